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
struct none_t {};                        // "nothing here": no parameters, no y

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

// Element j of a vector in the accumulation type, as widen(v.v[j]). A
// bfloat16 pair shares a 32-bit register, and its high element is the
// register's high half as it stands: one AND, where widening the element
// on its own moves it down first (two instructions). Widenings are a
// quarter of LayerNorm's bf16 instructions (docs/notes/rows.md).
template <class T, int N>
__device__ __forceinline__ auto widen_at(const Vec<T, N>& v, int j) {
    if constexpr (same_type<T, bf16_t>::value && N % 2 == 0) {
        union {
            Vec<T, N> v;
            unsigned w[N / 2];
        } u;
        u.v = v;
        const unsigned word = u.w[j / 2];
        return __uint_as_float(j % 2 == 0 ? word << 16 : word & 0xffff0000u);
    } else {
        return widen(v.v[j]);
    }
}

template <class T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
    return *reinterpret_cast<const Vec<T, N>*>(p);
}

// A vector store to global memory. A Vec of 16-bit elements built member by
// member (narrow() into each) was stored as N separate 2-byte stores in
// several kernels (the channels-last epilogue: 8x the store instructions,
// L2-bound at 19% of copy bandwidth; a residual's h in the split tier), and
// a union of 32-bit words still went word by word: the 4-, 8- and 16-byte
// stores of 1- and 2-byte data are spelled out.
template <class T, int N>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v) {
    constexpr int kBytes = static_cast<int>(sizeof(T)) * N;
    if constexpr (sizeof(T) == 1 && kBytes == 4) {  // (a quantizing store's one-byte elements)
        union {
            Vec<T, N> v;
            unsigned w;
        } u;
        u.v = v;
        asm volatile("st.global.b32 [%0], %1;" ::"l"(p), "r"(u.w) : "memory");
    } else if constexpr (sizeof(T) <= 2 && (kBytes == 16 || kBytes == 8)) {
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
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }
// The number of SM identifiers of the device (at least its SM count).
__device__ __forceinline__ unsigned int sm_ids() {
    unsigned int n;
    asm("mov.u32 %0, %%nsmid;" : "=r"(n));
    return n;
}

// Programmatic dependent launch (sm_90). A Program launches each step after
// its first with programmatic stream serialization (cunorm/_engine/launches.py),
// so the step's blocks may be placed while the step before it finishes. Every
// kernel opens with this: the wait returns once the grid before it on the
// stream has completed and its writes are visible, so nothing is read or
// written early; the trigger then lets the grid after it be placed, once
// every block of this one has passed here. Without the launch attribute, and
// before sm_90, it does nothing.
__device__ __forceinline__ void grid_dependency_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

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

// A group's statistic as the epilogue applies it: y = (x - center) * scale,
// then the store stage's parameters and options (stages.cuh). Subtracting
// the center before scaling keeps LayerNorm exact for rows whose mean is far
// larger than their spread (x*rstd - mean*rstd would cancel catastrophically).
template <class A>
struct Affine {
    A center;
    A scale;
};

// Which affine parameters apply (the low bits of a store stage's FLAGS, and
// the parameter gradients the backward kernels form).
constexpr int kWeight = 1;
constexpr int kBias = 2;

// L2 eviction policies (sm_80+): the resident tier marks the data it streams
// (x in, y out) evict-first and the parameters it re-reads for every row
// evict-last, so 32 MB of weight and bias stay in L2 across rows.
__device__ __forceinline__ unsigned long long l2_policy_evict_first() {
    unsigned long long p;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    return p;
}
__device__ __forceinline__ unsigned long long l2_policy_evict_last() {
    unsigned long long p;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
    return p;
}

// A vector load / store with an L2 policy, word by word (4-byte words; the
// 2-byte vectors of half/bf16 VEC=1 go without a hint).
template <class T, int N>
__device__ __forceinline__ Vec<T, N> load_vec_hint(const T* p, unsigned long long policy) {
    constexpr int kBytes = sizeof(T) * N;
    if constexpr (kBytes % 4 != 0) {
        return load_vec<T, N>(p);
    } else {
        union { Vec<T, N> v; unsigned u[kBytes / 4]; } r;
        const unsigned* src = reinterpret_cast<const unsigned*>(p);
        if constexpr (kBytes >= 16) {
#pragma unroll
            for (int k = 0; k < kBytes / 16; ++k) {
                asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                             : "=r"(r.u[4 * k]), "=r"(r.u[4 * k + 1]), "=r"(r.u[4 * k + 2]), "=r"(r.u[4 * k + 3])
                             : "l"(src + 4 * k), "l"(policy));
            }
        } else {
#pragma unroll
            for (int k = 0; k < kBytes / 4; ++k) {
                asm volatile("ld.global.L2::cache_hint.u32 %0, [%1], %2;" : "=r"(r.u[k]) : "l"(src + k), "l"(policy));
            }
        }
        return r.v;
    }
}

template <class T, int N>
__device__ __forceinline__ void store_vec_hint(T* p, const Vec<T, N>& v, unsigned long long policy) {
    constexpr int kBytes = sizeof(T) * N;
    if constexpr (kBytes % 16 != 0) {
        store_vec<T, N>(p, v);
    } else {
        union { Vec<T, N> v; unsigned u[kBytes / 4]; } r;
        r.v = v;
        unsigned* dst = reinterpret_cast<unsigned*>(p);
#pragma unroll
        for (int k = 0; k < kBytes / 16; ++k) {
            asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(dst + 4 * k),
                         "r"(r.u[4 * k]), "r"(r.u[4 * k + 1]), "r"(r.u[4 * k + 2]), "r"(r.u[4 * k + 3]), "l"(policy)
                         : "memory");
        }
    }
}

// Wait until at most `left` of this thread's cp.async groups are pending
// (an immediate operand: `left` must fold to a constant, below 4).
__device__ __forceinline__ void cp_async_wait_parts_left(int left) {
    if (left == 0) asm volatile("cp.async.wait_group 0;" ::: "memory");
    else if (left == 1) asm volatile("cp.async.wait_group 1;" ::: "memory");
    else if (left == 2) asm volatile("cp.async.wait_group 2;" ::: "memory");
    else asm volatile("cp.async.wait_group 3;" ::: "memory");
}

// Asynchronous copy global -> shared of one vector (4, 8 or 16 bytes,
// sm_80+): no register staging, so a thread can have its whole share of a
// chunk in flight at once. HINTED 16-byte copies carry an L2 policy.
// rows_uncached's stash copies go without: hinted, in four commit groups,
// they raised an illegal-instruction fault at the copy on the H200
// (compute-sanitizer; two groups, or no hint, ran clean).
template <int BYTES, bool HINTED = false>
__device__ __forceinline__ void copy_async(void* shared_dst, const void* global_src,
                                           unsigned long long policy = 0) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(shared_dst));
    if constexpr (BYTES == 16 && HINTED) {
        asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(dst), "l"(global_src),
                     "l"(policy)
                     : "memory");
    } else if constexpr (BYTES == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(global_src) : "memory");
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(dst), "l"(global_src), "n"(BYTES) : "memory");
    }
}
__device__ __forceinline__ void copy_async_wait_all() {
    asm volatile("cp.async.commit_group;" ::: "memory");
    asm volatile("cp.async.wait_group 0;" ::: "memory");
}

}  // namespace cunorm
