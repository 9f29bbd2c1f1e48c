// onchip.cu: channel_onchip, the channel family's one-read walk for
// statistic groups that fit on chip (cunorm/kernels/channels.cu has the
// layouts and the other walks; same statistic, same epilogue), and the
// thread-block cluster helpers it uses.
#include "reduce.cuh"

namespace cunorm {

// Thread-block clusters (sm_90): a kernel declares its cluster size at
// compile time, so a plain launch forms the clusters (CuPy has no
// cuLaunchKernelEx). Older architectures compile only CLUSTER == 1.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CUNORM_CLUSTER_DIMS(k) __cluster_dims__(k, 1, 1)
#else
#define CUNORM_CLUSTER_DIMS(k)
#endif

// The generic address of *p in the shared memory of block `rank` of this
// block's cluster.
template <class S>
__device__ __forceinline__ const S* cluster_peer(const S* p, unsigned int rank) {
    unsigned long long out;
    asm volatile("mapa.u64 %0, %1, %2;" : "=l"(out) : "l"(reinterpret_cast<unsigned long long>(p)), "r"(rank));
    return reinterpret_cast<const S*>(out);
}
__device__ __forceinline__ unsigned int cluster_rank() {
    unsigned int r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// Cluster barrier in two halves: arrive (releasing this block's shared
// memory writes) and wait (acquiring the others').
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

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
// Vector v of the group is held by block v / (THREADS * ITEMS) of the
// cluster, item (v / THREADS) % ITEMS, thread v % THREADS (coalesced). The
// blocks of a cluster exchange their sums through distributed shared memory
// (onchip_sum). Block rank 0 writes the returned statistics and BatchNorm's
// running estimates. y is stored with the streaming hint (st.global.cs).
// The regime: groups of at most CLUSTER * THREADS * ITEMS vectors (the
// dispatch), every load of a thread in flight at once, nothing read twice.
template <class T, class P, int FLAGS, int VEC, bool CHANNELS_LAST, class Y, int THREADS, int ITEMS, int CLUSTER>
__global__ void __launch_bounds__(THREADS) CUNORM_CLUSTER_DIMS(CLUSTER)
channel_onchip(const T* __restrict__ x, Y* __restrict__ y, const P* __restrict__ w, const P* __restrict__ b,
               typename AccOf<T>::type* mean_out, typename AccOf<T>::type* rstd_out,
               typename AccOf<T>::type* running_mean, typename AccOf<T>::type* running_var, int rows, int row_vecs,
               long long row_stride, long long sample_stride, long long group_stride, int spatial_vecs,
               int channels_per_group, int groups, typename AccOf<T>::type eps, typename AccOf<T>::type momentum) {
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
    const int group_vecs = rows * row_vecs;  // under 2**31 (the dispatch)
    const int first = static_cast<int>(rank) * THREADS * ITEMS + static_cast<int>(threadIdx.x);
    // element offset of the group's vector v (v < group_vecs; a 32-bit division)
    auto offset_of = [&](int v) {
        const int r = static_cast<int>(static_cast<unsigned int>(v) / static_cast<unsigned int>(row_vecs));
        return (base + r * row_stride + (v - r * row_vecs)) * VEC;
    };
    Vec<T, VEC> held[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int v = first + i * THREADS;
        if (v < group_vecs) held[i] = load_vec<T, VEC>(x + offset_of(v));
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
            ParamVec<P, FLAGS, VEC> p;
            if constexpr ((FLAGS & (kWeight | kBias)) != 0) {
                const int r = static_cast<int>(static_cast<unsigned int>(v) / static_cast<unsigned int>(row_vecs));
                const int col = v - r * row_vecs;
                if constexpr (CHANNELS_LAST) {
                    p = load_params<P, FLAGS, VEC>(w, b, first_channel + col * VEC);
                } else {
                    const int c = first_channel + col / spatial_vecs;
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        if constexpr ((FLAGS & kWeight) != 0) p.w.v[j] = w[c];
                        if constexpr ((FLAGS & kBias) != 0) p.b.v[j] = b[c];
                    }
                }
            }
            store_vec_streaming<Y, VEC>(y + offset_of(v), normalized<T, P, FLAGS, VEC, A, Y>(held[i], p, f, pivot));
        }
    }
    if constexpr (CLUSTER > 1) cluster_wait();  // no block leaves while a peer may read its shared memory
}

}  // namespace cunorm
