// backward.cu: the gradients of the row norms (the policies and the
// streaming passes' shared pieces: grads.cuh; the channel norms':
// channel_grads.cu).
//
// Inputs: dy (the gradient of y), x (the forward's normalized input: h for
// the residual forms), the forward's saved float32 statistics (RMSNorm,
// LayerNorm, the channel norms; the Lp norms recompute theirs), the weight.
// Outputs: dx (plus dh, the gradient that reached h, when the forward
// returned h), and dweight / dbias. All arrays here are C-contiguous in the
// layout the Python side names (rows; (outer, reduced, inner); channels-first
// or channels-last).
//
// dweight and dbias sum over every row: each block writes float32 partials
// of its own rows, and the partials of a column are added in a fixed order
// (by column_sum, or by rows_grad_cached's own grid behind a grid barrier).
// No float atomics anywhere (an integer arrival count for the barrier), so
// every gradient is bitwise the same run to run.
//
// Families (cunorm/_engine/gradients.py picks):
//   rows_grad_cached   contiguous rows of up to 32 elements (64 bytes of x)
//                      a thread: a block walks rows with its row in
//                      registers (short rows: several rows at once, a
//                      slot of the block each), reads x and dy once, and
//                      keeps its columns' dweight/dbias partials in shared
//                      memory across rows (each thread owns the same
//                      columns in every row); once all have written their
//                      partials the grid adds them up (a cooperative
//                      launch). One read of x and dy, one write of dx.
//   rows_grad_gated    rows_grad_cached for the gated RMSNorm: the gate z
//                      read beside x and dy, dz written beside dx.
//   rows_grad_wide     rows_grad_cached for the float32 residual stream: h
//                      and dh float32 under 16-bit dy, dx written in dy's
//                      type and the residual's gradient in float32.
//   rows_grad_cluster  the same for rows one block cannot hold (sm_90): a
//                      thread-block cluster a row, its partials added by
//                      column_sum.
//   column_sum         the parameter gradients' partial rows added up, a
//                      column at a time in row order (rows_grad_cluster's,
//                      the streamed passes', the modulated backward's).
// The rows too long for a cluster and the strided axis: backward_streamed.cu.
#include "cluster.cuh"
#include "column_sums.cuh"
#include "grads.cuh"

