"""cunorm's registered torch operators (``torch.ops.cunorm.*``): each op's
forward and backward as a ``torch.library.custom_op``, its fake
implementation (each output's shape, dtype and strides, which inductor
trusts) and its autograd formula (the backward operators).

The implementations call the engine (cunorm/_engine/calls.py) on the
tensors: the launch cache, else the general path, never routed again.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._engine import calls, channel_norms, dispatch_rows, plans, row_norms
from .._interop import torch as _adapter


# -- the registered operators --------------------------------------------------------------------------------------
# Each returns a list of tensors (y, then h, then the statistics, as the
# array-level op returns them), so one operator serves every return form.

def _as_list(results) -> list[Tensor]:
    return list(results) if isinstance(results, tuple) else [results]


def _run_rows(norm, x, weight, bias, residual, axis, eps, return_stats, epilogue, reference_fn) -> list[Tensor]:
    """A row operator's implementation: the array-level op's launch cache,
    else its general path (the registered operators run here on every call
    of a compiled graph)."""
    return _as_list(calls.rows(norm, x, weight, bias, residual, axis, eps, return_stats, None, reference_fn,
                               epilogue=epilogue))


def _run_channels(norm, x, num_groups, weight, bias, running_mean, running_var, training, momentum, eps, channel_axis,
                  return_stats, epilogue) -> list[Tensor]:
    """A channel operator's implementation, as _run_rows."""
    return _as_list(calls.channels(norm, x, num_groups, weight, bias, running_mean, running_var, training, momentum,
                                   eps, channel_axis, return_stats, None, epilogue=epilogue))


def _stats_like(x: Tensor, shape) -> Tensor:
    """An empty statistics tensor: the accumulation dtype of x's dtype."""
    dtype = _adapter.ACCUMULATION[x.dtype]
    return x.new_empty(shape, dtype=dtype)


@torch.library.custom_op("cunorm::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, weight: Optional[Tensor], residual: Optional[Tensor], axes: list[int], eps: float,
                 return_stats: bool, epilogue: int) -> list[Tensor]:
    return _run_rows("rms", x, weight, None, residual, tuple(axes), eps, return_stats, epilogue, None)


@torch.library.custom_op("cunorm::layer_norm", mutates_args=())
def _layer_norm_op(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor],
                   axes: list[int], eps: float, return_stats: bool, epilogue: int) -> list[Tensor]:
    return _run_rows("ln", x, weight, bias, residual, tuple(axes), eps, return_stats, epilogue, None)


@torch.library.custom_op("cunorm::normalize", mutates_args=())
def _normalize_op(x: Tensor, norm: str, axes: list[int], eps: float) -> Tensor:
    dispatch_rows.norm_info(norm)  # (a caller's string: checked before anything, never pasted into a kernel name)
    return _run_rows(norm, x, None, None, None, tuple(axes) if axes else None, eps, False, 0, None)[0]


def _rows_fake(x, residual, axes, return_stats, statistics):
    outputs = [torch.empty_like(x, memory_format=torch.contiguous_format)]
    if residual is not None:
        outputs.append(torch.empty_like(x, memory_format=torch.contiguous_format))
    if return_stats:
        shape = row_norms.stats_shape(tuple(x.shape), *row_norms.axis_span(tuple(axes) if axes else None, x.dim()))
        outputs += [_stats_like(x, shape) for _ in range(statistics)]
    return outputs


@_rms_norm_op.register_fake
def _(x, weight, residual, axes, eps, return_stats, epilogue):
    return _rows_fake(x, residual, axes, return_stats, 1)


@_layer_norm_op.register_fake
def _(x, weight, bias, residual, axes, eps, return_stats, epilogue):
    return _rows_fake(x, residual, axes, return_stats, 2)


@_normalize_op.register_fake
def _(x, norm, axes, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("cunorm::group_norm", mutates_args=())
def _group_norm_op(x: Tensor, num_groups: int, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                   channel_axis: int, return_stats: bool, epilogue: int) -> list[Tensor]:
    return _run_channels("group", x, num_groups, weight, bias, None, None, True, 0.1, eps, channel_axis, return_stats,
                         epilogue)


@torch.library.custom_op("cunorm::instance_norm", mutates_args=())
def _instance_norm_op(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, channel_axis: int,
                      return_stats: bool, epilogue: int) -> list[Tensor]:
    return _run_channels("instance", x, None, weight, bias, None, None, True, 0.1, eps, channel_axis, return_stats,
                         epilogue)


@torch.library.custom_op("cunorm::batch_norm", mutates_args=())
def _batch_norm_op(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], running_mean: Optional[Tensor],
                   running_var: Optional[Tensor], training: bool, momentum: float, eps: float, channel_axis: int,
                   return_stats: bool, epilogue: int) -> list[Tensor]:
    # Functional (autograd can only be registered on functional operators):
    # in training the updated running buffers are returned, computed into
    # copies, and the caller writes them back (batch_norm below).
    if training:
        running_mean = None if running_mean is None else running_mean.clone()
        running_var = None if running_var is None else running_var.clone()
    updated = [b for b in (running_mean, running_var) if b is not None] if training else []
    return _run_channels("batch", x, None, weight, bias, running_mean, running_var, training, momentum, eps,
                         channel_axis, return_stats, epilogue) + updated


