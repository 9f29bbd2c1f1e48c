// channel_grads.cu: the gradients of GroupNorm, InstanceNorm and BatchNorm
// (BatchNorm's on-chip backward: onchip.cu). Arrays as in backward.cu.
//
//   channel_grad_*     GroupNorm, InstanceNorm, BatchNorm: everything
//                      follows from two sums per (sample, channel),
//                      A = sum dy and B = sum dy * (x - mean): dweight[c] =
//                      sum_n rstd B, dbias[c] = sum_n A, and each group's
//                      coefficients from its channels' A and B weighted by
//                      the weight. Pass 1 reduces (sample, channel) chunks,
//                      two small launches combine them, pass 2 writes dx.
#include "grads.cuh"

namespace cunorm {

// --- the channel norms -----------------------------------------------------------
// x and dy dense, channels-first (batch, channels, spatial) or channels-last
// (batch, spatial, channels); the forward's mean/rstd of channel c of sample
// n at stat_index = n * stat_batch + c / channels_per_group (stat_batch:
// the groups of a sample, or 0 for BatchNorm).
__device__ __forceinline__ long long stat_index(long long n, int c, int channels_per_group, int stat_batch) {
    return n * stat_batch + c / channels_per_group;
}

// The channel tiles of the channel backward's grid y: channel vectors of
// bx (channels-last) or channels of by (plane rows).
template <int VEC, bool LAST>
__device__ __forceinline__ int channel_tiles(int channels, const BlockLayout& bl) {
    return LAST ? (channels / VEC + bl.bx - 1) / bl.bx : (channels + bl.by - 1) / bl.by;
}

// Pass 1: (A, B) = (sum dy, sum dy * (x - mean)) of each (n, c, chunk) into
// partial[((n * channels + c) * chunks + chunk) * 2].
// Channels-first: block (chunk, c, n) reduces its chunk of the (n, c) run;
// or, for runs of few vectors, "plane rows" (as channels.cu): block
// (bx <= 32, by) takes channels by * blockIdx.y + y, a row per channel.
// Channels-last: block (chunk, channel tile, n) of (bx, by) threads: x a
// channel vector, y a position of the chunk (stride by); the by partial
// sums of a channel are added in y order through shared memory.
template <class T, int VEC, bool LAST>
__global__ void __launch_bounds__(kGradBlockThreads, 1)
    channel_grad_sums(const T* __restrict__ dy, const T* __restrict__ x,
                      const typename AccOf<T>::type* __restrict__ mean, typename AccOf<T>::type* __restrict__ partial,
                      long long batch, long long spatial, int channels, int channels_per_group, int stat_batch,
                      long long chunks, long long chunk_len, int block_x) {
    grid_dependency_sync();
    const BlockLayout bl = block_layout(block_x);
    using A = typename AccOf<T>::type;
    using Sums = PairSum<A>;
    const long long chunk = blockIdx.x;
    // samples and channel tiles beyond the grid's y and z limits (65535)
    // are walked by grid stride; each step ends in a barrier (shared reuse)
    const int tiles = channel_tiles<VEC, LAST>(channels, bl);
    for (long long n = blockIdx.z; n < batch; n += gridDim.z)
    for (int tile = blockIdx.y; tile < tiles; tile += gridDim.y) {
    if constexpr (!LAST) {
        __shared__ typename Sums::Stats scratch[33];
        const int c = tile * bl.by + bl.ty;  // (plane rows: bl.by channels a block)
        const bool active = c < channels;
        typename Sums::Stats s = Sums::init();
        if (active) {
            const A m = mean[stat_index(n, c, channels_per_group, stat_batch)];
            const long long base = (n * channels + c) * spatial;
            const long long end = min(spatial / VEC, (chunk + 1) * chunk_len);
            for_each_batched<4>(
                chunk * chunk_len + bl.tx, end, bl.bx,
                [&](long long v) {
                    return load_pair<T, VEC>(x, dy, base + v * VEC);
                },
                [&](long long, const GradPair<T, VEC>& it) {
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        const A g = static_cast<A>(widen(it.dy.v[j]));
                        s.a += g;
                        s.b = fma(g, static_cast<A>(widen(it.x.v[j])) - m, s.b);
                    }
                });
        }
        s = bl.by == 1 ? block_reduce<Sums>(s, scratch) : group_reduce<Sums>(s, bl.bx);
        if (active && bl.tx == 0) Sums::store(partial + ((n * channels + c) * chunks + chunk) * 2, s);
    } else {
        extern __shared__ unsigned char shared_raw[];
        auto* shared = reinterpret_cast<typename Sums::Stats*>(shared_raw);  // [by][bx * VEC]
        const int cv = tile * bl.bx + bl.tx;
        const bool active = cv < channels / VEC;
        A m[VEC];
        typename Sums::Stats s[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            m[j] = active ? mean[stat_index(n, cv * VEC + j, channels_per_group, stat_batch)] : A(0);
            s[j] = Sums::init();
        }
        if (active) {
            const long long end = min(spatial, (chunk + 1) * chunk_len);
            const long long base = n * spatial * channels + static_cast<long long>(cv) * VEC;
            for_each_batched<4>(
                chunk * chunk_len + bl.ty, end, bl.by,
                [&](long long p) {
                    return load_pair<T, VEC>(x, dy, base + p * channels);
                },
                [&](long long, const GradPair<T, VEC>& it) {
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        const A g = static_cast<A>(widen(it.dy.v[j]));
                        s[j].a += g;
                        s[j].b = fma(g, static_cast<A>(widen(it.x.v[j])) - m[j], s[j].b);
                    }
                });
        }
#pragma unroll
        for (int j = 0; j < VEC; ++j) shared[(bl.ty * bl.bx + bl.tx) * VEC + j] = s[j];
        __syncthreads();
        if (bl.ty == 0 && active) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                typename Sums::Stats t = shared[bl.tx * VEC + j];
                for (int y = 1; y < bl.by; ++y) {
                    t = Sums::combine(t, shared[(y * bl.bx + bl.tx) * VEC + j]);
                }
                Sums::store(partial + ((n * channels + cv * VEC + j) * chunks + chunk) * 2, t);
            }
        }
    }
    __syncthreads();
    }
}

