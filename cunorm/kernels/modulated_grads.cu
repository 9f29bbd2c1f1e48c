// modulated_grads.cu: the backward of a row norm with adaLN's modulation
// and the gated residual (shift=, scale=, residual_gate=): one pass over
// the rows, one over their per-modulation-row partial sums.
//
// The forward (cunorm/_engine/conditioning.py), m = r / mod_div % mod_count
// the modulation row of row r:
//   h = res + gate[m] * x  (or x + res, or x)      xhat = (h - mean) * rstd
//   y = (xhat * w + b) * (1 + scale[m]) + shift[m]
// The backward, dy given (dh: the gradient that reached a returned h):
//   g        = dy * (1 + scale[m]) * w       (grads.cuh's g of the norm)
//   dh_total = grad_of(h, g, coeffs) + dh
//   dres     = dh_total,  dx = dh_total * gate[m]  (dh_total without a gate)
// and per modulation row m and column, over the rows of m:
//   Pm = sum dy * xhat,  Qm = sum dy,  Gm = sum dh_total * x
//   dshift[m] = Qm,  dscale[m] = w * Pm + b * Qm,  dgate[m] = Gm
//   dweight = sum over m of (1 + scale[m]) * Pm,  dbias likewise of Qm
// (the sums of g * xhat and g, the factor per modulation row taken out).
//
// rows_grad_modulated: the rows of each run of mod_div rows (one modulation
// row's) are cut into units_per_run units of unit_rows consecutive rows (the
// last may be shorter); unit u = run * units_per_run + j. A block takes units
// blockIdx.x, + gridDim.x, ... (a persistent grid). Thread layout, launch
// bounds and column sums as rows_grad_cached's (backward.cu): blockDim.x
// threads own vectors tid, tid + blockDim.x, ... (VPT of them) of every row;
// a thread keeps its columns' P, Q (and G) sums in shared memory in 16-byte
// groups (ColumnSums), its factors (1 + scale[m]) * w and gates in registers,
// across the unit's rows in row order, and writes the sums as the unit's
// partial rows: partial[(s * units + u) * n + column], s = 0 for P, 1 for Q,
// 2 for G. x and dh are read after the reduction, every vector's loads issued
// together, so the rows held across it are h and dy alone; they are fetched
// into L2 as the row starts, and h and dy of the next row one row ahead. The
// cutting depends on mod_div and the GPU alone, never on the batch: every
// per-row and per-modulation-row gradient is bitwise the same for any number
// of runs. No atomics.
//
// modulated_grad_sums: a block of bx x by threads (BlockLayout) a tile of bx
// x C columns of one modulation row (blockIdx.y); thread (tx, ty) adds C
// columns of the partial rows ty, ty + by, ... of the row's units, then
// thread (tx, 0) adds the by sums in ty order. It writes dshift, dscale,
// dgate and the weighted rows (1 + scale[m]) * Pm and (1 + scale[m]) * Qm,
// which column_sum (backward.cu) adds over the modulation rows into dweight
// and dbias.
#include "column_sums.cuh"