namespace cunorm {

// --- rows_grad_cached ----------------------------------------------------------
// Thread layout: blockDim.x threads (a multiple of 32, at most MAX_THREADS)
// own vectors tid, tid + blockDim.x, ... (VPT of them) of every row; grid =
// min(rows, the blocks resident at once), block b taking rows b, b + grid,
// ... With MULTI_ROW (rows of at most 64 threads) the block is
// blockDim.x / row_threads slots of row_threads threads (32 or 64, or for
// rows of fewer vectors the power of two at or above: a part of a warp,
// reduced by shuffles alone), thread tid of a slot owning vectors tid, tid
// + row_threads, ...; block b takes rows b x slots, ..., b x slots + slots
// - 1, then the next grid x slots. A block a row would run a barrier-bound
// warp a row and write a partial row every 18 or so rows: 2.5-4x slower on
// rows of 64-256 bf16 elements (H200, docs/notes/backward.md).
// With parameters per head (heads > 1: a (heads, n) weight over rows whose
// index mod heads is their head; MULTI_ROW 0), the grid is whole heads and
// block b reads head b % heads's row of the weight (rows_grad_cached_body);
// its partials go to column_sum (no cooperative launch).
// partial (FLAGS: 2 x gridDim.x x n words) receives each block's sums of dy
// * xhat (dweight) and dy (dbias) per column; the block then counts
// in on `arrived` (zeroed by the caller) and waits for every block (the
// launch is cooperative: all blocks resident at once, or no launch), and
// the grid adds the partials up into dw and db (grid_column_sum): no
// column_sum launch after it (LayerNorm / RMSNorm bf16 32768x4096, H200:
// 81.4 / 90.3% against 80.9 / 89.4% with it, whose 9 / 6 us
// were mostly its launch and ramp).
//
// rows_grad_cluster (CLUSTER > 1, sm_90, rows longer than a block holds):
// a cluster of CLUSTER blocks shares each row, block rank r owning vectors
// r * slice + tid, + blockDim.x, ... (slice = blockDim.x x VPT vectors) of
// every row; cluster c of the grid's gridDim.x / CLUSTER takes rows c, c +
// clusters, ... Each block's statistic is added to its peers' in rank
// order through distributed shared memory (a slot a row parity: a block
// cannot be two rows ahead of a peer, the cluster barrier of every row
// holds it), so all blocks of a cluster hold the bitwise same row
// statistic. The partials are a row per cluster (parts = clusters), added
// by column_sum.
//
// The column sums live in dynamic shared memory (one word per element a
// thread owns and parameter: VPT x VEC x blockDim.x words for dweight, as
// many for dbias), in groups of W = ColumnSums::kWidth consecutive elements
// of a vector (16 bytes) so that a group is one 16-byte shared access:
// group g of vector k of lane l of warp q sits at words (q * VPT * VEC + k *
// VEC + g * W) * 32 + l * W ... + W - 1. A warp's group is 512 contiguous
// bytes (no bank conflict), and the offsets from a thread's first word are constants (a
// stride of blockDim.x instead cost a register per element for its
// address). Held in registers the sums took 32 of LayerNorm's 114 (bf16, 2
// vectors of 8), leaving two 256-thread blocks an SM and too few rows in
// flight to cover the memory latency; a word per access (before the groups)
// cost LayerNorm 128 shared-memory instructions a row a thread, 32 now.
//
// Tried and dropped (LayerNorm bf16 32768x4096, H200): the next
// row's x and dy copied into shared memory (cp.async, two stages beside the
// column sums) while the current one is worked on, 70.2% against 77.3%
// for the fetch into L2; bfloat16 pairs widened from their 32-bit words
// (a mask for the high lane, not a byte permute and a shift) and the
// row's fetch as two bulk L2 prefetches (cp.async.bulk.prefetch, sm_90):
// 80.5-81.0% both, as without; a grid sum whose warps each took a column
// of 32 down all 396 partial rows (50 dependent-batch loads a thread):
// no faster than column_sum.

// The sum of a block's statistic s over its cluster, in rank order, in every
// thread (slot: one Stats of this block's shared memory, free until every
// block of the cluster has passed the next cluster barrier).
template <class Grad, int CLUSTER>
__device__ __forceinline__ typename Grad::Stats cluster_combine(typename Grad::Stats s, typename Grad::Stats* slot) {
    if (threadIdx.x == 0) *slot = s;
    cluster_arrive();
    cluster_wait();
    typename Grad::Stats total = *cluster_peer(slot, 0);
#pragma unroll
    for (unsigned int k = 1; k < CLUSTER; ++k) total = Grad::combine(total, *cluster_peer(slot, k));
    return total;
}

// The body of rows_grad_cached (CLUSTER 1) and rows_grad_cluster. MULTI_ROW
// (CLUSTER 1 only): the block works on slots = blockDim.x / row_threads
// rows at once, slot s (threads s x row_threads ...) taking rows b x slots
// + s, + gridDim.x x slots, ...; the slots' column sums are added in slot
// order before the block writes its one partial row.
// X: the storage type of x and dh (T, or float32 for the float32 residual
// stream's h under 16-bit dy), whose gradient is then also written to
// dres as X beside dx in T.
template <class Grad, class T, class P, int FLAGS, int VEC, int VPT, int MAX_THREADS, int CLUSTER, int MULTI_ROW,
          int GATE, class X>
__device__ __forceinline__ void rows_grad_cached_body(
    const T* __restrict__ dy, const X* __restrict__ x, const X* __restrict__ dh, const T* __restrict__ z,
    const P* __restrict__ w,
    const typename AccOf<T>::type* __restrict__ center, const typename AccOf<T>::type* __restrict__ scale,
    T* __restrict__ dx, typename AccOf<T>::type* __restrict__ partial, long long rows, int n, int row_threads,
    typename AccOf<T>::type eps, int prefetch_next, P* __restrict__ dw, P* __restrict__ db,
    unsigned int* __restrict__ arrived, T* __restrict__ dz, int heads, X* __restrict__ dres) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    static_assert(CLUSTER == 1, "thread-block clusters need sm_90");
#endif
    using A = typename AccOf<T>::type;
    using Stats = typename Grad::Stats;
    using Sums = ColumnSums<A, VEC>;
    constexpr bool kWide = !same_type<X, T>::value;  // dx in T and dres in X
    static_assert(!kWide || (same_type<X, A>::value && GATE == kGradUngated), "a wide x is the float32 stream's h");
    constexpr int W = Sums::kWidth;
    __shared__ Stats scratch[33];
    __shared__ Stats cluster_slots[CLUSTER > 1 ? 2 : 1];
    extern __shared__ __align__(16) unsigned char grad_column_sums[];
    A* const sums_base = reinterpret_cast<A*>(grad_column_sums) + (threadIdx.x / 32) * (VPT * VEC * 32) +
                         (threadIdx.x % 32) * W;
    const Sums dw_sums{sums_base};
    const Sums db_sums{sums_base + ((FLAGS & kWeight) ? VPT * VEC * blockDim.x : 0)};
    static_assert(!MULTI_ROW || CLUSTER == 1, "a row a block in a cluster");
    static_assert(GATE == kGradUngated || CLUSTER == 1, "the gated backward runs a block a row or less");
    const int n_vec = n / VEC;
    const unsigned int rank = CLUSTER > 1 ? cluster_rank() : 0u;
    if constexpr (!MULTI_ROW) row_threads = static_cast<int>(blockDim.x);
    const int slots = MULTI_ROW ? static_cast<int>(blockDim.x) / row_threads : 1;
    const int slot = MULTI_ROW ? static_cast<int>(threadIdx.x) / row_threads : 0;
    const int tid = static_cast<int>(threadIdx.x) - slot * row_threads;  // within the slot
    // this thread's first vector of every row (its block's slice, then its own)
    const int first_vec = static_cast<int>(rank) * row_threads * VPT + tid;
    const long long clusters = gridDim.x / CLUSTER;  // the partials' rows
    const long long cluster = blockIdx.x / CLUSTER;
    const long long row_step = clusters * slots;
    // A weight per head (heads > 1: a block a row, the grid whole heads):
    // block b's rows b, b + grid, ... are all of head b % heads, so its
    // partial row is that head's, and the partials read as grid / heads rows
    // of heads x n columns add up to dweight (heads, n): column_sum's launch
    // after this one, never the grid sum below (whose general part count
    // and width cost the short rows' kernels 4-6 registers, a block an SM).
    // (offset 0 where heads == 1, taken unconditionally: a select of w
    // holds registers the short rows' kernels need for a block an SM)
    const P* const w_head = w + static_cast<long long>(blockIdx.x % static_cast<unsigned int>(heads)) * n;
    // the weights widened once (not twice a row: 16-bit weights cost a
    // conversion an element a pass)
    A wf[VPT][VEC];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
        const int v = first_vec + k * row_threads;
#pragma unroll
        for (int j = 0; j < VEC; ++j) wf[k][j] = A(1);
        if constexpr (FLAGS & kWeight) {
            if (v < n_vec) {
                const Vec<P, VEC> wv = load_vec<P, VEC>(w_head + static_cast<long long>(v) * VEC);
#pragma unroll
                for (int j = 0; j < VEC; ++j) wf[k][j] = static_cast<A>(widen(wv.v[j]));
            }
        }
        typename Sums::Group zero;
#pragma unroll
        for (int i = 0; i < W; ++i) zero.v[i] = A(0);
#pragma unroll
        for (int g = 0; g < VEC / W; ++g) {
            if constexpr (FLAGS & kWeight) *dw_sums.group(k, g) = zero;
            if constexpr (FLAGS & kBias) *db_sums.group(k, g) = zero;
        }
    }
    int parity = 0;
