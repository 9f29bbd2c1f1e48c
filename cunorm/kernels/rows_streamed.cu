// rows_streamed.cu: the contiguous-row family's tiers for rows beyond the
// register cache (rows.cu describes the family, its layout and template
// arguments, and rows_cached): rows_uncached, rows_split_partial and
// rows_split_apply, or on large x (tuning.split_tiles_min_bytes)
// rows_split_partial, rows_split_finalize and rows_split_apply_tiles; and
// rows_resident (an override only).
#include "reduce.cuh"

namespace cunorm {

// Loads in flight per thread in the streaming sweeps (uncached, split).
constexpr int kSweepUnroll = 4;

// A vector of the input and the affine parameters of its positions, loaded
// together so a batch of them is in flight at once in the write sweeps.
template <class T, class STORE, int VEC>
struct Loaded {
    Vec<T, VEC> v;
    typename STORE::template Params<VEC> p;
};

// Items (an input vector and its parameters) a write sweep keeps in flight:
// as many as a register budget of 192 bytes holds, 64 with a residual (whose
// load path holds more), at most kSweepUnroll. More spilled on sm_80/sm_90.
template <class T, class STORE, class LOAD, int VEC>
__host__ __device__ constexpr int write_batch() {
    constexpr int item = VEC * (static_cast<int>(sizeof(T)) + STORE::kParamBytes);
    constexpr int budget = LOAD::kResidual ? 64 : 192;
    return item * 4 <= budget ? 4 : item * 2 <= budget ? 2 : 1;
}

// Elements before the first VEC-aligned element of a row starting at p (0
// when it is aligned), at most n.
template <class T, int VEC>
__device__ __forceinline__ int misaligned_head(const T* p, long long n) {
    const int misaligned = static_cast<int>((reinterpret_cast<unsigned long long>(p) / sizeof(T)) & (VEC - 1));
    return static_cast<int>(min(static_cast<long long>((VEC - misaligned) & (VEC - 1)), n));
}

// rows_uncached's stash arrives in this many parts (cp.async groups).
constexpr int kStashParts = 4;

// Vectors of each row a rows_uncached thread holds in registers after the
// stash: a 65535-float row is 226 KB of stash plus 512 threads x 4 x 16
// bytes, all of it on chip, read once. None with parameters or a residual,
// whose registers are spent already (ptxas spilled there, sm_80 and sm_90).
template <class STORE, class LOAD>
__host__ __device__ constexpr int uncached_held_vectors() {
    return (STORE::kBare && !LOAD::kResidual && !STORE::kQuantized) ? 4 : 0;
}

// rows_uncached's sweeps for a quantizing store (QuantStore), after the
// row's statistic: the row's scale needs max |y| over the whole row before
// any element is stored, so there is no stash or held vectors; each sweep
// re-reads the row (x, or h with a residual) from L2, where the statistic's
// sweep left it (one row a block, a block an SM: at most a few tens of MB).
//   static scale:     one write sweep;
//   a row's scale:    a sweep for max |y|, a block reduction, the write sweep;
//   a group's scale:  one write sweep whose loop bounds are uniform across
//                     the warp, so a group's GROUP / VEC adjacent lanes
//                     (aligned: blockDim.x and the row are whole groups)
//                     combine their max |y| by shuffles; every lane divides
//                     for its own scale (rows_cached shares the divisions;
//                     this tier is the fallback for rows beyond its budget).
template <class T, class STORE, class LOAD, int VEC, class A, class Stats>
__device__ __forceinline__ void uncached_quantized_sweeps(
    const T* src, const typename STORE::Param* __restrict__ w, const typename STORE::Param* __restrict__ b,
    const float* __restrict__ quant_scale, typename STORE::Out* yr, T* plain_r, float* y_scale_row,
    long long scale_group_stride, long long body, const Affine<A>& f, A pivot, typename STORE::Scale quant,
    Stats* scratch) {
    // The plain write sweep's batch: smaller with a residual, whose kernel
    // keeps more live (ptxas spilled beyond it on sm_80).
    constexpr int kWriteBatch = write_batch<T, STORE, LOAD, VEC>();
    auto load = [&](long long v) {
        const long long e = v * VEC;
        return Loaded<T, STORE, VEC>{load_vec<T, VEC>(src + e), STORE::template params<VEC>(w, b, e)};
    };
    if constexpr (STORE::kGroup > 0) {
        constexpr int kLanes = STORE::kGroup / VEC;
        static_assert(kLanes >= 1 && kLanes <= 32, "a group spans one to 32 lanes");
        const long long warp_first = static_cast<long long>(threadIdx.x & ~31u);
        const int lane = static_cast<int>(threadIdx.x) & 31;
#pragma unroll 1
        for (long long v0 = warp_first; v0 < body; v0 += kWriteBatch * static_cast<long long>(blockDim.x)) {
            Loaded<T, STORE, VEC> in[kWriteBatch];
#pragma unroll
            for (int u = 0; u < kWriteBatch; ++u) {
                const long long v = v0 + lane + u * static_cast<long long>(blockDim.x);
                if (v < body) in[u] = load(v);
            }
#pragma unroll
            for (int u = 0; u < kWriteBatch; ++u) {
                const long long v = v0 + lane + u * static_cast<long long>(blockDim.x);
                float m = v < body ? STORE::template amax<T>(in[u].v, in[u].p, f, pivot) : 0.0f;
#pragma unroll
                for (int mask = kLanes / 2; mask > 0; mask /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, mask));
                if (v < body) {
                    const typename STORE::Scale s = STORE::row_scale(m, quant_scale);
                    if ((lane & (kLanes - 1)) == 0) y_scale_row[(v / kLanes) * scale_group_stride] = s.scale;
                    store_vec(yr + v * VEC, STORE::template apply<T>(in[u].v, in[u].p, f, pivot, s));
                    store_plain<STORE>(plain_r, v * VEC, in[u].v, in[u].p, f, pivot);
                }
            }
        }
    } else {
        if constexpr (STORE::kRowScale) {
            using Max = MaxMagnitude<A>;
            typename Max::Stats m = Max::init();
            for_each_batched<kWriteBatch>(threadIdx.x, body, blockDim.x, load,
                                          [&](long long, const Loaded<T, STORE, VEC>& in) {
                                              m.v = fmax(m.v, STORE::template amax<T>(in.v, in.p, f, pivot));
                                          });
            m = block_reduce<Max>(m, reinterpret_cast<typename Max::Stats*>(scratch));
            quant = STORE::row_scale(m.v, quant_scale);
            if (threadIdx.x == 0) y_scale_row[0] = quant.scale;
        }
        for_each_batched<kWriteBatch>(threadIdx.x, body, blockDim.x, load,
                                      [&](long long v, const Loaded<T, STORE, VEC>& in) {
                                          store_vec(yr + v * VEC, STORE::template apply<T>(in.v, in.p, f, pivot,
                                                                                           quant));
                                          store_plain<STORE>(plain_r, v * VEC, in.v, in.p, f, pivot);
                                      });
    }
}

