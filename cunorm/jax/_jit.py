"""cunorm's kernels inside ``jax.jit``: the ops as JAX primitives (abstract
evaluation, lowering, batching, the dead-code rule), each lowered to the
XLA custom calls of its Program's launches (cunorm/jax/_custom_call.py),
with no build step.

Private API used, and so the supported versions (_custom_call.SUPPORTED_JAX):
``jax._src.interpreters.mlir`` (lowering registration),
``partial_eval.dce_rules`` (a row norm whose y is never read writes its
statistics alone) and ``batching``.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

import jax
from jax._src import dispatch
from jax._src.interpreters import mlir
from jax._src.interpreters import batching
from jax._src.interpreters import partial_eval as pe

try:
    from jax.extend.core import Primitive
except ImportError:  # (older jax)
    from jax.core import Primitive
try:
    from jax.core import ShapedArray
except ImportError:  # (jax versions that keep it private)
    from jax._src.core import ShapedArray

from .._engine import (channel_norms, conditioning, dispatch_grad, dtypes, gradients, launches, ops, plans, quantize,
                       row_norms)
from ._custom_call import emit, target
from . import _sharding


#: the table's statistics (ops.OPS) as the row kernels' outputs name them
_KERNEL_STATISTIC = {"mean": "center", "rstd": "scale"}


# --- the primitives -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RowSpec:
    """A row norm's static description: x (shape, dtype) normalized over
    axes first..last; which of residual, weight, bias it has, the parameters'
    kernel dtype; whether it returns the statistics; whether it returns y
    (False: set by the dead-code rule, _rows_dce, where the program never
    reads y); the epilogue's FLAGS bits (plans: rounding, weight offset,
    activation; the forward's only: the backward lowerings mask them off);
    ``quant``: quantize='s key (cunorm/_engine/quantize.py) where y is
    written quantized (no gradient: the wrappers bind it without a vjp)."""

    norm: str
    shape: tuple
    dtype: np.dtype
    first: int
    last: int
    eps: float
    residual: bool = False
    weight: bool = False
    bias: bool = False
    pdtype: np.dtype | None = None
    stats: bool = False
    y: bool = True
    epilogue: int = 0
    quant: tuple | None = None
    #: the per-row operands (cunorm/_engine/conditioning.py) as the kernel
    #: reads them, (slot, shape) of each given in CONDITIONED_SLOTS' order:
    #: shift, mod_scale and res_gate in the parameters' dtype, of x's ndim
    #: (size 1 along the axes they broadcast over: their rows C-contiguous);
    #: gate (z) of x's shape and dtype
    operands: tuple = ()
    #: the weight's (and bias's) ndim where they span more axes than the
    #: normalized ones (per-head parameters: x's trailing axes), else 0
    param_ndim: int = 0
    #: the residual's (and h's) dtype where it is not x's (the float32 stream)
    rdtype: np.dtype | None = None

    @property
    def param_rows(self) -> int:
        return math.prod(self.shape[len(self.shape) - self.param_ndim:self.first]) if self.param_ndim else 1

    @property
    def cond_flags(self) -> int:
        """The per-row operands' FLAGS bits (conditioning.OPERANDS and the
        float32 stream's)."""
        bits = dict(zip(row_norms.CONDITIONED_SLOTS, conditioning.OPERANDS.values()))
        flags = sum(bits[slot] for slot, _ in self.operands)
        flags |= plans.FLAG_PARAM_ROWS if self.param_rows > 1 else 0
        return flags | (plans.FLAG_WIDE_RESIDUAL if self.rdtype is not None else 0)

    @property
    def conditioning(self) -> tuple:
        """Plan.conditioning: (param_rows, mod_div, mod_count), () without
        per-row operands."""
        if not self.cond_flags:
            return ()
        modulation = [shape for slot, shape in self.operands if slot != "gate"]
        mod_div, mod_count = (conditioning.broadcast_rows(self.shape, self.first, modulation[0]) if modulation
                              else (1, 1))
        return self.param_rows, mod_div, mod_count

    @property
    def flags(self) -> int:
        return ((plans.FLAG_WEIGHT if self.weight else 0) | (plans.FLAG_BIAS if self.bias else 0) | self.epilogue
                | self.cond_flags)

    @property
    def param_shape(self) -> tuple:
        return self.shape[len(self.shape) - self.param_ndim:] if self.param_ndim else self.shape[self.first:
                                                                                                 self.last + 1]

    def localized(self, shape: tuple) -> "RowSpec":
        """The spec of a shard whose x has ``shape``: each operand's axes
        that x's extent (not a broadcast 1) take the shard's."""
        operands = tuple((slot, tuple(shape) if slot == "gate" else tuple(
            local if given == whole else given for given, whole, local in zip(oshape, self.shape, shape)))
            for slot, oshape in self.operands)
        return dataclasses.replace(self, shape=shape, operands=operands)

    @property
    def quantize(self):
        return quantize.by_key(self.quant)

    @property
    def stats_shape(self) -> tuple:
        return row_norms.stats_shape(self.shape, self.first, self.last)

    def stat_names(self) -> tuple:
        """The statistics the kernels write: LayerNorm's mean (center) and
        rstd (scale), RMSNorm's rstd; none for the Lp norms."""
        if not self.stats:
            return ()
        return tuple(_KERNEL_STATISTIC[name] for name in ops.statistics_of(self.norm))


