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
//   ScaledResidualLoad<T, G>
//                     h = r + g * x, g stored as G (adaLN-Zero's gated
//                     residual: g a row of a per-sample or per-token
//                     array), formed in the accumulation type and rounded
//                     once to T, written out (rows_cached only)
//   WideResidualLoad<T, R>
//                     h = x + r with r and h stored as R (float32 for
//                     16-bit x: the float32 residual stream), formed in
//                     R and held as the row (kWide; rows_cached only)
// Members: kResidual (r is read and h written: the tier keeps r's loads in
// flight, spends registers on them, and re-reads h rather than x); kWide
// and Residual (r's and h's storage type: T but for the wide stream); kScaled
// and Gate (a gate g is read, of type Gate, the row's from gate_row());
// load<VEC>(x_row, r_row, h_row, e); combine<VEC>(x, r), the add alone, for
// tiers that issue every load of a row before using any.
//
// Store stages:
//   AffineStore<P, FLAGS, Y>  y = act((x - center) * scale [* w] [+ b]) in
//                             the accumulation type, rounded once to Y (x's
//                             type, or float for 16-bit x read and float32
//                             written); w and b stored as P, per element of
//                             a row or per channel
//   QuantStore<P, FLAGS, Q, SCALING, GROUP>
//                             AffineStore's value over a scale, rounded and
//                             saturated to a one-byte Q (quant_store.cuh)
//   NoStore                   no y: the statistics alone (a jit program that
//                             never reads y)
// AffineStore's FLAGS may also ask for per-row operands (rows_cached only):
// kParamRows (row r reads row r % param_rows of a (param_rows, n) weight
// and bias: per-head weights) and kShift / kScale (the modulation of
// adaLN: y = act((affine) * (1 + scale) + shift), shift and scale rows of
// a per-sample or per-token array stored as P). A tier that takes them
// forms the row's operands once (row(): the parameters' and the
// modulation's rows) and reads a vector's with params(row, e); kRowParams
// says whether those differ from row to row. kGate and
// kGateInput (the gated RMSNorm, rows_cached only): a gate z of x's shape,
// stored as Y (Gate), read beside x; kGate alone multiplies the affine
// value by silu(z), z handed in with the vector's parameters
// (Params::gate); kGateInput makes x * silu(z) the norm's input
// (gated_input: the tier folds it, holds it and stores apply_formed's).
// Members: Param and Out (the storage types of w, b and of y); kWritesY;
// kBare (nothing is read or computed beyond the scaling: a tier may spend
// those registers on holding more of the row); kParamBytes (parameter bytes
// read per element: a write batch's register budget); Params<VEC> with
// params<VEC>(w, b, e), params_hinted<VEC>(w, b, e, policy) and
// prefetch(w, b, e) for the parameters of row position e; Scalars<A> with
// channel<A>(w, b, c) and splat<VEC>(w, b, c) for channel c's; value<T>(x -
// pivot, f, scalars) for one element in the accumulation type and
// element<T>(..., out) for it stored as Out; apply<T, VEC>(in, params, f,
// pivot) for a vector of Out (scalars_at<A>(params, j): element j's).
// kQuantized, Scale, kRowScale, kGroup, static_scale(quant_scale),
// amax<T>(in, params, f, pivot) and row_scale(amax, quant_scale): a store
// whose values are divided by a scale (QuantStore) says so; a tier that
// takes one forms the row's (or each group's: kGroup elements) scale before
// it stores (rows_cached) and hands it to apply(..., scale).
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
//   kParamRows         the parameters repeat every param_rows rows (row r
//                      reads row r % param_rows of them: per-head weights)
//   kShift, kScale     the modulation v * (1 + scale) + shift after the
//                      affine and before the activation, both per element
//                      of the row's modulation row (row / mod_div %
//                      mod_count of a (mod_count, n) array)
//   kGate              v * silu(z) after the affine (Qwen3-Next's and
//                      Mamba's norm_before_gate=True); with
//                      kRoundNormalized and a weight stored as Y, the
//                      product w * v is rounded to Y first, as
//                      `weight * h.to(dtype)` is before the gate multiplies
//   kGateInput         with kGate: the norm's input is x * silu(z) in the
//                      accumulation type, never rounded (norm_before_gate=False)
constexpr int kWeightOffset = 4;
constexpr int kRoundNormalized = 8;
constexpr int kActivationShift = 4;
constexpr int kParamRows = 128;
constexpr int kShift = 256;
constexpr int kScale = 512;
constexpr int kGate = 2048;
constexpr int kGateInput = 4096;

