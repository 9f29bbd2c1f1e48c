"""cunorm.torch's functions: the array-level ops' signatures and semantics
(cunorm.rms_norm etc.) on torch tensors, through the registered operators
(cunorm/torch/_operators.py) or, under eager autograd, the autograd.Functions
(cunorm/torch/_autograd.py)."""
from __future__ import annotations

import torch
from torch import Tensor

from .._engine import calls, channel_norms, conditioning, plans, row_norms
from .._engine.ops import DEFAULT_EPS, LP_EPS
from . import _operators  # noqa: F401  (registers torch.ops.cunorm.*)
from ._operators import operator_axes as _axes
from ._conditioned import conditioned as _conditioned
from ._conditioned import heads_alone as _heads_alone
from ._quantized import quantized as _quantized
from ._autograd import TORCH_ACTIVATIONS as _TORCH_ACTIVATIONS
from ._autograd import channel_norm_apply as _channel_norm_apply
from ._autograd import eager_autograd as _eager_autograd
from ._autograd import needs_grad as _needs_grad  # (the forward operators then return the statistics)
from ._autograd import offset_weight as _offset_weight
from ._autograd import row_norm_apply as _row_norm_apply

_NOT_QUANTIZED = conditioning.NOT_QUANTIZED


# -- functions ------------------------------------------------------------------------------------------------------
# The array-level ops' signatures and semantics (see cunorm.rms_norm etc.),
# without ``out=``: registered operators return new tensors. Arguments are
# checked by the array-level ops' checks before the operator is called (its
# schema needs them typed).

def _unpack(results: list[Tensor]):
    return results[0] if len(results) == 1 else tuple(results)


def _dropped(results: list[Tensor], wanted: bool, asked: bool, count: int) -> list[Tensor]:
    """The results without the ``count`` statistics asked for autograd only."""
    return results[:-count] if asked and not wanted else results


def _activated(results, activation):
    """The results with torch's ``activation`` applied to y (the first):
    under autograd the epilogue's activation runs as torch's op after the
    norm, so its gradient is torch's (cunorm's backward kernels take the
    gradient of the norm only)."""
    act = _TORCH_ACTIVATIONS[activation]
    if isinstance(results, tuple):
        return (act(results[0]),) + results[1:]
    return act(results)


def rms_norm(x, weight=None, *, axis=-1, eps=DEFAULT_EPS, residual=None, return_stats=False, weight_offset=0,
             rounding="output", activation=None, quantize=None, quant_scale=None, quant_scale_ub=None,
             quant_group=None, quant_scale_layout=None, return_unquantized=False, shift=None, scale=None,
             residual_gate=None, gate=None, norm_before_gate=True, group_size=None):
    """:func:`cunorm.rms_norm` as the registered op ``torch.ops.cunorm.rms_norm`` (differentiable); with
    ``quantize=``, ``torch.ops.cunorm.row_norm_quantized`` (inference only); with per-head weights,
    ``shift=``, ``scale=``, ``residual_gate=`` or ``gate=``: fused, or where autograd records the norm and
    torch's elementwise ops (cunorm/torch/_conditioned.py)."""
    quantizing = (quantize is not None or quant_scale is not None or quant_scale_ub is not None
                  or quant_group is not None or quant_scale_layout is not None or return_unquantized is not False)
    if group_size is not None and not (quantizing or _needs_grad(x, weight, residual, shift, scale, residual_gate,
                                                                 gate) or torch.compiler.is_compiling()):
        # fused over the groups' views, keyed in the launch cache as given (cunorm/_engine/calls.py)
        epilogue = plans.rms_epilogue(weight_offset, rounding, activation, weight is not None, gate, norm_before_gate)
        stats = row_norms.check_flag(return_stats, "return_stats")
        return calls.rows("rms", x, weight, None, residual, axis, eps, stats, None, None, epilogue, group=group_size,
                          conditioned={"shift": shift, "scale": scale, "residual_gate": residual_gate, "gate": gate})
    if group_size is not None:
        return conditioning.in_groups(
            rms_norm, group_size, x, weight, gate=gate, residual=residual, axis=axis, eps=eps,
            return_stats=return_stats, weight_offset=weight_offset, rounding=rounding, activation=activation,
            quantize=quantize, quant_scale=quant_scale, quant_scale_ub=quant_scale_ub, quant_group=quant_group,
            quant_scale_layout=quant_scale_layout, return_unquantized=return_unquantized, shift=shift, scale=scale,
            residual_gate=residual_gate, norm_before_gate=norm_before_gate)
    stats = row_norms.check_flag(return_stats, "return_stats")
    epilogue = plans.rms_epilogue(weight_offset, rounding, activation, weight is not None, gate, norm_before_gate)
    heads_alone = not quantizing and _heads_alone("rms", x, weight, None, axis, residual, shift, scale, residual_gate,
                                                  gate)  # (then the plain norm: its backward takes them)
    if not heads_alone and (conditioning.requested(weight, None, axis, shift, scale, residual_gate, gate)
                            or conditioning.wide(x, residual)):
        if quantize is not None:
            raise ValueError(_NOT_QUANTIZED)
        return _conditioned("rms", lambda x, w, b, **kw: rms_norm(x, w, **kw), x, weight, None, axis=axis,
                            eps=eps, residual=residual, return_stats=stats, epilogue=epilogue,
                            activation=activation, shift=shift, scale=scale, residual_gate=residual_gate,
                            gate=gate, weight_offset=weight_offset, rounding=rounding)
    if quantizing:
        return _quantized("rms", x, weight, None, residual, _axes(axis), eps, stats, epilogue, quantize, quant_scale,
                          quant_scale_ub, quant_group, quant_scale_layout, return_unquantized,
                          _needs_grad(x, weight, residual))
    if epilogue & plans.UNFUSED_IN_BACKWARD and _needs_grad(x, weight, residual):
        # the weight offset and the activation as torch ops around the norm, so autograd sees them
        w = _offset_weight(x, weight) if weight_offset else weight
        results = rms_norm(x, w, axis=axis, eps=eps, residual=residual, return_stats=stats, rounding=rounding)
        return _activated(results, activation) if activation is not None else results
    if _eager_autograd(x, weight, residual):
        return _unpack(_dropped(list(_row_norm_apply(x, weight, None, residual, "rms", axis, eps, rounding)), stats,
                                True, 1))
    asked = stats or _needs_grad(x, weight, residual)
    results = torch.ops.cunorm.rms_norm(x, weight, residual, _axes(axis), row_norms.check_eps(eps), asked, epilogue)
    return _unpack(_dropped(results, stats, asked, 1))