#pragma unroll 1
    for (long long first_row = cluster * slots; first_row < rows; first_row += row_step) {
        const long long row = first_row + slot;
        const bool active = !MULTI_ROW || row < rows;  // (a slot past the end still meets the barriers)
        const long long base = row * n;
        Vec<X, VEC> xv[VPT];
        Vec<T, VEC> gv[VPT];
        Vec<T, VEC> zv[GATE ? VPT : 1];
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            const int v = first_vec + k * row_threads;
            if (active && v < n_vec) {
                xv[k] = load_vec<X, VEC>(x + base + static_cast<long long>(v) * VEC);
                gv[k] = load_vec<T, VEC>(dy + base + static_cast<long long>(v) * VEC);
                if constexpr (GATE != kGradUngated) zv[k] = load_vec<T, VEC>(z + base + static_cast<long long>(v) * VEC);
            }
        }
        // prefetch_next: the block's next row into L2 while this one is
        // reduced and written, so that its loads wait on L2, not on DRAM,
        // at the top of its iteration. A line of x and one of dy a thread a
        // step (the loop before, over a row's lines of x then of dy with
        // 64-bit index arithmetic and up to k rows ahead, cost LayerNorm
        // bf16 32768x4096 1.4 points).
        if (prefetch_next && row + row_step < rows) {
            const int first = (first_vec - tid) * VEC;  // the block's slice
            const char* const x_next = reinterpret_cast<const char*>(x + (row + row_step) * n + first);
            const char* const dy_next = reinterpret_cast<const char*>(dy + (row + row_step) * n + first);
            const int bytes = min(n - first, row_threads * VPT * VEC) * static_cast<int>(sizeof(T));
            for (int offset = tid * 128; offset < bytes; offset += row_threads * 128) {
                prefetch_l2(x_next + offset);
                if constexpr (kWide) prefetch_l2(x_next + bytes + offset);  // (x twice dy's bytes)
                prefetch_l2(dy_next + offset);
                if constexpr (GATE != kGradUngated) {
                    prefetch_l2(reinterpret_cast<const char*>(z + (row + row_step) * n + first) + offset);
                }
            }
        }
        A c0 = A(0), s0 = A(1);
        if constexpr (Grad::kSaved) {
            if (active) {
                if (center != nullptr) c0 = center[row];
                s0 = scale[row];
            }
        }
        Stats s = Grad::init();
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            if (active && first_vec + k * row_threads < n_vec) {
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    A dyj = static_cast<A>(widen(gv[k].v[j]));
                    A xj = static_cast<A>(widen(xv[k].v[j]));
                    if constexpr (GATE != kGradUngated) {
                        const A zj = static_cast<A>(widen(zv[k].v[j]));
                        const A silu = zj * sigmoid_of(zj);
                        if constexpr (GATE == kGradGateOutput) dyj *= silu;  // silu(z) multiplies y
                        else xj *= silu;  // the norm's input
                    }
                    s = Grad::accumulate(s, xj, weighted<FLAGS>(dyj, wf[k][j]), c0, s0);
                }
            }
        }
        // (the block's most warps known: its warps' sums are added by an
        // unrolled loop, not the general one with its trip-count
        // arithmetic; LayerNorm bf16 32768x4096 77.2 -> 79.4%, H200)
        if constexpr (!MULTI_ROW) {
            s = block_reduce<Grad, MAX_THREADS / 32>(s, scratch);
        } else {
            s = group_block_reduce<Grad, MAX_THREADS / 32>(s, scratch, row_threads);
        }
        if constexpr (CLUSTER > 1) {
            s = cluster_combine<Grad, CLUSTER>(s, &cluster_slots[parity]);
            parity ^= 1;
        }
        const GradCoeffs<A> c = Grad::coeffs(s, n, eps, c0, s0);
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            const int v = first_vec + k * row_threads;
            if (active && v < n_vec) {
                const long long e = base + static_cast<long long>(v) * VEC;
                Vec<X, VEC> hv;
                if (dh != nullptr) hv = load_vec<X, VEC>(dh + e);
                Vec<T, VEC> out;
                Vec<X, VEC> wide_out;
                Vec<T, VEC> dz_out;
#pragma unroll
                for (int g = 0; g < VEC / W; ++g) {
                    typename Sums::Group dw_group, db_group;
                    if constexpr (FLAGS & kWeight) dw_group = *dw_sums.group(k, g);
                    if constexpr (FLAGS & kBias) db_group = *db_sums.group(k, g);
#pragma unroll
                    for (int i = 0; i < W; ++i) {
                        const int j = g * W + i;
                        A xj = static_cast<A>(widen(xv[k].v[j]));
                        A dyj = static_cast<A>(widen(gv[k].v[j]));
                        A d;
                        if constexpr (GATE == kGradGateOutput) {
                            // y = xhat * w * silu(z): dz = dy * xhat * w * silu'(z), and the
                            // norm's gradient of dy * silu(z)
                            const A zj = static_cast<A>(widen(zv[k].v[j]));
                            const SiluGrad<A> sz = silu_grad(zj, sigmoid_of(zj));
                            narrow(dyj * (xj * c.scale * wf[k][j]) * sz.slope, dz_out.v[j]);
                            dyj *= sz.value;
                            d = grad_of<Grad>(xj, weighted<FLAGS>(dyj, wf[k][j]), c);
                        } else if constexpr (GATE == kGradGateInput) {
                            // y = norm(u) * w with u = x * silu(z): du from the norm, dx = du *
                            // silu(z), dz = du * x * silu'(z)
                            const A zj = static_cast<A>(widen(zv[k].v[j]));
                            const SiluGrad<A> sz = silu_grad(zj, sigmoid_of(zj));
                            const A u = xj * sz.value;
                            const A du = grad_of<Grad>(u, weighted<FLAGS>(dyj, wf[k][j]), c);
                            narrow(du * xj * sz.slope, dz_out.v[j]);
                            d = du * sz.value;
                            xj = u;  // (dweight sums dy * norm(u))
                        } else {
                            d = grad_of<Grad>(xj, weighted<FLAGS>(dyj, wf[k][j]), c);
                        }
                        if (dh != nullptr) d += static_cast<A>(widen(hv.v[j]));
                        narrow(d, out.v[j]);
                        if constexpr (kWide) wide_out.v[j] = d;
                        if constexpr (FLAGS & kWeight) dw_group.v[i] = fma(dyj, (xj - c.center) * c.scale, dw_group.v[i]);
                        if constexpr (FLAGS & kBias) db_group.v[i] += dyj;
                    }
                    if constexpr (FLAGS & kWeight) *dw_sums.group(k, g) = dw_group;
                    if constexpr (FLAGS & kBias) *db_sums.group(k, g) = db_group;
                }
                store_vec<T, VEC>(dx + e, out);
                if constexpr (kWide) store_vec<X, VEC>(dres + e, wide_out);
                if constexpr (GATE != kGradUngated) store_vec<T, VEC>(dz + e, dz_out);
            }
        }
    }
    // no block leaves while a peer may still read its slot
    if constexpr (CLUSTER > 1) {
        cluster_arrive();
        cluster_wait();
    }
    if constexpr (FLAGS != 0) {
        if constexpr (MULTI_ROW) __syncthreads();  // every slot's sums written
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            const int v = first_vec + k * row_threads;
            if (slot == 0 && v < n_vec) {
#pragma unroll
                for (int g = 0; g < VEC / W; ++g) {
                    const long long col = static_cast<long long>(v) * VEC + g * W;
                    typename Sums::Group dw_group, db_group;
                    if constexpr (FLAGS & kWeight) dw_group = *dw_sums.group(k, g);
                    if constexpr (FLAGS & kBias) db_group = *db_sums.group(k, g);
                    for (int q = 1; q < slots; ++q) {  // the other slots' threads of these columns, in slot order
                        const int peer = static_cast<int>(threadIdx.x) + q * row_threads;
                        const int shift = ((peer >> 5) - static_cast<int>(threadIdx.x >> 5)) * (VPT * VEC * 32) +
                                          ((peer & 31) - static_cast<int>(threadIdx.x & 31)) * W;
                        const Sums peer_dw{dw_sums.first + shift}, peer_db{db_sums.first + shift};
#pragma unroll
                        for (int i = 0; i < W; ++i) {
                            if constexpr (FLAGS & kWeight) dw_group.v[i] += peer_dw.group(k, g)->v[i];
                            if constexpr (FLAGS & kBias) db_group.v[i] += peer_db.group(k, g)->v[i];
                        }
                    }
#pragma unroll
                    for (int i = 0; i < W; ++i) {
                        if constexpr (FLAGS & kWeight) partial[cluster * n + col + i] = dw_group.v[i];
                        if constexpr (FLAGS & kBias) partial[(clusters + cluster) * n + col + i] = db_group.v[i];
                    }
                }
            }
        }
        // Without `arrived` (a launch that cannot be cooperative: the jit
        // path's), column_sum adds the partials up after this launch.
        if (CLUSTER > 1 || arrived == nullptr) return;
        // Every block's partials written (the grid is co-resident: a
        // cooperative launch), then the grid adds them up.
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(arrived, 1u);
            while (load_acquire(arrived) < gridDim.x) __nanosleep(32);
        }
        __syncthreads();
        // (the column sums' shared memory, VPT x VEC words a thread and
        // parameter, holds the tile: four words a thread where it has them)
        A* const tile = reinterpret_cast<A*>(grad_column_sums);
        constexpr int kSumWords = VPT * VEC * (((FLAGS & kWeight) ? 1 : 0) + ((FLAGS & kBias) ? 1 : 0));
        if constexpr (sizeof(A) == 4 && kSumWords >= 4) {
            if (n % 4 == 0) {
                grid_column_sum<4, A, P, FLAGS>(partial, dw, db, static_cast<int>(gridDim.x), n, tile);
                return;
            }
        }
        grid_column_sum<1, A, P, FLAGS>(partial, dw, db, static_cast<int>(gridDim.x), n, tile);
    }
}

