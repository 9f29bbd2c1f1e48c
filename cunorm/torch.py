"""cunorm for PyTorch models: the ops as registered torch operators, and
drop-in ``torch.nn`` norm layers.

The functions here take and return torch tensors and run as operators of
the ``cunorm`` torch library (``torch.ops.cunorm.*``), registered with
``torch.library.custom_op``: ``torch.compile`` treats them as opaque ops
(described to it by their fake implementations, which give each output's
shape, dtype and strides) instead of tracing into CuPy or breaking the graph.
The top-level ``cunorm.*`` ops (and the modules below) route torch tensors
here by themselves when autograd or dynamo needs it; in plain eager
inference they take the shorter direct path (62 us of host time a call
instead of 86 us in the benchmark run on 65e31ac, H200 machine, 2026-11-21;
23-43 us less across that day's runs: torch's custom-op dispatch costs the
difference).

The modules subclass their ``torch.nn`` counterparts and replace only
``forward``: the constructor arguments, parameters, buffers, ``state_dict``
keys and ``repr`` are torch's own, so a checkpoint loads into either, and
``replace_norms(model)`` swaps a model's norm layers for cunorm's in place.

Backward passes are not built yet: a backward through any of these ops
raises an error saying so (never a wrong or missing gradient). Train with
torch's layers until then, or call cunorm under ``torch.no_grad()``.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from . import _channels, _dtypes, _ops, norms, reference
from ._interop import torch as _adapter

__all__ = ["rms_norm", "layer_norm", "normalize", "mean_abs_normalize", "frobenius_normalize", "group_norm",
           "instance_norm", "batch_norm", "RMSNorm", "LayerNorm", "GroupNorm", "InstanceNorm2d", "BatchNorm2d",
           "replace_norms"]

_ALL_AXES: list[int] = []  # an op's ``axes`` for axis=None (every axis)


# -- the registered operators --------------------------------------------------------------------------------------
# Each returns a list of tensors (y, then h, then the statistics, as the
# array-level op returns them), so one operator serves every return form.

def _as_list(results) -> list[Tensor]:
    return list(results) if isinstance(results, tuple) else [results]


def _stats_like(x: Tensor, shape) -> Tensor:
    """An empty statistics tensor: the accumulation dtype of x's dtype."""
    dtype = _adapter.TORCH_DTYPE[_dtypes.accumulation(_adapter.NUMPY_DTYPE[x.dtype])]
    return x.new_empty(shape, dtype=dtype)


@torch.library.custom_op("cunorm::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, weight: Optional[Tensor], residual: Optional[Tensor], axes: list[int], eps: float,
                 return_stats: bool) -> list[Tensor]:
    call = _ops.Call("rms", x, tuple(axes), eps, None, weight=weight, residual=residual, return_stats=return_stats)
    return _as_list(_ops.run(call, reference.rms_norm))


@torch.library.custom_op("cunorm::layer_norm", mutates_args=())
def _layer_norm_op(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor],
                   axes: list[int], eps: float, return_stats: bool) -> list[Tensor]:
    call = _ops.Call("ln", x, tuple(axes), eps, None, weight=weight, bias=bias, residual=residual,
                     return_stats=return_stats)
    return _as_list(_ops.run(call, reference.layer_norm))


@torch.library.custom_op("cunorm::normalize", mutates_args=())
def _normalize_op(x: Tensor, norm: str, axes: list[int], eps: float) -> Tensor:
    call = _ops.Call(norm, x, tuple(axes) if axes else None, eps, None)
    return _ops.run(call, None)


def _rows_fake(x, residual, axes, return_stats, statistics):
    outputs = [torch.empty_like(x, memory_format=torch.contiguous_format)]
    if residual is not None:
        outputs.append(torch.empty_like(x, memory_format=torch.contiguous_format))
    if return_stats:
        shape = _ops.stats_shape(tuple(x.shape), *_ops.axis_span(tuple(axes) if axes else None, x.dim()))
        outputs += [_stats_like(x, shape) for _ in range(statistics)]
    return outputs


@_rms_norm_op.register_fake
def _(x, weight, residual, axes, eps, return_stats):
    return _rows_fake(x, residual, axes, return_stats, 1)


@_layer_norm_op.register_fake
def _(x, weight, bias, residual, axes, eps, return_stats):
    return _rows_fake(x, residual, axes, return_stats, 2)


