// backward_streamed.cu: the gradients of rows too long for the register
// tier (rows_grad_cached, rows_grad_cluster: backward.cu) and of a strided
// reduced axis. Arrays, statistics and the parameter gradients' partials as
// in backward.cu: C-contiguous in the layout the Python side names, float32
// partials added in a fixed order, no float atomics.
//
// Families (cunorm/_engine/gradients.py picks):
//   rows_grad_chunks / rows_grad_finalize_wide / rows_grad_apply<false>
//                      contiguous rows too long for the register tier (the
//                      whole array is one such row): pass 1 reduces chunks
//                      of each row (chunk-major), a block a row combines its
//                      chunks into its GradCoeffs, pass 2 walks column tiles
//                      down the rows for dx and the dweight/dbias partials.
//                      x and dy are read twice.
//   rows_grad_sums / rows_grad_finalize / rows_grad_apply<true>
//                      a strided reduced axis: pass 1 reduces chunks of
//                      each group, the finalize combines a group's chunks
//                      in order, pass 2 writes dx and the parameter
//                      partials.
// The partials of dweight/dbias are added by column_sum (backward.cu).
#include "grads.cuh"

namespace cunorm {

// --- the streamed rows: pass 1, finalize, pass 2 ---------------------------------
// x, dy (and dh, dx) are (outer, reduced, inner), C-contiguous; a group is
// (o, i), its elements x[o, r, i] for r < reduced, its statistics and
// coefficients at o * inner + i. The weight is indexed by r.
//
// Contiguous rows (inner 1): rows_grad_chunks + rows_grad_finalize_wide +
// rows_grad_apply<STRIDED=false>. A strided reduced axis: rows_grad_sums +
// rows_grad_finalize + rows_grad_apply<STRIDED=true>.

// rows_grad_chunks (pass 1 of contiguous rows longer than the cached tier
// holds, and of the whole array as one row): block gx reduces chunk gx /
// rows of row gx % rows into stat_partial[(row * chunks + chunk) *
// kStatWords]. The grid is chunk-major, so the blocks resident together
// (every row's same chunk) share the chunk's weights through L2: weights
// are read from DRAM once, not once a row (problem 40: 16 times 16 MB).
// dweight/dbias are left to pass 2, which walks each column down the rows
// anyway. (Tried on problem 40, H200: pass 1 by column tiles
// down the rows, the weights in registers and dweight/dbias summed there,
// 0.155 ms against this kernel's 0.140, the whole backward 56.6% against
// 57.5%; the layout before, row-major with the weights re-read from DRAM
// for each row and a column_sum of one part copying dweight/dbias, 49.1%.)
template <class Grad, class T, class P, int FLAGS, int VEC>
__global__ void __launch_bounds__(kGradBlockThreads, 1)
    rows_grad_chunks(const T* __restrict__ dy, const T* __restrict__ x, const P* __restrict__ w,
                     const typename AccOf<T>::type* __restrict__ center,
                     const typename AccOf<T>::type* __restrict__ scale,
                     typename AccOf<T>::type* __restrict__ stat_partial, long long rows, long long n, long long chunks,
                     long long chunk_len) {
    grid_dependency_sync();
    using A = typename AccOf<T>::type;
    using Stats = typename Grad::Stats;
    __shared__ Stats scratch[33];
    const long long group = blockIdx.x % rows;
    const long long chunk = blockIdx.x / rows;
    const long long n_vec = n / VEC;
    A c0 = A(0), s0 = A(1);
    if constexpr (Grad::kSaved) {
        if (center != nullptr) c0 = center[group];
        s0 = scale[group];
    }
    const long long end = min(n_vec, (chunk + 1) * chunk_len);
    Stats s = Grad::init();
    for_each_batched<4>(
        chunk * chunk_len + threadIdx.x, end, blockDim.x,
        [&](long long v) {
            GradItem<T, P, VEC> it;
            it.x = load_vec<T, VEC>(x + group * n + v * VEC);
            it.dy = load_vec<T, VEC>(dy + group * n + v * VEC);
            if constexpr (FLAGS & kWeight) it.w = load_vec<P, VEC>(w + v * VEC);
            return it;
        },
        [&](long long, const GradItem<T, P, VEC>& it) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const A g = scaled_grad<A, P, FLAGS, VEC>(static_cast<A>(widen(it.dy.v[j])), it.w, j);
                s = Grad::accumulate(s, static_cast<A>(widen(it.x.v[j])), g, c0, s0);
            }
        });
    s = block_reduce<Grad>(s, scratch);
    if (threadIdx.x == 0) Grad::store(stat_partial + (group * chunks + chunk) * Grad::kStatWords, s);
}

