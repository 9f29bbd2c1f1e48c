"""SyncBatchNorm over torch.distributed: BatchNorm whose training
statistics are those of the batch of every rank of a process group.

Forward, per rank (the launches: cunorm/_engine/sync_batch.py):
  1. its per-channel count, mean and rstd with eps 0 (x read once), into a
     (3, C) block (one Program);
  2. one collective: every rank's block gathered (cunorm/torch/_collectives.py);
  3. one Program: a launch combines the blocks in rank order (Chan's
     pairwise update), so every rank holds the same bits, run to run, and
     updates the running buffers as torch does (the unbiased variance over
     the global count); then y, BatchNorm's eval-form apply with the
     global mean and variance as its statistics.
The rank's block, the gathered blocks and the global statistics are one
allocation, which the backward keeps.
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
from . import _collectives
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
    program.run(_pointers(program, arrays), interop.stream(device), interop.workspace_allocator(device))


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
    them (one dtype, contiguous; absent: None): the parameters themselves
    where they already are."""
    params = [p for p in (weight, bias) if p is not None]
    if not params:
        return 0, None, None, None
    pdtype = dtypes.param_storage(x_dtype, [interop.NUMPY_DTYPE[p.dtype] for p in params])
    kind = interop.TORCH_DTYPE[pdtype]
    w, b = (p if p is None or (p.dtype == kind and p.is_contiguous()) else p.detach().to(kind).contiguous()
            for p in (weight, bias))
    flags = (plans.FLAG_WEIGHT if weight is not None else 0) | (plans.FLAG_BIAS if bias is not None else 0)
    return flags, pdtype, w, b


def forward_block(channels: int, world: int, dtype, device) -> Tensor:
    """The forward's statistics, one 1-D allocation of the statistics'
    dtype: this rank's (3, C) block (count, mean, rstd) at 0, the gathered
    (world, 3, C) blocks at 3C, the global (4, C) mean, variance, rstd and
    count at gathered_end(...)."""
    return torch.empty((3 + 3 * world + 4) * channels, dtype=dtype, device=device)


def gathered_end(channels: int, world: int) -> int:
    """Where the global statistics start in the forward's block (elements)."""
    return (3 + 3 * world) * channels


def local_statistics(x: Tensor, last: bool, block: Tensor) -> None:
    """This rank's count, mean and rstd with eps 0 per channel into the
    first 3C elements of ``block`` (an empty batch: zeros; a channel
    without spread: rstd inf). x dense (``last``: channels-last)."""
    channels = x.shape[1]
    count = x.numel() // channels
    if count <= 1:  # (valid here: the global count decides)
        local = block[:3 * channels].view(3, channels)
        local.zero_()
        if count == 1:
            local[0] = 1.0
            local[1] = x.reshape(channels)
            local[2] = float("inf")
        return
    device = x.get_device()
    program = _program(sync_batch.statistics_program, interop.NUMPY_DTYPE[x.dtype], last, tuple(x.shape),
                       x.data_ptr() % 32, device)
    base, size = block.data_ptr(), block.element_size()
    _run(program, device, x=x, count_row=base, mean=base + channels * size, rstd=base + 2 * channels * size)