// rows_uncached: rows too long for registers, when there are enough of them
// to fill the GPU (problems 38/39: 32768 rows of 65535 floats, 256 KB each).
// Math: the policy's statistic of the row, then the epilogue, as every tier.
// Layout: a persistent grid of one 512-thread block an SM (cunorm/_engine/dispatch_rows.py,
// tuning.uncached_blocks_per_sm; capped at what fits), each walking rows
// blockIdx.x, + gridDim.x, ... and keeping as much of each row on chip as
// fits: the first stash_vecs vectors in shared memory (the stash, dynamic),
// the next uncached_held_vectors() a thread in registers; the rest, if any,
// is read twice. For each row:
//   1. the stash's copies are in flight (cp.async, issued while the previous
//      row was written, in kStashParts groups) while the held vectors and
//      the rest are loaded and folded; the stash is folded part by part as
//      it lands: the row's statistic;
//   2. the stash is normalized and written, and its slots refilled with the
//      block's next row (each thread reads and refills only its own slots,
//      so no barrier guards them); then the held vectors;
//   3. the rest is read again, backwards (the bytes read last come first,
//      the likeliest still in L2), marked evict-first as it is read and as y
//      is written, so spent bytes leave room for those still to be re-read.
// Measured on the H200 (cunorm/_engine/dispatch_rows.py): problem 39 at 86% of copy
// bandwidth with stash and registers, 67.5% reading everything twice.
// Rows may start off VEC alignment (rows of 65535 floats): each row's head
// (up to its first aligned element) and tail are folded and written an
// element at a time by the first threads, the aligned body a vector at a
// time. The plan allows a misaligned start only when x's and y's rows share
// it and there are no parameters (whose index would be misaligned too) and
// no residual (cunorm/_engine/plans.py, peel_vec).
// With a residual there is no stash (stash_vecs = 0: h is formed in
// registers) and the rest's second sweep reads h back (written by other
// threads of the block: block_reduce's barriers order it). Nor is there
// one for 2-byte vectors, which cp.async cannot copy.
// A quantizing store (quantize= on rows beyond rows_cached's budget) takes
// steps 2 and 3 as uncached_quantized_sweeps.
// Up to 128 registers a thread: four batched vectors plus float32 weight
// and bias vectors of 8 need more than 64.
template <template <class> class NormT, class T, class STORE, class LOAD, int VEC>
__global__ void __launch_bounds__(512, 1)
rows_uncached(const T* __restrict__ x, const T* __restrict__ r, const typename STORE::Param* __restrict__ w,
              const typename STORE::Param* __restrict__ b, const float* __restrict__ quant_scale,
              typename STORE::Out* __restrict__ y, T* __restrict__ h, typename AccOf<T>::type* center_out,
              typename AccOf<T>::type* scale_out, float* __restrict__ y_scale, T* __restrict__ y_plain,
              long long rows, long long n, long long x_row_stride, typename AccOf<T>::type eps, long long stash_vecs,
              long long scale_row_stride, long long scale_group_stride) {
    grid_dependency_sync();
    using A = typename AccOf<T>::type;
    using Norm = NormT<A>;
    using Stats = typename Norm::Stats;
    constexpr int kVecBytes = VEC * static_cast<int>(sizeof(T));
    extern __shared__ __align__(16) unsigned char shared_raw[];
    Vec<T, VEC>* stash = reinterpret_cast<Vec<T, VEC>*>(shared_raw);
    __shared__ Stats scratch[33];
    constexpr int kWriteBatch = write_batch<T, STORE, LOAD, VEC>();
    constexpr int kHeld = uncached_held_vectors<STORE, LOAD>();
    const unsigned long long stream = l2_policy_evict_first();
    // The caller's scale, where a quantizing store takes one.
    const typename STORE::Scale given_scale = STORE::static_scale(quant_scale);

    // Row geometry: the aligned body starts at element `head`; `kept` of its
    // vectors are stashed.
    struct Row {
        const T* x;
        long long head, body, kept;
    };
    auto row_at = [&](long long row) {
        const T* xr = x + row * x_row_stride;
        const long long head = misaligned_head<T, VEC>(xr, n);
        const long long body = (n - head) / VEC;
        return Row{xr, head, body, min(stash_vecs, body)};
    };
    // This thread's stash slots are i = threadIdx.x + j * blockDim.x, j <
    // slots(kept); they are copied in kStashParts commit groups, folded
    // part by part as each lands.
    auto slots = [&](long long kept) -> long long {
        return kept > threadIdx.x ? (kept - 1 - threadIdx.x) / blockDim.x + 1 : 0;
    };
    auto fill_stash = [&](const Row& row) {
        if constexpr (!LOAD::kResidual && kVecBytes >= 4) {
            const long long count = slots(row.kept);
#pragma unroll
            for (int part = 0; part < kStashParts; ++part) {
                for (long long j = count * part / kStashParts; j < count * (part + 1) / kStashParts; ++j) {
                    const long long i = threadIdx.x + j * blockDim.x;
                    copy_async<kVecBytes>(stash + i, row.x + row.head + i * VEC);
                }
                asm volatile("cp.async.commit_group;" ::: "memory");
            }
        }
    };

    if (blockIdx.x < rows) fill_stash(row_at(blockIdx.x));
#pragma unroll 1
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const Row g = row_at(row);
        const T* xr = g.x;
        const T* rr = r + row * x_row_stride;
        T* hr = h + row * n;
        typename STORE::Out* yr = y + row * n;
        const long long head = g.head, body = g.body, kept = g.kept;
        const int odd = static_cast<int>(n - body * VEC);  // head + tail elements, < 2 * VEC
        // the element of odd item k: the head, then the tail
        const long long odd_e = threadIdx.x < head ? threadIdx.x : head + body * VEC + (threadIdx.x - head);
        const A pivot = row_pivot<Norm, A, T, LOAD>(xr, rr, true);

        // 1. The statistic: odd elements, the streamed rest, then the stash.
        Stats s = Norm::init();
        if (static_cast<int>(threadIdx.x) < odd) {
            s = fold<Norm, A, T, 1>(s, LOAD::template load<1>(xr, rr, hr, odd_e), pivot);
        }
        const long long held_end = min(body, kept + static_cast<long long>(kHeld) * blockDim.x);
        Vec<T, VEC> held[kHeld > 0 ? kHeld : 1];
#pragma unroll
        for (int k = 0; k < kHeld; ++k) {
            const long long v = kept + threadIdx.x + static_cast<long long>(k) * blockDim.x;
            if (v < held_end) held[k] = LOAD::template load<VEC>(xr + head, rr + head, hr + head, v * VEC);
        }
        for_each_batched<kSweepUnroll>(
            held_end + threadIdx.x, body, blockDim.x,
            [&](long long v) { return LOAD::template load<VEC>(xr + head, rr + head, hr + head, v * VEC); },
            [&](long long, const Vec<T, VEC>& in) { s = fold<Norm, A, T, VEC>(s, in, pivot); });
#pragma unroll
        for (int k = 0; k < kHeld; ++k) {
            const long long v = kept + threadIdx.x + static_cast<long long>(k) * blockDim.x;
            if (v < held_end) s = fold<Norm, A, T, VEC>(s, held[k], pivot);
        }
        if (kept > 0) {
            const long long count = slots(kept);
#pragma unroll
            for (int part = 0; part < kStashParts; ++part) {
                cp_async_wait_parts_left(kStashParts - 1 - part);
                for (long long j = count * part / kStashParts; j < count * (part + 1) / kStashParts; ++j)
                    s = fold<Norm, A, T, VEC>(s, stash[threadIdx.x + j * blockDim.x], pivot);
            }
        }
        s = block_reduce<Norm>(s, scratch);
        const Affine<A> f = Norm::finalize(s, n, eps);
        if (threadIdx.x == 0) store_stats(center_out, scale_out, row, f, pivot);

        const T* src = LOAD::kResidual ? static_cast<const T*>(hr) : xr;
        if constexpr (STORE::kQuantized) {
            // (no stash, held vectors or odd elements: the dispatch gives these rows none)
            uncached_quantized_sweeps<T, STORE, LOAD, VEC>(
                src, w, b, quant_scale, yr, y_plain == nullptr ? nullptr : y_plain + row * n,
                STORE::kRowScale ? y_scale + row * scale_row_stride : nullptr, scale_group_stride, body, f, pivot,
                given_scale, scratch);
        } else {
            // 2. The stash and the odd elements out; the stash refilled.
            if (static_cast<int>(threadIdx.x) < odd) {
                store_vec(yr + odd_e, STORE::template apply<T>(load_vec<T, 1>(src + odd_e),
                                                               STORE::template params<1>(w, b, odd_e), f, pivot));
            }
            for (long long i = threadIdx.x; i < kept; i += blockDim.x) {
                const long long e = head + i * VEC;
                store_vec_hint(yr + e, STORE::template apply<T>(stash[i], STORE::template params<VEC>(w, b, e),
                                                                             f, pivot), stream);
            }
            if (kept > 0 && row + gridDim.x < rows) fill_stash(row_at(row + gridDim.x));
#pragma unroll
            for (int k = 0; k < kHeld; ++k) {
                const long long v = kept + threadIdx.x + static_cast<long long>(k) * blockDim.x;
                if (v < held_end) {
                    const long long e = head + v * VEC;
                    store_vec_hint(yr + e, STORE::template apply<T>(held[k], STORE::template params<VEC>(w, b, e),
                                                                                 f, pivot), stream);
                }
            }

            // 3. The rest again, backwards: h (with a residual) or x.
            const long long rest = body - held_end;
            for_each_batched<kWriteBatch>(
                threadIdx.x, rest, blockDim.x,
                [&](long long v) {
                    const long long e = head + (body - 1 - v) * VEC;
                    return Loaded<T, STORE, VEC>{load_vec_hint<T, VEC>(src + e, stream),
                                                    STORE::template params<VEC>(w, b, e)};
                },
                [&](long long v, const Loaded<T, STORE, VEC>& in) {
                    const long long e = head + (body - 1 - v) * VEC;
                    store_vec_hint(yr + e, STORE::template apply<T>(in.v, in.p, f, pivot), stream);
                });
        }
    }
}

