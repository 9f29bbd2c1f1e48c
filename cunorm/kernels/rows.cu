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
// Three tiers, picked by cunorm/_engine/dispatch_rows.py from the row length
// and count; rows_cached is here, the tiers of rows beyond the register
// cache in rows_streamed.cu:
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

// A lane's parameters (STORE::Params of VEC elements, N vectors): held in
// registers across the rows a block walks (HELD) or read for each row.
template <class STORE, int VEC, int N, bool HELD>
struct HeldParams {
    template <class Row>
    __device__ __forceinline__ auto of(int, const Row& ro, long long e) const {
        return STORE::template params<VEC>(ro, e);
    }
};
template <class STORE, int VEC, int N>
struct HeldParams<STORE, VEC, N, true> {
    typename STORE::template Params<VEC> p[N];
    template <class Row>
    __device__ __forceinline__ typename STORE::template Params<VEC> of(int k, const Row&, long long) const {
        return p[k];
    }
};

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
    grid_dependency_sync();
    using A = typename AccOf<T>::type;
    using Norm = NormT<A>;
    using Stats = typename Norm::Stats;
    static_assert(!STORE::kGated || (!STORE::kQuantized && !LOAD::kResidual && !Norm::kShifted),
                  "the gate z: an unshifted norm (RMSNorm), no residual, y unquantized");
    static_assert(!LOAD::kWide || (!STORE::kQuantized && !STORE::kGated), "the wide residual: y unquantized");
    // The row held in the accumulation type (the norm's input formed there:
    // x * silu(z), or x + r of the float32 residual stream), else as x.
    constexpr bool kFormed = STORE::kGatedInput || LOAD::kWide;
    // The residual gate g loaded where h = r + g * x is formed, not beside
    // x and r: where the kernel asks for three blocks an SM (42 registers),
    // g's registers held through x's and r's loads spilled.
    constexpr bool kGateAtUse =
        BLOCK_PER_ROW && CachedBoundsOf<NormT, T, STORE, LOAD, VEC, VECS_PER_THREAD>::kThreeBlocks;
    __shared__ Stats scratch[33];

    const int n_vec = n / VEC;
    const int row_threads = BLOCK_PER_ROW ? static_cast<int>(blockDim.x) : threads_per_row;
    const int lane = BLOCK_PER_ROW ? static_cast<int>(threadIdx.x)
                                   : static_cast<int>(threadIdx.x) & (threads_per_row - 1);
    // threads_per_row is a power of two: shifts, not integer divisions
    // (a block of short rows runs its prologue once)
    const int row_shift = BLOCK_PER_ROW ? 0 : __popc(threads_per_row - 1);
    const int rows_per_block = BLOCK_PER_ROW ? 1 : static_cast<int>(blockDim.x) >> row_shift;
    const int group = BLOCK_PER_ROW ? 0 : static_cast<int>(threadIdx.x) >> row_shift;
    const long long step = static_cast<long long>(gridDim.x) * rows_per_block;
    // The caller's scale, where the store takes one (read once, not a row at a time).
    const typename STORE::Scale given_scale = STORE::static_scale(quant_scale);
    // The parameters of this lane's vectors, read once where a block walks
    // many rows and they are the same for each (read for every row, their
    // loads, addresses and branches are a sixth of a short row's
    // instructions); at most 64 bytes a thread, and not beside the float32
    // residual stream's row (held in float32: 128 registers, spilled).
    constexpr bool kHeld = !BLOCK_PER_ROW && STORE::kWritesY && !STORE::kRowParams && STORE::kParamBytes > 0 &&
                           !LOAD::kWide && VECS_PER_THREAD * VEC * STORE::kParamBytes <= 64;
    HeldParams<STORE, VEC, VECS_PER_THREAD, kHeld> held;
    if constexpr (kHeld) {
        const typename STORE::Row ro = STORE::row(w, b, shift, mod_scale, 0, n, param_rows, mod_div, mod_count);
#pragma unroll
        for (int k = 0; k < VECS_PER_THREAD; ++k) {
            const int v = lane + k * row_threads;
            if (v < n_vec) held.p[k] = STORE::template params<VEC>(ro, static_cast<long long>(v) * VEC);
        }
    }

    // A block per row reads the parameters after the reduction. With at
    // most a row an SM (decode) each SM waits on memory, and their lines
    // are fetched into L1 first: a row of 4096 bf16 6.5 -> 5.8 us
    // (RMSNorm), 10.2 -> 8.6 (LayerNorm); prefetched at every row count,
    // 1056 rows of 4096 took 11.5 -> 14.4 us (H100, docs/notes/rows.md
    // "Decode"). Not for a modulation or per-head weights, where the
    // prefetch cost the modulated RMSNorm 3-5% at 4096 rows.
    if constexpr (BLOCK_PER_ROW && STORE::kWritesY && STORE::kParamBytes > 0 && !STORE::kRowParams) {
        if (rows <= static_cast<long long>(sm_ids())) {
#pragma unroll
            for (int k = 0; k < VECS_PER_THREAD; ++k) {
                const int v = lane + k * row_threads;
                if (v < n_vec) STORE::template prefetch<true>(w, b, static_cast<long long>(v) * VEC);
            }
        }
    }

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
                if constexpr (LOAD::kScaled && !kGateAtUse) gates[k] = load_vec<typename LOAD::Gate, VEC>(gr + v * VEC);
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
                        if constexpr (kGateAtUse) gates[k] = load_vec<typename LOAD::Gate, VEC>(gr + v * VEC);
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
                    m[k] = STORE::template amax<T>(cache[k], held.of(k, ro, e), f, pivot);
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
                    const auto p = held.of(k, ro, e);
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
                        m.v = fmax(m.v, STORE::template amax<T>(cache[k], held.of(k, ro, e), f,
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
                    auto p = held.of(k, ro, e);
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

}  // namespace cunorm
