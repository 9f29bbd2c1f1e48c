// cluster.cuh: thread-block cluster helpers (sm_90): the cluster's shape
// declared on the kernel, a block's rank, its peers' shared memory and the
// cluster barrier. Used by onchip.cu and backward.cu.
#pragma once

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

}  // namespace cunorm