// The split tier's pass 1 chunks are interleaved: chunk c of a row is its
// vectors c * blockDim.x + threadIdx.x + k * chunks * blockDim.x, so the
// blocks sweep memory together like a copy kernel, one front of addresses,
// instead of as `chunks` separate streams (problem 37, one row of 7.5 GB:
// chunk-contiguous, the pass that writes y ran at 62-76% of its floor;
// interleaved, 93%; tiles in block order, rows_split_apply_tiles', 100%).
//
// Pass 1 of the split tier: partial[row * chunks + chunk] = statistic of the
// chunk's elements (and h written).
// The split tier runs 256-thread blocks (cunorm/_engine/dispatch_rows.py, SPLIT_BLOCK_THREADS),
// up to 128 registers (a batch of x and r vectors with LayerNorm's fold
// spilled at 64).
template <template <class> class NormT, class T, class LOAD, int VEC>
__global__ void __launch_bounds__(256, 2)
rows_split_partial(const T* __restrict__ x, const T* __restrict__ r, T* __restrict__ h,
                   typename AccOf<T>::type* __restrict__ partial, long long rows, long long n,
                   long long x_row_stride, long long chunks) {
    grid_dependency_sync();
    using A = typename AccOf<T>::type;
    using Norm = NormT<A>;
    using Stats = typename Norm::Stats;
    __shared__ Stats scratch[33];
    const long long n_vec = n / VEC;
    Stats* out = reinterpret_cast<Stats*>(partial);

#pragma unroll 1
    for (long long chunk = blockIdx.y; chunk < chunks; chunk += gridDim.y)
#pragma unroll 1
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * x_row_stride;
        const T* rr = r + row * x_row_stride;
        T* hr = h + row * n;
        const A pivot = row_pivot<Norm, A, T, LOAD>(xr, rr, true);
        Stats s = Norm::init();
        for_each_batched<kSweepUnroll>(
            chunk * blockDim.x + threadIdx.x, n_vec, chunks * blockDim.x,
            [&](long long v) { return LOAD::template load<VEC>(xr, rr, hr, v * VEC); },
            [&](long long, const Vec<T, VEC>& in) { s = fold<Norm, A, T, VEC>(s, in, pivot); });
        s = block_reduce<Norm>(s, scratch);
        if (threadIdx.x == 0) out[row * chunks + chunk] = s;
    }
}

