"""The backward passes: validation, planning and launch (the public
functions are in cunorm/backward.py, the kernels in
cunorm/kernels/backward.cu, their choice in _dispatch.choose_*_grad).

A backward call mirrors its forward call: the same x (h for the residual
forms), axes or channel layout, parameters and the forward's saved
statistics, plus dy. The kernels read x, dy (and dh) C-contiguous in the
forward's canonical layout: inputs in any other layout are copied once first.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from . import _channels, _dispatch_grad, _dtypes, _ops, _plan

_NULL = np.uint64(0)


def _check_like(call, a, name):
    """``a`` (dy, dh) as a GPU/NumPy array of x's kind, shape and dtype."""
    aa = call._same_kind(a, name)
    if tuple(aa.shape) != tuple(call.x.shape):
        raise ValueError(f"{name} must have x's shape {tuple(call.x.shape)}, got {tuple(aa.shape)}")
    if aa.dtype != call.x.dtype:
        raise TypeError(f"{name} must have x's dtype {call.x.dtype}, got {aa.dtype}")
    return aa


def _check_stat(call, s, name, shape):
    """A saved statistic: the forward's shape and accumulation dtype."""
    if s is None:
        raise TypeError(f"{name} is required: pass the forward's {name} (return_stats=True)")
    sa = call._same_kind(s, name)
    want = _dtypes.accumulation(call.x.dtype)
    if sa.dtype != want:
        raise TypeError(f"{name} must have dtype {want} (the forward's statistics for {call.x.dtype} x), "
                        f"got {sa.dtype}")
    if tuple(sa.shape) != tuple(shape):
        raise ValueError(f"{name} must have the forward's statistics shape {tuple(shape)}, got {tuple(sa.shape)}")
    return sa


class RowGradCall:
    """A validated backward call of a row norm (rms, ln, the Lp norms)."""

    def __init__(self, norm, dy, x, *, axis, eps=0.0, mean=None, rstd=None, weight=None, bias=None, dh=None):
        # The forward's checks of x, axis, weight, bias and eps, then dy,
        # dh and the statistics against them.
        self.call = call = _ops.Call(norm, x, axis, eps, None, weight=weight, bias=bias)
        self.norm = norm
        self.dy = _check_like(call, dy, "dy")
        self.dh = None if dh is None else _check_like(call, dh, "dh")
        self.center = self.scale = None
        if norm == "ln":
            self.center = _check_stat(call, mean, "mean", call.stats_shape)
        if norm in ("rms", "ln"):
            self.scale = _check_stat(call, rstd, "rstd", call.stats_shape)


def run_rows(g: RowGradCall, reference):
    """(dx, dweight, dbias) for rms/ln (None where there is no parameter), dx
    for the Lp norms; as the caller's array type."""
    call = g.call
    if not call.on_gpu:
        return reference(g)
    with call.adapter.scope(call.x.data.device_id):
        dx, dw, db = _rows_gpu(g)
        wrap = call.adapter.from_cupy
        if g.norm not in ("rms", "ln"):
            return wrap(dx)
        results = [wrap(dx), None if dw is None else wrap(dw)]
        if g.norm == "ln":
            results.append(None if db is None else wrap(db))
        return tuple(results)


def _contiguous(a):
    import cupy

    return a if a is None or a.flags.c_contiguous else cupy.ascontiguousarray(a)


def _rows_gpu(g: RowGradCall):
    import cupy

    call = g.call
    x, dy, dh = (_contiguous(a) for a in (call.x, g.dy, g.dh))
    dx = cupy.empty(x.shape, dtype=x.dtype)
    flags, pdtype = _ops.kernel_params(x.dtype, call.weight, call.bias)
    w = _ops._as_param(call.weight, pdtype)  # the bias is not read: only dbias is wanted
    dw, db = _param_grad_buffers(call, call.norm_shape, pdtype)
    center, scale = (_contiguous(s) for s in (g.center, g.scale))
    if x.size:
        outer = math.prod(x.shape[: call.first])
        reduced = math.prod(call.norm_shape)
        inner = math.prod(x.shape[call.last + 1 :])
        extent = reduced if inner == 1 else inner
        pointers = [(a.data.ptr, x.itemsize) for a in (x, dy, dx, dh) if a is not None]
        if inner == 1 and w is not None:
            pointers.append((w.data.ptr, w.itemsize))
        vec = _plan.vector_width(x.itemsize, extent, [], pointers)
        launch = _rows_launch(g.norm, x.dtype, pdtype, flags, outer, reduced, inner, vec, x.data.device_id)
        _execute_rows(launch, x, dy, dh, dx, w, center, scale, dw, db, outer, reduced, inner, call.eps)
    return (dx,) + _param_grads(call, dw, db, empty=not x.size)


