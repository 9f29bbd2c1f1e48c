// norms.cuh: the norm policies. A kernel family is a way of walking memory;
// a policy says what statistic the walk accumulates and how the statistic
// turns into the epilogue's Affine{center, scale} of
//   y = (x - center) * scale [* weight] [+ bias].
// Adding a norm means adding a policy here and a plan in Python, not a new
// kernel.
//
// Every policy has the same shape, for an accumulation type A:
//   Stats                      the partial statistic, plain A fields only
//                              (workspaces store it as kStatWords A's)
//   init()                     the identity of combine
//   of_values<N>(v)            the statistic of N values held in registers
//                              (a loaded vector): the kernels fold vectors,
//                              not single elements; LayerNorm, the channel
//                              family's statistic, has of_split too
//   combine(a, b)              merge two partials; the callers fix the order
//                              of combination, so results are bitwise
//                              reproducible run to run
//   shfl_xor(s, mask, width)   butterfly exchange of a partial within a warp
//   finalize(s, n, eps)        the Affine of the group (n elements)
//   kShifted                   whether the kernels feed it x - pivot (the
//                              group's first element) instead of x, and
//                              center the epilogue on the pivot too (rows
//                              of 16-bit data excepted: LayerNorm below)
// A policy with a compile-time parameter (PowerNorm's p) is a member
// template of a class template: cunorm::PowerNorm<bits of p>::Policy.
#pragma once
#include "common.cuh"

namespace cunorm {

template <class A>
__device__ __forceinline__ A shfl_xor_acc(A v, int mask, int width) {
    return __shfl_xor_sync(0xffffffffu, v, mask, width);
}

// Reciprocals without the IEEE-division slow-path call (a call makes ptxas
// spill the values live across it to local memory). float: correctly
// rounded. double: the float reciprocal refined by two Newton steps (its
// relative error squares each step: 6e-8, 4e-15, below double's ulp), for
// the positive counts and sizes it is used on here.
__device__ __forceinline__ float reciprocal(float v) { return __frcp_rn(v); }
__device__ __forceinline__ double reciprocal(double v) {
    double r = static_cast<double>(__frcp_rn(static_cast<float>(v)));
    r = fma(fma(-v, r, 1.0), r, r);
    return fma(fma(-v, r, 1.0), r, r);
}

// The reciprocal of a combined count, for the share it weights a partial
// by: float within an ulp (rcp.approx; the correctly rounded reciprocal's
// fix-up steps, once a combine, cost LayerNorm bf16 4096x32768 154.7
// against 143.5 us and 65536x1024 82.6 against 80.1, H200); double as
// reciprocal().
__device__ __forceinline__ float count_reciprocal(float v) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
    return r;
}
__device__ __forceinline__ double count_reciprocal(double v) { return reciprocal(v); }

template <class A>
__device__ __forceinline__ A quiet_nan() {
    return static_cast<A>(__int_as_float(0x7fc00000));
}

// A sum of per-element terms: RMSNorm's statistic and every Lp norm's but
// p = inf. Term::add(s, v) adds v's term to the running sum s (finalize
// comes from the norm that derives from it).
template <class A, class Term>
struct SumStatistic {
    struct Stats {
        A sum;
    };
    static constexpr int kStatWords = 1;
    static constexpr bool kShifted = false;
    __device__ static __forceinline__ Stats init() { return Stats{A(0)}; }
    template <int N>
    __device__ static __forceinline__ Stats of_values(const A (&v)[N]) {
        A s = A(0);
#pragma unroll
        for (int j = 0; j < N; ++j) s = Term::add(s, v[j]);
        return Stats{s};
    }
    __device__ static __forceinline__ Stats combine(const Stats& a, const Stats& b) { return Stats{a.sum + b.sum}; }
    __device__ static __forceinline__ Stats shfl_xor(const Stats& s, int mask, int width) {
        return Stats{shfl_xor_acc(s.sum, mask, width)};
    }
};

// The terms: x^2 (fused, one rounding), |x|.
struct SquareTerm {
    template <class A>
    __device__ static __forceinline__ A add(A s, A v) { return fma(v, v, s); }
};
struct AbsTerm {
    template <class A>
    __device__ static __forceinline__ A add(A s, A v) { return s + fabs(v); }
};