// A warp a (n, c): lane l adds the (n, c) partials of chunks l, l + 32, ...
// in order (a step's 32 loads are contiguous, where a thread a member read
// its chunks one dependent, strided load at a time), then the lanes' sums
// are added by a butterfly, a fixed order: sums[(n, c) * 2].
template <class A>
__global__ void __launch_bounds__(kGradBlockThreads, 1)
    channel_grad_combine(const A* __restrict__ partial, A* __restrict__ sums, long long members, long long chunks) {
    grid_dependency_sync();
    const long long m = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x & 31;
    if (m >= members) return;  // (whole warps: the block is a multiple of 32)
    A a = A(0), b = A(0);
    for (long long c = lane; c < chunks; c += 32) {
        a += partial[(m * chunks + c) * 2];
        b += partial[(m * chunks + c) * 2 + 1];
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, offset);
        b += __shfl_xor_sync(0xffffffffu, b, offset);
    }
    if (lane == 0) {
        sums[m * 2] = a;
        sums[m * 2 + 1] = b;
    }
}

// One thread a (n, c): the coefficients of dx = alpha * dy + beta *
// (x - mean) + gamma for that sample and channel, from the sums of its
// statistic group (the group's channels of sample n, or channel c over the
// whole batch), each group's members added in (n, c) order; coeffs[(n, c)
// * 3]. Threads c < channels (of n = 0) also write dweight[c] and dbias[c]
// (sums over n in order). TRAINING=false (BatchNorm on running
// statistics): the statistics are constants, alpha alone remains.
// BatchNorm in training (stat_batch 0) instead takes a warp a channel
// (the grid holds at least 32 * channels threads): the lanes add the
// channel's sums over the batch, strided, then a butterfly (every lane
// ends with the same bits), and write the coefficients, the same for every
// sample. One thread a (n, c) re-added the whole batch: O(batch^2 C) loads,
// 35 us on ResNet-50's (64,2048,7,7).
// For BatchNorm in training the sums added are the first sums_batch
// samples' and count is the values a channel's statistics cover: batch and
// batch * spatial for one GPU; SyncBatchNorm passes its ranks' totals as
// its samples and the global count (count_at, where not null: read from
// the GPU, as its combine wrote it). totals, where not null, receives each
// channel's (sum dy, sum dy * (x - mean)) as added (what SyncBatchNorm's
// collective exchanges).
template <class A, class P, int FLAGS, bool TRAINING>
__global__ void __launch_bounds__(kGradBlockThreads, 1)
    channel_grad_finalize(const A* __restrict__ sums, const A* __restrict__ mean, const A* __restrict__ rstd,
                          const P* __restrict__ w, const A* __restrict__ count_at, A* __restrict__ coeffs,
                          P* __restrict__ dw, P* __restrict__ db,
                          A* __restrict__ totals, long long batch, long long spatial, int channels,
                          int channels_per_group, int stat_batch, long long sums_batch, A count) {
    grid_dependency_sync();
    using Out = typename AccOf<P>::type;
    const long long m = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if constexpr (TRAINING) {
        if (stat_batch == 0) {
            const long long channel = m >> 5;
            const int lane = static_cast<int>(m & 31);
            if (channel >= channels) return;  // the whole warp: m's high bits are the warp's
            const int c = static_cast<int>(channel);
            A g = A(0), gx = A(0);
            for (long long k = lane; k < sums_batch; k += 32) {
                g += sums[(k * channels + c) * 2];
                gx += sums[(k * channels + c) * 2 + 1];
            }
            for (int mask = 16; mask > 0; mask >>= 1) {
                g += __shfl_xor_sync(0xffffffffu, g, mask);
                gx += __shfl_xor_sync(0xffffffffu, gx, mask);
            }
            const A r = rstd[c];
            A wc = A(1);
            if constexpr ((FLAGS & kWeight) != 0) wc = static_cast<A>(widen(w[c]));
            const A inv = A(1) / (count_at != nullptr ? *count_at : count);
            const A alpha = r * wc, beta = -r * r * r * (wc * gx) * inv, gamma = -r * (wc * g) * inv;
            for (long long k = lane; k < batch; k += 32) {
                coeffs[(k * channels + c) * 3] = alpha;
                coeffs[(k * channels + c) * 3 + 1] = beta;
                coeffs[(k * channels + c) * 3 + 2] = gamma;
            }
            if (lane == 0) {
                if constexpr (FLAGS & kWeight) narrow(static_cast<Out>(r * gx), dw[c]);
                if constexpr (FLAGS & kBias) narrow(static_cast<Out>(g), db[c]);
                if (totals != nullptr) {
                    totals[c * 2] = g;
                    totals[c * 2 + 1] = gx;
                }
            }
            return;
        }
    }
    if (m >= batch * channels) return;
    const long long n = m / channels;
    const int c = static_cast<int>(m % channels);
    const long long stat = stat_index(n, c, channels_per_group, stat_batch);
    const A r = rstd[stat];
    A wc = A(1);
    if constexpr ((FLAGS & kWeight) != 0) wc = static_cast<A>(widen(w[c]));
    A beta = A(0), gamma = A(0);
    if constexpr (TRAINING) {
        // the group's members: channels c0..c0+cpg of sample n, or of every
        // sample for BatchNorm (stat_batch 0)
        const int c0 = c - c % channels_per_group;
        const long long n0 = stat_batch == 0 ? 0 : n;
        const long long n1 = stat_batch == 0 ? batch : n + 1;
        A sum_g = A(0), sum_gx = A(0);
        for (long long k = n0; k < n1; ++k) {
            for (int cc = c0; cc < c0 + channels_per_group; ++cc) {
                A wk = A(1);
                if constexpr ((FLAGS & kWeight) != 0) wk = static_cast<A>(widen(w[cc]));
                sum_g = fma(wk, sums[(k * channels + cc) * 2], sum_g);
                sum_gx = fma(wk, sums[(k * channels + cc) * 2 + 1], sum_gx);
            }
        }
        const A count = static_cast<A>((n1 - n0) * channels_per_group) * static_cast<A>(spatial);
        const A inv = A(1) / count;
        // sum g * xhat = r * sum_gx
        beta = -r * r * r * sum_gx * inv;
        gamma = -r * sum_g * inv;
    }
    coeffs[m * 3] = r * wc;
    coeffs[m * 3 + 1] = beta;
    coeffs[m * 3 + 2] = gamma;
    if constexpr (FLAGS != 0) {
        if (m >= channels) return;
        A sw = A(0), sb = A(0);
        for (long long k = 0; k < batch; ++k) {
            const A rk = rstd[stat_index(k, c, channels_per_group, stat_batch)];
            sw = fma(rk, sums[(k * channels + c) * 2 + 1], sw);
            sb += sums[(k * channels + c) * 2];
        }
        if constexpr (FLAGS & kWeight) narrow(static_cast<Out>(sw), dw[c]);
        if constexpr (FLAGS & kBias) narrow(static_cast<Out>(sb), db[c]);
    }
}

