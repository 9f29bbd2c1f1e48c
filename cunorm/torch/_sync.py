"""SyncBatchNorm over torch.distributed: BatchNorm whose training
statistics are those of the batch of every rank of a process group.

Forward, per rank:
  1. its per-channel (count, mean, M2) from cunorm's kernels
     (``channel_norms.batch_statistics``: channel_partial and channel_finalize,
     x read once; M2 = count / rstd ** 2 with eps 0);
  2. one collective: all ranks' (3, C) statistics gathered;
  3. every rank combines them in rank order (``sync_stats.combine``, Chan's
     pairwise update), so every rank holds the same bits, run to run;
  4. the running buffers updated as torch does (the unbiased variance over
     the global count); y from cunorm's BatchNorm with the global mean and
     variance as its statistics (one launch).
Backward, per rank (cunorm/_engine/sync_batch.py): the per-channel sums of
dy and dy * (x - mean) over its own batch (dy and x read once), one
collective for every rank's sums (added in rank order), then dx from the
global sums (dy and x read once more, dx written). The weight and bias
gradients are the rank's own sums, as torch's SyncBatchNorm returns them
(DistributedDataParallel averages them across ranks).

Ranks with an empty batch send count 0 and change nothing, as in torch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .._engine import calls, channel_norms, gradients, sync_batch, sync_stats
from ._layers import batch_forward

#: what torch raises for a training step of one value a channel
_ONE_VALUE = "Expected more than 1 value per channel when training, got input size {}"


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def local_statistics(x: Tensor) -> Tensor:
    """(3, C): this rank's count, mean and M2 per channel, in the
    statistics' dtype (zeros for an empty batch)."""
    channels = x.shape[1]
    out = torch.zeros(3, channels, dtype=_accumulation(x.dtype), device=x.device)
    count = x.numel() // channels
    if count == 1:  # (valid here: the global count decides; cunorm's batch_norm refuses one value a channel)
        out[0] = 1
        out[1] = x.reshape(channels)
    elif count:
        call = channel_norms.ChannelCall("batch", x, eps=0.0, channel_axis=1, training=True)
        with call.adapter.scope(call.x.data.device_id):
            mean, rstd = (call.adapter.from_cupy(s) for s in channel_norms.batch_statistics(call))
        out[0] = count
        out[1] = mean
        out[2] = (rstd.double().pow(-2) * count).to(out.dtype)  # (rstd inf: variance 0)
    return out


def gathered(t: Tensor, group, world: int) -> Tensor:
    """(world, *t.shape): every rank's ``t``, row r rank r's."""
    out = torch.empty((world,) + tuple(t.shape), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, t.contiguous(), group=group)
    return out


class SyncBatchNormFunction(torch.autograd.Function):
    """y of SyncBatchNorm in training over ``world`` ranks of ``group``;
    updates the running buffers (when given) in place."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group, world):
        stats = gathered(local_statistics(x), group, world)
        count, mean, m2 = sync_stats.combine(stats[:, 0], stats[:, 1], stats[:, 2])
        total = int(count[0]) if count.numel() else 0  # (one host sync, as torch's)
        if total <= 1:
            raise ValueError(_ONE_VALUE.format(list(x.shape)))
        var = m2 / total
        if running_mean is not None and running_var is not None:
            new_mean, new_var = sync_stats.running_update(running_mean.to(mean.dtype), running_var.to(var.dtype),
                                                          mean, m2, total, momentum)
            running_mean.copy_(new_mean)
            running_var.copy_(new_var)
        y = calls.channels("batch", x, None, weight, bias, mean, var, False, 0.1, eps, 1, False, None) \
            if x.numel() else torch.empty_like(x)
        ctx.save_for_backward(x, weight, bias, mean, torch.rsqrt(var + eps))
        ctx.eps, ctx.group, ctx.world, ctx.total = eps, group, world, total
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        dw = db = None
        if x.numel():
            g = gradients.ChannelGradCall("batch", dy, x, mean, rstd, weight=weight, bias=bias, channel_axis=1,
                                          training=True, eps=ctx.eps)
            pending, local, dw, db = sync_batch.grad_totals(g)
        else:
            local = torch.zeros(x.shape[1], 2, dtype=mean.dtype, device=x.device)
            dw = None if weight is None else torch.zeros_like(weight)
            db = None if bias is None else torch.zeros_like(bias)
        sums = gathered(local, ctx.group, ctx.world)
        total = sums[0]
        for r in range(1, ctx.world):  # rank order: the same bits on every rank
            total = total + sums[r]
        dx = sync_batch.grad_apply(pending, total, ctx.total) if x.numel() else torch.zeros_like(x)
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
