"""GroupNorm, InstanceNorm and BatchNorm: validation, planning and launch.

A call is canonicalized to a ChannelPlan (x dense channels-first or
channels-last in memory, whichever its strides already are; anything else is
copied once) and run by the channel family (cunorm/kernels/channels.cu), or
by the row family when it is a row norm in disguise
(dispatch_channels.channel_rows_fast). y has x's memory layout.
"""
from __future__ import annotations

import functools
import math
import numbers

import numpy as np

from . import dispatch_channels, dtypes, launch_cache, launches, ops, plans, row_norms
from .. import _interop

NORMS = ("group", "instance", "batch")


class ChannelCall:
    """A validated call of group_norm, instance_norm or batch_norm."""

    __slots__ = ("norm", "per_sample", "adapter", "x", "channel_axis", "groups", "weight", "bias", "eps", "out",
                 "out_given", "return_stats", "running_mean", "running_var", "training", "momentum", "epilogue",
                 "out_dtype")

    def __init__(self, norm, x, *, num_groups=None, weight=None, bias=None, eps, channel_axis, out=None,
                 return_stats=False, running_mean=None, running_var=None, training=True, momentum=0.1,
                 epilogue=0, out_dtype=None):
        if norm not in NORMS:  # (a registered operator's norm argument is a caller's string)
            raise ValueError(f"unknown channel norm {norm!r}: expected one of {list(NORMS)}")
        fn = f"{norm}_norm"
        self.norm = norm
        op = ops.BY_NORM[norm]
        self.per_sample = op.per_sample  # (statistic groups within one sample; BatchNorm's span the batch)
        self.epilogue = epilogue  # the activation's FLAGS bits (plans.activation_flags)
        # y's dtype where it is not x's (cunorm's GroupNorm layers under
        # autocast: float32 from 16-bit x); internal, without out=
        self.out_dtype = out_dtype
        self.adapter = _interop.adapter_for(x, "x")
        xa = x if self.adapter is _interop.NUMPY else self.adapter.to_cupy(x, "x")
        row_norms.check_dtype(xa.dtype, "x")
        row_norms.check_out_dtype(out_dtype, xa.dtype)
        if xa.ndim < 2:
            raise ValueError(f"{fn}: x must have a batch and a channel axis (N, C, ...), got shape {tuple(xa.shape)}")
        self.x = xa
        self.channel_axis = _channel_axis(channel_axis, xa.ndim, fn)
        shape = tuple(xa.shape)
        channels = shape[self.channel_axis]
        spatial = math.prod(s for a, s in enumerate(shape) if a not in (0, self.channel_axis))
        if op.groups:
            num_groups = row_norms.check_int(num_groups, "group_norm: num_groups")
            if num_groups < 1 or channels % num_groups:
                raise ValueError(f"group_norm: num_groups must be >= 1 and divide the {channels} channels, "
                                 f"got {num_groups}")
            self.groups = int(num_groups)
        else:
            self.groups = channels
        per_group = (channels // max(self.groups, 1)) * spatial * (1 if op.per_sample else shape[0])
        self.weight = self._param(weight, "weight", channels)
        self.bias = self._param(bias, "bias", channels)
        self.eps = row_norms.check_eps(eps, xa.dtype)
        self.return_stats = row_norms.check_flag(return_stats, "return_stats")
        self.training = row_norms.check_flag(training, "training")
        self.momentum = _momentum(momentum)
        self.running_mean = self._running(running_mean, "running_mean", channels)
        self.running_var = self._running(running_var, "running_var", channels)
        for name, buf in (("running_mean", self.running_mean), ("running_var", self.running_var)):
            other = None if buf is None else row_norms.first_overlap(buf, (xa, "x"), (self.weight, "weight"),
                                                                     (self.bias, "bias"))
            if other is not None:
                raise ValueError(f"batch_norm: {name} overlaps {other}; pass a separate buffer")
        if (self.running_mean is not None and self.running_var is not None
                and row_norms._overlaps(self.running_mean, self.running_var)):
            raise ValueError("batch_norm: running_mean and running_var overlap; pass two separate buffers")
        if norm == "batch" and not self.training and (self.running_mean is None or self.running_var is None):
            raise ValueError("batch_norm with training=False normalizes with the running statistics: "
                             "pass running_mean and running_var")
        if norm == "batch" and self.training and per_group == 1:
            raise ValueError(f"batch_norm in training needs more than one value per channel, got x of shape {shape}")
        if norm == "instance" and spatial == 1 and xa.size:
            raise ValueError(f"instance_norm needs more than one spatial element, got x of shape {shape}")
        self.out_given = out
        self.out = None if out is None else self._out(out)

    _same_kind = row_norms.Call._same_kind

    def _param(self, p, name, channels):
        if p is None:
            return None
        pa = self._same_kind(p, name)
        row_norms.check_dtype(pa.dtype, name)
        if tuple(pa.shape) != (channels,):
            raise ValueError(f"{self.norm}_norm: {name} must have shape ({channels},), one per channel, "
                             f"got {tuple(pa.shape)}")
        return pa

    def _running(self, buf, name, channels):
        if buf is None:
            return None
        if not ops.BY_NORM[self.norm].running:
            raise ValueError(f"{name} is a batch_norm argument")
        if self.training:
            row_norms.check_writable(buf, name)
        else:  # (read only in eval mode; a JAX buffer is refused alike: cunorm.jax takes those)
            row_norms.refuse_jax(buf, name)
        ba = self._same_kind(buf, name)
        row_norms.check_dtype(ba.dtype, name)
        if tuple(ba.shape) != (channels,):
            raise ValueError(f"batch_norm: {name} must have shape ({channels},), got {tuple(ba.shape)}")
        return ba

    def _out(self, out):
        row_norms.check_writable(out, "out")
        oa = self._same_kind(out, "out")
        if tuple(oa.shape) != tuple(self.x.shape) or oa.dtype != self.x.dtype:
            raise ValueError(f"out must have x's shape {tuple(self.x.shape)} and dtype {self.x.dtype}, "
                             f"got shape {tuple(oa.shape)} and dtype {oa.dtype}")
        name = row_norms.first_overlap(oa, (self.x, "x"), (self.weight, "weight"), (self.bias, "bias"),
                                       (self.running_mean, "running_mean"), (self.running_var, "running_var"))
        if name is not None:
            raise ValueError(f"out overlaps {name}; pass a separate buffer")
        return oa

    on_gpu = row_norms.Call.on_gpu

    @property
    def stats_shape(self) -> tuple:
        return stats_shape(self.norm, tuple(self.x.shape), self.channel_axis, self.groups)


def stats_shape(norm: str, shape: tuple, channel_axis: int, groups: int) -> tuple:
    """The statistics' shape: (N, groups), (N, C) or (C,)."""
    n, c = shape[0], shape[channel_axis]
    return {"group": (n, groups), "instance": (n, c), "batch": (c,)}[norm]


def _channel_axis(axis, ndim, fn) -> int:
    axis = row_norms.check_int(axis, f"{fn}: channel_axis")
    if not -ndim <= axis < ndim or axis % ndim not in (1, ndim - 1):
        raise ValueError(f"{fn}: channel_axis must be 1 (channels-first) or -1 (channels-last) for x of "
                         f"{ndim} dimensions, got {axis}")
    return axis % ndim


def _momentum(momentum) -> float:
    if isinstance(momentum, (bool, np.bool_)) or not isinstance(momentum, numbers.Real):
        raise TypeError(f"momentum must be a real number, got {type(momentum).__name__}")
    value = float(momentum)
    if not 0.0 <= value <= 1.0:  # also rejects NaN
        raise ValueError(f"momentum must be in [0, 1], got {momentum!r}")
    return value


def run(call: ChannelCall, key=None):
    """y (then mean, rstd) as the caller's array type. ``key``: the call's
    signature in the launch cache (cunorm/_engine/launch_cache.py), which gets an entry
    when the call ran without copies or conversions."""
    if not call.on_gpu:
        if not call.x.size:  # nothing to normalize; the running buffers are left as they are
            return row_norms.empty_results(call, 1, 2)
        return _run_reference(call)
    with call.adapter.scope(call.x.data.device_id):
        x, y, last, stats = prepare(call)
        program = None
        if x.size:
            _, program = execute(call, x, y, last, stats)
        wrap = call.adapter.from_cupy
        results = [call.out_given if call.out is not None else wrap(y)] + [wrap(s) for s in stats]
    if key is not None and program is not None and x is call.x and call.out is None:
        launch_cache.CHANNELS.put(key, _channel_entry(call, program, last))
    return results[0] if len(results) == 1 else tuple(results)


def _channel_entry(call: ChannelCall, program, last: bool) -> launch_cache.Entry:
    """The launch cache's entry of a channel norm's call that ran
    ``program`` over its arrays as given; called as entry(x, weight, bias,
    running_mean, running_var)."""
    x = call.x
    order = plans.channel_orders(x.ndim, call.channel_axis)[last]
    perm = tuple(int(a) for a in np.argsort(order))
    outputs = {"y": ([x.shape[a] for a in order], call.out_dtype or x.dtype,
                     None if perm == tuple(range(x.ndim)) else perm)}
    if call.return_stats:
        acc = dtypes.accumulation(x.dtype)
        outputs["mean"] = outputs["rstd"] = (call.stats_shape, acc, None)
    mean, rstd = ("mean", "rstd") if call.return_stats else (None, None)
    present = lambda name, a: None if a is None else name  # noqa: E731
    # (a row norm in disguise runs the row Program: its slots' names)
    slots = {"x": "x", "y": "y", "w": present("w", call.weight), "b": present("b", call.bias), "mean": mean,
             "rstd": rstd, "center": mean, "scale": rstd, "running_mean": present("running_mean", call.running_mean),
             "running_var": present("running_var", call.running_var)}
    return launch_cache.entry(call.adapter, x.data.device_id, program, ("x", "w", "b", "running_mean", "running_var"),
                              outputs, slots, tuple(outputs), arrays={"x": x})


def prepare(call: ChannelCall):
    """(x, y, channels_last, stats) of a GPU call: x dense in one of the two
    layouts (copied if it was not), y in the same layout, the statistics
    outputs (empty list unless asked for)."""
    import cupy

    ca = call.channel_axis
    x, last = _dense(call.x, ca, call.per_sample)
    order = plans.channel_orders(x.ndim, ca)[last]
    if call.out is not None:
        y = call.out
        if not plans.dense_order(y.shape, _elements(y), order):
            raise ValueError(f"out must have x's memory layout ({'channels-last' if last else 'channels-first'}, "
                             f"dense), got strides {y.strides}")
    else:
        y = cupy.empty([x.shape[a] for a in order], dtype=call.out_dtype or x.dtype).transpose(np.argsort(order))
    acc = dtypes.accumulation(x.dtype)
    stats = [cupy.empty(call.stats_shape, dtype=acc) for _ in range(2)] if call.return_stats else []
    if not x.size:  # statistics over no elements (row_norms.empty_results)
        for s in stats:
            s.fill(np.nan)
    return x, y, last, stats


def _dense(x, channel_axis: int, per_sample: bool):
    """(x, channels_last): x as it is where it is dense in one of the two
    layouts, else its C-order copy."""
    import cupy

    strides = _elements(x)
    last = plans.channel_layout(x.shape, strides, channel_axis, per_sample)
    if last is None:  # dense in neither layout: one copy, C order
        x = cupy.ascontiguousarray(x)
        last = output_layout(x.shape, strides, channel_axis, per_sample)
    return x, last


def output_layout(shape, strides, channel_axis: int, per_sample: bool) -> bool:
    """Whether y is channels-last in memory for x of ``shape`` and
    ``strides`` (elements): x's own layout when x is dense in one of the two,
    else that of x's C-order copy. (torch.compile's fake tensors take their
    strides from here, so it must agree with prepare.)"""
    last = plans.channel_layout(shape, strides, channel_axis, per_sample)
    if last is None:
        c_order = [1] * len(shape)
        for axis in range(len(shape) - 2, -1, -1):
            c_order[axis] = c_order[axis + 1] * shape[axis + 1]
        last = plans.channel_layout(shape, tuple(c_order), channel_axis, per_sample)
        if last is None:  # empty: nothing is laid out
            last = channel_axis != 1
    return last


def output_order(shape, strides, channel_axis: int, per_sample: bool) -> tuple[int, ...]:
    """y's axes in memory order, outermost first (see output_layout)."""
    return plans.channel_orders(len(shape), channel_axis)[output_layout(shape, strides, channel_axis, per_sample)]


def _elements(a):
    return tuple(s // a.itemsize for s in a.strides)


def _run_reference(call):
    """The float64 reference of a NumPy call: the table's (ops.OPS), with
    the group count, running buffers and mode where the op takes them."""
    op = ops.BY_NORM[call.norm]
    groups = (call.groups,) if op.groups else ()
    kw = {"eps": call.eps, "channel_axis": call.channel_axis, "return_stats": call.return_stats,
          "activation": plans.activation_name(call.epilogue)}
    if op.running:
        kw.update(running_mean=call.running_mean, running_var=call.running_var, training=call.training,
                  momentum=call.momentum)
    results = op.reference(call.x, *groups, call.weight, call.bias, **kw)
    if call.out_dtype is not None:
        results = row_norms._with_y(results, lambda y: y.astype(call.out_dtype))
    if call.out is None:
        return results
    first = results[0] if isinstance(results, tuple) else results
    call.out[...] = first
    return (call.out_given,) + results[1:] if isinstance(results, tuple) else call.out_given


def execute(call, x, y, last, stats, override: dict | None = None):
    """Launch the call over non-empty x (from prepare); returns (walk, program):
    the walk it took, for the benchmark's table, and the Program that ran,
    None where a parameter or running buffer had to be converted first.
    ``override`` (tests and the tuning script): {"walk": "split", "stream"
    or "rows"} forces a walk (dispatch_channels.choose_channel_walk); {"chunks": n}
    cuts the three launches as told, {"hints": h} sets their L2 hints
    (dispatch_channels.choose_channels), {"fold": bool} whether the apply
    finalizes each group (dispatch_channels.apply_finalizes); "tile_vecs",
    "slab_bytes", "lag" and "hints" set channel_stream's schedule
    (dispatch_channels.choose_channel_stream)."""
    import cupy

    shape = x.shape
    ca = call.channel_axis
    batch, channels = shape[0], shape[ca]
    spatial = x.size // (batch * channels)
    flags, pdtype = row_norms.kernel_params(x.dtype, call.weight, call.bias)
    w, b = row_norms._as_param(call.weight, pdtype), row_norms._as_param(call.bias, pdtype)
    flags |= call.epilogue
    from_running = call.norm == "batch" and not call.training
    key = (call.norm, x.dtype, pdtype, flags, last, batch, channels, spatial, channels // call.groups,
           call.per_sample, x.data.ptr % 32, y.data.ptr % 32, from_running, bool(stats), x.data.device_id,
           tuple(sorted((override or {}).items())), y.dtype if y.dtype != x.dtype else None)
    plan, launch = _planned(*key)
    acc = dtypes.accumulation(x.dtype)
    mean_out, rstd_out = (s.reshape(-1) for s in stats) if stats else (None, None)
    converted = w is not call.weight or b is not call.bias
    if launch is None:  # a row norm in disguise: LayerNorm over each group's contiguous row
        rows = plan.statistic_groups
        xv = cupy.ndarray((rows, x.size // rows), x.dtype, x.data)
        yv = cupy.ndarray((rows, x.size // rows), y.dtype, y.data)
        _, row_launch, program = row_norms._launch_rows("ln", xv, yv, center=mean_out, scale=rstd_out, first=1, last=1,
                                                        eps=call.eps, epilogue=call.epilogue, out_dtype=y.dtype)
        return f"rows ({row_launch.tier})", program
    # Running buffers the kernels update in place: accumulation dtype,
    # contiguous (copied back below when they had to be converted).
    running = [row_norms._as_param(buf, acc) for buf in (call.running_mean, call.running_var)]
    program = channel_program(plan, launch, from_running, call.eps, call.momentum, mean_out is not None,
                              tuple(r is not None for r in running), x.data.device_id)
    program.run_named({"x": x, "y": y, "w": w, "b": b, "mean": mean_out, "rstd": rstd_out,
                       "running_mean": running[0], "running_var": running[1]},
                      launches.cupy_stream(), launches.cupy_alloc)
    for buf, used in zip((call.running_mean, call.running_var), running):
        if buf is not None and used is not buf:
            converted = True  # (the Program ran over the copy: the launch cache must not replay it over buf)
            if not from_running:
                buf[...] = used
    return launch.tier, None if converted else program


#: a channel norm's slots, in the order Program.run takes their pointers
CHANNEL_SLOTS = ("x", "y", "w", "b", "mean", "rstd", "running_mean", "running_var")


@functools.lru_cache(maxsize=1024)
def channel_program(plan, launch, from_running: bool, eps: float, momentum: float, has_stats: bool,
                    has_running: tuple[bool, bool], device: int) -> launches.Program:
    """The Program of the channel family's walk (CHANNEL_SLOTS): absent
    parameters passed as x, absent statistics and running buffers as null."""
    return build_channels(launches.ProgramBuilder(CHANNEL_SLOTS, device), plan, launch, from_running, eps, momentum,
                          has_stats, has_running).build()


def build_channels(pb, plan, launch, from_running: bool, eps: float, momentum: float, has_stats: bool,
                   has_running: tuple[bool, bool]):
    """channel_program's launches into ``pb`` (a ProgramBuilder or a
    LaunchRecorder); returns pb. Each workspace is its own slot (the jit
    path's custom calls take no pointer into the middle of a buffer)."""
    x = pb["x"]
    w = pb["w"] if plan.flags & plans.FLAG_WEIGHT else x
    b = pb["b"] if plan.flags & plans.FLAG_BIAS else x
    mean, rstd = (pb["mean"], pb["rstd"]) if has_stats else (None, None)
    rm, rv = (pb[name] if present else None for name, present in zip(("running_mean", "running_var"), has_running))
    acc_bytes = dtypes.accumulation(plan.dtype).itemsize
    dims = {"batch": plan.batch, "spatial": plan.spatial, "channels": plan.channels,
            "channels_per_group": plan.channels_per_group, "per_sample": int(plan.per_sample)}
    # (the apply's own chunks where the dispatch tiles it)
    apply = {"x": x, "y": pb["y"], "w": w, "b": b, **dims, "chunks": launch.apply_chunks or launch.chunks,
             "chunk_len": launch.apply_chunk_vecs or launch.chunk_vecs, "eps": eps, "hints": launch.hints,
             "partial": None, "mean_out": None, "rstd_out": None}
    if launch.tier == "channel_onchip":
        vecs = plan.spatial // plan.vec
        if plan.channels_last:
            rows, row_vecs, row_stride = plan.spatial, plan.channels_per_group // plan.vec, plan.channels // plan.vec
            sample_stride, group_stride = plan.spatial * plan.channels // plan.vec, plan.channels_per_group // plan.vec
        elif plan.per_sample:
            rows, row_vecs, row_stride = 1, plan.channels_per_group * vecs, 0
            sample_stride, group_stride = plan.channels * vecs, plan.channels_per_group * vecs
        else:
            rows, row_vecs, row_stride, sample_stride, group_stride = plan.batch, vecs, plan.channels * vecs, 0, vecs
        pb.launch(launch.steps[0], x=x, y=pb["y"], w=w, b=b, mean_out=mean, rstd_out=rstd, running_mean=rm,
                  running_var=rv, rows=rows, row_vecs=row_vecs, row_stride=row_stride, sample_stride=sample_stride,
                  group_stride=group_stride, spatial_vecs=vecs, channels_per_group=plan.channels_per_group,
                  groups=plan.groups, eps=eps, momentum=momentum)
        return pb
    if not launch.workspace_words:  # eval mode in one launch: the epilogue reads the running buffers
        pb.launch(launch.steps[0], affine=None, running_mean=rm, running_var=rv, **apply)
        return pb
    # the partials, then the (pivot, center, scale) of each statistic group
    affine_words = 0 if launch.tier == "channel_folded" else 3 * plan.statistic_groups
    ws = pb.workspace((launch.workspace_words - affine_words) * acc_bytes)
    affine = pb.workspace(affine_words * acc_bytes) if affine_words else None
    if launch.stream is not None:
        sync = pb.workspace(4 * (1 + 2 * plan.statistic_groups), zeroed=True)
        pb.launch(launch.steps[0], x=x, y=pb["y"], w=w, b=b, partial=ws, affine=affine, mean_out=mean, rstd_out=rstd,
                  sync=sync, groups_total=plan.statistic_groups,
                  group_vecs=plan.channels_per_group * plan.spatial // plan.vec,
                  spatial_vecs=plan.spatial // plan.vec, channels_per_group=plan.channels_per_group,
                  groups=plan.groups, tile_vecs=launch.chunk_vecs, row_tiles=launch.chunks,
                  slab_tiles=launch.stream.slab_tiles, lag_slabs=launch.stream.lag, hints=launch.hints, eps=eps)
        return pb
    if from_running:
        pb.launch(launch.steps[0], running_mean=rm, running_var=rv, affine=affine, mean_out=mean, rstd_out=rstd,
                  channels=plan.channels, eps=eps)
    else:
        pb.launch(launch.steps[0], x=x, partial=ws, **dims, chunks=launch.chunks, chunk_len=launch.chunk_vecs)
        if launch.tier == "channel_folded":  # the apply finalizes each group itself
            pb.launch(launch.steps[1], affine=None, running_mean=None, running_var=None,
                      **{**apply, "partial": ws, "mean_out": mean, "rstd_out": rstd})
            return pb
        pb.launch(launch.steps[1], x=x, partial=ws, affine=affine, mean_out=mean, rstd_out=rstd, running_mean=rm,
                  running_var=rv, **dims, chunks=launch.chunks, eps=eps, momentum=momentum)
    if launch.tier == "channel_statistics":  # (SyncBatchNorm's per-rank statistics alone, no y: sync_batch.py)
        return pb
    pb.launch(launch.steps[-1], affine=affine, running_mean=None, running_var=None, **apply)
    return pb


@functools.lru_cache(maxsize=1024)
def _planned(norm, dtype, pdtype, flags, last, batch, channels, spatial, channels_per_group, per_sample, x_mod,
             y_mod, from_running, returns_stats, device_id, override_items=(), out_dtype=None):
    """(plan, launch) of a call; launch None for the row family's path."""
    plan = plans.make_channel_plan(norm, dtype, pdtype, flags, last, batch, channels, spatial, channels_per_group,
                                   per_sample, x_mod, y_mod, out_dtype)
    override = dict(override_items)
    walk = override.pop("walk", None)
    if walk not in (None, "split", "stream", "rows", "onchip"):
        raise ValueError(f"unknown channel walk override {walk!r}; expected 'split', 'stream' or 'rows'")
    device = launches.device_info(device_id)
    if walk is None and not from_running:
        walk = dispatch_channels.choose_channel_walk(plan, device)
    if walk == "rows":
        if from_running or not dispatch_channels.channel_rows_fast(plan):
            raise ValueError("the rows walk takes GroupNorm and InstanceNorm without parameters, channels-first")
        return plan, None
    if walk == "onchip":
        if from_running or dispatch_channels.onchip_shape(plan, device, override) is None:
            threads, elements, cluster = dispatch_channels.ONCHIP_SHAPES[-1]
            raise ValueError("channel_onchip takes training-mode calls whose statistic group fits its shape (at most "
                             f"{threads} threads x {elements} elements x a cluster of {cluster}; clusters from sm_90), "
                             "channels-last only GroupNorm/InstanceNorm groups of whole vectors; got "
                             f"{plan.norm}_norm, groups of "
                             f"{dispatch_channels.onchip_group_vecs(plan) * plan.vec} elements, "
                             f"{'channels-last' if plan.channels_last else 'channels-first'}, vectors of {plan.vec}, "
                             f"shape override {override or None}")
        launch = dispatch_channels.choose_channel_onchip(plan, device, override)
    elif walk == "stream":
        if from_running or not dispatch_channels.stream_fits(plan, device):
            raise ValueError("channel_stream takes GroupNorm and InstanceNorm in training, channels-first x in "
                             "16-byte vectors, groups of at most a quarter of L2; got "
                             f"{plan.norm}_norm, {'channels-last' if plan.channels_last else 'channels-first'}, "
                             f"{plan.vec * plan.dtype.itemsize}-byte vectors, groups of "
                             f"{plan.channels_per_group * plan.spatial * plan.dtype.itemsize} bytes")
        launch = dispatch_channels.choose_channel_stream(plan, device, override)
    else:
        launch = dispatch_channels.choose_channels(plan, device, from_running=from_running, returns_stats=returns_stats,
                                                   override=override)
    for step in launch.steps:
        launches.check_limits(step, device)
    return plan, launch