// A block a row. It declares no cluster shape: a kernel that declares one,
// even of one block, had its cooperative launches refused as too large
// (CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE) at grids the occupancy query
// allowed (H100).
template <class Grad, class T, class P, int FLAGS, int VEC, int VPT, int MAX_THREADS, int MIN_BLOCKS, int MULTI_ROW>
__global__ void __launch_bounds__(MAX_THREADS, MIN_BLOCKS)
    rows_grad_cached(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ dh,
                     const P* __restrict__ w, const typename AccOf<T>::type* __restrict__ center,
                     const typename AccOf<T>::type* __restrict__ scale, T* __restrict__ dx,
                     typename AccOf<T>::type* __restrict__ partial, long long rows, int n, int row_threads,
                     typename AccOf<T>::type eps, int prefetch_next, P* __restrict__ dw, P* __restrict__ db,
                     unsigned int* __restrict__ arrived, int heads) {
    grid_dependency_sync();
    rows_grad_cached_body<Grad, T, P, FLAGS, VEC, VPT, MAX_THREADS, 1, MULTI_ROW, kGradUngated, T>(
        dy, x, dh, nullptr, w, center, scale, dx, partial, rows, n, row_threads, eps, prefetch_next, dw, db, arrived,
        nullptr, heads, nullptr);
}

