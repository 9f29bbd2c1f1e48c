"""SyncBatchNorm's launches for a front end that runs its collectives
(cunorm/torch/_sync.py): each phase one Program, built here and cached by
the front end (one bounded cache, looked up outside the device scope that
building needs), run over the front end's raw pointers on its stream, so a
training step costs a few launches beside the two collectives.

Forward, around its collective:
  ``statistics_program``: the rank's count written into its block's count
  row (channel_sync_count), then its per-channel mean and rstd with eps 0
  (channel_partial and channel_finalize, x read once) into the block's
  mean and rstd rows: the (3, channels) block the collective gathers;
  ``apply_program``: channel_sync_combine over the gathered (ranks, 3,
  channels) blocks, in rank order (the global mean, variance, rstd and
  count, the running buffers updated), then y, BatchNorm's eval-form apply
  reading that mean and variance.
Backward (``grad_programs``), around its collective:
  before it, channel_grad_sums, combine and finalize: the rank's
  (channels, 2) totals of dy and dy * (x - mean), and its own dweight and
  dbias;
  after it, finalize over the gathered (ranks, channels, 2) totals with
  the global count read from the GPU, then channel_grad_apply writes dx.
Every rank runs the same launches over the same gathered bytes, so every
rank forms the same statistics and coefficients.
"""
from __future__ import annotations

import dataclasses
import math

from . import channel_norms, declarations as K, dtypes, launches, plans
from .dispatch_rows import Step
from .gradients import _channel_launch, build_channel_grad_sums, channel_grad_dims

#: threads a block of the one-thread-a-channel launches
_THREADS = 256

#: the statistics' slots: channel_norms.CHANNEL_SLOTS (mean and rstd: the
#: block's rows) and the block's count row
STATISTICS_SLOTS = channel_norms.CHANNEL_SLOTS + ("count_row",)
#: the apply's slots: channel_norms.CHANNEL_SLOTS, whose running_mean and
#: running_var are where the combine writes the global mean and variance
#: for the apply to read, and the combine's own: the gathered blocks, the
#: layer's running buffers (absent: not tracked), the global rstd and count
APPLY_SLOTS = channel_norms.CHANNEL_SLOTS + ("gathered", "buffer_mean", "buffer_var", "global_rstd", "count")
#: the backward's slots (both Programs)
GRAD_SLOTS = ("dy", "x", "dx", "mean", "rstd", "w", "dw", "db", "totals", "gathered", "count")
#: the split walk: the one-launch channel_grad_onchip backward has no point
#: between its sums and dx for the collective
_SPLIT = (("walk", "split"),)


def layout(shape, strides) -> bool | None:
    """True for channels-last x (element strides), False for
    channels-first, None for neither (then copied first)."""
    return plans.channel_layout(tuple(shape), tuple(strides), 1, False)


def dims(shape) -> tuple[int, int, int]:
    """(batch, channels, spatial) of x (N, C, *)."""
    return shape[0], shape[1], math.prod(shape[2:])


def statistics_program(dtype, last: bool, shape: tuple, x_mod: int, device: int) -> launches.Program:
    """STATISTICS_SLOTS: x in; count_row, mean and rstd (eps 0) out."""
    batch, channels, spatial = dims(shape)
    plan, launch = channel_norms._planned("batch", dtype, None, 0, last, batch, channels, spatial, 1, False, x_mod,
                                          x_mod, False, True, device, _SPLIT)
    pb = launches.ProgramBuilder(STATISTICS_SLOTS, device)
    acc = dtypes.KERNEL_TYPE[dtypes.accumulation(dtype)]
    _per_channel(pb, K.CHANNEL_SYNC_COUNT(acc), channels, device, count=pb["count_row"], value=float(batch * spatial))
    alone = dataclasses.replace(launch, tier="channel_statistics", steps=launch.steps[:2])
    return channel_norms.build_channels(pb, plan, alone, False, 0.0, 0.0, True, (False, False)).build()


