"""Where a cached call's host time goes. Each piece of the fast path is
timed alone two ways: in a loop on an idle GPU (wall clock per call, as the
bench's host suite measures) and behind a 1-second GPU sleep (launches only
queue: host time alone). Then the training steps: their host time, and a
torch.profiler table of their GPU kernels (--no-profile: not), and with
--cprofile the Python functions of each step (backward on the calling
thread, where cProfile sees it), by own time.
PYTHONPATH=. python bench/diag_host.py [--no-profile] [--cprofile]"""
import sys
import time

import cupy
import torch
import torch.nn.functional as F
from _timing import print_profile
from cupy_backends.cuda.api import driver

import cunorm
import cunorm.torch as ct
from cunorm import _fast, _torch_autograd
from cunorm._interop import cupy as cupy_adapter
from cunorm._interop import torch as torch_adapter
from cunorm.bench._cases import _per_call_us


def in_loop(fn, n=2000):
    """As the bench's host suite times a call (least of five loops)."""
    return _per_call_us(fn, n, torch.cuda.synchronize)


def behind_sleep(fn, n=400):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # about a second of GPU time: the launches below only queue
    t = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return elapsed


def show(name, fn, n=2000):
    print(f"{name:56s} {in_loop(fn, n):8.2f} {behind_sleep(fn):8.2f}", flush=True)


dev = torch.device("cuda", 0)
x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
w = torch.randn(4096, device=dev, dtype=torch.bfloat16)
xc, wc = cupy.from_dlpack(x), cupy.from_dlpack(w)
print(f"{'us per call':56s} {'loop':>8s} {'host':>8s}")
show("F.rms_norm", lambda: F.rms_norm(x, (4096,), w, 1e-5))
show("torch.empty((1,4096), bf16, device=dev)", lambda: torch.empty((1, 4096), dtype=torch.bfloat16, device=dev))
show("torch.empty(1, 4096, dtype=bf16, device=dev)", lambda: torch.empty(1, 4096, dtype=torch.bfloat16, device=dev))
show("torch.empty((1,4096), dtype=bf16, device=0)", lambda: torch.empty((1, 4096), dtype=torch.bfloat16, device=0))
show("torch.empty((1,), dtype=float32, device=dev)", lambda: torch.empty((1,), dtype=torch.float32, device=dev))
show("x.new_empty((1,), dtype=float32)", lambda: x.new_empty((1,), dtype=torch.float32))
show("torch.empty_like(x)", lambda: torch.empty_like(x))
show("torch signatures(x, (w, None, None))", lambda: torch_adapter.signatures(x, (w, None, None)))
show("rows_key torch", lambda: _fast.rows_key("rms", x, w, None, None, -1, 1e-5, False))
cunorm.rms_norm(x, w)
launcher = _fast.ROWS.get(_fast.rows_key("rms", x, w, None, None, -1, 1e-5, False))
entry = launcher.entry
keep = torch.empty_like(x)
arrays = [x, w, None, None, keep]
pointers = [0 if k < 0 or arrays[k] is None else arrays[k].data_ptr() for k in entry.sources]
step = entry.program.steps[0]
show("driver.launchKernel alone", lambda: driver.launchKernel(*step.head, 0, step.params_ptr, 0))
show("program.run", lambda: entry.program.run(pointers, 0))
show("Entry(x, w, None, None), the generic run", lambda: entry(x, w, None, None))
show("its generated launcher", lambda: launcher(x, w, None, None))
show("cunorm.rms_norm torch", lambda: cunorm.rms_norm(x, w))
show("cupy.empty((1,4096), bf16)", lambda: cupy.empty((1, 4096), dtype=xc.dtype))
show("cupy signatures(xc, (wc, None, None))", lambda: cupy_adapter.signatures(xc, (wc, None, None)))
show("cunorm.rms_norm cupy", lambda: cunorm.rms_norm(xc, wc))
y, rstd = cunorm.rms_norm(x, w, return_stats=True)
dy = torch.randn_like(x)
show("backward.rms_norm_backward", lambda: cunorm.backward.rms_norm_backward(dy, x, rstd, w))

norm = ct.replace_norms(torch.nn.RMSNorm(4096, eps=1e-5, device=dev, dtype=torch.bfloat16))
tnorm = torch.nn.RMSNorm(4096, eps=1e-5, device=dev, dtype=torch.bfloat16)
bn = ct.replace_norms(torch.nn.BatchNorm2d(64, device=dev))
tbn = torch.nn.BatchNorm2d(64, device=dev)
img = torch.randn(1, 64, 8, 8, device=dev, requires_grad=True)
dimg = torch.randn_like(img)
xg = x.clone().requires_grad_()
steps = {"cunorm RMSNorm step": lambda: norm(xg).backward(dy), "torch RMSNorm step": lambda: tnorm(xg).backward(dy),
         "cunorm BatchNorm2d step": lambda: bn(img).backward(dimg),
         "torch BatchNorm2d step": lambda: tbn(img).backward(dimg)}


class _Trivial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return torch.empty_like(a)

    @staticmethod
    def backward(ctx, g):
        return g


raw_row_apply = super(torch.autograd.Function, _torch_autograd.RowNorm).apply
raw_trivial_apply = super(torch.autograd.Function, _Trivial).apply
with torch.no_grad():
    show("rms_norm(x, w, return_stats=True), no grad", lambda: cunorm.rms_norm(x, w, return_stats=True), 1000)
show("RowNorm.apply", lambda: _torch_autograd.RowNorm.apply(xg, w, None, None, "rms", -1, 1e-5), 1000)
show("RowNorm C apply (no functorch unwrap)", lambda: raw_row_apply(xg, w, None, None, "rms", -1, 1e-5), 1000)
show("ct.rms_norm(xg, w)", lambda: ct.rms_norm(xg, w), 1000)
show("trivial Function apply", lambda: _Trivial.apply(xg), 1000)
show("trivial Function C apply", lambda: raw_trivial_apply(xg), 1000)
show("trivial Function step", lambda: _Trivial.apply(xg).backward(dy), 1000)
show("torch empty_like step (x * 1)", lambda: (xg * 1).backward(dy), 1000)
show("cunorm RMSNorm forward, grad on", lambda: norm(xg), 1000)
show("torch RMSNorm forward, grad on", lambda: tnorm(xg), 1000)
for name, fn in steps.items():
    show(name, fn, 1000)
torch.autograd.set_multithreading_enabled(False)
for name, fn in steps.items():
    show(name + ", backward on the calling thread", fn, 1000)
torch.autograd.set_multithreading_enabled(True)
if "--cprofile" in sys.argv:
    torch.autograd.set_multithreading_enabled(False)
    for name, fn in {**steps, "cunorm RMSNorm forward, grad on": lambda: norm(xg)}.items():
        print_profile(fn, 1000, name)
    torch.autograd.set_multithreading_enabled(True)
if "--source" in sys.argv:
    import inspect

    print(inspect.getsource(torch.autograd.Function.apply))
if "--no-profile" not in sys.argv:
    from torch.profiler import ProfilerActivity, profile

    for name, fn in steps.items():
        for _ in range(30):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        print(f"== {name}: GPU kernels of 20 steps")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=70))