def _abstract(*shape_dtypes):
    return tuple(ShapedArray(s, d) for s, d in shape_dtypes)


def _primitive(name: str, outputs) -> Primitive:
    """A primitive of several results, ``outputs(spec)`` {slot: (shape,
    dtype)}; eager binds run it jitted."""
    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_impl(functools.partial(dispatch.apply_primitive, prim))
    prim.def_abstract_eval(lambda *args, spec: _abstract(*outputs(spec).values()))
    return prim


def _grad_outputs(forward, param_shape) -> dict:
    """dx, and dweight/dbias of ``param_shape`` where the forward has them."""
    out = {"dx": (forward.shape, forward.dtype)}
    if forward.weight:
        out["dw"] = (param_shape, forward.pdtype)
    if forward.bias:
        out["db"] = (param_shape, forward.pdtype)
    return out


def _rows_outputs(spec: RowSpec) -> dict:
    acc = dtypes.accumulation(spec.dtype)
    quant = spec.quantize
    if quant is None:
        out = {"y": (spec.shape, spec.dtype)} if spec.y else {}
    else:
        out = {"y": (spec.shape, quant.format.numpy)}
        if quant.row_scales:
            out["y_scale"] = (quantize.scales_shape(quant, spec.shape, spec.first), np.dtype(np.float32))
        if quant.plain:
            out["y_plain"] = (spec.shape, spec.dtype)
    if spec.residual:
        out["h"] = (spec.shape, spec.rdtype or spec.dtype)
    for name in spec.stat_names():
        out[name] = (spec.stats_shape, acc)
    return out


def _rows_inputs(spec: RowSpec) -> tuple:
    quant = spec.quantize
    given_scale = quant is not None and quant.scaling != quantize.ROW  # (a static scale or a bound)
    return ("x",) + (("r",) if spec.residual else ()) + (("w",) if spec.weight else ()) + (
        ("b",) if spec.bias else ()) + tuple(slot for slot, _ in spec.operands) + (
        ("quant_scale",) if given_scale else ())


rows_p = _primitive("cunorm_rows", _rows_outputs)


