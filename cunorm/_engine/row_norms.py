"""The shared path of every public op: validate, plan, launch.

The plan, launch and Program (cunorm/_engine/launches.py) of a layout are computed
once and memoized; a call whose whole signature was seen before skips this
module altogether (cunorm/_engine/launch_cache.py).
"""
from __future__ import annotations

import functools
import math
import numbers

import numpy as np

from . import conditioning, dispatch_rows, dtypes, launch_cache, launches, ops, plans, quantize
# (the overlap checks live in overlap.py; the other modules find them here)
from .overlap import _overlaps, _same_view, check_writable, first_overlap, refuse_jax  # noqa: F401
from .. import _interop



def lp_norm_name(p) -> str:
    """The norm name of the Lp norm for p (validated)."""
    if isinstance(p, (bool, np.bool_)) or not isinstance(p, numbers.Real):
        raise TypeError(f"p must be a positive real number or inf, got {type(p).__name__}")
    value = float(p)
    if math.isnan(value) or value <= 0:
        raise ValueError(f"p must be > 0 (or inf), got {p!r}")
    if value == 1.0:
        return "l1"
    if value == 2.0:
        return "l2"
    if value == math.inf:
        return "linf"
    return dispatch_rows.power_norm_name(value)


def check_eps(eps, dtype=None) -> float:
    """eps as a float, finite and >= 0. With x's ``dtype``: also as the
    statistics hold it (float32 but for float64 x): an eps the float32 cast
    would make inf (above ~3.4e38) or 0 (a positive eps below ~1.4e-45) is
    refused, on every path alike (the NumPy reference computes in float64
    and would not round it)."""
    if type(eps) is float and 0.0 <= eps < math.inf:
        value = eps
    else:
        if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, numbers.Real):
            raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
        value = float(eps)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"eps must be finite and >= 0, got {eps!r}")
    # (two comparisons first: the common eps never reaches NumPy's cast)
    if (value >= _F32_ROUNDS_TO_INF or 0 < value <= _F32_ROUNDS_TO_ZERO) and dtype is not None \
            and np.dtype(dtype) != np.float64:
        held = float("inf") if value >= _F32_ROUNDS_TO_INF else 0.0
        raise ValueError(f"eps {eps!r} does not survive the cast to float32, the statistics' dtype for "
                         f"{np.dtype(dtype).name} x (it becomes {held!r}): pass an eps float32 can hold")
    return value


#: float32's round-to-nearest: from halfway past its largest finite value a
#: float64 rounds to inf; at or below half its smallest subnormal, to 0
_F32_ROUNDS_TO_INF = 2.0**128 - 2.0**103
_F32_ROUNDS_TO_ZERO = 2.0**-150