// rows_grad_sums (pass 1 of a strided reduced axis): block gx = (o * chunks
// + chunk) * inner_tiles + tile; thread t of the tile takes inner vector
// tile * blockDim.x + t and keeps a statistic for each of its VEC lanes
// over r in the chunk. partial: [groups][chunks][kStatWords].
template <class Grad, class T, class P, int FLAGS, int VEC>
__global__ void __launch_bounds__(kGradBlockThreads, 1)
    rows_grad_sums(const T* __restrict__ dy, const T* __restrict__ x, const P* __restrict__ w,
                   const typename AccOf<T>::type* __restrict__ center,
                   const typename AccOf<T>::type* __restrict__ scale, typename AccOf<T>::type* __restrict__ partial,
                   long long outer, long long reduced, long long inner, long long chunks, long long chunk_len) {
    grid_dependency_sync();
    using A = typename AccOf<T>::type;
    using Stats = typename Grad::Stats;
    const long long inner_vec = inner / VEC;
    const long long tiles = (inner_vec + blockDim.x - 1) / blockDim.x;
    const long long tile = blockIdx.x % tiles;
    const long long chunk = (blockIdx.x / tiles) % chunks;
    const long long o = blockIdx.x / tiles / chunks;
    const long long iv = tile * blockDim.x + threadIdx.x;
    if (iv >= inner_vec) return;
    A c0[VEC], s0[VEC];
    Stats s[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        const long long group = o * inner + iv * VEC + j;
        c0[j] = A(0);
        s0[j] = A(1);
        if constexpr (Grad::kSaved) {
            if (center != nullptr) c0[j] = center[group];
            s0[j] = scale[group];
        }
        s[j] = Grad::init();
    }
    const long long end = min(reduced, (chunk + 1) * chunk_len);
    const long long base = o * reduced * inner + iv * VEC;
    for_each_batched<4>(
        chunk * chunk_len, end, 1,
        [&](long long r) {
            GradItemScalarWeight<T, A, VEC> it;
            it.x = load_vec<T, VEC>(x + base + r * inner);
            it.dy = load_vec<T, VEC>(dy + base + r * inner);
            it.w = A(1);
            if constexpr (FLAGS & kWeight) it.w = static_cast<A>(widen(w[r]));
            return it;
        },
        [&](long long, const GradItemScalarWeight<T, A, VEC>& it) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                s[j] = Grad::accumulate(s[j], static_cast<A>(widen(it.x.v[j])),
                                        static_cast<A>(widen(it.dy.v[j])) * it.w, c0[j], s0[j]);
            }
        });
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        const long long group = o * inner + iv * VEC + j;
        Grad::store(partial + (group * chunks + chunk) * Grad::kStatWords, s[j]);
    }
}

// A group's coefficients (kCoeffWords words at coeffs + group * kCoeffWords)
// from its chunks' statistics.
template <class Grad, class A>
__device__ __forceinline__ void finalize_group(const typename Grad::Stats& s, const A* __restrict__ center,
                                               const A* __restrict__ scale, A* __restrict__ coeffs, long long group,
                                               long long n, A eps) {
    A c0 = A(0), s0 = A(1);
    if constexpr (Grad::kSaved) {
        if (center != nullptr) c0 = center[group];
        s0 = scale[group];
    }
    store_coeffs(coeffs + group * kCoeffWords, Grad::coeffs(s, n, eps, c0, s0));
}

