// column_sums.cuh: the parameter gradients' column sums (dweight, dbias)
// in a fixed order, without atomics: a rows_grad_cached thread's running
// sums in shared memory (ColumnSums), and the sums of the blocks' partial
// rows, by rows_grad_cached's own grid behind its grid barrier
// (grid_column_sum) or by column_sum (sum_partial_columns, both).
#pragma once
#include "grads.cuh"

namespace cunorm {

// A rows_grad_cached thread's column sums of one parameter: group g (kWidth
// words, 16 bytes) of its vector k at `first` + (k x VEC + g x kWidth) x 32
// words, the lanes of a warp side by side (the layout: backward.cu).
template <class A, int VEC>
struct ColumnSums {
    static constexpr int kWidth = VEC * sizeof(A) <= 16 ? VEC : 16 / static_cast<int>(sizeof(A));
    using Group = Vec<A, kWidth>;
    A* first;  // this thread's first word
    __device__ __forceinline__ Group* group(int k, int g) const {
        return reinterpret_cast<Group*>(first + (k * VEC + g * kWidth) * 32);
    }
};

// C consecutive accumulator words from L2 (.cg: partials another SM may
// have just written), one 16-byte load for 4 floats or 2 doubles.
template <class A, int C>
__device__ __forceinline__ Vec<A, C> load_partial(const A* p) {
    Vec<A, C> v;
    if constexpr (C == 4 && sizeof(A) == 4) {
        const float4 f = __ldcg(reinterpret_cast<const float4*>(p));
        v.v[0] = f.x; v.v[1] = f.y; v.v[2] = f.z; v.v[3] = f.w;
    } else if constexpr (C == 2 && sizeof(A) == 8) {
        const double2 d = __ldcg(reinterpret_cast<const double2*>(p));
        v.v[0] = d.x; v.v[1] = d.y;
    } else {
        static_assert(C == 1, "one word, or 16 bytes");
        v.v[0] = __ldcg(p);
    }
    return v;
}

// The column sums of parameter partials, in a fixed order (the one
// mechanism of column_sum and of rows_grad_cached's own grid): out[col + i]
// = the sum over p < parts of src[p * n + col + i] for i < C, rounded once
// to P, out being out_w for output 0 and out_b for 1. The block is `quads`
// x `slices` threads, thread (x, y) the one of linear index y * quads + x:
// it loads parts y, y + slices, ... (BATCH loads in flight); where quads
// divides 32 (and is less) the slices of a warp are added by a butterfly over the lane bits that
// number them and thread (x, 0) adds the warps' sums in warp order (a
// serial loop over 128 slices would take longer than their loads), else
// thread (x, 0) adds the slices' sums in slice order. The order depends on
// the block's shape alone: bitwise the same run to run. Every thread of the
// block calls it (it has barriers); `tile`: C x quads x slices words of
// shared memory. Index: the column type (int in rows_grad_cached, whose
// rows are short; long long in column_sum). Inlined in rows_grad_cached
// its registers count: the tile slot is read from threadIdx, the output
// picked only to write, the column's pointer formed once (a first version
// without these held 71 registers against 64 for RMSNorm fp32 rows of
// 1024, three blocks an SM instead of four, 89.7-90.3% against 92.1% in
// the same call, H200; 62 now).
template <int C, int BATCH, class A, class P, class Index>
__device__ __forceinline__ void sum_partial_columns(const A* __restrict__ src, P* __restrict__ out_w,
                                                    P* __restrict__ out_b, int output, int parts, Index n, Index col,
                                                    int x, int y, int quads, int slices, A* tile) {
    const int threads = blockDim.x;  // quads x slices (a 1-D block)
    Vec<A, C> s;
#pragma unroll
    for (int i = 0; i < C; ++i) s.v[i] = A(0);
    if (col < n) {
        const A* const column = src + col;
        for_each_batched<BATCH>(
            y, parts, slices, [&](long long p) { return load_partial<A, C>(column + p * n); },
            [&](long long, const Vec<A, C>& v) {
#pragma unroll
                for (int i = 0; i < C; ++i) s.v[i] += v.v[i];
            });
    }
    int steps = slices;  // the sums thread (x, 0) adds: a slice's each, or (quads < 32) a warp's
    // (quads divides 32 where it is a power of two; a block of 96 or 192
    // threads over few partial rows takes 3, 6, 12 or 24)
    if (32 % quads == 0 && quads < 32) {
        for (int mask = quads; mask < 32; mask <<= 1) {
#pragma unroll
            for (int i = 0; i < C; ++i) s.v[i] += shfl_xor_acc(s.v[i], mask, 32);
        }
        steps = threads >> 5;
        if ((threadIdx.x & 31) < quads) {
#pragma unroll
            for (int i = 0; i < C; ++i) tile[i * threads + (threadIdx.x >> 5) * quads + x] = s.v[i];
        }
    } else {
#pragma unroll
        for (int i = 0; i < C; ++i) tile[i * threads + threadIdx.x] = s.v[i];
    }
    __syncthreads();
    if (y == 0 && col < n) {
        P* const out = output == 0 ? out_w : out_b;
#pragma unroll
        for (int i = 0; i < C; ++i) {
            A t = tile[i * threads + x];
            for (int q = 1; q < steps; ++q) t += tile[i * threads + q * quads + x];
            if (col + i < n) narrow(static_cast<typename AccOf<P>::type>(t), out[col + i]);
        }
    }
    __syncthreads();  // tile is refilled
}

// The column sums of rows_grad_cached's partials by its own grid, once
// every block has written its own (behind the grid barrier): out_w from
// partial rows 0 .. parts - 1, out_b from rows parts .. 2 * parts - 1. A
// unit of work is quads x C consecutive columns of one output, C = 4 (one
// 16-byte load) where n allows, else 1, summed by the block as quads x
// slices threads (sum_partial_columns); blocks take units blockIdx.x, +
// gridDim.x, ... quads is the largest power of two up to 8 that still
// gives every block a unit, else 1 (short rows have few columns and many
// partial rows: 1024 columns of 924 partials make 64 units of 58 loads a
// thread at 8 quads, 256-512 units of about 8 at 1), slices = blockDim.x /
// quads where there
// are that many partial rows; a grid of fewer (few rows: decode-sized
// calls) takes the power of two at or above parts (at most 32) and wider
// units, so that no slice idles and a block runs few units one after
// another (one block of a 1x4096 RMSNorm ran 128 units of 32 columns:
// docs/notes/host-time.md).
// `tile`: C x blockDim.x words of shared memory.
template <int C, class A, class P, int FLAGS>
__device__ __forceinline__ void grid_column_sum(const A* __restrict__ partial, P* __restrict__ out_w,
                                                P* __restrict__ out_b, int parts, int n, A* tile) {
    constexpr int first = (FLAGS & kWeight) ? 0 : 1;  // the outputs wanted: first .. last
    constexpr int last = (FLAGS & kBias) ? 1 : 0;
    const int threads = static_cast<int>(blockDim.x);
    int quads = 8;
    while (quads > 1 && (last - first + 1) * ((n + quads * C - 1) / (quads * C)) < static_cast<int>(gridDim.x)) {
        quads /= 2;
    }
    int slices = threads / quads;
    if (parts < slices) {
        slices = 1;
        while (slices < parts && slices < 32) slices *= 2;
        quads = threads / slices;  // column groups of C a unit
    }
    const int x = threadIdx.x % quads, y = threadIdx.x / quads;
    const int unit_cols = quads * C;
    const int groups = (n + unit_cols - 1) / unit_cols;
    for (int unit = blockIdx.x; unit < (last - first + 1) * groups; unit += gridDim.x) {
        const int output = first + unit / groups;
        // (four loads in flight: eight raised the kernel's registers, 39 ->
        // 78 for RMSNorm fp32 rows of 1024, cutting its blocks an SM)
        sum_partial_columns<C, 4>(partial + static_cast<long long>(output) * parts * n, out_w, out_b, output, parts,
                                  n, (unit % groups) * unit_cols + x * C, x, y, quads, slices, tile);
    }
}

}  // namespace cunorm
