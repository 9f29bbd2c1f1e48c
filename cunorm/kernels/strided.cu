// strided.cu: the strided-axis family. x is viewed as (outer, reduced, inner)
// with inner > 1 and unit stride along inner; every (outer, inner) position is
// its own normalization group, reduced across a stride of x_reduced_stride
// elements (axis 1 of NCHW: the channel axis, stride H*W).
//
// Thread layout: bx x by (a BlockLayout over the 1-D block). tx walks inner
// in vectors of VEC consecutive positions, so a warp reads 32 * VEC
// contiguous elements of one channel (coalesced, 16-byte accesses); ty
// splits the reduced axis (thread y takes channels y, y + by, ...). Each
// thread keeps VEC independent statistics; the by partials of a position are
// combined through shared memory in y order (bitwise reproducible). When bx
// covers all of inner, consecutive y read consecutive channels, which are
// adjacent in memory, so small inner extents stay coalesced too.
//
//   CHANNELS_PER_THREAD > 0: the thread's channels are held in registers
//     between the reduction and the epilogue: one read, one write.
//   CHANNELS_PER_THREAD == 0: two sweeps over the channels, the second
//     mostly served by L2 (a block's working set is reduced * blockDim.x *
//     VEC elements): for reduced extents too long for registers.
//
// STORE: the store stage (stages.cuh), its parameters one per channel
// (reduced index).
// Per-group statistics go to center_out / scale_out (index o * inner + i)
// when those are not null. No residual here: cunorm forms h first for a
// strided axis (cunorm/_engine/row_norms.py).
//
// Dynamic shared memory: by * VEC * bx Stats.
#include "reduce.cuh"

namespace cunorm {

// channels per thread folded apart before joining the thread's total (the
// two-sweep loop below)
constexpr int kStridedRun = 256;

template <template <class> class NormT, class T, class STORE, int VEC, int CHANNELS_PER_THREAD>
__global__ void __launch_bounds__(256, 2)
strided_norm(const T* __restrict__ x, const typename STORE::Param* __restrict__ w,
             const typename STORE::Param* __restrict__ b, typename STORE::Out* __restrict__ y,
             typename AccOf<T>::type* center_out, typename AccOf<T>::type* scale_out, long long outer, int reduced,
             long long inner, long long x_outer_stride, long long x_reduced_stride, typename AccOf<T>::type eps,
             int block_x) {
    grid_dependency_sync();
    using A = typename AccOf<T>::type;
    using Norm = NormT<A>;
    using Stats = typename Norm::Stats;
    extern __shared__ __align__(16) unsigned char shared_raw[];
    Stats* partials = reinterpret_cast<Stats*>(shared_raw);

    const BlockLayout bl = block_layout(block_x);
    const int tx = bl.tx, ty = bl.ty, bx = bl.bx, by = bl.by;
    const long long inner_vecs = inner / VEC;
    const long long tiles = (inner_vecs + bx - 1) >> (__ffs(bx) - 1);  // bx is a power of two
    const long long y_outer_stride = static_cast<long long>(reduced) * inner;

    // 2-D grid (x: tiles of inner, y: outer), strided loops in both, so no
    // 64-bit division (a call, whose live registers ptxas spills) is needed.
#pragma unroll 1
    for (long long o = blockIdx.y; o < outer; o += gridDim.y)
#pragma unroll 1
    for (long long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const long long iv = tile * bx + tx;
        const bool active = iv < inner_vecs;
        const T* xo = x + o * x_outer_stride + iv * VEC;
        typename STORE::Out* yo = y + o * y_outer_stride + iv * VEC;

        Stats s[VEC];
        A pivot[VEC];  // each position's shift: its channel-0 value (kShifted norms)
        Vec<T, VEC> first_channel;
        if (Norm::kShifted && active) first_channel = load_vec<T, VEC>(xo);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            s[j] = Norm::init();
            pivot[j] = (Norm::kShifted && active) ? static_cast<A>(widen(first_channel.v[j])) : A(0);
        }

        // CHANNELS_PER_THREAD == 0 declares a one-slot cache that stays unused.
        Vec<T, VEC> cache[CHANNELS_PER_THREAD > 0 ? CHANNELS_PER_THREAD : 1];
        if constexpr (CHANNELS_PER_THREAD > 0) {
#pragma unroll
            for (int k = 0; k < CHANNELS_PER_THREAD; ++k) {
                const int c = ty + k * by;
                if (active && c < reduced) cache[k] = load_vec<T, VEC>(xo + c * x_reduced_stride);
            }
#pragma unroll
            for (int k = 0; k < CHANNELS_PER_THREAD; ++k) {
                const int c = ty + k * by;
                if (active && c < reduced) {
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        s[j] = fold_one<Norm>(s[j], static_cast<A>(widen(cache[k].v[j])) - pivot[j]);
                    }
                }
            }
        } else {
            if (active) {
                // Two levels: each run of kStridedRun channels is folded into
                // its own partial, then combined into s, so a float32 sum's
                // rounding grows with reduced / kStridedRun + kStridedRun
                // values, not with reduced / by (0.5% at 2^31 channels).
                // 64-bit indexes: reduced may be within by of 2^31, past which
                // an int c + by overflows (measured: no slower than int;
                // unsigned is 10-50% slower, docs/notes/hardening.md).
                const long long end = reduced, step = static_cast<long long>(by) * kStridedRun;
#pragma unroll 1
                for (long long start = ty; start < end; start += step) {
                    const long long stop = min(end, start + step);
                    Stats run[VEC];
#pragma unroll
                    for (int j = 0; j < VEC; ++j) run[j] = Norm::init();
#pragma unroll 4
                    for (long long c = start; c < stop; c += by) {
                        const Vec<T, VEC> in = load_vec<T, VEC>(xo + c * x_reduced_stride);
#pragma unroll
                        for (int j = 0; j < VEC; ++j) {
                            run[j] = fold_one<Norm>(run[j], static_cast<A>(widen(in.v[j])) - pivot[j]);
                        }
                    }
#pragma unroll
                    for (int j = 0; j < VEC; ++j) s[j] = Norm::combine(s[j], run[j]);
                }
            }
        }

