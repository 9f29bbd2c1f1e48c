// grads.cuh: the gradient policies, one for each forward policy of
// norms.cuh. Every backward is, like every forward, a reduction over the
// group followed by an elementwise epilogue:
//
//   g  = dy * weight                       (weight 1 when there is none)
//   dx = scale * g + offset + slope * phi(x)   [+ dh, the gradient that
//                                               reached h = x + residual]
//
// where the group's reduction gives offset and slope (GradCoeffs). The
// policies:
//   RmsGrad     rstd saved by the forward: xhat = x * rstd,
//               dx = rstd * (g - xhat * mean(g * xhat))
//   LayerGrad   mean and rstd saved: xhat = (x - mean) * rstd,
//               dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
//   LpGrad      the Lp norms (normalize): the norm is recomputed from x in
//               the same reduction (it is one more running sum over data
//               the backward reads anyway, so nothing is saved), with
//               s = 1 / max(norm, eps):
//               dx = s * dy - s^2 * sum(dy * x) * dnorm/dx
//               where norm >= eps, s * dy where the clamp holds
//   LinfGrad    L-infinity: as LpGrad with dnorm/dx = sign(x) on the
//               elements of largest magnitude, shared evenly between ties
//               (as torch's max backward does), 0 elsewhere
// The statistic is a monoid like the forward's (init, combine, shfl_xor),
// so reduce.cuh's group_reduce and block_reduce combine it in their fixed
// order: gradients are bitwise reproducible run to run.
#pragma once
#include "reduce.cuh"

