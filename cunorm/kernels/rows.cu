// rows.cu: the contiguous-row family. The reduced axis is contiguous (stride
// 1) and each row is one normalization group: x is (rows, n), a row starts
// every x_row_stride elements; y is written with y_row_stride.
//
// Three tiers, picked by cunorm/_dispatch.py from the row length and count:
//
//   rows_cached    the row is read once into registers, reduced, then scaled
//                  from registers: one read and one write of every element.
//                  BLOCK_PER_ROW=false: a group of threads_per_row lanes (a
//                  power of two <= 32) per row, several rows per block,
//                  butterfly shuffles only (short rows, up to a few thousand
//                  elements). BLOCK_PER_ROW=true: the whole block owns one row
//                  at a time and combines through shared memory (rows up to
//                  the register budget of one block: 128 KB of row).
//   rows_uncached  one block per row, two sweeps over global memory (the
//                  second mostly from L2): rows too long for registers when
//                  there are enough of them to fill the GPU.
//   rows_split_*   few long rows: each row is cut into chunks, one block per
//                  (row, chunk) on a 2-D grid (x: chunk, y: row). Pass 1 writes every chunk's partial
//                  statistic to a workspace; pass 2 combines a row's partials
//                  in a fixed order (so every chunk of the row sees the
//                  bitwise same statistic) and scales its chunk.
//
// Each thread moves VEC consecutive elements per access (16 bytes when the
// pointers, strides and n allow it). The math of the norm lives in its policy
// (norms.cuh); these kernels only walk memory.
#include "reduce.cuh"

namespace cunorm {

// Registers spent on the cached row decide how many threads a block may have
// (the planner mirrors this bound: cunorm/_dispatch.py, max_threads_cached).
template <class T, int VEC, int VECS_PER_THREAD>
struct RowsCachedBounds {
    static constexpr int kCacheBytes = VECS_PER_THREAD * VEC * static_cast<int>(sizeof(T));
    static constexpr int kBlockMaxThreads = kCacheBytes > 128 ? 512 : 1024;
};

// Blocks of the group-per-row variant (BLOCK_PER_ROW=false) have this many
// threads and ask for two resident blocks: a budget of 128 registers a thread.
constexpr int kGroupBlockThreads = 256;

// The weight slice of one vector (nothing at all when there is no weight).
template <class W, int VEC>
struct WeightVec {
    Vec<W, VEC> v;
};
template <int VEC>
struct WeightVec<none_t, VEC> {};

template <class W, int VEC>
__device__ __forceinline__ WeightVec<W, VEC> load_weight(const W* w, long long i) {
    if constexpr (same_type<W, none_t>::value) {
        return WeightVec<W, VEC>{};
    } else {
        return WeightVec<W, VEC>{load_vec<W, VEC>(w + i)};
    }
}

// y[0:VEC] = epilogue(x[0:VEC]) with the weight slice wv.
template <class T, class W, int VEC, class A>
__device__ __forceinline__ void write_scaled(T* dst, const Vec<T, VEC>& in, const WeightVec<W, VEC>& wv,
                                             const Affine<A>& f) {
    Vec<T, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        const A v = fma(static_cast<A>(widen(in.v[j])), f.scale, f.shift);
        if constexpr (same_type<W, none_t>::value) {
            narrow(v, out.v[j]);
        } else {
            narrow(v * static_cast<A>(widen(wv.v.v[j])), out.v[j]);
        }
    }
    store_vec<T, VEC>(dst, out);
}

template <template <class> class NormT, class T, class W, int VEC, int VECS_PER_THREAD, bool BLOCK_PER_ROW>
__global__ void __launch_bounds__(BLOCK_PER_ROW ? RowsCachedBounds<T, VEC, VECS_PER_THREAD>::kBlockMaxThreads
                                                : kGroupBlockThreads,
                                  BLOCK_PER_ROW ? 1 : 2)
rows_cached(const T* __restrict__ x, T* __restrict__ y, const W* __restrict__ w, long long rows, int n,
            long long x_row_stride, long long y_row_stride, typename AccOf<T>::type eps,
            int threads_per_row) {
    using A = typename AccOf<T>::type;
    using Norm = NormT<A>;
    using Stats = typename Norm::Stats;
    __shared__ Stats scratch[32];

    const int n_vec = n / VEC;
    const int row_threads = BLOCK_PER_ROW ? static_cast<int>(blockDim.x) : threads_per_row;
    const int lane = BLOCK_PER_ROW ? static_cast<int>(threadIdx.x)
                                   : static_cast<int>(threadIdx.x) & (threads_per_row - 1);
    const int rows_per_block = BLOCK_PER_ROW ? 1 : static_cast<int>(blockDim.x) / threads_per_row;
    const int group = BLOCK_PER_ROW ? 0 : static_cast<int>(threadIdx.x) / threads_per_row;
    const long long step = static_cast<long long>(gridDim.x) * rows_per_block;

    // The loop bound is uniform across the block: the exchanges below need
    // every lane, so lanes past the last row ride along inactive.
    for (long long base = static_cast<long long>(blockIdx.x) * rows_per_block; base < rows; base += step) {
        const long long row = base + group;
        const bool active = row < rows;
        const T* xr = x + row * x_row_stride;

        Vec<T, VEC> cache[VECS_PER_THREAD];
#pragma unroll
        for (int k = 0; k < VECS_PER_THREAD; ++k) {
            const int v = lane + k * row_threads;
            if (active && v < n_vec) cache[k] = load_vec<T, VEC>(xr + static_cast<long long>(v) * VEC);
        }
        Stats s = Norm::init();
#pragma unroll
        for (int k = 0; k < VECS_PER_THREAD; ++k) {
            const int v = lane + k * row_threads;
            if (active && v < n_vec) {
#pragma unroll
                for (int j = 0; j < VEC; ++j) Norm::add(s, static_cast<A>(widen(cache[k].v[j])));
            }
        }
        if constexpr (BLOCK_PER_ROW) {
            s = block_reduce<Norm>(s, scratch);
        } else {
            s = group_reduce<Norm>(s, threads_per_row);
        }
        const Affine<A> f = Norm::finalize(s, n, eps);

        T* yr = y + row * y_row_stride;
#pragma unroll
        for (int k = 0; k < VECS_PER_THREAD; ++k) {
            const int v = lane + k * row_threads;
            if (active && v < n_vec) {
                const long long e = static_cast<long long>(v) * VEC;
                write_scaled<T, W, VEC, A>(yr + e, cache[k], load_weight<W, VEC>(w, e), f);
            }
        }
    }
}

