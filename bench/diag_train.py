"""Where a norm layer's time goes, torch against cunorm: BatchNorm2d on
ResNet-50's activations (b32), LayerNorm on ViT-S/16's (64,197,384) and
BERT's (8,512,768) under bf16 autocast; per layer, forward + backward
(train) or forward (eval), the single call (CUDA events), the GPU time
(profiler kernel sums) and the host time (wall clock per call in a loop).
PYTHONPATH=. python bench/diag_train.py [-v] [-q] [bn] [ln] [bnsweep] [lnsweep] [gn]
(-q: no profiler, single call and host time only)"""
import copy
import os
import statistics
import sys
import time

import torch

import cunorm.torch as ct
from cunorm import _dispatch_channels, _dispatch_grad

if "PLANE_ROWS_MAX_VECS" in os.environ:  # the plane-rows threshold to try (before any call plans)
    _dispatch_channels.CHANNEL_PLANE_ROWS_MAX_VECS = _dispatch_grad.CHANNEL_PLANE_ROWS_MAX_VECS = int(
        os.environ["PLANE_ROWS_MAX_VECS"])

SHAPES = [(32, 64, 112, 112), (32, 256, 56, 56), (32, 128, 56, 56), (32, 512, 28, 28), (32, 1024, 14, 14),
          (32, 2048, 7, 7)]
LN_SHAPES = [(64, 197, 384), (8, 512, 768)]
#: the crossover sweeps (kinds "bnsweep", "lnsweep", "gn"): sizes around where
#: cunorm's single call overtakes torch's
BN_SWEEP = [(32, 64, 56, 56), (32, 128, 56, 56), (32, 256, 56, 56), (64, 256, 56, 56), (32, 128, 28, 28),
            (128, 512, 28, 28), (128, 1024, 14, 14)]
LN_SWEEP = [(8, 512, 768), (32, 512, 768), (64, 512, 768), (128, 512, 768), (64, 197, 768), (256, 197, 384)]
GN_SHAPES = [(2, 320, 64, 64), (8, 320, 64, 64), (8, 640, 32, 32), (8, 1280, 16, 16), (8, 512, 128, 128)]


def cases(kinds):
    """(label, torch layer, input dtype, autocast) of each case."""
    if "bn" in kinds:
        for shape in SHAPES:
            for dtype in (torch.float32, torch.bfloat16):
                yield shape, (lambda c=shape[1]: torch.nn.BatchNorm2d(c, device="cuda")), dtype, False
    if "ln" in kinds:
        for shape in LN_SHAPES:
            for dtype in (torch.float32, torch.bfloat16):
                yield shape, (lambda c=shape[-1]: torch.nn.LayerNorm(c, device="cuda")), dtype, True
    if "bnsweep" in kinds:
        yield from ((shape, (lambda c=shape[1]: torch.nn.BatchNorm2d(c, device="cuda")), dtype, False)
                    for shape in BN_SWEEP for dtype in (torch.float32, torch.bfloat16))
    if "lnsweep" in kinds:
        for shape in LN_SWEEP:
            yield shape, (lambda c=shape[-1]: torch.nn.LayerNorm(c, device="cuda")), torch.bfloat16, True
    if "gn" in kinds:
        for shape in GN_SHAPES:
            yield shape, (lambda c=shape[1]: torch.nn.GroupNorm(32, c, device="cuda")), torch.bfloat16, True


def step_fn(layer, x, dy, autocast=False):
    def step():
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            y = layer(x)
        y.backward(dy.to(y.dtype))
    return step


def single(fn, n=30):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    return statistics.median(ts)


def gpu_time(fn, n=10):
    if "-q" in sys.argv:
        return float("nan"), {}
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    kernels = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[ev.name] = kernels.get(ev.name, 0.0) + ev.device_time / n
    return sum(kernels.values()), kernels


def host(fn, n=200):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t) / n * 1e6


def main():
    verbose = "-v" in sys.argv
    print("| shape | dtype | mode | torch single us | cunorm single us | torch GPU us | cunorm GPU us | torch host us | cunorm host us |")
    print("|---|---|---|---|---|---|---|---|---|")
    kinds = [a for a in sys.argv[1:] if not a.startswith("-")] or ["bn"]
    for shape, make, dtype, autocast in cases(kinds):
        for mode in ("train", "eval"):
            theirs = make().train(mode == "train")
            ours = ct.replace_norms(copy.deepcopy(theirs))
            x = torch.randn(shape, device="cuda", dtype=dtype).requires_grad_(mode == "train")
            dy = torch.randn_like(x)
            row = {}
            for name, layer in (("torch", theirs), ("cunorm", ours)):
                if mode == "train":
                    fn = step_fn(layer, x, dy, autocast)
                else:
                    def fn(layer=layer):
                        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                            layer(x)
                row[name] = (single(fn), *gpu_time(fn), host(fn))
            print(f"| {shape}{' autocast' if autocast else ''} | {str(dtype)[6:]} | {mode} | {row['torch'][0]:.1f} | {row['cunorm'][0]:.1f} | "
                  f"{row['torch'][1]:.1f} | {row['cunorm'][1]:.1f} | {row['torch'][3]:.1f} | {row['cunorm'][3]:.1f} |",
                  flush=True)
            if verbose:
                for name in ("torch", "cunorm"):
                    for k, v in sorted(row[name][2].items(), key=lambda kv: -kv[1])[:4]:
                        print(f"    {name}: {v:8.1f} us  {k[:100]}")


if __name__ == "__main__":
    main()
