"""Per-head weights, ``shift=``, ``scale=`` and ``residual_gate=`` on
torch tensors (cunorm/_engine/conditioning.py).

Outside autograd and dynamo the engine runs them fused (one rows_cached
pass). Where autograd records or dynamo traces, the call is the plain norm
(cunorm's differentiable operator) followed by torch's elementwise ops,
each formed in float32 and rounded once to x's dtype, so autograd and
inductor see ordinary ops: the gated residual before the norm; the
per-head weight and bias, the modulation and the activation after it.
"""
from __future__ import annotations

import torch

from .._engine import calls, conditioning, plans
from .._interop import torch as _adapter
from ._autograd import TORCH_ACTIVATIONS, needs_grad


def conditioned(norm: str, plain, x, weight, bias, *, axis, eps, residual, return_stats, epilogue, activation,
                shift, scale, residual_gate, **options):
    """The row norm ``norm`` ("rms" or "ln") with per-row operands.
    ``plain(x, weight, bias, *, axis, eps, residual, return_stats,
    activation, **options)`` is cunorm.torch's function of the norm
    without them; ``epilogue``: its validated FLAGS bits; ``options``:
    rms_norm's weight_offset and rounding."""
    arrays = (x, weight, bias, residual, shift, scale, residual_gate)
    if not (needs_grad(*arrays) or torch.compiler.is_compiling()):
        return calls.rows(norm, x, weight, bias, residual, axis, eps, return_stats, None, None, epilogue,
                          conditioned={"shift": shift, "scale": scale, "residual_gate": residual_gate})
    acc = _adapter.ACCUMULATION[x.dtype]
    h = None
    if residual_gate is not None:
        if residual is None:
            raise ValueError("residual_gate scales x in h = residual + residual_gate * x: pass residual= too")
        h = (residual.to(acc) + residual_gate.to(acc) * x.to(acc)).to(x.dtype)
        x, residual = h, None
    heads = conditioning.per_head(weight, axis) or conditioning.per_head(bias, axis)
    modulated = shift is not None or scale is not None
    after = heads or modulated
    args = (None, None) if heads else (weight, bias)
    if heads and "weight_offset" in options:
        options = {**options, "weight_offset": 0}  # (1 + w multiplies below)
    results = plain(x, *args, axis=axis, eps=eps, residual=residual, return_stats=return_stats,
                    activation=None if after else activation, **options)
    results = list(results) if isinstance(results, tuple) else [results]
    if after:
        y = conditioning.modulate(results[0], weight if heads else None, bias if heads else None, shift, scale,
                                  offset=bool(epilogue & plans.FLAG_WEIGHT_OFFSET), cast=lambda a: a.to(acc),
                                  activate=TORCH_ACTIVATIONS.get(activation))
        results[0] = y.to(results[0].dtype)
    if h is not None:
        results.insert(1, h)
    return results[0] if len(results) == 1 else tuple(results)