// rows_grad_finalize: one thread a group (the strided axis: many groups of
// a few chunks), its chunks combined in chunk order.
template <class Grad, class A>
__global__ void __launch_bounds__(kGradBlockThreads, 1)
    rows_grad_finalize(const A* __restrict__ partial, const A* __restrict__ center, const A* __restrict__ scale,
                       A* __restrict__ coeffs, long long groups, long long chunks, long long n, A eps) {
    grid_dependency_sync();
    const long long group = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (group >= groups) return;
    typename Grad::Stats s = Grad::init();
    for (long long c = 0; c < chunks; ++c) {
        s = Grad::combine(s, Grad::load(partial + (group * chunks + c) * Grad::kStatWords));
    }
    finalize_group<Grad>(s, center, scale, coeffs, group, n, eps);
}

// rows_grad_finalize_wide: one block a group (contiguous rows: few rows
// have many chunks, about a thousand for the whole array, which one thread
// would add serially): thread t combines chunks t, t + blockDim.x, ... in
// order, four loads in flight (eight spilled LinfGrad<double> at the 64
// registers of 1024 threads), then block_reduce in its fixed order.
template <class Grad, class A>
__global__ void __launch_bounds__(kGradFinalizeThreads, 1)
    rows_grad_finalize_wide(const A* __restrict__ partial, const A* __restrict__ center,
                            const A* __restrict__ scale, A* __restrict__ coeffs, long long chunks, long long n,
                            A eps) {
    grid_dependency_sync();
    __shared__ typename Grad::Stats scratch[33];
    const long long group = blockIdx.x;
    typename Grad::Stats s = Grad::init();
    for_each_batched<4>(
        threadIdx.x, chunks, blockDim.x,
        [&](long long c) { return Grad::load(partial + (group * chunks + c) * Grad::kStatWords); },
        [&](long long, const typename Grad::Stats& t) { s = Grad::combine(s, t); });
    s = block_reduce<Grad>(s, scratch);
    if (threadIdx.x == 0) finalize_group<Grad>(s, center, scale, coeffs, group, n, eps);
}

// Pass 2: dx, and dweight/dbias.
// STRIDED=false: block (gx: column tile, gy: row chunk), both walked in
// reverse (the last chunks pass 1 read are the likeliest still in L2);
// thread t owns column vector tile * blockDim.x + t and walks the rows of
// its chunk, summing that column's dweight/dbias: written directly (as P)
// when there is one row chunk (problem 40), else as float partials
// [2][row chunks][n] for column_sum.
// STRIDED=true: block gx = (r * chunks + chunk) * inner_tiles + tile;
// thread t takes inner vector tile * blockDim.x + t of the outer indices in
// the chunk at reduced index r; the block's dweight/dbias sums for r go to
// partial[2][chunks * inner_tiles][reduced].
// Three blocks an SM (80 registers) for 32-bit data: problem 40's apply
// held 88 and ran two blocks an SM; 16-bit and 64-bit data spill at 80.
template <class T>
constexpr int kApplyMinBlocks = sizeof(T) == 4 ? 3 : 1;