@_normalize_op.register_fake
def _(x, norm, axes, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("cunorm::group_norm", mutates_args=())
def _group_norm_op(x: Tensor, num_groups: int, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                   channel_axis: int, return_stats: bool) -> list[Tensor]:
    call = _channels.ChannelCall("group", x, num_groups=num_groups, weight=weight, bias=bias, eps=eps,
                                 channel_axis=channel_axis, return_stats=return_stats)
    return _as_list(_channels.run(call))


@torch.library.custom_op("cunorm::instance_norm", mutates_args=())
def _instance_norm_op(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, channel_axis: int,
                      return_stats: bool) -> list[Tensor]:
    call = _channels.ChannelCall("instance", x, weight=weight, bias=bias, eps=eps, channel_axis=channel_axis,
                                 return_stats=return_stats)
    return _as_list(_channels.run(call))


@torch.library.custom_op("cunorm::batch_norm", mutates_args=())
def _batch_norm_op(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], running_mean: Optional[Tensor],
                   running_var: Optional[Tensor], training: bool, momentum: float, eps: float, channel_axis: int,
                   return_stats: bool) -> list[Tensor]:
    # Functional (autograd can only be registered on functional operators):
    # in training the updated running buffers are returned, computed into
    # copies, and the caller writes them back (batch_norm below).
    if training:
        running_mean = None if running_mean is None else running_mean.clone()
        running_var = None if running_var is None else running_var.clone()
    call = _channels.ChannelCall("batch", x, weight=weight, bias=bias, eps=eps, channel_axis=channel_axis,
                                 return_stats=return_stats, running_mean=running_mean, running_var=running_var,
                                 training=training, momentum=momentum)
    updated = [b for b in (running_mean, running_var) if b is not None] if training else []
    return _as_list(_channels.run(call)) + updated


def _channels_fake(norm, x, channel_axis, groups, return_stats):
    ndim, axis = x.dim(), channel_axis % x.dim()
    order = _channels.output_order(tuple(x.shape), tuple(x.stride()), axis, norm != "batch")
    y = x.new_empty([x.shape[a] for a in order]).permute(*[order.index(a) for a in range(ndim)])
    if not return_stats:
        return [y]
    shape = _channels.stats_shape(norm, tuple(x.shape), axis, groups)
    return [y] + [_stats_like(x, shape) for _ in range(2)]


@_group_norm_op.register_fake
def _(x, num_groups, weight, bias, eps, channel_axis, return_stats):
    return _channels_fake("group", x, channel_axis, num_groups, return_stats)


@_instance_norm_op.register_fake
def _(x, weight, bias, eps, channel_axis, return_stats):
    return _channels_fake("instance", x, channel_axis, None, return_stats)


@_batch_norm_op.register_fake
def _(x, weight, bias, running_mean, running_var, training, momentum, eps, channel_axis, return_stats):
    updated = [torch.empty_like(b) for b in (running_mean, running_var) if b is not None] if training else []
    return _channels_fake("batch", x, channel_axis, None, return_stats) + updated


def _no_backward(op: str):
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"cunorm.{op} has no backward pass yet: gradients through cunorm are not implemented (they are "
            f"planned). Train with torch.nn's layers (or undo cunorm.torch.replace_norms), or run cunorm under "
            f"torch.no_grad() / torch.inference_mode() for inference."
        )

    return backward


def _no_context(ctx, inputs, output):
    pass


for _op, _name in ((_rms_norm_op, "rms_norm"), (_layer_norm_op, "layer_norm"), (_normalize_op, "normalize"),
                   (_group_norm_op, "group_norm"), (_instance_norm_op, "instance_norm"),
                   (_batch_norm_op, "batch_norm")):
    _op.register_autograd(_no_backward(_name), setup_context=_no_context)
del _op, _name


# -- functions ------------------------------------------------------------------------------------------------------
# The array-level ops' signatures and semantics (see cunorm.rms_norm etc.),
# without ``out=``: registered operators return new tensors. Arguments are
# checked by the array-level ops' checks before the operator is called (its
# schema needs them typed).

def _axes(axis) -> list[int]:
    if axis is None:
        return _ALL_AXES
    if isinstance(axis, (tuple, list)):
        return [_ops.check_int(a, "axis") for a in axis]
    return [_ops.check_int(axis, "axis")]


def _unpack(results: list[Tensor]):
    return results[0] if len(results) == 1 else tuple(results)