namespace cunorm {

// MODF: what rows_grad_modulated reads besides dy, h and the statistics.
constexpr int kModScale = 1;  // scale=: g carries (1 + scale[m])
constexpr int kModGate = 2;   // residual_gate=: reads x, writes dres and the G sums

template <class Grad, class T, class P, int FLAGS, int MODF, int VEC, int VPT, int MAX_THREADS, int MIN_BLOCKS>
__global__ void __launch_bounds__(MAX_THREADS, MIN_BLOCKS)
rows_grad_modulated(const T* __restrict__ dy, const T* __restrict__ h, const T* __restrict__ x,
                    const T* __restrict__ dh, const P* __restrict__ w, const P* __restrict__ mod_scale,
                    const P* __restrict__ res_gate, const typename AccOf<T>::type* __restrict__ center,
                    const typename AccOf<T>::type* __restrict__ rstd, T* __restrict__ dx, T* __restrict__ dres,
                    typename AccOf<T>::type* __restrict__ partial, long long rows, int n, long long mod_div,
                    long long mod_count, int units_per_run, int unit_rows, typename AccOf<T>::type eps) {
    grid_dependency_sync();
    using A = typename AccOf<T>::type;
    using Stats = typename Grad::Stats;
    using Sums = ColumnSums<A, VEC>;
    using Group = typename Sums::Group;
    constexpr int W = Sums::kWidth;
    constexpr bool kGate = (MODF & kModGate) != 0;
    __shared__ Stats scratch[33];
    // P, Q and (with the gate) G: VPT x VEC words a thread each, the
    // layout of rows_grad_cached's column sums (a warp's group 512
    // contiguous bytes): in registers they spilled past one vector a
    // thread, which left blocks too few rows in flight
    // (docs/notes/conditioned.md).
    extern __shared__ __align__(16) unsigned char modulated_sums[];
    A* const first_word = reinterpret_cast<A*>(modulated_sums) + (threadIdx.x / 32) * (VPT * VEC * 32) +
                          (threadIdx.x % 32) * W;
    const int sum_words = VPT * VEC * static_cast<int>(blockDim.x);
    const Sums p_sums{first_word}, q_sums{first_word + sum_words}, g_sums{first_word + 2 * sum_words};
    const int n_vec = n / VEC;
    const long long units = rows / mod_div * units_per_run;
    Group zero;
#pragma unroll
    for (int i = 0; i < W; ++i) zero.v[i] = A(0);
#pragma unroll 1
    for (long long u = blockIdx.x; u < units; u += gridDim.x) {
        const long long run = u / units_per_run;
        const long long m = run % mod_count;
        const long long first = run * mod_div + (u - run * units_per_run) * unit_rows;
        const long long run_end = (run + 1) * mod_div;
        const long long end = first + unit_rows < run_end ? first + unit_rows : run_end;
        A f[VPT][VEC];  // (1 + scale[m]) * w
        // gate[m] as stored, held the unit (reloaded a row, it came from L2:
        // adaLN 32768x8192 1-2% slower)
        Vec<P, VEC> tv[VPT];
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            const int v = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
#pragma unroll
            for (int i = 0; i < VEC; ++i) f[k][i] = A(1);
            if (v < n_vec) {
                const long long col = static_cast<long long>(v) * VEC;
                if constexpr (FLAGS & kWeight) {
                    const Vec<P, VEC> wv = load_vec<P, VEC>(w + col);
#pragma unroll
                    for (int i = 0; i < VEC; ++i) f[k][i] = static_cast<A>(widen(wv.v[i]));
                }
                if constexpr (kGate) tv[k] = load_vec<P, VEC>(res_gate + m * n + col);
                if constexpr (MODF & kModScale) {
                    const Vec<P, VEC> sv = load_vec<P, VEC>(mod_scale + m * n + col);
#pragma unroll
                    for (int i = 0; i < VEC; ++i) f[k][i] *= A(1) + static_cast<A>(widen(sv.v[i]));
                }
            }
#pragma unroll
            for (int g = 0; g < VEC / W; ++g) {
                *p_sums.group(k, g) = zero;
                *q_sums.group(k, g) = zero;
                if constexpr (kGate) *g_sums.group(k, g) = zero;
            }
        }
#pragma unroll 1
        for (long long row = first; row < end; ++row) {
            const long long base = row * n;
            // x and dh of this row into L2 while h and dy are loaded and
            // reduced: fetched a row ahead with h and dy (they then wait in
            // L2 longer), adaLN at hidden 3072-8192 ran 4-8% slower (H200,
            // docs/notes/conditioned.md)
            if (kGate || dh != nullptr) {
                const int bytes = n * static_cast<int>(sizeof(T));
                for (int offset = threadIdx.x * 128; offset < bytes; offset += blockDim.x * 128) {
                    if constexpr (kGate) prefetch_l2(reinterpret_cast<const char*>(x + base) + offset);
                    if (dh != nullptr) prefetch_l2(reinterpret_cast<const char*>(dh + base) + offset);
                }
            }
            Vec<T, VEC> hv[VPT], gv[VPT];
#pragma unroll
            for (int k = 0; k < VPT; ++k) {
                const int v = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
                if (v < n_vec) {
                    const long long e = base + static_cast<long long>(v) * VEC;
                    hv[k] = load_vec<T, VEC>(h + e);
                    gv[k] = load_vec<T, VEC>(dy + e);
                }
            }
            // h and dy of the next row into L2 while this one is reduced and
            // written, a line of each a thread a step (rows_grad_cached's rule)
            if (row + 1 < end) {
                const int bytes = n * static_cast<int>(sizeof(T));
                const long long next = base + n;
                for (int offset = threadIdx.x * 128; offset < bytes; offset += blockDim.x * 128) {
                    prefetch_l2(reinterpret_cast<const char*>(h + next) + offset);
                    prefetch_l2(reinterpret_cast<const char*>(dy + next) + offset);
                }
            }
            A c0 = A(0);
            if (center != nullptr) c0 = center[row];
            const A s0 = rstd[row];
            Stats s = Grad::init();
#pragma unroll
            for (int k = 0; k < VPT; ++k) {
                if (static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x) < n_vec) {
#pragma unroll
                    for (int i = 0; i < VEC; ++i)
                        s = Grad::accumulate(s, static_cast<A>(widen(hv[k].v[i])),
                                             static_cast<A>(widen(gv[k].v[i])) * f[k][i], c0, s0);
                }
            }
            s = block_reduce<Grad, MAX_THREADS / 32>(s, scratch);
            const GradCoeffs<A> c = Grad::coeffs(s, n, eps, c0, s0);
            // every vector's x and dh loads issued before any is used: one
            // wait on L2 a row, not one a vector
            Vec<T, VEC> dhv[VPT], xv[VPT];
#pragma unroll
            for (int k = 0; k < VPT; ++k) {
                const int v = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
                if (v < n_vec) {
                    const long long e = base + static_cast<long long>(v) * VEC;
                    if (dh != nullptr) dhv[k] = load_vec<T, VEC>(dh + e);
                    if constexpr (kGate) xv[k] = load_vec<T, VEC>(x + e);
                }
            }
#pragma unroll
            for (int k = 0; k < VPT; ++k) {
                const int v = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
                if (v < n_vec) {
                    const long long e = base + static_cast<long long>(v) * VEC;
                    Vec<T, VEC> out, out_res;
#pragma unroll
                    for (int g = 0; g < VEC / W; ++g) {
                        Group sp = *p_sums.group(k, g), sq = *q_sums.group(k, g), sg;
                        if constexpr (kGate) sg = *g_sums.group(k, g);
#pragma unroll
                        for (int q = 0; q < W; ++q) {
                            const int i = g * W + q;
                            const A hi = static_cast<A>(widen(hv[k].v[i]));
                            const A dyi = static_cast<A>(widen(gv[k].v[i]));
                            A d = grad_of<Grad>(hi, dyi * f[k][i], c);
                            if (dh != nullptr) d += static_cast<A>(widen(dhv[k].v[i]));
                            sp.v[q] = fma(dyi, (hi - c.center) * c.scale, sp.v[q]);
                            sq.v[q] += dyi;
                            if constexpr (kGate) {
                                sg.v[q] = fma(d, static_cast<A>(widen(xv[k].v[i])), sg.v[q]);
                                narrow(d, out_res.v[i]);
                                narrow(d * static_cast<A>(widen(tv[k].v[i])), out.v[i]);
                            } else {
                                narrow(d, out.v[i]);
                            }
                        }
                        *p_sums.group(k, g) = sp;
                        *q_sums.group(k, g) = sq;
                        if constexpr (kGate) *g_sums.group(k, g) = sg;
                    }
                    store_vec<T, VEC>(dx + e, out);
                    if constexpr (kGate) store_vec<T, VEC>(dres + e, out_res);
                }
            }
        }
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            const int v = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
            if (v < n_vec) {
#pragma unroll
                for (int g = 0; g < VEC / W; ++g) {
                    const long long col = static_cast<long long>(v) * VEC + g * W;
                    store_vec<A, W>(partial + u * n + col, *p_sums.group(k, g));
                    store_vec<A, W>(partial + (units + u) * n + col, *q_sums.group(k, g));
                    if constexpr (kGate) store_vec<A, W>(partial + (2 * units + u) * n + col, *g_sums.group(k, g));
                }
            }
        }
    }
}

