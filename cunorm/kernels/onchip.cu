// onchip.cu: the channel family's one-read walks for statistic groups that
// fit on chip, forward (channel_onchip; cunorm/kernels/channels.cu has the
// layouts and the other walks; same statistic, same epilogue) and
// BatchNorm's backward (channel_grad_onchip; channel_grads.cu has the
// other walks, same gradient). The cluster helpers: cluster.cuh.
#include "cluster.cuh"
#include "reduce.cuh"

namespace cunorm {

// The sum of every thread's v over the block, then over the cluster in rank
// order, in every thread (bitwise reproducible). warp_sums: THREADS / 32
// slots, block_sum: one, both used by this call alone.
template <int THREADS, int CLUSTER, class A>
__device__ __forceinline__ A onchip_sum(A v, A* warp_sums, A* block_sum) {
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) v += shfl_xor_acc(v, mask, 32);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
    __syncthreads();
    A total = warp_sums[0];
#pragma unroll
    for (int i = 1; i < THREADS / 32; ++i) total += warp_sums[i];
    if constexpr (CLUSTER > 1) {
        if (threadIdx.x == 0) *block_sum = total;
        cluster_arrive();
        cluster_wait();
        total = *cluster_peer(block_sum, 0);
#pragma unroll
        for (unsigned int k = 1; k < CLUSTER; ++k) total += *cluster_peer(block_sum, k);
    }
    return total;
}

// The vectors of a statistic group held on chip: `rows` rows of row_vecs
// vectors, row r starting at vector base + r * row_stride. Vector v of the
// group is held by block v / (THREADS * ITEMS) of the cluster, item
// (v / THREADS) % ITEMS, thread v % THREADS (coalesced).
struct OnchipGroup {
    long long base;
    long long row_stride;
    int row_vecs;
    int vecs;  // rows * row_vecs, under 2**31 (the dispatch)

    // element offset of the group's vector v (v < vecs; a 32-bit division), VEC elements a vector
    template <int VEC>
    __device__ __forceinline__ long long offset(int v) const {
        const int r = static_cast<int>(static_cast<unsigned int>(v) / static_cast<unsigned int>(row_vecs));
        return (base + r * row_stride + (v - r * row_vecs)) * VEC;
    }
};

// The first vector this thread holds (rank: the block's rank in its cluster).
template <int THREADS, int ITEMS>
__device__ __forceinline__ int onchip_first(unsigned int rank) {
    return static_cast<int>(rank) * THREADS * ITEMS + static_cast<int>(threadIdx.x);
}

