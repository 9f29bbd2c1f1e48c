// common.cuh: storage types, conversions and vector access shared by every
// kernel family.
//
// The kernels include no CUDA header at all: 16-bit floats are carried as
// their raw bits and converted with single PTX instructions. That keeps the
// compiled source a pure function of the files in this folder (the loader
// inlines them and hashes the result), and lets CI compile every kernel with
// NVRTC alone, without the CUDA include tree.
//
// Requires compute capability 8.0 or newer (cvt.rn.bf16.f32 is sm_80+).
#pragma once

namespace cunorm {

struct half_t { unsigned short bits; };  // IEEE binary16, raw bits
struct bf16_t { unsigned short bits; };  // bfloat16, raw bits
struct none_t {};                        // "no affine parameters" marker
// Y = none_t: a kernel with a y output that writes none (rows_cached's
// statistics alone)
template <class Y>
struct IsNone {
    static constexpr bool value = false;
};
template <>
struct IsNone<none_t> {
    static constexpr bool value = true;
};

// Accumulation type: float for 16- and 32-bit storage, double for float64.
template <class T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

template <class A, class B> struct same_type { static constexpr bool value = false; };
template <class A> struct same_type<A, A> { static constexpr bool value = true; };

// A 2-D thread layout over a 1-D block: thread (tx, ty) of bx x by is the
// one of linear index ty * bx + tx, as in a 2-D launch, so warps are made
// of the same threads. Every launch is 1-D (XLA's custom call, which
// cunorm/jax/_jit.py launches through, takes no other), and a kernel with a
// 2-D layout is told its bx (the block_x argument).
struct BlockLayout {
    int tx, ty, bx, by;
};
__device__ __forceinline__ BlockLayout block_layout(int block_x) {
    const int t = static_cast<int>(threadIdx.x);
    const int ty = t / block_x;
    return BlockLayout{t - ty * block_x, ty, block_x, static_cast<int>(blockDim.x) / block_x};
}

// widen: storage -> accumulation type. Exact for every storage type.
__device__ __forceinline__ float widen(half_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));
    return f;
}
__device__ __forceinline__ float widen(bf16_t b) {
    return __uint_as_float(static_cast<unsigned>(b.bits) << 16);
}
__device__ __forceinline__ float widen(float f) { return f; }
__device__ __forceinline__ double widen(double d) { return d; }

// narrow: accumulation type -> storage, round to nearest even (once, at the
// very end of each element's computation).
__device__ __forceinline__ void narrow(float f, half_t& out) {
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out.bits) : "f"(f));
}
__device__ __forceinline__ void narrow(float f, bf16_t& out) {
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out.bits) : "f"(f));
}
__device__ __forceinline__ void narrow(float f, float& out) { out = f; }
__device__ __forceinline__ void narrow(double d, double& out) { out = d; }

// A vector of N consecutive elements, aligned to its full size so that the
// compiler emits one 16-byte (or 8-, 4-byte) access for it. The planner only
// picks N > 1 when the base pointer, the strides and the extent allow it.
template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
    T v[N];
};

template <class T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
    return *reinterpret_cast<const Vec<T, N>*>(p);
}

// A vector store to global memory. A Vec of 16-bit elements built member by
// member (narrow() into each) was stored as N separate 2-byte stores in
// several kernels (the channels-last epilogue: 8x the store instructions,
// L2-bound at 19% of copy bandwidth; a residual's h in the split tier), and
// a union of 32-bit words still went word by word: the 8- and 16-byte
// stores of 16-bit data are spelled out.
template <class T, int N>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v) {
    constexpr int kBytes = static_cast<int>(sizeof(T)) * N;
    if constexpr (sizeof(T) == 2 && (kBytes == 16 || kBytes == 8)) {
        union {
            Vec<T, N> v;
            unsigned w[kBytes / 4];
        } u;
        u.v = v;
        if constexpr (kBytes == 16) {
            asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(u.w[0]), "r"(u.w[1]), "r"(u.w[2]),
                         "r"(u.w[3])
                         : "memory");
        } else {
            asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(u.w[0]), "r"(u.w[1]) : "memory");
        }
    } else {
        *reinterpret_cast<Vec<T, N>*>(p) = v;
    }
}