// A if C, else B.
template <bool C, class A, class B>
struct Select {
    using type = A;
};
template <class A, class B>
struct Select<false, A, B> {
    using type = B;
};
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
        // float: the division approximate (__fdividef, within 2 ulp; 0 past
        // a denominator of 2^126, where z / (1 + exp(-z)) is below 2^-119):
        // the IEEE division's ten instructions an element are a quarter of
        // the gated norm's over heads of 128 (docs/notes/conditioned.md)
        if constexpr (same_type<A, float>::value) {
            return __fdividef(v, 1.0f + exp(-v));
        } else {
            return v / (A(1) + exp(-v));
        }
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

// The parameters and the modulation of one vector.
template <class P, bool WEIGHT, bool BIAS, int VEC>
struct ModulatedParamVec : ParamVec<P, WEIGHT, BIAS, VEC> {
    Vec<P, VEC> shift;
    Vec<P, VEC> scale;
};

// The parameters and the gate z of one vector.
template <class P, bool WEIGHT, bool BIAS, class G, int VEC>
struct GatedParamVec : ParamVec<P, WEIGHT, BIAS, VEC> {
    Vec<G, VEC> gate;
};

// The row of a per-sample or per-token array that row r reads: r / div % count.
__device__ __forceinline__ long long broadcast_row(long long row, long long div, long long count) {
    return (row / div) % count;
}

template <class P, int FLAGS, class Y>
struct AffineStore {
    using Param = P;
    using Out = Y;
    static constexpr bool kHasWeight = (FLAGS & kWeight) != 0;
    static constexpr bool kHasBias = (FLAGS & kBias) != 0;
    static constexpr bool kHasShift = (FLAGS & kShift) != 0;
    static constexpr bool kHasScale = (FLAGS & kScale) != 0;
    static constexpr bool kModulated = kHasShift || kHasScale;
    static constexpr bool kGated = (FLAGS & kGate) != 0;
    static constexpr bool kGatedInput = (FLAGS & kGateInput) != 0;
    static_assert(!kGatedInput || kGated, "kGateInput comes with kGate");
    static_assert(!kGated || !kModulated, "a gate or a modulation, not both");
    static constexpr bool kGateAfter = kGated && !kGatedInput;  // silu(z) multiplies y: z in the Params
    using Gate = typename Select<kGated, Y, none_t>::type;
    static constexpr bool kPerRow = (FLAGS & (kParamRows | kShift | kScale | kGate)) != 0;  // (rows_cached only)
    // params(row(...), e) differs from row to row (per-head weights, a modulation)
    static constexpr bool kRowParams = (FLAGS & (kParamRows | kShift | kScale)) != 0;
    static constexpr bool kWritesY = true;
    static constexpr bool kBare = FLAGS == 0;
    static constexpr bool kActivated = ((FLAGS >> kActivationShift) & 7) != 0;
    static constexpr int kParamBytes =
        ((kHasWeight ? 1 : 0) + (kHasBias ? 1 : 0) + (kHasShift ? 1 : 0) + (kHasScale ? 1 : 0)) *
        static_cast<int>(sizeof(P));

    template <int VEC>
    using Params = typename Select<
        kGateAfter, GatedParamVec<P, kHasWeight, kHasBias, Gate, VEC>,
        typename Select<kModulated, ModulatedParamVec<P, kHasWeight, kHasBias, VEC>,
                        ParamVec<P, kHasWeight, kHasBias, VEC>>::type>::type;
    template <class A>
    struct Scalars {
        A w, b, shift, scale, gate;
    };

    // One row's operands: its parameters' row and its modulation's row.
    struct Row {
        const P* w;
        const P* b;
        const P* shift;
        const P* scale;
    };
    __device__ __forceinline__ static Row row(const P* w, const P* b, const P* shift, const P* scale, long long r,
                                              int n, long long param_rows, long long mod_div, long long mod_count) {
        Row o{w, b, shift, scale};
        if constexpr ((FLAGS & kParamRows) != 0) {
            const long long at = (r % param_rows) * n;
            if constexpr (kHasWeight) o.w += at;
            if constexpr (kHasBias) o.b += at;
        }
        if constexpr (kModulated) {
            const long long at = broadcast_row(r, mod_div, mod_count) * n;
            if constexpr (kHasShift) o.shift += at;
            if constexpr (kHasScale) o.scale += at;
        }
        return o;
    }
    template <int VEC>
    __device__ __forceinline__ static Params<VEC> params(const Row& o, long long e) {
        Params<VEC> p;
        if constexpr (kHasWeight) p.w = load_vec<P, VEC>(o.w + e);
        if constexpr (kHasBias) p.b = load_vec<P, VEC>(o.b + e);
        if constexpr (kHasShift) p.shift = load_vec<P, VEC>(o.shift + e);
        if constexpr (kHasScale) p.scale = load_vec<P, VEC>(o.scale + e);
        return p;
    }

