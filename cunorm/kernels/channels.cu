// channels.cu: the channel family, for norms whose statistic groups are sets
// of whole channels: GroupNorm and InstanceNorm (a group of channels of one
// sample) and BatchNorm (one channel across the batch). Same policies as the
// row family (norms.cuh); what differs is the walk.
//
// x is dense in one of two physical layouts, of `batch` samples, `channels`
// channels and `spatial` positions (the product of the spatial axes, 1 for
// none):
//   channels-first  (batch, channels, spatial), NCHW: a channel's positions
//                   are contiguous;
//   channels-last   (batch, spatial, channels), NHWC: a position's channels
//                   are contiguous.
// Statistic group g holds channels [g * channels_per_group, (g + 1) *
// channels_per_group), of one sample (per_sample != 0: GroupNorm,
// InstanceNorm) or of every sample (BatchNorm); its index is
// (per_sample ? n : 0) * groups + g. Shifted policies (LayerNorm) shift every
// value by the group's first element (the pivot), as the row family does.
//
// Three launches, x read twice and y written once (the floor of a statistic
// too big to keep on chip):
//   channel_partial   the statistic of every (sample, channel, chunk of the
//                     positions), to a workspace;
//   channel_finalize  a block per statistic group combines the group's
//                     partials in a fixed order (bitwise reproducible) into
//                     (pivot, center, scale) for channel_apply, writes the
//                     returned statistics and updates BatchNorm's running
//                     estimates;
//   channel_apply     y = (x - pivot - center) * scale [* w[c]] [+ b[c]],
//                     walked in the reverse of channel_partial's order, so
//                     that what channel_partial read last is re-read from L2.
// Channels-first per-sample groups of few partials in plane rows skip
// channel_finalize: channel_apply's rows combine their group's partials
// themselves (two launches; the dispatch's apply_finalizes).
// channel_from_running replaces the first two for BatchNorm in eval mode.
// Groups that fit on chip take channel_onchip instead (onchip.cu: one read),
// and GroupNorm/InstanceNorm with parameters on x larger than L2
// channel_stream (channel_stream.cu: one read from DRAM).
// channel_apply's hints: 1, y stored with the streaming hint (st.global.cs);
// 2, x loaded as a last use (ld.global.cs); 16-byte vectors only.
//
// Layouts (the LAYOUT template argument of the three launches):
//   kChannelsFirst        NCHW;
//   kChannelsLast         NHWC, a statistic per channel of a thread's vector;
//   kChannelsLastGrouped  NHWC, per-sample statistics (GroupNorm,
//                         InstanceNorm) where a vector's channels lie in one
//                         group (channels_per_group a multiple of VEC, a
//                         group's vectors within one tile of the block): a
//                         thread keeps one statistic, and the partials are
//                         per (sample, chunk, group).
//   kChannelsLastPaired   NHWC, per-sample statistics where a vector may
//                         straddle two groups (channels_per_group at least
//                         VEC, not a multiple of it; a position's vectors in
//                         one tile): a thread keeps the statistics of its
//                         vector's first group and of the group after it,
//                         partials as kChannelsLastGrouped's (whose
//                         channel_finalize combines them). GroupNorm(32) of
//                         320 or 960 channels, 16-byte vectors.
//
// Thread layouts. Channels-first: a 256-thread block per (sample, channel,
// chunk), walking the chunk's contiguous vectors; or, for planes of few
// vectors (a channel's positions of one sample), "plane rows": a 2-D layout
// (common.cuh's BlockLayout) of (bx <= 32, 256 / bx), a row of bx threads
// per channel, whole planes (one chunk), reduced within the row by
// shuffles. Channels-last: a 2-D layout of 256, tx along the channels in
// vectors of VEC (up to 256 vectors: a row of threads reads a position's
// channels, contiguous, and the block several consecutive positions), ty
// over the chunk's positions; the partials combined across y (then, grouped
// or paired, across a group's vectors) through shared memory
// (channels_last.cuh). The paired apply takes its own chunks and vectors
// (the dispatch's): it reads no partial.
// A channels-last block is launched as whole warps (XLA's launches count
// threads in warps): threads past its by rows idle.
// Grids are 3-D (x: chunk, y: channel or channel tile, z: sample) walked with
// strided loops, so no 64-bit division is needed.
#include "channels_last.cuh"