def _channels_fake(norm, x, channel_axis, groups, return_stats):
    ndim, axis = x.dim(), channel_axis % x.dim()
    order = channel_norms.output_order(tuple(x.shape), tuple(x.stride()), axis, norm != "batch")
    y = x.new_empty([x.shape[a] for a in order]).permute(*[order.index(a) for a in range(ndim)])
    if not return_stats:
        return [y]
    shape = channel_norms.stats_shape(norm, tuple(x.shape), axis, groups)
    return [y] + [_stats_like(x, shape) for _ in range(2)]


@_group_norm_op.register_fake
def _(x, num_groups, weight, bias, eps, channel_axis, return_stats, epilogue):
    return _channels_fake("group", x, channel_axis, num_groups, return_stats)


@_instance_norm_op.register_fake
def _(x, weight, bias, eps, channel_axis, return_stats, epilogue):
    return _channels_fake("instance", x, channel_axis, None, return_stats)


@_batch_norm_op.register_fake
def _(x, weight, bias, running_mean, running_var, training, momentum, eps, channel_axis, return_stats, epilogue):
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
    dx, dw = calls.rows_grad("rms", dy, x, None, rstd, weight, None, dh, tuple(axes), 0.0, None)
    return [dx] + _present(dw)


@torch.library.custom_op("cunorm::layer_norm_backward", mutates_args=())
def _layer_norm_backward_op(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Optional[Tensor],
                            bias: Optional[Tensor], dh: Optional[Tensor], axes: list[int]) -> list[Tensor]:
    dx, dw, db = calls.rows_grad("ln", dy, x, mean, rstd, weight, bias, dh, tuple(axes), 0.0, None)
    return [dx] + _present(dw, db)


@torch.library.custom_op("cunorm::normalize_backward", mutates_args=())
def _normalize_backward_op(dy: Tensor, x: Tensor, norm: str, axes: list[int], eps: float) -> Tensor:
    return calls.rows_grad(norm, dy, x, None, None, None, None, None, tuple(axes) if axes else None, eps, None)


@torch.library.custom_op("cunorm::channel_norm_backward", mutates_args=())
def _channel_norm_backward_op(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, norm: str, num_groups: int,
                              weight: Optional[Tensor], bias: Optional[Tensor], training: bool, eps: float,
                              channel_axis: int) -> list[Tensor]:
    dx, dw, db = calls.channel_grad(norm, dy, x, mean, rstd, num_groups if norm == "group" else None, weight, bias,
                                    channel_axis, training, eps, None)
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


# The epilogue's bits the backward operators do not differentiate
# (plans.UNFUSED_IN_BACKWARD): the functions below run them as torch ops
# around the norm where autograd records, and the operators refuse a
# backward through them.
_UNFUSED = ("cunorm.{op}: the operator was called with an activation or a weight offset (epilogue={bits}) while "
            "autograd recorded it; its backward does not differentiate them. Call it through cunorm.torch.{op} "
            "(or cunorm.{op}), which runs them as torch ops where autograd records.")

_NO_STATS = ("cunorm.{op}: the operator was called with return_stats=False while autograd recorded it, so the "
             "statistics its backward needs were not kept. Call it through cunorm.torch.{op} (or cunorm.{op}), "
             "which asks for them, or pass return_stats=True.")


def _output_grads(grads) -> list:
    """The gradients of a list-returning operator's outputs, in order."""
    return list(grads[0]) if len(grads) == 1 and isinstance(grads[0], (list, tuple)) else list(grads)


def _rows_setup(ctx, x, weight, bias, residual, axes, return_stats, output, statistics, epilogue):
    ctx.kept = return_stats
    ctx.unfused = epilogue & plans.UNFUSED_IN_BACKWARD
    if not return_stats:
        return
    h = output[1] if residual is not None else x
    ctx.save_for_backward(h, weight, bias, *output[-statistics:])
    ctx.axes, ctx.residual = axes, residual is not None


def _check_kept(ctx):
    if ctx.unfused:
        raise RuntimeError(_UNFUSED.format(op=ctx.op, bits=ctx.unfused))
    if not ctx.kept:
        raise RuntimeError(_NO_STATS.format(op=ctx.op))