def _param_grad_buffers(call, shape, pdtype):
    """dweight and dbias as the kernels write them (the parameters' kernel
    dtype), None for an absent parameter."""
    import cupy

    return tuple(None if p is None else cupy.empty(shape, dtype=pdtype) for p in (call.weight, call.bias))


def _param_grads(call, dw, db, *, empty: bool):
    """dweight and dbias as returned: zeros when there were no rows (empty
    sums), in each parameter's own dtype (the kernels' may differ)."""
    out = []
    for grad, param in ((dw, call.weight), (db, call.bias)):
        if grad is not None:
            if empty:
                grad.fill(0)
            if grad.dtype != param.dtype:
                grad = grad.astype(param.dtype)
        out.append(grad)
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def _rows_launch(norm, dtype, pdtype, flags, outer, reduced, inner, vec, device_id):
    device = _ops.device_info(device_id)
    launch = _dispatch_grad.choose_rows_grad(norm, dtype, pdtype, flags, outer, reduced, inner, vec, device)
    for step in launch.steps:
        _ops._check_limits(step, device)
    return launch


def _execute_rows(launch, x, dy, dh, dx, w, center, scale, dw, db, outer, reduced, inner, eps):
    import cupy

    acc = _dtypes.accumulation(x.dtype)
    i64 = np.int64
    device = x.data.device_id
    dh_arg = _NULL if dh is None else dh
    w_arg = x if w is None else w
    center_arg = _NULL if center is None else center
    scale_arg = _NULL if scale is None else scale
    wants = dw is not None or db is not None
    direct = False
    if launch.tier == "cached":
        # the partials' rows are the grid's blocks: cap it first (as
        # launch_steps would), then size the workspace; the grid adds its
        # partials into dw/db itself (arrived: its barrier's count)
        (step,) = launch.steps
        grid = _ops.persistent_grid(step, device)
        partial = cupy.empty(2 * grid[0] * reduced if wants else 1, dtype=acc)
        arrived = cupy.zeros(1, dtype=np.uint32) if wants else _NULL
        dw_arg, db_arg = (_NULL if a is None else a for a in (dw, db))
        _ops.launch_steps((dataclasses.replace(step, grid=grid),),
                          ((dy, x, dh_arg, dx, w_arg, center_arg, scale_arg, partial, i64(outer),
                            np.int32(reduced), acc.type(eps), np.int32(launch.prefetch_next), dw_arg, db_arg,
                            arrived),), device)
        direct = True
    else:
        groups = outer * inner
        parts = launch.parts
        ws = cupy.empty(groups * launch.chunks * launch.stat_words, dtype=acc)
        coeffs = cupy.empty(groups * _dispatch_grad.GRAD_COEFF_WORDS, dtype=acc)
        # streamed rows write dweight/dbias themselves when they are one part
        direct = launch.tier == "streamed" and parts == 1
        partial = cupy.empty(2 * parts * reduced if wants and not direct else 1, dtype=acc)
        dims = (i64(outer), i64(reduced), i64(inner))
        dw_arg, db_arg = (x if a is None else a for a in (dw, db))
        apply_args = (dy, x, dh_arg, dx, w_arg, coeffs, partial, dw_arg, db_arg) + dims + (
            i64(launch.apply_chunks), i64(launch.apply_chunk_len))
        if launch.tier == "streamed":
            steps_args = ((dy, x, w_arg, center_arg, scale_arg, ws, i64(outer), i64(reduced), i64(launch.chunks),
                           i64(launch.chunk_len)),
                          (ws, center_arg, scale_arg, coeffs, i64(launch.chunks), i64(reduced), acc.type(eps)),
                          apply_args)
        else:
            steps_args = ((dy, x, w_arg, center_arg, scale_arg, ws) + dims + (i64(launch.chunks),
                                                                                i64(launch.chunk_len)),
                          (ws, center_arg, scale_arg, coeffs, i64(groups), i64(launch.chunks), i64(reduced),
                           acc.type(eps)),
                          apply_args)
        _ops.launch_steps(launch.steps, steps_args, device)
    if wants and not direct:
        pdtype = (dw if dw is not None else db).dtype
        step = _column_sum(acc, pdtype, parts, reduced, 1 if db is None else 2)
        dw_arg, db_arg = (_NULL if a is None else a for a in (dw, db))
        _ops.launch_steps((step,), ((partial, dw_arg, db_arg, np.int32(parts), i64(reduced)),), device)


@functools.lru_cache(maxsize=1024)
def _column_sum(acc, pdtype, parts, n, outputs):
    step = _dispatch_grad.column_sum_step(_dtypes.KERNEL_TYPE[acc], _dtypes.KERNEL_TYPE[pdtype], parts, n, outputs)
    _ops._check_limits(step)
    return step


# --- the channel norms -----------------------------------------------------------


