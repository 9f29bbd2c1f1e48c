"""The backward passes: validation, planning and launch (the public
functions are in cunorm/backward.py, the kernels in
cunorm/kernels/backward.cu and channel_grads.cu, their choice in
dispatch_grad.choose_*_grad).

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

from . import (channel_norms, dispatch_grad, dispatch_rows, dtypes, launch_cache, launches, ops, plans, row_norms,
               targets, tuning)
from .. import reference



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
    want = dtypes.accumulation(call.x.dtype)
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
        self.call = call = row_norms.Call(norm, x, axis, eps, None, weight=weight, bias=bias)
        self.norm = norm
        self.dy = _check_like(call, dy, "dy")
        self.dh = None if dh is None else _check_like(call, dh, "dh")
        self.center = self.scale = None
        statistics = ops.statistics_of(norm)  # (what the forward saved: mean centers, rstd scales)
        if "mean" in statistics:
            self.center = _check_stat(call, mean, "mean", call.stats_shape)
        if "rstd" in statistics:
            self.scale = _check_stat(call, rstd, "rstd", call.stats_shape)


def reference_rows(g: RowGradCall):
    """The float64 reference of a row norm's backward (NumPy arrays): the
    table's reference_backward with the op's statistics and parameters
    (ops.OPS); the Lp family's with its p."""
    call = g.call
    axis = tuple(range(call.first, call.last + 1))
    op = ops.BY_NORM.get(g.norm)
    if op is None or not op.statistics:
        p, mean = dispatch_rows.lp_power(g.norm)
        return reference.normalize_backward(g.dy, call.x, p, axis=axis, eps=call.eps, mean=mean)
    saved = {"mean": g.center, "rstd": g.scale}
    return op.reference_backward(g.dy, call.x, *(saved[name] for name in op.statistics),
                                 *(getattr(call, name) for name in op.params), axis=axis, dh=g.dh)


def run_rows(g: RowGradCall, reference=None, key=None):
    """(dx, dweight, dbias) for rms/ln (None where there is no parameter), dx
    for the Lp norms; as the caller's array type. ``key``: the call's
    signature in the launch cache (cunorm/_engine/launch_cache.py), which gets an entry
    when the call ran without copies or casts."""
    call = g.call
    if not call.on_gpu:
        if not call.x.size:
            return _empty_grads(call, len(ops.params_of(g.norm)))
        return (reference or reference_rows)(g)
    with call.adapter.scope(call.x.data.device_id):
        (dx, dw, db), program = _rows_gpu(g)
        wrap = call.adapter.from_cupy
        grads = {"weight": dw, "bias": db}
        results = [wrap(dx)] + [None if grads[name] is None else wrap(grads[name]) for name in ops.params_of(g.norm)]
    if key is not None and program is not None:
        launch_cache.ROWS_GRAD.put(key, _rows_grad_entry(g, program))
    return results[0] if len(results) == 1 else tuple(results)


def _rows_grad_entry(g: RowGradCall, program) -> launch_cache.Entry:
    """Called as entry(dy, x, mean, rstd, weight, bias, dh)."""
    call = g.call
    x = call.x
    outputs = {"dx": (x.shape, x.dtype, None)}
    for name, p in (("dw", call.weight), ("db", call.bias)):
        if p is not None:
            outputs[name] = (p.shape, p.dtype, None)
    present = lambda name, a: None if a is None else name  # noqa: E731
    slots = {"dy": "dy", "x": "x", "dh": present("dh", g.dh), "dx": "dx", "w": present("w", call.weight),
             "center": present("mean", g.center), "scale": present("rstd", g.scale), "dw": present("dw", call.weight),
             "db": present("db", call.bias)}
    returns = ["dx"] + [present(n, p) for n, p in (("dw", call.weight), ("db", call.bias))][:len(ops.params_of(g.norm))]
    return launch_cache.entry(call.adapter, x.data.device_id, program, ("dy", "x", "mean", "rstd", "w", "b", "dh"),
                              outputs, slots, returns, arrays={"x": x, "w": call.weight, "b": call.bias})


def _contiguous(a):
    import cupy

    return a if a is None or a.flags.c_contiguous else cupy.ascontiguousarray(a)


