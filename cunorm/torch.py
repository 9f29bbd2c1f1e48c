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

Every op is differentiable: its autograd formula is cunorm's backward
pass (cunorm.backward), itself a registered operator
(``torch.ops.cunorm.*_backward``), so ``torch.compile`` traces training
steps through both. The forward operators return their statistics when
autograd records them (the functions and layers here ask for them and drop
them from what they return); the statistics outputs are not
differentiated through. Double backward is not supported.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from . import _channels, _dtypes, _grad, _ops, backward, norms, reference
from ._interop import torch as _adapter
from ._torch_autograd import channel_norm_apply as _channel_norm_apply
from ._torch_autograd import eager_autograd as _eager_autograd
from ._torch_autograd import needs_grad as _needs_grad  # (the forward operators then return the statistics)
from ._torch_autograd import row_norm_apply as _row_norm_apply

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


# -- backward ---------------------------------------------------------------------------------------------------------
# The backward passes are operators too (so torch.compile sees them as
# opaque ops with fake implementations), registered as the forward
# operators' autograd formulas. They compute from what the forward saved: x
# (or the h it returned), its statistics, the weight. The forward operators
# return their statistics whenever autograd needs them (the functions below
# ask for them and drop them again); the statistics outputs themselves are
# not differentiated through.


def _param_grads(results: list[Tensor], weight, bias):
    """(dweight, dbias) from a backward operator's [dx, dweight?, dbias?]."""
    rest = iter(results[1:])
    return (next(rest) if weight is not None else None), (next(rest) if bias is not None else None)


def _present(*tensors) -> list[Tensor]:
    return [t for t in tensors if t is not None]


@torch.library.custom_op("cunorm::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(dy: Tensor, x: Tensor, rstd: Tensor, weight: Optional[Tensor], dh: Optional[Tensor],
                          axes: list[int]) -> list[Tensor]:
    dx, dw = backward.rms_norm_backward(dy, x, rstd, weight, axis=tuple(axes), dh=dh)
    return [dx] + _present(dw)


@torch.library.custom_op("cunorm::layer_norm_backward", mutates_args=())
def _layer_norm_backward_op(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Optional[Tensor],
                            bias: Optional[Tensor], dh: Optional[Tensor], axes: list[int]) -> list[Tensor]:
    dx, dw, db = backward.layer_norm_backward(dy, x, mean, rstd, weight, bias, axis=tuple(axes), dh=dh)
    return [dx] + _present(dw, db)


@torch.library.custom_op("cunorm::normalize_backward", mutates_args=())
def _normalize_backward_op(dy: Tensor, x: Tensor, norm: str, axes: list[int], eps: float) -> Tensor:
    g = _grad.RowGradCall(norm, dy, x, axis=tuple(axes) if axes else None, eps=eps)
    return _grad.run_rows(g, None)


@torch.library.custom_op("cunorm::channel_norm_backward", mutates_args=())
def _channel_norm_backward_op(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, norm: str, num_groups: int,
                              weight: Optional[Tensor], bias: Optional[Tensor], training: bool, eps: float,
                              channel_axis: int) -> list[Tensor]:
    g = _grad.ChannelGradCall(norm, dy, x, mean, rstd, num_groups=num_groups if norm == "group" else None,
                              weight=weight, bias=bias, channel_axis=channel_axis, training=training, eps=eps)
    dx, dw, db = _grad.run_channels(g, None)
    return [dx] + _present(dw, db)


@_rms_norm_backward_op.register_fake
def _(dy, x, rstd, weight, dh, axes):
    return [torch.empty_like(x, memory_format=torch.contiguous_format)] + [torch.empty_like(p) for p in
                                                                          _present(weight)]


@_layer_norm_backward_op.register_fake
def _(dy, x, mean, rstd, weight, bias, dh, axes):
    return [torch.empty_like(x, memory_format=torch.contiguous_format)] + [torch.empty_like(p) for p in
                                                                          _present(weight, bias)]


