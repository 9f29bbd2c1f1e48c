"""The shared path of every public op: validate, plan, launch.

Everything here is thin on purpose: the plan and launch for a given layout
are computed once and memoized, so a call costs a few dictionary lookups
and the launches themselves.
"""
from __future__ import annotations

import functools
import math
import numbers

import numpy as np

from . import _dispatch, _dtypes, _interop, _plan


def check_eps(eps) -> float:
    if type(eps) is float and 0.0 <= eps < math.inf:
        return eps
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
    value = float(eps)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"eps must be finite and >= 0, got {eps!r}")
    return value


def check_dtype(dtype, name: str) -> np.dtype:
    if dtype not in _dtypes.KERNEL_TYPE:
        raise TypeError(f"{name} must have dtype {_dtypes.SUPPORTED_NAMES}, got {dtype}")
    return dtype


class Call:
    """A validated call: x's metadata, the normalized axes, the weight."""

    __slots__ = ("adapter", "x", "first", "last", "norm_shape", "weight", "eps", "out", "out_given")

    def __init__(self, x, weight, axis, eps, out):
        adapter = _interop.adapter_for(x, "x")
        self.adapter = adapter
        xa = x if adapter is _interop.NUMPY else adapter.to_cupy(x, "x")
        check_dtype(xa.dtype, "x")
        self.first, self.last = _plan.normalize_axes(axis, xa.ndim)
        self.norm_shape = tuple(xa.shape[self.first : self.last + 1])
        if math.prod(self.norm_shape) == 0:
            raise ValueError(
                f"the normalized axes of x have zero length (x.shape {tuple(xa.shape)}, axes "
                f"{self.first}..{self.last}): a norm over no elements is undefined"
            )
        self.x = xa
        self.weight = self._param(weight, "weight")
        self.eps = check_eps(eps)
        self.out_given = out
        self.out = None if out is None else self._out(out)

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
            raise ValueError(f"{name} is on GPU {ac.data.device_id} but x is on GPU {self.x.data.device_id}")
        return ac

    def _param(self, p, name: str):
        if p is None:
            return None
        pa = self._same_kind(p, name)
        check_dtype(pa.dtype, name)
        if tuple(pa.shape) != self.norm_shape:
            raise ValueError(
                f"{name} must have the shape of the normalized axes {self.norm_shape}, got {tuple(pa.shape)}"
            )
        return pa

    def _out(self, out):
        oa = self._same_kind(out, "out")
        if tuple(oa.shape) != tuple(self.x.shape) or oa.dtype != self.x.dtype:
            raise ValueError(
                f"out must have x's shape {tuple(self.x.shape)} and dtype {self.x.dtype}, "
                f"got shape {tuple(oa.shape)} and dtype {oa.dtype}"
            )
        if not oa.flags.c_contiguous:
            raise ValueError("out must be C-contiguous")
        if self.adapter is not _interop.NUMPY and _overlaps(oa, self.x) and not _same_view(oa, self.x):
            raise ValueError("out overlaps x without being x itself; pass a separate buffer (or x, for in place)")
        return oa

    @property
    def on_gpu(self) -> bool:
        return self.adapter is not _interop.NUMPY


def _span(a):
    lo = hi = a.data.ptr
    for n, s in zip(a.shape, a.strides):
        if n > 1:
            if s > 0:
                hi += (n - 1) * s
            else:
                lo += (n - 1) * s
    return lo, hi + a.itemsize


def _overlaps(a, b) -> bool:
    if a.size == 0 or b.size == 0:
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def _same_view(a, b) -> bool:
    return a.data.ptr == b.data.ptr and a.strides == b.strides and a.shape == b.shape


@functools.lru_cache(maxsize=None)
def device_info(device_id: int) -> _dispatch.Device:
    import cupy

    dev = cupy.cuda.Device(device_id)
    cc = int(dev.compute_capability)
    if cc < 80:
        raise RuntimeError(f"cunorm needs a GPU of compute capability 8.0 or newer; GPU {device_id} is {cc / 10:.1f}")
    return _dispatch.Device(sm_count=dev.attributes["MultiProcessorCount"], compute_capability=cc)


@functools.lru_cache(maxsize=4096)
def _planned(norm, dtype, wdtype, shape, strides, first, last, x_align, y_align, w_align, device_id):
    plan = _plan.make_plan(norm, dtype, wdtype, shape, strides, first, last, x_align, y_align, w_align)
    if plan is None:
        return None, None
    launch = _dispatch.choose(plan, device_info(device_id))
    for step in launch.steps:
        _check_limits(step)
    return plan, launch


