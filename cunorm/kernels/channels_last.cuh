// channels_last.cuh: channel_partial's walk of channels-last x
// (channels.cu's header: the layouts, the thread layout, the partials).
// A 2-D block of rows of bx threads along a position's vectors (one tile of
// them), by rows over a chunk's positions; four positions in flight a
// thread; each thread's statistics combined across the rows through
// shared memory, then (grouped, paired) across a group's vectors by the
// thread of the group's first.
#pragma once
#include "channel_layout.cuh"
#include "reduce.cuh"

namespace cunorm {

// Positions first, first + stride, ... below end of a thread's channel
// vector (base: its first position's), four loads in flight: whole(in) for
// each four, one(in[u]) for each of the last up to three.
template <class T, int VEC, class Whole, class One>
__device__ __forceinline__ void for_each_four_positions(const T* base, long long first, long long end, int stride,
                                                        int channels, Whole whole, One one) {
#pragma unroll 1
    for (long long p0 = first; p0 < end; p0 += 4 * stride) {
        Vec<T, VEC> in[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            if (p0 + u * stride < end) in[u] = load_vec<T, VEC>(base + (p0 + u * stride) * channels);
        }
        if (p0 + 3 * stride < end) {
            whole(in);
        } else {
#pragma unroll
            for (int u = 0; u < 3; ++u) {
                if (p0 + u * stride < end) one(in[u]);
            }
        }
    }
}

template <class Norm, class T, int VEC, int LAYOUT>
__device__ __forceinline__ void channels_last_partial(const T* __restrict__ x, typename Norm::Stats* __restrict__ out,
                                                      const ChannelShape& cs, long long chunks, long long chunk_len,
                                                      const BlockLayout& bl) {
    using A = typename AccOf<T>::type;
    using Stats = typename Norm::Stats;
    const long long batch = cs.batch, spatial = cs.spatial;
    const int channels = cs.channels, channels_per_group = cs.channels_per_group;
    constexpr bool kGrouped = LAYOUT == kChannelsLastGrouped;
    constexpr bool kPaired = LAYOUT == kChannelsLastPaired;
    constexpr int kKept = kGrouped ? 1 : kPaired ? 2 : VEC;  // statistics a thread keeps
    extern __shared__ __align__(16) unsigned char shared_raw[];
    Stats* partials = reinterpret_cast<Stats*>(shared_raw);
    const int tx = bl.tx, ty = bl.ty, bx = bl.bx, by = bl.by;
    const int channel_vecs = channels / VEC;
    const int group_vecs = channels_per_group / VEC;  // (grouped)
#pragma unroll 1
    for (long long n = blockIdx.z; n < batch; n += gridDim.z)
#pragma unroll 1
    for (int tile = blockIdx.y; tile * bx < channel_vecs; tile += gridDim.y)
#pragma unroll 1
    for (long long chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
        const int cv = tile * bx + tx;
        const bool row = ty < by;  // (threads past the rows, padding the block to whole warps, idle)
        const bool active = row && cv < channel_vecs;
        Stats s[kKept];
        A pivot[kKept];
        // (paired: the vector's first `split` channels in its first group)
        const int split = kPaired ? paired_split<VEC>(cv * VEC, channels_per_group) : VEC;
#pragma unroll
        for (int j = 0; j < kKept; ++j) {
            s[j] = Norm::init();
            const int c = kPaired ? cv * VEC + min(j * split, VEC - 1) : cv * VEC + j;
            pivot[j] = active ? group_pivot<Norm, A, T, true>(x, cs, n, c) : A(0);
        }
        const long long begin = chunk * chunk_len;
        const long long end = min(begin + chunk_len, spatial);
        const T* base = x + n * spatial * channels + cv * VEC;
        if constexpr (kGrouped) {
            // Four positions in flight, each vector folded into the
            // thread's one statistic.
            if (active) {
                for_each_batched<4>(
                    begin + ty, end, by, [&](long long p) { return load_vec<T, VEC>(base + p * channels); },
                    [&](long long, const Vec<T, VEC>& in) { s[0] = fold<Norm, A, T, VEC>(s[0], in, pivot[0]); });
            }
        } else if (kPaired && active) {
            // each group's values among the four positions folded together
            // (two combines per four positions, not one a channel)
            const A first_rcp = A(1) / static_cast<A>(4 * split);
            const A second_rcp = split < VEC ? A(1) / static_cast<A>(4 * (VEC - split)) : A(0);
            for_each_four_positions<T, VEC>(
                base, begin + ty, end, by, channels,
                [&](const Vec<T, VEC> (&in)[4]) {
                    A v[4][VEC];
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        const A pivot_j = j < split ? pivot[0] : pivot[1];
#pragma unroll
                        for (int u = 0; u < 4; ++u) v[u][j] = static_cast<A>(widen(in[u].v[j])) - pivot_j;
                    }
                    Stats first, second;
                    Norm::of_split(v, split, first_rcp, second_rcp, first, second);
                    s[0] = Norm::combine(s[0], first);
                    if (split < VEC) s[1] = Norm::combine(s[1], second);
                },
                [&](const Vec<T, VEC>& in) {
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        // (selected, not indexed by a variable: the arrays stay in registers)
                        const A value = static_cast<A>(widen(in.v[j]));
                        if (j < split) s[0] = fold_one<Norm>(s[0], value - pivot[0]);
                        else s[1] = fold_one<Norm>(s[1], value - pivot[1]);
                    }
                });
        } else if (active) {
            // each channel's four values folded together (one combine per
            // four values: the combine is what bounds a 16-bit
            // channels-last pass otherwise)
            for_each_four_positions<T, VEC>(
                base, begin + ty, end, by, channels,
                [&](const Vec<T, VEC> (&in)[4]) {
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        const A v[4] = {static_cast<A>(widen(in[0].v[j])) - pivot[j],
                                        static_cast<A>(widen(in[1].v[j])) - pivot[j],
                                        static_cast<A>(widen(in[2].v[j])) - pivot[j],
                                        static_cast<A>(widen(in[3].v[j])) - pivot[j]};
                        s[j] = Norm::combine(s[j], Norm::of_values(v));
                    }
                },
                [&](const Vec<T, VEC>& in) {
#pragma unroll
                    for (int j = 0; j < VEC; ++j) s[j] = fold_one<Norm>(s[j], static_cast<A>(widen(in.v[j])) - pivot[j]);
                });
        }
        // Combine the by partials of each statistic in y order (layout
        // [y][j][x]: a warp's accesses on distinct banks).
        __syncthreads();
        if (row) {
#pragma unroll
            for (int j = 0; j < kKept; ++j) partials[(ty * kKept + j) * bx + tx] = s[j];
        }
        __syncthreads();
        if (ty == 0 && active) {
#pragma unroll
            for (int j = 0; j < kKept; ++j) {
                Stats total = partials[j * bx + tx];
                for (int yy = 1; yy < by; ++yy) total = Norm::combine(total, partials[(yy * kKept + j) * bx + tx]);
                if constexpr (kGrouped || kPaired) {
                    partials[j * bx + tx] = total;  // the column's total (each thread its own)
                } else {
                    out[(n * chunks + chunk) * channels + cv * VEC + j] = total;
                }
            }
        }
        if constexpr (kGrouped) {
            // then a group's columns in order, by the thread of its first
            // vector (the dispatch keeps a group's vectors in one tile)
            __syncthreads();
            if (ty == 0 && active && cv % group_vecs == 0) {
                Stats total = partials[tx];
                for (int k = 1; k < group_vecs; ++k) total = Norm::combine(total, partials[tx + k]);
                out[(n * chunks + chunk) * cs.groups + cv / group_vecs] = total;
            }
        }
        if constexpr (kPaired) {
            // then each group's columns in order, by the thread of the
            // vector its first channel lies in (the dispatch keeps a
            // position's vectors in one tile); in the vectors after
            // that one the group is the first (column 0)
            __syncthreads();
            if (ty == 0 && active) {
                const int c0 = cv * VEC;
#pragma unroll
                for (int k = 0; k < 2; ++k) {
                    if (k == 0 ? c0 % channels_per_group != 0 : split == VEC) continue;
                    const int g = c0 / channels_per_group + k;
                    const int last = ((g + 1) * channels_per_group - 1) / VEC;
                    Stats total = partials[k * bx + tx];
                    for (int v = cv + 1; v <= last; ++v) total = Norm::combine(total, partials[v - cv + tx]);
                    out[(n * chunks + chunk) * cs.groups + g] = total;
                }
            }
        }
    }
}

}  // namespace cunorm
