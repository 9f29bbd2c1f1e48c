"""The fused backward of the gated RMSNorm (``gate=``): validation and
the launch of cunorm/kernels/backward.cu's rows_grad_gated.

The call mirrors its forward over rows: dy, x, the forward's rstd (of x *
silu(z) where the gate comes before the norm), the weight and the gate z,
normalized over the trailing axes. It returns the gradients of x, the
weight and z (GatedGrads).

What the fused kernel takes (``fusable``): rows one rows_grad_cached block
holds (16384 16-bit, 8192 32-bit, 4096 64-bit elements at the widest
vectors), with a weight over the normalized axes, none, or a weight per
head (more of x's trailing axes: a weight per group of ``group_size``),
whose rows then run a block a row (dispatch_grad._cached_launch). The
roundings of the forward (``rounding=``, a 16-bit weight's product) have
the identity as their gradient, as autograd gives them: the kernel works
in float32 (float64 for float64 x) throughout.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from . import dispatch_grad, launch_cache, launches, plans, row_norms, tuning


class GatedGrads(NamedTuple):
    """The gradients of the gated RMSNorm's inputs (weight: None without one)."""

    x: object
    weight: object
    gate: object


def fits(n: int, itemsize: int) -> bool:
    """Whether one rows_grad_gated block holds a row of n elements of
    ``itemsize`` bytes at the widest vectors that divide it (plain values:
    a front end asks before its forward runs)."""
    vec = plans.vector_width(itemsize, n, [], [])
    tune = tuning.for_arch(90)
    return n > 0 and dispatch_grad.grad_cached_shape(n // vec, vec, itemsize, tune,
                                                     max_vpt=dispatch_grad.gated_max_vpt(vec, itemsize)) is not None


def fusable(x_shape: tuple, itemsize: int, first: int, last: int) -> bool:
    """Whether the fused backward takes a gated call over x of ``x_shape``
    normalized over axes first..last (its weight over those axes, none, or
    per head)."""
    return (last == len(x_shape) - 1 and all(type(s) is int for s in x_shape)
            and fits(math.prod(x_shape[first:]), itemsize))


class GatedGradCall:
    """A validated backward call of the gated RMSNorm."""

    def __init__(self, dy, x, rstd, weight, gate, norm_before_gate, axis):
        from . import gradients

        g = gradients.RowGradCall("rms", dy, x, axis=axis, rstd=rstd, weight=weight)
        call = g.call
        if gate is None:
            raise TypeError("gate is required: pass the forward's gate z")
        self.gate = gradients._check_like(call, gate, "gate")
        if call.last != call.x.ndim - 1:
            raise ValueError(f"gate= gates rows: normalize over the trailing axes, got axes ending at {call.last} "
                             f"of a {call.x.ndim}-d x")
        if not isinstance(norm_before_gate, (bool, np.bool_)):
            raise TypeError(f"norm_before_gate must be a bool, got {type(norm_before_gate).__name__}")
        self.call, self.dy, self.rstd = call, g.dy, g.scale
        self.before = bool(norm_before_gate)


def reference(g: GatedGradCall) -> GatedGrads:
    """The float64 backward (NumPy arrays), by its formula."""
    from .. import reference as ref

    call = g.call
    return GatedGrads(*ref.rms_norm_gated_backward(g.dy, call.x, g.rstd, call.weight, gate=g.gate,
                                                   norm_before_gate=g.before,
                                                   axis=tuple(range(call.first, call.last + 1))))


def run(g: GatedGradCall, key=None) -> GatedGrads:
    """The gradients as the caller's array kind: the reference for NumPy
    arrays, rows_grad_gated for GPU arrays; ValueError for rows it does not
    hold. ``key``: the call's signature in the launch cache, which gets an
    entry when the call ran over its arrays as given."""
    call = g.call
    if not call.on_gpu:
        if not call.x.size:
            zeros = None if call.weight is None else np.zeros(call.weight.shape, call.weight.dtype)
            return GatedGrads(np.empty(call.x.shape, call.x.dtype), zeros, np.empty(call.x.shape, call.x.dtype))
        return reference(g)
    with call.adapter.scope(call.x.data.device_id):
        grads, entry = _gpu(g)
        wrap = call.adapter.from_cupy
        results = GatedGrads(*(None if a is None else wrap(a) for a in grads))
    if key is not None and entry is not None:
        launch_cache.ROWS_GRAD.put(key, entry)
    return results


#: the slots of a gated backward's Program
SLOTS = ("dy", "x", "z", "w", "scale", "dx", "dz", "dw")