def run(norm: str, call: Call, reference):
    """Compute ``norm`` for a validated call and return it as the caller's type."""
    if not call.on_gpu:
        axes = tuple(range(call.first, call.last + 1))
        y = reference(call.x, call.weight, axis=axes, eps=call.eps)
        if call.out is not None:
            call.out[...] = y
            return call.out_given
        return y

    import cupy

    x = call.x
    y = call.out if call.out is not None else cupy.empty(x.shape, dtype=x.dtype)
    if x.size:
        w = call.weight
        if w is not None:
            wdtype = _dtypes.weight_storage(x.dtype, w.dtype)
            if w.dtype != wdtype or not w.flags.c_contiguous:
                w = cupy.ascontiguousarray(w, dtype=wdtype)
        launch_on(norm, x, y, w, call.first, call.last, call.eps)
    if call.out is not None:
        return call.out_given
    return call.adapter.from_cupy(y, call.out_given)


def launch_on(norm, x, y, w, first, last, eps, *, override=None):
    """Plan and launch ``norm`` over CuPy arrays (y C-contiguous)."""
    import cupy

    itemsize = x.itemsize
    strides = tuple(s // itemsize for s in x.strides)
    wdtype = None if w is None else w.dtype
    w_ptr = 0 if w is None else w.data.ptr
    key = (norm, x.dtype, wdtype, tuple(x.shape), strides, first, last,
           x.data.ptr % 32, y.data.ptr % 32, w_ptr % 32, x.data.device_id)
    if override is None:
        plan, launch = _planned(*key)
    else:
        plan = _plan.make_plan(*key[:-1])
        launch = None if plan is None else _dispatch.choose(plan, device_info(x.data.device_id), override=override)
        for step in () if launch is None else launch.steps:
            _check_limits(step)
    if plan is None:  # a layout the kernels do not walk: one contiguous copy
        x = cupy.ascontiguousarray(x)
        return launch_on(norm, x, y, w, first, last, eps, override=override)
    _execute(plan, launch, x, y, w, eps)
    return plan, launch


def _execute(plan, launch, x, y, w, eps):
    import cupy

    from ._loader import get_function

    acc = _dtypes.accumulation(plan.dtype)
    eps_arg = acc.type(eps)
    w_arg = x if w is None else w  # never read when there is no weight
    i64 = np.int64
    if launch.tier == "cached":
        args = (x, y, w_arg, i64(plan.outer), np.int32(plan.reduced), i64(plan.outer_stride), i64(plan.reduced),
                eps_arg, np.int32(launch.threads_per_row))
        steps_args = (args,)
    elif launch.tier == "uncached":
        steps_args = ((x, y, w_arg, i64(plan.outer), i64(plan.reduced), i64(plan.outer_stride), i64(plan.reduced),
                       eps_arg),)
    elif launch.tier == "split":
        ws = cupy.empty(launch.workspace_words, dtype=acc)
        chunks, chunk_vecs = i64(launch.chunks), i64(launch.chunk_vecs)
        steps_args = (
            (x, ws, i64(plan.outer), i64(plan.reduced), i64(plan.outer_stride), chunks, chunk_vecs),
            (x, y, w_arg, ws, i64(plan.outer), i64(plan.reduced), i64(plan.outer_stride), i64(plan.reduced),
             chunks, chunk_vecs, eps_arg),
        )
    else:  # strided
        steps_args = ((x, y, w_arg, i64(plan.outer), np.int32(plan.reduced), i64(plan.inner),
                       i64(plan.outer_stride), i64(plan.reduced_stride), eps_arg),)
    device = x.data.device_id
    for step, args in zip(launch.steps, steps_args):
        fn = get_function(step.kernel.family, step.kernel.expression, device)
        fn(step.grid, step.block, args, shared_mem=step.shared_bytes)


def _check_limits(step):
    grid, block = step.grid, step.block
    if not (0 < grid[0] <= _dispatch.MAX_GRID_X and all(0 < g <= _dispatch.MAX_GRID_Y for g in grid[1:])):
        raise RuntimeError(f"grid {grid} for {step.kernel.expression} is outside the launch limits")
    if not (0 < math.prod(block) <= 1024) or step.shared_bytes > 48 * 1024:
        raise RuntimeError(f"block {block} / {step.shared_bytes} B shared for {step.kernel.expression} is out of limits")
