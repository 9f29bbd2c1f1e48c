"""The float32 residual stream (16-bit x, a float32 ``residual=``) inside
``jax.jit`` under ``jax.grad``: the fused forward (the row primitive with
its float32 h, cunorm/jax/_jit.py) and the fused backward
(rows_grad_wide, cunorm/_engine/wide_grad.py) as a primitive of its own,
RMSNorm or LayerNorm over rows one block holds, with parameters over the
normalized axes or none. cunorm/jax/__init__.py sends the stream's other
forms (with per-row operands, an activation, a weight offset, per-head
parameters) through the fused forward with the composed formula's
gradient.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np

from .._engine import gradients, launches, plans, wide_grad
from . import _jit, _sharding
from ._custom_call import emit
from ._modulated import bind_forward


def fusable_backward(spec: _jit.RowSpec) -> bool:
    """Whether rows_grad_wide takes a prepared call: the float32 residual
    and no per-row operand, per-head parameter, activation or weight
    offset; rows one block holds."""
    if (spec.operands or spec.rdtype is None or spec.param_ndim or spec.norm not in ("rms", "ln")
            or spec.epilogue & plans.UNFUSED_IN_BACKWARD):
        return False
    return wide_grad.fusable(spec.shape, spec.first, spec.last)


@dataclasses.dataclass(frozen=True)
class WideGradSpec:
    """The float32 stream's backward of a forward RowSpec (its statistics
    kept): dh is h's cotangent (custom_vjp gives zeros where none reached it)."""

    forward: _jit.RowSpec

    def inputs(self) -> tuple:
        f = self.forward
        return (("dy", "x", "dh") + (("w",) if f.weight else ()) + (("center",) if f.norm == "ln" else ())
                + ("scale",))

    def outputs(self) -> dict:
        f = self.forward
        out = {"dx": (f.shape, f.dtype), "dres": (f.shape, np.dtype(np.float32))}
        if f.weight:
            out["dw"] = (f.param_shape, f.pdtype)
        if f.bias:
            out["db"] = (f.param_shape, f.pdtype)
        return out


wide_grad_p = _jit._primitive("cunorm_rows_grad_wide", lambda spec: spec.outputs())


def _lowering(ctx, *args, spec: WideGradSpec):
    device_id, device, arch = _jit.target()
    f = spec.forward
    rows, n = math.prod(f.shape[:f.first]), math.prod(f.shape[f.first:])
    flags = (plans.FLAG_WEIGHT if f.weight else 0) | (plans.FLAG_BIAS if f.bias else 0)
    vec = plans.vector_width(wide_grad.ITEMSIZE, n, [], [])
    launch = wide_grad.choose(f.norm, f.dtype, f.pdtype, flags, rows, n, vec, device, cooperative=False)
    if launch is None:
        raise RuntimeError(f"cunorm inside jit: no fused float32-residual backward for {f}")  # (fusable_backward)
    for step in launch.steps:
        launches.check_limits(step, device)
    pb = launches.LaunchRecorder(wide_grad.SLOTS, device_id)
    gradients.launch_cached(pb, launch, f.dtype, f.pdtype, {"dw": f.weight, "db": f.bias}, rows, n, 0.0, 1,
                            dy=pb["dy"], x=pb["x"], dh=pb["dh"],
                            w=pb["w"] if f.weight else None, center=pb["center"] if f.norm == "ln" else None,
                            scale=pb["scale"], dx=pb["dx"], dres=pb["dres"])
    outputs = spec.outputs()
    out = emit(pb, dict(zip(spec.inputs(), args)), outputs, arch)
    return [out[name] for name in outputs]


def _layout(spec: WideGradSpec) -> _sharding.Layout:
    """The backward's: dweight and dbias summed across the shards of the rows."""
    f = spec.forward
    x = _sharding.labels(len(f.shape))
    norm, params = x[f.first:f.last + 1], _jit.operand_labels(f)["w"]
    labels = {"dy": x, "x": x, "dh": x, "w": params, "center": x[:f.first], "scale": x[:f.first], "dx": x,
              "dres": x, "dw": params, "db": params}
    outputs = list(spec.outputs())
    return _sharding.Layout(tuple(labels[n] for n in spec.inputs()), tuple(labels[n] for n in outputs),
                            frozenset(norm), frozenset(i for i, n in enumerate(outputs) if n in ("dw", "db")))


_jit.register_unbatched(wide_grad_p, _lowering, _layout,
                        lambda spec, shape: WideGradSpec(spec.forward.localized(shape)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def wide_vjp(spec: _jit.RowSpec, given: dict):
    """The prepared call (_modulated.forward_spec, prepare), fused forward
    and backward."""
    return bind_forward(spec, given)


def _fwd(spec, given):
    full = dataclasses.replace(spec, stats=True)
    named = dict(zip(_jit._rows_outputs(full), bind_forward(full, given)))
    # (h, the statistics and the weight: not x or the residual, which the backward never reads)
    saved = {name: named[name] for name in ("h",) + full.stat_names()}
    return tuple(named[n] for n in _jit._rows_outputs(spec)), (given.get("w"), saved)


def _bwd(spec, saved, cotangents):
    w, kept = saved
    ct = dict(zip(_jit._rows_outputs(spec), cotangents))
    grad = WideGradSpec(dataclasses.replace(spec, stats=True))
    values = {"dy": ct["y"], "x": kept["h"], "dh": ct["h"], "w": w, **kept}
    grads = dict(zip(grad.outputs(), wide_grad_p.bind(*[values[n] for n in grad.inputs()], spec=grad)))
    # (prepare's arrays: x, the residual, the parameters in spec.pdtype)
    found = {"x": grads["dx"], "r": grads["dres"], "w": grads.get("dw"), "b": grads.get("db")}
    return ({name: found[name] for name in _jit._rows_inputs(spec)},)


wide_vjp.defvjp(_fwd, _bwd)