// OUTS: which of dshift (1), dscale (2), dgate (4) are written; FLAGS:
// the weight and bias present (their weighted rows written for
// column_sum, and read for dscale). C: consecutive columns a thread adds,
// one 16-byte load a partial row where n allows: a word a thread reads a
// warp row of 32 bytes, and RMSNorm bf16 32768x4096's partials (132 units
// of 4096 columns a sample) take 30 us that way at 24% of DRAM bandwidth,
// 14.8 us in 16-byte loads (H200).
template <class A, class P, int FLAGS, int MODF, int OUTS, int C>
__global__ void __launch_bounds__(256, 1)
modulated_grad_sums(const A* __restrict__ partial, const P* __restrict__ w, const P* __restrict__ b,
                    const P* __restrict__ mod_scale, P* __restrict__ dshift, P* __restrict__ dscale,
                    P* __restrict__ dgate, A* __restrict__ weighted, long long units, int n, int units_per_run,
                    long long runs, long long mod_count, int block_x) {
    grid_dependency_sync();
    using PA = typename AccOf<P>::type;
    constexpr int kSums = (MODF & kModGate) ? 3 : 2;
    __shared__ Vec<A, C> tile[kSums][256];
    const BlockLayout bl = block_layout(block_x);
    const long long m = blockIdx.y;
    const int col = (static_cast<int>(blockIdx.x) * bl.bx + bl.tx) * C;
    // the units of modulation row m: runs m, m + mod_count, ..., each units_per_run of them
    const long long parts = (runs - m + mod_count - 1) / mod_count * units_per_run;
    Vec<A, C> s[kSums];
#pragma unroll
    for (int q = 0; q < kSums; ++q) {
#pragma unroll
        for (int i = 0; i < C; ++i) s[q].v[i] = A(0);
    }
    if (col < n) {
#pragma unroll 4
        for (long long p = bl.ty; p < parts; p += bl.by) {
            const long long u = (m + p / units_per_run * mod_count) * units_per_run + p % units_per_run;
#pragma unroll
            for (int q = 0; q < kSums; ++q) {
                const Vec<A, C> v = load_partial<A, C>(partial + (q * units + u) * n + col);
#pragma unroll
                for (int i = 0; i < C; ++i) s[q].v[i] += v.v[i];
            }
        }
    }
#pragma unroll
    for (int q = 0; q < kSums; ++q) tile[q][threadIdx.x] = s[q];
    __syncthreads();
    if (bl.ty != 0 || col >= n) return;
#pragma unroll
    for (int q = 0; q < kSums; ++q) {
        for (int y = 1; y < bl.by; ++y) {
            const Vec<A, C> t = tile[q][y * bl.bx + bl.tx];
#pragma unroll
            for (int i = 0; i < C; ++i) s[q].v[i] += t.v[i];
        }
    }
#pragma unroll
    for (int i = 0; i < C; ++i) {  // (n is a multiple of C: every column of the group is in the row)
        const long long e = m * n + col + i;
        A wv = A(1), bv = A(0), factor = A(1);
        if constexpr (FLAGS & kWeight) wv = static_cast<A>(widen(w[col + i]));
        if constexpr (FLAGS & kBias) bv = static_cast<A>(widen(b[col + i]));
        if constexpr (MODF & kModScale) factor += static_cast<A>(widen(mod_scale[e]));
        if constexpr (OUTS & 1) narrow(static_cast<PA>(s[1].v[i]), dshift[e]);
        if constexpr (OUTS & 2) narrow(static_cast<PA>(fma(wv, s[0].v[i], bv * s[1].v[i])), dscale[e]);
        if constexpr (OUTS & 4) narrow(static_cast<PA>(s[kSums - 1].v[i]), dgate[e]);
        if constexpr (FLAGS & kWeight) weighted[e] = factor * s[0].v[i];
        if constexpr (FLAGS & kBias) weighted[mod_count * n + e] = factor * s[1].v[i];
    }
}

}  // namespace cunorm