// channel_onchip: a statistic group held on chip, x read once; the group's
// mean and variance by two passes over the held values, shifted by the
// group's first element as the other walks are (norms.cuh, LayerNorm), then
// channel_apply's epilogue.
//
// A cluster of CLUSTER blocks of THREADS threads per statistic group (sample
// n, group g; BatchNorm: channel g of every sample), each thread holding
// ITEMS vectors of the group in registers. The group is `rows` rows of
// row_vecs vectors, row r at
//     n * sample_stride + g * group_stride + r * row_stride   (in vectors):
//   channels-first GroupNorm/InstanceNorm: one row, the group's planes;
//   channels-first BatchNorm: a row per sample, the channel's plane;
//   channels-last GroupNorm: a row per position, the group's channels.
// The blocks of a cluster exchange their sums through distributed shared memory
// (onchip_sum). Block rank 0 writes the returned statistics and BatchNorm's
// running estimates. y is stored with the streaming hint (st.global.cs).
// The regime: groups of at most CLUSTER * THREADS * ITEMS vectors (the
// dispatch), every load of a thread in flight at once, nothing read twice.
template <class T, class STORE, int VEC, bool CHANNELS_LAST, int THREADS, int ITEMS, int CLUSTER>
__global__ void __launch_bounds__(THREADS) CUNORM_CLUSTER_DIMS(CLUSTER)
channel_onchip(const T* __restrict__ x, const typename STORE::Param* __restrict__ w,
               const typename STORE::Param* __restrict__ b, typename AccOf<T>::type* running_mean,
               typename AccOf<T>::type* running_var, typename STORE::Out* __restrict__ y,
               typename AccOf<T>::type* mean_out, typename AccOf<T>::type* rstd_out, int rows, int row_vecs,
               long long row_stride, long long sample_stride, long long group_stride, int spatial_vecs,
               int channels_per_group, int groups, typename AccOf<T>::type eps, typename AccOf<T>::type momentum) {
    grid_dependency_sync();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    static_assert(CLUSTER == 1, "thread-block clusters need sm_90");
#endif
    using A = typename AccOf<T>::type;
    using Norm = LayerNorm<A>;
    __shared__ A warp_sums[2][THREADS / 32];
    __shared__ A block_sums[2];
    const unsigned int rank = CLUSTER > 1 ? cluster_rank() : 0u;
    const int group = static_cast<int>(blockIdx.x / CLUSTER);
    const int n = group / groups;
    const int g = group - n * groups;
    const long long base = n * sample_stride + g * group_stride;
    const OnchipGroup grp{base, row_stride, row_vecs, rows * row_vecs};
    const int group_vecs = grp.vecs;
    const int first = onchip_first<THREADS, ITEMS>(rank);
    Vec<T, VEC> held[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int v = first + i * THREADS;
        if (v < group_vecs) held[i] = load_vec<T, VEC>(x + grp.offset<VEC>(v));
    }
    const A pivot = static_cast<A>(widen(x[base * VEC]));  // the shift (norms.cuh, LayerNorm)
    A sum = A(0);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        if (first + i * THREADS < group_vecs) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) sum += static_cast<A>(widen(held[i].v[j])) - pivot;
        }
    }
    const long long count = static_cast<long long>(group_vecs) * VEC;
    const A mean = onchip_sum<THREADS, CLUSTER>(sum, warp_sums[0], &block_sums[0]) * reciprocal(static_cast<A>(count));
    A m2 = A(0);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        if (first + i * THREADS < group_vecs) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const A d = (static_cast<A>(widen(held[i].v[j])) - pivot) - mean;
                m2 = fma(d, d, m2);
            }
        }
    }
    m2 = onchip_sum<THREADS, CLUSTER>(m2, warp_sums[1], &block_sums[1]);
    if constexpr (CLUSTER > 1) cluster_arrive();  // this block has read its peers' sums (waited for before exit)
    const typename Norm::Stats s{static_cast<A>(count), mean, m2};
    const Affine<A> f = Norm::finalize(s, count, eps);
    if (rank == 0 && threadIdx.x == 0) {
        store_stats(mean_out, rstd_out, group, f, pivot);
        if (running_mean != nullptr) {
            running_mean[group] = (A(1) - momentum) * running_mean[group] + momentum * (pivot + mean);
        }
        if (running_var != nullptr) {
            running_var[group] = (A(1) - momentum) * running_var[group] + momentum * Norm::unbiased_variance(s, count);
        }
    }
    const int first_channel = g * channels_per_group;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int v = first + i * THREADS;
        if (v < group_vecs) {
            typename STORE::template Params<VEC> p;
            if constexpr (STORE::kParamBytes != 0) {
                const int r = static_cast<int>(static_cast<unsigned int>(v) / static_cast<unsigned int>(row_vecs));
                const int col = v - r * row_vecs;
                if constexpr (CHANNELS_LAST) {
                    p = STORE::template params<VEC>(w, b, first_channel + col * VEC);
                } else {
                    p = STORE::template splat<VEC>(w, b, first_channel + col / spatial_vecs);
                }
            }
            store_vec_streaming(y + grp.offset<VEC>(v), STORE::template apply<T>(held[i], p, f, pivot));
        }
    }
    if constexpr (CLUSTER > 1) cluster_wait();  // no block leaves while a peer may read its shared memory
}