    template <int VEC>
    __device__ __forceinline__ static Params<VEC> params(const P* w, const P* b, long long e) {
        static_assert(!kPerRow, "per-row operands: params(row(...), e)");
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
    // The 128-byte lines of the parameters at e into L2 (or L1).
    template <bool L1 = false>
    __device__ __forceinline__ static void prefetch(const P* w, const P* b, long long e) {
        if constexpr (kHasWeight) L1 ? prefetch_l1(w + e) : prefetch_l2(w + e);
        if constexpr (kHasBias) L1 ? prefetch_l1(b + e) : prefetch_l2(b + e);
    }
    template <class A>
    __device__ __forceinline__ static Scalars<A> channel(const P* w, const P* b, long long c) {
        Scalars<A> s{A(1), A(0), A(0), A(0), A(0)};
        if constexpr (kHasWeight) s.w = static_cast<A>(widen(w[c]));
        if constexpr (kHasBias) s.b = static_cast<A>(widen(b[c]));
        return s;
    }
    // The parameters of element j of a vector.
    template <class A, class PV>
    __device__ __forceinline__ static Scalars<A> scalars_at(const PV& p, int j) {
        Scalars<A> s{A(1), A(0), A(0), A(0), A(0)};
        if constexpr (kHasWeight) s.w = static_cast<A>(widen_at(p.w, j));
        if constexpr (kHasBias) s.b = static_cast<A>(widen_at(p.b, j));
        if constexpr (kHasShift) s.shift = static_cast<A>(widen_at(p.shift, j));
        if constexpr (kHasScale) s.scale = static_cast<A>(widen_at(p.scale, j));
        if constexpr (kGateAfter) s.gate = static_cast<A>(widen_at(p.gate, j));
        return s;
    }
    // The norm's input vector with kGateInput: x * silu(z) in A, never
    // rounded; the tier folds it and holds it for apply_formed (silu once
    // an element: twice made the gated norm compute-bound).
    template <class A, class T, int VEC>
    __device__ __forceinline__ static Vec<A, VEC> gated_input(const Vec<T, VEC>& x, const Vec<Gate, VEC>& z) {
        Vec<A, VEC> v;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            v.v[j] = static_cast<A>(widen_at(x, j)) * activate<kSilu>(static_cast<A>(widen_at(z, j)));
        }
        return v;
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
        if constexpr (kGateAfter) {
            if constexpr ((FLAGS & kRoundNormalized) != 0 && kHasWeight && same_type<P, Y>::value && sizeof(Y) == 2) {
                v = rounded_to<Y>(v);
            }
            v = v * activate<kSilu>(s.gate);
        }
        if constexpr (kHasShift && kHasScale) {
            v = fma(v, A(1) + s.scale, s.shift);
        } else if constexpr (kHasScale) {
            v = v * (A(1) + s.scale);
        } else if constexpr (kHasShift) {
            v = v + s.shift;
        }
        return activate<(FLAGS >> kActivationShift) & 7>(v);
    }

    // One element of y: value() rounded to Out.
    template <class T, class A>
    __device__ __forceinline__ static void element(A shifted, const Affine<A>& f, Scalars<A> s, Y& out) {
        narrow(value<T>(shifted, f, s), out);
    }

    // No scale: y is stored as it is formed.
    struct Scale {};
    static constexpr bool kQuantized = false;
    static constexpr bool kRowScale = false;
    static constexpr int kGroup = 0;
    __device__ __forceinline__ static Scale static_scale(const float*) { return Scale{}; }

    // in[0:VEC] - pivot normalized with the parameters of those positions,
    // rounded to Out.
    template <class T, int VEC, class A>
    __device__ __forceinline__ static Vec<Y, VEC> apply(const Vec<T, VEC>& in, const Params<VEC>& p,
                                                        const Affine<A>& f, A pivot, Scale = Scale{}) {
        Vec<Y, VEC> out;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const A shifted = static_cast<A>(widen_at(in, j)) - pivot;
            element<T>(shifted, f, scalars_at<A>(p, j), out.v[j]);
        }
        return out;
    }
    // apply() of inputs formed in the accumulation type (gated_input's).
    template <class T, int VEC, class A>
    __device__ __forceinline__ static Vec<Y, VEC> apply_formed(const Vec<A, VEC>& in, const Params<VEC>& p,
                                                               const Affine<A>& f, A pivot) {
        Vec<Y, VEC> out;
#pragma unroll
        for (int j = 0; j < VEC; ++j) element<T>(in.v[j] - pivot, f, scalars_at<A>(p, j), out.v[j]);
        return out;
    }
};

