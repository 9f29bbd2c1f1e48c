// reduce.cuh: folding values into a norm's partial statistics and combining
// partials across threads, in a fixed order (butterflies, then warps in index order), so every thread ends
// with the same, bitwise reproducible, statistic. No atomics anywhere.
#pragma once
#include "norms.cuh"
#include "quant_store.cuh"

namespace cunorm {

// Fold one loaded vector, shifted by the group's pivot, into a partial.
template <class Norm, class A, class T, int VEC>
__device__ __forceinline__ typename Norm::Stats fold(const typename Norm::Stats& s, const Vec<T, VEC>& v, A pivot) {
    A values[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) values[j] = static_cast<A>(widen_at(v, j)) - pivot;
    return Norm::combine(s, Norm::of_values(values));
}

// The shift of a row for shifted norms (norms.cuh, kShifted): its first
// element as the load stage forms it (h = x + r, rounded as h is, with a
// residual); 0 otherwise, and for rows of 16-bit h (norms.cuh, LayerNorm).
// Every thread of the row loads the same element (one broadcast access).
template <class Norm, class A, class T, class LOAD>
__device__ __forceinline__ A row_pivot(const T* x_row, const typename LOAD::Residual* r_row, bool active,
                                       const typename LOAD::Gate* g_row = nullptr) {
    if constexpr (!Norm::kShifted || (sizeof(T) == 2 && !LOAD::kWide)) {
        return A(0);
    } else {
        if (!active) return A(0);
        Vec<T, 1> v = load_vec<T, 1>(x_row);
        if constexpr (LOAD::kWide) {
            return LOAD::template combine_wide<1>(v, load_vec<typename LOAD::Residual, 1>(r_row)).v[0];
        } else if constexpr (LOAD::kScaled) {
            v = LOAD::template combine<1>(v, load_vec<T, 1>(r_row), load_vec<typename LOAD::Gate, 1>(g_row));
        } else if constexpr (LOAD::kResidual) {
            v = LOAD::template combine<1>(v, load_vec<T, 1>(r_row));
        }
        return static_cast<A>(widen(v.v[0]));
    }
}

// Fold a single value (the strided family keeps one statistic per position).
template <class Norm, class A>
__device__ __forceinline__ typename Norm::Stats fold_one(const typename Norm::Stats& s, A value) {
    const A one[1] = {value};
    return Norm::combine(s, Norm::of_values(one));
}

// Visit v = first, first + stride, ... below end, in batches of UNROLL whose
// loads are all issued before any is used (memory-level parallelism for the
// streaming sweeps). Written out instead of `#pragma unroll` on a 64-bit
// loop, whose trip count would need a 64-bit division: a call, around which
// ptxas spills to local memory. INDEX: the index type, named by the caller
// (not deduced): int where the range is known to stay under 2**31, which
// takes fewer registers than 64-bit indices.
template <class T>
struct Named {
    using type = T;
};

template <int UNROLL, class INDEX = long long, class Load, class Use>
__device__ __forceinline__ void for_each_batched(typename Named<INDEX>::type first, typename Named<INDEX>::type end,
                                                 typename Named<INDEX>::type stride, Load load, Use use) {
#pragma unroll 1
    for (INDEX v0 = first; v0 < end; v0 += UNROLL * stride) {
        decltype(load(v0)) values[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (v0 + u * stride < end) values[u] = load(v0 + u * stride);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (v0 + u * stride < end) use(v0 + u * stride, values[u]);
        }
    }
}

// Per-group statistics for the caller (the backward pass needs them): the
// center undone of the pivot shift, and the scale.
template <class A>
__device__ __forceinline__ void store_stats(A* center_out, A* scale_out, long long group, const Affine<A>& f,
                                            A pivot) {
    if (center_out != nullptr) center_out[group] = pivot + f.center;
    if (scale_out != nullptr) scale_out[group] = f.scale;
}

// All `width` lanes of each aligned group of `width` lanes (a power of two,
// at most 32) end with the combination of the group's partials. Every lane
// of the warp must call it.
template <class Norm>
__device__ __forceinline__ typename Norm::Stats group_reduce(typename Norm::Stats s, int width) {
    for (int mask = width >> 1; mask > 0; mask >>= 1) {
        s = Norm::combine(s, Norm::shfl_xor(s, mask, width));
    }
    return s;
}

// Statistics whose combine is a few additions (the gradient sums of
// grads.cuh) say so with `static constexpr bool kCheapCombine = true`.
template <class Norm, class = void>
struct cheap_combine {
    static constexpr bool value = false;
};
template <class Norm>
struct cheap_combine<Norm, decltype(void(Norm::kCheapCombine))> {
    static constexpr bool value = Norm::kCheapCombine;
};

// The largest magnitude over a row, as a policy group_reduce and
// block_reduce take (a quantizing store's amax). fmax leaves NaN out.
template <class A>
struct MaxMagnitude {
    struct Stats {
        A v;
    };
    static constexpr bool kCheapCombine = true;
    __device__ static __forceinline__ Stats init() { return Stats{A(0)}; }
    __device__ static __forceinline__ Stats combine(const Stats& a, const Stats& b) { return Stats{fmax(a.v, b.v)}; }
    __device__ static __forceinline__ Stats shfl_xor(const Stats& s, int mask, int width) {
        return Stats{shfl_xor_acc(s.v, mask, width)};
    }
};

// All threads of the block end with the block's combined partial.
// `scratch` holds 33 Stats; every thread of the block must call it. With up
// to four warps, or a cheap combine, every thread combines the warps'
// partials itself in warp order (two barriers); with more, warp 0 combines
// them by a butterfly over lanes (the identity padding the missing warps)
// and shares the result: log2(32) combines a thread instead of one per
// warp, which matters for LayerNorm's division-bearing combine, for one
// more barrier (with 2-warp LayerNorm blocks the extra barrier cost 11
// points of bandwidth). Either way the order is fixed by blockDim: bitwise
// reproducible. The leading barrier protects scratch from a previous
// call's readers.
// MAX_WARPS: the most warps the caller's block has (its launch bounds),
// when that is known and few: the warps' partials are then combined by a
// loop of known length (predicated, no trip-count arithmetic), in the same
// order.
template <class Norm, int MAX_WARPS = 32>
__device__ __forceinline__ typename Norm::Stats block_reduce(typename Norm::Stats s,
                                                             typename Norm::Stats* scratch) {
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int warps = (blockDim.x + 31) >> 5;
    s = group_reduce<Norm>(s, 32);
    __syncthreads();
    if (lane == 0) scratch[warp] = s;
    __syncthreads();
    if constexpr (MAX_WARPS <= 8) {
        if (warps <= 4 || cheap_combine<Norm>::value) {
            typename Norm::Stats total = scratch[0];
#pragma unroll
            for (int i = 1; i < MAX_WARPS; ++i) {
                if (i < warps) total = Norm::combine(total, scratch[i]);
            }
            return total;
        }
    }
    if (warps <= 4 || cheap_combine<Norm>::value) {
        typename Norm::Stats total = scratch[0];
        for (int i = 1; i < warps; ++i) total = Norm::combine(total, scratch[i]);
        return total;
    }
    if (warp == 0) {
        typename Norm::Stats t = lane < warps ? scratch[lane] : Norm::init();
        t = group_reduce<Norm>(t, 32);
        if (lane == 0) scratch[32] = t;
    }
    __syncthreads();
    return scratch[32];
}

// All threads of each aligned group of `width` consecutive threads of the
// block (a power of two up to 32, or a multiple of 32 dividing blockDim.x,
// of at most four warps or a cheap combine) end with their group's combined
// partial, combined in block_reduce's order for a block of `width` threads:
// the same statistic. Groups within a warp need no barrier; wider ones add
// their warps' partials through `scratch` (a Stats a warp), every thread of
// the block calling.
template <class Norm, int MAX_WARPS>
__device__ __forceinline__ typename Norm::Stats group_block_reduce(typename Norm::Stats s,
                                                                   typename Norm::Stats* scratch, int width) {
    if (width <= 32) return group_reduce<Norm>(s, width);
    const int warp = threadIdx.x >> 5;
    const int group_warps = width >> 5;
    const int first = warp - warp % group_warps;
    s = group_reduce<Norm>(s, 32);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) scratch[warp] = s;
    __syncthreads();
    typename Norm::Stats total = scratch[first];
#pragma unroll
    for (int i = 1; i < MAX_WARPS; ++i) {
        if (i < group_warps) total = Norm::combine(total, scratch[first + i]);
    }
    return total;
}

}  // namespace cunorm
