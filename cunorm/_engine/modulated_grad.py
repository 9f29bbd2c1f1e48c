"""The fused backward of a row norm with adaLN's modulation (``shift=``,
``scale=``) and the gated residual (``residual_gate=``): validation, the
plan (a pure function) and the launches of cunorm/kernels/modulated_grads.cu.

The call mirrors its forward: dy, h (the normalized input: the returned h
for the residual forms, else x), the forward's statistics, weight, bias
and modulation arrays, the x that residual_gate scaled, and dh (the
gradient that reached a returned h). It returns the gradients of x, the
residual, the weight, the bias, shift, scale and the residual gate.

What the fused kernels take (``plan`` returns None otherwise, and the
caller composes the backward): RMSNorm or LayerNorm over the trailing axes,
rows rows_grad_cached's block holds (its shared memory within
dispatch_grad.MODULATED_MAX_SHARED), modulation arrays of
one broadcast pattern whose rows come in runs of at least UNIT_MIN_ROWS
(per sample, or one for all; per token is the elementwise case the
composed backward serves), no per-head weights, gate=, float32 residual
stream, weight offset or activation.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from . import conditioning, dispatch_grad, dtypes, launch_cache, launches, plans, row_norms, tuning
from . import declarations as K
from .dispatch_grad import MOD_GATE, MOD_SCALE, OUT_GATE, OUT_SCALE, OUT_SHIFT, UNIT_MIN_ROWS, ModulatedPlan
from .dispatch_grad import modulated_plan as plan
from .dispatch_rows import Step, _ceil_div, next_pow2


class ModulatedGrads(NamedTuple):
    """The gradients of a modulated row norm's inputs (None where the
    forward had no such input). ``residual``: with a residual gate, the
    gradient that reached h (the residual's); without one None, the
    residual's gradient being x's."""

    x: object
    residual: object
    weight: object
    bias: object
    shift: object
    scale: object
    residual_gate: object


def fusable(x_shape: tuple, itemsize: int, first: int, last: int, shapes: list, per_head: bool,
            gate: bool) -> bool:
    """Whether the fused kernels take a call over x of ``x_shape``
    normalized over axes first..last, with modulation arrays of ``shapes``
    (plain values: a front end asks before its forward runs); ``gate``:
    with residual_gate."""
    if last != len(x_shape) - 1 or per_head or not shapes:
        return False
    # (a list, not a set: a traced call's sizes may be symbolic, which do not hash)
    patterns = [conditioning.broadcast_rows(tuple(x_shape), first, tuple(s)) for s in shapes]
    if None in patterns or any(p != patterns[0] for p in patterns[1:]):
        return False
    mod_div, mod_count = patterns[0]
    n, rows = math.prod(x_shape[first:]), math.prod(x_shape[:first])
    return plan(rows, n, plans.vector_width(itemsize, n, [], []), itemsize, mod_div, mod_count, 1, gate) is not None


def steps(p: ModulatedPlan, norm: str, dtype, pdtype, flags: int, modf: int, outs: int, rows: int, n: int) -> tuple:
    """The launches of ``p``: rows_grad_modulated, modulated_grad_sums and,
    with a weight or bias, column_sum over the modulation rows."""
    t, pt = dtypes.KERNEL_TYPE[np.dtype(dtype)], dtypes.KERNEL_TYPE[np.dtype(pdtype)]
    acc = dtypes.accumulation(dtype)
    a = dtypes.KERNEL_TYPE[acc]
    grad = dispatch_grad.grad_policy(norm, a)
    units = rows // p.mod_div * p.units_per_run
    shared = p.sums_shared_bytes(acc.itemsize, bool(modf & MOD_GATE))
    main = Step(K.ROWS_GRAD_MODULATED(grad, t, pt, flags, modf, p.vec, p.vpt, p.max_threads, p.min_blocks,
                                      persistent=True), (units,), (p.threads,), shared)
    runs = rows // p.mod_div
    parts = _ceil_div(runs, p.mod_count) * p.units_per_run
    by = min(32, next_pow2(parts))
    bx = dispatch_grad.GRAD_BLOCK_THREADS // by
    columns = dispatch_grad.column_sum_width(a, n)
    sums = Step(K.MODULATED_GRAD_SUMS(a, pt, flags, modf, outs, columns), (_ceil_div(n, bx * columns), p.mod_count),
                (bx, by))
    out = [main, sums]
    if flags:
        out.append(dispatch_grad.column_sum_step(a, pt, p.mod_count, n, 2 if flags & plans.FLAG_BIAS else 1))
    return tuple(out)


#: the slots of a modulated backward's Program
SLOTS = ("dy", "h", "x", "dh", "w", "b", "mod_scale", "res_gate", "center", "rstd", "dx", "dres", "dw", "db",
         "dshift", "dscale", "dgate")


@functools.lru_cache(maxsize=256)
def program(p: ModulatedPlan, norm, dtype, pdtype, flags, modf, outs, rows, n, eps, present, device):
    """The Program of one call; ``present``: the slots the call fills."""
    return build(launches.ProgramBuilder(SLOTS, device), p, norm, dtype, pdtype, flags, modf, outs, rows, n, eps,
                 present).build()


def build(pb, p: ModulatedPlan, norm, dtype, pdtype, flags, modf, outs, rows, n, eps, present):
    """program's launches into ``pb`` (a ProgramBuilder over SLOTS, or the
    jit path's LaunchRecorder); returns pb."""
    has = set(present)
    slot = lambda name: pb[name] if name in has else None  # noqa: E731
    main, sums, *column = steps(p, norm, dtype, pdtype, flags, modf, outs, rows, n)
    acc = dtypes.accumulation(dtype).itemsize
    units = rows // p.mod_div * p.units_per_run
    partial = pb.workspace((3 if modf & MOD_GATE else 2) * units * n * acc)
    weighted = pb.workspace(2 * p.mod_count * n * acc if flags else acc)
    info = launches.device_info(pb.device)
    for step in (main, sums, *column):
        launches.check_limits(step, info)
    pb.launch(main, dy=pb["dy"], h=pb["h"], x=slot("x"), dh=slot("dh"), w=slot("w"), mod_scale=slot("mod_scale"),
              res_gate=slot("res_gate"), center=slot("center"), rstd=pb["rstd"], dx=pb["dx"], dres=slot("dres"),
              partial=partial, rows=rows, n=n, mod_div=p.mod_div, mod_count=p.mod_count,
              units_per_run=p.units_per_run, unit_rows=p.unit_rows, eps=eps)
    pb.launch(sums, partial=partial, w=slot("w"), b=slot("b"), mod_scale=slot("mod_scale"), dshift=slot("dshift"),
              dscale=slot("dscale"), dgate=slot("dgate"), weighted=weighted, units=units, n=n,
              units_per_run=p.units_per_run, runs=rows // p.mod_div, mod_count=p.mod_count)
    if column:
        pb.launch(column[0], partial=weighted, out_w=slot("dw"), out_b=slot("db"), parts=p.mod_count, n=n)
    return pb


class ModulatedGradCall:
    """A validated backward call of a modulated row norm (``norm``: "rms"
    or "ln")."""

    def __init__(self, norm, dy, h, *, mean=None, rstd=None, weight=None, bias=None, dh=None, shift=None,
                 scale=None, residual_gate=None, x=None, axis=-1):
        from . import gradients

        if norm not in ("rms", "ln"):
            raise ValueError(f"the modulated backward is rms_norm's or layer_norm's, got {norm!r}")
        if residual_gate is not None and x is None:
            raise TypeError("residual_gate's gradient needs x, the input it scaled (h = residual + residual_gate * x)")
        if residual_gate is None and x is not None:
            raise ValueError("x is the input residual_gate scaled: pass it with residual_gate= only")
        # the forward's checks, h standing for x (and for the residual, which residual_gate needs)
        conditioned = {"shift": shift, "scale": scale, "residual_gate": residual_gate}
        self.call = call = row_norms.Call(norm, h, axis, 0.0, None, weight=weight, bias=bias,
                                          residual=h if residual_gate is not None else None, conditioned=conditioned)
        self.norm = norm
        self.dy = gradients._check_like(call, dy, "dy")
        self.dh = None if dh is None else gradients._check_like(call, dh, "dh")
        self.x = None if x is None else gradients._check_like(call, x, "x")
        self.center = None if norm == "rms" else gradients._check_stat(call, mean, "mean", call.stats_shape)
        self.scale_stat = gradients._check_stat(call, rstd, "rstd", call.stats_shape)
        if not (shift is not None or scale is not None or residual_gate is not None):
            raise TypeError("the modulated backward needs shift=, scale= or residual_gate=")
        cond = call.cond
        if cond.flags & plans.FLAG_PARAM_ROWS:
            raise ValueError("per-head weights have no fused modulated backward: cunorm.torch's autograd composes it")
        self.cond = cond


def reference(g: ModulatedGradCall) -> ModulatedGrads:
    """The float64 backward (NumPy arrays), by its formula."""
    from .. import reference as ref

    call, cond = g.call, g.cond
    f = lambda a: None if a is None else np.asarray(a, dtype=np.float64)  # noqa: E731
    axes = tuple(range(call.first, call.last + 1))
    h, dy, x = f(call.x), f(g.dy), f(g.x)
    scale, gate = f(cond.scale), f(cond.residual_gate)
    w, b = f(call.weight), f(call.bias)
    center = 0.0 if g.center is None else np.expand_dims(f(g.center), axes)
    rstd = np.expand_dims(f(g.scale_stat), axes)
    xhat = (h - center) * rstd
    affine = xhat * (1.0 if w is None else w) + (0.0 if b is None else b)
    d_affine = dy * (1.0 if scale is None else 1.0 + scale)
    if g.norm == "rms":
        d_h, dw = ref.rms_norm_backward(d_affine, h, f(g.scale_stat), w, axis=axes, dh=f(g.dh), exact=True)
        db = None
    else:
        d_h, dw, db = ref.layer_norm_backward(d_affine, h, f(g.center), f(g.scale_stat), w, b, axis=axes,
                                              dh=f(g.dh), exact=True)
    dt = call.x.dtype

    def summed(a, like):
        if like is None:
            return None
        lead = a.ndim - like.ndim
        a = a.sum(axis=tuple(range(lead))) if lead else a
        a = a.sum(axis=tuple(i for i, s in enumerate(like.shape) if s == 1 and a.shape[i] != 1), keepdims=True)
        return a.astype(like.dtype)

    dx = d_h if gate is None else d_h * gate
    return ModulatedGrads(
        dx.astype(dt), None if gate is None else d_h.astype(dt),
        None if w is None else dw.astype(call.weight.dtype), None if b is None else db.astype(call.bias.dtype),
        summed(dy, cond.shift), summed(dy * affine, cond.scale), summed(d_h * x, cond.residual_gate) if x is not None
        else None)


def run(g: ModulatedGradCall, key=None) -> ModulatedGrads:
    """The gradients as the caller's array kind: the reference for NumPy
    arrays, the fused kernels for GPU arrays; ValueError where the fused
    kernels do not take the call (ModulatedGradCall's docstring). ``key``:
    the call's signature in the launch cache, which gets an entry when the
    call ran over its arrays as given (nothing copied or cast)."""
    call = g.call
    if not call.on_gpu:
        return reference(g)
    with call.adapter.scope(call.x.data.device_id):
        grads, entry = _gpu(g)
        wrap = call.adapter.from_cupy
        results = ModulatedGrads(*(None if a is None else wrap(a) for a in grads))
    if key is not None and entry is not None:
        launch_cache.ROWS_GRAD.put(key, entry)
    return results


#: the inputs of a launch cache entry, in the order calls.rows_grad_modulated replays it
ENTRY_INPUTS = ("dy", "h", "x", "dh", "w", "b", "shift", "scale", "residual_gate", "mean", "rstd")


def _gpu(g: ModulatedGradCall) -> ModulatedGrads:
    import cupy

    call, cond = g.call, g.cond
    cont = lambda a: a if a is None or a.flags.c_contiguous else cupy.ascontiguousarray(a)  # noqa: E731
    h, dy, dh, x = (cont(a) for a in (call.x, g.dy, g.dh, g.x))
    center, rstd = cont(g.center), cont(g.scale_stat)
    n = math.prod(call.norm_shape)
    rows = h.size // n if n else 0
    flags, pdtype = row_norms.kernel_params(h.dtype, call.weight, call.bias, conditioning.dtypes_of(cond))
    if not h.size:
        return _empty(g, n), None
    vec = plans.vector_width(h.itemsize, n, [], [])
    if plans.vector_width(h.itemsize, n, [], [(a.data.ptr, h.itemsize) for a in (h, dy, dh, x) if a is not None]) < vec:
        h, dy, dh, x = (None if a is None else a.copy() for a in (h, dy, dh, x))  # (fresh: aligned for vec)
    gate = cond.residual_gate is not None
    info = launches.device_info(h.data.device_id)
    p = None if cond.expand else plan(rows, n, vec, h.itemsize, cond.mod_div, cond.mod_count, info.sm_count, gate,
                                      tune=tuning.of(info))
    if p is None:
        raise ValueError(unfused_reason(cond, rows, n, h.itemsize))
    dx = cupy.empty(h.shape, h.dtype)
    dres = cupy.empty(h.shape, h.dtype) if gate else None
    aligned = lambda a: a if a is None or a.data.ptr % 16 == 0 else a.copy()  # noqa: E731  (16-byte loads)
    w, b = (aligned(row_norms._as_param(a, pdtype)) for a in (call.weight, call.bias))
    dw, db = (None if a is None else cupy.empty(call.norm_shape, pdtype) for a in (call.weight, call.bias))
    operands = {k: aligned(a) for k, a in conditioning.kernel_rows(cond, tuple(h.shape), call.first, pdtype).items()}
    # (each array's gradient in its own shape: its (mod_count, n) rows, C-contiguous)
    mod_outs = {name: None if getattr(cond, name) is None else cupy.empty(getattr(cond, name).shape, pdtype)
                for name in ("shift", "scale", "residual_gate")}
    modf = (MOD_SCALE if cond.scale is not None else 0) | (MOD_GATE if gate else 0)
    outs = sum(bit for bit, name in ((OUT_SHIFT, "shift"), (OUT_SCALE, "scale"), (OUT_GATE, "residual_gate"))
               if mod_outs[name] is not None)
    arrays = {"dy": dy, "h": h, "x": x, "dh": dh, "w": w, "b": b, "mod_scale": operands.get("mod_scale"),
              "res_gate": operands.get("res_gate"), "center": center, "rstd": rstd, "dx": dx, "dres": dres,
              "dw": dw, "db": db, "dshift": mod_outs["shift"], "dscale": mod_outs["scale"],
              "dgate": mod_outs["residual_gate"]}
    present = tuple(name for name in SLOTS if arrays[name] is not None)
    prog = program(p, g.norm, np.dtype(h.dtype), np.dtype(pdtype), flags, modf, outs, rows, n,
                   float(call.eps), present, h.data.device_id)
    prog.run_named(arrays, launches.cupy_stream(), launches.cupy_alloc)
    given = {"shift": cond.shift, "mod_scale": cond.scale, "res_gate": cond.residual_gate}
    clean = (h is call.x and dy is g.dy and dh is g.dh and x is g.x and center is g.center and rstd is g.scale_stat
             and w is call.weight and b is call.bias and not cond.expand
             and all(a.dtype == pdtype for a in (call.weight, call.bias, cond.shift, cond.scale, cond.residual_gate)
                     if a is not None)
             and all(a.data.ptr == given[k].data.ptr for k, a in operands.items()))
    entry = _entry(g, prog, pdtype, present) if clean else None

    def back(out, like):
        if out is None:
            return None
        return out.reshape(like.shape).astype(like.dtype, copy=False)

    return ModulatedGrads(dx, dres, back(dw, call.weight), back(db, call.bias), back(mod_outs["shift"], cond.shift),
                          back(mod_outs["scale"], cond.scale),
                          back(mod_outs["residual_gate"], cond.residual_gate)), entry


def _entry(g: ModulatedGradCall, prog, pdtype, present):
    """The launch cache's launcher of a call that ran over its arrays as given."""
    call, cond = g.call, g.cond
    h = call.x
    outputs = {"dx": (h.shape, h.dtype, None)}
    if cond.residual_gate is not None:
        outputs["dres"] = (h.shape, h.dtype, None)
    for name, like in (("dw", call.weight), ("db", call.bias), ("dshift", cond.shift), ("dscale", cond.scale),
                       ("dgate", cond.residual_gate)):
        if like is not None:
            outputs[name] = (like.shape, pdtype, None)
    source = {"dy": "dy", "h": "h", "x": "x", "dh": "dh", "w": "w", "b": "b", "mod_scale": "scale",
              "res_gate": "residual_gate", "center": "mean", "rstd": "rstd"}
    slots = {slot: (source.get(slot, slot) if slot in present else None) for slot in SLOTS}
    returns = [name if name in outputs else None for name in ("dx", "dres", "dw", "db", "dshift", "dscale", "dgate")]
    return launch_cache.entry(call.adapter, h.data.device_id, prog, ENTRY_INPUTS, outputs, slots, returns,
                              arrays={"h": h})


def _empty(g: ModulatedGradCall, n: int) -> ModulatedGrads:
    """The gradients of x with no rows: dx empty, every sum zero."""
    import cupy

    call, cond = g.call, g.cond
    zeros = lambda a: None if a is None else cupy.zeros(a.shape, a.dtype)  # noqa: E731
    return ModulatedGrads(cupy.empty(call.x.shape, call.x.dtype),
                          None if cond.residual_gate is None else cupy.empty(call.x.shape, call.x.dtype),
                          zeros(call.weight), zeros(call.bias), zeros(cond.shift), zeros(cond.scale),
                          zeros(cond.residual_gate))


def unfused_reason(cond, rows: int, n: int, itemsize: int) -> str:
    """Why the fused kernels do not take a call (plan gave None)."""
    if cond.expand:
        return ("the fused modulated backward takes shift, scale and residual_gate of one broadcast pattern; "
                "these differ")
    if cond.mod_count > 1 and cond.mod_div < UNIT_MIN_ROWS:
        return (f"the fused modulated backward takes modulation rows shared by runs of at least {UNIT_MIN_ROWS} "
                f"rows (per sample), got runs of {cond.mod_div} (per token: its gradients are elementwise)")
    if cond.mod_count == 1 and rows < UNIT_MIN_ROWS:
        return (f"the fused modulated backward takes modulation rows shared by runs of at least {UNIT_MIN_ROWS} "
                f"rows, got one modulation row over {rows} {'row' if rows == 1 else 'rows'}")
    most = max(k for k in range(16 // itemsize, 32769, 16 // itemsize)
               if plan(UNIT_MIN_ROWS, k, 16 // itemsize, itemsize, UNIT_MIN_ROWS, 1, 1,
                       cond.residual_gate is not None) is not None)
    return f"the fused modulated backward takes rows of up to {most} elements of this dtype, got {n}"
