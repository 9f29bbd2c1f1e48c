"""Quantize on write: the formats, the scalings and the checks of
``quantize=`` (rms_norm, layer_norm over rows).

y is formed in float32 from the float32 statistics and the parameters,
divided by its scale (multiplied by its float32 reciprocal: a value within
an ulp of a rounding boundary may round the other way), rounded to nearest
even in the format and saturated to its finite range
(cunorm/kernels/stages.cuh, QuantStore). The scale is the
caller's (a one-element float32 array: static per tensor) or each row's
(or each group's of 64 or 128 elements along the row) ``max|y| / qmax``,
optionally capped by the caller's bound first and never below
``1 / (qmax * 512)`` (dynamic; an all-zero row or group gets that floor).
Group scales come back (rows, n / group), row-major or in the transposed,
column-major layout TMA-fed GEMMs read (rows padded to 16 bytes: DeepGEMM's
and SGLang's ``scale_tma_aligned``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from . import dtypes

#: scalings (QuantStore's SCALING)
STATIC, ROW, ROW_BOUNDED = 0, 1, 2
#: group sizes quant_group= takes (QuantStore's GROUP; 0: a scale a row)
GROUPS = (64, 128)
#: layouts of group scales: (rows, groups) C-contiguous; its transpose
#: (groups, rows) seen as (rows, groups); the same with rows padded to a
#: multiple of 4 (16 bytes, a TMA box's alignment)
ROW_MAJOR, COLUMN_MAJOR, COLUMN_MAJOR_TMA = "row_major", "column_major", "column_major_tma"
LAYOUTS = (ROW_MAJOR, COLUMN_MAJOR, COLUMN_MAJOR_TMA)


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
    """A validated quantize= request: the format, the scaling, the group
    size, the scales' layout and whether y is also returned unquantized."""

    format: Format
    scaling: int
    group: int = 0  # elements a scale covers (0: the row)
    layout: str = ROW_MAJOR  # of group scales
    plain: bool = False  # y also returned unquantized

    @property
    def key(self) -> tuple[str, int, int, str, bool]:
        """What plans and caches key it by."""
        return self.format.name, self.scaling, self.group, self.layout, self.plain

    @property
    def row_scales(self) -> bool:
        return self.scaling != STATIC


def by_key(key) -> Quantize | None:
    return None if key is None else Quantize(FORMATS[key[0]], *key[1:])


def check(quantize, quant_scale, quant_scale_ub, x_dtype, quant_group=None, quant_scale_layout=None,
          return_unquantized=False) -> Quantize | None:
    """The request, validated (None: no quantization), before anything runs."""
    if type(return_unquantized) is not bool:
        raise TypeError(f"return_unquantized must be a bool, got {type(return_unquantized).__name__}")
    if quantize is None:
        for value, given in ((quant_scale, "quant_scale"), (quant_scale_ub, "quant_scale_ub"),
                             (quant_group, "quant_group"), (quant_scale_layout, "quant_scale_layout"),
                             (return_unquantized or None, "return_unquantized")):
            if value is not None:
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
    group = 0
    if quant_group is not None:
        if type(quant_group) is not int:
            raise TypeError(f"quant_group must be None or an int (64 or 128), got {type(quant_group).__name__}")
        if quant_group not in GROUPS:
            raise ValueError(f"quant_group must be None, 64 or 128, got {quant_group}")
        if scaling == STATIC:
            raise ValueError("quant_group (dynamic scales a group) and quant_scale (one static scale) exclude "
                             "each other")
        group = quant_group
    layout = ROW_MAJOR
    if quant_scale_layout is not None:
        if not isinstance(quant_scale_layout, str):
            raise TypeError(f"quant_scale_layout must be None or one of {LAYOUTS}, got "
                            f"{type(quant_scale_layout).__name__}")
        if quant_scale_layout not in LAYOUTS:
            raise ValueError(f"quant_scale_layout must be None or one of {LAYOUTS}, got {quant_scale_layout!r}")
        if quant_scale_layout != ROW_MAJOR and not group:
            raise ValueError(f"quant_scale_layout={quant_scale_layout!r} lays out group scales: pass quant_group= "
                             "too")
        layout = quant_scale_layout
    return Quantize(fmt, scaling, group, layout, return_unquantized)


