"""The conditioned row norms inside ``jax.jit``: per-head weights,
``shift=``, ``scale=``, ``residual_gate=``, ``gate=`` and the float32
residual stream as one fused forward (the row primitive with per-row
operands, cunorm/jax/_jit.py), and the fused modulated backward
(cunorm/_engine/modulated_grad.py) as its own primitive.

``forward_spec`` plans a validated call (row_norms.Call over stand-ins)
for the row primitive and ``prepare`` brings each per-row operand to the
form the kernel reads (shift, scale and the residual gate of x's ndim,
size 1 along the axes they broadcast over, in the parameters' dtype: their
rows C-contiguous; a pattern the kernel does not take broadcast out to x's
shape), with jax ops, so jax differentiates the preparation itself. ``modulated_vjp`` runs shift=,
scale= and residual_gate= of one per-sample (or one-for-all) pattern
forward and backward fused; cunorm/jax/__init__.py sends the other forms
through the fused forward with the composed formula's gradient.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from .._engine import conditioning, launches, modulated_grad, plans, row_norms, tuning
from .._engine.dispatch_grad import MOD_GATE, MOD_SCALE, OUT_GATE, OUT_SCALE, OUT_SHIFT
from . import _jit, _sharding
from ._custom_call import emit

#: a conditioned keyword's kernel slot
SLOT = dict(zip(conditioning.OPERAND_NAMES, row_norms.CONDITIONED_SLOTS))


def forward_spec(call: row_norms.Call, x, weight, bias, residual, arrays: dict, epilogue: int,
                 return_stats: bool):
    """The RowSpec of a validated call (row_norms.Call over stand-ins) over
    jax arrays (``arrays``: {keyword: array or None} of
    conditioning.OPERAND_NAMES), or None where rows_cached does not take it
    (rows too long for one block's registers, no elements): the caller
    composes it."""
    cond = call.cond
    if not x.size:
        return None
    _, pdtype = row_norms.kernel_params(call.x.dtype, call.weight, call.bias, conditioning.dtypes_of(cond))
    pdtype = None if pdtype is None else np.dtype(pdtype)
    shape, ndim = tuple(x.shape), x.ndim
    operands = []
    for name in conditioning.OPERAND_NAMES:
        a = arrays.get(name)
        if a is not None:  # (no one pattern: a row of them a row of x)
            operands.append((SLOT[name], shape if name == "gate" or cond.expand else
                             (1,) * (ndim - a.ndim) + tuple(a.shape)))
    params = weight if weight is not None else bias
    heads = params is not None and params.ndim > call.last - call.first + 1
    spec = _jit.RowSpec(call.norm, shape, np.dtype(x.dtype), call.first, call.last, call.eps,
                        residual=residual is not None, weight=weight is not None, bias=bias is not None,
                        pdtype=pdtype, stats=return_stats, epilogue=epilogue, operands=tuple(operands),
                        param_ndim=params.ndim if heads else 0,
                        rdtype=np.dtype(residual.dtype) if residual is not None and residual.dtype != x.dtype
                        else None)
    device_id, _, _ = _jit.target()
    plan, launch = row_norms._planned(*_jit._row_key(spec, device_id))
    if plan is None or launch is None or launch.tier != "cached":
        return None
    return spec


def prepare(spec: _jit.RowSpec, x, weight, bias, residual, shift, scale, residual_gate, gate) -> dict:
    """The row primitive's arrays by input name: the parameters and the
    modulation in the parameters' dtype, the modulation of its kernel
    shape (RowSpec.operands)."""
    given = {"x": jnp.asarray(x)}
    for name, a in (("r", residual), ("w", weight), ("b", bias)):
        if a is not None:
            given[name] = a if name == "r" else a.astype(spec.pdtype)
    arrays = dict(zip(row_norms.CONDITIONED_SLOTS, (shift, scale, residual_gate, gate)))
    for slot, shape in spec.operands:
        a = arrays[slot]
        given[slot] = a if slot == "gate" else jnp.broadcast_to(
            jnp.reshape(a, (1,) * (len(shape) - a.ndim) + tuple(a.shape)), shape).astype(spec.pdtype)
    return given


def bind_forward(spec: _jit.RowSpec, given: dict) -> tuple:
    return tuple(_jit.rows_p.bind(*[given[name] for name in _jit._rows_inputs(spec)], spec=spec))


def fusable_backward(spec: _jit.RowSpec) -> bool:
    """Whether the fused modulated backward takes a prepared call:
    shift, scale or the residual gate (no gate z, per-head parameters,
    float32 stream, activation or weight offset) of a pattern its plan
    takes (modulated_grad.fusable)."""
    shapes = [shape for slot, shape in spec.operands]
    slots = [slot for slot, _ in spec.operands]
    if (not slots or "gate" in slots or spec.param_ndim or spec.rdtype is not None
            or spec.epilogue & plans.UNFUSED_IN_BACKWARD):
        return False
    return modulated_grad.fusable(spec.shape, spec.dtype.itemsize, spec.first, spec.last, shapes, False,
                                  "res_gate" in slots)


# --- the fused modulated backward as a primitive -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModulatedGradSpec:
    """The modulated backward of a forward RowSpec (its statistics kept);
    ``dh``: a gradient reached the returned h."""

    forward: _jit.RowSpec
    dh: bool = False

    @property
    def slots(self) -> tuple:
        return tuple(slot for slot, _ in self.forward.operands)

    def inputs(self) -> tuple:
        f = self.forward
        gate = "res_gate" in self.slots
        return ("dy", "h") + (("x",) if gate else ()) + (("dh",) if self.dh else ()) + (
            ("w",) if f.weight else ()) + (("b",) if f.bias else ()) + tuple(
            s for s in ("mod_scale", "res_gate") if s in self.slots) + (("center",) if f.norm == "ln" else ()) + (
            "rstd",)

    def outputs(self) -> dict:
        f = self.forward
        out = {"dx": (f.shape, f.dtype)}
        if "res_gate" in self.slots:
            out["dres"] = (f.shape, f.dtype)
        for name, present in (("dw", f.weight), ("db", f.bias)):
            if present:
                out[name] = (f.param_shape, f.pdtype)
        shapes = dict(f.operands)
        for name, slot in (("dshift", "shift"), ("dscale", "mod_scale"), ("dgate", "res_gate")):
            if slot in shapes:
                out[name] = (shapes[slot], f.pdtype)
        return out


modulated_grad_p = _jit._primitive("cunorm_rows_grad_modulated", lambda spec: spec.outputs())


def _lowering(ctx, *args, spec: ModulatedGradSpec):
    device_id, device, arch = _jit.target()
    f = spec.forward
    rows, n = math.prod(f.shape[:f.first]), math.prod(f.shape[f.first:])
    itemsize = f.dtype.itemsize
    _, mod_div, mod_count = f.conditioning
    gate = "res_gate" in spec.slots
    # (min_run 1: a shard's runs may be a part of those fusable_backward planned)
    p = modulated_grad.plan(rows, n, plans.vector_width(itemsize, n, [], []), itemsize, mod_div, mod_count,
                            device.sm_count, gate, min_run=1, tune=tuning.of(device))
    if p is None:
        raise RuntimeError(f"cunorm inside jit: no fused modulated backward for {f}")  # (fusable_backward said so)
    outputs = spec.outputs()
    flags = (plans.FLAG_WEIGHT if f.weight else 0) | (plans.FLAG_BIAS if f.bias else 0)
    modf = (MOD_SCALE if "mod_scale" in spec.slots else 0) | (MOD_GATE if gate else 0)
    outs = sum(bit for bit, name in ((OUT_SHIFT, "dshift"), (OUT_SCALE, "dscale"), (OUT_GATE, "dgate"))
               if name in outputs)
    present = tuple(slot for slot in modulated_grad.SLOTS if slot in spec.inputs() or slot in outputs)
    recorder = launches.LaunchRecorder(modulated_grad.SLOTS, device_id)
    modulated_grad.build(recorder, p, f.norm, f.dtype, f.pdtype, flags, modf, outs, rows, n, 0.0, present)
    out = emit(recorder, dict(zip(spec.inputs(), args)), outputs, arch)
    return [out[name] for name in outputs]


def _layout(spec: ModulatedGradSpec) -> _sharding.Layout:
    """The backward's: the sums (dweight, dbias, dshift, dscale, dgate)
    added across the shards of the axes they lack."""
    f = spec.forward
    x = _sharding.labels(len(f.shape))
    stats = x[:f.first]
    labels = {"dy": x, "h": x, "x": x, "dh": x, "center": stats, "rstd": stats, "dx": x, "dres": x,
              **_jit.operand_labels(f)}
    named = {"dw": "w", "db": "b", "dshift": "shift", "dscale": "mod_scale", "dgate": "res_gate"}
    outputs = list(spec.outputs())
    return _sharding.Layout(tuple(labels[n] for n in spec.inputs()),
                            tuple(labels[named.get(n, n)] for n in outputs), frozenset(x[f.first:f.last + 1]),
                            frozenset(i for i, n in enumerate(outputs) if n in named))


_jit.register_unbatched(modulated_grad_p, _lowering, _layout,
                        lambda spec, shape: ModulatedGradSpec(spec.forward.localized(shape), spec.dh))


# --- forward and backward fused -------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def modulated_vjp(spec: _jit.RowSpec, given: dict):
    """The prepared call (forward_spec), fused forward and backward."""
    return bind_forward(spec, given)


def _fwd(spec, given):
    full = dataclasses.replace(spec, stats=True)
    named = dict(zip(_jit._rows_outputs(full), bind_forward(full, given)))
    public = tuple(named[n] for n in _jit._rows_outputs(spec))
    return public, (named.get("h", given["x"]), given, named.get("center"), named["scale"])


def _bwd(spec, saved, cotangents):
    h, given, center, rstd = saved
    ct = dict(zip(_jit._rows_outputs(spec), cotangents))
    grad = ModulatedGradSpec(dataclasses.replace(spec, stats=True), dh=spec.residual)
    values = {"dy": ct["y"], "h": h, "x": given["x"], "dh": ct.get("h"), "w": given.get("w"), "b": given.get("b"),
              "mod_scale": given.get("mod_scale"), "res_gate": given.get("res_gate"), "center": center, "rstd": rstd}
    grads = dict(zip(grad.outputs(), modulated_grad_p.bind(*[values[n] for n in grad.inputs()], spec=grad)))
    dx = grads["dx"]
    found = {"x": dx, "r": grads.get("dres", dx), "w": grads.get("dw"), "b": grads.get("db"),
             "shift": grads.get("dshift"), "mod_scale": grads.get("dscale"), "res_gate": grads.get("dgate")}
    return ({name: found[name] for name in given},)


modulated_vjp.defvjp(_fwd, _bwd)