// RMSNorm:  y = x * rsqrt(mean(x^2) + eps).
// A non-finite sum of squares (an Inf or NaN in the group, or float overflow)
// makes the whole group NaN rather than silently zero.
template <class A>
struct RmsNorm : SumStatistic<A, SquareTerm> {
    using Stats = typename SumStatistic<A, SquareTerm>::Stats;
    __device__ static __forceinline__ Affine<A> finalize(const Stats& s, long long n, A eps) {
        A scale = rsqrt(s.sum * reciprocal(static_cast<A>(n)) + eps);
        if (!isfinite(s.sum)) scale = quiet_nan<A>();
        return Affine<A>{A(0), scale};
    }
};

// LayerNorm:  y = (x - mean) * rsqrt(var + eps), var biased.
// Partials are (count, mean, M2 = sum of squared deviations from the mean):
// exact two-pass statistics within a vector, Chan et al.'s pairwise update
// across vectors and threads. Never E[x^2] - E[x]^2, which loses everything
// when |mean| >> std. The data are shifted by the group's first element
// (kShifted): for rows of mean 1e4 and std 1 in float32, the mean itself
// rounds to 5e-4 of the std; x - pivot is exact there (Sterbenz) and the
// shifted mean is of the size of the std, so the outputs keep float32's
// precision. 16-bit data are not shifted (reduce.cuh, row_pivot): their
// spread is at least an ulp of their mean (2^-8 of it in bfloat16, 2^-11
// in float16), so float32's rounding of the mean stays within 2^-13 of the
// std, far below y's rounding, while the subtraction costs an instruction
// an element in each of the statistic and the epilogue
// (docs/notes/rows.md, "16-bit LayerNorm").
template <class A>
struct LayerNorm {
    struct Stats {
        A count;
        A mean;
        A m2;
    };
    static constexpr int kStatWords = 3;
    static constexpr bool kShifted = true;

    __device__ static __forceinline__ Stats init() { return Stats{A(0), A(0), A(0)}; }
    template <int N>
    __device__ static __forceinline__ Stats of_values(const A (&v)[N]) {
        A sum = A(0);
#pragma unroll
        for (int j = 0; j < N; ++j) sum += v[j];
        const A mean = sum * (A(1) / A(N));  // N is a power of two: exact
        A m2 = A(0);
#pragma unroll
        for (int j = 0; j < N; ++j) m2 = fma(v[j] - mean, v[j] - mean, m2);
        return Stats{A(N), mean, m2};
    }
    // The statistics of columns 0 .. split - 1 of v (first, ROWS * split
    // values; first_rcp is 1 / that) and of the columns after them (second,
    // when split < COLS): the same two passes, summed down each column, then
    // across the columns (the channels-last groups that straddle a vector).
    template <int ROWS, int COLS>
    __device__ static __forceinline__ void of_split(const A (&v)[ROWS][COLS], int split, A first_rcp, A second_rcp,
                                                    Stats& first, Stats& second) {
        A column[COLS];
        A sum_first = A(0), sum_second = A(0);
#pragma unroll
        for (int j = 0; j < COLS; ++j) {
            column[j] = v[0][j];
#pragma unroll
            for (int u = 1; u < ROWS; ++u) column[j] += v[u][j];
            sum_first += j < split ? column[j] : A(0);
            sum_second += j < split ? A(0) : column[j];
        }
        const A mean_first = sum_first * first_rcp, mean_second = sum_second * second_rcp;
        A m2_first = A(0), m2_second = A(0);
#pragma unroll
        for (int j = 0; j < COLS; ++j) {
            const A mean = j < split ? mean_first : mean_second;
            A m2 = A(0);
#pragma unroll
            for (int u = 0; u < ROWS; ++u) m2 = fma(v[u][j] - mean, v[u][j] - mean, m2);
            m2_first += j < split ? m2 : A(0);
            m2_second += j < split ? A(0) : m2;
        }
        first = Stats{static_cast<A>(ROWS * split), mean_first, m2_first};
        second = Stats{static_cast<A>(ROWS * (COLS - split)), mean_second, m2_second};
    }
    __device__ static __forceinline__ Stats combine(const Stats& a, const Stats& b) {
        const A n = a.count + b.count;
        if (n == A(0)) return a;
        const A delta = b.mean - a.mean;
        const A fb = b.count * count_reciprocal(n);  // b's share of the combined count
        return Stats{n, fma(delta, fb, a.mean), a.m2 + b.m2 + delta * delta * a.count * fb};
    }
    __device__ static __forceinline__ Stats shfl_xor(const Stats& s, int mask, int width) {
        return Stats{shfl_xor_acc(s.count, mask, width), shfl_xor_acc(s.mean, mask, width),
                     shfl_xor_acc(s.m2, mask, width)};
    }
    __device__ static __forceinline__ Affine<A> finalize(const Stats& s, long long n, A eps) {
        A scale = rsqrt(s.m2 * reciprocal(static_cast<A>(n)) + eps);
        A center = s.mean;
        if (!isfinite(s.m2) || !isfinite(s.mean)) scale = center = quiet_nan<A>();
        return Affine<A>{center, scale};
    }
    // The unbiased variance m2 / (n - 1) (BatchNorm's running estimate).
    __device__ static __forceinline__ A unbiased_variance(const Stats& s, long long n) {
        return s.m2 * reciprocal(static_cast<A>(n - 1));
    }
};