// A quantizing store's y also as the plain store writes it (x's type,
// rounded once), where the caller asked for it (y_plain not null: a
// uniform branch); nothing for the other stores.
template <class STORE, class T, int VEC, class A>
__device__ __forceinline__ void store_plain(T* y_plain, long long at, const Vec<T, VEC>& in,
                                            const typename STORE::template Params<VEC>& p, const Affine<A>& f,
                                            A pivot) {
    if constexpr (STORE::kQuantized) {
        if (y_plain != nullptr) {
            store_vec(y_plain + at, STORE::template Plain<T>::template apply<T>(in, p, f, pivot));
        }
    }
}

struct NoStore {
    using Param = none_t;
    using Out = none_t;
    using Gate = none_t;
    static constexpr bool kGated = false;
    static constexpr bool kGatedInput = false;
    struct Row {};
    __device__ __forceinline__ static Row row(const none_t*, const none_t*, const none_t*, const none_t*, long long,
                                              int, long long, long long, long long) {
        return Row{};
    }
    struct Scale {};
    static constexpr bool kQuantized = false;
    static constexpr bool kRowScale = false;
    static constexpr int kGroup = 0;
    __device__ __forceinline__ static Scale static_scale(const float*) { return Scale{}; }
    static constexpr bool kWritesY = false;
    static constexpr bool kPerRow = false;
    static constexpr bool kRowParams = false;
    static constexpr bool kBare = true;
    static constexpr bool kActivated = false;
    static constexpr int kParamBytes = 0;
};

// h = x + r, rounded to the storage type (the norm then sees exactly the h
// it returns).
template <class T, int VEC>
__device__ __forceinline__ Vec<T, VEC> add_residual(const Vec<T, VEC>& x, const Vec<T, VEC>& r) {
    Vec<T, VEC> h;
#pragma unroll
    for (int j = 0; j < VEC; ++j) narrow(widen_at(x, j) + widen_at(r, j), h.v[j]);
    return h;
}

template <class T>
struct XLoad {
    static constexpr bool kResidual = false;
    static constexpr bool kScaled = false;
    static constexpr bool kWide = false;
    using Gate = none_t;
    using Residual = T;
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
    static constexpr bool kScaled = false;
    static constexpr bool kWide = false;
    using Gate = none_t;
    using Residual = T;
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

// h = r + g * x in the accumulation type, rounded once to T; g the row's
// gate (gate_row: a row of a per-sample or per-token (count, n) array).
template <class T, class G>
struct ScaledResidualLoad {
    static constexpr bool kResidual = true;
    static constexpr bool kScaled = true;
    static constexpr bool kWide = false;
    using Gate = G;
    using Residual = T;
    using A = typename AccOf<T>::type;
    __device__ __forceinline__ static const G* gate_row(const G* g, long long row, int n, long long div,
                                                        long long count) {
        return g + broadcast_row(row, div, count) * n;
    }
    template <int VEC>
    __device__ __forceinline__ static Vec<T, VEC> combine(const Vec<T, VEC>& x, const Vec<T, VEC>& r,
                                                          const Vec<G, VEC>& g) {
        Vec<T, VEC> h;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            narrow(fma(static_cast<A>(widen_at(g, j)), static_cast<A>(widen_at(x, j)), static_cast<A>(widen_at(r, j))),
                   h.v[j]);
        }
        return h;
    }
};

// h = x + r with r and h stored as R, the accumulation type of 16-bit x
// (the float32 residual stream): formed in R, never rounded to T, written
// out as R and held as the row's values (rows_cached only: it folds them
// and stores y from them with apply_formed).
template <class T, class R>
struct WideResidualLoad {
    static constexpr bool kResidual = true;
    static constexpr bool kScaled = false;
    static constexpr bool kWide = true;
    using Gate = none_t;
    using Residual = R;
    static_assert(same_type<R, typename AccOf<T>::type>::value, "r and h in x's accumulation type");
    template <int VEC>
    __device__ __forceinline__ static Vec<R, VEC> combine_wide(const Vec<T, VEC>& x, const Vec<R, VEC>& r) {
        Vec<R, VEC> h;
#pragma unroll
        for (int j = 0; j < VEC; ++j) h.v[j] = static_cast<R>(widen_at(x, j)) + r.v[j];
        return h;
    }
};

}  // namespace cunorm
