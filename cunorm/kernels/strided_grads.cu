// strided_grads.cu: the backward of a norm over a strided axis in one pass
// (strided_grad_cached). x, dy and dx are viewed as C-contiguous (outer,
// reduced, inner) with inner > 1; every (outer, inner) position is its own
// group, reduced across a stride of inner elements (axis 1 of NCHW).
//
//   g  = dy * w[r]                     (w: one weight a reduced index)
//   dx = grad_of(x, g, coeffs)          (grads.cuh: the policy's reduction
//                                        over the group gives the coeffs)
//   dweight[r] = sum over positions of dy * xhat, dbias[r] = sum of dy
//
// Thread layout: as strided_norm's (a BlockLayout bx x by over the 1-D
// block). tx walks inner in vectors of VEC positions, so a warp reads 32 *
// VEC contiguous elements of one reduced index; ty splits the reduced axis
// (thread y takes indices y, y + by, ..., CPT of them). A thread holds its
// CPT vectors of x and of dy in registers between the reduction and dx, so
// x and dy are read once and dx written once (the three-pass strided tier
// reads both twice). The by partial statistics of a position are combined
// through shared memory in y order: dx is bitwise the same run to run and
// for any outer extent.
//
// Grid: (gx, gy) blocks walking tiles of inner (x) and outer indices (y)
// in strided loops, at most the blocks resident at once (the dispatch
// sizes it): each thread's dweight/dbias sums stay in registers across its
// positions. At the end a block adds its threads'
// sums of each reduced index in tx order and writes one partial row (block
// blockIdx.y * gridDim.x + blockIdx.x of 2 x parts x reduced floats,
// dweight's rows then dbias's), which column_sum adds in a fixed order.
//
// Dynamic shared memory: max(by * VEC * bx statistics and VEC * bx
// GradCoeffs, 2 * CPT * by * bx accumulator words).
#include "grads.cuh"