// A row's partials (pass 1's chunks of it) combined in chunk order:
// strided over the block's threads, then block_reduce's fixed order, the
// same bits in every block of blockDim.x threads. Every thread of the
// block calls it (barriers).
template <class Norm, class A>
__device__ __forceinline__ typename Norm::Stats row_partials_combined(const A* partial, long long row, long long chunks,
                                                                      typename Norm::Stats* scratch) {
    const typename Norm::Stats* parts = reinterpret_cast<const typename Norm::Stats*>(partial);
    typename Norm::Stats s = Norm::init();
#pragma unroll 1
    for (long long c = threadIdx.x; c < chunks; c += blockDim.x) s = Norm::combine(s, parts[row * chunks + c]);
    return block_reduce<Norm>(s, scratch);
}

// Between the split tier's passes on large x, a block a row
// (rows_split_apply does this work itself otherwise): combine the row's
// partials (row_partials_combined: the same bits whatever the grid) into
// affine[3 row ..] = (pivot, center, scale), and the returned statistics.
template <template <class> class NormT, class T, class LOAD>
__global__ void __launch_bounds__(256)
rows_split_finalize(const T* __restrict__ x, const T* __restrict__ h,
                    const typename AccOf<T>::type* __restrict__ partial, typename AccOf<T>::type* __restrict__ affine,
                    typename AccOf<T>::type* center_out, typename AccOf<T>::type* scale_out, long long rows,
                    long long n, long long x_row_stride, long long chunks, typename AccOf<T>::type eps) {
    grid_dependency_sync();
    using A = typename AccOf<T>::type;
    using Norm = NormT<A>;
    using Stats = typename Norm::Stats;
    __shared__ Stats scratch[33];
#pragma unroll 1
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const Stats s = row_partials_combined<Norm>(partial, row, chunks, scratch);
        if (threadIdx.x == 0) {
            const Affine<A> f = Norm::finalize(s, n, eps);
            const T* src = LOAD::kResidual ? h + row * n : x + row * x_row_stride;
            // h's first element is the rounded x + r pass 1 shifted by.
            const A pivot = row_pivot<Norm, A, T, XLoad<T>>(src, src, true);
            affine[3 * row] = pivot;
            affine[3 * row + 1] = f.center;
            affine[3 * row + 2] = f.scale;
            store_stats(center_out, scale_out, row, f, pivot);
        }
    }
}