class SyncBatchNormFunction(torch.autograd.Function):
    """y of SyncBatchNorm in training over ``world`` ranks of ``group``;
    updates the running buffers (when given) in place. ``own``: the
    collectives through cunorm's own NCCL communicator where it can
    (cunorm/torch/_collectives.py), else torch.distributed's."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group, world, own):
        if x.numel() // x.shape[1] == 1 and world < 2:  # (as torch: ranks that may add values are not waited for)
            raise ValueError(_ONE_VALUE.format(list(x.shape)))
        x, last = _dense(x) if x.numel() else (x, False)
        channels = x.shape[1]
        device = x.get_device()
        block = forward_block(channels, world, interop.ACCUMULATION[x.dtype], x.device)
        local_statistics(x, last, block)
        _collectives.all_gather(block, 0, 3 * channels, 3 * channels, group, world, own)
        x_dtype = interop.NUMPY_DTYPE[x.dtype]
        flags, pdtype, w, b = _kernel_params(x_dtype, weight, bias)
        running = [running_mean, running_var] if running_mean is not None and running_var is not None else []
        held = [r if r.dtype == block.dtype and r.is_contiguous() else r.to(block.dtype).contiguous()
                for r in running]
        y = torch.empty_like(x)
        program = _program(sync_batch.apply_program, x_dtype, pdtype, flags, last, tuple(x.shape),
                           x.data_ptr() % 32, y.data_ptr() % 32, world, float(eps), float(momentum), bool(held),
                           device)
        base, size = block.data_ptr(), block.element_size()
        stats = base + gathered_end(channels, world) * size
        _run(program, device, x=x, y=y, w=w, b=b, gathered=base + 3 * channels * size,
             buffer_mean=held[0] if held else None, buffer_var=held[1] if held else None, running_mean=stats,
             running_var=stats + channels * size, global_rstd=stats + 2 * channels * size,
             count=stats + 3 * channels * size)
        for buf, h in zip(running, held):
            if h is not buf:
                buf.copy_(h)
        ctx.save_for_backward(x, w, block)
        ctx.group, ctx.world, ctx.own, ctx.last, ctx.flags, ctx.pdtype = group, world, own, last, flags, pdtype
        ctx.param_dtypes = (None if weight is None else weight.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, block = ctx.saved_tensors
        channels, world = x.shape[1], ctx.world
        weight_dtype, bias_dtype = ctx.param_dtypes
        acc_size = block.element_size()
        if not x.numel():
            totals = torch.zeros((1 + world) * channels * 2, dtype=block.dtype, device=x.device)
            _collectives.all_gather(totals, 0, 2 * channels, 2 * channels, ctx.group, world, ctx.own)
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
        before, after = _program(sync_batch.grad_programs, interop.NUMPY_DTYPE[x.dtype], ctx.pdtype, ctx.flags,
                                 ctx.last, tuple(x.shape), x.data_ptr() % 32, dx.data_ptr() % 32, world, device)
        # one allocation: the rank's (C, 2) totals, the gathered (world, C,
        # 2) totals, then the Programs' workspaces (one after the other on
        # the stream, so they share it)
        sums = (1 + world) * channels * 2
        workspace_at = -(-sums * acc_size // 256) * 256
        nbytes = workspace_at + max(before.workspace_bytes, after.workspace_bytes)
        scratch = torch.empty(-(-nbytes // acc_size), dtype=block.dtype, device=x.device)
        base = scratch.data_ptr()
        stats = block.data_ptr() + gathered_end(channels, world) * acc_size
        arrays = dict(dy=dy, x=x, dx=dx, mean=stats, rstd=stats + 2 * channels * acc_size, w=w, dw=dw, db=db)

        stream = interop.stream(device)

        def workspace(nbytes):
            return None, base + workspace_at
        before.run(_pointers(before, arrays, totals=base), stream, workspace)
        _collectives.all_gather(scratch, 0, 2 * channels, 2 * channels, ctx.group, world, ctx.own)
        after.run(_pointers(after, arrays, gathered=base + 2 * channels * acc_size,
                            count=stats + 3 * channels * acc_size), stream, workspace)
        dw = None if dw is None else dw.to(weight_dtype)
        db = None if db is None else db.to(bias_dtype)
        return _grads(ctx, dx, dw, db)


def _pointers(program, arrays: dict, **more) -> tuple:
    """program's slot pointers from ``arrays`` and ``more`` by slot name (a
    tensor, a raw pointer, or absent: null)."""
    arrays = {**arrays, **more} if more else arrays
    return tuple(0 if a is None else a if type(a) is int else a.data_ptr() for a in map(arrays.get, program.slots))


def _grads(ctx, dx, dw, db):
    return (dx, dw if ctx.needs_input_grad[1] else None, db if ctx.needs_input_grad[2] else None,
            None, None, None, None, None, None, None)


class SyncBatchNorm(torch.nn.SyncBatchNorm):
    """``torch.nn.SyncBatchNorm`` computed by cunorm (same arguments,
    parameters, buffers, state_dict and ``process_group``). In training
    under an initialized process group of more than one rank, the statistics
    are those of every rank's batch (one collective forward, one backward);
    otherwise it is cunorm's BatchNorm, as torch's falls back to its own.

    The two collectives go through a NCCL communicator of cunorm's own for
    the group (made by the first synchronized forward, where the group is
    NCCL's and CuPy loads NCCL), whose host calls cost a fraction of
    torch.distributed's; it takes GPU memory of its own (about 0.5 GB a
    GPU on two H200s, docs/torch.md). Set ``own_communicator`` False, on
    the class or a layer and alike on every rank, for torch.distributed's
    collectives instead."""

    #: the collectives through cunorm's own NCCL communicator (True) or
    #: torch.distributed's (False); the same on every rank
    own_communicator = True

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
        return SyncBatchNormFunction.apply(x, self.weight, self.bias, *running, self.eps, factor, group, world,
                                           bool(self.own_communicator))


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