namespace cunorm {

// Every (sample, first channel of the block's `rows`, chunk) of a
// channels-first grid, grid-strided; the block's row y takes channel c0 + y
// (which may be past the last channel). The bounds are uniform across a
// block, so f may hold barriers.
template <class F>
__device__ __forceinline__ void for_each_channel_chunk(long long batch, int channels, long long chunks, int rows,
                                                       F f) {
#pragma unroll 1
    for (long long n = blockIdx.z; n < batch; n += gridDim.z)
#pragma unroll 1
        for (int c0 = blockIdx.y * rows; c0 < channels; c0 += gridDim.y * rows)
#pragma unroll 1
            for (long long chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) f(n, c0, chunk);
}

// Partial statistics. Channels-first: partial[(n * channels + c) * chunks +
// chunk]; channels-last: partial[(n * chunks + chunk) * channels + c];
// grouped and paired: partial[(n * chunks + chunk) * groups + g]. A chunk is
// chunk_len positions (vectors of VEC positions when channels-first).
// Dynamic shared memory (channels-last): by * bx * (grouped ? 1 : paired ? 2
// : VEC) Stats.
// Five blocks an SM channels-first (48 registers, no spills): GroupNorm(32)
// bf16 (16,320,64,64) is 640 plane-row blocks, one wave at five, 1.21 at
// the four that 62 registers allowed (docs/notes/channel-norms.md).
// float64 at four: its LayerNorm statistics of two-element vectors need more
// than five blocks' 48 registers on sm_80 (they spilled there).
template <class T, int LAYOUT>
__host__ __device__ constexpr int partial_min_blocks() {
    return LAYOUT != kChannelsFirst ? 2 : sizeof(T) == 8 ? 4 : 5;
}

template <template <class> class NormT, class T, int VEC, int LAYOUT>
__global__ void __launch_bounds__(256, partial_min_blocks<T, LAYOUT>())
channel_partial(const T* __restrict__ x, typename AccOf<T>::type* __restrict__ partial, long long batch,
                long long spatial, int channels, int channels_per_group, int per_sample, long long chunks,
                long long chunk_len, int block_x) {
    grid_dependency_sync();
    const BlockLayout bl = block_layout(block_x);
    using A = typename AccOf<T>::type;
    using Norm = NormT<A>;
    using Stats = typename Norm::Stats;
    const ChannelShape cs = channel_shape(batch, spatial, channels, channels_per_group, per_sample);
    Stats* out = reinterpret_cast<Stats*>(partial);
    if constexpr (LAYOUT == kChannelsFirst) {
        __shared__ Stats scratch[33];
        const long long spatial_vecs = spatial / VEC;
        const int rows = bl.by;  // planes a block: 1, or 256 / bl.bx (plane rows, bl.bx <= 32)
        for_each_channel_chunk(batch, channels, chunks, rows, [&](long long n, int c0, long long chunk) {
            const int c = c0 + bl.ty;
            const bool active = c < channels;
            Stats s = Norm::init();
            if (active) {
                const T* row = x + (n * channels + c) * spatial;
                const A pivot = group_pivot<Norm, A, T, false>(x, cs, n, c);
                const long long begin = chunk * chunk_len;
                const long long end = min(begin + chunk_len, spatial_vecs);
                for_each_batched<4>(
                    begin + bl.tx, end, bl.bx,
                    [&](long long v) { return load_vec<T, VEC>(row + v * VEC); },
                    [&](long long, const Vec<T, VEC>& in) { s = fold<Norm, A, T, VEC>(s, in, pivot); });
            }
            // every lane reaches the reduction: the bounds are uniform across the block
            s = rows == 1 ? block_reduce<Norm>(s, scratch) : group_reduce<Norm>(s, bl.bx);
            if (active && bl.tx == 0) out[(n * channels + c) * chunks + chunk] = s;
        });
    } else {
        channels_last_partial<Norm, T, VEC, LAYOUT>(x, out, cs, chunks, chunk_len, bl);
    }
}

// The partials of statistic group g of sample n0 (and of the samples after
// it, samples_in_group of them: BatchNorm's groups span the batch) that
// lane `lane` of `width` combines: members lane, lane + width, ... of the
// (sample, member) order, in that order. The lanes' results combined
// across them (group_reduce, block_reduce) are the group's statistic, the
// same wherever the same width combines them.
template <class Norm, int LAYOUT>
__device__ __forceinline__ typename Norm::Stats lane_partials(const typename Norm::Stats* parts,
                                                              const ChannelShape& cs, long long n0, int g,
                                                              long long samples_in_group, int per_sample_members,
                                                              long long chunks, int lane, int width) {
    typename Norm::Stats s = Norm::init();
    const int c0 = g * cs.channels_per_group;
    const long long members = samples_in_group * per_sample_members;
#pragma unroll 1
    for (long long i = lane; i < members; i += width) {
        const long long k = i / per_sample_members;
        const int m = static_cast<int>(i - k * per_sample_members);
        const long long n = n0 + k;
        if constexpr (LAYOUT == kChannelsFirst) {
            // contiguous: (n, c0 .. c0 + cpg, every chunk)
            s = Norm::combine(s, parts[(n * cs.channels + c0) * chunks + m]);
        } else if constexpr (LAYOUT == kChannelsLastGrouped) {
            s = Norm::combine(s, parts[(n * chunks + m) * cs.groups + g]);
        } else {
            // chunk by chunk, the group's channels contiguous in each
            const int chunk = m / cs.channels_per_group;
            const int c = m - chunk * cs.channels_per_group;
            s = Norm::combine(s, parts[(n * chunks + chunk) * cs.channels + c0 + c]);
        }
    }
    return s;
}

// A block, or a row of bx <= 32 threads of a 2-D layout (groups of
// few partials), per statistic group: combine its partials (for each
// sample of the group, its channels and chunks) in a fixed order, then
//   affine[3 g .. 3 g + 2] = (pivot, center, scale) for channel_apply,
//   mean_out[g] = pivot + center, rstd_out[g] = scale   (when not null),
//   running_mean[g], running_var[g] (when not null; BatchNorm, a group per
//     channel): running = (1 - momentum) * running + momentum * statistic,
//     the variance unbiased (count / (count - 1)).
template <template <class> class NormT, class T, int LAYOUT>
__global__ void __launch_bounds__(256, 2)
channel_finalize(const T* __restrict__ x, const typename AccOf<T>::type* __restrict__ partial,
                 typename AccOf<T>::type* running_mean, typename AccOf<T>::type* running_var,
                 typename AccOf<T>::type* __restrict__ affine, typename AccOf<T>::type* mean_out,
                 typename AccOf<T>::type* rstd_out, long long batch, long long spatial, int channels,
                 int channels_per_group, int per_sample, long long chunks, typename AccOf<T>::type eps,
                 typename AccOf<T>::type momentum, int block_x) {
    grid_dependency_sync();
    const BlockLayout bl = block_layout(block_x);
    using A = typename AccOf<T>::type;
    using Norm = NormT<A>;
    using Stats = typename Norm::Stats;
    __shared__ Stats scratch[33];
    const ChannelShape cs = channel_shape(batch, spatial, channels, channels_per_group, per_sample);
    const Stats* parts = reinterpret_cast<const Stats*>(partial);
    // 32-bit indices below: the dispatch keeps the group count and a group's
    // partials of one sample under 2**31.
    const int group_count = static_cast<int>((per_sample ? batch : 1) * cs.groups);
    const long long samples_in_group = per_sample ? 1 : batch;
    // A sample's partials of one group: channels_per_group * chunks of them
    // (grouped: chunks).
    const int per_sample_members =
        static_cast<int>(LAYOUT == kChannelsLastGrouped ? chunks : channels_per_group * chunks);
    const int rows = bl.by;  // groups a block: 1, or 256 / bl.bx (bl.bx <= 32)
#pragma unroll 1
    for (int group0 = blockIdx.x * rows; group0 < group_count; group0 += gridDim.x * rows) {
        // the bounds are uniform across the block (the reduction's barriers)
        const int group = min(group0 + bl.ty, group_count - 1);
        const bool active = group0 + bl.ty < group_count;
        const int n0 = per_sample ? group / cs.groups : 0;
        const int g = group - n0 * cs.groups;
        const int c0 = g * channels_per_group;
        // The group's partials, (sample, member) flattened and strided over
        // the threads (BatchNorm's 64 samples of one partial each: one
        // thread walking the samples in turn spent 28-36 us on ResNet-50's
        // activations, a chain of dependent loads).
        Stats s = lane_partials<Norm, LAYOUT>(parts, cs, n0, g, samples_in_group, per_sample_members, chunks, bl.tx,
                                              bl.bx);
        s = rows == 1 ? block_reduce<Norm>(s, scratch) : group_reduce<Norm>(s, bl.bx);
        if (active && bl.tx == 0) {
            const long long count = samples_in_group * channels_per_group * spatial;
            const Affine<A> f = Norm::finalize(s, count, eps);
            const A pivot = group_pivot<Norm, A, T, LAYOUT != kChannelsFirst>(x, cs, n0, c0);
            affine[3 * group] = pivot;
            affine[3 * group + 1] = f.center;
            affine[3 * group + 2] = f.scale;
            store_stats(mean_out, rstd_out, group, f, pivot);
            if (running_mean != nullptr) {
                running_mean[group] = (A(1) - momentum) * running_mean[group] + momentum * (pivot + f.center);
            }
            if (running_var != nullptr) {
                const A unbiased = Norm::unbiased_variance(s, count);
                running_var[group] = (A(1) - momentum) * running_var[group] + momentum * unbiased;
            }
        }
    }
}

// BatchNorm in eval mode: affine[3 c ..] = (0, running_mean[c],
// rsqrt(running_var[c] + eps)), and the returned statistics.
template <class A>
__global__ void __launch_bounds__(256, 2)
channel_from_running(const A* __restrict__ running_mean, const A* __restrict__ running_var, A* __restrict__ affine,
                     A* mean_out, A* rstd_out, int channels, A eps) {
    grid_dependency_sync();
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < channels; c += gridDim.x * blockDim.x) {
        const Affine<A> f{running_mean[c], rsqrt(running_var[c] + eps)};
        affine[3 * c] = A(0);
        affine[3 * c + 1] = f.center;
        affine[3 * c + 2] = f.scale;
        store_stats(mean_out, rstd_out, c, f, A(0));
    }
}