namespace cunorm {

template <class Grad, class T, class P, int FLAGS, int VEC, int CPT>
__global__ void __launch_bounds__(256, 2)
strided_grad_cached(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ dh,
                    const P* __restrict__ w, const typename AccOf<T>::type* __restrict__ center,
                    const typename AccOf<T>::type* __restrict__ scale, T* __restrict__ dx,
                    typename AccOf<T>::type* __restrict__ partial, long long outer, int reduced, long long inner,
                    typename AccOf<T>::type eps, int block_x) {
    grid_dependency_sync();
    using A = typename AccOf<T>::type;
    using Stats = typename Grad::Stats;
    extern __shared__ __align__(16) unsigned char shared_raw[];
    const BlockLayout bl = block_layout(block_x);
    const int tx = bl.tx, ty = bl.ty, bx = bl.bx, by = bl.by;
    Stats* partials = reinterpret_cast<Stats*>(shared_raw);
    GradCoeffs<A>* coeffs = reinterpret_cast<GradCoeffs<A>*>(partials + by * VEC * bx);
    const long long inner_vecs = inner / VEC;
    const long long tiles = (inner_vecs + bx - 1) >> (__ffs(bx) - 1);  // bx is a power of two

    A dw_acc[CPT], db_acc[CPT];
#pragma unroll
    for (int k = 0; k < CPT; ++k) dw_acc[k] = db_acc[k] = A(0);

#pragma unroll 1
    for (long long o = blockIdx.y; o < outer; o += gridDim.y)
#pragma unroll 1
    for (long long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const long long iv = tile * bx + tx;
        const bool active = iv < inner_vecs;
        const long long base = o * reduced * inner + iv * VEC;

        A c0[VEC], s0[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            c0[j] = A(0);
            s0[j] = A(1);
            if constexpr (Grad::kSaved) {
                const long long group = o * inner + iv * VEC + j;
                if (active && center != nullptr) c0[j] = center[group];
                if (active) s0[j] = scale[group];
            }
        }
        // the weights are read again each position (L1 hits), not held
        // across positions: CPT more registers would spill LayerNorm's
        // 16-bit kernels at the launch bounds' 128
        Vec<T, VEC> xs[CPT], dys[CPT];
        A wk[CPT];
#pragma unroll
        for (int k = 0; k < CPT; ++k) {
            const int c = ty + k * by;
            wk[k] = A(1);
            if (active && c < reduced) {
                xs[k] = load_vec<T, VEC>(x + base + c * inner);
                dys[k] = load_vec<T, VEC>(dy + base + c * inner);
                if constexpr (FLAGS & kWeight) wk[k] = static_cast<A>(widen(w[c]));
            }
        }
        Stats s[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) s[j] = Grad::init();
#pragma unroll
        for (int k = 0; k < CPT; ++k) {
            if (active && ty + k * by < reduced) {
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    s[j] = Grad::accumulate(s[j], static_cast<A>(widen(xs[k].v[j])),
                                            static_cast<A>(widen(dys[k].v[j])) * wk[k], c0[j], s0[j]);
                }
            }
        }

        // The by partials of each position, combined in y order by one
        // thread (the one whose ty is j modulo by), whose coefficients the
        // others then read: a chain of by shared loads a position, not one
        // a thread, which for large by would outlast the position's memory
        // traffic. Layout [y][j][x]
        // keeps a warp's accesses on distinct banks. (A position's partials
        // are written after the previous position's last barrier, which
        // follows every read of them; its coefficients after the barrier
        // below, which follows every read of the previous ones.)
#pragma unroll
        for (int j = 0; j < VEC; ++j) partials[(ty * VEC + j) * bx + tx] = s[j];
        __syncthreads();
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            if (j % by == ty) {
                Stats total = partials[j * bx + tx];
#pragma unroll 8
                for (int yy = 1; yy < by; ++yy) total = Grad::combine(total, partials[(yy * VEC + j) * bx + tx]);
                coeffs[j * bx + tx] = Grad::coeffs(total, reduced, eps, c0[j], s0[j]);
            }
        }
        __syncthreads();
        GradCoeffs<A> f[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) f[j] = coeffs[j * bx + tx];

#pragma unroll
        for (int k = 0; k < CPT; ++k) {
            const int c = ty + k * by;
            if (active && c < reduced) {
                const long long e = base + c * inner;
                Vec<T, VEC> hv;
                if (dh != nullptr) hv = load_vec<T, VEC>(dh + e);
                Vec<T, VEC> out;
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const A xj = static_cast<A>(widen(xs[k].v[j]));
                    const A dyj = static_cast<A>(widen(dys[k].v[j]));
                    A d = grad_of<Grad>(xj, dyj * wk[k], f[j]);
                    if (dh != nullptr) d += static_cast<A>(widen(hv.v[j]));
                    narrow(d, out.v[j]);
                    if constexpr (FLAGS & kWeight) dw_acc[k] = fma(dyj, (xj - f[j].center) * f[j].scale, dw_acc[k]);
                    if constexpr (FLAGS & kBias) db_acc[k] += dyj;
                }
                store_vec<T, VEC>(dx + e, out);
            }
        }
    }

    if constexpr (FLAGS != 0) {
        // The block's sums of each reduced index: word (q * 2 + output) *
        // bx + tx for q = ty * CPT + k, added in tx order by one thread a
        // (q, output).
        A* sums = reinterpret_cast<A*>(shared_raw);
        __syncthreads();
#pragma unroll
        for (int k = 0; k < CPT; ++k) {
            sums[((ty * CPT + k) * 2) * bx + tx] = dw_acc[k];
            sums[((ty * CPT + k) * 2 + 1) * bx + tx] = db_acc[k];
        }
        __syncthreads();
        const long long parts = static_cast<long long>(gridDim.x) * gridDim.y;
        const long long part = static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x;
        for (int i = threadIdx.x; i < by * CPT * 2; i += blockDim.x) {
            const int q = i >> 1, output = i & 1;
            const int c = q / CPT + (q % CPT) * by;  // q = ty * CPT + k
            if (c >= reduced || (output == 0 && !(FLAGS & kWeight)) || (output == 1 && !(FLAGS & kBias))) continue;
            A total = sums[i * bx];
            for (int xx = 1; xx < bx; ++xx) total += sums[i * bx + xx];
            partial[(output * parts + part) * reduced + c] = total;
        }
    }
}

}  // namespace cunorm