// The gated RMSNorm (Grad RmsGrad): rows_grad_cached reading the gate z
// beside x and dy and writing dz beside dx. GATE kGradGateOutput (y =
// xhat * w * silu(z)): the row's sum and dx take g = dy * silu(z) * w,
// dweight sums dy * silu(z) * xhat, dz = dy * xhat * w * silu'(z).
// kGradGateInput (y = norm(u) * w, u = x * silu(z) formed in A as the
// forward formed it): the norm's gradient du of u, dx = du * silu(z), dz =
// du * x * silu'(z), dweight sums dy * u * rstd. sigmoid(z) is evaluated
// in the reduction and again after it, z held in x's dtype: held in A
// across the reduction, it spilled (docs/notes/conditioned.md).
template <class Grad, class T, class P, int FLAGS, int GATE, int VEC, int VPT, int MAX_THREADS, int MIN_BLOCKS,
          int MULTI_ROW>
__global__ void __launch_bounds__(MAX_THREADS, MIN_BLOCKS)
    rows_grad_gated(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ z,
                    const P* __restrict__ w, const typename AccOf<T>::type* __restrict__ scale, T* __restrict__ dx,
                    T* __restrict__ dz, typename AccOf<T>::type* __restrict__ partial, long long rows, int n,
                    int row_threads, typename AccOf<T>::type eps, int prefetch_next, P* __restrict__ dw,
                    unsigned int* __restrict__ arrived, int heads) {
    grid_dependency_sync();
    static_assert(GATE == kGradGateOutput || GATE == kGradGateInput, "a gated backward");
    rows_grad_cached_body<Grad, T, P, FLAGS, VEC, VPT, MAX_THREADS, 1, MULTI_ROW, GATE, T>(
        dy, x, nullptr, z, w, nullptr, scale, dx, partial, rows, n, row_threads, eps, prefetch_next, dw, nullptr,
        arrived, dz, heads, nullptr);
}

