"""SyncBatchNorm over torch.distributed: BatchNorm whose training
statistics are those of the batch of every rank of a process group.

Forward, per rank (the launches: cunorm/_engine/sync_batch.py):
  1. its per-channel count, mean and rstd with eps 0 (x read once), into a
     (3, C) block;
  2. one collective: every rank's block gathered;
  3. one launch combines them in rank order (Chan's pairwise update), so
     every rank holds the same bits, run to run, and updates the running
     buffers as torch does (the unbiased variance over the global count);
  4. y from cunorm's BatchNorm with the global mean and variance as its
     statistics (one launch).
Backward, per rank: the per-channel sums of dy and dy * (x - mean) over
its own batch (dy and x read once), one collective for every rank's sums,
then dx from the ranks' sums added in rank order (dy and x read once
more, dx written). The weight and bias gradients are the rank's own sums,
as torch's SyncBatchNorm returns them (DistributedDataParallel averages
them across ranks).

Each phase runs a cached Program over the tensors' raw pointers on torch's
current stream; the global count stays on the GPU, so a step synchronizes
with the host nowhere. Ranks with an empty batch send count 0 and change
nothing, as in torch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .._engine import calls, dtypes, plans, sync_batch
from .._interop import torch as interop
from ._layers import batch_forward

#: what torch raises for a training step of one value a channel
_ONE_VALUE = "Expected more than 1 value per channel when training, got input size {}"


def _run(program, device: int, **tensors) -> None:
    """program over the tensors' pointers by slot name (absent: null), on
    torch's current stream, its workspaces from torch's allocator."""
    pointers = tuple(0 if tensors.get(slot) is None else tensors[slot].data_ptr() for slot in program.slots)
    program.run(pointers, interop.stream(device), interop.workspace_allocator(device))


def _dense(x: Tensor) -> tuple[Tensor, bool]:
    """(x, channels_last): x where it is dense in one of the two layouts,
    else its contiguous copy."""
    last = sync_batch.layout(x.shape, x.stride())
    if last is None:
        x = x.contiguous()
        last = sync_batch.layout(x.shape, x.stride())
    return x, last


def local_statistics(x: Tensor) -> Tensor:
    """(3, C): this rank's count, mean and rstd with eps 0 per channel, in
    the statistics' dtype (zeros for an empty batch; a channel without
    spread has rstd inf)."""
    channels = x.shape[1]
    acc = interop.ACCUMULATION[x.dtype]
    count = x.numel() // channels
    if count <= 1:  # (one value is valid here: the global count decides)
        out = torch.zeros(3, channels, dtype=acc, device=x.device)
        if count:
            out[0] = 1
            out[1] = x.reshape(channels)
            out[2] = float("inf")
        return out
    out = torch.empty(3, channels, dtype=acc, device=x.device)
    out[0].fill_(count)
    x, last = _dense(x)
    device = x.get_device()
    with interop.scope(device):
        program = sync_batch.statistics_program(interop.NUMPY_DTYPE[x.dtype], last, tuple(x.shape),
                                                x.data_ptr() % 32, device)
    _run(program, device, x=x, mean=out[1], rstd=out[2])
    return out


def gathered(t: Tensor, group, world: int) -> Tensor:
    """(world, *t.shape): every rank's ``t``, row r rank r's."""
    out = torch.empty((world,) + tuple(t.shape), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, t.contiguous(), group=group)
    return out


def combine(blocks: Tensor, running_mean, running_var, eps: float, momentum: float):
    """(mean, var, rstd, count) of every rank's batch from the gathered
    (ranks, 3, C) blocks, in rank order; the running buffers (when given)
    updated in place."""
    ranks, _, channels = blocks.shape
    device = blocks.get_device()
    acc = blocks.dtype
    mean, var, rstd = (torch.empty(channels, dtype=acc, device=blocks.device) for _ in range(3))
    count = torch.empty(1, dtype=acc, device=blocks.device)
    running = [running_mean, running_var] if running_mean is not None and running_var is not None else [None, None]
    held = [b if b is None or (b.dtype == acc and b.is_contiguous()) else b.to(acc).contiguous() for b in running]
    with interop.scope(device):
        program = sync_batch.combine_program(interop.NUMPY_DTYPE[acc], ranks, channels, float(eps), float(momentum),
                                             device)
    _run(program, device, gathered=blocks, running_mean=held[0], running_var=held[1], mean=mean, var=var, rstd=rstd,
         count=count)
    for buf, h in zip(running, held):
        if h is not buf:
            buf.copy_(h)
    return mean, var, rstd, count


class SyncBatchNormFunction(torch.autograd.Function):
    """y of SyncBatchNorm in training over ``world`` ranks of ``group``;
    updates the running buffers (when given) in place."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group, world):
        if x.numel() // x.shape[1] == 1 and world < 2:  # (as torch: ranks that may add values are not waited for)
            raise ValueError(_ONE_VALUE.format(list(x.shape)))
        blocks = gathered(local_statistics(x), group, world)
        mean, var, rstd, count = combine(blocks, running_mean, running_var, eps, momentum)
        y = calls.channels("batch", x, None, weight, bias, mean, var, False, 0.1, eps, 1, False, None) \
            if x.numel() else torch.empty_like(x)
        ctx.save_for_backward(x, weight, bias, mean, rstd, count)
        ctx.group, ctx.world = group, world
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd, count = ctx.saved_tensors
        channels = x.shape[1]
        params = [p for p in (weight, bias) if p is not None]
        if not x.numel():
            local = torch.zeros(channels, 2, dtype=mean.dtype, device=x.device)
            gathered(local, ctx.group, ctx.world)
            dw = None if weight is None else torch.zeros_like(weight)
            db = None if bias is None else torch.zeros_like(bias)
            return _grads(ctx, torch.zeros_like(x), dw, db)
        x, last = _dense(x)
        device = x.get_device()
        x_dtype = interop.NUMPY_DTYPE[x.dtype]
        flags = (plans.FLAG_WEIGHT if weight is not None else 0) | (plans.FLAG_BIAS if bias is not None else 0)
        pdtype = dtypes.param_storage(x_dtype, [interop.NUMPY_DTYPE[p.dtype] for p in params]) if params else None
        kernel_param = None if pdtype is None else interop.TORCH_DTYPE[pdtype]
        w = None if weight is None else weight.detach().to(kernel_param).contiguous()
        if not plans.same_layout(tuple(x.shape), dy.stride(), x.stride()) or dy.data_ptr() % 16:
            dy = torch.empty_like(x).copy_(dy)  # (x's dense layout: empty_like keeps it)
        dx = torch.empty_like(x)
        dw = None if weight is None else torch.empty(channels, dtype=kernel_param, device=x.device)
        db = None if bias is None else torch.empty(channels, dtype=kernel_param, device=x.device)
        local = torch.empty(channels, 2, dtype=mean.dtype, device=x.device)
        with interop.scope(device):
            before, after = sync_batch.grad_programs(x_dtype, pdtype, flags, last, tuple(x.shape), x.data_ptr() % 32,
                                                     dx.data_ptr() % 32, ctx.world, device)
        tensors = dict(dy=dy, x=x, dx=dx, mean=mean, rstd=rstd, w=w, dw=dw, db=db)
        _run(before, device, totals=local, **tensors)
        _run(after, device, gathered=gathered(local, ctx.group, ctx.world), count=count, **tensors)
        dw = None if dw is None else dw.to(weight.dtype)
        db = None if db is None else db.to(bias.dtype)
        return _grads(ctx, dx, dw, db)