// Pass 2: dx = alpha * dy + beta * (x - mean) + gamma, blocks as in
// channel_grad_sums (channels-last: each thread a channel vector, its
// positions y, y + by, ... of the chunk), the grid walked in reverse: its
// first blocks re-read what pass 1 read last, the likeliest still in L2.
template <class T, int VEC, bool LAST>
__global__ void __launch_bounds__(kGradBlockThreads, 1)
    channel_grad_apply(const T* __restrict__ dy, const T* __restrict__ x,
                       const typename AccOf<T>::type* __restrict__ mean,
                       const typename AccOf<T>::type* __restrict__ coeffs, T* __restrict__ dx, long long batch,
                       long long spatial, int channels, int channels_per_group, int stat_batch, long long chunks,
                       long long chunk_len, int block_x) {
    grid_dependency_sync();
    const BlockLayout bl = block_layout(block_x);
    using A = typename AccOf<T>::type;
    const long long chunk = gridDim.x - 1 - blockIdx.x;
    const int tiles = channel_tiles<VEC, LAST>(channels, bl);
    // (grid stride over samples and tiles past the y and z limits, in reverse)
    for (long long n = batch - 1 - static_cast<long long>(blockIdx.z); n >= 0; n -= gridDim.z)
    for (int tile_y = tiles - 1 - static_cast<int>(blockIdx.y); tile_y >= 0; tile_y -= static_cast<int>(gridDim.y)) {
    if constexpr (!LAST) {
        const int c = tile_y * bl.by + bl.ty;  // (plane rows: bl.by channels a block)
        if (c >= channels) continue;
        const long long m = n * channels + c;
        const A alpha = coeffs[m * 3], beta = coeffs[m * 3 + 1], gamma = coeffs[m * 3 + 2];
        const A mu = mean[stat_index(n, c, channels_per_group, stat_batch)];
        const long long base = m * spatial;
        const long long end = min(spatial / VEC, (chunk + 1) * chunk_len);
        for_each_batched<4>(
            chunk * chunk_len + bl.tx, end, bl.bx,
            [&](long long v) {
                return load_pair<T, VEC>(x, dy, base + v * VEC);
            },
            [&](long long v, const GradPair<T, VEC>& it) {
                Vec<T, VEC> out;
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const A d = fma(alpha, static_cast<A>(widen(it.dy.v[j])),
                                    fma(beta, static_cast<A>(widen(it.x.v[j])) - mu, gamma));
                    narrow(d, out.v[j]);
                }
                store_vec<T, VEC>(dx + base + v * VEC, out);
            });
    } else {
        const int cv = tile_y * bl.bx + bl.tx;
        if (cv >= channels / VEC) continue;
        A alpha[VEC], beta[VEC], gamma[VEC], mu[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const long long m = n * channels + cv * VEC + j;
            alpha[j] = coeffs[m * 3];
            beta[j] = coeffs[m * 3 + 1];
            gamma[j] = coeffs[m * 3 + 2];
            mu[j] = mean[stat_index(n, cv * VEC + j, channels_per_group, stat_batch)];
        }
        const long long end = min(spatial, (chunk + 1) * chunk_len);
        const long long base = n * spatial * channels + static_cast<long long>(cv) * VEC;
        for_each_batched<4>(
            chunk * chunk_len + bl.ty, end, bl.by,
            [&](long long p) {
                return load_pair<T, VEC>(x, dy, base + p * channels);
            },
            [&](long long p, const GradPair<T, VEC>& it) {
                Vec<T, VEC> out;
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const A d = fma(alpha[j], static_cast<A>(widen(it.dy.v[j])),
                                    fma(beta[j], static_cast<A>(widen(it.x.v[j])) - mu[j], gamma[j]));
                    narrow(d, out.v[j]);
                }
                store_vec<T, VEC>(dx + base + p * channels, out);
            });
    }
    }
}

}  // namespace cunorm