// y = (x - pivot - center) * scale [* w[c]] [+ b[c]] with the (pivot,
// center, scale) of the element's statistic group; same grid and block
// shapes as channel_partial, chunks of chunk_len positions (vectors of VEC
// positions when channels-first). STORE: the store stage (stages.cuh), its
// parameters per channel; y's storage type STORE::Out is T's or float for
// 16-bit T (GroupNorm under autocast reads bf16 and returns float32, with
// no cast pass before it).
// With running_var not null (BatchNorm in eval mode, no statistics
// returned: one launch, no workspace), a channel's (0, center, scale) is
// (0, running_mean[c], rsqrt(running_var[c] + eps)), as
// channel_from_running writes it, and affine is not read.
// With partial not null (channels-first, per-sample groups: the dispatch's
// choice), channel_finalize's work is done here and that launch skipped:
// each row of threads combines its channel's group's partials in a fixed
// order (lane_partials over the row's lanes, then across them: every row
// of a group gets the same bits), and the row of the group's first channel
// and first chunk writes mean_out and rstd_out; affine is not read.
// Three blocks an SM channels-first (80 registers, 32-bit indices within a
// chunk): at two, GroupNorm(32) + SiLU bf16 (16,320,64,64) spent 42 us in
// this launch against 33 (docs/notes/channel-norms.md). Paired, vectors of
// up to 8 bytes (the dispatch's choice: tuning.paired_apply_vec_bytes) at
// three too, the dispatch's one wave (GELU took 88-90 registers at two).
template <class T, int VEC, int LAYOUT>
__host__ __device__ constexpr int apply_min_blocks() {
    return LAYOUT == kChannelsFirst || (LAYOUT == kChannelsLastPaired && VEC * sizeof(T) <= 8) ? 3 : 2;
}

