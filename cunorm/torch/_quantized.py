"""quantize= (cunorm/_engine/quantize.py) as a registered torch operator,
``torch.ops.cunorm.row_norm_quantized``, so that torch.compile takes a
quantized rms_norm or layer_norm as one opaque op. Inference only: the
operator has no autograd formula (a quantized y has no gradient); it and
cunorm.torch's functions refuse a call that autograd would record."""
from __future__ import annotations

import torch
from torch import Tensor

from .._engine import calls, ops, row_norms
from .._engine.quantize import check, scales_shape, scales_strided
from .._interop import torch as _adapter
from ._library import define

SCHEMA = ("(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, SymInt[] axes, float eps, bool return_stats, "
          "int epilogue, str norm, str quantize, Tensor? quant_scale, Tensor? quant_scale_ub, int? quant_group, "
          "str? quant_scale_layout, bool return_unquantized) -> Tensor[]")
#: the row norms that take quantize=
NORMS = {"rms": "rms_norm", "ln": "layer_norm"}


def _check_norm(norm: str) -> None:
    if norm not in NORMS:  # (a caller's string: checked, never pasted into a kernel name)
        raise ValueError(f"row_norm_quantized: norm must be one of {sorted(NORMS)}, got {norm!r}")


def _row_norm_quantized(x, weight, bias, residual, axes, eps, return_stats, epilogue, norm, quantize, quant_scale,
                        quant_scale_ub, quant_group, quant_scale_layout, return_unquantized):
    _check_norm(norm)
    results = calls.rows(norm, x, weight, bias, residual, tuple(axes), eps, return_stats, None, None,
                         epilogue=epilogue,
                         quantize=(quantize, quant_scale, quant_scale_ub, quant_group, quant_scale_layout,
                                   return_unquantized))
    return list(results) if isinstance(results, tuple) else [results]


def _fake(x, weight, bias, residual, axes, eps, return_stats, epilogue, norm, quantize, quant_scale, quant_scale_ub,
          quant_group, quant_scale_layout, return_unquantized):
    _check_norm(norm)
    quant = check(quantize, quant_scale, quant_scale_ub, _adapter.NUMPY_DTYPE.get(x.dtype), quant_group,
                  quant_scale_layout, return_unquantized)
    first, last = row_norms.axis_span(tuple(axes), x.dim())
    outputs = [x.new_empty(x.shape, dtype=getattr(torch, quant.format.name))]
    if quant.row_scales:
        shape = scales_shape(quant, tuple(x.shape), first)
        strides = scales_strided(quant, shape).strides if quant.group else None
        outputs.append(x.new_empty_strided(shape, strides, dtype=torch.float32) if strides else
                       x.new_empty(shape, dtype=torch.float32))
    if return_unquantized:
        outputs.append(torch.empty_like(x, memory_format=torch.contiguous_format))
    if residual is not None:
        outputs.append(torch.empty_like(x, memory_format=torch.contiguous_format))
    if return_stats:
        shape = row_norms.stats_shape(tuple(x.shape), first, last)
        outputs += [x.new_empty(shape, dtype=_adapter.ACCUMULATION[x.dtype]) for _ in ops.statistics_of(norm)]
    return outputs


define("row_norm_quantized", SCHEMA, _row_norm_quantized, _fake)


def quantized(norm: str, x: Tensor, weight, bias, residual, axes, eps, return_stats, epilogue, quantize, quant_scale,
              quant_scale_ub, quant_group, quant_scale_layout, return_unquantized, needs_grad: bool):
    """cunorm.torch's rms_norm / layer_norm with quantize=: the operator's
    results, unpacked; refused where autograd would record the call."""
    # (the request checked before the operator's schema sees a None format)
    check(quantize, quant_scale, quant_scale_ub, _adapter.NUMPY_DTYPE.get(x.dtype), quant_group, quant_scale_layout,
          return_unquantized)
    if needs_grad:
        raise RuntimeError(f"cunorm.torch.{NORMS[norm]}: quantize= is inference only (a quantized y has no "
                           f"gradient): call it under torch.no_grad() or torch.inference_mode()")
    results = torch.ops.cunorm.row_norm_quantized(x, weight, bias, residual, axes, row_norms.check_eps(eps),
                                                  row_norms.check_flag(return_stats, "return_stats"), epilogue, norm,
                                                  quantize, quant_scale, quant_scale_ub, quant_group,
                                                  quant_scale_layout, return_unquantized)
    return results[0] if len(results) == 1 else tuple(results)