@_normalize_backward_op.register_fake
def _(dy, x, norm, axes, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_channel_norm_backward_op.register_fake
def _(dy, x, mean, rstd, norm, num_groups, weight, bias, training, eps, channel_axis):
    dx = _channels_fake(norm, x, channel_axis, num_groups, False)[0]
    return [dx] + [torch.empty_like(p) for p in _present(weight, bias)]


_NO_STATS = ("cunorm.{op}: the operator was called with return_stats=False while autograd recorded it, so the "
             "statistics its backward needs were not kept. Call it through cunorm.torch.{op} (or cunorm.{op}), "
             "which asks for them, or pass return_stats=True.")


def _output_grads(grads) -> list:
    """The gradients of a list-returning operator's outputs, in order."""
    return list(grads[0]) if len(grads) == 1 and isinstance(grads[0], (list, tuple)) else list(grads)


def _rows_setup(ctx, x, weight, bias, residual, axes, return_stats, output, statistics):
    ctx.kept = return_stats
    if not return_stats:
        return
    h = output[1] if residual is not None else x
    ctx.save_for_backward(h, weight, bias, *output[-statistics:])
    ctx.axes, ctx.residual = axes, residual is not None


def _check_kept(ctx):
    if not ctx.kept:
        raise RuntimeError(_NO_STATS.format(op=ctx.op))


def _rows_dy(ctx, grads, h):
    """(dy, dh): the gradients of y and of the returned h (residual form)."""
    grads = _output_grads(grads)
    dy = grads[0] if grads[0] is not None else torch.zeros_like(h)
    return dy, (grads[1] if ctx.residual else None)


def _rms_setup(ctx, inputs, output):
    x, weight, residual, axes, eps, return_stats = inputs
    ctx.op = "rms_norm"
    _rows_setup(ctx, x, weight, None, residual, axes, return_stats, output, 1)


def _rms_backward(ctx, *grads):
    _check_kept(ctx)
    h, weight, _, rstd = ctx.saved_tensors
    dy, dh = _rows_dy(ctx, grads, h)
    results = torch.ops.cunorm.rms_norm_backward(dy, h, rstd, weight, dh, ctx.axes)
    dw, _ = _param_grads(results, weight, None)
    return results[0], dw, results[0] if ctx.residual else None, None, None, None


def _ln_setup(ctx, inputs, output):
    x, weight, bias, residual, axes, eps, return_stats = inputs
    ctx.op = "layer_norm"
    _rows_setup(ctx, x, weight, bias, residual, axes, return_stats, output, 2)


def _ln_backward(ctx, *grads):
    _check_kept(ctx)
    h, weight, bias, mean, rstd = ctx.saved_tensors
    dy, dh = _rows_dy(ctx, grads, h)
    results = torch.ops.cunorm.layer_norm_backward(dy, h, mean, rstd, weight, bias, dh, ctx.axes)
    dw, db = _param_grads(results, weight, bias)
    return results[0], dw, db, results[0] if ctx.residual else None, None, None, None


def _normalize_setup(ctx, inputs, output):
    x, norm, axes, eps = inputs
    ctx.save_for_backward(x)
    ctx.norm, ctx.axes, ctx.eps = norm, axes, eps


def _normalize_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return torch.ops.cunorm.normalize_backward(dy, x, ctx.norm, ctx.axes, ctx.eps), None, None, None


def _channel_setup(ctx, norm, x, num_groups, weight, bias, channel_axis, return_stats, output, training=True,
                   eps=0.0, running=(None, None)):
    ctx.kept = return_stats or not training
    if not ctx.kept:
        return
    mean, rstd = (output[1], output[2]) if training else running
    ctx.save_for_backward(x, mean, rstd, weight, bias)
    ctx.norm, ctx.num_groups, ctx.channel_axis, ctx.training, ctx.eps = norm, num_groups, channel_axis, training, eps


def _channel_grads(ctx, grads):
    if not ctx.kept:
        raise RuntimeError(_NO_STATS.format(op=f"{ctx.norm}_norm"))
    x, mean, rstd, weight, bias = ctx.saved_tensors
    dy = _output_grads(grads)[0]
    if dy is None:
        dy = torch.zeros_like(x)
    results = torch.ops.cunorm.channel_norm_backward(dy, x, mean, rstd, ctx.norm, ctx.num_groups, weight, bias,
                                                     ctx.training, ctx.eps, ctx.channel_axis)
    return (results[0],) + _param_grads(results, weight, bias)


def _group_setup(ctx, inputs, output):
    x, num_groups, weight, bias, eps, channel_axis, return_stats = inputs
    _channel_setup(ctx, "group", x, num_groups, weight, bias, channel_axis, return_stats, output)


def _group_backward(ctx, *grads):
    dx, dw, db = _channel_grads(ctx, grads)
    return dx, None, dw, db, None, None, None


def _instance_setup(ctx, inputs, output):
    x, weight, bias, eps, channel_axis, return_stats = inputs
    _channel_setup(ctx, "instance", x, 0, weight, bias, channel_axis, return_stats, output)


def _instance_backward(ctx, *grads):
    dx, dw, db = _channel_grads(ctx, grads)
    return dx, dw, db, None, None, None


def _batch_setup(ctx, inputs, output):
    x, weight, bias, running_mean, running_var, training, momentum, eps, channel_axis, return_stats = inputs
    _channel_setup(ctx, "batch", x, 0, weight, bias, channel_axis, return_stats, output, training, eps,
                   (running_mean, running_var))


def _batch_backward(ctx, *grads):
    dx, dw, db = _channel_grads(ctx, grads)
    return dx, dw, db, None, None, None, None, None, None, None


_rms_norm_op.register_autograd(_rms_backward, setup_context=_rms_setup)
_layer_norm_op.register_autograd(_ln_backward, setup_context=_ln_setup)
_normalize_op.register_autograd(_normalize_backward, setup_context=_normalize_setup)
_group_norm_op.register_autograd(_group_backward, setup_context=_group_setup)
_instance_norm_op.register_autograd(_instance_backward, setup_context=_instance_setup)
_batch_norm_op.register_autograd(_batch_backward, setup_context=_batch_setup)


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


def _dropped(results: list[Tensor], wanted: bool, asked: bool, count: int) -> list[Tensor]:
    """The results without the ``count`` statistics asked for autograd only."""
    return results[:-count] if asked and not wanted else results


def rms_norm(x, weight=None, *, axis=-1, eps=norms.DEFAULT_EPS, residual=None, return_stats=False):
    """:func:`cunorm.rms_norm` as the registered op ``torch.ops.cunorm.rms_norm`` (differentiable)."""
    stats = _ops.check_flag(return_stats, "return_stats")
    if _eager_autograd(x, weight, residual):
        return _unpack(_dropped(list(_row_norm_apply(x, weight, None, residual, "rms", axis, eps)), stats, True, 1))
    asked = stats or _needs_grad(x, weight, residual)
    results = torch.ops.cunorm.rms_norm(x, weight, residual, _axes(axis), _ops.check_eps(eps), asked)
    return _unpack(_dropped(results, stats, asked, 1))


def layer_norm(x, weight=None, bias=None, *, axis=-1, eps=norms.DEFAULT_EPS, residual=None, return_stats=False):
    """:func:`cunorm.layer_norm` as the registered op ``torch.ops.cunorm.layer_norm`` (differentiable)."""
    stats = _ops.check_flag(return_stats, "return_stats")
    if _eager_autograd(x, weight, bias, residual):
        return _unpack(_dropped(list(_row_norm_apply(x, weight, bias, residual, "ln", axis, eps)), stats, True, 2))
    asked = stats or _needs_grad(x, weight, bias, residual)
    results = torch.ops.cunorm.layer_norm(x, weight, bias, residual, _axes(axis), _ops.check_eps(eps), asked)
    return _unpack(_dropped(results, stats, asked, 2))


def normalize(x, p=2.0, *, axis=-1, eps=norms.LP_EPS):
    """:func:`cunorm.normalize` as the registered op ``torch.ops.cunorm.normalize`` (differentiable)."""
    return torch.ops.cunorm.normalize(x, _ops.lp_norm_name(p), _axes(axis), _ops.check_eps(eps))


def mean_abs_normalize(x, *, axis=-1, eps=norms.LP_EPS):
    """:func:`cunorm.mean_abs_normalize` as the registered op ``torch.ops.cunorm.normalize``."""
    return torch.ops.cunorm.normalize(x, "mean_abs", _axes(axis), _ops.check_eps(eps))


def frobenius_normalize(x, *, axis=None, eps=norms.LP_EPS):
    """:func:`cunorm.frobenius_normalize` as the registered op ``torch.ops.cunorm.normalize``."""
    return torch.ops.cunorm.normalize(x, "l2", _axes(axis), _ops.check_eps(eps))


def group_norm(x, num_groups, weight=None, bias=None, *, eps=norms.DEFAULT_EPS, channel_axis=1,
               return_stats=False):
    """:func:`cunorm.group_norm` as the registered op ``torch.ops.cunorm.group_norm`` (differentiable)."""
    groups, axis = _ops.check_int(num_groups, "num_groups"), _ops.check_int(channel_axis, "channel_axis")
    stats = _ops.check_flag(return_stats, "return_stats")
    if _eager_autograd(x, weight, bias):
        return _unpack(_dropped(list(_channel_norm_apply(x, weight, bias, None, None, "group", groups, True, 0.1, eps,
                                                        axis)), stats, True, 2))
    asked = stats or _needs_grad(x, weight, bias)
    results = torch.ops.cunorm.group_norm(x, groups, weight, bias, _ops.check_eps(eps), axis, asked)
    return _unpack(_dropped(results, stats, asked, 2))


def instance_norm(x, weight=None, bias=None, *, eps=norms.DEFAULT_EPS, channel_axis=1, return_stats=False):
    """:func:`cunorm.instance_norm` as the registered op ``torch.ops.cunorm.instance_norm`` (differentiable)."""
    axis, stats = _ops.check_int(channel_axis, "channel_axis"), _ops.check_flag(return_stats, "return_stats")
    if _eager_autograd(x, weight, bias):
        return _unpack(_dropped(list(_channel_norm_apply(x, weight, bias, None, None, "instance", None, True, 0.1, eps,
                                                        axis)), stats, True, 2))
    asked = stats or _needs_grad(x, weight, bias)
    results = torch.ops.cunorm.instance_norm(x, weight, bias, _ops.check_eps(eps), axis, asked)
    return _unpack(_dropped(results, stats, asked, 2))


def batch_norm(x, weight=None, bias=None, *, running_mean=None, running_var=None, training=True, momentum=0.1,
               eps=norms.DEFAULT_EPS, channel_axis=1, return_stats=False):
    """:func:`cunorm.batch_norm` as the registered op ``torch.ops.cunorm.batch_norm``; in training the
    running buffers are updated in place as there (the op returns them, this copies them back)."""
    axis, stats = _ops.check_int(channel_axis, "channel_axis"), _ops.check_flag(return_stats, "return_stats")
    training = _ops.check_flag(training, "training")
    if _eager_autograd(x, weight, bias):
        return _unpack(_dropped(list(_channel_norm_apply(x, weight, bias, running_mean, running_var, "batch", None,
                                                        training, momentum, eps, axis)), stats, True, 2))
    asked = stats or (training and _needs_grad(x, weight, bias))
    results = torch.ops.cunorm.batch_norm(x, weight, bias, running_mean, running_var, training,
                                          _channels._momentum(momentum), _ops.check_eps(eps), axis, asked)
    buffers = [b for b in (running_mean, running_var) if b is not None] if training else []
    if buffers:
        with torch.no_grad():
            for buffer, updated in zip(buffers, results[-len(buffers):]):
                buffer.copy_(updated)
        results = results[:-len(buffers)]
    return _unpack(_dropped(results, stats, asked, 2))


# -- modules ----------------------------------------------------------------------------------------------------------
# Under eager autograd RMSNorm, LayerNorm, GroupNorm and BatchNorm2d enter
# their autograd.Function (cunorm/_torch_autograd.py) directly; otherwise
# they call the array-level ops, which run as the registered operators
# under dynamo (torch.compile) and take the launch cache in inference.

class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` computed by cunorm (same arguments, parameters and
    state_dict). ``eps=None`` means torch's default, the machine epsilon of
    float32 (float64 for float64 input)."""

    def forward(self, x: Tensor) -> Tensor:
        eps = self.eps if self.eps is not None else _default_rms_eps(x.dtype)
        axis = _trailing_axes(self.normalized_shape)
        weight = self.weight  # (a parameter: each read goes through Module.__getattr__)
        if _eager_autograd(x, weight):  # straight to the autograd.Function (as the op would route it)
            return _row_norm_apply(x, weight, None, None, "rms", axis, eps)[0]
        return norms.rms_norm(x, weight, axis=axis, eps=eps)


def _trailing_axes(normalized_shape):
    """The axes a layer's normalized_shape names: -1 for one (an int keys the
    launch cache without a walk over a tuple), else the trailing ones."""
    n = len(normalized_shape)
    return -1 if n == 1 else tuple(range(-n, 0))


def _default_rms_eps(dtype) -> float:
    # torch's rms_norm takes the epsilon of its compute type (float32 for the
    # 16-bit dtypes), which is cunorm's accumulation dtype too.
    return float(np.finfo(_dtypes.accumulation(_adapter.NUMPY_DTYPE[dtype])).eps)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` computed by cunorm (same arguments, parameters and state_dict)."""

    def forward(self, x: Tensor) -> Tensor:
        axis = _trailing_axes(self.normalized_shape)
        weight, bias = self.weight, self.bias
        if _eager_autograd(x, weight, bias):  # as in RMSNorm.forward
            return _row_norm_apply(x, weight, bias, None, "ln", axis, self.eps)[0]
        return norms.layer_norm(x, weight, bias, axis=axis, eps=self.eps)


class GroupNorm(torch.nn.GroupNorm):
    """``torch.nn.GroupNorm`` computed by cunorm (same arguments, parameters and state_dict); x (N, C, *),
    channels_last tensors run as they are."""

    def forward(self, x: Tensor) -> Tensor:
        weight, bias = self.weight, self.bias
        if _eager_autograd(x, weight, bias):  # as in RMSNorm.forward
            return _channel_norm_apply(x, weight, bias, None, None, "group", self.num_groups, True, 0.1, self.eps,
                                       1)[0]
        return norms.group_norm(x, self.num_groups, weight, bias, eps=self.eps)


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
        running_mean, running_var = (self.running_mean, self.running_var) if keep else (None, None)
        weight, bias = self.weight, self.bias
        if _eager_autograd(x, weight, bias):  # as in RMSNorm.forward
            return _channel_norm_apply(x, weight, bias, running_mean, running_var, "batch", None, training, factor,
                                       self.eps, 1)[0]
        return norms.batch_norm(x, weight, bias, running_mean=running_mean, running_var=running_var,
                                training=training, momentum=factor, eps=self.eps)


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