def check_flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_int(value, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def check_out_dtype(out_dtype, x_dtype) -> None:
    """The internal float32-output form (norms._layer_norm_float32,
    _group_norm_float32) is for 16-bit x only."""
    if out_dtype is not None and x_dtype.itemsize != 2:
        raise TypeError(f"a float32 result is for float16 or bfloat16 x, got {x_dtype}")


def check_dtype(dtype, name: str) -> np.dtype:
    if dtype not in dtypes.KERNEL_TYPE:
        raise TypeError(f"{name} must have dtype {dtypes.SUPPORTED_NAMES}, got {dtype}")
    return dtype


class Call:
    """A validated call of a normalization: x, the normalized axes, the affine
    parameters, the residual, eps and out, each checked against x."""

    __slots__ = ("norm", "adapter", "x", "first", "last", "norm_shape", "weight", "bias", "residual", "eps", "out",
                 "out_given", "return_stats", "epilogue", "out_dtype", "quant", "quant_scale", "cond")

    def __init__(self, norm, x, axis, eps, out, *, weight=None, bias=None, residual=None, return_stats=False,
                 epilogue=0, out_dtype=None, quant=None, quant_scale=None, quant_scale_ub=None, quant_group=None,
                 quant_scale_layout=None, return_unquantized=False, conditioned=None):
        self.norm = norm
        self.epilogue = epilogue  # the epilogue's FLAGS bits (plans: rounding, weight offset, activation)
        # y's dtype where it is not x's (cunorm's layers under autocast: float32
        # from 16-bit x); internal, without out= or a residual
        self.out_dtype = out_dtype
        adapter = _interop.adapter_for(x, "x")
        self.adapter = adapter
        xa = x if adapter is _interop.NUMPY else adapter.to_cupy(x, "x")
        check_dtype(xa.dtype, "x")
        check_out_dtype(out_dtype, xa.dtype)
        self.first, self.last = axis_span(axis, xa.ndim)
        self.norm_shape = tuple(xa.shape[self.first : self.last + 1])
        self.x = xa
        self.weight = self._param(weight, "weight")
        self.bias = self._param(bias, "bias")
        self.residual = self._residual(residual)
        # per-head weights, shift=, scale=, residual_gate= (conditioning.py)
        given = {}
        for name, a in (conditioned or {}).items():
            if a is not None:
                a = self._same_kind(a, name)
                check_dtype(a.dtype, name)
            given[name] = a
        self.cond = conditioning.check(self, given)
        if self.residual is not None and conditioning.check_wide(
                xa.dtype, self.residual.dtype, xa.itemsize, self.residual.dtype == dtypes.float32, self.last,
                xa.ndim, self.cond.residual_gate is not None):
            self.cond.flags |= plans.FLAG_WIDE_RESIDUAL  # (the float32 residual stream)
        if self.cond.flags and (quant is not None or out_dtype is not None):
            raise ValueError(conditioning.NOT_QUANTIZED)
        self.eps = check_eps(eps, xa.dtype)
        self.out_given = out
        self.out = None if out is None else self._out(out)
        self.return_stats = check_flag(return_stats, "return_stats")
        # quantize= (quantize.py): the request, and the static scale or the bound as x's kind of array
        self.quant = quantize.check(quant, quant_scale, quant_scale_ub, xa.dtype, quant_group, quant_scale_layout,
                                    return_unquantized)
        self.quant_scale = None
        if self.quant is not None:
            if self.last != xa.ndim - 1:
                raise ValueError(f"quantize= normalizes over the trailing axes (rows), got axis {axis!r} of a "
                                 f"{xa.ndim}-d x")
            quantize.check_extent(self.quant, math.prod(self.norm_shape))
            if self.quant.layout != quantize.ROW_MAJOR and getattr(adapter, "name", None) == "jax":
                raise ValueError(f"quant_scale_layout={self.quant.layout!r} is a strided view, which JAX arrays "
                                 "cannot be: take the row-major scales and transpose them")
            if out is not None:
                raise ValueError("out= is for y in x's dtype; a quantized y comes back as a new array")
            given, name = (quant_scale, "quant_scale") if quant_scale is not None else (quant_scale_ub,
                                                                                        "quant_scale_ub")
            if given is not None:
                self.quant_scale = self._same_kind(given, name)
                quantize.check_scale_array(self.quant_scale, name)

    def _same_kind(self, a, name: str):
        """``a`` as the same kind of array as x (NumPy with NumPy, GPU with GPU)."""
        adapter = _interop.adapter_for(a, name)
        if (adapter is _interop.NUMPY) != (self.adapter is _interop.NUMPY):
            where = "a NumPy array" if adapter is _interop.NUMPY else "a GPU array"
            want = "NumPy" if self.adapter is _interop.NUMPY else "GPU"
            raise TypeError(f"{name} is {where} but x is a {want} array: pass both on the same side")
        if adapter is _interop.NUMPY:
            return a
        ac = adapter.to_cupy(a, name)
        if ac.data.device_id != self.x.data.device_id:
            raise ValueError(f"{name} is on GPU {ac.data.device_id} but x is on GPU {self.x.data.device_id}: "
                             f"move it to x's GPU (torch: {name}.to(x.device); CuPy: cupy.asarray({name}) "
                             f"under `with cupy.cuda.Device({self.x.data.device_id})`)")
        return ac

    def _param(self, p, name: str):
        if p is None:
            return None
        pa = self._same_kind(p, name)
        check_dtype(pa.dtype, name)
        if tuple(pa.shape) != self.norm_shape:  # (or per-head: more of x's trailing axes)
            conditioning.param_rows(name, tuple(pa.shape), tuple(self.x.shape), self.norm_shape, self.last)
        return pa

    def _residual(self, r):
        if r is None:
            return None
        ra = self._same_kind(r, "residual")
        if tuple(ra.shape) != tuple(self.x.shape):
            raise ValueError(f"residual must have x's shape {tuple(self.x.shape)}, got {tuple(ra.shape)}")
        check_dtype(ra.dtype, "residual")  # (x's, or float32 under 16-bit x: conditioning.check_wide)
        return ra

    def _out(self, out):
        check_writable(out, "out")
        oa = self._same_kind(out, "out")
        if tuple(oa.shape) != tuple(self.x.shape) or oa.dtype != self.x.dtype:
            raise ValueError(
                f"out must have x's shape {tuple(self.x.shape)} and dtype {self.x.dtype}, "
                f"got shape {tuple(oa.shape)} and dtype {oa.dtype}"
            )
        if not oa.flags.c_contiguous:
            raise ValueError("out must be C-contiguous")
        read = [(self.residual, "residual"), (self.weight, "weight"), (self.bias, "bias")]
        read += [(a, name) for name, a in self.cond.arrays.items()]
        if not _same_view(oa, self.x):  # (out may be x itself: in place)
            read.insert(0, (self.x, "x"))
        name = first_overlap(oa, *read)  # (every path alike)
        if name is not None:
            raise ValueError(f"out overlaps {name}; pass a separate buffer (out may be x itself, for in place)")
        return oa

    @property
    def on_gpu(self) -> bool:
        return self.adapter is not _interop.NUMPY

    @property
    def stats_shape(self) -> tuple:
        return stats_shape(tuple(self.x.shape), self.first, self.last)


def axis_span(axis, ndim: int) -> tuple[int, int]:
    """(first, last) of the normalized axes: ``axis`` an int or adjacent
    ints, or None for every axis (the Lp norms' whole-array form)."""
    if axis is None:
        if ndim == 0:
            raise ValueError("x must have at least one dimension, got a 0-d array")
        return 0, ndim - 1
    return plans.normalize_axes(axis, ndim)


def stats_shape(shape: tuple, first: int, last: int) -> tuple:
    """The statistics' shape: x's without the normalized axes."""
    return shape[:first] + shape[last + 1 :]


def run(call: Call, reference, key=None, y_shape=None):
    """Compute the call's norm; return y (then h, then the statistics) as the
    caller's array type. ``key``: the call's signature in the launch cache
    (cunorm/_engine/launch_cache.py), which gets an entry when the call ran without copies;
    ``y_shape``: the shape the entry returns y and h in where it is not x's
    (a call over grouped views: the caller's arrays are x's memory)."""
    if call.quant is not None and not call.on_gpu:
        return quantize.reference_results(call, reference, reference_arguments(call))
    if not call.on_gpu:
        if not call.x.size:
            return empty_results(call, 1 + (call.residual is not None), len(ops.statistics_of(call.norm)))
        results = reference(call.x, **reference_arguments(call))
        if call.out_dtype is not None:
            results = _with_y(results, lambda y: y.astype(call.out_dtype))
        if call.out is None:
            return results
        first = results[0] if isinstance(results, tuple) else results
        call.out[...] = first
        return (call.out_given,) + results[1:] if isinstance(results, tuple) else call.out_given

    with call.adapter.scope(call.x.data.device_id):
        results, program = _run_gpu(call)
    if key is not None and program is not None:
        launch_cache.ROWS.put(key, _rows_entry(call, program, y_shape))
    return results


def reference_arguments(call: Call) -> dict:
    """The keyword arguments of the call's reference function: what its op
    takes (ops.OPS: parameters, residual, statistics, the epilogue's
    options) from the validated call."""
    op = ops.BY_NORM.get(call.norm)
    kwargs = {"axis": tuple(range(call.first, call.last + 1)), "eps": call.eps}
    if call.quant is not None:
        kwargs["exact"] = True  # (y before any rounding: quantize.reference_results quantizes it)
    if op is None:  # (the Lp family: x, axis, eps)
        return kwargs
    kwargs.update((name, getattr(call, name)) for name in op.params)
    if op.residual:
        kwargs["residual"] = call.residual
    if op.statistics:
        kwargs["return_stats"] = call.return_stats
    if "activation" in op.options:
        kwargs["activation"] = plans.activation_name(call.epilogue)
    if "weight_offset" in op.options:
        kwargs["weight_offset"] = int(bool(call.epilogue & plans.FLAG_WEIGHT_OFFSET))
    if "rounding" in op.options:
        kwargs["rounding"] = "normalized" if call.epilogue & plans.FLAG_ROUND_NORMALIZED else "output"
    if op.conditioned:
        kwargs.update(call.cond.arrays)
        if call.cond.gate is not None:
            kwargs["norm_before_gate"] = not call.epilogue & plans.FLAG_GATE_INPUT
    return kwargs


def empty_results(call, arrays: int, stats: int):
    """The NumPy results of a call whose x has no elements: y (into out
    where given), h where there is a residual (``arrays`` 2), and the
    statistics where asked for, NaN (the mean of nothing, as NumPy's) where
    they have entries; nothing is computed or updated."""
    y = np.empty(call.x.shape, call.out_dtype or call.x.dtype) if call.out is None else call.out_given
    results = [y]
    if arrays > 1:  # h, in the residual's dtype
        results.append(np.empty(call.x.shape, call.residual.dtype))
    if call.return_stats:
        results += [np.full(call.stats_shape, np.nan, dtypes.accumulation(call.x.dtype)) for _ in range(stats)]
    return results[0] if len(results) == 1 else tuple(results)


def _with_y(results, change):
    """results with y (the first, or the only one) changed."""
    return (change(results[0]),) + tuple(results[1:]) if isinstance(results, tuple) else change(results)


def _rows_entry(call: Call, program, y_shape=None) -> launch_cache.Entry:
    """The launch cache's entry of a row norm's call that ran ``program``
    over its arrays as given; called as entry(x, weight, bias, residual),
    and with quantize= entry(x, weight, bias, residual, scale, bound).
    ``y_shape``: y's and h's shape where not x's (run)."""
    x = call.x
    acc = dtypes.accumulation(x.dtype)
    quant = call.quant
    shape = x.shape if y_shape is None else y_shape
    if quant is None:
        outputs = {"y": (shape, x.dtype if call.out_dtype is None else call.out_dtype, None)}
    else:
        outputs = quantize.cached_outputs(call)
    if call.residual is not None:
        outputs["h"] = (shape, call.residual.dtype, None)
    if call.return_stats:
        for name in ops.statistics_of(call.norm):
            outputs[name] = (call.stats_shape, acc, None)
    present = lambda name, a: None if a is None else name  # noqa: E731
    slots = {"x": "x", "r": present("r", call.residual), "y": "y", "h": present("h", call.residual),
             "w": present("w", call.weight), "b": present("b", call.bias), "center": outputs.get("mean") and "mean",
             "scale": outputs.get("rstd") and "rstd", "y_scale": outputs.get("y_scale") and "y_scale",
             "y_plain": outputs.get("y_plain") and "y_plain"}
    inputs = ("x", "w", "b", "r")
    if quant is not None:  # (the launcher takes both arrays; the kernel reads the one given)
        inputs += ("scale", "bound")
        slots["quant_scale"] = {quantize.STATIC: "scale", quantize.ROW_BOUNDED: "bound"}.get(quant.scaling)
    if call.cond.arrays:  # (called as launcher(x, w, b, r, shift, scale, residual_gate))
        inputs += conditioning.OPERAND_NAMES
        slots.update((slot, present(name, getattr(call.cond, name)))
                     for slot, name in zip(CONDITIONED_SLOTS, conditioning.OPERAND_NAMES))
    return launch_cache.entry(call.adapter, x.data.device_id, program, inputs, outputs, slots, tuple(outputs),
                              arrays={"x": x})


def _run_gpu(call: Call):
    """The call's launches; returns (results, program) where program is the
    Program that ran when nothing had to be copied or cast first (the
    launch cache may then replay it for the same signature), else None."""
    import cupy

    x = call.x
    quant = call.quant
    if quant is not None:
        y, y_scale, y_plain = quantize.empty_results(cupy, call)
    else:
        y_scale = y_plain = None
        y = call.out if call.out is not None else cupy.empty(x.shape, dtype=call.out_dtype or x.dtype)
    h = None if call.residual is None else cupy.empty(x.shape, dtype=call.residual.dtype)
    stats = []
    if call.return_stats:
        acc = dtypes.accumulation(x.dtype)
        stats = [cupy.empty(call.stats_shape, dtype=acc) for _ in ops.statistics_of(call.norm)]
        if not x.size:  # statistics over no elements (empty_results)
            for s in stats:
                s.fill(np.nan)
    program = None
    if x.size:
        cond = call.cond
        _, pdtype = kernel_params(x.dtype, call.weight, call.bias, conditioning.dtypes_of(cond))
        w, b = _as_param(call.weight, pdtype), _as_param(call.bias, pdtype)
        x, r, w, b = quantize.aligned_for_groups(quant, x, call.residual, w, b)
        named = dict(zip(ops.statistics_of(call.norm), stats))
        center, scale = named.get("mean"), named.get("rstd")
        extra = dict(quant_scale=call.quant_scale, y_scale=y_scale, y_plain=y_plain)
        operands = conditioning.kernel_rows(cond, tuple(x.shape), call.first, pdtype) if cond.flags else {}
        extra.update(operands)
        _, _, program = _launch_rows(call.norm, x, y, w=w, b=b, r=r, h=h, center=center, scale=scale,
                                     first=call.first, last=call.last, eps=call.eps,
                                     epilogue=call.epilogue | cond.flags, out_dtype=call.out_dtype, quant=quant,
                                     quant_arrays=extra, conditioning=cond.rows)
        copied = w is not call.weight or b is not call.bias or x is not call.x or r is not call.residual
        # (the per-row operands' rows are the given arrays' memory unless cast or broadcast out)
        copied = copied or any(operands[slot].data.ptr != given.data.ptr for slot, given in zip(
            CONDITIONED_SLOTS, cond.arrays_in_order) if given is not None)
        if copied or call.out is not None:
            program = None
    out = call.adapter.from_cupy
    results = [call.out_given if call.out is not None else out(y)]
    if quant is not None:
        results = [call.adapter.view_bits(results[0], quant.format.name)]
        results += [out(a) for a in (y_scale, y_plain) if a is not None]
    if h is not None:
        results.append(out(h))
    results += [out(s) for s in stats]
    return (results[0] if len(results) == 1 else tuple(results)), program


def kernel_params(x_dtype, w, b, operands=()) -> tuple[int, np.dtype | None]:
    """(flags, dtype) of the affine parameters as the kernels read them:
    which are present (FLAG_WEIGHT | FLAG_BIAS) and the one storage dtype
    (dtypes.param_storage; None without parameters) of them and of the
    ``operands``' dtypes (shift, scale and residual gate: stored alike).
    Callers cast what they read with _as_param."""
    flags = (plans.FLAG_WEIGHT if w is not None else 0) | (plans.FLAG_BIAS if b is not None else 0)
    kinds = [p.dtype for p in (w, b) if p is not None] + list(operands)
    if not kinds:
        return 0, None
    return flags, dtypes.param_storage(x_dtype, kinds)


def _as_param(p, dtype):
    """A weight, bias or running buffer as the kernels read it: contiguous,
    in ``dtype`` (copied only when it is not already)."""
    if p is None or (p.dtype == dtype and p.flags.c_contiguous):
        return p
    import cupy

    return cupy.ascontiguousarray(p, dtype=dtype)


@functools.lru_cache(maxsize=4096)
def _planned(*key):
    return _plan_and_choose(key, None)


def _plan_and_choose(key, override):
    """(plan, launch) for a call's key; launch is None when x must be copied
    first (no plan) or when a residual over a strided axis is formed
    unfused first."""
    plan = plans.make_plan(*key[:-1])
    if plan is None or (plan.residual and not plan.contiguous_rows):
        return plan, None
    device = launches.device_info(key[-1])
    launch = dispatch_rows.choose(plan, device, override=override)
    if launch is None:  # y in another dtype, which this tier does not write
        return plan, None
    for step in launch.steps:
        launches.check_limits(step, device)
    return plan, launch


def _mod32(a):
    return 0 if a is None else a.data.ptr % 32


def launch_on(norm, x, y, *, w=None, b=None, r=None, h=None, center=None, scale=None, first, last, eps,
              override=None, epilogue=0):
    """Plan and launch ``norm`` over CuPy arrays: y (and h, center, scale)
    C-contiguous; w and b contiguous, of one dtype; r of x's layout or it is
    made so. Returns (plan, launch) of the normalization."""
    plan, launch, _ = _launch_rows(norm, x, y, w=w, b=b, r=r, h=h, center=center, scale=scale, first=first,
                                   last=last, eps=eps, override=override, epilogue=epilogue)
    return plan, launch


def _launch_rows(norm, x, y, *, w=None, b=None, r=None, h=None, center=None, scale=None, first, last, eps,
                 override=None, epilogue=0, out_dtype=None, quant=None, quant_arrays=None, conditioning=()):
    """launch_on, returning (plan, launch, program): program is the Program
    that ran over the arrays as given, None when x or r was copied or h
    formed unfused first. ``epilogue``: the epilogue's FLAGS bits.
    ``out_dtype``: y's dtype where it is not x's (no residual); where
    rows_cached does not take the call, x is cast to it first. ``quant``
    and ``quant_arrays``: quantize='s request and its slots' arrays.

    What the kernels do not take is prepared in a fixed sequence, each step
    at most once: x and r brought to one layout (C-contiguous copies), x
    cast to y's dtype, x copied C-contiguous, h formed unfused for a
    strided axis. Nothing re-enters, so nothing can loop."""
    import cupy

    flags = (plans.FLAG_WEIGHT if w is not None else 0) | (plans.FLAG_BIAS if b is not None else 0)
    flags |= epilogue
    operands = [(quant_arrays or {}).get(slot) for slot in CONDITIONED_SLOTS]
    gate = operands.pop()  # (the gate z is x's dtype; the others are stored as the parameters)
    stored = [a for a in [w, b] + operands if a is not None]
    pdtype = stored[0].dtype if stored and flags & plans.OPERAND_FLAGS else None

    def plan_for(x, r, h, out_dtype):
        mixed = out_dtype if out_dtype is not None and out_dtype != x.dtype else None
        itemsize = x.itemsize
        strides = tuple([s // itemsize for s in plans.canonical_strides(x.shape, x.strides, itemsize)])
        key = (norm, x.dtype, pdtype, flags, r is not None, x.shape, strides, first, last, x.data.ptr % 32,
               y.data.ptr % 32, _mod32(r), _mod32(h), _mod32(w), _mod32(b), mixed,
               None if quant is None else quant.key, conditioning, tuple(_mod32(a) for a in operands), _mod32(gate),
               x.data.device_id)
        return (_planned(*key) if override is None else _plan_and_choose(key, override)) + (mixed,)

    given = (x, r)
    # (in elements: a float32 residual under 16-bit x has strides of twice the bytes)
    if r is not None and not plans.same_layout(x.shape, [s // r.itemsize for s in r.strides],
                                               [s // x.itemsize for s in x.strides]):
        x, r = cupy.ascontiguousarray(x), cupy.ascontiguousarray(r)
    plan, launch, mixed = plan_for(x, r, h, out_dtype)
    if mixed is not None and (plan is None or launch is None):  # rows_cached does not take it: cast x first
        x, out_dtype = x.astype(mixed, order="C"), None
        plan, launch, mixed = plan_for(x, r, h, out_dtype)
    if plan is None:  # a layout the kernels do not walk: one contiguous copy
        x, r = cupy.ascontiguousarray(x), None if r is None else cupy.ascontiguousarray(r)
        plan, launch, mixed = plan_for(x, r, h, out_dtype)
    if r is not None and not plan.contiguous_rows:
        # A strided axis: form h with one elementwise pass, then normalize h.
        _residual_add(cupy.ascontiguousarray(x), cupy.ascontiguousarray(r), h)
        x, r, h = h, None, None
        plan, launch, mixed = plan_for(x, r, h, out_dtype)
    if (plan is None or launch is None) and flags & plans.CONDITIONED_FLAGS:
        raise ValueError(f"per-head weights, shift=, scale=, residual_gate=, gate= and a float32 residual under "
                         f"16-bit x run where a row fits in one block's registers (rows_cached); a row of "
                         f"{plan.reduced if plan else '?'} {np.dtype(x.dtype).name} elements does not")
    if plan is None or launch is None:
        raise RuntimeError(f"cunorm: no {norm} launch for x of shape {x.shape} and strides {x.strides}")
    program = rows_program(plan, launch, float(eps), center is not None, scale is not None, x.data.device_id)
    program.run_named({"x": x, "r": r, "y": y, "h": h, "w": w, "b": b, "center": center, "scale": scale,
                       **(quant_arrays or {})}, launches.cupy_stream(), launches.cupy_alloc)
    return plan, launch, program if x is given[0] and r is given[1] else None


def _residual_add(x, r, h):
    vec = plans.vector_width(x.itemsize, x.size, [], [(x.data.ptr, x.itemsize), (r.data.ptr, x.itemsize),
                                                      (h.data.ptr, x.itemsize)])
    program = _residual_add_program(x.dtype, x.size // vec, vec, x.data.device_id)
    program.run((x.data.ptr, r.data.ptr, h.data.ptr), launches.cupy_stream())


@functools.lru_cache(maxsize=256)
def _residual_add_program(dtype, n_vec: int, vec: int, device: int) -> launches.Program:
    step = dispatch_rows.residual_add_step(dtype, n_vec, vec, launches.device_info(device))
    launches.check_limits(step)
    pb = launches.ProgramBuilder(("x", "r", "h"), device)
    pb.launch(step, x=pb["x"], r=pb["r"], h=pb["h"], n_vec=n_vec)
    return pb.build()


#: the per-row operands' slots (conditioning.kernel_rows), in conditioning.OPERANDS' order
CONDITIONED_SLOTS = ("shift", "mod_scale", "res_gate", "gate")
#: a row norm's slots, in the order Program.run takes their pointers
ROW_SLOTS = ("x", "r", "y", "h", "w", "b", "center", "scale", "quant_scale", "y_scale", "y_plain") + CONDITIONED_SLOTS


@functools.lru_cache(maxsize=1024)
def rows_program(plan, launch, eps: float, has_center: bool, has_scale: bool, device: int) -> launches.Program:
    """The Program of a row norm's launch (ROW_SLOTS): arrays a kernel never
    touches (no residual, no weight) are passed as x, absent statistics as
    null."""
    return build_rows(launches.ProgramBuilder(ROW_SLOTS, device), plan, launch, eps, has_center, has_scale).build()


def build_rows(pb, plan, launch, eps: float, has_center: bool, has_scale: bool, write_y: bool = True):
    """rows_program's launches into ``pb`` (a ProgramBuilder, or the jit
    path's LaunchRecorder); returns pb. ``write_y`` False (the cached tier
    only): the statistics alone (dispatch_rows.statistics_only), y null."""
    if not write_y:
        launch = dispatch_rows.statistics_only(launch)
    x, y = pb["x"], pb["y"] if write_y else None
    r, h = (pb["r"], pb["h"]) if plan.residual else (x, x)
    w = pb["w"] if plan.flags & plans.FLAG_WEIGHT else x
    b = pb["b"] if plan.flags & plans.FLAG_BIAS else x
    center = pb["center"] if has_center else None
    scale = pb["scale"] if has_scale else None
    acc_bytes = dtypes.accumulation(plan.dtype).itemsize
    rows = {"rows": plan.outer, "n": plan.reduced, "x_row_stride": plan.outer_stride}
    outputs = {"y": y, "w": w, "b": b, "center_out": center, "scale_out": scale}
    if launch.tier in ("cached", "uncached"):  # (the tiers that take a quantized y)
        quant = quantize.by_key(plan.quant)
        s_row, s_group = quantize.kernel_strides(quant, plan.outer, plan.reduced)
        outputs.update(quant_scale=pb["quant_scale"] if quant is not None and quant.scaling != quantize.ROW else None,
                       y_scale=pb["y_scale"] if quant is not None and quant.row_scales else None,
                       y_plain=pb["y_plain"] if quant is not None and quant.plain else None,
                       scale_row_stride=s_row, scale_group_stride=s_group)
    if launch.tier == "cached":
        param_rows, mod_div, mod_count = plan.conditioning or (1, 1, 1)
        operands = {slot: pb[slot] if plan.flags & bit else None for slot, bit in zip(
            CONDITIONED_SLOTS, conditioning.OPERANDS.values())}
        pb.launch(launch.steps[0], x=x, r=r, h=h, **outputs, **rows, **operands, eps=eps,
                  threads_per_row=launch.threads_per_row, param_rows=param_rows, mod_div=mod_div,
                  mod_count=mod_count)
    elif launch.tier == "uncached":
        pb.launch(launch.steps[0], x=x, r=r, h=h, **outputs, **rows, eps=eps, stash_vecs=launch.stash_vecs)
    elif launch.tier == "resident":
        partial = pb.workspace(launch.workspace_words * acc_bytes)
        arrived = pb.workspace(4 * plan.outer, zeroed=True)
        pb.launch(launch.steps[0], x=x, r=r, h=h, **outputs, partial=partial, arrived=arrived, **rows,
                  chunk_vecs=launch.chunk_vecs, eps=eps)
    elif launch.tier == "split":
        affine_words = 3 * plan.outer if launch.apply_chunks else 0  # (the finalize's, where it runs)
        partial = pb.workspace((launch.workspace_words - affine_words) * acc_bytes)
        pb.launch(launch.steps[0], x=x, r=r, h=h, partial=partial, **rows, chunks=launch.chunks)
        if not launch.apply_chunks:  # the apply combines each row's partials itself
            pb.launch(launch.steps[1], x=x, h=h, **outputs, partial=partial, **rows, chunks=launch.chunks, eps=eps)
        else:  # the finalize, then the apply in tiles
            affine = pb.workspace(affine_words * acc_bytes)
            pb.launch(launch.steps[1], x=x, h=h, partial=partial, affine=affine, center_out=outputs["center_out"],
                      scale_out=outputs["scale_out"], **rows, chunks=launch.chunks, eps=eps)
            pb.launch(launch.steps[2], x=x, h=h, w=outputs["w"], b=outputs["b"], affine=affine, y=outputs["y"],
                      **rows, tile_vecs=launch.apply_chunk_vecs, tiles=launch.apply_chunks)
    else:  # strided
        pb.launch(launch.steps[0], x=x, **outputs, outer=plan.outer, reduced=plan.reduced, inner=plan.inner,
                  x_outer_stride=plan.outer_stride, x_reduced_stride=plan.reduced_stride, eps=eps)
    return pb