// --- the Lp family: y = x / max(norm(x), eps), as torch's F.normalize ---------
// One accumulated word each; the epilogue multiplies by scale = 1 / max(norm,
// eps) (within an ulp of dividing). A non-finite statistic (an Inf or NaN in
// the group, or an overflowing sum) makes the group NaN, as for RMSNorm.

template <class A>
__device__ __forceinline__ Affine<A> lp_affine(A statistic, A norm, A eps) {
    // float: the correctly rounded reciprocal; double: one division a group.
    A scale;
    if constexpr (sizeof(A) == 4) {
        scale = reciprocal(fmax(norm, eps));
    } else {
        scale = A(1) / fmax(norm, eps);
    }
    if (!isfinite(statistic)) scale = quiet_nan<A>();
    return Affine<A>{A(0), scale};
}

// The sign of x, 0 at 0 (the derivative of |x| as torch takes it).
template <class A>
__device__ __forceinline__ A sign_of(A x) {
    return static_cast<A>((x > A(0)) - (x < A(0)));
}

// Each Lp policy also carries its gradient (grads.cuh, LpGrad): with
// s = 1 / norm, where the clamp does not hold,
//   dx = s * dy - s^2 * sum(dy * x) * dnorm/dx,
// and dnorm/dx = grad_factor(s, n) * grad_phi(x, s).

// L1:  norm = sum |x|;  dnorm/dx = sign(x).
template <class A>
struct L1Norm : SumStatistic<A, AbsTerm> {
    using Stats = typename SumStatistic<A, AbsTerm>::Stats;
    __device__ static __forceinline__ A norm_value(const Stats& s, long long) { return s.sum; }
    __device__ static __forceinline__ Affine<A> finalize(const Stats& s, long long n, A eps) {
        return lp_affine(s.sum, norm_value(s, n), eps);
    }
    __device__ static __forceinline__ A grad_phi(A x, A) { return sign_of(x); }
    __device__ static __forceinline__ A grad_factor(A, long long) { return A(1); }
};

// Mean-abs (problem 38):  norm = mean |x| = sum |x| / n.
//   dnorm/dx = sign(x) / n.
template <class A>
struct MeanAbsNorm : L1Norm<A> {
    using Stats = typename L1Norm<A>::Stats;
    __device__ static __forceinline__ A norm_value(const Stats& s, long long n) {
        return s.sum * reciprocal(static_cast<A>(n));
    }
    __device__ static __forceinline__ Affine<A> finalize(const Stats& s, long long n, A eps) {
        return lp_affine(s.sum, norm_value(s, n), eps);
    }
    __device__ static __forceinline__ A grad_factor(A, long long n) { return reciprocal(static_cast<A>(n)); }
};