def _rows_gpu(g: RowGradCall):
    import cupy

    call = g.call
    x, dy, dh = (_contiguous(a) for a in (call.x, g.dy, g.dh))
    clean = x is call.x and dy is g.dy and dh is g.dh
    dx = cupy.empty(x.shape, dtype=x.dtype)
    flags, pdtype = row_norms.kernel_params(x.dtype, call.weight, call.bias)
    w = row_norms._as_param(call.weight, pdtype)  # the bias is not read: only dbias is wanted
    heads = call.cond.param_rows  # (parameters per head: one row of them a head, the heads trailing x's rows)
    dw, db = (None if p is None else cupy.empty(p.shape, dtype=pdtype) for p in (call.weight, call.bias))
    center, scale = (_contiguous(s) for s in (g.center, g.scale))
    clean = clean and center is g.center and scale is g.scale and w is call.weight and x.size > 0
    program = None
    if x.size:
        outer = math.prod(x.shape[: call.first])
        reduced = math.prod(call.norm_shape)
        inner = math.prod(x.shape[call.last + 1 :])
        extent = reduced if inner == 1 else inner
        pointers = [(a.data.ptr, x.itemsize) for a in (x, dy, dx, dh) if a is not None]
        if inner == 1 and w is not None:
            pointers.append((w.data.ptr, w.itemsize))
        vec = plans.vector_width(x.itemsize, extent, [], pointers)
        launch = _rows_launch(g.norm, x.dtype, pdtype, flags, outer, reduced, inner, vec, x.data.device_id, heads)
        if launch is None:
            raise ValueError(f"the backward with parameters per head takes rows one block holds (at most "
                             f"{CACHED_ROW_LIMITS}), got rows of {reduced} {x.dtype} elements")
        program = _execute_rows(launch, x, dy, dh, dx, w, center, scale, dw, db, outer, reduced, inner, call.eps,
                                heads)
    grads = _param_grads(call, dw, db, empty=not x.size)
    clean = clean and grads[0] is dw and grads[1] is db
    return (dx,) + grads, program if clean else None


def _param_grad_buffers(call, shape, pdtype):
    """dweight and dbias as the kernels write them (the parameters' kernel
    dtype), None for an absent parameter."""
    import cupy

    return tuple(None if p is None else cupy.empty(shape, dtype=pdtype) for p in (call.weight, call.bias))


def _empty_grads(call, params: int):
    """The NumPy backward of x with no elements: dx empty, the parameters'
    gradients zero (sums over nothing); ``params`` of them returned."""
    dx = np.empty(call.x.shape, call.x.dtype)
    grads = [None if p is None else np.zeros(p.shape, p.dtype) for p in (call.weight, call.bias)][:params]
    return (dx, *grads) if params else dx


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


#: the rows rows_grad_cached's block holds, as its errors name them
CACHED_ROW_LIMITS = "16384 16-bit, 8192 32-bit or 4096 64-bit elements"


