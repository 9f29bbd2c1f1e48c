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
// row's) are cut into units_per_run units of unit_rows consecutive rows
// (the last may be shorter); unit u = run * units_per_run + j. A block
// takes units blockIdx.x, + gridDim.x, ... (a persistent grid). Thread
// layout as rows_grad_cached's: blockDim.x threads own vectors tid, tid +
// blockDim.x, ... (VPT of them) of every row, at most 512 threads. A thread
// keeps its columns' P and Q sums in registers (G in its own words of
// shared memory) across the unit's rows, in row order, and writes them as
// the unit's partial rows: partial[(s * units + u) * n + column], s = 0
// for P, 1 for Q, 2 for G. The cutting depends on mod_div and the GPU
// alone, never on the batch: every per-row and per-modulation-row gradient
// is bitwise the same for any number of runs. No atomics.
//
// modulated_grad_sums: a block of bx x by threads (BlockLayout) a tile of
// bx columns of one modulation row (blockIdx.y); thread (tx, ty) adds the
// partial rows ty, ty + by, ... of the row's units, then thread (tx, 0)
// adds the by sums in ty order. It writes dshift, dscale, dgate and the
// weighted rows (1 + scale[m]) * Pm and (1 + scale[m]) * Qm, which
// column_sum (backward.cu) adds over the modulation rows into dweight and
// dbias.
#include "grads.cuh"

