"""One model of the models suite, untouched and after replace_norms: host
time per call (wall clock in a loop, the GPU drained at the ends), GPU
time per call (profiler kernel sums) and the top kernels of each.
PYTHONPATH=. python bench/diag_model_profile.py [label part] [mode]
(mode: a models-suite mode, default "eval bf16 autocast"). The two models'
host times are taken one after the other, and the host's speed drifts
between device calls and within one: compare host times with the models
suite (which alternates the two), the kernels and GPU times here."""
import copy
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from cunorm import torch as cunorm_torch
from cunorm.bench import _models

part = sys.argv[1] if len(sys.argv) > 1 else "vit"
mode = sys.argv[2] if len(sys.argv) > 2 else "eval bf16 autocast"
label, build = next((lb, b) for lb, b in _models.models(quick=False) if part in lb)
model, make_input = build()
theirs = model.cuda()
ours = cunorm_torch.replace_norms(copy.deepcopy(theirs))
print(label, mode, flush=True)
for name, m in (("torch", theirs), ("cunorm", ours)):
    step = _models._step(m, make_input, mode, False)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        step()
    host = (time.perf_counter() - t) / 20
    torch.cuda.synchronize()
    total = (time.perf_counter() - t) / 20
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    kernels = [k for k in prof.key_averages() if k.device_type.name == "CUDA"]
    gpu = sum(k.device_time_total for k in kernels) / 5
    print(f"{name}: host {host * 1e3:.2f} ms/call, wall {total * 1e3:.2f} ms/call, GPU {gpu / 1e3:.2f} ms/call, "
          f"{sum(k.count for k in kernels) // 5} kernels/call", flush=True)
    for k in sorted(kernels, key=lambda k: -k.device_time_total)[:8]:
        print(f"   {k.device_time_total / 5:8.1f} us  n={k.count // 5:4d}  {k.key[:90]}")