class ChannelGradCall:
    """A validated backward call of group_norm, instance_norm or batch_norm."""

    def __init__(self, norm, dy, x, mean, rstd, *, num_groups=None, weight=None, bias=None, channel_axis,
                 training=True, eps=1e-5):
        # the forward's checks (in training mode: the statistics are checked
        # here, as the saved ones or, for eval-mode BatchNorm, the running ones)
        self.training = _ops.check_flag(training, "training")
        self.call = call = _channels.ChannelCall(norm, x, num_groups=num_groups, weight=weight, bias=bias, eps=eps,
                                                 channel_axis=channel_axis)
        self.norm = norm
        self.dy = _check_like(call, dy, "dy")
        if norm == "batch" and not self.training:
            # eval mode: the statistics are the running buffers
            channels = (call.x.shape[call.channel_axis],)
            self.mean = _check_running(call, mean, "running_mean", channels)
            self.rstd = _check_running(call, rstd, "running_var", channels)
        else:
            self.mean = _check_stat(call, mean, "mean", call.stats_shape)
            self.rstd = _check_stat(call, rstd, "rstd", call.stats_shape)


def _check_running(call, buf, name, shape):
    if buf is None:
        raise TypeError(f"{name} is required for batch_norm_backward with training=False")
    ba = call._same_kind(buf, name)
    _ops.check_dtype(ba.dtype, name)
    if tuple(ba.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(ba.shape)}")
    return ba


def run_channels(g: ChannelGradCall, reference):
    """(dx, dweight, dbias) as the caller's array type."""
    call = g.call
    if not call.on_gpu:
        return reference(g)
    with call.adapter.scope(call.x.data.device_id):
        dx, dw, db = _channels_gpu(g)
        wrap = call.adapter.from_cupy
        return wrap(dx), None if dw is None else wrap(dw), None if db is None else wrap(db)


def _channels_gpu(g: ChannelGradCall):
    import cupy

    call = g.call
    # x dense in one of the two layouts (copied if not), dx in the same
    x, dx, last, _ = _channels.prepare(call)
    per_sample = call.norm != "batch"
    dy = g.dy
    if dy.strides != x.strides or dy.data.ptr % 16:  # dy into x's (and dx's) layout, 16-byte aligned
        dy = cupy.ndarray(dx.shape, dx.dtype, cupy.cuda.alloc(dx.nbytes), strides=dx.strides)
        dy[...] = g.dy
    flags, pdtype = _ops.kernel_params(x.dtype, call.weight, call.bias)
    w = _ops._as_param(call.weight, pdtype)
    channels = x.shape[call.channel_axis]
    dw, db = _param_grad_buffers(call, (channels,), pdtype)
    acc = _dtypes.accumulation(x.dtype)
    mean, rstd = g.mean, g.rstd
    if call.norm == "batch" and not g.training:
        mean = _ops._as_param(mean, acc)
        rstd = 1.0 / cupy.sqrt(rstd.astype(acc) + acc.type(call.eps))
    mean, rstd = _contiguous(mean.reshape(-1)), _contiguous(rstd.reshape(-1))
    if x.size:
        batch = x.shape[0]
        spatial = x.size // (batch * channels)
        plan = _plan.make_channel_plan(call.norm, x.dtype, pdtype, flags, last, batch, channels, spatial,
                                       channels // call.groups, per_sample, x.data.ptr % 32, dx.data.ptr % 32)
        launch = _channel_launch(plan, g.training, x.data.device_id)
        i32, i64 = np.int32, np.int64
        stat_batch = 0 if not per_sample else call.groups
        dims = (i64(plan.batch), i64(plan.spatial), i32(plan.channels), i32(plan.channels_per_group),
                i32(stat_batch))
        members = plan.batch * plan.channels
        ws = cupy.empty(members * launch.chunks * 2 + members * 2 + members * 3, dtype=acc)
        partial = ws[: members * launch.chunks * 2]
        sums = ws[members * launch.chunks * 2 : members * (launch.chunks * 2 + 2)]
        coeffs = ws[members * (launch.chunks * 2 + 2) :]
        chunking = (i64(launch.chunks), i64(launch.chunk_len))
        w_arg = x if w is None else w
        dw_arg, db_arg = (x if a is None else a for a in (dw, db))
        _ops.launch_steps(
            launch.steps,
            ((dy, x, mean, partial) + dims + chunking,
             (partial, sums, i64(members), i64(launch.chunks)),
             (sums, mean, rstd, w_arg, coeffs, dw_arg, db_arg) + dims,
             (dy, x, dx, mean, coeffs) + dims + chunking),
            x.data.device_id)
    return (dx,) + _param_grads(call, dw, db, empty=not x.size)


@functools.lru_cache(maxsize=1024)
def _channel_launch(plan, training, device_id):
    device = _ops.device_info(device_id)
    launch = _dispatch_grad.choose_channel_grad(plan, training, device)
    for step in launch.steps:
        _ops._check_limits(step, device)
    return launch
