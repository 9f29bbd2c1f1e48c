"""Sweep rows_grad_cached's preferred block (GRAD_CACHED_TARGET_THREADS) on
LayerNorm and RMSNorm backward, bf16 32768x4096 and problem 40; floor% against the copy
bandwidth of the same run. PYTHONPATH=. python bench/tune_backward.py"""
import sys, cupy, numpy as np
sys.path.insert(0, ".")
import cunorm
from cunorm import _dispatch, _grad, _dtypes
from cunorm.bench._cases import time_gpu, copy_bandwidth
bw = copy_bandwidth()
print("copy", bw)
rng = cupy.random.default_rng(0)
bf = np.dtype(_dtypes.bfloat16)
for shape, axis in (((32768, 4096), -1), ((16, 64, 256, 256), (1, 2, 3))):
    dt = bf if shape[0] == 32768 else np.dtype(np.float32)
    x = rng.standard_normal(shape, dtype=np.float32).astype(dt); dy = rng.standard_normal(shape, dtype=np.float32).astype(dt)
    ps = shape[1:] if isinstance(axis, tuple) else (shape[-1],)
    w = rng.standard_normal(ps, dtype=np.float32).astype(dt); b = w.copy()
    _, mean, rstd = cunorm.layer_norm(x, w, b, axis=axis, return_stats=True)
    nbytes = 3 * x.nbytes + 3 * w.nbytes
    for target in (128, 256, 512):
        _dispatch.GRAD_CACHED_TARGET_THREADS = target
        _grad._rows_launch.cache_clear()
        ms = time_gpu(lambda: cunorm.layer_norm_backward(dy, x, mean, rstd, w, b, axis=axis))[0]
        print(shape, "layer_norm target", target, f"{ms:.3f} ms {100 * nbytes / ms / 1e6 / bw:.1f}%", flush=True)
        _, rstd1 = cunorm.rms_norm(x, w, axis=axis, return_stats=True)
        ms = time_gpu(lambda: cunorm.rms_norm_backward(dy, x, rstd1, w, axis=axis))[0]
        print(shape, "rms_norm target", target,
              f"{ms:.3f} ms {100 * (3 * x.nbytes + 2 * w.nbytes) / ms / 1e6 / bw:.1f}%", flush=True)
    del x, dy