def check_extent(quant: Quantize, n: int) -> None:
    """A group size divides the normalized extent (n elements a row)."""
    if quant.group and n % quant.group:
        raise ValueError(f"quant_group={quant.group} needs the normalized extent to be a multiple of it, got {n} "
                         "elements a row")


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
        shape = y.shape
        if quant.group:  # (a row of groups: the scale broadcast over each)
            y = y.reshape(shape[:-1] + (shape[-1] // quant.group, quant.group))
        with np.errstate(invalid="ignore"):
            amax = np.fmax.reduce(np.abs(y), axis=-1, keepdims=True, initial=0.0)
        if quant.scaling == ROW_BOUNDED:
            amax = np.minimum(amax, np.float64(np.float32(np.asarray(bound).reshape(()))))
        scales = np.maximum((amax / fmt.qmax).astype(np.float32), np.float32(fmt.min_scale))
        s = scales.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        v = y / s
    if quant.group:
        v, scales = v.reshape(shape), scales[..., 0]
    if fmt.name == "int8":
        q = np.clip(np.rint(np.nan_to_num(v, nan=0.0)), -fmt.qmax, fmt.qmax).astype(np.int8)
    else:
        q = np.clip(v, -fmt.qmax, fmt.qmax).astype(fmt.numpy)
    return q, scales


def scales_shape(quant: Quantize, shape: tuple, first: int) -> tuple:
    """Dynamic scales' shape for x of ``shape`` normalized over its axes
    from ``first`` on: x's with each normalized axis 1, so that ``q *
    scales`` broadcasts back to y; with groups, x's leading axes and then
    the groups of a row."""
    lead = tuple(shape[:first])
    if quant.group:
        return lead + (math.prod(shape[first:]) // quant.group,)
    return lead + (1,) * (len(shape) - first)


def scales_layout(quant: Quantize, rows: int, groups: int) -> tuple[int, int, int]:
    """(row stride, group stride, elements held) of the scales of ``rows``
    rows of ``groups`` scales each, as the kernel indexes them
    (rows_cached: scale_row_stride, scale_group_stride)."""
    if quant.layout == ROW_MAJOR:
        return groups, 1, rows * groups
    padded = rows if quant.layout == COLUMN_MAJOR else -(-rows // 4) * 4
    return 1, padded, groups * padded


def kernel_strides(quant: Quantize | None, rows: int, n: int) -> tuple[int, int]:
    """The quantizing kernels' scale_row_stride and scale_group_stride for ``rows``
    rows of ``n`` elements (a scale a row: row stride 1)."""
    if quant is None or not quant.group:
        return 1, 0
    s_row, s_group, _ = scales_layout(quant, rows, n // quant.group)
    return s_row, s_group


def aligned_for_groups(quant: Quantize | None, *arrays):
    """The arrays (CuPy, or None), each a C-contiguous copy where its start
    or a stride is not a multiple of ``group / 32`` elements (a group's
    lanes need vectors of at least that many: dispatch_rows.group_lanes);
    as given without groups."""
    if quant is None or not quant.group:
        return arrays

    def aligned(a):
        if a is None:
            return a
        unit = quant.group // 32 * a.itemsize
        if a.data.ptr % unit == 0 and all(s % unit == 0 for s, n in zip(a.strides[:-1], a.shape[:-1]) if n > 1):
            return a
        return a.copy()

    return tuple(aligned(a) for a in arrays)


@dataclass(frozen=True)
class Strided:
    """An output allocated as ``held`` elements and seen through
    ``strides`` (elements): the launch cache's layout of column-major
    scales (launch_cache.Entry)."""

    strides: tuple
    held: int


def scales_strided(quant: Quantize, shape: tuple) -> Strided:
    """The strides (elements) and the elements held of group scales of
    ``shape`` (scales_shape) in quant's layout."""
    lead, groups = tuple(shape[:-1]), shape[-1]
    s_row, s_group, held = scales_layout(quant, math.prod(lead), groups)
    return Strided(tuple(s_row * math.prod(lead[i + 1:]) for i in range(len(lead))) + (s_group,), held)


def cached_outputs(call) -> dict:
    """The launch cache's outputs of a quantized call (launch_cache.entry):
    q in the format's dtype (each adapter allocates it as its own, raw bytes
    for CuPy's FP8), then the scales where they are formed."""
    quant = call.quant
    outputs = {"y": (call.x.shape, quant.format.numpy, None)}
    if quant.row_scales:
        shape = scales_shape(quant, call.x.shape, call.first)
        laid = None if quant.layout == ROW_MAJOR else scales_strided(quant, shape)
        outputs["y_scale"] = (shape, np.dtype(np.float32), laid)
    if quant.plain:
        outputs["y_plain"] = (call.x.shape, call.x.dtype, None)
    return outputs


def empty_scales(xp, quant: Quantize, shape: tuple):
    """The scales' array of ``shape`` (scales_shape) in ``xp`` (numpy or
    cupy), laid out as asked: a column-major layout is a view of its whole
    (groups, padded rows) storage (scales_strided)."""
    if quant.layout == ROW_MAJOR:
        return xp.empty(shape, dtype=np.float32)
    laid = scales_strided(quant, shape)
    storage = xp.empty(laid.held, dtype=np.float32)
    return xp.lib.stride_tricks.as_strided(storage, shape, tuple(s * storage.itemsize for s in laid.strides))


def empty_results(cupy, call):
    """(q, scales or None, unquantized y or None) of a GPU call, new."""
    quant = call.quant
    scales = empty_scales(cupy, quant, scales_shape(quant, call.x.shape, call.first)) if quant.row_scales else None
    plain = cupy.empty(call.x.shape, dtype=call.x.dtype) if quant.plain else None
    return cupy.empty(call.x.shape, dtype=quant.format.device), scales, plain


def reference_results(call, reference_fn, kwargs):
    """A NumPy call's results from its float64 reference (``reference_fn``
    called with ``kwargs`` gives exact y, then h and the statistics as
    asked; without ``exact`` it gives y rounded as the call without
    quantize= rounds it, for the unquantized y asked for): (q[, scales][,
    y][, h][, statistics])."""
    results = reference_fn(call.x, **kwargs)
    plain = reference_fn(call.x, **dict(kwargs, exact=False)) if call.quant.plain else None
    results = results if isinstance(results, tuple) else (results,)
    y, rest = results[0], list(results[1:])
    rows = y.reshape(tuple(y.shape[: call.first]) + (-1,))
    q, scales = reference(rows, call.quant, scale=call.quant_scale, bound=call.quant_scale)
    out = [q.reshape(y.shape)]
    if scales is not None:
        laid = empty_scales(np, call.quant, scales_shape(call.quant, call.x.shape, call.first))
        laid[...] = scales.reshape(laid.shape)
        out.append(laid)
    if plain is not None:
        out.append(plain[0] if isinstance(plain, tuple) else plain)
    if call.residual is not None:
        out.append(rest.pop(0))
    acc = dtypes.accumulation(call.x.dtype)
    out += [s.astype(acc) for s in rest]
    return out[0] if len(out) == 1 else tuple(out)
