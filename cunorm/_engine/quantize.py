"""Quantize on write: the formats, the scalings and the checks of
``quantize=`` (rms_norm, layer_norm over rows).

y is formed in float32 from the float32 statistics and the parameters,
divided by its scale (multiplied by its float32 reciprocal: a value within
an ulp of a rounding boundary may round the other way), rounded to nearest
even in the format and saturated to its finite range
(cunorm/kernels/stages.cuh, QuantStore). The scale is the
caller's (a one-element float32 array: static per tensor) or each row's
``max|y| / qmax``, optionally capped by the caller's bound first and never
below ``1 / (qmax * 512)`` (dynamic per row; an all-zero row gets that
floor).
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from . import dtypes

#: scalings (QuantStore's SCALING)
STATIC, ROW, ROW_BOUNDED = 0, 1, 2


@dataclass(frozen=True)
class Format:
    name: str
    kernel_type: str  # the one-byte type in cunorm/kernels/stages.cuh
    qmax: float  # the largest finite value
    numpy: np.dtype  # the dtype of a NumPy result (the reference)
    device: np.dtype  # the dtype of a CuPy result (raw bits for FP8: CuPy has no FP8 dtypes)

    @property
    def min_scale(self) -> float:
        """The floor of a dynamic scale (an all-zero row's)."""
        return float(np.float32(1.0) / np.float32(self.qmax * 512.0))


FORMATS = {
    "float8_e4m3fn": Format("float8_e4m3fn", "cunorm::e4m3_t", 448.0, np.dtype(ml_dtypes.float8_e4m3fn),
                            np.dtype(np.uint8)),
    "float8_e5m2": Format("float8_e5m2", "cunorm::e5m2_t", 57344.0, np.dtype(ml_dtypes.float8_e5m2),
                          np.dtype(np.uint8)),
    "int8": Format("int8", "signed char", 127.0, np.dtype(np.int8), np.dtype(np.int8)),
}
FORMAT_NAMES = ", ".join(repr(n) for n in FORMATS)


@dataclass(frozen=True)
class Quantize:
    """A validated quantize= request: the format and the scaling."""

    format: Format
    scaling: int

    @property
    def key(self) -> tuple[str, int]:
        """What plans and caches key it by."""
        return self.format.name, self.scaling

    @property
    def row_scales(self) -> bool:
        return self.scaling != STATIC


def by_key(key) -> Quantize | None:
    return None if key is None else Quantize(FORMATS[key[0]], key[1])


def check(quantize, quant_scale, quant_scale_ub, x_dtype) -> Quantize | None:
    """The request, validated (None: no quantization), before anything runs."""
    if quantize is None:
        if quant_scale is not None or quant_scale_ub is not None:
            given = "quant_scale" if quant_scale is not None else "quant_scale_ub"
            raise ValueError(f"{given} is for a quantized output: pass quantize= too")
        return None
    if not isinstance(quantize, str):
        raise TypeError(f"quantize must be None or one of {FORMAT_NAMES}, got {type(quantize).__name__}")
    fmt = FORMATS.get(quantize)
    if fmt is None:
        raise ValueError(f"quantize must be None or one of {FORMAT_NAMES}, got {quantize!r}")
    if x_dtype == dtypes.float64:
        raise TypeError("quantize= takes float16, bfloat16 or float32 x (y is formed in float32), got float64")
    if quant_scale is not None and quant_scale_ub is not None:
        raise ValueError("quant_scale (a static scale) and quant_scale_ub (a bound on dynamic scales) exclude "
                         "each other")
    scaling = STATIC if quant_scale is not None else ROW_BOUNDED if quant_scale_ub is not None else ROW
    return Quantize(fmt, scaling)


def check_scale_array(a, name: str) -> None:
    """A static scale or a bound: one float32 element (an array the caller
    may change between calls, as a captured CUDA graph reads it)."""
    if np.dtype(a.dtype) != np.float32:
        raise TypeError(f"{name} must be a float32 array, got dtype {a.dtype}")
    if a.size != 1 or a.ndim > 1:
        raise ValueError(f"{name} must hold one element (shape () or (1,)), got shape {tuple(a.shape)}")


def reference(y, quant: Quantize, scale=None, bound=None):
    """(q, scales) of a float64 y whose last axis is one row: NumPy's
    quantization of what the kernel stores. ``scale``/``bound``: the
    caller's one-element arrays. scales is None for a static scale."""
    fmt = quant.format
    if quant.scaling == STATIC:
        s = np.float64(np.float32(np.asarray(scale).reshape(())))
        scales = None
    else:
        with np.errstate(invalid="ignore"):
            amax = np.fmax.reduce(np.abs(y), axis=-1, keepdims=True, initial=0.0)
        if quant.scaling == ROW_BOUNDED:
            amax = np.minimum(amax, np.float64(np.float32(np.asarray(bound).reshape(()))))
        scales = np.maximum((amax / fmt.qmax).astype(np.float32), np.float32(fmt.min_scale))
        s = scales.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        v = y / s
    if fmt.name == "int8":
        q = np.clip(np.rint(np.nan_to_num(v, nan=0.0)), -fmt.qmax, fmt.qmax).astype(np.int8)
    else:
        q = np.clip(v, -fmt.qmax, fmt.qmax).astype(fmt.numpy)
    return q, scales


def scales_shape(call) -> tuple:
    """Dynamic scales' shape: x's with each normalized (trailing) axis 1, so
    that ``q * scales`` broadcasts back to y."""
    return tuple(call.x.shape[: call.first]) + (1,) * (call.last - call.first + 1)


def reference_results(call, results):
    """A NumPy call's results from its float64 reference (exact y, then h
    and the statistics as asked): (q[, scales][, h][, statistics])."""
    results = results if isinstance(results, tuple) else (results,)
    y, rest = results[0], list(results[1:])
    rows = y.reshape(tuple(y.shape[: call.first]) + (-1,))
    q, scales = reference(rows, call.quant, scale=call.quant_scale, bound=call.quant_scale)
    out = [q.reshape(y.shape)]
    if scales is not None:
        out.append(scales.reshape(scales_shape(call)))
    if call.residual is not None:
        out.append(rest.pop(0))
    acc = dtypes.accumulation(call.x.dtype)
    out += [s.astype(acc) for s in rest]
    return out[0] if len(out) == 1 else tuple(out)
