// rows.cu: the contiguous-row family. The reduced axis is contiguous (stride
// 1) and each row is one normalization group: x is (rows, n), a row starts
// every x_row_stride elements (the residual r shares x's layout); y and h are
// written C-contiguous, (rows, n).
//
// Template arguments shared by every kernel here:
//   NormT      the norm policy (norms.cuh)
//   T          storage type of x, r, h
//   STORE      the store stage (stages.cuh): the parameters w and b, the
//              epilogue, y's storage type (STORE::Out)
//   LOAD       the load stage: x, or h = x + r formed, written out and
//              normalized (the pre-norm transformer block's fused add);
//              rows_cached also takes h = r + g * x and the float32
//              residual stream (stages.cuh)
//   VEC        elements a thread moves per access (16 bytes when the
//              pointers, strides and n allow it)
// Per-group statistics (Affine center and scale, accumulation type) are
// written to center_out / scale_out when those are not null. rows_cached
// with NoStore writes no y (the statistics alone: a jit program that never
// reads y).
//
// Three tiers, picked by cunorm/_engine/dispatch_rows.py from the row length and count:
//
//   rows_cached    the row is read once into registers, reduced, then scaled
//                  from registers: one read and one write of every element.
//                  y's storage type (STORE::Out) may be float for
//                  16-bit T (LayerNorm under autocast reads bf16 and
//                  returns float32, with no cast pass before it); the other
//                  tiers write y in T, but for rows_uncached's quantized y.
//                  It alone takes the per-row operands and the gated
//                  RMSNorm's z (read beside x); where the norm's input is
//                  formed in the accumulation type (x * silu(z), or x + r
//                  of the float32 stream) the row is held in it (kFormed).
//                  BLOCK_PER_ROW=false: a group of threads_per_row lanes (a
//                  power of two <= 32) per row, several rows per block,
//                  butterfly shuffles only (short rows). BLOCK_PER_ROW=true:
//                  the whole block owns one row at a time and combines
//                  through shared memory (rows up to the register budget of
//                  one block: 128 KB of row).
//   rows_uncached  rows too long for registers when there are enough of
//                  them to fill the GPU: a block an SM walks rows, keeping
//                  what fits of each in shared memory and registers (a row
//                  of 65535 floats entirely) and reading the rest twice.
//   rows_split_*   few long rows: each row is cut into interleaved chunks,
//                  one block per (row, chunk) on a 2-D grid (x: row, y: chunk: the blocks
//                  of one chunk run together, so its weight and bias are
//                  read from memory once for all rows). Pass 1
//                  writes every chunk's partial statistic to a workspace (and
//                  h); pass 2 combines a row's partials in a fixed order (so
//                  every chunk of the row sees the bitwise same statistic)
//                  and scales its chunk.
#include "reduce.cuh"
#include "row_bounds.cuh"

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

// A quantizing store's y also as the plain store writes it (x's type,
// rounded once), where the caller asked for it (y_plain not null: a
// uniform branch); nothing for the other stores.
template <class STORE, class T, int VEC, class A>
__device__ __forceinline__ void store_plain(T* y_plain, long long at, const Vec<T, VEC>& in,
                                            const typename STORE::template Params<VEC>& p, const Affine<A>& f,
                                            A pivot) {
    if constexpr (STORE::kQuantized) {
        if (y_plain != nullptr) {
            store_vec(y_plain + at, STORE::template Plain<T>::template apply<T>(in, p, f, pivot));
        }
    }
}

template <template <class> class NormT, class T, class STORE, class LOAD, int VEC, int VECS_PER_THREAD,
          bool BLOCK_PER_ROW>
__global__ void __launch_bounds__(
    BLOCK_PER_ROW ? CachedBoundsOf<NormT, T, STORE, LOAD, VEC, VECS_PER_THREAD>::kBlockMaxThreads
                  : kGroupBlockThreads,
    BLOCK_PER_ROW ? CachedBoundsOf<NormT, T, STORE, LOAD, VEC, VECS_PER_THREAD>::kBlockMinBlocks : kGroupMinBlocks)
