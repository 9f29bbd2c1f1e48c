"""Per-head weights, ``shift=``, ``scale=``, ``residual_gate=``,
``gate=`` and a float32 residual under 16-bit x on torch tensors (cunorm/_engine/conditioning.py). Per-head
parameters alone, over rows the plain backward takes, run as the plain
norm instead (heads_alone): its autograd Function in eager mode, its
operator under dynamo.

Outside autograd and dynamo the engine runs them fused (one rows_cached
pass); where dynamo traces a call autograd does not record, the fused
forward is one registered operator (torch.ops.cunorm.rms_norm_conditioned,
layer_norm_conditioned). Where autograd records, shift=, scale= and
residual_gate= of one per-sample (or one-for-all) pattern run fused
forward and backward: ModulatedRowNorm in eager, the operator and its
autograd formula (torch.ops.cunorm.*_modulated_backward) under dynamo
(cunorm/_engine/modulated_grad.py); gate= over rows (a weight over the
normalized axes, per head or group, or none) likewise: GatedRowNorm in eager, the
operator and torch.ops.cunorm.rms_norm_gated_backward under dynamo
(cunorm/_engine/gated_grad.py); the float32 residual alone likewise:
WideRowNorm in eager, the plain operator and its formula's
torch.ops.cunorm.*_float32_residual_backward under dynamo
(cunorm/_engine/wide_grad.py). Otherwise the call is the plain norm
(cunorm's differentiable operator) followed by torch's elementwise ops,
each formed in float32 and rounded once to x's dtype, so autograd and
inductor see ordinary ops: the gated residual before the norm; the
per-head weight and bias, the modulation and the activation after it;
the gated RMSNorm's gate before or after (conditioning.gated).
"""
from __future__ import annotations

import math

import torch

from .._engine import calls, conditioning, gated_grad, gradients, ops, plans, row_norms, wide_grad
from .._interop import torch as _adapter
from ._autograd import TORCH_ACTIVATIONS, needs_grad, offset_weight, once_differentiable
from ._operators import axes_span, modulated_fusable, operator_axes


class ModulatedRowNorm(torch.autograd.Function):
    """rms_norm / layer_norm with shift=, scale= and residual_gate=, fused
    forward (rows_cached) and backward (modulated_grads.cu): outputs y[,
    h], then the statistics (not differentiable)."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, shift, scale, residual_gate, norm, axis, eps, epilogue):
        results = calls.rows(norm, x, weight, bias, residual, axis, eps, True, None, None, epilogue,
                             conditioned={"shift": shift, "scale": scale, "residual_gate": residual_gate})
        statistics = results[-(2 if norm == "ln" else 1):]
        h = results[1] if residual is not None else x
        ctx.save_for_backward(h, x if residual_gate is not None else None, weight, bias, shift, scale, residual_gate,
                              *statistics)
        ctx.norm, ctx.axis, ctx.residual = norm, axis, residual is not None
        ctx.mark_non_differentiable(*statistics)
        ctx.set_materialize_grads(False)
        return results

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, *grads):
        h, x, weight, bias, shift, scale, residual_gate, *statistics = ctx.saved_tensors
        dh = grads[0] if ctx.residual else None
        if dy is None:  # only h was used
            dy = torch.zeros_like(h)
        mean, rstd = statistics if ctx.norm == "ln" else (None, statistics[0])
        g = calls.rows_grad_modulated(ctx.norm, dy, h, mean, rstd, weight, bias, dh, shift, scale, residual_gate, x,
                                      ctx.axis)
        dres = None
        if ctx.residual:
            dres = g.residual if residual_gate is not None else g.x
        return g.x, g.weight, g.bias, dres, g.shift, g.scale, g.residual_gate, None, None, None, None


class GatedRowNorm(torch.autograd.Function):
    """rms_norm with gate=, fused forward (rows_cached) and backward
    (rows_grad_gated, cunorm/_engine/gated_grad.py): outputs y, then rstd
    (not differentiable)."""

    @staticmethod
    def forward(ctx, x, weight, gate, axis, eps, epilogue):
        y, rstd = calls.rows("rms", x, weight, None, None, axis, eps, True, None, None, epilogue,
                             conditioned={"gate": gate})
        ctx.save_for_backward(x, weight, gate, rstd)
        ctx.axis = axis
        ctx.before = not epilogue & plans.FLAG_GATE_INPUT
        ctx.offset = bool(epilogue & plans.FLAG_WEIGHT_OFFSET)
        ctx.mark_non_differentiable(rstd)
        ctx.set_materialize_grads(False)
        return y, rstd

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, _):
        if dy is None:
            return None, None, None, None, None, None
        x, weight, gate, rstd = ctx.saved_tensors
        w = offset_weight(x, weight) if weight is not None and ctx.offset else weight
        g = calls.rows_grad_gated(dy, x, rstd, w, gate, ctx.before, ctx.axis)
        dw = None if g.weight is None else g.weight.to(weight.dtype)
        return g.x, dw, g.gate, None, None, None


class WideRowNorm(torch.autograd.Function):
    """rms_norm / layer_norm of 16-bit x with a float32 residual (the
    float32 residual stream), fused forward (rows_cached's float32 h) and
    backward (rows_grad_wide, cunorm/_engine/wide_grad.py): outputs y, h,
    then the statistics (not differentiable)."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, norm, axis, eps, epilogue):
        results = calls.rows(norm, x, weight, bias, residual, axis, eps, True, None, None, epilogue)
        statistics = results[2:]
        ctx.save_for_backward(results[1], weight, bias, *statistics)
        ctx.norm, ctx.axis, ctx.dtype = norm, axis, x.dtype
        ctx.mark_non_differentiable(*statistics)
        ctx.set_materialize_grads(False)
        return tuple(results)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, dh, *_):
        h, weight, bias, *statistics = ctx.saved_tensors
        if dy is None:  # only h was used
            dy = torch.zeros(h.shape, dtype=ctx.dtype, device=h.device)
        mean, rstd = statistics if ctx.norm == "ln" else (None, statistics[0])
        g = calls.rows_grad_wide(ctx.norm, dy, h, mean, rstd, weight, bias, dh, ctx.axis)
        return g.x, g.weight, g.bias, g.residual, None, None, None, None