        // Combine the by partials of each position: layout [y][j][x] keeps a
        // warp's reads on distinct banks.
        __syncthreads();
#pragma unroll
        for (int j = 0; j < VEC; ++j) partials[(ty * VEC + j) * bx + tx] = s[j];
        __syncthreads();
        Affine<A> f[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            Stats total = partials[j * bx + tx];
            for (int yy = 1; yy < by; ++yy) total = Norm::combine(total, partials[(yy * VEC + j) * bx + tx]);
            f[j] = Norm::finalize(total, reduced, eps);
            if (active && ty == 0) store_stats(center_out, scale_out, o * inner + iv * VEC + j, f[j], pivot[j]);
        }

        auto write = [&](long long c, const Vec<T, VEC>& in) {
            const auto p = STORE::template channel<A>(w, b, c);
            Vec<typename STORE::Out, VEC> out;
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                STORE::template element<T>(static_cast<A>(widen(in.v[j])) - pivot[j], f[j], p, out.v[j]);
            }
            store_vec(yo + c * inner, out);
        };
        if constexpr (CHANNELS_PER_THREAD > 0) {
#pragma unroll
            for (int k = 0; k < CHANNELS_PER_THREAD; ++k) {
                const int c = ty + k * by;
                if (active && c < reduced) write(c, cache[k]);
            }
        } else {
            if (active) {
#pragma unroll 4
                for (long long c = ty; c < reduced; c += by) {
                    write(c, load_vec<T, VEC>(xo + c * x_reduced_stride));
                }
            }
        }
    }
}

// h = x + r (rounded to T) over n_vec vectors of contiguous arrays: the
// residual add for a strided axis, where the norm then reads h (the fused
// form lives in the row family, whose layout the LLM pattern uses).
template <class T, int VEC>
__global__ void __launch_bounds__(256, 4)
residual_add(const T* __restrict__ x, const T* __restrict__ r, T* __restrict__ h, long long n_vec) {
    grid_dependency_sync();
#pragma unroll 1
    for (long long v = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; v < n_vec;
         v += static_cast<long long>(gridDim.x) * blockDim.x) {
        store_vec<T, VEC>(h + v * VEC, add_residual<T, VEC>(load_vec<T, VEC>(x + v * VEC), load_vec<T, VEC>(r + v * VEC)));
    }
}

}  // namespace cunorm