def _grads(ctx, dx, dw, db):
    return (dx, dw if ctx.needs_input_grad[1] else None, db if ctx.needs_input_grad[2] else None,
            None, None, None, None, None, None)


class SyncBatchNorm(torch.nn.SyncBatchNorm):
    """``torch.nn.SyncBatchNorm`` computed by cunorm (same arguments,
    parameters, buffers, state_dict and ``process_group``). In training
    under an initialized process group of more than one rank, the statistics
    are those of every rank's batch (one collective forward, one backward);
    otherwise it is cunorm's BatchNorm, as torch's falls back to its own."""

    def forward(self, x: Tensor) -> Tensor:
        self._check_input_dim(x)
        self._check_non_zero_input_channels(x)
        group = self.process_group or (dist.group.WORLD if dist.is_available() and dist.is_initialized() else None)
        world = dist.get_world_size(group) if group is not None else 1
        if not (self.training and world > 1):
            return batch_forward(self, x)
        if x.device.type != "cuda":
            raise ValueError(f"SyncBatchNorm expected input tensor to be on a CUDA device, got {x.device}")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # the cumulative average
                factor = 1.0 / float(self.num_batches_tracked)
        running = (self.running_mean, self.running_var) if self.track_running_stats else (None, None)
        return SyncBatchNormFunction.apply(x, self.weight, self.bias, *running, self.eps, factor, group, world)


SyncBatchNorm.__module__ = "cunorm.torch"
SyncBatchNorm._cunorm_original = torch.nn.SyncBatchNorm  # (runs_original's fallback: torch's own forward)
SyncBatchNorm._cunorm_fused_original = True


def convert_sync_batchnorm(module: torch.nn.Module, process_group=None) -> torch.nn.Module:
    """``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` with cunorm's
    SyncBatchNorm: every BatchNorm layer of ``module`` (torch's, cunorm's,
    or a torch SyncBatchNorm) becomes a :class:`SyncBatchNorm` over
    ``process_group`` (the default group when None), keeping its
    parameters, buffers and state. Returns the converted module (a new one
    where ``module`` itself is a BatchNorm layer)."""
    converted = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    for m in converted.modules():
        if type(m) is torch.nn.SyncBatchNorm:
            m.__class__ = SyncBatchNorm
            if process_group is not None:
                m.process_group = process_group
    return converted