namespace cunorm {

// MODF: what rows_grad_modulated reads besides dy, h and the statistics.
constexpr int kModScale = 1;  // scale=: g carries (1 + scale[m])
constexpr int kModGate = 2;   // residual_gate=: reads x, writes dres and the G sums

// Two blocks an SM (64 registers) where a thread holds one vector without
// the gate; with it, 64 registers spill on sm_90.
template <class Grad, class T, class P, int FLAGS, int MODF, int VEC, int VPT>
__global__ void __launch_bounds__(512, VPT == 1 && !(MODF & kModGate) ? 2 : 1)
rows_grad_modulated(const T* __restrict__ dy, const T* __restrict__ h, const T* __restrict__ x,
                    const T* __restrict__ dh, const P* __restrict__ w, const P* __restrict__ mod_scale,
                    const P* __restrict__ res_gate, const typename AccOf<T>::type* __restrict__ center,
                    const typename AccOf<T>::type* __restrict__ rstd, T* __restrict__ dx, T* __restrict__ dres,
                    typename AccOf<T>::type* __restrict__ partial, long long rows, int n, long long mod_div,
                    long long mod_count, int units_per_run, int unit_rows, typename AccOf<T>::type eps) {
    using A = typename AccOf<T>::type;
    using Stats = typename Grad::Stats;
    using Acc = Vec<A, VEC>;
    constexpr bool kGate = (MODF & kModGate) != 0;
    __shared__ Stats scratch[33];
    // Dynamic shared memory: the unit's factors (1 + scale[m]) * w and
    // gate[m] a column, then with the gate the G sums (sum k of thread t at
    // k * blockDim.x + t); a thread reads only its own words, so none needs
    // a barrier. The P and Q sums are held in registers: in shared memory
    // their reads and writes each row move six times the global loads'
    // bytes through L1, which then bounds the kernel. The G sums are not:
    // in registers they spill for 16-bit rows of two vectors a thread
    // (docs/notes/conditioned.md).
    extern __shared__ __align__(16) unsigned char modulated_shared[];
    const int n_vec = n / VEC;
    Acc* const factors = reinterpret_cast<Acc*>(modulated_shared);
    Acc* const gates = factors + n_vec;
    Acc* const gate_sums = gates + n_vec;
    const long long units = rows / mod_div * units_per_run;
#pragma unroll 1
    for (long long u = blockIdx.x; u < units; u += gridDim.x) {
        const long long run = u / units_per_run;
        const long long m = run % mod_count;
        const long long first = run * mod_div + (u - run * units_per_run) * unit_rows;
        const long long run_end = (run + 1) * mod_div;
        const long long end = first + unit_rows < run_end ? first + unit_rows : run_end;
        Acc sum_p[VPT], sum_q[VPT];
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            const int v = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
#pragma unroll
            for (int i = 0; i < VEC; ++i) sum_p[k].v[i] = sum_q[k].v[i] = A(0);
            if (v < n_vec) {
                const long long col = static_cast<long long>(v) * VEC;
                Acc f, t;
#pragma unroll
                for (int i = 0; i < VEC; ++i) f.v[i] = t.v[i] = A(1);
                if constexpr (FLAGS & kWeight) {
                    const Vec<P, VEC> wv = load_vec<P, VEC>(w + col);
#pragma unroll
                    for (int i = 0; i < VEC; ++i) f.v[i] = static_cast<A>(widen(wv.v[i]));
                }
                if constexpr (MODF & kModScale) {
                    const Vec<P, VEC> sv = load_vec<P, VEC>(mod_scale + m * n + col);
#pragma unroll
                    for (int i = 0; i < VEC; ++i) f.v[i] *= A(1) + static_cast<A>(widen(sv.v[i]));
                }
                factors[v] = f;
                if constexpr (kGate) {
                    const Vec<P, VEC> gv = load_vec<P, VEC>(res_gate + m * n + col);
#pragma unroll
                    for (int i = 0; i < VEC; ++i) t.v[i] = static_cast<A>(widen(gv.v[i]));
                    gates[v] = t;
                    Acc zero;
#pragma unroll
                    for (int i = 0; i < VEC; ++i) zero.v[i] = A(0);
                    gate_sums[k * blockDim.x + threadIdx.x] = zero;
                }
            }
        }
#pragma unroll 1
        for (long long row = first; row < end; ++row) {
            const long long base = row * n;
            Vec<T, VEC> hv[VPT], gv[VPT], xv[VPT], dhv[VPT];
#pragma unroll
            for (int k = 0; k < VPT; ++k) {
                const int v = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
                if (v < n_vec) {
                    const long long e = base + static_cast<long long>(v) * VEC;
                    hv[k] = load_vec<T, VEC>(h + e);
                    gv[k] = load_vec<T, VEC>(dy + e);
                    if constexpr (kGate) xv[k] = load_vec<T, VEC>(x + e);
                    if (dh != nullptr) dhv[k] = load_vec<T, VEC>(dh + e);
                }
            }
            // the next row into L2 while this one is reduced and written
            // (the distance measured fastest: docs/notes/conditioned.md)
            if (row + 1 < end) {
                const int bytes = n * static_cast<int>(sizeof(T));
                for (int offset = threadIdx.x * 128; offset < bytes; offset += blockDim.x * 128) {
                    prefetch_l2(reinterpret_cast<const char*>(h + base + n) + offset);
                    prefetch_l2(reinterpret_cast<const char*>(dy + base + n) + offset);
                    if constexpr (kGate) prefetch_l2(reinterpret_cast<const char*>(x + base + n) + offset);
                    if (dh != nullptr) prefetch_l2(reinterpret_cast<const char*>(dh + base + n) + offset);
                }
            }
            A c0 = A(0);
            if (center != nullptr) c0 = center[row];
            const A s0 = rstd[row];
            Stats s = Grad::init();
#pragma unroll
            for (int k = 0; k < VPT; ++k) {
                const int v = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
                if (v < n_vec) {
                    const Acc f = factors[v];
#pragma unroll
                    for (int i = 0; i < VEC; ++i)
                        s = Grad::accumulate(s, static_cast<A>(widen(hv[k].v[i])),
                                             static_cast<A>(widen(gv[k].v[i])) * f.v[i], c0, s0);
                }
            }
            s = block_reduce<Grad, 16>(s, scratch);
            const GradCoeffs<A> c = Grad::coeffs(s, n, eps, c0, s0);
#pragma unroll
            for (int k = 0; k < VPT; ++k) {
                const int v = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
                if (v < n_vec) {
                    const long long e = base + static_cast<long long>(v) * VEC;
                    Vec<T, VEC> out, out_res;
                    const Acc f = factors[v];
                    Acc t, sg;
                    if constexpr (kGate) {
                        t = gates[v];
                        sg = gate_sums[k * blockDim.x + threadIdx.x];
                    }
#pragma unroll
                    for (int i = 0; i < VEC; ++i) {
                        const A hi = static_cast<A>(widen(hv[k].v[i]));
                        const A dyi = static_cast<A>(widen(gv[k].v[i]));
                        A d = grad_of<Grad>(hi, dyi * f.v[i], c);
                        if (dh != nullptr) d += static_cast<A>(widen(dhv[k].v[i]));
                        sum_p[k].v[i] = fma(dyi, (hi - c.center) * c.scale, sum_p[k].v[i]);
                        sum_q[k].v[i] += dyi;
                        if constexpr (kGate) {
                            sg.v[i] = fma(d, static_cast<A>(widen(xv[k].v[i])), sg.v[i]);
                            narrow(d, out_res.v[i]);
                            narrow(d * t.v[i], out.v[i]);
                        } else {
                            narrow(d, out.v[i]);
                        }
                    }
                    store_vec<T, VEC>(dx + e, out);
                    if constexpr (kGate) {
                        store_vec<T, VEC>(dres + e, out_res);
                        gate_sums[k * blockDim.x + threadIdx.x] = sg;
                    }
                }
            }
        }
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            const int v = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
            if (v < n_vec) {
                const long long col = static_cast<long long>(v) * VEC;
                // (whole vectors: a word a lane, the lanes 32 bytes apart,
                // writes each 32-byte sector a word at a time)
                store_vec<A, VEC>(partial + u * n + col, sum_p[k]);
                store_vec<A, VEC>(partial + (units + u) * n + col, sum_q[k]);
                if constexpr (kGate) store_vec<A, VEC>(partial + (2 * units + u) * n + col,
                                                       gate_sums[k * blockDim.x + threadIdx.x]);
            }
        }
    }
}