// Fetch the 128-byte line holding p into L2 (no register, nothing waits on
// it): the resident rows tier and the cached backward fetch their next row
// this way while working on the current one.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Acquire load of an arrival counter (the partials it guards are then
// visible).
__device__ __forceinline__ unsigned int load_acquire(const unsigned int* p) {
    unsigned int v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Release store of a flag (the writes before it are visible to an acquire
// load that sees it).
__device__ __forceinline__ void store_release(unsigned int* p, unsigned int v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Accesses with L2 hints, for the streamed walks: a last read that may be
// evicted first, and a store that should not push data still to be re-read
// out of L2 (ld/st.global.cs, "streaming"). 16-byte vectors take the hint;
// other widths are plain accesses.
template <class T, int N>
__device__ __forceinline__ Vec<T, N> load_vec_last_use(const T* p) {
    if constexpr (sizeof(T) * N == 16) {
        union {
            int4 raw;
            Vec<T, N> v;
        } u;
        u.raw = __ldcs(reinterpret_cast<const int4*>(p));
        return u.v;
    } else {
        return load_vec<T, N>(p);
    }
}
template <class T, int N>
__device__ __forceinline__ void store_vec_streaming(T* p, const Vec<T, N>& v) {
    if constexpr (sizeof(T) * N == 16) {
        union {
            int4 raw;
            Vec<T, N> v;
        } u;
        u.v = v;
        __stcs(reinterpret_cast<int4*>(p), u.raw);
    } else {
        store_vec<T, N>(p, v);
    }
}

// The two above chosen at run time by a walk's hints (1: streaming stores,
// 2: last-use loads), a value uniform across the launch.
template <class T, int N>
__device__ __forceinline__ Vec<T, N> load_vec_hinted(const T* p, int hints) {
    return (hints & 2) ? load_vec_last_use<T, N>(p) : load_vec<T, N>(p);
}
template <class T, int N>
__device__ __forceinline__ void store_vec_hinted(T* p, const Vec<T, N>& v, int hints) {
    if (hints & 1) store_vec_streaming<T, N>(p, v);
    else store_vec<T, N>(p, v);
}

// Elementwise epilogue shared by every family:
//   y = act((x - center) * scale [* weight] [+ bias])
// in the accumulation type, rounded once to the storage type. Subtracting
// the center before scaling keeps LayerNorm exact for rows whose mean is far
// larger than their spread (x*rstd - mean*rstd would cancel catastrophically).
template <class A>
struct Affine {
    A center;
    A scale;
};

// The FLAGS template argument: which affine parameters a kernel applies
// (kWeight, kBias), and how the epilogue rounds and ends:
//   kWeightOffset      the weight is read as 1 + weight (Gemma's RMSNorm)
//   kRoundNormalized   (x - center) * scale is rounded to the storage type
//                      before the weight multiplies (Llama's RMSNorm rounds
//                      there), then the product is rounded again
//   bits 4..6          the activation applied last (Activation), computed
//                      as torch computes it in float32
constexpr int kWeight = 1;
constexpr int kBias = 2;
constexpr int kWeightOffset = 4;
constexpr int kRoundNormalized = 8;
constexpr int kActivationShift = 4;
enum Activation { kIdentity = 0, kRelu = 1, kSilu = 2, kGelu = 3, kGeluTanh = 4 };

// v rounded to the storage type T and widened back (exact for float, double).
template <class T, class A>
__device__ __forceinline__ A rounded_to(A v) {
    T t;
    narrow(v, t);
    return static_cast<A>(widen(t));
}

// The activations, each with torch's formula and order of operations.
// ReLU keeps a NaN (as torch's clamp does).
template <int ACT, class A>
__device__ __forceinline__ A activate(A v) {
    if constexpr (ACT == kRelu) {
        return v < A(0) ? A(0) : v;
    } else if constexpr (ACT == kSilu) {
        return v / (A(1) + exp(-v));
    } else if constexpr (ACT == kGelu) {
        return v * A(0.5) * (A(1) + erf(v * A(0.70710678118654752440)));
    } else if constexpr (ACT == kGeluTanh) {
        const A inner = A(0.79788456080286535588) * (v + A(0.044715) * (v * v * v));
        return A(0.5) * v * (A(1) + tanh(inner));
    } else {
        return v;
    }
}

template <int FLAGS, class T, class A>
__device__ __forceinline__ A apply_affine(A x, const Affine<A>& f, A w, A b) {
    A v = (x - f.center) * f.scale;
    if constexpr ((FLAGS & kRoundNormalized) != 0) v = rounded_to<T>(v);
    if constexpr ((FLAGS & kWeightOffset) != 0) w = A(1) + w;
    if constexpr ((FLAGS & kWeight) && (FLAGS & kBias)) {
        v = fma(v, w, b);
    } else if constexpr (FLAGS & kWeight) {
        v = v * w;
    } else if constexpr (FLAGS & kBias) {
        v = v + b;
    }
    return activate<(FLAGS >> kActivationShift) & 7>(v);
}

// The affine parameters of one vector: VEC weights and/or biases in their
// storage type P (nothing at all when FLAGS names neither).
template <class P, int FLAGS, int VEC, bool ANY = (FLAGS & (kWeight | kBias)) != 0>
struct ParamVec {
    Vec<P, VEC> w;
    Vec<P, VEC> b;
};
template <class P, int FLAGS, int VEC>
struct ParamVec<P, FLAGS, VEC, false> {};

template <class P, int FLAGS, int VEC>
__device__ __forceinline__ ParamVec<P, FLAGS, VEC> load_params(const P* w, const P* b, long long i) {
    ParamVec<P, FLAGS, VEC> p;
    if constexpr (FLAGS & kWeight) p.w = load_vec<P, VEC>(w + i);
    if constexpr (FLAGS & kBias) p.b = load_vec<P, VEC>(b + i);
    return p;
}

template <class A, class P, int FLAGS, int VEC>
__device__ __forceinline__ A param_w(const ParamVec<P, FLAGS, VEC>& p, int j) {
    if constexpr (FLAGS & kWeight) return static_cast<A>(widen(p.w.v[j]));
    else return A(1);
}
template <class A, class P, int FLAGS, int VEC>
__device__ __forceinline__ A param_b(const ParamVec<P, FLAGS, VEC>& p, int j) {
    if constexpr (FLAGS & kBias) return static_cast<A>(widen(p.b.v[j]));
    else return A(0);
}

// epilogue(h[0:VEC] - pivot) with the parameters of those positions (pivot:
// the group's shift, 0 for unshifted norms), rounded to the output's
// storage type Y (T's, or float for a 16-bit T read and float32 written).
template <class T, class P, int FLAGS, int VEC, class A, class Y = T>
__device__ __forceinline__ Vec<Y, VEC> normalized(const Vec<T, VEC>& in, const ParamVec<P, FLAGS, VEC>& p,
                                                  const Affine<A>& f, A pivot) {
    Vec<Y, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        const A v = apply_affine<FLAGS, T>(static_cast<A>(widen(in.v[j])) - pivot, f, param_w<A>(p, j), param_b<A>(p, j));
        narrow(v, out.v[j]);
    }
    return out;
}

// y[0:VEC] = normalized(h[0:VEC]); y's storage type Y from dst.
template <class T, class P, int FLAGS, int VEC, class A, class Y>
__device__ __forceinline__ void write_normalized(Y* dst, const Vec<T, VEC>& in, const ParamVec<P, FLAGS, VEC>& p,
                                                 const Affine<A>& f, A pivot) {
    store_vec<Y, VEC>(dst, normalized<T, P, FLAGS, VEC, A, Y>(in, p, f, pivot));
}

// h = x + r, rounded to the storage type (the fused pre-norm residual add:
// the norm then sees exactly the h it returns).
template <class T, int VEC>
__device__ __forceinline__ Vec<T, VEC> add_residual(const Vec<T, VEC>& x, const Vec<T, VEC>& r) {
    Vec<T, VEC> h;
#pragma unroll
    for (int j = 0; j < VEC; ++j) narrow(widen(x.v[j]) + widen(r.v[j]), h.v[j]);
    return h;
}

}  // namespace cunorm