def _row_key(spec: RowSpec, device_id: int) -> tuple:
    ndim = len(spec.shape)
    strides = tuple(math.prod(spec.shape[i + 1:]) for i in range(ndim))
    operand_ptrs = (0, 0, 0) if spec.conditioning else ()  # (XLA's buffers are aligned: offsets 0)
    return (spec.norm, np.dtype(spec.dtype), spec.pdtype, spec.flags, spec.residual, spec.shape, strides,
            spec.first, spec.last, 0, 0, 0, 0, 0, 0, None, spec.quant, spec.conditioning, operand_ptrs, 0, device_id)


def _record_rows(spec: RowSpec, values: dict, arch: int) -> dict:
    device_id, _, _ = target()
    plan, launch = row_norms._plan_and_choose(_row_key(spec, device_id), None)
    if plan is None or launch is None:
        raise RuntimeError(f"cunorm inside jit: no launch for {spec}")  # (the wrappers send no such call)
    names = spec.stat_names()
    recorder = launches.LaunchRecorder(row_norms.ROW_SLOTS, device_id)
    # without y, the cached tier writes the statistics alone; the others
    # write y anyway (dropped here)
    write_y = spec.y or launch.tier != "cached"
    row_norms.build_rows(recorder, plan, launch, spec.eps, "center" in names, "scale" in names, write_y)
    return emit(recorder, values, _rows_outputs(dataclasses.replace(spec, y=write_y)), arch)


def _rows_lowering(ctx, *args, spec: RowSpec):
    _, _, arch = target()
    out = _record_rows(spec, dict(zip(_rows_inputs(spec), args)), arch)
    return [out[name] for name in _rows_outputs(spec)]


def operand_labels(spec: RowSpec) -> dict:
    """The labels of a row norm's per-row operands and parameters: x's on
    the axes they share with x (its extent), a label of their own (never
    split) along a broadcast 1; a shard's operands then hold the rows its
    own rows read (RowSpec.localized)."""
    x = _sharding.labels(len(spec.shape))
    params = x[len(x) - spec.param_ndim:] if spec.param_ndim else x[spec.first:spec.last + 1]
    labels = {"w": params, "b": params}
    for slot, shape in spec.operands:
        labels[slot] = tuple(label if size == whole else f"o{i}"
                             for i, (label, size, whole) in enumerate(zip(x, shape, spec.shape)))
    return labels


def _rows_layout(spec: RowSpec) -> _sharding.Layout:
    """A row norm's arrays by their dimensions: the normalized axes whole."""
    x = _sharding.labels(len(spec.shape))
    norm, stats = x[spec.first:spec.last + 1], x[:spec.first] + x[spec.last + 1:]
    operands = {"x": x, "r": x, "quant_scale": _sharding.fresh(1), **operand_labels(spec)}
    results = []
    for name, (shape, _) in _rows_outputs(spec).items():
        if name == "y_scale":  # x's leading axes, then the groups of a row or size-1 axes
            results.append(x[:spec.first] + _sharding.fresh(len(shape) - spec.first, 1))
        else:
            results.append(stats if name in ("center", "scale") else x)
    return _sharding.Layout(tuple(operands[n] for n in _rows_inputs(spec)), tuple(results), frozenset(norm))


_sharding.register(rows_p, _rows_lowering, _rows_layout, lambda spec, shape: spec.localized(shape))


def _rows_dce(used_outputs, eqn):
    """jit's dead-code rule of a row norm: a call whose y nothing reads (the
    forward of jax.grad, where only the statistics reach the backward)
    becomes one that writes its other results alone."""
    if not any(used_outputs):
        return [False] * len(eqn.invars), None
    spec = eqn.params["spec"]
    names = list(_rows_outputs(spec))
    if spec.y and spec.quant is None and not spec.cond_flags and not used_outputs[names.index("y")]:
        eqn = eqn.replace(params={**eqn.params, "spec": dataclasses.replace(spec, y=False)},
                          outvars=[v for name, v in zip(names, eqn.outvars) if name != "y"])
    return [True] * len(eqn.invars), eqn


pe.dce_rules[rows_p] = _rows_dce