namespace cunorm {

template <class A>
struct GradCoeffs {
    A scale;   // the forward's scale: rstd, or 1 / max(norm, eps)
    A center;  // the forward's center: LayerNorm's mean, 0 otherwise
    A offset;
    A slope;
    A level;  // LinfGrad: the largest magnitude (phi's test)
};
constexpr int kCoeffWords = 5;  // GradCoeffs in a workspace

template <class A>
__device__ __forceinline__ void store_coeffs(A* dst, const GradCoeffs<A>& c) {
    dst[0] = c.scale;
    dst[1] = c.center;
    dst[2] = c.offset;
    dst[3] = c.slope;
    dst[4] = c.level;
}
template <class A>
__device__ __forceinline__ GradCoeffs<A> load_coeffs(const A* src) {
    return GradCoeffs<A>{src[0], src[1], src[2], src[3], src[4]};
}

// Two running sums (a, b).
template <class A>
struct PairSum {
    struct Stats {
        A a;
        A b;
    };
    static constexpr int kStatWords = 2;
    static constexpr bool kCheapCombine = true;  // block_reduce: every thread adds the warps' sums
    __device__ static __forceinline__ Stats init() { return Stats{A(0), A(0)}; }
    __device__ static __forceinline__ Stats combine(const Stats& x, const Stats& y) {
        return Stats{x.a + y.a, x.b + y.b};
    }
    __device__ static __forceinline__ Stats shfl_xor(const Stats& s, int mask, int width) {
        return Stats{shfl_xor_acc(s.a, mask, width), shfl_xor_acc(s.b, mask, width)};
    }
    __device__ static __forceinline__ void store(A* dst, const Stats& s) {
        dst[0] = s.a;
        dst[1] = s.b;
    }
    __device__ static __forceinline__ Stats load(const A* src) { return Stats{src[0], src[1]}; }
};

// RMSNorm: b = sum g * x (sum g * xhat = rstd * b: the constant factor
// leaves the per-element loop).
template <class A>
struct RmsGrad : PairSum<A> {
    using Stats = typename PairSum<A>::Stats;
    static constexpr bool kSaved = true;  // reads the forward's statistics
    __device__ static __forceinline__ Stats accumulate(const Stats& s, A x, A g, A, A) {
        return Stats{s.a, fma(g, x, s.b)};
    }
    __device__ static __forceinline__ GradCoeffs<A> coeffs(const Stats& s, long long n, A, A, A scale) {
        return GradCoeffs<A>{scale, A(0), A(0), -scale * scale * (scale * s.b) * reciprocal(static_cast<A>(n)), A(0)};
    }
    __device__ static __forceinline__ A phi(A x, const GradCoeffs<A>&) { return x; }
};

// LayerNorm: a = sum g, b = sum g * (x - mean) (x - mean, not x: no
// cancellation for rows whose mean is far above their spread; sum g * xhat
// = rstd * b).
template <class A>
struct LayerGrad : PairSum<A> {
    using Stats = typename PairSum<A>::Stats;
    static constexpr bool kSaved = true;
    __device__ static __forceinline__ Stats accumulate(const Stats& s, A x, A g, A center, A) {
        return Stats{s.a + g, fma(g, x - center, s.b)};
    }
    __device__ static __forceinline__ GradCoeffs<A> coeffs(const Stats& s, long long n, A, A center, A scale) {
        const A inv_n = reciprocal(static_cast<A>(n));
        return GradCoeffs<A>{scale, center, -scale * s.a * inv_n, -scale * scale * (scale * s.b) * inv_n, A(0)};
    }
    __device__ static __forceinline__ A phi(A x, const GradCoeffs<A>& c) { return x - c.center; }
};

// The Lp norms whose statistic is a sum (L1, L2, mean-abs, general p),
// Norm their forward policy: a = its statistic, b = sum g * x.
template <class Norm, class A>
struct LpGrad : PairSum<A> {
    using Stats = typename PairSum<A>::Stats;
    static constexpr bool kSaved = false;
    __device__ static __forceinline__ Stats accumulate(const Stats& s, A x, A g, A, A) {
        const A one[1] = {x};
        return Stats{s.a + Norm::of_values(one).sum, fma(g, x, s.b)};
    }
    __device__ static __forceinline__ GradCoeffs<A> coeffs(const Stats& s, long long n, A eps, A, A) {
        const typename Norm::Stats forward{s.a};
        const A scale = Norm::finalize(forward, n, eps).scale;
        // at norm == eps exactly the gradient goes through the norm, as
        // torch's clamp_min passes it where its input >= the bound
        const bool clamped = !(Norm::norm_value(forward, n) >= eps);
        const A slope = clamped ? A(0) : -scale * scale * s.b * Norm::grad_factor(scale, n);
        return GradCoeffs<A>{scale, A(0), A(0), slope, A(0)};
    }
    __device__ static __forceinline__ A phi(A x, const GradCoeffs<A>& c) { return Norm::grad_phi(x, c.scale); }
};

// L-infinity: the largest magnitude, how many elements reach it, sum g * x.
template <class A>
struct LinfGrad {
    struct Stats {
        A max_abs;
        A ties;
        A gx;
    };
    static constexpr int kStatWords = 3;
    static constexpr bool kCheapCombine = true;
    static constexpr bool kSaved = false;
    __device__ static __forceinline__ Stats init() { return Stats{A(0), A(0), A(0)}; }
    // The forward's maximum (a NaN wins); the ties of each side that
    // reaches it.
    __device__ static __forceinline__ Stats combine(const Stats& x, const Stats& y) {
        const A m = LinfNorm<A>::nan_max(x.max_abs, y.max_abs);
        const A ties = (x.max_abs == m ? x.ties : A(0)) + (y.max_abs == m ? y.ties : A(0));
        return Stats{m, ties, x.gx + y.gx};
    }
    __device__ static __forceinline__ Stats shfl_xor(const Stats& s, int mask, int width) {
        return Stats{shfl_xor_acc(s.max_abs, mask, width), shfl_xor_acc(s.ties, mask, width),
                     shfl_xor_acc(s.gx, mask, width)};
    }
    __device__ static __forceinline__ void store(A* dst, const Stats& s) {
        dst[0] = s.max_abs;
        dst[1] = s.ties;
        dst[2] = s.gx;
    }
    __device__ static __forceinline__ Stats load(const A* src) { return Stats{src[0], src[1], src[2]}; }
    __device__ static __forceinline__ Stats accumulate(const Stats& s, A x, A g, A, A) {
        return combine(s, Stats{fabs(x), A(1), g * x});
    }
    __device__ static __forceinline__ GradCoeffs<A> coeffs(const Stats& s, long long n, A eps, A, A) {
        const A scale = LinfNorm<A>::finalize(typename LinfNorm<A>::Stats{s.max_abs}, n, eps).scale;
        const bool clamped = !(s.max_abs >= eps);
        const A slope = clamped ? A(0) : -scale * scale * s.gx / s.ties;
        return GradCoeffs<A>{scale, A(0), A(0), slope, s.max_abs};
    }
    __device__ static __forceinline__ A phi(A x, const GradCoeffs<A>& c) {
        return fabs(x) == c.level ? sign_of(x) : A(0);
    }
};

// The gated RMSNorm's gate: silu(z) = z * sigmoid(z) and its derivative
// sigmoid(z) * (1 + z * (1 - sigmoid(z))). float: the division
// approximate (__fdividef, within 2 ulp; sigmoid 0 where 1 + exp(-z) passes
// 2^126), as the forward's silu (stages.cuh).
template <class A>
struct SiluGrad {
    A value;
    A slope;
};
template <class A>
__device__ __forceinline__ A sigmoid_of(A z) {
    if constexpr (same_type<A, float>::value) {
        return __fdividef(1.0f, 1.0f + exp(-z));
    } else {
        return A(1) / (A(1) + exp(-z));
    }
}
template <class A>
__device__ __forceinline__ SiluGrad<A> silu_grad(A z, A sigmoid) {
    return SiluGrad<A>{z * sigmoid, sigmoid * fma(z, A(1) - sigmoid, A(1))};
}
// Where the gated RMSNorm's silu(z) multiplies (rows_grad_gated's GATE): y
// = norm(x) * w * silu(z), or y = norm(x * silu(z)) * w.
enum GradGate { kGradUngated = 0, kGradGateOutput = 1, kGradGateInput = 2 };

// The gradient of one element: dx = scale * g + offset + slope * phi(x).
template <class Grad, class A>
__device__ __forceinline__ A grad_of(A x, A g, const GradCoeffs<A>& c) {
    return fma(c.scale, g, fma(c.slope, Grad::phi(x, c), c.offset));
}

// --- shared by the backward passes (backward.cu, channel_grads.cu) ---------------

// Every kernel here states a minimum of resident blocks in its launch
// bounds: with the maximum alone, ptxas (CUDA 12, sm_80) capped some
// instantiations at 32 or 64 registers and spilled 8-56 bytes; with (max,
// 1) none spill. rows_grad_cached takes its bounds as template arguments
// (the dispatch's choice: its preferred block asks for more blocks an SM).
// Block of the streaming passes (rows_grad_chunks/sums/apply, channel_grad_*).
constexpr int kGradBlockThreads = 256;
// Block of rows_grad_finalize_wide (at most).
constexpr int kGradFinalizeThreads = 1024;

// What a streaming sweep keeps in flight per position: the x and dy vectors
// (and the weights of the positions, or one weight for all of them).
template <class T, int VEC>
struct GradPair {
    Vec<T, VEC> x, dy;
};
template <class T, class P, int VEC>
struct GradItem {
    Vec<T, VEC> x, dy;
    Vec<P, VEC> w;
};
template <class T, class A, int VEC>
struct GradItemScalarWeight {
    Vec<T, VEC> x, dy;
    A w;
};

template <class T, int VEC>
__device__ __forceinline__ GradPair<T, VEC> load_pair(const T* x, const T* dy, long long e) {
    return GradPair<T, VEC>{load_vec<T, VEC>(x + e), load_vec<T, VEC>(dy + e)};
}

// g = dy * weight of one lane of a vector.
template <class A, class P, int FLAGS, int VEC>
__device__ __forceinline__ A scaled_grad(A dy, const Vec<P, VEC>& w, int j) {
    if constexpr (FLAGS & kWeight) return dy * static_cast<A>(widen(w.v[j]));
    else return dy;
}
// g = dy * weight, the weight already widened.
template <int FLAGS, class A>
__device__ __forceinline__ A weighted(A dy, A w) {
    if constexpr (FLAGS & kWeight) return dy * w;
    else return dy;
}

}  // namespace cunorm