// channel_grad_onchip: BatchNorm's backward, channels-first, with a channel
// held on chip: x and dy read once, dx written once. Over the channel (every
// sample's plane), A = sum dy and B = sum dy * (x - mean); then
//   dweight[c] = rstd B,  dbias[c] = A,
//   dx = alpha dy + beta (x - mean) + gamma,  alpha = rstd w[c],
//   beta = -rstd^3 w[c] B / count,  gamma = -rstd w[c] A / count
// (TRAINING; on running statistics beta = gamma = 0), as
// channel_grad_finalize and channel_grad_apply compute them. mean and rstd:
// the forward's saved statistics, or the running mean and 1 / sqrt(running
// variance + eps).
// A cluster of CLUSTER blocks of THREADS threads per channel, as
// channel_onchip's, each thread holding ITEMS vectors of x and ITEMS of dy:
// the channel's `batch` planes of plane_vecs vectors, plane n of channel c
// at vector (n * channels + c) * plane_vecs. Block rank 0 writes dweight
// and dbias. The regime: channels of at most CLUSTER * THREADS * ITEMS
// vectors (the dispatch), where the four launches' passes over small planes
// are short of blocks and of vectors. The launch bounds name one block an
// SM: with the maximum alone ptxas capped some instantiations at 40-64
// registers and spilled (as backward.cu's kernels).
template <class T, class P, int FLAGS, int VEC, bool TRAINING, int THREADS, int ITEMS, int CLUSTER>
__global__ void __launch_bounds__(THREADS, 1) CUNORM_CLUSTER_DIMS(CLUSTER)
channel_grad_onchip(const T* __restrict__ dy, const T* __restrict__ x, const typename AccOf<T>::type* __restrict__ mean,
                    const typename AccOf<T>::type* __restrict__ rstd, const P* __restrict__ w, T* __restrict__ dx,
                    P* __restrict__ dw, P* __restrict__ db, int batch, int plane_vecs, int channels) {
    grid_dependency_sync();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    static_assert(CLUSTER == 1, "thread-block clusters need sm_90");
#endif
    using A = typename AccOf<T>::type;
    __shared__ A warp_sums[2][THREADS / 32];
    __shared__ A block_sums[2];
    const unsigned int rank = CLUSTER > 1 ? cluster_rank() : 0u;
    const int c = static_cast<int>(blockIdx.x / CLUSTER);
    const OnchipGroup grp{static_cast<long long>(c) * plane_vecs, static_cast<long long>(channels) * plane_vecs,
                          plane_vecs, batch * plane_vecs};
    const int first = onchip_first<THREADS, ITEMS>(rank);
    Vec<T, VEC> held_x[ITEMS], held_dy[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int v = first + i * THREADS;
        if (v < grp.vecs) {
            held_x[i] = load_vec<T, VEC>(x + grp.offset<VEC>(v));
            held_dy[i] = load_vec<T, VEC>(dy + grp.offset<VEC>(v));
        }
    }
    const A mu = mean[c], r = rstd[c];
    A sum_dy = A(0), sum_dy_x = A(0);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        if (first + i * THREADS < grp.vecs) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const A g = static_cast<A>(widen(held_dy[i].v[j]));
                sum_dy += g;
                sum_dy_x = fma(g, static_cast<A>(widen(held_x[i].v[j])) - mu, sum_dy_x);
            }
        }
    }
    sum_dy = onchip_sum<THREADS, CLUSTER>(sum_dy, warp_sums[0], &block_sums[0]);
    sum_dy_x = onchip_sum<THREADS, CLUSTER>(sum_dy_x, warp_sums[1], &block_sums[1]);
    if constexpr (CLUSTER > 1) cluster_arrive();  // this block has read its peers' sums (waited for before exit)
    A wc = A(1);
    if constexpr ((FLAGS & kWeight) != 0) wc = static_cast<A>(widen(w[c]));
    const A alpha = r * wc;
    A beta = A(0), gamma = A(0);
    if constexpr (TRAINING) {
        const A inv = reciprocal(static_cast<A>(batch) * static_cast<A>(plane_vecs * VEC));
        beta = -r * r * r * (wc * sum_dy_x) * inv;
        gamma = -r * (wc * sum_dy) * inv;
    }
    if (rank == 0 && threadIdx.x == 0) {
        using Out = typename AccOf<P>::type;
        if constexpr ((FLAGS & kWeight) != 0) narrow(static_cast<Out>(r * sum_dy_x), dw[c]);
        if constexpr ((FLAGS & kBias) != 0) narrow(static_cast<Out>(sum_dy), db[c]);
    }
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int v = first + i * THREADS;
        if (v < grp.vecs) {
            Vec<T, VEC> out;
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const A d = fma(alpha, static_cast<A>(widen(held_dy[i].v[j])),
                                fma(beta, static_cast<A>(widen(held_x[i].v[j])) - mu, gamma));
                narrow(d, out.v[j]);
            }
            store_vec_streaming<T, VEC>(dx + grp.offset<VEC>(v), out);
        }
    }
    if constexpr (CLUSTER > 1) cluster_wait();  // no block leaves while a peer may read its shared memory
}

}  // namespace cunorm
