import cupy, numpy as np, cunorm, sys
sys.path.insert(0, "bench")
from bench import time_gpu
from cunorm import _dtypes
cases = [("gn cl bf16", (8,128,128,512), _dtypes.bfloat16, -1, 32),
         ("gn cl f32", (8,128,128,512), np.float32, -1, 32),
         ("gn cf bf16", (8,512,128,128), _dtypes.bfloat16, 1, 32),
         ("in cl f32 C64", (16,256,256,64), np.float32, -1, 64),
         ("bn cl f32 C64", (16,256,256,64), np.float32, -1, 0),
         ("gn cl f32 C64 big", (112,512,512,64), np.float32, -1, 8)]
for name, shape, dt, ca, g in cases:
    x = cupy.random.standard_normal(shape, dtype=np.float32).astype(dt)
    c = shape[ca]
    w = cupy.ones(c, dt)
    y = cupy.empty_like(x)
    if g == 0:
        f = lambda: cunorm.batch_norm(x, w, w, channel_axis=ca, out=y)
    else:
        f = lambda: cunorm.group_norm(x, g, w, w, channel_axis=ca, out=y)
    ms, lo, hi = time_gpu(f)
    print(f"{name}: {ms*1e3:.1f} us, {2*x.nbytes/ms/1e6:.0f} GB/s eff", flush=True)
    del x, y
    cupy.get_default_memory_pool().free_all_blocks()
