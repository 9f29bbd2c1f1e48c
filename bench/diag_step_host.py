"""Host time of a BatchNorm2d training step's parts, cunorm against torch
(a tiny input: the GPU idles; wall clock per call in a loop).
PYTHONPATH=. python bench/diag_step_host.py (bench/profile_host.py profiles the steps)"""
import copy

import torch
from _timing import per_call

import cunorm
import cunorm.torch as ct


tb = torch.nn.BatchNorm2d(64, device="cuda")
cb = ct.replace_norms(copy.deepcopy(tb))
x = torch.randn(1, 64, 8, 8, device="cuda")
xg = x.clone().requires_grad_()
dy = torch.randn_like(x)
w, b, rm, rv = cb.weight.detach(), cb.bias.detach(), cb.running_mean, cb.running_var
y_t, y_c = tb(xg), cb(xg)
mean = torch.zeros(64, device="cuda")
rstd = torch.ones(64, device="cuda")


class Nothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a.clone()

    @staticmethod
    def backward(ctx, g):
        return g


cases = {
    "torch fwd (no grad)": lambda: tb(x),
    "cunorm fwd (no grad)": lambda: cb(x),
    "cunorm.batch_norm train, tensors": lambda: cunorm.batch_norm(x, w, b, running_mean=rm, running_var=rv),
    "torch fwd (grad)": lambda: tb(xg),
    "cunorm fwd (grad)": lambda: cb(xg),
    "torch step": lambda: tb(xg).backward(dy),
    "cunorm step": lambda: cb(xg).backward(dy),
    "cunorm backward fn": lambda: cunorm.backward.batch_norm_backward(dy, x, mean, rstd, w, b),
    "Function clone step": lambda: Nothing.apply(xg).backward(dy),
    "torch clone step": lambda: xg.clone().backward(dy),
}
for name, fn in cases.items():
    grad = "(no grad)" not in name and "train, tensors" not in name and "backward fn" not in name
    with torch.set_grad_enabled(grad):
        print(f"{name:40s} {per_call(fn, 3000, 300):8.1f} us", flush=True)