def _rows_dy(ctx, grads, h):
    """(dy, dh): the gradients of y and of the returned h (residual form)."""
    grads = _output_grads(grads)
    dy = grads[0] if grads[0] is not None else torch.zeros_like(h)
    return dy, (grads[1] if ctx.residual else None)


def _rms_setup(ctx, inputs, output):
    x, weight, residual, axes, eps, return_stats, epilogue = inputs
    ctx.op = "rms_norm"
    _rows_setup(ctx, x, weight, None, residual, axes, return_stats, output, 1, epilogue)


def _rms_backward(ctx, *grads):
    _check_kept(ctx)
    h, weight, _, rstd = ctx.saved_tensors
    dy, dh = _rows_dy(ctx, grads, h)
    results = torch.ops.cunorm.rms_norm_backward(dy, h, rstd, weight, dh, ctx.axes)
    dw, _ = _param_grads(results, weight, None)
    return results[0], dw, results[0] if ctx.residual else None, None, None, None, None


def _ln_setup(ctx, inputs, output):
    x, weight, bias, residual, axes, eps, return_stats, epilogue = inputs
    ctx.op = "layer_norm"
    _rows_setup(ctx, x, weight, bias, residual, axes, return_stats, output, 2, epilogue)


def _ln_backward(ctx, *grads):
    _check_kept(ctx)
    h, weight, bias, mean, rstd = ctx.saved_tensors
    dy, dh = _rows_dy(ctx, grads, h)
    results = torch.ops.cunorm.layer_norm_backward(dy, h, mean, rstd, weight, bias, dh, ctx.axes)
    dw, db = _param_grads(results, weight, bias)
    return results[0], dw, db, results[0] if ctx.residual else None, None, None, None, None


def _normalize_setup(ctx, inputs, output):
    x, norm, axes, eps = inputs
    ctx.save_for_backward(x)
    ctx.norm, ctx.axes, ctx.eps = norm, axes, eps


def _normalize_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return torch.ops.cunorm.normalize_backward(dy, x, ctx.norm, ctx.axes, ctx.eps), None, None, None


def _channel_setup(ctx, norm, x, num_groups, weight, bias, channel_axis, return_stats, output, epilogue, training=True,
                   eps=0.0, running=(None, None)):
    ctx.norm, ctx.unfused = norm, epilogue & plans.UNFUSED_IN_BACKWARD
    ctx.kept = return_stats or not training
    if not ctx.kept:
        return
    mean, rstd = (output[1], output[2]) if training else running
    ctx.save_for_backward(x, mean, rstd, weight, bias)
    ctx.num_groups, ctx.channel_axis, ctx.training, ctx.eps = num_groups, channel_axis, training, eps


def _channel_grads(ctx, grads):
    if ctx.unfused:
        raise RuntimeError(_UNFUSED.format(op=f"{ctx.norm}_norm", bits=ctx.unfused))
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
    x, num_groups, weight, bias, eps, channel_axis, return_stats, epilogue = inputs
    _channel_setup(ctx, "group", x, num_groups, weight, bias, channel_axis, return_stats, output, epilogue)


def _group_backward(ctx, *grads):
    dx, dw, db = _channel_grads(ctx, grads)
    return dx, None, dw, db, None, None, None, None


def _instance_setup(ctx, inputs, output):
    x, weight, bias, eps, channel_axis, return_stats, epilogue = inputs
    _channel_setup(ctx, "instance", x, 0, weight, bias, channel_axis, return_stats, output, epilogue)


def _instance_backward(ctx, *grads):
    dx, dw, db = _channel_grads(ctx, grads)
    return dx, dw, db, None, None, None, None


def _batch_setup(ctx, inputs, output):
    x, weight, bias, running_mean, running_var, training, momentum, eps, channel_axis, return_stats, epilogue = inputs
    _channel_setup(ctx, "batch", x, 0, weight, bias, channel_axis, return_stats, output, epilogue, training, eps,
                   (running_mean, running_var))


def _batch_backward(ctx, *grads):
    dx, dw, db = _channel_grads(ctx, grads)
    return dx, dw, db, None, None, None, None, None, None, None, None


_rms_norm_op.register_autograd(_rms_backward, setup_context=_rms_setup)
_layer_norm_op.register_autograd(_ln_backward, setup_context=_ln_setup)
_normalize_op.register_autograd(_normalize_backward, setup_context=_normalize_setup)
_group_norm_op.register_autograd(_group_backward, setup_context=_group_setup)
_instance_norm_op.register_autograd(_instance_backward, setup_context=_instance_setup)
_batch_norm_op.register_autograd(_batch_backward, setup_context=_batch_setup)