// OUTS: which of dshift (1), dscale (2), dgate (4) are written; FLAGS:
// the weight and bias present (their weighted rows written for
// column_sum, and read for dscale).
template <class A, class P, int FLAGS, int MODF, int OUTS>
__global__ void __launch_bounds__(256, 1)
modulated_grad_sums(const A* __restrict__ partial, const P* __restrict__ w, const P* __restrict__ b,
                    const P* __restrict__ mod_scale, P* __restrict__ dshift, P* __restrict__ dscale,
                    P* __restrict__ dgate, A* __restrict__ weighted, long long units, int n, int units_per_run,
                    long long runs, long long mod_count, int block_x) {
    using PA = typename AccOf<P>::type;
    constexpr int kSums = (MODF & kModGate) ? 3 : 2;
    __shared__ A tile[kSums][256];
    const BlockLayout bl = block_layout(block_x);
    const long long m = blockIdx.y;
    const int col = static_cast<int>(blockIdx.x) * bl.bx + bl.tx;
    // the units of modulation row m: runs m, m + mod_count, ..., each units_per_run of them
    const long long parts = (runs - m + mod_count - 1) / mod_count * units_per_run;
    A s[kSums];
#pragma unroll
    for (int q = 0; q < kSums; ++q) s[q] = A(0);
    if (col < n) {
#pragma unroll 4
        for (long long p = bl.ty; p < parts; p += bl.by) {
            const long long u = (m + p / units_per_run * mod_count) * units_per_run + p % units_per_run;
#pragma unroll
            for (int q = 0; q < kSums; ++q) s[q] += __ldcg(partial + (q * units + u) * n + col);
        }
    }
#pragma unroll
    for (int q = 0; q < kSums; ++q) tile[q][threadIdx.x] = s[q];
    __syncthreads();
    if (bl.ty != 0 || col >= n) return;
#pragma unroll
    for (int q = 0; q < kSums; ++q) {
        for (int y = 1; y < bl.by; ++y) s[q] += tile[q][y * bl.bx + bl.tx];
    }
    const long long e = m * n + col;
    A wv = A(1), bv = A(0), factor = A(1);
    if constexpr (FLAGS & kWeight) wv = static_cast<A>(widen(w[col]));
    if constexpr (FLAGS & kBias) bv = static_cast<A>(widen(b[col]));
    if constexpr (MODF & kModScale) factor += static_cast<A>(widen(mod_scale[e]));
    if constexpr (OUTS & 1) narrow(static_cast<PA>(s[1]), dshift[e]);
    if constexpr (OUTS & 2) narrow(static_cast<PA>(fma(wv, s[0], bv * s[1])), dscale[e]);
    if constexpr (OUTS & 4) narrow(static_cast<PA>(s[kSums - 1]), dgate[e]);
    if constexpr (FLAGS & kWeight) weighted[e] = factor * s[0];
    if constexpr (FLAGS & kBias) weighted[mod_count * n + e] = factor * s[1];
}

}  // namespace cunorm
