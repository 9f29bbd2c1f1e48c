"""Profile the host time of cached calls (cProfile, top functions by own
time): rms_norm on torch tensors and CuPy arrays, a BatchNorm2d in eval,
and an RMSNorm training step. PYTHONPATH=. python bench/profile_host.py"""
import cProfile
import pstats
import time

import cupy
import torch

import cunorm
import cunorm.torch as ct

x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
xc, wc = cupy.from_dlpack(x), cupy.from_dlpack(w)
bn = ct.replace_norms(torch.nn.BatchNorm2d(64, device="cuda").eval())
img = torch.randn(1, 64, 8, 8, device="cuda")
norm = ct.replace_norms(torch.nn.RMSNorm(4096, eps=1e-5, device="cuda", dtype=torch.bfloat16))
xg = x.clone().requires_grad_()
dy = torch.randn_like(x)


def step():
    norm(xg).backward(dy)


cases = {"rms_norm torch": lambda: cunorm.rms_norm(x, w), "rms_norm cupy": lambda: cunorm.rms_norm(xc, wc),
         "BatchNorm2d eval": lambda: bn(img), "RMSNorm step": step}
for name, fn in cases.items():
    with torch.no_grad() if name != "RMSNorm step" else torch.enable_grad():
        for _ in range(300):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(2000):
            fn()
        torch.cuda.synchronize()
        print(f"{name}: {(time.perf_counter() - t) / 2000 * 1e6:.1f} us per call")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
