"""Diagnostic: does the relative placement of y against x change a row
kernel's time? (Same kernel, same data, output carved at different offsets.)"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cupy
import numpy as np

from cunorm.bench._cases import copy_bandwidth, time_gpu
from cunorm import _dtypes, _ops

bw = copy_bandwidth()
print(f"copy {bw:.0f} GB/s")
bf16 = np.dtype(_dtypes.bfloat16)
for norm, shape, threads_list in [("rms", (32768, 4096), [128, 256]), ("ln", (32768, 4096), [64, 128, 256]),
                                  ("rms", (4096, 32768), [512])]:
    size = shape[0] * shape[1] * 2
    pool = cupy.empty(3 * size + (64 << 20), dtype=np.uint8)
    x = cupy.ndarray(shape, bf16, memptr=pool.data)
    x[...] = cupy.random.standard_normal(shape, dtype=np.float32).astype(bf16)
    w = cupy.random.standard_normal(shape[1], dtype=np.float32).astype(bf16)
    b = w.copy() if norm == "ln" else None
    for off in [0, 4096, 1 << 20, 3 << 20, size // 3, (7 << 20) + 512]:
        y = cupy.ndarray(shape, bf16, memptr=pool.data + (size + off))
        for t in threads_list:
            ov = {"tier": "cached", "threads": t}
            ms, lo, hi = time_gpu(lambda: _ops.launch_on(norm, x, y, w=w, b=b, first=1, last=1, eps=1e-5, override=ov),
                                  reps=20)
            nbytes = 2 * size + 2 * w.nbytes
            print(f"{norm} {shape} threads {t:4} y at x+{size + off:>11}: {ms:.4f} ms "
                  f"(min {lo:.4f} max {hi:.4f}) {100 * nbytes / (ms * 1e-3) / 1e9 / bw:.1f}%", flush=True)
    del pool, x, y
    cupy.get_default_memory_pool().free_all_blocks()