def per_head_fits(n: int, itemsize: int, weight: bool, bias: bool) -> bool:
    """Whether the backward takes parameters per head over rows of n
    elements of ``itemsize`` bytes: rows_grad_cached a block a row, its
    column sums within the least shared memory of the GPUs cunorm plans
    rows_grad_cached for (sm_80's: targets.TARGETS).
    Plain arithmetic (no memo, no kernel objects), as dynamo traces it
    when a front end asks before its forward runs."""
    vec = plans.vector_width(itemsize, n, [], [])
    shape = dispatch_grad.grad_cached_shape(n // vec, vec, itemsize, tuning.for_arch(80)) if n > 0 else None
    if shape is None:
        return False
    threads, vpt, _ = shape
    flags = (plans.FLAG_WEIGHT if weight else 0) | (plans.FLAG_BIAS if bias else 0)
    shared = dispatch_grad.grad_cached_shared_bytes(flags, vec, threads, vpt, 8 if itemsize == 8 else 4)
    least = targets.TARGETS["sm_80"].device.max_shared_per_block
    return shared <= least - dispatch_rows.RESIDENT_SHARED_RESERVE


@functools.lru_cache(maxsize=1024)
def _rows_launch(norm, dtype, pdtype, flags, outer, reduced, inner, vec, device_id, heads=1):
    device = launches.device_info(device_id)
    launch = dispatch_grad.choose_rows_grad(norm, dtype, pdtype, flags, outer, reduced, inner, vec, device,
                                            heads=heads)
    for step in () if launch is None else launch.steps:
        launches.check_limits(step, device)
    return launch


#: a row norm backward's slots, in the order Program.run takes their pointers
ROW_GRAD_SLOTS = ("dy", "x", "dh", "dx", "w", "center", "scale", "dw", "db")


def _execute_rows(launch, x, dy, dh, dx, w, center, scale, dw, db, outer, reduced, inner, eps, heads=1):
    grads = [a for a in (dw, db) if a is not None]
    program = rows_grad_program(launch, x.dtype, grads[0].dtype if grads else None, outer, reduced, inner, float(eps),
                                tuple(a is not None for a in (dh, w, center, scale, dw, db)), x.data.device_id,
                                heads)
    program.run_named({"dy": dy, "x": x, "dh": dh, "dx": dx, "w": w, "center": center, "scale": scale, "dw": dw,
                       "db": db}, launches.cupy_stream(), launches.cupy_alloc)
    return program


@functools.lru_cache(maxsize=1024)
def rows_grad_program(launch, dtype, pdtype, outer, reduced, inner, eps, present, device,
                      heads=1) -> launches.Program:
    """The Program of a row norm's backward (ROW_GRAD_SLOTS); ``present``
    says which of dh, w, center, scale, dw, db the call has, pdtype the
    dtype dweight/dbias are written in, ``heads`` the parameters' rows. A
    weight absent is passed as x; dh, the statistics, and for the cached
    tier dweight/dbias, as null (for the others as x)."""
    return build_rows_grad(launches.ProgramBuilder(ROW_GRAD_SLOTS, device), launch, dtype, pdtype, outer, reduced,
                           inner, eps, present, heads).build()


def build_rows_grad(pb, launch, dtype, pdtype, outer, reduced, inner, eps, present, heads=1):
    """rows_grad_program's launches into ``pb`` (a ProgramBuilder or a
    LaunchRecorder); returns pb. A cached step that is not cooperative
    leaves its partials to column_sum (the jit path's launches)."""
    has = dict(zip(("dh", "w", "center", "scale", "dw", "db"), present))
    dy, x, dx = pb["dy"], pb["x"], pb["dx"]
    dh, center, scale = (pb[n] if has[n] else None for n in ("dh", "center", "scale"))
    w = pb["w"] if has["w"] else x
    acc_bytes = dtypes.accumulation(dtype).itemsize
    wants = has["dw"] or has["db"]
    if launch.tier == "cached":
        launch_cached(pb, launch, dtype, pdtype, has, outer, reduced, eps, heads, dy=dy, x=x, dh=dh, dx=dx, w=w,
                      center=center, scale=scale)
        return pb
    if launch.tier == "strided_cached":
        (step,) = launch.steps
        partial = pb.workspace(2 * launch.parts * reduced * acc_bytes if wants else acc_bytes)
        pb.launch(step, dy=dy, x=x, dh=dh, w=w, center=center, scale=scale, dx=dx, partial=partial, outer=outer,
                  reduced=reduced, inner=inner, eps=eps)
        if wants:
            _column_sum(pb, dtype, pdtype, has, partial, launch.parts, reduced)
        return pb
    groups = outer * inner
    parts = launch.parts
    ws = pb.workspace(groups * launch.chunks * launch.stat_words * acc_bytes)
    coeffs = pb.workspace(groups * dispatch_grad.GRAD_COEFF_WORDS * acc_bytes)
    # streamed rows write dweight/dbias themselves when they are one part
    direct = launch.tier == "streamed" and parts == 1
    partial = pb.workspace(2 * parts * reduced * acc_bytes if wants and not direct else acc_bytes)
    # the apply step writes dweight/dbias only when direct (null otherwise)
    dw, db = (pb[n] if has[n] and direct else None for n in ("dw", "db"))
    sums = {"dy": dy, "x": x, "w": w, "center": center, "scale": scale}
    if launch.tier == "streamed":
        pb.launch(launch.steps[0], **sums, stat_partial=ws, rows=outer, n=reduced, chunks=launch.chunks,
                  chunk_len=launch.chunk_len)
        pb.launch(launch.steps[1], partial=ws, center=center, scale=scale, coeffs=coeffs, chunks=launch.chunks,
                  n=reduced, eps=eps)
    else:
        pb.launch(launch.steps[0], **sums, partial=ws, outer=outer, reduced=reduced, inner=inner,
                  chunks=launch.chunks, chunk_len=launch.chunk_len)
        pb.launch(launch.steps[1], partial=ws, center=center, scale=scale, coeffs=coeffs, groups=groups,
                  chunks=launch.chunks, n=reduced, eps=eps)
    pb.launch(launch.steps[2], dy=dy, x=x, dh=dh, dx=dx, w=w, coeffs=coeffs, partial=partial, dw=dw, db=db,
              outer=outer, reduced=reduced, inner=inner, chunks=launch.apply_chunks, chunk_len=launch.apply_chunk_len)
    if wants and not direct:
        _column_sum(pb, dtype, pdtype, has, partial, parts, reduced)
    return pb


def launch_cached(pb, launch, dtype, pdtype, has, rows, n, eps, heads=1, **arrays):
    """The cached tier's launch (rows_grad_cached, rows_grad_gated,
    rows_grad_cluster) over ``rows`` rows of n elements into ``pb``:
    ``arrays`` its data arguments, ``has`` whether the call has dw and db.
    The partials' rows are the grid's blocks or clusters (capped at the
    resident ones when the step is prepared); a cooperative grid adds them
    into dw/db itself, else column_sum does (the jit path's launches).
    ``heads`` > 1 (parameters per head, a block a row): the grid is whole
    heads, so a block's rows and its partial row are one head's, and
    column_sum adds the partials up as grid / heads rows of heads x n
    columns (never the grid itself); a grid of more blocks than are
    resident runs them in turn."""
    acc_bytes = dtypes.accumulation(dtype).itemsize
    wants = has["dw"] or has["db"]
    (step,) = launch.steps
    grid = pb.persistent_grid(step)
    if heads > 1:
        blocks = max(grid[0] // heads, 1) * heads
        kernel = dataclasses.replace(step.kernel, cooperative=False, persistent=blocks <= grid[0])
        step, grid = dataclasses.replace(step, kernel=kernel), (blocks,) + grid[1:]
    parts = grid[0] // step.kernel.cluster // heads  # a partial row a block, or a cluster
    partial = pb.workspace(2 * parts * heads * n * acc_bytes if wants else acc_bytes)
    grid_sums = wants and step.kernel.cooperative
    arrived = pb.workspace(4, zeroed=True) if grid_sums else None
    declared = {name for name, _ in step.kernel.signature}
    sums = {name: pb[name] if has[name] and grid_sums else None for name in ("dw", "db") if name in declared}
    if "heads" in declared:
        sums["heads"] = heads
    pb.launch(dataclasses.replace(step, grid=grid), **arrays, partial=partial, rows=rows, n=n,
              row_threads=launch.row_threads, eps=eps, prefetch_next=int(launch.prefetch_next), arrived=arrived,
              **sums)
    if wants and not grid_sums:
        _column_sum(pb, dtype, pdtype, has, partial, parts, n * heads)


def _column_sum(pb, dtype, pdtype, has, partial, parts, reduced):
    """dweight and dbias: column_sum over ``parts`` partial rows of each."""
    a = dtypes.KERNEL_TYPE[dtypes.accumulation(dtype)]
    step = dispatch_grad.column_sum_step(a, dtypes.KERNEL_TYPE[pdtype], parts, reduced, 1 if not has["db"] else 2)
    launches.check_limits(step)
    pb.launch(step, partial=partial, out_w=pb["dw"] if has["dw"] else None, out_b=pb["db"] if has["db"] else None,
              parts=parts, n=reduced)


# --- the channel norms -----------------------------------------------------------


class ChannelGradCall:
    """A validated backward call of group_norm, instance_norm or batch_norm."""

    def __init__(self, norm, dy, x, mean, rstd, *, num_groups=None, weight=None, bias=None, channel_axis,
                 training=True, eps=1e-5):
        # the forward's checks (in training mode: the statistics are checked
        # here, as the saved ones or, for eval-mode BatchNorm, the running ones)
        self.training = row_norms.check_flag(training, "training")
        self.call = call = channel_norms.ChannelCall(norm, x, num_groups=num_groups, weight=weight, bias=bias, eps=eps,
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
    row_norms.check_dtype(ba.dtype, name)
    if tuple(ba.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(ba.shape)}")
    return ba


def reference_channels(g: ChannelGradCall):
    """The float64 reference of a channel norm's backward (NumPy arrays),
    as reference_rows: BatchNorm's with its mode and eps."""
    call = g.call
    op = ops.BY_NORM[g.norm]
    groups = (call.groups,) if op.groups else ()
    mode = {"training": g.training, "eps": call.eps} if op.running else {}
    return op.reference_backward(g.dy, call.x, g.mean, g.rstd, *groups, call.weight, call.bias,
                                 channel_axis=call.channel_axis, **mode)


def run_channels(g: ChannelGradCall, reference=None, key=None, override=None):
    """(dx, dweight, dbias) as the caller's array type. ``key``: as for
    run_rows; ``override``: as for choose_channel_grad (tests and tuning;
    not memoized)."""
    call = g.call
    if not call.on_gpu:
        if not call.x.size:
            return _empty_grads(call, 2)
        return (reference or reference_channels)(g)
    with call.adapter.scope(call.x.data.device_id):
        (dx, dw, db), program, last = _channels_gpu(g, override)
        wrap = call.adapter.from_cupy
        results = wrap(dx), None if dw is None else wrap(dw), None if db is None else wrap(db)
    if key is not None and program is not None and override is None:
        launch_cache.CHANNELS_GRAD.put(key, _channel_grad_entry(g, program, last))
    return results


def _channel_grad_entry(g: ChannelGradCall, program, last: bool) -> launch_cache.Entry:
    """Called as entry(dy, x, mean, rstd, weight, bias, None)."""
    call = g.call
    x = call.x
    order = plans.channel_orders(x.ndim, call.channel_axis)[last]
    perm = tuple(int(a) for a in np.argsort(order))
    outputs = {"dx": ([x.shape[a] for a in order], x.dtype, None if perm == tuple(range(x.ndim)) else perm)}
    for name, p in (("dw", call.weight), ("db", call.bias)):
        if p is not None:
            outputs[name] = (p.shape, p.dtype, None)
    present = lambda name, a: None if a is None else name  # noqa: E731
    slots = {"dy": "dy", "x": "x", "dx": "dx", "mean": "mean", "rstd": "rstd", "w": present("w", call.weight),
             "dw": present("dw", call.weight), "db": present("db", call.bias)}
    return launch_cache.entry(call.adapter, x.data.device_id, program, ("dy", "x", "mean", "rstd", "w", "b", "dh"),
                              outputs, slots, ("dx", present("dw", call.weight), present("db", call.bias)),
                              arrays={"x": x, "w": call.weight, "b": call.bias})


def _channels_gpu(g: ChannelGradCall, override=None):
    import cupy

    call = g.call
    # x dense in one of the two layouts (copied if not), dx in the same
    x, dx, last, _ = channel_norms.prepare(call)
    per_sample = call.per_sample
    dy = g.dy
    clean = x is call.x
    if not plans.same_layout(x.shape, dy.strides, x.strides) or dy.data.ptr % 16:  # dy into x's (and dx's) layout, 16-byte aligned
        dy = cupy.ndarray(dx.shape, dx.dtype, cupy.cuda.alloc(dx.nbytes), strides=dx.strides)
        dy[...] = g.dy
        clean = False
    flags, pdtype = row_norms.kernel_params(x.dtype, call.weight, call.bias)
    w = row_norms._as_param(call.weight, pdtype)
    channels = x.shape[call.channel_axis]
    dw, db = _param_grad_buffers(call, (channels,), pdtype)
    acc = dtypes.accumulation(x.dtype)
    mean, rstd = g.mean, g.rstd
    if call.norm == "batch" and not g.training:
        mean = row_norms._as_param(mean, acc)
        rstd = 1.0 / cupy.sqrt(rstd.astype(acc) + acc.type(call.eps))
        clean = False
    flat = mean.reshape(-1), rstd.reshape(-1)
    mean, rstd = (_contiguous(a) for a in flat)
    clean = clean and mean is flat[0] and rstd is flat[1] and w is call.weight and x.size > 0
    program = None
    if x.size:
        batch = x.shape[0]
        spatial = x.size // (batch * channels)
        plan = plans.make_channel_plan(call.norm, x.dtype, pdtype, flags, last, batch, channels, spatial,
                                       channels // call.groups, per_sample, x.data.ptr % 32, dx.data.ptr % 32)
        launch = _channel_launch(plan, g.training, x.data.device_id,
                                 None if override is None else tuple(sorted(override.items())))
        program = channel_grad_program(plan, launch, x.data.device_id)
        program.run_named({"dy": dy, "x": x, "dx": dx, "mean": mean, "rstd": rstd, "w": w, "dw": dw, "db": db},
                          launches.cupy_stream(), launches.cupy_alloc)
    grads = _param_grads(call, dw, db, empty=not x.size)
    clean = clean and grads[0] is dw and grads[1] is db
    return (dx,) + grads, program if clean else None, last


@functools.lru_cache(maxsize=1024)
def _channel_launch(plan, training, device_id, override=None):
    device = launches.device_info(device_id)
    launch = dispatch_grad.choose_channel_grad(plan, training, device, None if override is None else dict(override))
    for step in launch.steps:
        launches.check_limits(step, device)
    return launch


#: a channel norm backward's slots, in the order Program.run takes their pointers
CHANNEL_GRAD_SLOTS = ("dy", "x", "dx", "mean", "rstd", "w", "dw", "db")


@functools.lru_cache(maxsize=1024)
def channel_grad_program(plan, launch, device) -> launches.Program:
    """The Program of a channel norm's backward (CHANNEL_GRAD_SLOTS):
    channel_grad_onchip, or sums, combine, finalize, apply over one
    workspace (the partial sums, the combined sums, the coefficients);
    absent parameters passed as x."""
    return build_channel_grad(launches.ProgramBuilder(CHANNEL_GRAD_SLOTS, device), plan, launch).build()


def build_channel_grad(pb, plan, launch):
    """channel_grad_program's launches into ``pb`` (a ProgramBuilder or a
    LaunchRecorder); returns pb."""
    dy, x, mean = pb["dy"], pb["x"], pb["mean"]
    w = pb["w"] if plan.flags & plans.FLAG_WEIGHT else x
    dw = pb["dw"] if plan.flags & plans.FLAG_WEIGHT else x
    db = pb["db"] if plan.flags & plans.FLAG_BIAS else x
    if launch.tier == "channel_onchip":
        pb.launch(launch.steps[0], dy=dy, x=x, dx=pb["dx"], mean=mean, rstd=pb["rstd"], w=w, dw=dw, db=db,
                  batch=plan.batch, plane_vecs=plan.spatial // plan.vec, channels=plan.channels)
        return pb
    sums = build_channel_grad_sums(pb, plan, launch)
    coeffs = pb.workspace(plan.batch * plan.channels * 3 * dtypes.accumulation(plan.dtype).itemsize)
    dims = channel_grad_dims(plan)
    pb.launch(launch.steps[2], sums=sums, mean=mean, rstd=pb["rstd"], w=w, count_at=None, coeffs=coeffs, dw=dw,
              db=db, totals=None, sums_batch=plan.batch, count=float(plan.batch * plan.spatial), **dims)
    pb.launch(launch.steps[3], dy=dy, x=x, dx=pb["dx"], mean=mean, coeffs=coeffs, **dims, chunks=launch.chunks,
              chunk_len=launch.chunk_len)
    return pb


def build_channel_grad_sums(pb, plan, launch):
    """The backward's first pass and its combine into ``pb`` (slots dy, x,
    mean): returns the workspace of the (sample, channel) sums. With one
    chunk a (sample, channel) the first pass's partials are the sums (no
    combine launch: 6.5-6.7 us of BatchNorm (64,256,56,56)'s backward on an
    H200, docs/notes/backward.md)."""
    acc_bytes = dtypes.accumulation(plan.dtype).itemsize
    members = plan.batch * plan.channels
    ws = pb.workspace(members * launch.chunks * 2 * acc_bytes)  # the partial sums
    pb.launch(launch.steps[0], dy=pb["dy"], x=pb["x"], mean=pb["mean"], partial=ws, **channel_grad_dims(plan),
              chunks=launch.chunks, chunk_len=launch.chunk_len)
    if launch.chunks == 1:
        return ws
    sums = pb.workspace(members * 2 * acc_bytes)  # combined
    pb.launch(launch.steps[1], partial=ws, sums=sums, members=members, chunks=launch.chunks)
    return sums


def channel_grad_dims(plan) -> dict:
    """The channel backward kernels' shape arguments."""
    return {"batch": plan.batch, "spatial": plan.spatial, "channels": plan.channels,
            "channels_per_group": plan.channels_per_group, "stat_batch": _stat_batch(plan)}


def _stat_batch(plan) -> int:
    """The kernels' stat_batch: the groups a sample has, 0 for statistics
    over the whole batch (BatchNorm)."""
    return plan.channels // plan.channels_per_group if plan.per_sample else 0
