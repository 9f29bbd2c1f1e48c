"""Host time of a training step's parts, cunorm against torch: the step,
the signature, the launcher, the Function machinery and the engine, for
BatchNorm2d, LayerNorm (autocast and not) and RMSNorm on tiny inputs (the
GPU idles; wall clock per call in a loop).
PYTHONPATH=. python bench/diag_step_parts.py"""
import copy

import torch
from _timing import per_call

import cunorm
import cunorm.torch as ct
from cunorm import _fast, _launch


def best(fn, n=2000, warmup=200, rounds=3):
    return min(per_call(fn, n, warmup) for _ in range(rounds))


def show(name, fn, grad=False):
    with torch.set_grad_enabled(grad):
        print(f"{name:52s} {best(fn):8.1f} us", flush=True)


# --- BatchNorm2d(64) on (1,64,8,8) fp32 -------------------------------------------
tb = torch.nn.BatchNorm2d(64, device="cuda")
cb = ct.replace_norms(copy.deepcopy(tb))
x = torch.randn(1, 64, 8, 8, device="cuda")
xg = x.clone().requires_grad_()
dy = torch.randn_like(x)
w, b, rm, rv = cb.weight.detach(), cb.bias.detach(), cb.running_mean, cb.running_var
with torch.no_grad():
    y, mean, rstd = cunorm.batch_norm(x, w, b, running_mean=rm, running_var=rv, return_stats=True)
    cunorm.backward.batch_norm_backward(dy, x, mean, rstd, w, b)
for _ in range(3):
    tb(xg).backward(dy)
    cb(xg).backward(dy)
fkey = _fast.channel_key("batch", x, None, w, b, rm, rv, True, 0.1, 1e-5, 1, True, 0)
flaunch = _fast.CHANNELS.get(fkey)
gkey = _fast.grad_key("batch", dy, x, mean, rstd, w, b, None, (None, 1, True), 1e-5)
glaunch = _fast.CHANNELS_GRAD.get(gkey)
print("BN forward launcher:\n" + flaunch.source, "\nBN backward launcher:\n" + glaunch.source, flush=True)


class Nothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a.clone()

    @staticmethod
    def backward(ctx, g):
        return g


class Three(torch.autograd.Function):
    """The ChannelNorm shape: 5 tensors in, 3 out, 2 non-differentiable, 5 saved."""
    @staticmethod
    def forward(ctx, a, w, b, rm, rv, *rest):
        out = a.clone(), mean.clone(), rstd.clone()
        ctx.save_for_backward(a, out[1], out[2], w, b)
        ctx.mark_non_differentiable(out[1], out[2])
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, g, *_):
        ctx.saved_tensors
        return g, None, None, None, None, None, None, None, None, None, None


wg, bg = cb.weight, cb.bias
show("BN torch step", lambda: tb(xg).backward(dy), True)
show("BN cunorm step", lambda: cb(xg).backward(dy), True)
show("BN torch fwd (grad)", lambda: tb(xg), True)
show("BN cunorm fwd (grad)", lambda: cb(xg), True)
show("BN torch F.batch_norm (grad)", lambda: torch.nn.functional.batch_norm(xg, rm, rv, wg, bg, True), True)
show("BN cunorm batch_norm return_stats (no grad)", lambda: cunorm.batch_norm(
    x, w, b, running_mean=rm, running_var=rv, training=True, momentum=0.1, eps=1e-5, channel_axis=1,
    return_stats=True))
show("BN channel_key", lambda: _fast.channel_key("batch", x, None, w, b, rm, rv, True, 0.1, 1e-5, 1, True, 0))
show("BN forward launcher", lambda: flaunch(x, w, b, rm, rv))
show("BN backward_fn", lambda: cunorm.backward.batch_norm_backward(dy, x, mean, rstd, w, b))
show("BN grad_key", lambda: _fast.grad_key("batch", dy, x, mean, rstd, w, b, None, (None, 1, True), 1e-5))
show("BN backward launcher", lambda: glaunch(dy, x, mean, rstd, w, b, None))
show("Function clone step", lambda: Nothing.apply(xg).backward(dy), True)
show("torch clone step", lambda: xg.clone().backward(dy), True)
show("Function 5-in 3-out step (clones)", lambda: Three.apply(xg, wg, bg, rm, rv, "batch", None, True, 0.1, 1e-5, 1)[0]
     .backward(dy), True)