template <template <class> class NormT, class T, class W, int VEC>
__global__ void __launch_bounds__(1024)
rows_uncached(const T* __restrict__ x, T* __restrict__ y, const W* __restrict__ w, long long rows,
              long long n, long long x_row_stride, long long y_row_stride, typename AccOf<T>::type eps) {
    using A = typename AccOf<T>::type;
    using Norm = NormT<A>;
    using Stats = typename Norm::Stats;
    __shared__ Stats scratch[32];
    const long long n_vec = n / VEC;

    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * x_row_stride;
        Stats s = Norm::init();
#pragma unroll 4
        for (long long v = threadIdx.x; v < n_vec; v += blockDim.x) {
            const Vec<T, VEC> in = load_vec<T, VEC>(xr + v * VEC);
#pragma unroll
            for (int j = 0; j < VEC; ++j) Norm::add(s, static_cast<A>(widen(in.v[j])));
        }
        s = block_reduce<Norm>(s, scratch);
        const Affine<A> f = Norm::finalize(s, n, eps);
        T* yr = y + row * y_row_stride;
#pragma unroll 4
        for (long long v = threadIdx.x; v < n_vec; v += blockDim.x) {
            write_scaled<T, W, VEC, A>(yr + v * VEC, load_vec<T, VEC>(xr + v * VEC), load_weight<W, VEC>(w, v * VEC), f);
        }
    }
}

// Pass 1 of the split tier: partial[row * chunks + chunk] = statistic of the
// chunk's elements. A chunk is chunk_vecs vectors (the last one may be short).
template <template <class> class NormT, class T, int VEC>
__global__ void __launch_bounds__(1024)
rows_split_partial(const T* __restrict__ x, typename AccOf<T>::type* __restrict__ partial, long long rows,
                   long long n, long long x_row_stride, long long chunks, long long chunk_vecs) {
    using A = typename AccOf<T>::type;
    using Norm = NormT<A>;
    using Stats = typename Norm::Stats;
    __shared__ Stats scratch[32];
    const long long n_vec = n / VEC;
    Stats* out = reinterpret_cast<Stats*>(partial);

    for (long long row = blockIdx.y; row < rows; row += gridDim.y)
    for (long long chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
        const long long begin = chunk * chunk_vecs;
        const long long end = min(begin + chunk_vecs, n_vec);
        const T* xr = x + row * x_row_stride;
        Stats s = Norm::init();
#pragma unroll 4
        for (long long v = begin + threadIdx.x; v < end; v += blockDim.x) {
            const Vec<T, VEC> in = load_vec<T, VEC>(xr + v * VEC);
#pragma unroll
            for (int j = 0; j < VEC; ++j) Norm::add(s, static_cast<A>(widen(in.v[j])));
        }
        s = block_reduce<Norm>(s, scratch);
        if (threadIdx.x == 0) out[row * chunks + chunk] = s;
    }
}

// Pass 2 of the split tier: combine the row's partials (same order in every
// block of the row), then scale this block's chunk.
template <template <class> class NormT, class T, class W, int VEC>
__global__ void __launch_bounds__(1024)
rows_split_apply(const T* __restrict__ x, T* __restrict__ y, const W* __restrict__ w,
                 const typename AccOf<T>::type* __restrict__ partial, long long rows, long long n,
                 long long x_row_stride, long long y_row_stride, long long chunks, long long chunk_vecs,
                 typename AccOf<T>::type eps) {
    using A = typename AccOf<T>::type;
    using Norm = NormT<A>;
    using Stats = typename Norm::Stats;
    __shared__ Stats scratch[32];
    const long long n_vec = n / VEC;
    const Stats* parts = reinterpret_cast<const Stats*>(partial);

    for (long long row = blockIdx.y; row < rows; row += gridDim.y)
    for (long long chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
        const long long begin = chunk * chunk_vecs;
        const long long end = min(begin + chunk_vecs, n_vec);
        Stats s = Norm::init();
        for (long long c = threadIdx.x; c < chunks; c += blockDim.x) s = Norm::combine(s, parts[row * chunks + c]);
        s = block_reduce<Norm>(s, scratch);
        const Affine<A> f = Norm::finalize(s, n, eps);
        const T* xr = x + row * x_row_stride;
        T* yr = y + row * y_row_stride;
#pragma unroll 4
        for (long long v = begin + threadIdx.x; v < end; v += blockDim.x) {
            write_scaled<T, W, VEC, A>(yr + v * VEC, load_vec<T, VEC>(xr + v * VEC), load_weight<W, VEC>(w, v * VEC), f);
        }
    }
}

}  // namespace cunorm