template <class Grad, class T, class P, int FLAGS, int VEC, bool STRIDED>
__global__ void __launch_bounds__(kGradBlockThreads, kApplyMinBlocks<T>)
    rows_grad_apply(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ dh,
                    const P* __restrict__ w, const typename AccOf<T>::type* __restrict__ coeffs, T* __restrict__ dx,
                    typename AccOf<T>::type* __restrict__ partial, P* __restrict__ dw, P* __restrict__ db,
                    long long outer, long long reduced, long long inner, long long chunks, long long chunk_len) {
    grid_dependency_sync();
    using A = typename AccOf<T>::type;
    if constexpr (!STRIDED) {
        const long long n_vec = reduced / VEC;
        const long long v = static_cast<long long>(gridDim.x - 1 - blockIdx.x) * blockDim.x + threadIdx.x;
        if (v >= n_vec) return;
        Vec<P, VEC> wv;
        if constexpr (FLAGS & kWeight) wv = load_vec<P, VEC>(w + v * VEC);
        A dw_acc[VEC], db_acc[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) dw_acc[j] = db_acc[j] = A(0);
        const long long part = gridDim.y - 1 - blockIdx.y;
        const long long first = part * chunk_len;
        const long long end = min(outer, first + chunk_len);
        for_each_batched<4>(
            first, end, 1,
            [&](long long row) {
                return load_pair<T, VEC>(x, dy, row * reduced + v * VEC);
            },
            [&](long long row, const GradPair<T, VEC>& it) {
                const GradCoeffs<A> c = load_coeffs(coeffs + row * kCoeffWords);
                const long long e = row * reduced + v * VEC;
                Vec<T, VEC> hv;
                if (dh != nullptr) hv = load_vec<T, VEC>(dh + e);
                Vec<T, VEC> out;
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const A xj = static_cast<A>(widen(it.x.v[j]));
                    const A dyj = static_cast<A>(widen(it.dy.v[j]));
                    A d = grad_of<Grad>(xj, scaled_grad<A, P, FLAGS, VEC>(dyj, wv, j), c);
                    if (dh != nullptr) d += static_cast<A>(widen(hv.v[j]));
                    narrow(d, out.v[j]);
                    if constexpr (FLAGS & kWeight) dw_acc[j] = fma(dyj, (xj - c.center) * c.scale, dw_acc[j]);
                    if constexpr (FLAGS & kBias) db_acc[j] += dyj;
                }
                store_vec<T, VEC>(dx + e, out);
            });
        if constexpr (FLAGS != 0) {
            using Out = typename AccOf<P>::type;
            const long long parts = gridDim.y;
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const long long col = v * VEC + j;
                if (parts == 1) {
                    if constexpr (FLAGS & kWeight) narrow(static_cast<Out>(dw_acc[j]), dw[col]);
                    if constexpr (FLAGS & kBias) narrow(static_cast<Out>(db_acc[j]), db[col]);
                } else {
                    if constexpr (FLAGS & kWeight) partial[part * reduced + col] = dw_acc[j];
                    if constexpr (FLAGS & kBias) partial[(parts + part) * reduced + col] = db_acc[j];
                }
            }
        }
    } else {
        using Sums = PairSum<A>;
        __shared__ typename Sums::Stats scratch[33];
        const long long inner_vec = inner / VEC;
        const long long tiles = (inner_vec + blockDim.x - 1) / blockDim.x;
        const long long tile = blockIdx.x % tiles;
        const long long chunk = (blockIdx.x / tiles) % chunks;
        const long long r = blockIdx.x / tiles / chunks;
        const long long iv = tile * blockDim.x + threadIdx.x;
        A wr = A(1);
        if constexpr (FLAGS & kWeight) wr = static_cast<A>(widen(w[r]));
        typename Sums::Stats sums = Sums::init();  // (dweight, dbias) of r
        if (iv < inner_vec) {
            const long long end = min(outer, (chunk + 1) * chunk_len);
            for_each_batched<4>(
                chunk * chunk_len, end, 1,
                [&](long long o) {
                    const long long e = (o * reduced + r) * inner + iv * VEC;
                    return load_pair<T, VEC>(x, dy, e);
                },
                [&](long long o, const GradPair<T, VEC>& it) {
                    const long long e = (o * reduced + r) * inner + iv * VEC;
                    Vec<T, VEC> hv;
                    if (dh != nullptr) hv = load_vec<T, VEC>(dh + e);
                    Vec<T, VEC> out;
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        const GradCoeffs<A> c = load_coeffs(coeffs + (o * inner + iv * VEC + j) * kCoeffWords);
                        const A xj = static_cast<A>(widen(it.x.v[j]));
                        const A dyj = static_cast<A>(widen(it.dy.v[j]));
                        A d = grad_of<Grad>(xj, dyj * wr, c);
                        if (dh != nullptr) d += static_cast<A>(widen(hv.v[j]));
                        narrow(d, out.v[j]);
                        if constexpr (FLAGS & kWeight) sums.a = fma(dyj, (xj - c.center) * c.scale, sums.a);
                        if constexpr (FLAGS & kBias) sums.b += dyj;
                    }
                    store_vec<T, VEC>(dx + e, out);
                });
        }
        if constexpr (FLAGS != 0) {
            sums = block_reduce<Sums>(sums, scratch);
            if (threadIdx.x == 0) {
                const long long parts = chunks * tiles;
                const long long part = chunk * tiles + tile;
                if constexpr (FLAGS & kWeight) partial[part * reduced + r] = sums.a;
                if constexpr (FLAGS & kBias) partial[(parts + part) * reduced + r] = sums.b;
            }
        }
    }
}

}  // namespace cunorm
