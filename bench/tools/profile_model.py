"""One model of the models suite, untouched and after replace_norms: host
time per call (wall clock in a loop, the GPU drained at the ends), GPU
time per call (profiler kernel sums) and the top kernels of each.
PYTHONPATH=. python bench/tools/profile_model.py [label part] [mode] [-p]
(mode: a models-suite mode, default "eval bf16 autocast"; -p: cProfile of
each). Host times: the least of five rounds alternating the two models
(the host's speed drifts), and with Python's garbage collector off."""
import copy
import gc
import sys
import time

import torch
from _timing import print_profile
from torch.profiler import ProfilerActivity, profile

from cunorm import torch as cunorm_torch
from cunorm.bench import _models

args = [a for a in sys.argv[1:] if not a.startswith("-")]
part = args[0] if args else "vit"
mode = args[1] if len(args) > 1 else "eval bf16 autocast"
label, build = next((lb, b) for lb, b in _models.models(quick=False) if part in lb)
model, make_input = build()
theirs = model.cuda()
ours = cunorm_torch.replace_norms(copy.deepcopy(theirs))
print(label, mode, flush=True)
steps = {name: _models._step(m, make_input, mode, False) for name, m in (("torch", theirs), ("cunorm", ours))}


def host_ms(step, n=10):
    """Host ms a call over n calls, and the wall ms with the GPU drained."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        step()
    host = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    return host * 1e3, (time.perf_counter() - t) / n * 1e3


for step in steps.values():
    for _ in range(5):
        step()
rounds = {name: [] for name in steps}
for _ in range(5):  # alternated: the host's speed drifts
    for name, step in steps.items():
        rounds[name].append(host_ms(step))
nogc = {}
gc.disable()  # (before any profiling: the first calls after the profiler's run are slower)
for name, step in steps.items():
    nogc[name] = min(host_ms(step)[0] for _ in range(3))
gc.enable()
for name, step in steps.items():
    host, wall = min(rounds[name])
    host_nogc = nogc[name]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    kernels = [k for k in prof.key_averages() if k.device_type.name == "CUDA"]
    gpu = sum(k.device_time_total for k in kernels) / 5
    print(f"{name}: host {host:.2f} ms/call (gc off {host_nogc:.2f}), wall {wall:.2f}, GPU {gpu / 1e3:.2f} ms/call, "
          f"{sum(k.count for k in kernels) // 5} kernels/call", flush=True)
    for k in sorted(kernels, key=lambda k: -k.device_time_total)[:8]:
        print(f"   {k.device_time_total / 5:8.1f} us  n={k.count // 5:4d}  {k.key[:90]}")
if "-p" in sys.argv:  # where the host time goes
    for name, step in steps.items():
        print_profile(step, 10, name, top=14, warmup=0)
