// sync.cu: SyncBatchNorm's statistics across ranks, after the forward's
// collective (the ranks' per-channel statistics gathered, rank by rank).
//
//   channel_sync_combine   one thread a channel: the ranks' (count, mean,
//                          M2) added in rank order by Chan's pairwise
//                          update (never E[x^2] - E[x]^2), the running
//                          buffers updated as torch updates them (the
//                          unbiased variance over the global count), the
//                          global mean, biased variance, rstd and count
//                          written for y and the backward.
//   channel_sync_count     one thread a channel: the rank's count written
//                          into its block's count row before the
//                          collective (a launch of the statistics' Program,
//                          where a fill would cost a framework call).
#include "common.cuh"

namespace cunorm {

// gathered: (ranks, 3, channels), each rank's count, mean and rstd of its
// batch with eps 0 (rstd inf: no spread; count 0: an empty rank, which
// changes nothing). M2 = count / rstd^2. running_mean and running_var
// (null: not tracked) become (1 - momentum) * running + momentum * batch.
// count: the global count (one value, the same in every thread).
template <class A>
__global__ void __launch_bounds__(256)
    channel_sync_combine(const A* __restrict__ gathered, A* __restrict__ running_mean,
                         A* __restrict__ running_var, A* __restrict__ mean, A* __restrict__ var,
                         A* __restrict__ rstd, A* __restrict__ count, int ranks, int channels, A eps,
                         A momentum) {
    grid_dependency_sync();
    const int c = static_cast<int>(blockIdx.x) * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x);
    if (c >= channels) return;
    A n = A(0), mu = A(0), m2 = A(0);
    for (int r = 0; r < ranks; ++r) {
        const A* rank = gathered + static_cast<long long>(r) * 3 * channels;
        const A n_b = rank[c];
        if (!(n_b > A(0))) continue;
        const A rstd_b = rank[2 * channels + c];
        const A m2_b = n_b / (rstd_b * rstd_b);
        const A n_ab = n + n_b;
        const A share = n_b / n_ab;
        const A delta = rank[channels + c] - mu;
        mu = mu + delta * share;
        m2 = m2 + m2_b + delta * delta * n * share;
        n = n_ab;
    }
    const A biased = m2 / n;
    mean[c] = mu;
    var[c] = biased;
    rstd[c] = rsqrt(biased + eps);
    if (c == 0) count[0] = n;
    if (running_mean != nullptr) {
        running_mean[c] = (A(1) - momentum) * running_mean[c] + momentum * mu;
        running_var[c] = (A(1) - momentum) * running_var[c] + momentum * (m2 / (n - A(1)));
    }
}

// count: the rank's (channels) count row, every entry ``value``.
template <class A>
__global__ void __launch_bounds__(256) channel_sync_count(A* __restrict__ count, int channels, A value) {
    grid_dependency_sync();
    const int c = static_cast<int>(blockIdx.x) * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x);
    if (c < channels) count[c] = value;
}

}  // namespace cunorm