// rows_split_apply_tiles' vectors a thread (1: every thread of 8 blocks an
// SM with one vector in flight, as a copy kernel; else write_batch's) and
// the blocks an SM its bounds ask for. Mirrored by
// dispatch_rows.split_apply_lean.
template <class T, class STORE, class LOAD, int VEC>
__host__ __device__ constexpr bool split_apply_lean() {
    return !LOAD::kResidual && sizeof(T) <= 4 && VEC * STORE::kParamBytes <= 32;  // (more spilled at 32 registers)
}

// Pass 2 of the split tier: combine the row's partials (same order in every
// block of the row), then scale this block's chunk (of h, with a residual),
// walked from the end of the row (v -> n_vec - 1 - v): the first vectors
// re-read are the last pass 1 read, still in L2.
template <template <class> class NormT, class T, class STORE, class LOAD, int VEC>
__global__ void __launch_bounds__(256, 2)
rows_split_apply(const T* __restrict__ x, const T* __restrict__ h, const typename STORE::Param* __restrict__ w,
                 const typename STORE::Param* __restrict__ b,
                 const typename AccOf<T>::type* __restrict__ partial, typename STORE::Out* __restrict__ y,
                 typename AccOf<T>::type* center_out, typename AccOf<T>::type* scale_out, long long rows, long long n,
                 long long x_row_stride, long long chunks, typename AccOf<T>::type eps) {
    grid_dependency_sync();
    using A = typename AccOf<T>::type;
    using Norm = NormT<A>;
    using Stats = typename Norm::Stats;
    __shared__ Stats scratch[33];
    const long long n_vec = n / VEC;
    constexpr int kWriteBatch = write_batch<T, STORE, LOAD, VEC>();

#pragma unroll 1
    for (long long chunk = blockIdx.y; chunk < chunks; chunk += gridDim.y)
#pragma unroll 1
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const Stats s = row_partials_combined<Norm>(partial, row, chunks, scratch);
        const Affine<A> f = Norm::finalize(s, n, eps);
        const T* src = LOAD::kResidual ? h + row * n : x + row * x_row_stride;
        // h's first element is the rounded x + r pass 1 shifted by.
        const A pivot = row_pivot<Norm, A, T, XLoad<T>>(src, src, true);
        if (chunk == 0 && threadIdx.x == 0) store_stats(center_out, scale_out, row, f, pivot);
        typename STORE::Out* yr = y + row * n;
        for_each_batched<kWriteBatch>(
            chunk * blockDim.x + threadIdx.x, n_vec, chunks * blockDim.x,
            [&](long long v) {
                const long long e = (n_vec - 1 - v) * VEC;
                return Loaded<T, STORE, VEC>{load_vec<T, VEC>(src + e), STORE::template params<VEC>(w, b, e)};
            },
            [&](long long v, const Loaded<T, STORE, VEC>& in) {
                store_vec(yr + (n_vec - 1 - v) * VEC, STORE::template apply<T>(in.v, in.p, f, pivot));
            });
    }
}