@dataclasses.dataclass(frozen=True)
class RowGradSpec:
    """A row norm backward's static description (RowSpec's forward)."""

    forward: RowSpec
    dh: bool = False

    def inputs(self) -> tuple:
        f = self.forward
        return ("dy", "x") + (("dh",) if self.dh else ()) + (("w",) if f.weight else ()) + tuple(
            {"center": "center", "scale": "scale"}[n] for n in f.stat_names())

    def outputs(self) -> dict:
        return _grad_outputs(self.forward, self.forward.param_shape)


rows_grad_p = _primitive("cunorm_rows_grad", lambda spec: spec.outputs())


def _rows_grad_lowering(ctx, *args, spec: RowGradSpec):
    device_id, device, arch = target()
    f = spec.forward
    outer = math.prod(f.shape[:f.first])
    reduced = math.prod(f.shape[f.first:f.last + 1])
    inner = math.prod(f.shape[f.last + 1:])
    itemsize = np.dtype(f.dtype).itemsize
    vec = plans.vector_width(itemsize, reduced if inner == 1 else inner, [], [])
    launch = dispatch_grad.choose_rows_grad(f.norm, np.dtype(f.dtype), f.pdtype, f.flags & plans.PARAM_FLAGS,
                                            outer, reduced, inner, vec, device, cooperative=False,
                                            heads=f.param_rows)
    if launch is None:  # (parameters per head over rows the cached tier does not take: the wrappers compose)
        raise RuntimeError(f"cunorm inside jit: no backward for {f}")
    for step in launch.steps:
        launches.check_limits(step, device)
    names = set(spec.inputs())
    present = ("dh" in names, f.weight, "center" in names, "scale" in names, f.weight, f.bias)
    recorder = launches.LaunchRecorder(gradients.ROW_GRAD_SLOTS, device_id)
    gradients.build_rows_grad(recorder, launch, np.dtype(f.dtype), f.pdtype, outer, reduced, inner, f.eps, present,
                              f.param_rows)
    out = emit(recorder, dict(zip(spec.inputs(), args)), spec.outputs(), arch)
    return [out[name] for name in spec.outputs()]


def _rows_grad_layout(spec: RowGradSpec) -> _sharding.Layout:
    """The backward's: dweight and dbias summed across the shards of the
    other axes (per-head parameters split with their heads)."""
    f = spec.forward
    x = _sharding.labels(len(f.shape))
    norm, stats = x[f.first:f.last + 1], x[:f.first] + x[f.last + 1:]
    params = operand_labels(f)["w"]  # (the normalized axes; per head, the heads' too: split with them)
    operands = {"dy": x, "x": x, "dh": x, "w": params, "center": stats, "scale": stats}
    outputs = list(spec.outputs())
    return _sharding.Layout(tuple(operands[n] for n in spec.inputs()),
                            tuple(x if n == "dx" else params for n in outputs), frozenset(norm),
                            frozenset(i for i, n in enumerate(outputs) if n != "dx"))


_sharding.register(rows_grad_p, _rows_grad_lowering, _rows_grad_layout,
                   lambda spec, shape: RowGradSpec(spec.forward.localized(shape), spec.dh))


