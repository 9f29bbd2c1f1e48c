// stages.cuh: the load and store stages handed to every forward tier.
//
// A forward tier owns the reduction: how a group's elements are spread over
// threads, read, folded and combined into the statistic (an Affine: center
// and scale). What a tier reads for each element (LOAD) and what it writes
// for each normalized element (STORE) are template arguments, as OneFlow's
// LayerNorm tiers take LOAD and STORE functors. A tier calls its stages and
// tests no option, so a new input or output is a new stage, not a new
// branch in every tier.
//
// Load stages (the row family; the channel and strided families read x):
//   XLoad<T>          the vector of x at element e
//   ResidualLoad<T>   h = x + r, rounded to T and written out: the pre-norm
//                     transformer block's fused add (the norm then sees
//                     exactly the h it returns)
// Members: kResidual (r is read and h written: the tier keeps r's loads in
// flight, spends registers on them, and re-reads h rather than x);
// load<VEC>(x_row, r_row, h_row, e); combine<VEC>(x, r), the add alone, for
// tiers that issue every load of a row before using any.
//
// Store stages:
//   AffineStore<P, FLAGS, Y>  y = act((x - center) * scale [* w] [+ b]) in
//                             the accumulation type, rounded once to Y (x's
//                             type, or float for 16-bit x read and float32
//                             written); w and b stored as P, per element of
//                             a row or per channel
//   NoStore                   no y: the statistics alone (a jit program that
//                             never reads y)
// Members: Param and Out (the storage types of w, b and of y); kWritesY;
// kBare (nothing is read or computed beyond the scaling: a tier may spend
// those registers on holding more of the row); kParamBytes (parameter bytes
// read per element: a write batch's register budget); Params<VEC> with
// params<VEC>(w, b, e), params_hinted<VEC>(w, b, e, policy) and
// prefetch(w, b, e) for the parameters of row position e; Scalars<A> with
// channel<A>(w, b, c) and splat<VEC>(w, b, c) for channel c's; value<T>(x -
// pivot, f, scalars) for one element in the accumulation type and
// element<T>(..., out) for it stored as Out; apply<T, VEC>(in, params, f,
// pivot) for a vector of Out.
#pragma once
#include "common.cuh"

namespace cunorm {

// AffineStore's FLAGS: kWeight and kBias (common.cuh) name the parameters;
// the options say how the epilogue rounds and ends:
//   kWeightOffset      the weight is read as 1 + weight (Gemma's RMSNorm)
//   kRoundNormalized   (x - center) * scale is rounded to x's storage type
//                      before the weight multiplies (Llama's RMSNorm rounds
//                      there), then the product is rounded again
//   bits 4..6          the activation applied last (Activation), computed
//                      as torch computes it in float32
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

// The parameters of one vector: VEC weights and/or biases in their storage
// type P (nothing at all when there are none).
template <class P, bool WEIGHT, bool BIAS, int VEC, bool ANY = WEIGHT || BIAS>
struct ParamVec {
    Vec<P, VEC> w;
    Vec<P, VEC> b;
};
template <class P, bool WEIGHT, bool BIAS, int VEC>
struct ParamVec<P, WEIGHT, BIAS, VEC, false> {};

template <class P, int FLAGS, class Y>
struct AffineStore {
    using Param = P;
    using Out = Y;
    static constexpr bool kHasWeight = (FLAGS & kWeight) != 0;
    static constexpr bool kHasBias = (FLAGS & kBias) != 0;
    static constexpr bool kWritesY = true;
    static constexpr bool kBare = FLAGS == 0;
    static constexpr int kParamBytes = ((kHasWeight ? 1 : 0) + (kHasBias ? 1 : 0)) * static_cast<int>(sizeof(P));

    template <int VEC>
    using Params = ParamVec<P, kHasWeight, kHasBias, VEC>;
    template <class A>
    struct Scalars {
        A w, b;
    };

