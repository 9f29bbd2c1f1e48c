// reduce.cuh: combining a norm's partial statistics across threads, in a
// fixed order (butterflies, then warps in index order), so every thread ends
// with the same, bitwise reproducible, statistic. No atomics anywhere.
#pragma once
#include "norms.cuh"

namespace cunorm {

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

// All threads of the block end with the block's combined partial.
// `scratch` holds 32 Stats; every thread of the block must call it. The
// leading barrier protects scratch from a previous call's readers.
template <class Norm>
__device__ __forceinline__ typename Norm::Stats block_reduce(typename Norm::Stats s,
                                                             typename Norm::Stats* scratch) {
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int warps = (blockDim.x + 31) >> 5;
    s = group_reduce<Norm>(s, 32);
    __syncthreads();
    if (lane == 0) scratch[warp] = s;
    __syncthreads();
    typename Norm::Stats total = scratch[0];
    for (int i = 1; i < warps; ++i) total = Norm::combine(total, scratch[i]);
    return total;
}

}  // namespace cunorm