// The float32 residual stream's backward (T 16-bit; the forward formed h =
// x + r in float32 and normalized it): rows_grad_cached over h (float32)
// with dy in T; dh (the float32 gradient that reached h, or null) is added
// in float32, and the sum, the gradient of both x and the residual, is
// written twice: dx rounded once to T, dres as float32. Per element: dy
// and dx 2 bytes each, h, dh and dres 4.
template <class Grad, class T, class P, int FLAGS, int VEC, int VPT, int MAX_THREADS, int MIN_BLOCKS, int MULTI_ROW>
__global__ void __launch_bounds__(MAX_THREADS, MIN_BLOCKS)
    rows_grad_wide(const T* __restrict__ dy, const typename AccOf<T>::type* __restrict__ x,
                   const typename AccOf<T>::type* __restrict__ dh, const P* __restrict__ w,
                   const typename AccOf<T>::type* __restrict__ center,
                   const typename AccOf<T>::type* __restrict__ scale, T* __restrict__ dx,
                   typename AccOf<T>::type* __restrict__ dres, typename AccOf<T>::type* __restrict__ partial,
                   long long rows, int n, int row_threads, typename AccOf<T>::type eps, int prefetch_next,
                   P* __restrict__ dw, P* __restrict__ db, unsigned int* __restrict__ arrived, int heads) {
    grid_dependency_sync();
    static_assert(sizeof(T) == 2, "the float32 stream runs under 16-bit x");
    rows_grad_cached_body<Grad, T, P, FLAGS, VEC, VPT, MAX_THREADS, 1, MULTI_ROW, kGradUngated,
                          typename AccOf<T>::type>(
        dy, x, dh, nullptr, w, center, scale, dx, partial, rows, n, row_threads, eps, prefetch_next, dw, db, arrived,
        nullptr, heads, dres);
}

