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

_NULL = np.uint64(0)  # a null pointer argument (optional statistics outputs)


def check_eps(eps) -> float:
    if type(eps) is float and 0.0 <= eps < math.inf:
        return eps
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
    value = float(eps)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"eps must be finite and >= 0, got {eps!r}")
    return value


def check_flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_int(value, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def check_dtype(dtype, name: str) -> np.dtype:
    if dtype not in _dtypes.KERNEL_TYPE:
        raise TypeError(f"{name} must have dtype {_dtypes.SUPPORTED_NAMES}, got {dtype}")
    return dtype


class Call:
    """A validated call of a normalization: x, the normalized axes, the affine
    parameters, the residual, eps and out, each checked against x."""

    __slots__ = ("norm", "adapter", "x", "first", "last", "norm_shape", "weight", "bias", "residual", "eps", "out",
                 "out_given", "return_stats")

    def __init__(self, norm, x, axis, eps, out, *, weight=None, bias=None, residual=None, return_stats=False):
        self.norm = norm
        adapter = _interop.adapter_for(x, "x")
        self.adapter = adapter
        xa = x if adapter is _interop.NUMPY else adapter.to_cupy(x, "x")
        check_dtype(xa.dtype, "x")
        self.first, self.last = axis_span(axis, xa.ndim)
        self.norm_shape = tuple(xa.shape[self.first : self.last + 1])
        if math.prod(self.norm_shape) == 0:
            raise ValueError(
                f"the normalized axes of x have zero length (x.shape {tuple(xa.shape)}, axes "
                f"{self.first}..{self.last}): a norm over no elements is undefined"
            )
        self.x = xa
        self.weight = self._param(weight, "weight")
        self.bias = self._param(bias, "bias")
        self.residual = self._residual(residual)
        self.eps = check_eps(eps)
        self.out_given = out
        self.out = None if out is None else self._out(out)
        self.return_stats = check_flag(return_stats, "return_stats")

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
        if tuple(pa.shape) != self.norm_shape:
            raise ValueError(
                f"{name} must have the shape of the normalized axes {self.norm_shape}, got {tuple(pa.shape)}"
            )
        return pa

    def _residual(self, r):
        if r is None:
            return None
        ra = self._same_kind(r, "residual")
        if tuple(ra.shape) != tuple(self.x.shape):
            raise ValueError(f"residual must have x's shape {tuple(self.x.shape)}, got {tuple(ra.shape)}")
        if ra.dtype != self.x.dtype:
            raise TypeError(f"residual must have x's dtype {self.x.dtype}, got {ra.dtype}")
        return ra

    def _out(self, out):
        _writable(out, "out")
        oa = self._same_kind(out, "out")
        if tuple(oa.shape) != tuple(self.x.shape) or oa.dtype != self.x.dtype:
            raise ValueError(
                f"out must have x's shape {tuple(self.x.shape)} and dtype {self.x.dtype}, "
                f"got shape {tuple(oa.shape)} and dtype {oa.dtype}"
            )
        if not oa.flags.c_contiguous:
            raise ValueError("out must be C-contiguous")
        if self.adapter is not _interop.NUMPY:
            for other, name in ((self.x, "x"), (self.residual, "residual")):
                if other is not None and _overlaps(oa, other) and not (name == "x" and _same_view(oa, other)):
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
    return _plan.normalize_axes(axis, ndim)


def stats_shape(shape: tuple, first: int, last: int) -> tuple:
    """The statistics' shape: x's without the normalized axes."""
    return shape[:first] + shape[last + 1 :]


def _writable(a, name: str) -> None:
    """Refuse a JAX array where cunorm would write (JAX arrays are immutable)."""
    if getattr(_interop.adapter_for(a, name), "name", None) == "jax":
        raise TypeError(f"{name} is a JAX array, which cunorm must not write into (JAX arrays are immutable); "
                        f"leave {name} out and use the returned array")


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
    attrs = dev.attributes
    return _dispatch.Device(sm_count=attrs["MultiProcessorCount"], compute_capability=cc,
                            max_shared_per_block=attrs["MaxSharedMemoryPerBlockOptin"])


def run(call: Call, reference):
    """Compute the call's norm; return y (then h, then the statistics) as the
    caller's array type."""
    if not call.on_gpu:
        kwargs = {"axis": tuple(range(call.first, call.last + 1)), "eps": call.eps}
        if call.norm in ("rms", "ln"):
            kwargs.update(weight=call.weight, residual=call.residual, return_stats=call.return_stats)
        if call.norm == "ln":
            kwargs["bias"] = call.bias
        results = reference(call.x, **kwargs)
        if call.out is None:
            return results
        first = results[0] if isinstance(results, tuple) else results
        call.out[...] = first
        return (call.out_given,) + results[1:] if isinstance(results, tuple) else call.out_given

    with call.adapter.scope(call.x.data.device_id):
        return _run_gpu(call)


def _run_gpu(call: Call):
    import cupy

    x = call.x
    y = call.out if call.out is not None else cupy.empty(x.shape, dtype=x.dtype)
    h = None if call.residual is None else cupy.empty(x.shape, dtype=x.dtype)
    stats = []
    if call.return_stats:
        acc = _dtypes.accumulation(x.dtype)
        stats = [cupy.empty(call.stats_shape, dtype=acc) for _ in range(2 if call.norm == "ln" else 1)]
    if x.size:
        _, pdtype = kernel_params(x.dtype, call.weight, call.bias)
        w, b = _as_param(call.weight, pdtype), _as_param(call.bias, pdtype)
        center, scale = (stats if call.norm == "ln" else [None] + stats) if stats else (None, None)
        launch_on(call.norm, x, y, w=w, b=b, r=call.residual, h=h, center=center, scale=scale,
                  first=call.first, last=call.last, eps=call.eps)
    out = call.adapter.from_cupy
    results = [call.out_given if call.out is not None else out(y)]
    if h is not None:
        results.append(out(h))
    results += [out(s) for s in stats]
    return results[0] if len(results) == 1 else tuple(results)


def kernel_params(x_dtype, w, b) -> tuple[int, np.dtype | None]:
    """(flags, dtype) of the affine parameters as the kernels read them:
    which are present (FLAG_WEIGHT | FLAG_BIAS) and the one storage dtype
    (_dtypes.param_storage; None without parameters). Callers cast what they
    read with _as_param."""
    flags = (_plan.FLAG_WEIGHT if w is not None else 0) | (_plan.FLAG_BIAS if b is not None else 0)
    if not flags:
        return 0, None
    return flags, _dtypes.param_storage(x_dtype, [p.dtype for p in (w, b) if p is not None])


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
    plan = _plan.make_plan(*key[:-1])
    if plan is None or (plan.residual and not plan.contiguous_rows):
        return plan, None
    device = device_info(key[-1])
    launch = _dispatch.choose(plan, device, override=override)
    for step in launch.steps:
        _check_limits(step, device)
    return plan, launch


def _mod32(a):
    return 0 if a is None else a.data.ptr % 32


def launch_on(norm, x, y, *, w=None, b=None, r=None, h=None, center=None, scale=None, first, last, eps,
              override=None):
    """Plan and launch ``norm`` over CuPy arrays: y (and h, center, scale)
    C-contiguous; w and b contiguous, of one dtype; r of x's layout or it is
    made so. Returns (plan, launch) of the normalization."""
    import cupy

    if r is not None and r.strides != x.strides:
        x, r = cupy.ascontiguousarray(x), cupy.ascontiguousarray(r)
    itemsize = x.itemsize
    strides = tuple([s // itemsize for s in x.strides])
    flags = (_plan.FLAG_WEIGHT if w is not None else 0) | (_plan.FLAG_BIAS if b is not None else 0)
    pdtype = None if not flags else (w if w is not None else b).dtype
    key = (norm, x.dtype, pdtype, flags, r is not None, x.shape, strides, first, last,
           x.data.ptr % 32, y.data.ptr % 32, _mod32(r), _mod32(h), _mod32(w), _mod32(b), x.data.device_id)
    plan, launch = _planned(*key) if override is None else _plan_and_choose(key, override)
    if plan is None:  # a layout the kernels do not walk: one contiguous copy
        x = cupy.ascontiguousarray(x)
        r = None if r is None else cupy.ascontiguousarray(r)
        return launch_on(norm, x, y, w=w, b=b, r=r, h=h, center=center, scale=scale, first=first, last=last,
                         eps=eps, override=override)
    if r is not None and not plan.contiguous_rows:
        # A strided axis: form h with one elementwise pass, then normalize h.
        _residual_add(cupy.ascontiguousarray(x), cupy.ascontiguousarray(r), h)
        return launch_on(norm, h, y, w=w, b=b, center=center, scale=scale, first=first, last=last, eps=eps,
                         override=override)
    _execute(plan, launch, x, y, w, b, r, h, center, scale, eps)
    return plan, launch


def _residual_add(x, r, h):
    from ._loader import get_function

    vec = _plan.vector_width(x.itemsize, x.size, [], [(x.data.ptr, x.itemsize), (r.data.ptr, x.itemsize),
                                                       (h.data.ptr, x.itemsize)])
    step = _dispatch.residual_add_step(x.dtype, x.size // vec, vec, device_info(x.data.device_id))
    _check_limits(step)
    get_function(step.kernel.family, step.kernel.expression, x.data.device_id)(
        step.grid, step.block, (x, r, h, np.int64(x.size // vec)))


def _execute(plan, launch, x, y, w, b, r, h, center, scale, eps):
    import cupy

    acc = _dtypes.accumulation(plan.dtype)
    eps_arg = acc.type(eps)
    # Arrays a kernel never touches (no residual, no weight) are passed as x.
    r, h, w, b = (x if a is None else a for a in (r, h, w, b))
    center, scale = (_NULL if a is None else a for a in (center, scale))
    i64 = np.int64
    rows, xs = i64(plan.outer), i64(plan.outer_stride)
    if launch.tier == "cached":
        steps_args = ((x, r, y, h, w, b, center, scale, rows, np.int32(plan.reduced), xs, eps_arg,
                       np.int32(launch.threads_per_row)),)
    elif launch.tier == "uncached":
        steps_args = ((x, r, y, h, w, b, center, scale, rows, i64(plan.reduced), xs, eps_arg,
                       i64(launch.stash_vecs)),)
    elif launch.tier == "resident":
        ws = cupy.empty(launch.workspace_words, dtype=acc)
        arrived = cupy.zeros(plan.outer, dtype=np.uint32)
        steps_args = ((x, r, y, h, w, b, center, scale, ws, arrived, rows, i64(plan.reduced), xs,
                       i64(launch.chunk_vecs), eps_arg),)
    elif launch.tier == "split":
        ws = cupy.empty(launch.workspace_words, dtype=acc)
        n, chunks = i64(plan.reduced), i64(launch.chunks)
        steps_args = (
            (x, r, h, ws, rows, n, xs, chunks),
            (x, h, y, w, b, center, scale, ws, rows, n, xs, chunks, eps_arg),
        )
    else:  # strided
        steps_args = ((x, y, w, b, center, scale, rows, np.int32(plan.reduced), i64(plan.inner), xs,
                       i64(plan.reduced_stride), eps_arg),)
    launch_steps(launch.steps, steps_args, x.data.device_id)


def launch_steps(steps, steps_args, device: int):
    """Launch each step of a Launch with its arguments, in order, on
    ``device``: opting in to more than 48 KB of dynamic shared memory where a
    step asks for it, and checking a cooperative grid fits first."""
    for step, args in zip(steps, steps_args):
        fn = _step_function(step, device)
        grid = step.grid
        if step.kernel.cooperative:
            resident = _resident_blocks(fn, math.prod(step.block), step.shared_bytes, device)
            if resident < math.prod(grid):
                raise RuntimeError(f"{step.kernel.expression}: {math.prod(grid)} blocks cannot all be resident "
                                   f"({resident} fit on the GPU)")
        elif step.kernel.persistent:
            grid = persistent_grid(step, device)
        fn(grid, step.block, args, shared_mem=step.shared_bytes)


def persistent_grid(step, device: int) -> tuple[int, ...]:
    """A persistent step's grid, its x extent capped at the blocks resident
    at once (so no block starts its share late)."""
    fn = _step_function(step, device)
    resident = _resident_blocks(fn, math.prod(step.block), step.shared_bytes, device)
    if resident < 1:
        raise RuntimeError(f"{step.kernel.expression}: no block of {math.prod(step.block)} threads and "
                           f"{step.shared_bytes} B of shared memory fits an SM")
    return (min(step.grid[0], resident),) + tuple(step.grid[1:])


def _step_function(step, device: int):
    """A step's kernel, opted in to the step's dynamic shared memory where
    that is more than the default allows (48 KB less the static): before
    any launch, and before any occupancy query, which otherwise counts no
    block at all of a kernel that asks for more."""
    from ._loader import get_function

    fn = get_function(step.kernel.family, step.kernel.expression, device, step.kernel.cooperative)
    if step.shared_bytes > 0:
        _opt_in(fn, step.shared_bytes)
    return fn


@functools.lru_cache(maxsize=None)
def _opt_in(fn, shared_bytes: int) -> None:
    """Raise a kernel's dynamic shared memory limit to shared_bytes where it
    is lower: once per kernel and size, not a driver query every launch."""
    if fn.max_dynamic_shared_size_bytes < shared_bytes:
        fn.max_dynamic_shared_size_bytes = shared_bytes


@functools.lru_cache(maxsize=None)
def _resident_blocks(fn, threads: int, shared_bytes: int, device: int) -> int:
    """How many blocks of ``threads`` and ``shared_bytes`` of a kernel fit on
    the GPU at once (a cooperative grid must, where CuPy would shrink it
    with a warning; a persistent grid is capped at it)."""
    from cupy_backends.cuda.api import driver

    per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, threads, shared_bytes)
    return per_sm * device_info(device).sm_count


def _check_limits(step, device=None):
    grid, block = step.grid, step.block
    if not (0 < grid[0] <= _dispatch.MAX_GRID_X and all(0 < g <= _dispatch.MAX_GRID_Y for g in grid[1:])):
        raise RuntimeError(f"grid {grid} for {step.kernel.expression} is outside the launch limits")
    shared_limit = 48 * 1024 if device is None else max(48 * 1024, device.max_shared_per_block)
    if not (0 < math.prod(block) <= 1024) or step.shared_bytes > shared_limit:
        raise RuntimeError(f"block {block} / {step.shared_bytes} B shared for {step.kernel.expression} is out of limits")