def wide_fusable(x, weight, bias, axis, epilogue) -> bool:
    """Whether the float32 residual stream's fused backward
    (wide_grad.fusable) takes a call on torch tensors (CUDA, or meta: the
    operators' fakes give their shapes): parameters over the normalized
    axes or none, no activation or weight offset."""
    if (not isinstance(x, torch.Tensor) or x.device.type not in ("cuda", "meta")
            or epilogue & plans.UNFUSED_IN_BACKWARD
            or conditioning.per_head(weight, axis) or conditioning.per_head(bias, axis)):
        return False
    first, last = axes_span(axis, x.dim())
    return wide_grad.fusable(tuple(x.shape), first, last)


def heads_alone(norm, x, weight, bias, axis, residual, *operands) -> bool:
    """Whether a call's only per-row operands are parameters per head
    that the plain backward takes (gradients.per_head_fits): such a call
    runs as the plain norm (its autograd Function), which passes the
    parameters through to the kernels; under dynamo, the plain operator,
    whose autograd formula runs the same backward."""
    if (any(a is not None for a in operands) or not isinstance(x, torch.Tensor)
            or not (conditioning.per_head(weight, axis) or conditioning.per_head(bias, axis))
            or conditioning.wide(x, residual)):
        return False
    first, last = axes_span(axis, x.dim())
    return (last == x.dim() - 1 and all(type(s) is int for s in x.shape)
            and gradients.per_head_fits(math.prod(x.shape[first:]), x.element_size(), weight is not None,
                                        bias is not None))


def gated_fusable(x, gate, axis) -> bool:
    """Whether the fused gated backward (gated_grad.fusable) takes a call on
    torch tensors (CUDA, or meta: the operators' fakes give their shapes)."""
    if not (isinstance(x, torch.Tensor) and x.device.type in ("cuda", "meta") and isinstance(gate, torch.Tensor)):
        return False
    first, last = axes_span(axis, x.dim())
    return gated_grad.fusable(tuple(x.shape), x.element_size(), first, last)