// Pass 2 of the split tier on large x (rows_split_apply otherwise):
// y = (x - pivot - center) * scale [* w] [+ b] (of h, with a residual)
// with rows_split_finalize's (pivot, center, scale), a tile of tile_vecs
// vectors a block. Blocks run tile-major (every row's tile k, then k - 1:
// a tile's weight and bias are read from memory once for all rows) from
// the rows' ends, each tile walked from its end, so the first
// vectors re-read are the last pass 1 read, still in L2. Tiles in block
// order sweep memory as a copy kernel does; a vector a thread at eight
// blocks an SM where 32 registers hold it (split_apply_lean), else tiles
// of 1024-2047 vectors. rows_split_apply ran this pass at 92-93% of copy
// bandwidth, 1024-vector tiles at 97%, a vector a thread at 100% (problem
// 37, H200: docs/notes/rows.md).
template <class T, class STORE, class LOAD, int VEC>
__global__ void __launch_bounds__(256, split_apply_lean<T, STORE, LOAD, VEC>() ? 8 : 1)
rows_split_apply_tiles(const T* __restrict__ x, const T* __restrict__ h, const typename STORE::Param* __restrict__ w,
                       const typename STORE::Param* __restrict__ b,
                       const typename AccOf<T>::type* __restrict__ affine, typename STORE::Out* __restrict__ y,
                       long long rows, long long n, long long x_row_stride, long long tile_vecs, long long tiles) {
    grid_dependency_sync();
    using A = typename AccOf<T>::type;
    const long long n_vec = n / VEC;
    constexpr int kWriteBatch = split_apply_lean<T, STORE, LOAD, VEC>() ? 1 : write_batch<T, STORE, LOAD, VEC>();

#pragma unroll 1
    for (long long block = blockIdx.x; block < rows * tiles; block += gridDim.x) {
        const long long from_last = rows == 1 ? block : block / rows;  // (one row: no 64-bit division)
        const long long tile = tiles - 1 - from_last;
        const long long row = block - from_last * rows;
        const A pivot = affine[3 * row];
        const Affine<A> f{affine[3 * row + 1], affine[3 * row + 2]};
        const T* src = LOAD::kResidual ? h + row * n : x + row * x_row_stride;
        typename STORE::Out* yr = y + row * n;
        const long long end = min(n_vec, (tile + 1) * tile_vecs);  // (v = end - 1 - u walks the tile from its end)
        for_each_batched<kWriteBatch>(
            tile * tile_vecs + threadIdx.x, end, blockDim.x,
            [&](long long u) {
                const long long e = (end - 1 - (u - tile * tile_vecs)) * VEC;
                return Loaded<T, STORE, VEC>{load_vec<T, VEC>(src + e), STORE::template params<VEC>(w, b, e)};
            },
            [&](long long u, const Loaded<T, STORE, VEC>& in) {
                const long long e = (end - 1 - (u - tile * tile_vecs)) * VEC;
                store_vec(yr + e, STORE::template apply<T>(in.v, in.p, f, pivot));
            });
    }
}

