"""Profile the host time of cached calls (cProfile, top functions by own
time): rms_norm on torch tensors and CuPy arrays, a BatchNorm2d in eval,
an RMSNorm training step and a BatchNorm2d training step (torch's beside
it). PYTHONPATH=. python bench/tools/profile_host.py [case name ...]"""
import cProfile
import copy
import pstats
import sys
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


torch_bn = torch.nn.BatchNorm2d(64, device="cuda")
train_bn = ct.replace_norms(copy.deepcopy(torch_bn))
img_g = img.clone().requires_grad_()
dimg = torch.randn_like(img)

cases = {"rms_norm torch": lambda: cunorm.rms_norm(x, w), "rms_norm cupy": lambda: cunorm.rms_norm(xc, wc),
         "BatchNorm2d eval": lambda: bn(img), "RMSNorm step": step,
         "BatchNorm2d step": lambda: train_bn(img_g).backward(dimg),
         "torch BatchNorm2d step": lambda: torch_bn(img_g).backward(dimg)}
wanted = sys.argv[1:] or list(cases)
for name, fn in cases.items():
    if name not in wanted:
        continue
    with torch.no_grad() if not name.endswith("step") else torch.enable_grad():
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
