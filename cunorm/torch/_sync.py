"""SyncBatchNorm over torch.distributed: BatchNorm whose training
statistics are those of the batch of every rank of a process group.

Forward, per rank (the launches: cunorm/_engine/sync_batch.py):
  1. its per-channel count, mean and rstd with eps 0 (x read once), into a
     (3, C) block;
  2. one collective: every rank's block gathered;
  3. one launch combines them in rank order (Chan's pairwise update), so
     every rank holds the same bits, run to run, and updates the running
     buffers as torch does (the unbiased variance over the global count);
  4. y: BatchNorm's eval-form apply with the global mean and variance as
     its statistics (one launch).
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

from .._engine import dtypes, plans, sync_batch
from .._engine.caches import BoundedCache
from .._interop import torch as interop
from ._layers import batch_forward

#: what torch raises for a training step of one value a channel
_ONE_VALUE = "Expected more than 1 value per channel when training, got input size {}"

#: the Programs of every phase by (builder, arguments): a step looks each up
#: without entering the device's CuPy scope, which only building needs
_PROGRAMS = BoundedCache(1024)


def _program(build, *key):
    """``build(*key)`` (sync_batch's, device id last), built on first use."""
    program = _PROGRAMS.get((build, key))
    if program is None:
        with interop.scope(key[-1]):
            program = build(*key)
        _PROGRAMS.put((build, key), program)
    return program


def _run(program, device: int, **arrays) -> None:
    """program over the arrays by slot name (a tensor, a raw pointer, or
    absent: null), on torch's current stream, its workspaces from torch's
    allocator."""
    pointers = tuple(0 if a is None else a if type(a) is int else a.data_ptr()
                     for a in map(arrays.get, program.slots))
    program.run(pointers, interop.stream(device), interop.workspace_allocator(device))


def _dense(x: Tensor) -> tuple[Tensor, bool]:
    """(x, channels_last): x where it is dense in one of the two layouts,
    else its contiguous copy."""
    last = sync_batch.layout(x.shape, x.stride())
    if last is None:
        x = x.contiguous()
        last = sync_batch.layout(x.shape, x.stride())
    return x, last


def _kernel_params(x_dtype, weight, bias):
    """(flags, parameter dtype, w, b): the parameters as the kernels read
    them (one dtype, contiguous; absent: None)."""
    params = [p for p in (weight, bias) if p is not None]
    if not params:
        return 0, None, None, None
    pdtype = dtypes.param_storage(x_dtype, [interop.NUMPY_DTYPE[p.dtype] for p in params])
    kind = interop.TORCH_DTYPE[pdtype]
    w, b = (None if p is None else p.detach().to(kind).contiguous() for p in (weight, bias))
    flags = (plans.FLAG_WEIGHT if weight is not None else 0) | (plans.FLAG_BIAS if bias is not None else 0)
    return flags, pdtype, w, b


def _row(block: Tensor, row: int) -> int:
    """The address of row ``row`` of a C-contiguous 2-D block."""
    return block.data_ptr() + row * block.stride(0) * block.element_size()


def local_statistics(x: Tensor, last: bool) -> Tensor:
    """(3, C): this rank's count, mean and rstd with eps 0 per channel, in
    the statistics' dtype (zeros for an empty batch; a channel without
    spread has rstd inf). x dense (``last``: channels-last)."""
    channels = x.shape[1]
    acc = interop.ACCUMULATION[x.dtype]
    count = x.numel() // channels
    out = torch.full((3, channels), float(count), dtype=acc, device=x.device)
    if count == 1:  # (valid here: the global count decides)
        out[1] = x.reshape(channels)
        out[2] = float("inf")
    if count <= 1:  # (an empty batch: all zeros)
        return out
    device = x.get_device()
    program = _program(sync_batch.statistics_program, interop.NUMPY_DTYPE[x.dtype], last, tuple(x.shape),
                       x.data_ptr() % 32, device)
    _run(program, device, x=x, mean=_row(out, 1), rstd=_row(out, 2))
    return out


def gathered(t: Tensor, group, world: int) -> Tensor:
    """(world, *t.shape): every rank's ``t``, row r rank r's."""
    out = torch.empty((world,) + tuple(t.shape), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, t.contiguous(), group=group)
    return out


def combine(blocks: Tensor, running_mean, running_var, eps: float, momentum: float) -> Tensor:
    """(4, C): the mean, variance and rstd of every rank's batch and (at
    [3, 0]) its count, from the gathered (ranks, 3, C) blocks in rank
    order; the running buffers (when given) updated in place."""
    ranks, _, channels = blocks.shape
    device = blocks.get_device()
    acc = blocks.dtype
    out = torch.empty(4, channels, dtype=acc, device=blocks.device)
    running = [running_mean, running_var] if running_mean is not None and running_var is not None else [None, None]
    held = [b if b is None or (b.dtype == acc and b.is_contiguous()) else b.to(acc).contiguous() for b in running]
    program = _program(sync_batch.combine_program, interop.NUMPY_DTYPE[acc], ranks, channels, float(eps),
                       float(momentum), device)
    _run(program, device, gathered=blocks, running_mean=held[0], running_var=held[1], mean=out, var=_row(out, 1),
         rstd=_row(out, 2), count=_row(out, 3))
    for buf, h in zip(running, held):
        if h is not buf:
            buf.copy_(h)
    return out


class SyncBatchNormFunction(torch.autograd.Function):
    """y of SyncBatchNorm in training over ``world`` ranks of ``group``;
    updates the running buffers (when given) in place."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group, world):
        if x.numel() // x.shape[1] == 1 and world < 2:  # (as torch: ranks that may add values are not waited for)
            raise ValueError(_ONE_VALUE.format(list(x.shape)))
        x, last = _dense(x) if x.numel() else (x, False)
        stats = combine(gathered(local_statistics(x, last), group, world), running_mean, running_var, eps, momentum)
        x_dtype = interop.NUMPY_DTYPE[x.dtype]
        flags, pdtype, w, b = _kernel_params(x_dtype, weight, bias)
        y = torch.empty_like(x)
        if x.numel():
            device = x.get_device()
            program = _program(sync_batch.apply_program, x_dtype, pdtype, flags, last, tuple(x.shape),
                               x.data_ptr() % 32, y.data_ptr() % 32, float(eps), device)
            _run(program, device, x=x, y=y, w=w, b=b, running_mean=stats, running_var=_row(stats, 1))
        ctx.save_for_backward(x, w, stats)
        ctx.group, ctx.world, ctx.last, ctx.flags, ctx.pdtype = group, world, last, flags, pdtype
        ctx.param_dtypes = (None if weight is None else weight.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, stats = ctx.saved_tensors
        channels = x.shape[1]
        weight_dtype, bias_dtype = ctx.param_dtypes
        if not x.numel():
            local = torch.zeros(channels, 2, dtype=stats.dtype, device=x.device)
            gathered(local, ctx.group, ctx.world)
            dw = None if weight_dtype is None else torch.zeros(channels, dtype=weight_dtype, device=x.device)
            db = None if bias_dtype is None else torch.zeros(channels, dtype=bias_dtype, device=x.device)
            return _grads(ctx, torch.zeros_like(x), dw, db)
        device = x.get_device()
        if not plans.same_layout(tuple(x.shape), dy.stride(), x.stride()) or dy.data_ptr() % 16:
            dy = torch.empty_like(x).copy_(dy)  # (x's dense layout: empty_like keeps it)
        dx = torch.empty_like(x)
        kind = None if ctx.pdtype is None else interop.TORCH_DTYPE[ctx.pdtype]
        dw = None if weight_dtype is None else torch.empty(channels, dtype=kind, device=x.device)
        db = None if bias_dtype is None else torch.empty(channels, dtype=kind, device=x.device)
        local = torch.empty(channels, 2, dtype=stats.dtype, device=x.device)
        before, after = _program(sync_batch.grad_programs, interop.NUMPY_DTYPE[x.dtype], ctx.pdtype, ctx.flags,
                                 ctx.last, tuple(x.shape), x.data_ptr() % 32, dx.data_ptr() % 32, ctx.world, device)
        arrays = dict(dy=dy, x=x, dx=dx, mean=stats, rstd=_row(stats, 2), w=w, dw=dw, db=db)
        _run(before, device, totals=local, **arrays)
        _run(after, device, gathered=gathered(local, ctx.group, ctx.world), count=_row(stats, 3), **arrays)
        dw = None if dw is None else dw.to(weight_dtype)
        db = None if db is None else db.to(bias_dtype)
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