rows_cached(const T* __restrict__ x, const typename LOAD::Residual* __restrict__ r,
            const typename STORE::Param* __restrict__ w,
            const typename STORE::Param* __restrict__ b, const float* __restrict__ quant_scale,
            const typename STORE::Param* __restrict__ shift, const typename STORE::Param* __restrict__ mod_scale,
            const typename LOAD::Gate* __restrict__ res_gate, const typename STORE::Gate* __restrict__ gate,
            typename STORE::Out* __restrict__ y, typename LOAD::Residual* __restrict__ h,
            typename AccOf<T>::type* center_out, typename AccOf<T>::type* scale_out,
            float* __restrict__ y_scale, T* __restrict__ y_plain, long long rows, int n, long long x_row_stride,
            typename AccOf<T>::type eps, int threads_per_row, long long scale_row_stride,
            long long scale_group_stride, long long param_rows, long long mod_div, long long mod_count) {
    using A = typename AccOf<T>::type;
    using Norm = NormT<A>;
    using Stats = typename Norm::Stats;
    static_assert(!STORE::kGated || (!STORE::kQuantized && !LOAD::kResidual && !Norm::kShifted),
                  "the gate z: an unshifted norm (RMSNorm), no residual, y unquantized");
    static_assert(!LOAD::kWide || (!STORE::kQuantized && !STORE::kGated), "the wide residual: y unquantized");
    // The row held in the accumulation type (the norm's input formed there:
    // x * silu(z), or x + r of the float32 residual stream), else as x.
    constexpr bool kFormed = STORE::kGatedInput || LOAD::kWide;
    __shared__ Stats scratch[33];

    const int n_vec = n / VEC;
    const int row_threads = BLOCK_PER_ROW ? static_cast<int>(blockDim.x) : threads_per_row;
    const int lane = BLOCK_PER_ROW ? static_cast<int>(threadIdx.x)
                                   : static_cast<int>(threadIdx.x) & (threads_per_row - 1);
    const int rows_per_block = BLOCK_PER_ROW ? 1 : static_cast<int>(blockDim.x) / threads_per_row;
    const int group = BLOCK_PER_ROW ? 0 : static_cast<int>(threadIdx.x) / threads_per_row;
    const long long step = static_cast<long long>(gridDim.x) * rows_per_block;
    // The caller's scale, where the store takes one (read once, not a row at a time).
    const typename STORE::Scale given_scale = STORE::static_scale(quant_scale);

    // The loop bound is uniform across the block: the exchanges below need
    // every lane, so lanes past the last row ride along inactive.
#pragma unroll 1
    for (long long base = static_cast<long long>(blockIdx.x) * rows_per_block; base < rows; base += step) {
        const long long row = base + group;
        const bool active = row < rows;
        const T* xr = x + row * x_row_stride;

        // Issue every load of the row before using any of them.
        using GateVec = typename Select<LOAD::kScaled, Vec<typename LOAD::Gate, VEC>, none_t>::type;
        using ZVec = typename Select<STORE::kGated, Vec<typename STORE::Gate, VEC>, none_t>::type;
        Vec<T, VEC> cache[VECS_PER_THREAD];
        Vec<typename LOAD::Residual, VEC> residual[LOAD::kResidual ? VECS_PER_THREAD : 1];
        GateVec gates[LOAD::kScaled ? VECS_PER_THREAD : 1];
        ZVec zs[STORE::kGated ? VECS_PER_THREAD : 1];  // the gated norm's z, held beside x
        using FormedVec = typename Select<kFormed, Vec<A, VEC>, none_t>::type;
        FormedVec formed[kFormed ? VECS_PER_THREAD : 1];  // the norm's input formed in A
        const typename LOAD::Gate* gr = nullptr;
        if constexpr (LOAD::kScaled) gr = LOAD::gate_row(res_gate, row, n, mod_div, mod_count);
#pragma unroll
        for (int k = 0; k < VECS_PER_THREAD; ++k) {
            const int v = lane + k * row_threads;
            if (active && v < n_vec) {
                cache[k] = load_vec<T, VEC>(xr + static_cast<long long>(v) * VEC);
                if constexpr (LOAD::kResidual) {
                    residual[k] = load_vec<typename LOAD::Residual, VEC>(r + row * x_row_stride + v * VEC);
                }
                if constexpr (LOAD::kScaled) gates[k] = load_vec<typename LOAD::Gate, VEC>(gr + v * VEC);
                if constexpr (STORE::kGated) {
                    zs[k] = load_vec<typename STORE::Gate, VEC>(gate + row * n + static_cast<long long>(v) * VEC);
                }
            }
        }
        const A pivot = row_pivot<Norm, A, T, LOAD>(xr, r + row * x_row_stride, active, gr);
        Stats s = Norm::init();
#pragma unroll
        for (int k = 0; k < VECS_PER_THREAD; ++k) {
            const int v = lane + k * row_threads;
            if (active && v < n_vec) {
                if constexpr (LOAD::kWide) {
                    formed[k] = LOAD::template combine_wide<VEC>(cache[k], residual[k]);
                    store_vec<A, VEC>(h + row * n + static_cast<long long>(v) * VEC, formed[k]);
                } else if constexpr (LOAD::kResidual) {
                    if constexpr (LOAD::kScaled) {
                        cache[k] = LOAD::template combine<VEC>(cache[k], residual[k], gates[k]);
                    } else {
                        cache[k] = LOAD::template combine<VEC>(cache[k], residual[k]);
                    }
                    store_vec<T, VEC>(h + row * n + static_cast<long long>(v) * VEC, cache[k]);
                }
                if constexpr (STORE::kGatedInput) formed[k] = STORE::template gated_input<A>(cache[k], zs[k]);
                if constexpr (kFormed) {
                    s = fold<Norm, A, A, VEC>(s, formed[k], pivot);
                } else {
                    s = fold<Norm, A, T, VEC>(s, cache[k], pivot);
                }
            }
        }
        if constexpr (BLOCK_PER_ROW) {
            s = block_reduce<Norm>(s, scratch);
        } else {
            s = group_reduce<Norm>(s, threads_per_row);
        }
        const Affine<A> f = Norm::finalize(s, n, eps);
        if (active && lane == 0) store_stats(center_out, scale_out, row, f, pivot);
        // the row's parameters and modulation (per-head weights, adaLN)
        const typename STORE::Row ro = STORE::row(w, b, shift, mod_scale, row, n, param_rows, mod_div, mod_count);

        if constexpr (STORE::kGroup > 0) {
            // A scale each kGroup elements. The group's lanes (kGroup / VEC
            // adjacent ones, aligned: row_threads is a multiple of them)
            // combine each vector's max |value| by butterfly shuffles;
            // then the scales' divisions are shared out, one a lane (a
            // division and a reciprocal a vector would cost a warp a
            // quarter of its instructions), and each reciprocal reaches
            // the group's lanes by a shuffle. Every lane of the warp
            // shuffles, active or not (the loop bounds are uniform).
            constexpr int kLanes = STORE::kGroup / VEC;
            static_assert(kLanes >= 1 && kLanes <= 32, "a group spans one to 32 lanes");
            constexpr int kShare = VECS_PER_THREAD < kLanes ? VECS_PER_THREAD : kLanes;  // scales a round forms
            constexpr int kRounds = VECS_PER_THREAD / kShare;
            float m[VECS_PER_THREAD];
#pragma unroll
            for (int k = 0; k < VECS_PER_THREAD; ++k) {
                const int v = lane + k * row_threads;
                m[k] = 0.0f;
                if (active && v < n_vec) {
                    const long long e = static_cast<long long>(v) * VEC;
                    m[k] = STORE::template amax<T>(cache[k], STORE::template params<VEC>(ro, e), f, pivot);
                }
#pragma unroll
                for (int mask = kLanes / 2; mask > 0; mask /= 2) {
                    m[k] = fmaxf(m[k], __shfl_xor_sync(0xffffffffu, m[k], mask));
                }
            }
            const int in_group = lane & (kLanes - 1);
            const int slot = in_group & (kShare - 1);
            const int group_lane0 = (static_cast<int>(threadIdx.x) & 31) & ~(kLanes - 1);
            float inverse[kRounds];
#pragma unroll
            for (int round = 0; round < kRounds; ++round) {
                float mine = 0.0f;  // this lane's vector of the round: m[round * kShare + slot]
#pragma unroll
                for (int j = 0; j < kShare; ++j) mine = j == slot ? m[round * kShare + j] : mine;
                const typename STORE::Scale quant = STORE::row_scale(mine, quant_scale);
                inverse[round] = quant.inverse;
                const int v = lane + (round * kShare + slot) * row_threads;
                if (active && v < n_vec && in_group < kShare) {
                    y_scale[row * scale_row_stride + (static_cast<long long>(v) * VEC / STORE::kGroup) *
                                                         scale_group_stride] = quant.scale;
                }
            }
            typename STORE::Out* yr = y + row * n;
#pragma unroll
            for (int k = 0; k < VECS_PER_THREAD; ++k) {
                const typename STORE::Scale quant{0.0f, __shfl_sync(0xffffffffu, inverse[k / kShare],
                                                                    group_lane0 + k % kShare)};
                const int v = lane + k * row_threads;
                if (active && v < n_vec) {
                    const long long e = static_cast<long long>(v) * VEC;
                    const auto p = STORE::template params<VEC>(ro, e);
                    store_vec(yr + e, STORE::template apply<T>(cache[k], p, f, pivot, quant));
                    store_plain<STORE>(y_plain, row * n + e, cache[k], p, f, pivot);
                }
            }
        } else if constexpr (STORE::kWritesY) {
            // A store that divides by the row's scale (QuantStore) forms it
            // first: the row's max |value| over the cached vectors.
            typename STORE::Scale quant = given_scale;
            if constexpr (STORE::kRowScale) {
                using Max = MaxMagnitude<A>;
                typename Max::Stats m = Max::init();
#pragma unroll
                for (int k = 0; k < VECS_PER_THREAD; ++k) {
                    const int v = lane + k * row_threads;
                    if (active && v < n_vec) {
                        const long long e = static_cast<long long>(v) * VEC;
                        m.v = fmax(m.v, STORE::template amax<T>(cache[k], STORE::template params<VEC>(ro, e), f,
                                                                pivot));
                    }
                }
                if constexpr (BLOCK_PER_ROW) {
                    m = block_reduce<Max>(m, reinterpret_cast<typename Max::Stats*>(scratch));
                } else {
                    m = group_reduce<Max>(m, threads_per_row);
                }
                quant = STORE::row_scale(m.v, quant_scale);
                if (active && lane == 0) y_scale[row * scale_row_stride] = quant.scale;
            }
            typename STORE::Out* yr = y + row * n;
#pragma unroll
            for (int k = 0; k < VECS_PER_THREAD; ++k) {
                const int v = lane + k * row_threads;
                if (active && v < n_vec) {
                    const long long e = static_cast<long long>(v) * VEC;
                    auto p = STORE::template params<VEC>(ro, e);
                    if constexpr (kFormed) {
                        store_vec(yr + e, STORE::template apply_formed<T>(formed[k], p, f, pivot));
                    } else {
                        if constexpr (STORE::kGated) p.gate = zs[k];
                        store_vec(yr + e, STORE::template apply<T>(cache[k], p, f, pivot, quant));
                        store_plain<STORE>(y_plain, row * n + e, cache[k], p, f, pivot);
                    }
                }
            }
        }
    }
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

// The split tier's chunks are interleaved: chunk c of a row is its vectors
// c * blockDim.x + threadIdx.x + k * chunks * blockDim.x, so the blocks of a
// pass sweep memory together like a copy kernel, one front of addresses,
// instead of as `chunks` separate streams (problem 37, one row of 7.5 GB:
// chunk-contiguous, pass 2 ran at 62-76% of its floor; interleaved, 93%).
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
    using A = typename AccOf<T>::type;
    using Norm = NormT<A>;
    using Stats = typename Norm::Stats;
    __shared__ Stats scratch[33];
    const long long n_vec = n / VEC;
    const Stats* parts = reinterpret_cast<const Stats*>(partial);
    constexpr int kWriteBatch = write_batch<T, STORE, LOAD, VEC>();

#pragma unroll 1
    for (long long chunk = blockIdx.y; chunk < chunks; chunk += gridDim.y)
#pragma unroll 1
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        Stats s = Norm::init();
#pragma unroll 1
        for (long long c = threadIdx.x; c < chunks; c += blockDim.x) s = Norm::combine(s, parts[row * chunks + c]);
        s = block_reduce<Norm>(s, scratch);
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