def layer_norm(x, weight=None, bias=None, *, axis=-1, eps=DEFAULT_EPS, residual=None, return_stats=False,
               activation=None, quantize=None, quant_scale=None, quant_scale_ub=None, quant_group=None,
               quant_scale_layout=None, return_unquantized=False, shift=None, scale=None, residual_gate=None):
    """:func:`cunorm.layer_norm` as the registered op ``torch.ops.cunorm.layer_norm`` (differentiable); with
    ``quantize=``, ``torch.ops.cunorm.row_norm_quantized`` (inference only); conditioned as
    :func:`rms_norm`."""
    stats = row_norms.check_flag(return_stats, "return_stats")
    epilogue = plans.activation_flags(activation)
    quantizing = (quantize is not None or quant_scale is not None or quant_scale_ub is not None
                  or quant_group is not None or quant_scale_layout is not None or return_unquantized is not False)
    heads_alone = not quantizing and _heads_alone("ln", x, weight, bias, axis, residual, shift, scale, residual_gate)
    if not heads_alone and (conditioning.requested(weight, bias, axis, shift, scale, residual_gate)
                            or conditioning.wide(x, residual)):
        if quantize is not None:
            raise ValueError(_NOT_QUANTIZED)
        return _conditioned("ln", layer_norm, x, weight, bias, axis=axis, eps=eps, residual=residual,
                            return_stats=stats, epilogue=epilogue, activation=activation, shift=shift,
                            scale=scale, residual_gate=residual_gate)
    if quantizing:
        return _quantized("ln", x, weight, bias, residual, _axes(axis), eps, stats, epilogue, quantize, quant_scale,
                          quant_scale_ub, quant_group, quant_scale_layout, return_unquantized,
                          _needs_grad(x, weight, bias, residual))
    if epilogue and _needs_grad(x, weight, bias, residual):  # the activation as torch's op (see rms_norm)
        results = layer_norm(x, weight, bias, axis=axis, eps=eps, residual=residual, return_stats=stats)
        return _activated(results, activation)
    if _eager_autograd(x, weight, bias, residual):
        results = _row_norm_apply(x, weight, bias, residual, "ln", axis, eps, "output")
        return _unpack(_dropped(list(results), stats, True, 2))
    asked = stats or _needs_grad(x, weight, bias, residual)
    results = torch.ops.cunorm.layer_norm(x, weight, bias, residual, _axes(axis), row_norms.check_eps(eps), asked,
                                          epilogue)
    return _unpack(_dropped(results, stats, asked, 2))


def normalize(x, p=2.0, *, axis=-1, eps=LP_EPS):
    """:func:`cunorm.normalize` as the registered op ``torch.ops.cunorm.normalize`` (differentiable)."""
    return torch.ops.cunorm.normalize(x, row_norms.lp_norm_name(p), _axes(axis), row_norms.check_eps(eps))


def mean_abs_normalize(x, *, axis=-1, eps=LP_EPS):
    """:func:`cunorm.mean_abs_normalize` as the registered op ``torch.ops.cunorm.normalize``."""
    return torch.ops.cunorm.normalize(x, "mean_abs", _axes(axis), row_norms.check_eps(eps))