@dataclasses.dataclass(frozen=True)
class ChannelSpec:
    """A channel norm's static description: x dense (N, C, ...) or, channels
    last, (N, ..., C); groups; which parameters and running buffers it has;
    training; whether it returns the statistics; the activation's FLAGS
    bits (the forward's only)."""

    norm: str
    shape: tuple
    dtype: np.dtype
    channels_last: bool
    groups: int
    eps: float
    momentum: float = 0.1
    training: bool = True
    weight: bool = False
    bias: bool = False
    pdtype: np.dtype | None = None
    running: bool = False
    stats: bool = False
    epilogue: int = 0

    @property
    def per_sample(self) -> bool:
        """Whether the statistic groups lie within one sample (the table of
        ops: not BatchNorm's)."""
        return ops.BY_NORM[self.norm].per_sample

    @property
    def flags(self) -> int:
        return (plans.FLAG_WEIGHT if self.weight else 0) | (plans.FLAG_BIAS if self.bias else 0) | self.epilogue

    @property
    def channels(self) -> int:
        return self.shape[-1 if self.channels_last else 1]

    @property
    def stats_shape(self) -> tuple:
        return channel_norms.stats_shape(self.norm, self.shape, len(self.shape) - 1 if self.channels_last else 1,
                                         self.groups)

    def inputs(self) -> tuple:
        return ("x",) + (("w",) if self.weight else ()) + (("b",) if self.bias else ()) + (
            ("running_mean", "running_var") if self.running else ())

    def outputs(self) -> dict:
        acc = dtypes.accumulation(self.dtype)
        out = {"y": (self.shape, self.dtype)}
        if self.stats:
            out.update(mean=(self.stats_shape, acc), rstd=(self.stats_shape, acc))
        if self.running and self.training:
            out.update(running_mean=((self.channels,), acc), running_var=((self.channels,), acc))
        return out


channels_p = _primitive("cunorm_channels", lambda spec: spec.outputs())


