// row_bounds.cuh: the register budget of rows.cu's register tier
// (rows_cached): its launch bounds from the bytes a thread holds.
#pragma once
#include "stages.cuh"

namespace cunorm {

// Registers spent on the cached row decide the block's shape. The cost counts
// the cached bytes, four times over with a residual (x and r are both live,
// each with its own addresses, while h is formed) and twice for LayerNorm's
// three-word statistic or float64:
//   cost <= 64,  <= 8 loads a thread:  up to 1024 threads (64 registers),
//                                      light statistics only: LayerNorm
//                                      capped at 64 registers ran bf16
//                                      32768x4096 at 56-81%, at 128: 91%
//   cost <= 256, <= 16 loads:          up to 512 threads, 128 registers;
//                                      light 16-bit rows at cost <= 128 ask
//                                      for two blocks an SM (64 registers):
//                                      one block of 512 ran bf16 4096x32768
//                                      at 81% of copy bandwidth, two at 92%
// A quantizing store (a conversion an element; with a row's or a group's
// scale, every value formed twice) keeps 128 registers: at 64, its 16-bit
// rows of 8 vectors a thread spilled.
// Set by ptxas's spill reports over every instantiation for sm_80 and sm_90
// (at 64 registers, 8 float4 vectors a thread spilled on sm_80);
// cunorm/_engine/dispatch_rows.py (cached_cost, block_cache_limit) mirrors it.
// Per-row operands (per-head weights, a modulation, a gated residual: a
// division or two a row and one more pointer each) keep 128 registers too:
// at 64, the per-head weights' 16-bit rows of 4 vectors a thread spilled.
// The gated norm's z is held beside x and costs as a residual does.
// Per-row kernels of at most two vectors a thread ask for two blocks an SM
// (64 registers): the adaLN-Zero LayerNorm took 72 registers, one
// 512-thread block an SM (ncu: 25% occupancy, 35% of DRAM bandwidth), and
// 1.5x the time at 32768x8192 bf16 (docs/notes/conditioned.md). 16-bit
// LayerNorm's of them ask for three (kThreeBlocks: 42 registers, 40 taken
// with the residual gate loaded at its use, rows.cu): the adaLN-Zero
// LayerNorm ran bf16 32768x8192 in 536 against 632 us, 32768x3072 in 213
// against 265; at four (32 registers) it spilled 64 bytes and ran slower
// than at two; float32 spilled 8 bytes at three (H200,
// docs/notes/conditioned.md "Three blocks an SM for the adaLN
// LayerNorm"). Not where heavy statistics and a residual meet four
// parameter arrays or a float32 residual (PER_ROW_LEAN false): those
// spilled at 64 on sm_90.
// LayerNorm of 16-bit rows without a residual asks for two blocks too
// (64 registers, none spilled for sm_80 or sm_90): bf16 4096x32768 ran at
// 60% of copy bandwidth with one block of 512 an SM, at 82% with two
// (docs/notes/rows.md).
template <class T, class A, int STAT_WORDS, int VEC, int VECS_PER_THREAD, bool RESIDUAL, bool QUANTIZED,
          bool PER_ROW, bool PER_ROW_LEAN>
struct RowsCachedBounds {
    static constexpr int kCost = VECS_PER_THREAD * VEC * static_cast<int>(sizeof(T)) * (RESIDUAL ? 4 : 1) *
                                 ((STAT_WORDS > 1 || sizeof(A) == 8) ? 2 : 1);
    static constexpr int kLoads = VECS_PER_THREAD * (RESIDUAL ? 2 : 1);
    static constexpr bool kHeavy = STAT_WORDS > 1 || sizeof(A) == 8;
    static constexpr int kBlockMaxThreads = (!kHeavy && !PER_ROW && kCost <= 64 && kLoads <= 8) ? 1024 : 512;
    static constexpr bool kThreeBlocks =
        PER_ROW && PER_ROW_LEAN && !QUANTIZED && VECS_PER_THREAD <= 2 && STAT_WORDS > 1 && sizeof(T) == 2;
    static constexpr int kBlockMinBlocks =
        kThreeBlocks ? 3
        : ((!kHeavy && !QUANTIZED && !PER_ROW && sizeof(T) == 2 && kCost > 64 && kCost <= 128 && kLoads <= 8) ||
           (PER_ROW && PER_ROW_LEAN && !QUANTIZED && VECS_PER_THREAD <= 2) ||
           (STAT_WORDS > 1 && sizeof(T) == 2 && !RESIDUAL && !PER_ROW && !QUANTIZED))
            ? 2
            : 1;
};

// rows_cached's bounds for its template arguments.
template <template <class> class NormT, class T, class STORE, class LOAD, int VEC, int VECS_PER_THREAD>
using CachedBoundsOf = RowsCachedBounds<
    T, typename AccOf<T>::type, NormT<typename AccOf<T>::type>::kStatWords, VEC, VECS_PER_THREAD,
    LOAD::kResidual || STORE::kGated, STORE::kQuantized, STORE::kPerRow || LOAD::kScaled || LOAD::kWide,
    !((NormT<typename AccOf<T>::type>::kStatWords > 1 || sizeof(typename AccOf<T>::type) == 8) && LOAD::kResidual &&
      (LOAD::kWide || STORE::kParamBytes > 2 * static_cast<int>(sizeof(typename STORE::Param))))>;

// Blocks of the group-per-row variant (BLOCK_PER_ROW=false) have this many
// threads and ask for kGroupMinBlocks resident blocks: a budget of 128
// registers a thread. 128-thread blocks read short rows 1-3% faster than
// 256 and 512 (docs/notes/rows.md, "Short rows").
constexpr int kGroupBlockThreads = 128;
constexpr int kGroupMinBlocks = 4;

}  // namespace cunorm