    template <int VEC>
    __device__ __forceinline__ static Params<VEC> params(const P* w, const P* b, long long e) {
        Params<VEC> p;
        if constexpr (kHasWeight) p.w = load_vec<P, VEC>(w + e);
        if constexpr (kHasBias) p.b = load_vec<P, VEC>(b + e);
        return p;
    }
    template <int VEC>
    __device__ __forceinline__ static Params<VEC> params_hinted(const P* w, const P* b, long long e,
                                                                unsigned long long policy) {
        Params<VEC> p;
        if constexpr (kHasWeight) p.w = load_vec_hint<P, VEC>(w + e, policy);
        if constexpr (kHasBias) p.b = load_vec_hint<P, VEC>(b + e, policy);
        return p;
    }
    // The 128-byte lines of the parameters at e into L2.
    __device__ __forceinline__ static void prefetch(const P* w, const P* b, long long e) {
        if constexpr (kHasWeight) prefetch_l2(w + e);
        if constexpr (kHasBias) prefetch_l2(b + e);
    }
    template <class A>
    __device__ __forceinline__ static Scalars<A> channel(const P* w, const P* b, long long c) {
        Scalars<A> s{A(1), A(0)};
        if constexpr (kHasWeight) s.w = static_cast<A>(widen(w[c]));
        if constexpr (kHasBias) s.b = static_cast<A>(widen(b[c]));
        return s;
    }
    // Every element of the vector takes channel c's parameters.
    template <int VEC>
    __device__ __forceinline__ static Params<VEC> splat(const P* w, const P* b, long long c) {
        Params<VEC> p;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            if constexpr (kHasWeight) p.w.v[j] = w[c];
            if constexpr (kHasBias) p.b.v[j] = b[c];
        }
        return p;
    }

    // One element: shifted is x - pivot; T is x's storage type (the
    // rounding point of kRoundNormalized).
    template <class T, class A>
    __device__ __forceinline__ static A value(A shifted, const Affine<A>& f, Scalars<A> s) {
        A v = (shifted - f.center) * f.scale;
        if constexpr ((FLAGS & kRoundNormalized) != 0) v = rounded_to<T>(v);
        if constexpr ((FLAGS & kWeightOffset) != 0) s.w = A(1) + s.w;
        if constexpr (kHasWeight && kHasBias) {
            v = fma(v, s.w, s.b);
        } else if constexpr (kHasWeight) {
            v = v * s.w;
        } else if constexpr (kHasBias) {
            v = v + s.b;
        }
        return activate<(FLAGS >> kActivationShift) & 7>(v);
    }

    // One element of y: value() rounded to Out.
    template <class T, class A>
    __device__ __forceinline__ static void element(A shifted, const Affine<A>& f, Scalars<A> s, Y& out) {
        narrow(value<T>(shifted, f, s), out);
    }

    // in[0:VEC] - pivot normalized with the parameters of those positions,
    // rounded to Out.
    template <class T, int VEC, class A>
    __device__ __forceinline__ static Vec<Y, VEC> apply(const Vec<T, VEC>& in, const Params<VEC>& p,
                                                        const Affine<A>& f, A pivot) {
        Vec<Y, VEC> out;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const A shifted = static_cast<A>(widen(in.v[j])) - pivot;
            Scalars<A> s{A(1), A(0)};
            if constexpr (kHasWeight) s.w = static_cast<A>(widen(p.w.v[j]));
            if constexpr (kHasBias) s.b = static_cast<A>(widen(p.b.v[j]));
            element<T>(shifted, f, s, out.v[j]);
        }
        return out;
    }
};

struct NoStore {
    using Param = none_t;
    using Out = none_t;
    static constexpr bool kWritesY = false;
    static constexpr bool kBare = true;
    static constexpr int kParamBytes = 0;
};

// h = x + r, rounded to the storage type (the norm then sees exactly the h
// it returns).
template <class T, int VEC>
__device__ __forceinline__ Vec<T, VEC> add_residual(const Vec<T, VEC>& x, const Vec<T, VEC>& r) {
    Vec<T, VEC> h;
#pragma unroll
    for (int j = 0; j < VEC; ++j) narrow(widen(x.v[j]) + widen(r.v[j]), h.v[j]);
    return h;
}

template <class T>
struct XLoad {
    static constexpr bool kResidual = false;
    template <int VEC>
    __device__ __forceinline__ static Vec<T, VEC> load(const T* x_row, const T*, T*, long long e) {
        return load_vec<T, VEC>(x_row + e);
    }
    template <int VEC>
    __device__ __forceinline__ static Vec<T, VEC> combine(const Vec<T, VEC>& x, const Vec<T, VEC>&) {
        return x;
    }
};

template <class T>
struct ResidualLoad {
    static constexpr bool kResidual = true;
    template <int VEC>
    __device__ __forceinline__ static Vec<T, VEC> load(const T* x_row, const T* r_row, T* h_row, long long e) {
        const Vec<T, VEC> v = add_residual<T, VEC>(load_vec<T, VEC>(x_row + e), load_vec<T, VEC>(r_row + e));
        store_vec<T, VEC>(h_row + e, v);
        return v;
    }
    template <int VEC>
    __device__ __forceinline__ static Vec<T, VEC> combine(const Vec<T, VEC>& x, const Vec<T, VEC>& r) {
        return add_residual<T, VEC>(x, r);
    }
};

}  // namespace cunorm