def rms_norm(x, weight=None, *, axis=-1, eps=norms.DEFAULT_EPS, residual=None, return_stats=False):
    """:func:`cunorm.rms_norm` as the registered op ``torch.ops.cunorm.rms_norm``."""
    stats = _ops.check_flag(return_stats, "return_stats")
    return _unpack(torch.ops.cunorm.rms_norm(x, weight, residual, _axes(axis), _ops.check_eps(eps), stats))


def layer_norm(x, weight=None, bias=None, *, axis=-1, eps=norms.DEFAULT_EPS, residual=None, return_stats=False):
    """:func:`cunorm.layer_norm` as the registered op ``torch.ops.cunorm.layer_norm``."""
    stats = _ops.check_flag(return_stats, "return_stats")
    return _unpack(torch.ops.cunorm.layer_norm(x, weight, bias, residual, _axes(axis), _ops.check_eps(eps), stats))


def normalize(x, p=2.0, *, axis=-1, eps=norms.LP_EPS):
    """:func:`cunorm.normalize` as the registered op ``torch.ops.cunorm.normalize``."""
    return torch.ops.cunorm.normalize(x, norms._lp_norm(p), _axes(axis), _ops.check_eps(eps))


def mean_abs_normalize(x, *, axis=-1, eps=norms.LP_EPS):
    """:func:`cunorm.mean_abs_normalize` as the registered op ``torch.ops.cunorm.normalize``."""
    return torch.ops.cunorm.normalize(x, "mean_abs", _axes(axis), _ops.check_eps(eps))


def frobenius_normalize(x, *, axis=None, eps=norms.LP_EPS):
    """:func:`cunorm.frobenius_normalize` as the registered op ``torch.ops.cunorm.normalize``."""
    return torch.ops.cunorm.normalize(x, "l2", _axes(axis), _ops.check_eps(eps))


def group_norm(x, num_groups, weight=None, bias=None, *, eps=norms.DEFAULT_EPS, channel_axis=1,
               return_stats=False):
    """:func:`cunorm.group_norm` as the registered op ``torch.ops.cunorm.group_norm``."""
    groups, axis = _ops.check_int(num_groups, "num_groups"), _ops.check_int(channel_axis, "channel_axis")
    stats = _ops.check_flag(return_stats, "return_stats")
    return _unpack(torch.ops.cunorm.group_norm(x, groups, weight, bias, _ops.check_eps(eps), axis, stats))


def instance_norm(x, weight=None, bias=None, *, eps=norms.DEFAULT_EPS, channel_axis=1, return_stats=False):
    """:func:`cunorm.instance_norm` as the registered op ``torch.ops.cunorm.instance_norm``."""
    axis, stats = _ops.check_int(channel_axis, "channel_axis"), _ops.check_flag(return_stats, "return_stats")
    return _unpack(torch.ops.cunorm.instance_norm(x, weight, bias, _ops.check_eps(eps), axis, stats))


def batch_norm(x, weight=None, bias=None, *, running_mean=None, running_var=None, training=True, momentum=0.1,
               eps=norms.DEFAULT_EPS, channel_axis=1, return_stats=False):
    """:func:`cunorm.batch_norm` as the registered op ``torch.ops.cunorm.batch_norm``; in training the
    running buffers are updated in place as there (the op returns them, this copies them back)."""
    axis, stats = _ops.check_int(channel_axis, "channel_axis"), _ops.check_flag(return_stats, "return_stats")
    training = _ops.check_flag(training, "training")
    results = torch.ops.cunorm.batch_norm(x, weight, bias, running_mean, running_var, training,
                                          _channels._momentum(momentum), _ops.check_eps(eps), axis, stats)
    buffers = [b for b in (running_mean, running_var) if b is not None] if training else []
    if buffers:
        for buffer, updated in zip(buffers, results[-len(buffers):]):
            buffer.copy_(updated)
        results = results[:-len(buffers)]
    return _unpack(results)


# -- modules ----------------------------------------------------------------------------------------------------------
# Their forward calls the array-level ops, which run as the registered
# operators when autograd or dynamo needs them (training, torch.compile) and
# take the shorter direct path otherwise (inference: 23-43 us less host time
# a call, H200 machine, 2026-11-21).