template <class T, class STORE, int VEC, int LAYOUT>
__global__ void __launch_bounds__(256, apply_min_blocks<T, VEC, LAYOUT>())
channel_apply(const T* __restrict__ x, const typename STORE::Param* __restrict__ w,
              const typename STORE::Param* __restrict__ b, const typename AccOf<T>::type* __restrict__ affine,
              const typename AccOf<T>::type* __restrict__ running_mean,
              const typename AccOf<T>::type* __restrict__ running_var,
              const typename AccOf<T>::type* __restrict__ partial, typename STORE::Out* __restrict__ y,
              typename AccOf<T>::type* __restrict__ mean_out, typename AccOf<T>::type* __restrict__ rstd_out,
              long long batch, long long spatial, int channels, int channels_per_group, int per_sample,
              long long chunks, long long chunk_len, typename AccOf<T>::type eps, int hints, int block_x) {
    grid_dependency_sync();
    const BlockLayout bl = block_layout(block_x);
    using A = typename AccOf<T>::type;
    using Y = typename STORE::Out;
    using Scalars = typename STORE::template Scalars<A>;
    const int groups = channels / channels_per_group;
    auto params_of = [&](long long n, int c, Affine<A>& f, A& pivot, Scalars& p) {
        if (running_var != nullptr) {
            pivot = A(0);
            f = Affine<A>{running_mean[c], rsqrt(running_var[c] + eps)};
        } else {
            const long long group = (per_sample ? n : 0) * groups + c / channels_per_group;
            pivot = affine[3 * group];
            f = Affine<A>{affine[3 * group + 1], affine[3 * group + 2]};
        }
        p = STORE::template channel<A>(w, b, c);
    };
    // The work in the reverse of channel_partial's order: the blocks from
    // the last (sample, channel, chunk), each walking its chunk from the
    // end, so the first x read is what channel_partial read last, still in
    // L2 (1-4% of the GPU time where x is a few times L2's size:
    // docs/notes/channel-norms.md).
    if constexpr (LAYOUT == kChannelsFirst) {
        const long long spatial_vecs = spatial / VEC;
        const int last_c0 = (channels - 1) / bl.by * bl.by;
        for_each_channel_chunk(batch, channels, chunks, bl.by, [&](long long n_, int c0_, long long chunk_) {
            const long long n = batch - 1 - n_, chunk = chunks - 1 - chunk_;
            const int c0 = last_c0 - c0_;
            const int c = c0 + bl.ty;
            Affine<A> f;
            A pivot;
            Scalars p;
            if (partial != nullptr) {
                // the finalize's work for this row's group (every lane of
                // the block reaches the reduction: the bounds are uniform)
                using Norm = LayerNorm<A>;  // (the channel family's statistic: CHANNEL_NORM)
                __shared__ typename Norm::Stats scratch[33];
                const ChannelShape cs = channel_shape(batch, spatial, channels, channels_per_group, 1);
                const int g = min(c, channels - 1) / channels_per_group;
                auto s = lane_partials<Norm, kChannelsFirst>(reinterpret_cast<const typename Norm::Stats*>(partial),
                                                             cs, n, g, 1, static_cast<int>(channels_per_group * chunks),
                                                             chunks, bl.tx, bl.bx);
                s = bl.by == 1 ? block_reduce<Norm>(s, scratch) : group_reduce<Norm>(s, bl.bx);
                if (c >= channels) return;  // no barrier below
                f = Norm::finalize(s, channels_per_group * spatial, eps);
                pivot = group_pivot<Norm, A, T, false>(x, cs, n, c);
                p = STORE::template channel<A>(w, b, c);
                if (bl.tx == 0 && chunk == 0 && c == g * channels_per_group) {
                    store_stats(mean_out, rstd_out, n * groups + g, f, pivot);
                }
            } else {
                if (c >= channels) return;  // no barrier below
                params_of(n, c, f, pivot, p);
            }
            // the chunk's vectors by 32-bit indices from its first (a
            // chunk is a plane of plane rows, an apply tile of under 2048
            // vectors or, folded, at most channel_max_chunk_bytes): fewer
            // registers than 64-bit ones, for three blocks an SM without
            // spills
            const long long begin = chunk * chunk_len;
            const int len = static_cast<int>(min(chunk_len, spatial_vecs - begin));
            const long long first = (n * channels + c) * spatial + begin * VEC;
            const T* xs = x + first;
            Y* ys = y + first;
            const int last = len - 1;  // (v = last - u walks the chunk from its end)
            for_each_batched<4, int>(
                bl.tx, len, bl.bx, [&](int u) { return load_vec_hinted<T, VEC>(xs + (last - u) * VEC, hints); },
                [&](int u, const Vec<T, VEC>& in) {
                    Vec<Y, VEC> o;
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        STORE::template element<T>(static_cast<A>(widen(in.v[j])) - pivot, f, p, o.v[j]);
                    }
                    store_vec_hinted<Y, VEC>(ys + (last - u) * VEC, o, hints);
                });
        });
    } else {
        const int tx = bl.tx, ty = bl.ty, bx = bl.bx, by = bl.by;
        const int channel_vecs = channels / VEC;
        const int last_tile = (channel_vecs - 1) / bx;
#pragma unroll 1
        for (long long n_ = blockIdx.z; n_ < batch; n_ += gridDim.z)
#pragma unroll 1
        for (int tile_ = blockIdx.y; tile_ * bx < channel_vecs; tile_ += gridDim.y) {
            const long long n = batch - 1 - n_;
            const int tile = last_tile - tile_;
            const int cv = tile * bx + tx;
            if (cv >= channel_vecs || ty >= by) continue;  // (ty >= by: a padding thread) no barrier below
            // grouped (per-sample statistics, no running buffers): one
            // group's (pivot, center, scale) for the vector's channels;
            // paired: two groups', the first `split` channels' and the rest's
            constexpr bool kGrouped = LAYOUT == kChannelsLastGrouped;
            constexpr bool kPaired = LAYOUT == kChannelsLastPaired;
            constexpr int kGroupParams = kGrouped ? 1 : kPaired ? 2 : VEC;
            const int split = kPaired ? paired_split<VEC>(cv * VEC, channels_per_group) : VEC;
            Affine<A> f[kGroupParams];
            A pivot[kGroupParams];
            Scalars params[VEC];
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                Affine<A> fj;
                A pj;
                params_of(n, cv * VEC + j, fj, pj, params[j]);
                if constexpr (kPaired) {
                    if (j == 0) {  // (split == VEC: the second is the first group's too, unused)
                        f[0] = f[1] = fj;
                        pivot[0] = pivot[1] = pj;
                    } else if (j == split) {
                        f[1] = fj;
                        pivot[1] = pj;
                    }
                } else if (j < kGroupParams) {
                    f[j] = fj;
                    pivot[j] = pj;
                }
            }
            const long long offset = n * spatial * channels + cv * VEC;
            const T* xs = x + offset;
            Y* ys = y + offset;
#pragma unroll 1
            for (long long chunk_ = blockIdx.x; chunk_ < chunks; chunk_ += gridDim.x) {
                const long long chunk = chunks - 1 - chunk_;
                const long long begin = chunk * chunk_len;
                const long long end = min(begin + chunk_len, spatial);
                const long long mirror = begin + end - 1;  // (p = mirror - u walks the chunk from its end)
                for_each_batched<4>(
                    begin + ty, end, by,
                    [&](long long u) { return load_vec_hinted<T, VEC>(xs + (mirror - u) * channels, hints); },
                    [&](long long u, const Vec<T, VEC>& in) {
                        const long long p = mirror - u;
                        Vec<Y, VEC> o;
#pragma unroll
                        for (int j = 0; j < VEC; ++j) {
                            if constexpr (kPaired) {
                                const bool first = j < split;
                                const A shifted = static_cast<A>(widen(in.v[j])) - (first ? pivot[0] : pivot[1]);
                                STORE::template element<T>(shifted, first ? f[0] : f[1], params[j], o.v[j]);
                            } else {
                                const int k = kGrouped ? 0 : j;
                                const A shifted = static_cast<A>(widen(in.v[j])) - pivot[k];
                                STORE::template element<T>(shifted, f[k], params[j], o.v[j]);
                            }
                        }
                        store_vec_hinted<Y, VEC>(ys + p * channels, o, hints);
                    });
            }
        }
    }
}

}  // namespace cunorm