// A cluster of CLUSTER blocks a row (sm_90; never cooperative).
template <class Grad, class T, class P, int FLAGS, int VEC, int VPT, int MAX_THREADS, int MIN_BLOCKS, int CLUSTER>
__global__ void __launch_bounds__(MAX_THREADS, MIN_BLOCKS) CUNORM_CLUSTER_DIMS(CLUSTER)
    rows_grad_cluster(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ dh,
                      const P* __restrict__ w, const typename AccOf<T>::type* __restrict__ center,
                      const typename AccOf<T>::type* __restrict__ scale, T* __restrict__ dx,
                      typename AccOf<T>::type* __restrict__ partial, long long rows, int n, int row_threads,
                      typename AccOf<T>::type eps, int prefetch_next, P* __restrict__ dw, P* __restrict__ db,
                      unsigned int* __restrict__ arrived) {
    grid_dependency_sync();
    rows_grad_cached_body<Grad, T, P, FLAGS, VEC, VPT, MAX_THREADS, CLUSTER, 0, kGradUngated, T>(
        dy, x, dh, nullptr, w, center, scale, dx, partial, rows, n, row_threads, eps, prefetch_next, dw, db, arrived,
        nullptr, 1, nullptr);
}

// --- column_sum ------------------------------------------------------------------
// dweight and dbias in one launch: block row gy = 0 (dweight, into out_w)
// or 1 (dbias, into out_b; a null output skips its blocks) adds partial
// rows [gy * parts, (gy + 1) * parts): out[c] = sum over p < parts of
// partial[(gy * parts + p) * n + c], rounded once to P. Block (bx, by), bx
// * by = 256, by the power of two nearest above parts (at most 32):
// tx takes C consecutive columns of the block's bx * C (one 16-byte load
// where n allows: C = 16 / sizeof(A), else 1), ty parts y, y + by, ...
// (sum_partial_columns, bx x by threads), eight loads
// in flight a thread (LayerNorm bf16 32768x4096's 396 partial
// rows, dweight and dbias: 9 us, 10 us one load at a time). A column a
// thread made 2 partial rows of 2M columns 71 us, one short block for
// every 128 columns (H200). (A fixed 32 x 32 block launched
// 128K blocks of 1024 threads for 4M columns of one partial row each:
// 16.8% of copy bandwidth.)
template <class A, class P, int C>
__global__ void __launch_bounds__(kGradBlockThreads, 1)
    column_sum(const A* __restrict__ partial, P* __restrict__ out_w, P* __restrict__ out_b, int parts, long long n,
               int block_x) {
    grid_dependency_sync();
    const BlockLayout bl = block_layout(block_x);
    __shared__ A tile[kGradBlockThreads * C];
    if ((blockIdx.y == 0 ? out_w : out_b) == nullptr) return;
    const long long col = (static_cast<long long>(blockIdx.x) * bl.bx + bl.tx) * C;
    sum_partial_columns<C, 8>(partial + static_cast<long long>(blockIdx.y) * parts * n, out_w, out_b,
                              static_cast<int>(blockIdx.y), parts, n, col, bl.tx, bl.ty, bl.bx, bl.by, tile);
}

}  // namespace cunorm
