"""SyncBatchNorm's backward on the GPU, in the two halves its collective
separates (the front end, cunorm/torch/_sync.py, runs the collective).

Before it (``grad_totals``): the channel backward's first pass over dy and
x (channel_grad_sums and its combine), then channel_grad_finalize, which
adds each channel's sums over the rank's batch in order and writes them as
(channels, 2) totals, with the rank's own dweight and dbias.
After it (``grad_apply``): channel_grad_finalize again over the ranks'
totals added, as one sample, with the global count, forming dx's
coefficients; then channel_grad_apply writes dx, x and dy read once more.
Nothing is launched between the halves but the collective and the ranks'
totals added in rank order, so every rank forms the same coefficients.
"""
from __future__ import annotations

import dataclasses
import functools

from . import dtypes, gradients, launches, plans

#: the slots of both halves' Programs
SLOTS = ("dy", "x", "dx", "mean", "rstd", "w", "dw", "db", "totals")
#: the launch every rank runs: the split walk (the one-launch channel_grad_onchip
#: backward has no point between its sums and dx)
_SPLIT = (("walk", "split"),)


@dataclasses.dataclass
class Pending:
    """What grad_apply needs of grad_totals' call."""

    call: object
    arrays: gradients.ChannelGradArrays
    plan: plans.ChannelPlan
    launch: object


def grad_totals(g: gradients.ChannelGradCall):
    """(pending, totals, dweight, dbias) of a training-mode batch_norm
    backward over this rank's non-empty x, as the caller's arrays: totals
    the (channels, 2) sums of dy and dy * (x - mean) in the accumulation
    dtype; dweight and dbias this rank's own (None where absent)."""
    import cupy

    call = g.call
    if call.norm != "batch" or not g.training or not call.x.size:
        raise ValueError("grad_totals takes a training-mode batch_norm backward over a non-empty x")
    with call.adapter.scope(call.x.data.device_id):
        a = gradients.channel_grad_arrays(g)
        plan = a.plan(call)
        device = a.x.data.device_id
        launch = gradients._channel_launch(plan, True, device, _SPLIT)
        totals = cupy.empty((plan.channels, 2), dtype=dtypes.accumulation(a.x.dtype))
        _totals_program(plan, launch, device).run_named(dict(a.named(), totals=totals), launches.cupy_stream(),
                                                        launches.cupy_alloc)
        dw, db = gradients._param_grads(call, a.dw, a.db, empty=False)
        wrap = call.adapter.from_cupy
        return (Pending(call, a, plan, launch), wrap(totals), None if dw is None else wrap(dw),
                None if db is None else wrap(db))


def grad_apply(pending: Pending, totals, count: int):
    """dx (the caller's array type) from every rank's totals added
    ((channels, 2), the accumulation dtype, any array the adapter takes) and
    the number of values a channel has over every rank."""
    call, a = pending.call, pending.arrays
    with call.adapter.scope(a.x.data.device_id):
        totals = gradients._contiguous(call.adapter.to_cupy(totals, "totals"))
        want = (pending.plan.channels, 2)
        if tuple(totals.shape) != want or totals.dtype != dtypes.accumulation(a.x.dtype):
            raise ValueError(f"totals must be {want} in {dtypes.accumulation(a.x.dtype)}, got "
                             f"{tuple(totals.shape)} in {totals.dtype}")
        program = _apply_program(pending.plan, pending.launch, a.x.data.device_id, int(count))
        program.run_named(dict(a.named(), totals=totals), launches.cupy_stream(), launches.cupy_alloc)
        return call.adapter.from_cupy(a.dx)


def _finalize_args(pb, plan):
    x = pb["x"]
    weight, bias = plan.flags & plans.FLAG_WEIGHT, plan.flags & plans.FLAG_BIAS
    return {"mean": pb["mean"], "rstd": pb["rstd"], "w": pb["w"] if weight else x,
            "batch": plan.batch, "spatial": plan.spatial, "channels": plan.channels,
            "channels_per_group": plan.channels_per_group, "stat_batch": 0}, bool(weight), bool(bias)


@functools.lru_cache(maxsize=256)
def _totals_program(plan, launch, device) -> launches.Program:
    pb = launches.ProgramBuilder(SLOTS, device)
    acc_bytes = dtypes.accumulation(plan.dtype).itemsize
    members = plan.batch * plan.channels
    partial = pb.workspace(members * launch.chunks * 2 * acc_bytes)
    sums = pb.workspace(members * 2 * acc_bytes)
    coeffs = pb.workspace(members * 3 * acc_bytes)  # (this rank's alone: not used)
    chunking = {"chunks": launch.chunks, "chunk_len": launch.chunk_len}
    dims = {"batch": plan.batch, "spatial": plan.spatial, "channels": plan.channels,
            "channels_per_group": plan.channels_per_group, "stat_batch": 0}
    pb.launch(launch.steps[0], dy=pb["dy"], x=pb["x"], mean=pb["mean"], partial=partial, **dims, **chunking)
    pb.launch(launch.steps[1], partial=partial, sums=sums, members=members, chunks=launch.chunks)
    args, weight, bias = _finalize_args(pb, plan)
    pb.launch(launch.steps[2], sums=sums, coeffs=coeffs, dw=pb["dw"] if weight else pb["x"],
              db=pb["db"] if bias else pb["x"], totals=pb["totals"], sums_batch=plan.batch,
              count=float(plan.batch * plan.spatial), **args)
    return pb.build()


@functools.lru_cache(maxsize=256)
def _apply_program(plan, launch, device, count: int) -> launches.Program:
    pb = launches.ProgramBuilder(SLOTS, device)
    acc_bytes = dtypes.accumulation(plan.dtype).itemsize
    coeffs = pb.workspace(plan.batch * plan.channels * 3 * acc_bytes)
    # the global dweight and dbias the finalize also forms go to scratch (the
    # rank's own were returned by grad_totals)
    dw, db = pb.workspace(plan.channels * 8), pb.workspace(plan.channels * 8)
    args, _, _ = _finalize_args(pb, plan)
    pb.launch(launch.steps[2], sums=pb["totals"], coeffs=coeffs, dw=dw, db=db, totals=None, sums_batch=1,
              count=float(count), **args)
    pb.launch(launch.steps[3], dy=pb["dy"], x=pb["x"], dx=pb["dx"], mean=pb["mean"], coeffs=coeffs,
              batch=plan.batch, spatial=plan.spatial, channels=plan.channels,
              channels_per_group=plan.channels_per_group, stat_batch=0, chunks=launch.chunks,
              chunk_len=launch.chunk_len)
    return pb.build()