def conditioned(norm: str, plain, x, weight, bias, *, axis, eps, residual, return_stats, epilogue, activation,
                shift, scale, residual_gate, gate=None, **options):
    """The row norm ``norm`` ("rms" or "ln") with per-row operands.
    ``plain(x, weight, bias, *, axis, eps, residual, return_stats,
    activation, **options)`` is cunorm.torch's function of the norm
    without them; ``epilogue``: its validated FLAGS bits; ``options``:
    rms_norm's weight_offset and rounding."""
    arrays = (x, weight, bias, residual, shift, scale, residual_gate, gate)
    grad, compiling = needs_grad(*arrays), torch.compiler.is_compiling()
    if not (grad or compiling):
        return calls.rows(norm, x, weight, bias, residual, axis, eps, return_stats, None, None, epilogue,
                          conditioned={"shift": shift, "scale": scale, "residual_gate": residual_gate, "gate": gate})
    fused_backward = gate is None and modulated_fusable(norm, x, weight, bias, residual, axis, epilogue, shift, scale,
                                                        residual_gate)
    fused_gated = gate is not None and residual is None and gated_fusable(x, gate, axis)
    fused_wide = (grad and all(a is None for a in (shift, scale, residual_gate, gate))
                  and conditioning.wide(x, residual) and _checked_wide(x, residual, axis)
                  and wide_fusable(x, weight, bias, axis, epilogue))
    if fused_wide:
        return _wide(norm, x, weight, bias, residual, axis, eps, return_stats, epilogue, compiling)
    if compiling and (fused_backward or fused_gated or not grad):
        return _operator(norm, x, weight, bias, residual, shift, scale, residual_gate, gate, axis, eps, return_stats,
                         epilogue, grad)
    if fused_gated:
        y, rstd = GatedRowNorm.apply(x, weight, gate, axis, eps, epilogue)
        return (y, rstd) if return_stats else y
    if fused_backward:
        results = ModulatedRowNorm.apply(x, weight, bias, residual, shift, scale, residual_gate, norm, axis, eps,
                                         epilogue)
        if not return_stats:
            results = results[:2] if residual is not None else results[0]
        return results
    acc = _adapter.ACCUMULATION[x.dtype]
    if gate is not None:
        if not isinstance(gate, torch.Tensor):
            raise TypeError(f"gate must be a torch tensor as x is, got {type(gate).__name__}")
        _, last = axes_span(axis, x.dim())
        others = [n for n, a in (("shift", shift), ("scale", scale), ("residual_gate", residual_gate)) if a is not None]
        conditioning.check_gate(norm, tuple(x.shape), x.dtype, tuple(gate.shape), gate.dtype, last,
                                residual is not None, epilogue, others)
        return conditioning.gated(
            lambda h, w, **kw: plain(h, w, None, **kw), x, weight, gate,
            norm_before_gate=not epilogue & plans.FLAG_GATE_INPUT,
            normalized=bool(epilogue & plans.FLAG_ROUND_NORMALIZED),
            offset=bool(epilogue & plans.FLAG_WEIGHT_OFFSET),
            round_weighted=weight is not None and weight.dtype == x.dtype and x.element_size() == 2,
            to=_to, acc=acc, silu=torch.nn.functional.silu, return_stats=return_stats, axis=axis, eps=eps)
    if conditioning.wide(x, residual):
        _checked_wide(x, residual, axis, residual_gate is not None)
    return conditioning.composed(plain, x, weight, bias, to=_to, acc=acc, activate=TORCH_ACTIVATIONS.get(activation),
                                 axis=axis, eps=eps, residual=residual, residual_gate=residual_gate, shift=shift,
                                 scale=scale, return_stats=return_stats, activation=activation, **options)


def _to(t, dtype):
    return t.to(dtype)


def _checked_wide(x, residual, axis, residual_gate: bool = False) -> bool:
    """conditioning.check_wide of a torch call (its TypeError or
    ValueError); True where the residual is the float32 stream."""
    _, last = axes_span(axis, x.dim())
    return conditioning.check_wide(x.dtype, residual.dtype, x.element_size(), residual.dtype == torch.float32, last,
                                   x.dim(), residual_gate)


def _wide(norm, x, weight, bias, residual, axis, eps, return_stats, epilogue, compiling):
    """The float32 residual stream where autograd records: WideRowNorm in
    eager mode; under dynamo the plain operator, whose autograd formula
    calls the stream's backward operator (torch.ops.cunorm.*_float32_residual_backward)."""
    if compiling:
        axes, eps = operator_axes(axis), row_norms.check_eps(eps)
        if norm == "rms":
            results = torch.ops.cunorm.rms_norm(x, weight, residual, axes, eps, True, epilogue)
        else:
            results = torch.ops.cunorm.layer_norm(x, weight, bias, residual, axes, eps, True, epilogue)
    else:
        results = WideRowNorm.apply(x, weight, bias, residual, norm, axis, eps, epilogue)
    return tuple(results) if return_stats else (results[0], results[1])


def _operator(norm, x, weight, bias, residual, shift, scale, residual_gate, gate, axis, eps, return_stats, epilogue,
              grad):
    """The call as the registered operator torch.ops.cunorm.{rms,layer}_norm_conditioned
    (what dynamo traces: one fused forward, and where autograd records the
    fused modulated backward), its arguments checked while tracing."""
    given = {"shift": shift, "scale": scale, "residual_gate": residual_gate, "gate": gate}
    for name, a in given.items():
        if a is not None and not isinstance(a, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor as x is, got {type(a).__name__}")
    first, last = axes_span(axis, x.dim())
    if conditioning.wide(x, residual):
        _checked_wide(x, residual, axis, residual_gate is not None)
    shape_of = lambda a: None if a is None else tuple(a.shape)  # noqa: E731
    # (shapes and dtypes only, in plain values dynamo traces: the engine checks the rest when it runs)
    conditioning.check_shapes(norm, tuple(x.shape), x.dtype, first, last, shape_of(weight), shape_of(bias),
                              residual is not None, epilogue,
                              {name: None if a is None else (tuple(a.shape), a.dtype) for name, a in given.items()})
    asked = return_stats or grad
    axes, eps = operator_axes(axis), row_norms.check_eps(eps)
    if norm == "rms":
        results = torch.ops.cunorm.rms_norm_conditioned(x, weight, residual, shift, scale, residual_gate, gate, axes,
                                                        eps, asked, epilogue)
    else:
        results = torch.ops.cunorm.layer_norm_conditioned(x, weight, bias, residual, shift, scale, residual_gate,
                                                          axes, eps, asked, epilogue)
    if asked and not return_stats:
        results = results[:len(results) - len(ops.statistics_of(norm))]
    return results[0] if len(results) == 1 else tuple(results)
