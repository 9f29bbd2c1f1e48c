// norms.cuh: the norm policies. A kernel family is a way of walking memory;
// a policy says what statistic the walk accumulates and how the statistic
// turns into the epilogue's (scale, shift). Adding a norm means adding a
// policy here and a plan in Python, not a new kernel.
//
// Every policy has the same shape, for an accumulation type A:
//   Stats                      the partial statistic, plain A fields only
//                              (workspaces store it as kStatWords A's)
//   init()                     the identity of combine
//   add(s, x)                  fold one element in
//   combine(a, b)              merge two partials; the callers fix the order
//                              of combination, so results are bitwise
//                              reproducible run to run
//   shfl_xor(s, mask, width)   butterfly exchange of a partial within a warp
//   finalize(s, n, eps)        the Affine{scale, shift} of  y = x*scale+shift
#pragma once
#include "common.cuh"

namespace cunorm {

template <class A>
__device__ __forceinline__ A shfl_xor_acc(A v, int mask, int width) {
    return __shfl_xor_sync(0xffffffffu, v, mask, width);
}

// RMSNorm:  y = x * rsqrt(mean(x^2) + eps).
// A non-finite sum of squares (an Inf or NaN in the group, or float overflow)
// makes the whole group NaN rather than silently zero.
// Correctly rounded reciprocal without the IEEE-division slow-path call (a
// call makes ptxas spill the values live across it to local memory).
__device__ __forceinline__ float reciprocal(float v) { return __frcp_rn(v); }
__device__ __forceinline__ double reciprocal(double v) { return __drcp_rn(v); }

template <class A>
struct RmsNorm {
    struct Stats {
        A sum_sq;
    };
    static constexpr int kStatWords = 1;

    __device__ static __forceinline__ Stats init() { return Stats{A(0)}; }
    __device__ static __forceinline__ void add(Stats& s, A x) { s.sum_sq = fma(x, x, s.sum_sq); }
    __device__ static __forceinline__ Stats combine(const Stats& a, const Stats& b) {
        return Stats{a.sum_sq + b.sum_sq};
    }
    __device__ static __forceinline__ Stats shfl_xor(const Stats& s, int mask, int width) {
        return Stats{shfl_xor_acc(s.sum_sq, mask, width)};
    }
    __device__ static __forceinline__ Affine<A> finalize(const Stats& s, long long n, A eps) {
        A mean_sq = s.sum_sq * reciprocal(static_cast<A>(n));
        A scale = rsqrt(mean_sq + eps);
        if (!isfinite(s.sum_sq)) scale = A(__int_as_float(0x7fc00000));  // quiet NaN
        return Affine<A>{scale, A(0)};
    }
};

}  // namespace cunorm