class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` computed by cunorm (same arguments, parameters and
    state_dict). ``eps=None`` means torch's default, the machine epsilon of
    float32 (float64 for float64 input)."""

    def forward(self, x: Tensor) -> Tensor:
        eps = self.eps if self.eps is not None else _default_rms_eps(x.dtype)
        return norms.rms_norm(x, self.weight, axis=tuple(range(-len(self.normalized_shape), 0)), eps=eps)


def _default_rms_eps(dtype) -> float:
    # torch's rms_norm takes the epsilon of its compute type (float32 for the
    # 16-bit dtypes), which is cunorm's accumulation dtype too.
    return float(np.finfo(_dtypes.accumulation(_adapter.NUMPY_DTYPE[dtype])).eps)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` computed by cunorm (same arguments, parameters and state_dict)."""

    def forward(self, x: Tensor) -> Tensor:
        return norms.layer_norm(x, self.weight, self.bias, axis=tuple(range(-len(self.normalized_shape), 0)),
                                eps=self.eps)


class GroupNorm(torch.nn.GroupNorm):
    """``torch.nn.GroupNorm`` computed by cunorm (same arguments, parameters and state_dict); x (N, C, *),
    channels_last tensors run as they are."""

    def forward(self, x: Tensor) -> Tensor:
        return norms.group_norm(x, self.num_groups, self.weight, self.bias, eps=self.eps)


class InstanceNorm2d(torch.nn.InstanceNorm2d):
    """``torch.nn.InstanceNorm2d`` computed by cunorm (same arguments, parameters, buffers and state_dict).

    With ``track_running_stats=True`` in training, the running buffers are
    updated as torch updates them, from cunorm's float32 statistics (the
    variance recovered from rstd: relative error ~1e-7 of var + eps)."""

    def forward(self, x: Tensor) -> Tensor:
        self._check_input_dim(x)
        if x.dim() == 3:  # unbatched (C, H, W), as torch allows
            return self.forward(x.unsqueeze(0)).squeeze(0)
        use_input_stats = self.training or not self.track_running_stats
        if not use_input_stats:
            return norms.batch_norm(x, self.weight, self.bias, running_mean=self.running_mean,
                                    running_var=self.running_var, training=False, eps=self.eps)
        if not (self.track_running_stats and self.running_mean is not None):
            return norms.instance_norm(x, self.weight, self.bias, eps=self.eps)
        y, mean, rstd = norms.instance_norm(x, self.weight, self.bias, eps=self.eps, return_stats=True)
        momentum = self.momentum if self.momentum is not None else 0.0
        n = math.prod(x.shape[2:])
        with torch.no_grad():
            var = (rstd.double().pow(-2) - self.eps).clamp_min(0) * (n / max(n - 1, 1))
            self.running_mean.mul_(1 - momentum).add_(mean.mean(0).to(self.running_mean.dtype), alpha=momentum)
            self.running_var.mul_(1 - momentum).add_(var.mean(0).to(self.running_var.dtype), alpha=momentum)
        return y


class BatchNorm2d(torch.nn.BatchNorm2d):
    """``torch.nn.BatchNorm2d`` computed by cunorm (same arguments, parameters, buffers and state_dict),
    including ``momentum=None`` (the cumulative average) and ``num_batches_tracked``."""

    def forward(self, x: Tensor) -> Tensor:
        # torch's _BatchNorm.forward, with the normalization itself cunorm's
        self._check_input_dim(x)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        training = self.training or (self.running_mean is None and self.running_var is None)
        keep = not self.training or self.track_running_stats
        return norms.batch_norm(x, self.weight, self.bias, running_mean=self.running_mean if keep else None,
                                running_var=self.running_var if keep else None, training=training,
                                momentum=factor, eps=self.eps)


_REPLACEMENTS = {torch.nn.RMSNorm: RMSNorm, torch.nn.LayerNorm: LayerNorm, torch.nn.GroupNorm: GroupNorm,
                 torch.nn.InstanceNorm2d: InstanceNorm2d, torch.nn.BatchNorm2d: BatchNorm2d}


def replace_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Make every ``torch.nn`` RMSNorm, LayerNorm, GroupNorm, InstanceNorm2d
    and BatchNorm2d in ``model`` (``model`` itself included) compute with
    cunorm, in place, and return ``model``.

    The modules stay the same objects with the same parameters, buffers,
    hooks and training mode (an optimizer built before keeps working); only
    their class becomes cunorm's subclass of it. Subclasses of the torch
    layers (whose forward may differ) are left alone.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for module in model.modules():
        replacement = _REPLACEMENTS.get(type(module))
        if replacement is not None:
            module.__class__ = replacement
    return model
