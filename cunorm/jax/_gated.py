"""The gated RMSNorm (``gate=``) inside ``jax.jit`` under ``jax.grad``:
the fused forward (the row primitive with the gate z, cunorm/jax/_jit.py)
and the fused backward (rows_grad_gated, cunorm/_engine/gated_grad.py) as
a primitive of its own, over whole rows or groups with a weight over the
normalized axes, per head (a weight a group) or none.
cunorm/jax/__init__.py sends the other gated forms through the fused
forward with the composed formula's gradient.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np

from .._engine import dispatch_grad, dtypes, gated_grad, gradients, launches, plans
from . import _jit, _sharding
from ._custom_call import emit
from ._modulated import bind_forward


def fusable_backward(spec: _jit.RowSpec) -> bool:
    """Whether rows_grad_gated takes a prepared call: the gate z alone
    among the per-row operands, a weight over the normalized (trailing)
    axes, per head or none, no residual or activation, rows one block
    holds."""
    if [slot for slot, _ in spec.operands] != ["gate"] or spec.residual or spec.epilogue & plans.ACTIVATION_BITS:
        return False
    return gated_grad.fusable(spec.shape, spec.dtype.itemsize, spec.first, spec.last)


@dataclasses.dataclass(frozen=True)
class GatedGradSpec:
    """The gated backward of a forward RowSpec (its statistics kept);
    ``pdtype``: the weight's dtype as the kernel reads it (float32 for 1 +
    w with the weight offset)."""

    forward: _jit.RowSpec
    pdtype: np.dtype | None = None

    def inputs(self) -> tuple:
        return ("dy", "x", "z") + (("w",) if self.forward.weight else ()) + ("scale",)

    def outputs(self) -> dict:
        f = self.forward
        out = {"dx": (f.shape, f.dtype), "dz": (f.shape, f.dtype)}
        if f.weight:
            out["dw"] = (f.param_shape, self.pdtype)
        return out


gated_grad_p = _jit._primitive("cunorm_rows_grad_gated", lambda spec: spec.outputs())


def _lowering(ctx, *args, spec: GatedGradSpec):
    device_id, device, arch = _jit.target()
    f = spec.forward
    rows, n = math.prod(f.shape[:f.first]), math.prod(f.shape[f.first:])
    gate = dispatch_grad.GATE_INPUT if f.epilogue & plans.FLAG_GATE_INPUT else dispatch_grad.GATE_OUTPUT
    flags = plans.FLAG_WEIGHT if f.weight else 0
    launch = dispatch_grad.choose_rows_grad_gated(f.dtype, spec.pdtype, flags, rows, n,
                                                  plans.vector_width(f.dtype.itemsize, n, [], []), gate, device,
                                                  cooperative=False, heads=f.param_rows)
    if launch is None:
        raise RuntimeError(f"cunorm inside jit: no fused gated backward for {f}")  # (fusable_backward said so)
    for step in launch.steps:
        launches.check_limits(step, device)
    pb = launches.LaunchRecorder(gated_grad.SLOTS, device_id)
    gradients.launch_cached(pb, launch, f.dtype, spec.pdtype, {"dw": f.weight, "db": False}, rows, n, 0.0,
                            f.param_rows, dy=pb["dy"], x=pb["x"], z=pb["z"], w=pb["w"] if f.weight else None,
                            scale=pb["scale"], dx=pb["dx"], dz=pb["dz"])
    outputs = spec.outputs()
    out = emit(pb, dict(zip(spec.inputs(), args)), outputs, arch)
    return [out[name] for name in outputs]


def _layout(spec: GatedGradSpec) -> _sharding.Layout:
    """The backward's: dweight summed across the shards of the rows (a
    weight per head split with its heads)."""
    f = spec.forward
    x = _sharding.labels(len(f.shape))
    norm, params = x[f.first:f.last + 1], _jit.operand_labels(f)["w"]
    labels = {"dy": x, "x": x, "z": x, "w": params, "scale": x[:f.first], "dx": x, "dz": x, "dw": params}
    outputs = list(spec.outputs())
    return _sharding.Layout(tuple(labels[n] for n in spec.inputs()), tuple(labels[n] for n in outputs),
                            frozenset(norm), frozenset(i for i, n in enumerate(outputs) if n == "dw"))


_jit.register_unbatched(gated_grad_p, _lowering, _layout,
                        lambda spec, shape: GatedGradSpec(spec.forward.localized(shape), spec.pdtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gated_vjp(spec: _jit.RowSpec, given: dict):
    """The prepared call (_modulated.forward_spec, prepare), fused forward
    and backward."""
    return bind_forward(spec, given)


def _fwd(spec, given):
    full = dataclasses.replace(spec, stats=True)
    named = dict(zip(_jit._rows_outputs(full), bind_forward(full, given)))
    return tuple(named[n] for n in _jit._rows_outputs(spec)), (given, named["scale"])


def _bwd(spec, saved, cotangents):
    given, rstd = saved
    w = given.get("w")
    pdtype = spec.pdtype
    if w is not None and spec.epilogue & plans.FLAG_WEIGHT_OFFSET:  # (the kernel's weight: 1 + w in float32)
        pdtype = np.dtype(dtypes.accumulation(spec.dtype))
        w = w.astype(pdtype) + 1
    grad = GatedGradSpec(dataclasses.replace(spec, stats=True), pdtype)
    ct = dict(zip(_jit._rows_outputs(spec), cotangents))
    values = {"dy": ct["y"], "x": given["x"], "z": given["gate"], "w": w, "scale": rstd}
    grads = dict(zip(grad.outputs(), gated_grad_p.bind(*[values[n] for n in grad.inputs()], spec=grad)))
    found = {"x": grads["dx"], "gate": grads["dz"],
             "w": None if w is None else grads["dw"].astype(given["w"].dtype)}
    return ({name: found[name] for name in given},)


gated_vjp.defvjp(_fwd, _bwd)
