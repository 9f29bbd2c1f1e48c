"""The fused backward of the float32 residual stream: a row norm whose
forward took 16-bit x and a float32 residual, formed ``h = x + residual``
in float32, returned h as float32 and normalized it (y in x's dtype).
Validation, the choice of launch (a pure function) and the launch of
cunorm/kernels/backward.cu's rows_grad_wide.

The call mirrors its forward: dy (x's 16-bit dtype), h (float32), the
forward's statistics, weight and bias, and dh (the float32 gradient that
reached h, or None). The gradient of h, ``g = norm_backward(dy) + dh``,
formed in float32, is both x's and the residual's: it comes back twice,
rounded once to x's dtype (x) and as float32 (residual), from one pass
that reads dy, h and dh once.

What the fused kernel takes (``fits``): RMSNorm or LayerNorm over the
trailing axes, rows one rows_grad_cached block holds with h's float32
elements in registers (8192 elements: 16 float32 elements a thread x 512
threads), parameters over the normalized axes, none, or per head.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import numpy as np

from . import dispatch_grad, dtypes, launch_cache, launches, plans, row_norms, tuning
from . import declarations as K


class WideResidualGrads(NamedTuple):
    """The gradients of the float32 residual stream's inputs: x in x's
    dtype, the residual in float32 (the same values), weight and bias
    (None where the forward had none)."""

    x: object
    residual: object
    weight: object
    bias: object


#: x, dy and dx are 16-bit in the float32 stream: the vector width's element size
ITEMSIZE = 2
#: the longest row rows_grad_wide holds, as its errors name it: h's float32
#: elements within rows_grad_cached's bytes a thread, in its largest block
ROW_LIMIT = dispatch_grad.GRAD_CACHED_MAX_BYTES // 4 * dispatch_grad.GRAD_CACHED_MAX_THREADS


def choose(norm: str, dtype, pdtype, flags: int, rows: int, n: int, vec: int, device, cooperative: bool = True,
           heads: int = 1):
    """rows_grad_wide's launch over ``rows`` rows of n elements, dy of the
    16-bit ``dtype`` in vectors of ``vec`` (h float32, twice the bytes):
    rows_grad_cached's shape for 32-bit data (at most 16 elements a thread,
    the vectors' 8 float32 elements of h two 16-byte loads); None where one
    block does not hold a row."""
    a = dtypes.KERNEL_TYPE[dtypes.float32]
    p = dtypes.NO_PARAMS if not flags else dtypes.KERNEL_TYPE[pdtype]
    launch = dispatch_grad._cached_launch(
        K.ROWS_GRAD_WIDE, (dispatch_grad.grad_policy(norm, a), dtypes.KERNEL_TYPE[dtype], p, flags),
        dtypes.float32, flags, rows, n // vec, vec, device, cooperative, 1, heads=heads)
    if launch is None:
        return None
    kernel = launch.steps[0].kernel
    shape = dict(zip(K.ROWS_GRAD_WIDE.template, kernel.template_args))
    vpt, min_blocks = shape["VPT"], shape["MIN_BLOCKS"]
    # The next row's fetch into L2 pays where a thread has one vector in
    # flight or its block is alone on the SM; blocks of two vectors a
    # thread, several an SM, keep enough of h and dy in flight without it,
    # and its prefetches cost them 12-15% (docs/notes/conditioned.md, "The
    # float32 residual stream's backward").
    return dataclasses.replace(launch, prefetch_next=launch.prefetch_next and (vpt == 1 or min_blocks == 1))


def fits(n: int) -> bool:
    """Whether one rows_grad_wide block holds a row of n elements (plain
    values: a front end asks before its forward runs)."""
    vec = plans.vector_width(ITEMSIZE, n, [], [])
    return n > 0 and dispatch_grad.grad_cached_shape(n // vec, vec, 4, tuning.for_arch(90)) is not None


def fusable(x_shape: tuple, first: int, last: int) -> bool:
    """Whether the fused backward takes a float32-stream call over x of
    ``x_shape`` normalized over axes first..last."""
    return (last == len(x_shape) - 1 and all(type(s) is int for s in x_shape)
            and fits(math.prod(x_shape[first:])))


class WideGradCall:
    """A validated backward call of the float32 residual stream."""

    def __init__(self, norm, dy, h, mean, rstd, weight, bias, dh, axis):
        from .gradients import _check_stat

        if norm not in ("rms", "ln"):
            raise ValueError(f"the float32 residual stream's backward is RMSNorm's or LayerNorm's, got {norm!r}")
        self.call = call = row_norms.Call(norm, h, axis, 0.0, None, weight=weight, bias=bias)
        self.norm = norm
        if call.x.dtype != dtypes.float32:
            raise TypeError(f"h must be float32 (the forward's h of the float32 residual stream), got {call.x.dtype}")
        if call.last != call.x.ndim - 1:
            raise ValueError(f"the float32 residual stream runs over rows: normalize over the trailing axes, got "
                             f"axes ending at {call.last} of a {call.x.ndim}-d h")
        self.dy = call._same_kind(dy, "dy")
        if tuple(self.dy.shape) != tuple(call.x.shape):
            raise ValueError(f"dy must have h's shape {tuple(call.x.shape)}, got {tuple(self.dy.shape)}")
        if self.dy.dtype.itemsize != 2 or self.dy.dtype not in dtypes.SUPPORTED:
            raise TypeError(f"dy must have x's 16-bit dtype (float16 or bfloat16) under the float32 residual "
                            f"stream, got {self.dy.dtype}")
        self.dh = None
        if dh is not None:
            self.dh = call._same_kind(dh, "dh")
            if tuple(self.dh.shape) != tuple(call.x.shape):
                raise ValueError(f"dh must have h's shape {tuple(call.x.shape)}, got {tuple(self.dh.shape)}")
            if self.dh.dtype != dtypes.float32:
                raise TypeError(f"dh must have h's dtype float32, got {self.dh.dtype}")
        self.center = _check_stat(call, mean, "mean", call.stats_shape) if norm == "ln" else None
        self.scale = _check_stat(call, rstd, "rstd", call.stats_shape)


def reference(g: WideGradCall) -> WideResidualGrads:
    """The float64 backward (NumPy arrays): the norm's over h with dy
    widened, dh added; x's gradient rounded once to dy's dtype."""
    from .. import reference as ref

    call = g.call
    axis = tuple(range(call.first, call.last + 1))
    if g.norm == "rms":
        dh, dw = ref.rms_norm_backward(g.dy, call.x, g.scale, call.weight, axis=axis, dh=g.dh, exact=True)
        db = None
    else:
        dh, dw, db = ref.layer_norm_backward(g.dy, call.x, g.center, g.scale, call.weight, call.bias, axis=axis,
                                             dh=g.dh, exact=True)
    params = [None if d is None else np.asarray(d).astype(p.dtype) for d, p in ((dw, call.weight), (db, call.bias))]
    return WideResidualGrads(dh.astype(g.dy.dtype), dh.astype(np.float32), *params)


def run(g: WideGradCall, key=None) -> WideResidualGrads:
    """The gradients as the caller's array kind: the reference for NumPy
    arrays, rows_grad_wide for GPU arrays; ValueError for rows it does not
    hold. ``key``: the call's signature in the launch cache, which gets an
    entry when the call ran over its arrays as given."""
    call = g.call
    if not call.on_gpu:
        if not call.x.size:
            zeros = [None if p is None else np.zeros(p.shape, p.dtype) for p in (call.weight, call.bias)]
            return WideResidualGrads(np.empty(call.x.shape, g.dy.dtype), np.empty(call.x.shape, np.float32), *zeros)
        return reference(g)
    with call.adapter.scope(call.x.data.device_id):
        grads, entry = _gpu(g)
        wrap = call.adapter.from_cupy
        results = WideResidualGrads(*(None if a is None else wrap(a) for a in grads))
    if key is not None and entry is not None:
        launch_cache.ROWS_GRAD.put(key, entry)
    return results


#: the slots of the float32 residual stream's backward Program
SLOTS = ("dy", "x", "dh", "w", "center", "scale", "dx", "dres", "dw", "db")


@functools.lru_cache(maxsize=256)
def program(launch, dtype, pdtype, rows, n, present, device, heads=1) -> launches.Program:
    """The Program of one call signature (SLOTS); ``present``: whether
    the call has dh, w, center, dw and db; ``heads``: the parameters'
    rows (per head)."""
    from .gradients import launch_cached

    has = dict(zip(("dh", "w", "center", "dw", "db"), present))
    pb = launches.ProgramBuilder(SLOTS, device)
    dh, w, center = (pb[name] if has[name] else None for name in ("dh", "w", "center"))
    launch_cached(pb, launch, dtype, pdtype, has, rows, n, 0.0, heads, dy=pb["dy"], x=pb["x"], dh=dh, w=w,
                  center=center, scale=pb["scale"], dx=pb["dx"], dres=pb["dres"])
    return pb.build()


@functools.lru_cache(maxsize=1024)
def _launch(norm, dtype, pdtype, flags, rows, n, vec, device_id, heads=1):
    device = launches.device_info(device_id)
    launch = choose(norm, dtype, pdtype, flags, rows, n, vec, device, heads=heads)
    for step in () if launch is None else launch.steps:
        launches.check_limits(step, device)
    return launch


def _gpu(g: WideGradCall):
    import cupy

    from .gradients import _contiguous, _param_grads

    call = g.call
    h, dy, dh, center, rstd = (_contiguous(a) for a in (call.x, g.dy, g.dh, g.center, g.scale))
    n = math.prod(call.norm_shape)
    rows = h.size // n if n else 0
    flags, pdtype = row_norms.kernel_params(dy.dtype, call.weight, call.bias)
    heads = call.cond.param_rows
    dx, dres = cupy.empty(h.shape, dy.dtype), cupy.empty(h.shape, np.float32)
    dw, db = (None if p is None else cupy.empty(p.shape, pdtype) for p in (call.weight, call.bias))
    if not h.size:
        return (dx, dres) + _param_grads(call, dw, db, empty=True), None
    vec = plans.vector_width(ITEMSIZE, n, [], [])
    pointers = [(a.data.ptr, a.itemsize) for a in (h, dy, dh) if a is not None]
    if plans.vector_width(ITEMSIZE, n, [], pointers) < vec:
        h, dy, dh = (None if a is None else a.copy() for a in (h, dy, dh))  # (fresh: aligned for vec)
    launch = _launch(g.norm, np.dtype(dy.dtype), None if pdtype is None else np.dtype(pdtype), flags, rows, n, vec,
                     h.data.device_id, heads)
    if launch is None:
        raise ValueError(f"the float32 residual stream's fused backward takes rows of at most {ROW_LIMIT} "
                         f"elements, got rows of {n}")
    w = row_norms._as_param(call.weight, pdtype)
    present = (dh is not None, w is not None, center is not None, dw is not None, db is not None)
    prog = program(launch, np.dtype(dy.dtype), None if pdtype is None else np.dtype(pdtype), rows, n, present,
                   h.data.device_id, heads)
    prog.run_named({"dy": dy, "x": h, "dh": dh, "w": w, "center": center, "scale": rstd, "dx": dx, "dres": dres,
                    "dw": dw, "db": db}, launches.cupy_stream(), launches.cupy_alloc)
    grads = _param_grads(call, dw, db, empty=False)
    clean = (h is call.x and dy is g.dy and dh is g.dh and center is g.center and rstd is g.scale
             and w is call.weight and grads[0] is dw and grads[1] is db)
    return (dx, dres) + grads, _entry(g, prog) if clean else None


#: the inputs of a launch cache entry, in the order calls.rows_grad_wide replays it
ENTRY_INPUTS = ("dy", "h", "mean", "rstd", "w", "b", "dh")


def _entry(g: WideGradCall, prog):
    """The launch cache's launcher of a call that ran over its arrays as given."""
    call = g.call
    h = call.x
    outputs = {"dx": (h.shape, g.dy.dtype, None), "dres": (h.shape, h.dtype, None)}
    for name, p in (("dw", call.weight), ("db", call.bias)):
        if p is not None:
            outputs[name] = (p.shape, p.dtype, None)
    present = lambda name, a: None if a is None else name  # noqa: E731
    slots = {"dy": "dy", "x": "h", "dh": present("dh", g.dh), "w": present("w", call.weight),
             "center": present("mean", g.center), "scale": "rstd", "dx": "dx", "dres": "dres",
             "dw": present("dw", call.weight), "db": present("db", call.bias)}
    returns = ["dx", "dres", present("dw", call.weight), present("db", call.bias)]
    return launch_cache.entry(call.adapter, h.data.device_id, prog, ENTRY_INPUTS, outputs, slots, returns,
                              arrays={"h": h, "w": call.weight, "b": call.bias})


def key(norm, dy, h, mean, rstd, weight, bias, dh, axis):
    """The signature of a float32-residual backward call (None: not keyed)."""
    ad = launch_cache.adapter(dy)
    if ad is None or not launch_cache._int_axes(axis):
        return None
    return launch_cache.key(ad, dy, h, mean, rstd, weight, bias, dh, scalars=(norm, axis, "wide"))
