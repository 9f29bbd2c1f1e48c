"""Problem 40's backward ceiling on this GPU (a one-off measurement, cited
in docs/performance.md): how fast pass 1's bytes can be read at all, and
how much pass 2 gains from what pass 1 leaves in L2.

1. Pure reads of x, dy (16 rows of 1M float4 each) and the weight, summed,
   in three orders: pass 1's chunks (a block a row's chunk, chunk-major),
   equal column shares down the rows, column tiles grid-strided down the
   rows; and one flat 537 MB array read grid-strided (a plain read).
2. The backward's own launches (streamed rows), timed with L2 as pass 1
   left it and with L2 flushed before pass 2, for pass-1 chunks of several
   sizes.

PYTHONPATH=. python bench/probe_problem40.py"""
import sys

import cupy
import numpy as np

sys.path.insert(0, ".")
sys.path.insert(0, "bench")
from cunorm import _dispatch_grad, _grad  # noqa: E402
from cunorm.bench._cases import backward_call, copy_bandwidth, time_gpu  # noqa: E402
from tune_backward import launch_times  # noqa: E402

src = r'''
#define ROWS 16
__device__ float fold(float4 a) { return a.x + a.y + a.z + a.w; }
extern "C" __global__ void __launch_bounds__(256, 1) chunks(const float4* __restrict__ x, const float4* __restrict__ dy, const float4* __restrict__ w, long long nv, long long chunk_len, float* out) {
    long long row = blockIdx.x % ROWS, chunk = blockIdx.x / ROWS;
    long long end = min(nv, (chunk + 1) * chunk_len);
    float s = 0.f;
    for (long long v0 = chunk * chunk_len + threadIdx.x; v0 < end; v0 += 4 * 256) {
        float4 a[4], b[4], c[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) if (v0 + u * 256 < end) { a[u] = x[row * nv + v0 + u * 256]; b[u] = dy[row * nv + v0 + u * 256]; c[u] = w[v0 + u * 256]; }
#pragma unroll
        for (int u = 0; u < 4; ++u) if (v0 + u * 256 < end) s += fold(a[u]) * fold(b[u]) + fold(c[u]);
    }
    if (s == 1.2345f) out[0] = s;
}
template <bool STRIDED>
__device__ void tiles(const float4* __restrict__ x, const float4* __restrict__ dy, const float4* __restrict__ w, long long nv, float* out) {
    float s[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) s[r] = 0.f;
    long long lo = blockIdx.x * nv / gridDim.x, hi = (blockIdx.x + 1) * nv / gridDim.x;
    long long first = STRIDED ? (long long)blockIdx.x * 256 : lo;
    long long step = STRIDED ? (long long)gridDim.x * 256 : 256;
    long long end = STRIDED ? nv : hi;
    for (long long t = first; t < end; t += step) {
        long long v = t + threadIdx.x;
        if (v >= end) continue;
        float wv = fold(w[v]);
#pragma unroll
        for (int r0 = 0; r0 < ROWS; r0 += 4) {
            float4 a[4], b[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) { a[u] = x[(r0 + u) * nv + v]; b[u] = dy[(r0 + u) * nv + v]; }
#pragma unroll
            for (int u = 0; u < 4; ++u) s[r0 + u] += fold(a[u]) * fold(b[u]) * wv;
        }
    }
    float t = 0.f;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) t += s[r];
    if (t == 1.2345f) out[0] = t;
}
extern "C" __global__ void __launch_bounds__(256, 3) shares(const float4* x, const float4* dy, const float4* w, long long nv, float* out) { tiles<false>(x, dy, w, nv, out); }
extern "C" __global__ void __launch_bounds__(256, 3) strided(const float4* x, const float4* dy, const float4* w, long long nv, float* out) { tiles<true>(x, dy, w, nv, out); }
extern "C" __global__ void flat(const float4* __restrict__ p, long long n4, float* out) {
    float s = 0.f;
    long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 7 * stride < n4; i += 8 * stride) {
        float4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = p[i + u * stride];
#pragma unroll
        for (int u = 0; u < 8; ++u) s += fold(v[u]);
    }
    for (; i < n4; i += stride) s += fold(p[i]);
    if (s == 1.2345f) out[0] = s;
}
'''


def read_orders(bw):
    mod = cupy.RawModule(code=src)
    nv = 1 << 20
    x = cupy.ones(16 * nv * 4, np.float32)
    dy = cupy.ones_like(x)
    w = cupy.ones(nv * 4, np.float32)
    both = cupy.ones(2 * 16 * nv * 4, np.float32)
    out = cupy.zeros(1, np.float32)
    nbytes = x.nbytes + dy.nbytes + w.nbytes
    sm = cupy.cuda.Device().attributes["MultiProcessorCount"]

    def show(label, fn, nb=nbytes):
        ms, lo, hi = time_gpu(fn)
        print(f"{label:50s} {ms:.4f} ms {nb / ms / 1e6:6.0f} GB/s ({100 * nb / ms / 1e6 / bw:.1f}% of copy)",
              flush=True)

    k = mod.get_function("chunks")
    for per_sm in (12, 24):
        chunks = -(-per_sm * sm // 16)
        chunk_len = -(-nv // chunks)
        chunks = -(-nv // chunk_len)
        show(f"chunks, {per_sm} an SM ({16 * chunks} blocks)",
             lambda: k((16 * chunks,), (256,), (x, dy, w, np.int64(nv), np.int64(chunk_len), out)))
    for name in ("shares", "strided"):
        k2 = mod.get_function(name)
        for per_sm in (2, 3):
            show(f"{name}, {per_sm} blocks an SM", lambda: k2((per_sm * sm,), (256,), (x, dy, w, np.int64(nv), out)))
    k3 = mod.get_function("flat")
    show("flat, one array of x and dy's size", lambda: k3((4 * sm,), (512,), (both, np.int64(both.size // 4), out)),
         both.nbytes)


def l2_reuse():
    *_, run, nbytes = backward_call("ln", (16, 64, 256, 256), "float32", (1, 2, 3), cupy.random.default_rng())
    busy = cupy.empty(64 << 20, dtype=np.float32)
    print("L2 bytes", cupy.cuda.Device().attributes["L2CacheSize"])
    default = _dispatch_grad.GRAD_CHUNK_BLOCKS_PER_SM
    for per_sm in (12, 48, 192):
        _dispatch_grad.GRAD_CHUNK_BLOCKS_PER_SM = per_sm
        _grad._rows_launch.cache_clear()
        _grad.rows_grad_program.cache_clear()
        for flush in (False, True):
            def before(step, flush=flush):
                if flush and "apply" in step.kernel.expression:
                    busy.fill(1)

            per = {}
            for _ in range(7):
                for name, ms in launch_times(run, before, verbose=False):
                    per.setdefault(name.replace("rows_grad_", ""), []).append(ms)
            print(f"pass-1 blocks an SM {per_sm:3d}", "L2 flushed before pass 2" if flush else "as pass 1 left it       ",
                  " ".join(f"{n} {1000 * np.median(v):6.1f} us" for n, v in per.items()), flush=True)
    _dispatch_grad.GRAD_CHUNK_BLOCKS_PER_SM = default
    _grad._rows_launch.cache_clear()
    _grad.rows_grad_program.cache_clear()


def main():
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s")
    read_orders(bw)
    l2_reuse()


if __name__ == "__main__":
    main()