def _channels_lowering(ctx, *args, spec: ChannelSpec):
    device_id, _, arch = target()
    batch, channels = spec.shape[0], spec.channels
    spatial = math.prod(spec.shape) // (batch * channels)
    from_running = spec.norm == "batch" and not spec.training
    # the stream walk waits on other blocks: the jit path takes the three launches
    walk = {} if from_running else {"walk": "split"} if _walk(spec, device_id) == "stream" else {}
    plan, launch = channel_norms._planned(spec.norm, np.dtype(spec.dtype), spec.pdtype, spec.flags, spec.channels_last,
                                          batch, channels, spatial, channels // spec.groups, spec.per_sample, 0, 0,
                                          from_running, spec.stats, device_id, tuple(walk.items()))
    values = dict(zip(spec.inputs(), args))
    outputs = spec.outputs()
    if launch is None:  # a LayerNorm over each group's contiguous row (no parameters)
        rows = plan.statistic_groups
        row_spec = RowSpec("ln", (rows, math.prod(spec.shape) // rows), spec.dtype, 1, 1, spec.eps,
                           stats=spec.stats, epilogue=spec.epilogue)
        out = _record_rows(row_spec, {"x": values["x"]}, arch)
        renamed = {"y": out["y"]}
        if spec.stats:
            renamed.update(mean=out["center"], rstd=out["scale"])
        # the rows' shapes back to the channel norm's: (rows, n) -> x's, (rows,) -> the statistics'
        return [mlir.reshape(ctx, renamed[name], ShapedArray(*outputs[name])) for name in outputs]
    recorder = launches.LaunchRecorder(channel_norms.CHANNEL_SLOTS, device_id)
    channel_norms.build_channels(recorder, plan, launch, from_running, spec.eps, spec.momentum, spec.stats,
                                 (spec.running, spec.running))
    out = emit(recorder, values, outputs, arch)
    return [out[name] for name in outputs]


def _walk(spec: ChannelSpec, device_id: int) -> str | None:
    plan = plans.make_channel_plan(spec.norm, np.dtype(spec.dtype), spec.pdtype, spec.flags, spec.channels_last,
                                   spec.shape[0], spec.channels,
                                   math.prod(spec.shape) // (spec.shape[0] * spec.channels),
                                   spec.channels // spec.groups, spec.per_sample, 0, 0)
    from .._engine import dispatch_channels

    return dispatch_channels.choose_channel_walk(plan, launches.device_info(device_id))


def _channel_labels(spec: ChannelSpec):
    """(x's labels, the channel axis', the statistics', the labels kept
    whole: all but the batch's for per-sample statistics, all for
    BatchNorm's)."""
    x = _sharding.labels(len(spec.shape))
    c = x[-1] if spec.channels_last else x[1]
    stats = {"group": (x[0],) + _sharding.fresh(1), "instance": (x[0], c), "batch": (c,)}[spec.norm]
    return x, c, stats, frozenset(x[1:] if spec.per_sample else x)


def _channels_layout(spec: ChannelSpec) -> _sharding.Layout:
    x, c, stats, whole = _channel_labels(spec)
    labelled = {"x": x, "y": x, "mean": stats, "rstd": stats}
    return _sharding.Layout(tuple(labelled.get(n, (c,)) for n in spec.inputs()),
                            tuple(labelled.get(n, (c,)) for n in spec.outputs()), whole)


_sharding.register(channels_p, _channels_lowering, _channels_layout,
                   lambda spec, shape: dataclasses.replace(spec, shape=shape))


@dataclasses.dataclass(frozen=True)
class ChannelGradSpec:
    forward: ChannelSpec

    def inputs(self) -> tuple:
        return ("dy", "x", "mean", "rstd") + (("w",) if self.forward.weight else ())

    def outputs(self) -> dict:
        return _grad_outputs(self.forward, (self.forward.channels,))


channels_grad_p = _primitive("cunorm_channels_grad", lambda spec: spec.outputs())


def _channels_grad_lowering(ctx, *args, spec: ChannelGradSpec):
    device_id, device, arch = target()
    f = spec.forward
    batch, channels = f.shape[0], f.channels
    spatial = math.prod(f.shape) // (batch * channels)
    plan = plans.make_channel_plan(f.norm, np.dtype(f.dtype), f.pdtype, f.flags & plans.PARAM_FLAGS, f.channels_last,
                                   batch, channels, spatial, channels // f.groups, f.per_sample, 0, 0)
    launch = gradients._channel_launch(plan, f.training, device_id)
    recorder = launches.LaunchRecorder(gradients.CHANNEL_GRAD_SLOTS, device_id)
    gradients.build_channel_grad(recorder, plan, launch)
    out = emit(recorder, dict(zip(spec.inputs(), args)), spec.outputs(), arch)
    return [out[name] for name in spec.outputs()]


def _channels_grad_layout(spec: ChannelGradSpec) -> _sharding.Layout:
    x, c, stats, whole = _channel_labels(spec.forward)
    labelled = {"dy": x, "x": x, "dx": x, "mean": stats, "rstd": stats}
    outputs = list(spec.outputs())
    return _sharding.Layout(tuple(labelled.get(n, (c,)) for n in spec.inputs()),
                            tuple(labelled.get(n, (c,)) for n in outputs), whole,
                            frozenset(i for i, n in enumerate(outputs) if n != "dx"))


_sharding.register(channels_grad_p, _channels_grad_lowering, _channels_grad_layout,
                   lambda spec, shape: ChannelGradSpec(dataclasses.replace(spec.forward, shape=shape)))


# --- vmap: the mapped axis folded into the rows or the samples ----------------------


_UNMAPPED = None  # a batching rule's dimension of an operand vmap does not map


def _moved(args, dims):
    return [a if d is _UNMAPPED else jax.numpy.moveaxis(a, d, 0) for a, d in zip(args, dims)]


def _unrolled(prim, args, dims, **params):
    """The fallback batching: one call per mapped index, stacked."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not _UNMAPPED)
    moved = _moved(args, dims)
    outs = [prim.bind(*[a if d is _UNMAPPED else a[i] for a, d in zip(moved, dims)], **params)
            for i in range(size)]
    return [jax.numpy.stack(o) for o in zip(*outs)], [0] * len(outs[0])


def register_unbatched(prim, lowering, layout_of, localize) -> None:
    """_sharding.register of a fused backward's primitive, batched by
    _unrolled (one call per mapped index)."""
    _sharding.register(prim, lowering, layout_of, localize)
    batching.primitive_batchers[prim] = lambda args, dims, *, spec: _unrolled(prim, args, dims, spec=spec)


def _fold(spec, shape):
    return dataclasses.replace(spec, shape=shape)


def _rows_batch(args, dims, *, spec: RowSpec):
    names = _rows_inputs(spec)
    mapped = {n for n, d in zip(names, dims) if d is not _UNMAPPED}
    if mapped - {"x", "r"} or spec.cond_flags:  # (per-row operands: read by row, not folded)
        return _unrolled(rows_p, args, dims, spec=spec)
    moved = _moved(args, dims)
    size = next(a.shape[0] for a, d in zip(moved, dims) if d is not _UNMAPPED)
    moved = [jax.numpy.broadcast_to(a, (size,) + a.shape) if n in ("x", "r") and d is _UNMAPPED else a
             for a, n, d in zip(moved, names, dims)]
    folded = dataclasses.replace(spec, shape=(size,) + spec.shape, first=spec.first + 1, last=spec.last + 1)
    return rows_p.bind(*moved, spec=folded), [0] * len(_rows_outputs(spec))


def _rows_grad_batch(args, dims, *, spec: RowGradSpec):
    f = spec.forward
    if f.weight or f.bias:  # dweight / dbias of each mapped index: its own sums
        return _unrolled(rows_grad_p, args, dims, spec=spec)
    moved = _moved(args, dims)
    size = next(a.shape[0] for a, d in zip(moved, dims) if d is not _UNMAPPED)
    moved = [jax.numpy.broadcast_to(a, (size,) + a.shape) if d is _UNMAPPED else a
             for a, d in zip(moved, dims)]
    folded = RowGradSpec(dataclasses.replace(f, shape=(size,) + f.shape, first=f.first + 1, last=f.last + 1),
                         spec.dh)
    return list(rows_grad_p.bind(*moved, spec=folded)), [0]


def _channels_batch(args, dims, *, spec: ChannelSpec):
    names = spec.inputs()
    mapped = {n for n, d in zip(names, dims) if d is not _UNMAPPED}
    if not spec.per_sample or mapped != {"x"}:
        return _unrolled(channels_p, args, dims, spec=spec)
    x = jax.numpy.moveaxis(args[0], dims[0], 0)
    size = x.shape[0]
    folded = _fold(spec, (size * spec.shape[0],) + spec.shape[1:])
    outs = channels_p.bind(x.reshape(folded.shape), *args[1:], spec=folded)
    shapes = [(size,) + s for s, _ in spec.outputs().values()]
    return [o.reshape(s) for o, s in zip(outs, shapes)], [0] * len(outs)


def _channels_grad_batch(args, dims, *, spec: ChannelGradSpec):
    f = spec.forward
    names = spec.inputs()
    mapped = {n for n, d in zip(names, dims) if d is not _UNMAPPED}
    if not f.per_sample or f.weight or "w" in mapped:
        return _unrolled(channels_grad_p, args, dims, spec=spec)
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not _UNMAPPED)
    moved = [jax.numpy.broadcast_to(a, (size,) + a.shape) if d is _UNMAPPED else a
             for a, d in zip(_moved(args, dims), dims)]
    folded = ChannelGradSpec(_fold(f, (size * f.shape[0],) + f.shape[1:]))
    flat = [a.reshape((size * a.shape[1],) + a.shape[2:]) for a in moved]
    outs = channels_grad_p.bind(*flat, spec=folded)
    return [outs[0].reshape((size,) + f.shape)], [0]


batching.primitive_batchers[rows_p] = _rows_batch
batching.primitive_batchers[rows_grad_p] = _rows_grad_batch
batching.primitive_batchers[channels_p] = _channels_batch
batching.primitive_batchers[channels_grad_p] = _channels_grad_batch
