// channel_stream.cu: GroupNorm and InstanceNorm with parameters on
// channels-first x larger than L2, x read from DRAM once (the channel
// family's layouts and policies: channels.cu).
#include "reduce.cuh"

namespace cunorm {

// Loads a partial written by another block of the same launch: through L2
// (ld.global.cg), never a stale L1 line.
template <class A, class Stats>
__device__ __forceinline__ Stats load_stats_cg(const Stats* p) {
    static_assert(sizeof(Stats) % sizeof(A) == 0, "Stats holds A words only");
    Stats s;
    A* dst = reinterpret_cast<A*>(&s);
    const A* src = reinterpret_cast<const A*>(p);
#pragma unroll
    for (int k = 0; k < static_cast<int>(sizeof(Stats) / sizeof(A)); ++k) dst[k] = __ldcg(src + k);
    return s;
}

// channel_stream: GroupNorm and InstanceNorm on channels-first x with x read
// from DRAM once. Same math as channel_partial + channel_finalize +
// channel_apply; what differs is the schedule.
//
// A statistic group (sample n, group g) is a contiguous row of group_vecs
// vectors (channels_per_group planes of spatial_vecs). Rows are cut into
// row_tiles tiles of tile_vecs vectors, and consecutive tiles into slabs of
// slab_tiles (whole groups). Blocks take tickets from an atomic counter, in
// order, and the tickets walk
//     partial tiles of slabs 0 .. lag-1,
//     then for each later slab s: its partial tiles alternating with the
//       apply tiles of slab s - lag,
//     then the apply tiles of the last lag slabs,
// so a slab is re-read lag slabs after it was first read, while it is still
// in L2 (the dispatch sizes the slabs so that lag + 1 of them fit). A partial
// tile stores its statistic; the block that completes a group's last tile
// (the group's arrival counter) combines the group's tiles in tile order
// (bitwise reproducible) into (pivot, center, scale) and releases the
// group's ready flag, on which its apply tiles wait. No deadlock without
// co-residency: an apply ticket waits only on partial tickets taken earlier
// by running blocks, which never wait.
//
// 256 threads a block, a tile's vectors strided over them, 4 loads in flight
// per thread; a block takes its next ticket while it works on the current
// one. hints & 1: y stored with the streaming hint (st.global.cs); hints & 2:
// the apply tile's x loaded as a last use (ld.global.cs). 16-byte vectors.
// sync (zeroed before the launch): [0] the ticket counter, [1 + i] the
// arrivals of group i, [1 + groups_total + i] its ready flag.
// Three blocks an SM (80 registers): with an activation's epilogue the
// kernel took 88 and two blocks, and GroupNorm(32) + SiLU bf16
// (8,512,128,128) ran at 233 us against 135 us without it; at three, 189 us
// (docs/notes/channel-norms.md). y in float32 from 16-bit x with an
// activation spilled at 80: two.
template <class T, class STORE>
__host__ __device__ constexpr int stream_min_blocks() {
    return (sizeof(typename STORE::Out) > sizeof(T) && STORE::kActivated) ? 2 : 3;
}

template <template <class> class NormT, class T, class STORE, int VEC>
__global__ void __launch_bounds__(256, stream_min_blocks<T, STORE>())
channel_stream(const T* __restrict__ x, const typename STORE::Param* __restrict__ w,
               const typename STORE::Param* __restrict__ b, typename STORE::Out* __restrict__ y,
               typename AccOf<T>::type* partial, typename AccOf<T>::type* affine, typename AccOf<T>::type* mean_out,
               typename AccOf<T>::type* rstd_out, unsigned int* sync, long long groups_total, long long group_vecs,
               long long spatial_vecs, int channels_per_group, int groups, long long tile_vecs, long long row_tiles,
               long long slab_tiles, long long lag_slabs, int hints, typename AccOf<T>::type eps) {
    grid_dependency_sync();
    using A = typename AccOf<T>::type;
    using Norm = NormT<A>;
    using Stats = typename Norm::Stats;
    __shared__ Stats scratch[33];
    __shared__ unsigned int next_ticket;
    __shared__ int completes_group;
    Stats* parts = reinterpret_cast<Stats*>(partial);
    unsigned int* arrivals = sync + 1;
    unsigned int* ready = sync + 1 + groups_total;
    // Tickets and tiles are under 2**31 (the dispatch; the counter also
    // counts each block's last, unused ticket): 32-bit divisions (a 64-bit
    // one is a call, around which ptxas spills).
    const unsigned int tiles = static_cast<unsigned int>(groups_total * row_tiles);
    const unsigned int row_tiles32 = static_cast<unsigned int>(row_tiles);
    const unsigned int slab = static_cast<unsigned int>(slab_tiles);
    const unsigned int slabs = (tiles + slab - 1) / slab;
    const unsigned int lag = static_cast<unsigned int>(min(lag_slabs, static_cast<long long>(slabs)));
    const unsigned int tickets = 2 * slabs * slab;  // the last slab padded: its missing tiles are skipped
    const unsigned int middle = (slabs - lag) * 2 * slab;
    if (threadIdx.x == 0) next_ticket = atomicAdd(sync, 1u);
    __syncthreads();
    unsigned int ticket = next_ticket;
#pragma unroll 1
    while (ticket < tickets) {
        __syncthreads();  // every thread has read next_ticket
        if (threadIdx.x == 0) next_ticket = atomicAdd(sync, 1u);
        bool apply;
        unsigned int tile;
        if (ticket < lag * slab) {
            apply = false;
            tile = ticket;
        } else if (ticket - lag * slab < middle) {
            const unsigned int k = ticket - lag * slab;
            const unsigned int phase = k / (2 * slab);
            const unsigned int r = k - phase * 2 * slab;
            apply = (r & 1u) != 0;
            tile = (phase + (apply ? 0 : lag)) * slab + (r >> 1);
        } else {
            apply = true;
            tile = (slabs - lag) * slab + (ticket - lag * slab - middle);
        }
        if (tile < tiles) {  // uniform across the block
            const unsigned int group32 = tile / row_tiles32;
            const long long group = group32;
            const long long begin = static_cast<long long>(tile - group32 * row_tiles32) * tile_vecs;
            const long long end = min(begin + tile_vecs, group_vecs);
            const T* row = x + group * group_vecs * VEC;
            if (!apply) {
                const A pivot = Norm::kShifted ? static_cast<A>(widen(row[0])) : A(0);
                Stats s = Norm::init();
                for_each_batched<4>(
                    begin + threadIdx.x, end, blockDim.x, [&](long long v) { return load_vec<T, VEC>(row + v * VEC); },
                    [&](long long, const Vec<T, VEC>& in) { s = fold<Norm, A, T, VEC>(s, in, pivot); });
                s = block_reduce<Norm, 8>(s, scratch);
                if (threadIdx.x == 0) {
                    parts[tile] = s;
                    __threadfence();
                    completes_group = atomicAdd(arrivals + group, 1u) == static_cast<unsigned int>(row_tiles - 1);
                }
                __syncthreads();
                if (completes_group) {
                    __threadfence();
                    Stats t = Norm::init();
                    for (long long m = threadIdx.x; m < row_tiles; m += blockDim.x) {
                        t = Norm::combine(t, load_stats_cg<A>(parts + group * row_tiles + m));
                    }
                    t = block_reduce<Norm, 8>(t, scratch);
                    if (threadIdx.x == 0) {
                        const Affine<A> f = Norm::finalize(t, group_vecs * VEC, eps);
                        affine[3 * group] = pivot;
                        affine[3 * group + 1] = f.center;
                        affine[3 * group + 2] = f.scale;
                        store_stats(mean_out, rstd_out, group, f, pivot);
                        __threadfence();
                        store_release(ready + group, 1u);
                    }
                }
            } else {
                if (threadIdx.x == 0) {
                    while (load_acquire(ready + group) == 0u) __nanosleep(64);
                }
                __syncthreads();
                const A pivot = __ldcg(affine + 3 * group);
                const Affine<A> f{__ldcg(affine + 3 * group + 1), __ldcg(affine + 3 * group + 2)};
                const int first_channel = static_cast<int>(group32 % static_cast<unsigned int>(groups)) *
                                          channels_per_group;
                typename STORE::Out* out = y + group * group_vecs * VEC;
                for_each_batched<4>(
                    begin + threadIdx.x, end, blockDim.x,
                    [&](long long v) { return load_vec_hinted<T, VEC>(row + v * VEC, hints); },
                    [&](long long v, const Vec<T, VEC>& in) {
                        typename STORE::template Scalars<A> p{A(1), A(0)};
                        if constexpr (STORE::kParamBytes != 0) {
                            // group_vecs < 2**31 (the dispatch): a 32-bit division
                            const int c = first_channel + static_cast<int>(static_cast<unsigned int>(v) /
                                                                           static_cast<unsigned int>(spatial_vecs));
                            p = STORE::template channel<A>(w, b, c);
                        }
                        Vec<typename STORE::Out, VEC> o;
#pragma unroll
                        for (int j = 0; j < VEC; ++j) {
                            STORE::template element<T>(static_cast<A>(widen(in.v[j])) - pivot, f, p, o.v[j]);
                        }
                        store_vec_hinted(out + v * VEC, o, hints);
                    });
            }
        }
        __syncthreads();  // next_ticket is written
        ticket = next_ticket;
    }
}

}  // namespace cunorm