// rows_resident: few long rows (problem 40: 16 rows of 4M floats) in ONE
// read of x. A cooperative launch of one 512-thread block per SM; block c owns chunk c
// (chunk_vecs vectors) of every row and keeps it in shared memory while the
// row's statistic is assembled:
//   1. load the chunk into shared memory (cp.async, all of it in flight at
//      once; through registers when forming and writing h with a residual)
//      and fold it into the block's partial;
//   2. publish the partial, then count in on the row's arrival counter
//      (release); prefetch the next row's chunk into L2 while waiting;
//   3. when all blocks have arrived (acquire), combine the row's partials in
//      block order (bitwise the same statistic in every block);
//   4. normalize the chunk from shared memory and write it.
// Co-residency of all blocks, which the wait needs, is what the cooperative
// launch guarantees (the launch fails rather than deadlocks). Counters are
// zeroed by the caller. Dynamic shared memory: chunk_vecs * VEC * sizeof(T).
template <template <class> class NormT, class T, class STORE, class LOAD, int VEC>
__global__ void __launch_bounds__(512, 1)
rows_resident(const T* __restrict__ x, const T* __restrict__ r, const typename STORE::Param* __restrict__ w,
              const typename STORE::Param* __restrict__ b,
              typename STORE::Out* __restrict__ y, T* __restrict__ h, typename AccOf<T>::type* center_out,
              typename AccOf<T>::type* scale_out, typename AccOf<T>::type* partial, unsigned int* arrived,
              long long rows, long long n, long long x_row_stride, long long chunk_vecs, typename AccOf<T>::type eps) {
    grid_dependency_sync();
    using A = typename AccOf<T>::type;
    using Norm = NormT<A>;
    using Stats = typename Norm::Stats;
    extern __shared__ __align__(16) unsigned char shared_raw[];
    Vec<T, VEC>* chunk = reinterpret_cast<Vec<T, VEC>*>(shared_raw);
    __shared__ Stats scratch[33];

    const long long n_vec = n / VEC;
    const long long begin = static_cast<long long>(blockIdx.x) * chunk_vecs;
    const long long end = min(begin + chunk_vecs, n_vec);
    const int count = static_cast<int>(max(end - begin, 0LL));
    const int blocks = static_cast<int>(gridDim.x);
    Stats* parts = reinterpret_cast<Stats*>(partial);
    constexpr int kLineVecs = 128 / (VEC * static_cast<int>(sizeof(T)));  // vectors per 128-byte line

#pragma unroll 1
    for (long long row = 0; row < rows; ++row) {
        const T* xr = x + row * x_row_stride + begin * VEC;
        const T* rr = r + row * x_row_stride + begin * VEC;
        T* hr = h + row * n + begin * VEC;
        const A pivot = row_pivot<Norm, A, T, LOAD>(x + row * x_row_stride, r + row * x_row_stride, true);

        Stats s = Norm::init();
        constexpr int kVecBytes = VEC * static_cast<int>(sizeof(T));
        if constexpr (!LOAD::kResidual && kVecBytes >= 4) {
            // The whole chunk in flight at once, straight into shared memory.
            const unsigned long long first_out = l2_policy_evict_first();
            for (int i = threadIdx.x; i < count; i += blockDim.x)
                copy_async<kVecBytes, true>(chunk + i, xr + i * VEC, first_out);
            copy_async_wait_all();
            for (int i = threadIdx.x; i < count; i += blockDim.x) s = fold<Norm, A, T, VEC>(s, chunk[i], pivot);
        } else {
            for_each_batched<kSweepUnroll>(
                threadIdx.x, count, blockDim.x,
                [&](long long i) { return LOAD::template load<VEC>(xr, rr, hr, i * VEC); },
                [&](long long i, const Vec<T, VEC>& v) {
                    chunk[i] = v;
                    s = fold<Norm, A, T, VEC>(s, v, pivot);
                });
        }
        s = block_reduce<Norm>(s, scratch);
        if (threadIdx.x == 0) {
            parts[row * blocks + blockIdx.x] = s;
            __threadfence();
            atomicAdd(arrived + row, 1u);
        }
        // While the other blocks finish the row: this block's parameters
        // (read next) and the next row's chunk into L2.
        for (int i = threadIdx.x * kLineVecs; i < count; i += blockDim.x * kLineVecs) {
            STORE::prefetch(w, b, (begin + i) * VEC);
            if (row + 1 < rows) {
                prefetch_l2(xr + x_row_stride + static_cast<long long>(i) * VEC);
                if constexpr (LOAD::kResidual) prefetch_l2(rr + x_row_stride + static_cast<long long>(i) * VEC);
            }
        }
        if (threadIdx.x == 0) {
            while (load_acquire(arrived + row) < static_cast<unsigned int>(blocks)) __nanosleep(64);
        }
        __syncthreads();

        Stats t = Norm::init();
        for (int c = threadIdx.x; c < blocks; c += blockDim.x) {
            // .cg: straight from L2, where the other blocks' partials landed
            Stats part;
            const A* src = reinterpret_cast<const A*>(parts + row * blocks + c);
            A* dst = reinterpret_cast<A*>(&part);
#pragma unroll
            for (int k = 0; k < Norm::kStatWords; ++k) dst[k] = __ldcg(src + k);
            t = Norm::combine(t, part);
        }
        t = block_reduce<Norm>(t, scratch);
        const Affine<A> f = Norm::finalize(t, n, eps);
        if (blockIdx.x == 0 && threadIdx.x == 0) store_stats(center_out, scale_out, row, f, pivot);

        typename STORE::Out* yr = y + row * n + begin * VEC;
        constexpr int kWriteBatch = write_batch<T, STORE, LOAD, VEC>();
        const unsigned long long keep = l2_policy_evict_last(), stream = l2_policy_evict_first();
        for_each_batched<kWriteBatch>(
            threadIdx.x, count, blockDim.x,
            [&](long long i) {
                return Loaded<T, STORE, VEC>{chunk[i],
                                             STORE::template params_hinted<VEC>(w, b, (begin + i) * VEC, keep)};
            },
            [&](long long i, const Loaded<T, STORE, VEC>& in) {
                store_vec_hint(yr + i * VEC, STORE::template apply<T>(in.v, in.p, f, pivot), stream);
            });
        __syncthreads();  // the chunk buffer is refilled for the next row
    }
}

}  // namespace cunorm
