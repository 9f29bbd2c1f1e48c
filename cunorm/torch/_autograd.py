"""torch's eager autograd over cunorm: autograd.Functions around the
engine's calls of the ops and their backward passes
(cunorm/_engine/calls.py), for cunorm.torch's functions and layers.

Outside torch.compile these Functions run the array-level ops themselves
(the launch cache, cunorm/_engine/launch_cache.py) forward and backward: the registered
operators' dispatch (cunorm/torch/__init__.py) costs more host time than the
kernels on small inputs. Under dynamo the operators are the route.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._engine import calls, ops, plans
from .._engine.ops import DEFAULT_EPS
from .._interop import torch as _adapter

_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling

#: the epilogue's activations as torch's ops (where they run unfused: under autograd, and under torch.compile)
TORCH_ACTIVATIONS = {"relu": torch.relu, "silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
                     "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
                     "identity": lambda t: t}


def needs_grad(*tensors) -> bool:
    """Whether autograd records a call on these tensors: grad mode on and
    one of them requiring grad (a loop, not a generator: this is on every
    training call)."""
    if not _grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


def offset_weight(x: Tensor, weight: Tensor) -> Tensor:
    """``1 + weight`` in the accumulation dtype, as the kernel's weight
    offset forms it (autograd then takes the offset's gradient)."""
    return weight.to(_adapter.ACCUMULATION[x.dtype]) + 1


def eager_autograd(*tensors) -> bool:
    """needs_grad outside dynamo's tracing: the Functions below are the route."""
    return needs_grad(*tensors) and not _is_compiling()


def once_differentiable(backward_fn):
    """torch's once_differentiable, which runs the backward under no_grad
    and marks its outputs so a double backward raises: needed only where
    the backward runs with grad enabled (create_graph=True); in the usual
    backward grad is already off and the wrapper's scope is pure cost.
    torch's wrapper looks among its arguments for a gradient that requires
    grad, and a list-returning operator's formula gets its gradients as one
    list: the wrapper is given them flattened."""

    def backward_once(ctx, *grads):
        if not _grad_enabled():
            return backward_fn(ctx, *grads)
        flat = grads[0] if len(grads) == 1 and isinstance(grads[0], (list, tuple)) else grads
        guarded = torch.autograd.function.once_differentiable(lambda ctx, *_: backward_fn(ctx, *grads))
        return guarded(ctx, *flat)

    return backward_once


class RowNorm(torch.autograd.Function):
    """rms_norm / layer_norm: outputs y[, h], then the statistics (not differentiable).
    ``rounding`` (rms_norm's): the backward is the same for both; the weight's
    gradient sums dy * h * rstd unrounded."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, norm, axis, eps, rounding):
        op = ops.BY_NORM[norm]
        epilogue = plans.rms_epilogue(0, rounding, None, weight is not None) if "rounding" in op.options else 0
        results = calls.rows(norm, x, weight, bias, residual, axis, eps, True, None, None, epilogue=epilogue)
        statistics = results[-len(op.statistics):]
        h = results[1] if residual is not None else x
        ctx.save_for_backward(h, weight, bias, *statistics)
        ctx.norm, ctx.axis, ctx.residual = norm, axis, residual is not None
        ctx.mark_non_differentiable(*statistics)
        ctx.set_materialize_grads(False)  # (no zero tensors made for the statistics' absent gradients)
        return results

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, *grads):
        h, weight, bias, *statistics = ctx.saved_tensors
        dh = grads[0] if ctx.residual else None
        if dy is None:  # only h was used
            dy = torch.zeros_like(h)
        op = ops.BY_NORM[ctx.norm]
        saved = dict(zip(op.statistics, statistics))
        dx, *grads = calls.rows_grad(ctx.norm, dy, h, saved.get("mean"), saved.get("rstd"), weight, bias, dh, ctx.axis,
                                     0.0, None)
        grads = dict(zip(op.params, grads))
        return dx, grads.get("weight"), grads.get("bias"), dx if ctx.residual else None, None, None, None, None


class ChannelNorm(torch.autograd.Function):
    """group_norm / instance_norm / batch_norm: outputs y, mean, rstd (not differentiable)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, norm, num_groups, training, momentum, eps,
                channel_axis):
        groups = num_groups if ops.BY_NORM[norm].groups else None
        y, mean, rstd = calls.channels(norm, x, groups, weight, bias, running_mean, running_var, training, momentum,
                                       eps, channel_axis, True, None)
        # eval-mode BatchNorm's backward reads the running buffers, not rstd
        saved = (mean, rstd) if training else (running_mean, running_var)
        ctx.save_for_backward(x, *saved, weight, bias)
        ctx.args = norm, num_groups, training, eps, channel_axis
        ctx.mark_non_differentiable(mean, rstd)
        ctx.set_materialize_grads(False)  # (no zero tensors made for the statistics' absent gradients)
        return y, mean, rstd

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, _dmean, _drstd):
        if dy is None:  # y unused (the statistics alone were)
            return (None,) * 11
        x, mean, rstd, weight, bias = ctx.saved_tensors
        norm, num_groups, training, eps, channel_axis = ctx.args
        op = ops.BY_NORM[norm]
        # (the forward's eps reaches the backward only where eval mode reads the running variance)
        dx, dw, db = calls.channel_grad(norm, dy, x, mean, rstd, num_groups if op.groups else None, weight, bias,
                                        channel_axis, training, eps if op.running else DEFAULT_EPS, None)
        return dx, dw, db, None, None, None, None, None, None, None, None


def raw_apply(cls, tensors: int):
    """``cls.apply`` without torch.autograd.Function.apply's Python prologue,
    which outside functorch's transforms only unwraps functorch's dead
    wrappers: the C apply behind it, with the tensors among the first
    ``tensors`` arguments unwrapped by the same C helper. Under a functorch
    transform, or on a torch without these hooks, cls.apply itself."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    unwrap = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)
    if active is None or unwrap is None:
        return cls.apply
    c_apply = super(torch.autograd.Function, cls).apply

    def apply(*args):
        if active():
            return cls.apply(*args)
        return c_apply(*[unwrap(a) if isinstance(a, Tensor) else a for a in args[:tensors]], *args[tensors:])

    return apply


row_norm_apply = raw_apply(RowNorm, 4)
channel_norm_apply = raw_apply(ChannelNorm, 5)