// L2:  norm = sqrt(sum x^2) (Frobenius over the whole array);
//   dnorm/dx = x / norm = s * x.
template <class A>
struct L2Norm : SumStatistic<A, SquareTerm> {
    using Stats = typename SumStatistic<A, SquareTerm>::Stats;
    __device__ static __forceinline__ A norm_value(const Stats& s, long long) { return sqrt(s.sum); }
    __device__ static __forceinline__ Affine<A> finalize(const Stats& s, long long n, A eps) {
        return lp_affine(s.sum, norm_value(s, n), eps);
    }
    __device__ static __forceinline__ A grad_phi(A x, A) { return x; }
    __device__ static __forceinline__ A grad_factor(A scale, long long) { return scale; }
};

// a^q for a >= 0 and an exponent q the compiler knows: a whole q from 2 to
// 8 as the product of q factors (q - 1 roundings, within float's
// accuracy here), any other q by pow, the accurate library function. pow
// is a few tens of instructions an element: with it the p=3 normalize of
// fp32 32768x4096 rows reads 67% of copy bandwidth, as a product 96%
// (H200; docs/notes/rows.md).
template <class A>
__device__ __forceinline__ A power_of(A a, A q) {
    if (q >= A(2) && q <= A(8) && q == A(static_cast<int>(q))) {
        const int k = static_cast<int>(q);
        A r = a;
#pragma unroll
        for (int i = 1; i < 8; ++i) {
            if (i < k) r *= a;
        }
        return r;
    }
    return pow(a, q);
}

// General p > 0 (not 1, 2 or inf):  norm = (sum |x|^p)^(1/p), p a template
// argument (the bits of the double p: cunorm/_engine/dispatch_rows.py), one
// instantiation a p.
template <unsigned long long P_BITS>
struct PowerNorm {
    template <class A>
    __device__ static __forceinline__ A power() { return static_cast<A>(__longlong_as_double(P_BITS)); }
    struct PowerTerm {
        template <class A>
        __device__ static __forceinline__ A add(A s, A v) { return s + power_of(fabs(v), power<A>()); }
    };
    //   dnorm/dx = sign(x) |x|^(p-1) / norm^(p-1) = sign(x) |s x|^(p-1).
    template <class A>
    struct Policy : SumStatistic<A, PowerTerm> {
        using Stats = typename SumStatistic<A, PowerTerm>::Stats;
        __device__ static __forceinline__ A norm_value(const Stats& s, long long) {
            return pow(s.sum, A(1) / power<A>());
        }
        __device__ static __forceinline__ Affine<A> finalize(const Stats& s, long long n, A eps) {
            return lp_affine(s.sum, norm_value(s, n), eps);
        }
        __device__ static __forceinline__ A grad_phi(A x, A scale) {
            return sign_of(x) * power_of(fabs(x) * scale, power<A>() - A(1));
        }
        __device__ static __forceinline__ A grad_factor(A, long long) { return A(1); }
    };
};

// L-infinity:  norm = max |x|. The max keeps a NaN once it has seen one
// (fmax would drop it and hide the NaN group).
template <class A>
struct LinfNorm {
    struct Stats {
        A max_abs;
    };
    static constexpr int kStatWords = 1;
    static constexpr bool kShifted = false;
    __device__ static __forceinline__ A nan_max(A a, A b) { return (b > a || b != b) ? b : a; }
    __device__ static __forceinline__ Stats init() { return Stats{A(0)}; }
    template <int N>
    __device__ static __forceinline__ Stats of_values(const A (&v)[N]) {
        A m = A(0);
#pragma unroll
        for (int j = 0; j < N; ++j) m = nan_max(m, fabs(v[j]));
        return Stats{m};
    }
    __device__ static __forceinline__ Stats combine(const Stats& a, const Stats& b) {
        return Stats{nan_max(a.max_abs, b.max_abs)};
    }
    __device__ static __forceinline__ Stats shfl_xor(const Stats& s, int mask, int width) {
        return Stats{shfl_xor_acc(s.max_abs, mask, width)};
    }
    __device__ static __forceinline__ A norm_value(const Stats& s, long long) { return s.max_abs; }
    __device__ static __forceinline__ Affine<A> finalize(const Stats& s, long long n, A eps) {
        return lp_affine(s.max_abs, norm_value(s, n), eps);
    }
};

}  // namespace cunorm