show("num_batches_tracked.add_(1)", lambda: cb.num_batches_tracked.add_(1))
show("_check_input_dim", lambda: cb._check_input_dim(x))
show("empty_like(x)", lambda: torch.empty_like(x))
show("x.new_empty((64,))", lambda: x.new_empty((64,), dtype=torch.float32))
show("torch.empty(256, uint8)", lambda: torch.empty(256, dtype=torch.uint8, device="cuda"))
show("x.stride()", lambda: x.stride())
show("x.shape", lambda: x.shape)
show("x.data_ptr()", lambda: x.data_ptr())
show("x.get_device()", lambda: x.get_device())
show("x.dtype", lambda: x.dtype)
show("x.requires_grad", lambda: x.requires_grad)
s = torch.cuda.current_stream().cuda_stream
step = flaunch.entry.program.steps[-1]
show("one driver launch (apply step)", lambda: _launch.launch_kernel(*step.head, s, step.params_ptr, 0))
show("raw stream getter", lambda: _fast._launch and torch._C._cuda_getCurrentRawStream(0))
show("current device getter", lambda: torch._C._cuda_getDevice())

# --- LayerNorm(768) on (8,768): plain and under bf16 autocast ----------------------
tl = torch.nn.LayerNorm(768, device="cuda")
cl = ct.replace_norms(copy.deepcopy(tl))
xl = torch.randn(8, 768, device="cuda").requires_grad_()
xh = torch.randn(8, 768, device="cuda", dtype=torch.bfloat16).requires_grad_()
dyl = torch.randn(8, 768, device="cuda")
for _ in range(3):
    tl(xl).backward(dyl); cl(xl).backward(dyl)
    with torch.autocast("cuda", torch.bfloat16):
        tl(xh).backward(dyl); cl(xh).backward(dyl)
show("LN torch step", lambda: tl(xl).backward(dyl), True)
show("LN cunorm step", lambda: cl(xl).backward(dyl), True)


def autocast(fn):
    def run():
        with torch.autocast("cuda", torch.bfloat16):
            fn()
    return run


show("LN torch step autocast bf16", autocast(lambda: tl(xh).backward(dyl)), True)
show("LN cunorm step autocast bf16", autocast(lambda: cl(xh).backward(dyl)), True)
show("autocast enter/exit alone", autocast(lambda: None), True)
show("xh.float() step", lambda: xh.float().backward(dyl), True)
xd = xl.detach()
wl, bl = cl.weight.detach(), cl.bias.detach()
show("LN cunorm layer_norm return_stats (no grad)", lambda: cunorm.layer_norm(xd, wl, bl, axis=-1, eps=1e-5,
                                                                             return_stats=True))
_, lm, lr = cunorm.layer_norm(xd, wl, bl, axis=-1, eps=1e-5, return_stats=True)
show("LN backward_fn", lambda: cunorm.backward.layer_norm_backward(dyl, xd, lm, lr, wl, bl, axis=-1))

# --- RMSNorm(4096) on (4,4096) bf16 ------------------------------------------------
tr = torch.nn.RMSNorm(4096, device="cuda", dtype=torch.bfloat16)
cr = ct.replace_norms(copy.deepcopy(tr))
xr = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16).requires_grad_()
dyr = torch.randn_like(xr)
for _ in range(3):
    tr(xr).backward(dyr); cr(xr).backward(dyr)
show("RMS torch step", lambda: tr(xr).backward(dyr), True)
show("RMS cunorm step", lambda: cr(xr).backward(dyr), True)
show("RMS torch fwd (no grad)", lambda: tr(xr))
show("RMS cunorm fwd (no grad)", lambda: cr(xr))