def apply_program(dtype, pdtype, flags: int, last: bool, shape: tuple, x_mod: int, y_mod: int, ranks: int,
                  eps: float, momentum: float, tracked: bool, device: int) -> launches.Program:
    """APPLY_SLOTS: the gathered blocks, x, w, b in; the global statistics
    and y out, the running buffers (``tracked``) updated."""
    batch, channels, spatial = dims(shape)
    acc = dtypes.KERNEL_TYPE[dtypes.accumulation(dtype)]
    pb = launches.ProgramBuilder(APPLY_SLOTS, device)
    buffers = (pb["buffer_mean"], pb["buffer_var"]) if tracked else (None, None)
    _per_channel(pb, K.CHANNEL_SYNC_COMBINE(acc), channels, device, gathered=pb["gathered"],
                 running_mean=buffers[0], running_var=buffers[1], mean=pb["running_mean"], var=pb["running_var"],
                 rstd=pb["global_rstd"], count=pb["count"], ranks=ranks, eps=eps, momentum=momentum)
    if batch * spatial:
        plan, launch = channel_norms._planned("batch", dtype, pdtype, flags, last, batch, channels, spatial, 1,
                                              False, x_mod, y_mod, True, False, device)
        channel_norms.build_channels(pb, plan, launch, True, eps, 0.0, False, (True, True))
    return pb.build()


def _per_channel(pb, kernel, channels: int, device: int, **args) -> None:
    """``kernel``'s launch a thread a channel (_THREADS a block) into pb,
    its limits checked."""
    step = Step(kernel, (-(-channels // _THREADS),), (_THREADS,))
    launches.check_limits(step, launches.device_info(device))
    pb.launch(step, channels=channels, **args)


def grad_programs(dtype, pdtype, flags: int, last: bool, shape: tuple, x_mod: int, dx_mod: int, ranks: int,
                  device: int) -> tuple[launches.Program, launches.Program]:
    """(before, after) the backward's collective, over GRAD_SLOTS: before
    writes totals, dw and db; after reads gathered and count, writes dx."""
    batch, channels, spatial = dims(shape)
    plan = plans.make_channel_plan("batch", dtype, pdtype, flags, last, batch, channels, spatial, 1, False, x_mod,
                                   dx_mod)
    launch = _channel_launch(plan, True, device, _SPLIT)
    coeffs_bytes = plan.batch * plan.channels * 3 * dtypes.accumulation(plan.dtype).itemsize
    weight, bias = plan.flags & plans.FLAG_WEIGHT, plan.flags & plans.FLAG_BIAS

    before = launches.ProgramBuilder(GRAD_SLOTS, device)
    x = before["x"]  # (the slots of both Programs are the same)
    finalize = {"mean": before["mean"], "rstd": before["rstd"], "w": before["w"] if weight else x,
                **channel_grad_dims(plan)}
    sums = build_channel_grad_sums(before, plan, launch)
    before.launch(launch.steps[2], sums=sums, count_at=None, coeffs=before.workspace(coeffs_bytes),
                  dw=before["dw"] if weight else x, db=before["db"] if bias else x, totals=before["totals"],
                  sums_batch=plan.batch, count=float(plan.batch * plan.spatial), **finalize)  # (coeffs: not used)

    after = launches.ProgramBuilder(GRAD_SLOTS, device)
    coeffs = after.workspace(coeffs_bytes)
    # the ranks' dweight and dbias, which this finalize also forms, go to
    # scratch (each rank's own came before the collective)
    scratch_w, scratch_b = after.workspace(plan.channels * 8), after.workspace(plan.channels * 8)
    after.launch(launch.steps[2], sums=after["gathered"], count_at=after["count"], coeffs=coeffs, dw=scratch_w,
                 db=scratch_b, totals=None, sums_batch=ranks, count=1.0, **finalize)  # (count_at holds it)
    after.launch(launch.steps[3], dy=after["dy"], x=x, dx=after["dx"], mean=after["mean"], coeffs=coeffs,
                 **channel_grad_dims(plan), chunks=launch.chunks, chunk_len=launch.chunk_len)
    return before.build(), after.build()