@functools.lru_cache(maxsize=256)
def program(launch, dtype, pdtype, rows, n, weighted, device, heads=1) -> launches.Program:
    """The Program of one call signature (SLOTS); ``heads``: the weight's
    rows (per head)."""
    from .gradients import launch_cached

    pb = launches.ProgramBuilder(SLOTS, device)
    launch_cached(pb, launch, dtype, pdtype, {"dw": weighted, "db": False}, rows, n, 0.0, heads, dy=pb["dy"],
                  x=pb["x"], z=pb["z"], w=pb["w"] if weighted else None, scale=pb["scale"], dx=pb["dx"], dz=pb["dz"])
    return pb.build()


@functools.lru_cache(maxsize=1024)
def _launch(dtype, pdtype, flags, rows, n, vec, gate, device_id, heads=1):
    device = launches.device_info(device_id)
    launch = dispatch_grad.choose_rows_grad_gated(dtype, pdtype, flags, rows, n, vec, gate, device, heads=heads)
    if launch is not None:
        for step in launch.steps:
            launches.check_limits(step, device)
    return launch


def _gpu(g: GatedGradCall):
    import cupy

    from .gradients import CACHED_ROW_LIMITS, _contiguous, _param_grads

    call = g.call
    x, dy, z, rstd = (_contiguous(a) for a in (call.x, g.dy, g.gate, g.rstd))
    n = math.prod(call.norm_shape)
    rows = x.size // n if n else 0
    flags, pdtype = row_norms.kernel_params(x.dtype, call.weight, None)
    heads = call.cond.param_rows
    dx, dz = cupy.empty(x.shape, x.dtype), cupy.empty(x.shape, x.dtype)
    dw = None if call.weight is None else cupy.empty(call.weight.shape, pdtype)
    if not x.size:
        return (dx, _param_grads(call, dw, None, empty=True)[0], dz), None
    vec = plans.vector_width(x.itemsize, n, [], [])
    if plans.vector_width(x.itemsize, n, [], [(a.data.ptr, x.itemsize) for a in (x, dy, z)]) < vec:
        x, dy, z = (a.copy() for a in (x, dy, z))  # (fresh: aligned for vec)
    gate = dispatch_grad.GATE_OUTPUT if g.before else dispatch_grad.GATE_INPUT
    launch = _launch(np.dtype(x.dtype), None if pdtype is None else np.dtype(pdtype), flags, rows, n, vec, gate,
                     x.data.device_id, heads)
    if launch is None:
        raise ValueError(f"the gated RMSNorm's fused backward takes rows one block holds (at most "
                         f"{CACHED_ROW_LIMITS}), got rows of {n} {x.dtype} elements")
    w = row_norms._as_param(call.weight, pdtype)
    prog = program(launch, np.dtype(x.dtype), None if pdtype is None else np.dtype(pdtype), rows, n,
                   w is not None, x.data.device_id, heads)
    prog.run_named({"dy": dy, "x": x, "z": z, "w": w, "scale": rstd, "dx": dx, "dz": dz, "dw": dw},
                   launches.cupy_stream(), launches.cupy_alloc)
    clean = (x is call.x and dy is g.dy and z is g.gate and rstd is g.rstd and w is call.weight)
    entry = _entry(g, prog, pdtype) if clean else None
    return (dx, _param_grads(call, dw, None, empty=False)[0], dz), entry


#: the inputs of a launch cache entry, in the order calls.rows_grad_gated replays it
ENTRY_INPUTS = ("dy", "x", "rstd", "w", "gate")


def _entry(g: GatedGradCall, prog, pdtype):
    """The launch cache's launcher of a call that ran over its arrays as given."""
    call = g.call
    x = call.x
    outputs = {"dx": (x.shape, x.dtype, None), "dz": (x.shape, x.dtype, None)}
    if call.weight is not None:
        outputs["dw"] = (call.weight.shape, pdtype, None)
    slots = {"dy": "dy", "x": "x", "z": "gate", "w": "w" if call.weight is not None else None, "scale": "rstd",
             "dx": "dx", "dz": "dz", "dw": "dw" if call.weight is not None else None}
    returns = ["dx", "dw" if call.weight is not None else None, "dz"]
    return launch_cache.entry(call.adapter, x.data.device_id, prog, ENTRY_INPUTS, outputs, slots, returns,
                              arrays={"x": x})


def key(dy, x, rstd, weight, gate, norm_before_gate, axis):
    """The signature of a gated backward call (None: not keyed)."""
    ad = launch_cache.adapter(dy)
    if ad is None or type(norm_before_gate) is not bool or not launch_cache._int_axes(axis):
        return None
    return launch_cache.key(ad, dy, x, rstd, weight, gate, scalars=("rms", axis, norm_before_gate, "gated"))