def frobenius_normalize(x, *, axis=None, eps=LP_EPS):
    """:func:`cunorm.frobenius_normalize` as the registered op ``torch.ops.cunorm.normalize``."""
    return torch.ops.cunorm.normalize(x, "l2", _axes(axis), row_norms.check_eps(eps))


def group_norm(x, num_groups, weight=None, bias=None, *, eps=DEFAULT_EPS, channel_axis=1,
               return_stats=False, activation=None):
    """:func:`cunorm.group_norm` as the registered op ``torch.ops.cunorm.group_norm`` (differentiable)."""
    groups, axis = row_norms.check_int(num_groups, "num_groups"), row_norms.check_int(channel_axis, "channel_axis")
    stats = row_norms.check_flag(return_stats, "return_stats")
    epilogue = plans.activation_flags(activation)
    if epilogue and _needs_grad(x, weight, bias):  # the activation as torch's op (see rms_norm)
        return _activated(group_norm(x, groups, weight, bias, eps=eps, channel_axis=axis, return_stats=stats),
                          activation)
    if _eager_autograd(x, weight, bias):
        return _unpack(_dropped(list(_channel_norm_apply(x, weight, bias, None, None, "group", groups, True, 0.1, eps,
                                                         axis)), stats, True, 2))
    asked = stats or _needs_grad(x, weight, bias)
    results = torch.ops.cunorm.group_norm(x, groups, weight, bias, row_norms.check_eps(eps), axis, asked, epilogue)
    return _unpack(_dropped(results, stats, asked, 2))


def instance_norm(x, weight=None, bias=None, *, eps=DEFAULT_EPS, channel_axis=1, return_stats=False,
                  activation=None):
    """:func:`cunorm.instance_norm` as the registered op ``torch.ops.cunorm.instance_norm`` (differentiable)."""
    axis, stats = row_norms.check_int(channel_axis, "channel_axis"), row_norms.check_flag(return_stats, "return_stats")
    epilogue = plans.activation_flags(activation)
    if epilogue and _needs_grad(x, weight, bias):  # the activation as torch's op (see rms_norm)
        return _activated(instance_norm(x, weight, bias, eps=eps, channel_axis=axis, return_stats=stats), activation)
    if _eager_autograd(x, weight, bias):
        return _unpack(_dropped(list(_channel_norm_apply(x, weight, bias, None, None, "instance", None, True, 0.1, eps,
                                                         axis)), stats, True, 2))
    asked = stats or _needs_grad(x, weight, bias)
    results = torch.ops.cunorm.instance_norm(x, weight, bias, row_norms.check_eps(eps), axis, asked, epilogue)
    return _unpack(_dropped(results, stats, asked, 2))


def batch_norm(x, weight=None, bias=None, *, running_mean=None, running_var=None, training=True, momentum=0.1,
               eps=DEFAULT_EPS, channel_axis=1, return_stats=False, activation=None):
    """:func:`cunorm.batch_norm` as the registered op ``torch.ops.cunorm.batch_norm``; in training the
    running buffers are updated in place as there (the op returns them, this copies them back)."""
    axis, stats = row_norms.check_int(channel_axis, "channel_axis"), row_norms.check_flag(return_stats, "return_stats")
    training = row_norms.check_flag(training, "training")
    epilogue = plans.activation_flags(activation)
    if training:  # (the operator updates copies; both buffers are checked before either is written back)
        for buffer, name in ((running_mean, "running_mean"), (running_var, "running_var")):
            if buffer is not None:
                row_norms.check_writable(buffer, name)
    if epilogue and _needs_grad(x, weight, bias):  # the activation as torch's op (see rms_norm)
        return _activated(batch_norm(x, weight, bias, running_mean=running_mean, running_var=running_var,
                                     training=training, momentum=momentum, eps=eps, channel_axis=axis,
                                     return_stats=stats), activation)
    if _eager_autograd(x, weight, bias):
        return _unpack(_dropped(list(_channel_norm_apply(x, weight, bias, running_mean, running_var, "batch", None,
                                                         training, momentum, eps, axis)), stats, True, 2))
    asked = stats or (training and _needs_grad(x, weight, bias))
    results = torch.ops.cunorm.batch_norm(x, weight, bias, running_mean, running_var, training,
                                          channel_norms._momentum(momentum), row_norms.check_eps(eps), axis, asked,
                                          epilogue)
    buffers = [b for b in (running_mean, running_var) if b is not None] if training else []
    if buffers:
        with torch.no_grad():
            for buffer, updated in zip(buffers, results[-len(buffers):]):
                buffer.copy_(updated)
        results = results[:-len(buffers)]
    return _unpack(_dropped(results, stats, asked, 2))
