"""Canonical plans: every call becomes a reduction over the middle of an
(outer, reduced, inner) view of x, followed by an elementwise epilogue.

Pure functions of shapes, strides (in elements), dtypes and pointer
alignment; no GPU needed, so CI tests them directly.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from . import dtypes


@dataclass(frozen=True)
class Plan:
    """What a kernel needs to know about one call.

    outer, reduced, inner: the extents of x viewed as (outer, reduced, inner);
        every (outer, inner) position is one normalization group of
        ``reduced`` elements.
    outer_stride, reduced_stride: x's strides in elements along outer and
        reduced (the inner stride is 1 whenever inner > 1; the reduced stride
        is 1 whenever inner == 1). y is always written C-contiguous.
    dtype: storage dtype of x (and of the residual r, y and h).
    param_dtype, flags: storage dtype of the affine parameters and which of
        them apply (FLAG_WEIGHT | FLAG_BIAS), with the epilogue's options
        (the store stage's FLAGS word); param_dtype is None without
        parameters.
    residual: h = x + r is formed, returned and normalized (r and h of x's
        dtype, or of float32 under 16-bit x with FLAG_WIDE_RESIDUAL).
    vec: elements per vector access along the contiguous axis (reduced if
        inner == 1, else inner), the widest that every pointer, stride and
        extent allows, at most 16 bytes.
    norm: which policy of cunorm/kernels/norms.cuh.
    peel_vec: the vector a kernel that peels each row's misaligned head
        (rows_uncached) may use: wider than vec when rows start off
        alignment (rows of 65535 floats) but x's and y's rows share their
        misalignment and there are no parameters or residual; else vec.
    out_dtype: y's storage dtype where it is not x's (float32 for 16-bit
        x: LayerNorm under autocast), else None. Only rows_cached writes
        it (cunorm/_engine/dispatch_rows.py); y's alignment counts in vec.
    quant: the key of a quantized y's request (cunorm/_engine/quantize.py),
        one byte an element, else None. Only rows_cached writes it.
    conditioning: (param_rows, mod_div, mod_count) where the flags ask for
        per-row operands (CONDITIONED_FLAGS): row r reads parameter row r %
        param_rows and modulation (and residual gate) row r // mod_div %
        mod_count; else (). Only rows_cached takes them.
    """

    norm: str
    dtype: np.dtype
    param_dtype: np.dtype | None
    flags: int
    residual: bool
    outer: int
    reduced: int
    inner: int
    outer_stride: int
    reduced_stride: int
    vec: int
    peel_vec: int
    out_dtype: np.dtype | None = None
    quant: tuple | None = None
    conditioning: tuple = ()

    @property
    def contiguous_rows(self) -> bool:
        return self.inner == 1


FLAG_WEIGHT = 1  # mirrors kWeight in cunorm/kernels/common.cuh
FLAG_BIAS = 2  # mirrors kBias
PARAM_FLAGS = FLAG_WEIGHT | FLAG_BIAS
# The epilogue's options, the same FLAGS word (AffineStore in
# cunorm/kernels/stages.cuh says what each does)
FLAG_WEIGHT_OFFSET = 4  # kWeightOffset: the weight read as 1 + weight
FLAG_ROUND_NORMALIZED = 8  # kRoundNormalized: rounded before the weight
ACTIVATION_SHIFT = 4  # kActivationShift
ACTIVATION_BITS = 7 << ACTIVATION_SHIFT  # the activation's code (bits 4..6)
#: the epilogue bits cunorm's backward kernels do not differentiate (the
#: rounding they do: its backward is the norm's); the torch and JAX wrappers
#: run them as framework ops after the norm where gradients are taken
UNFUSED_IN_BACKWARD = FLAG_WEIGHT_OFFSET | ACTIVATION_BITS
# Per-row operands, rows_cached only (AffineStore and ScaledResidualLoad in
# cunorm/kernels/stages.cuh): per-head weights, adaLN's modulation, the
# gated residual. FLAG_RESIDUAL_GATE picks the load stage (h = r + g * x);
# it is not a bit of the store's FLAGS word (STORE_FLAGS masks it off).
FLAG_PARAM_ROWS = 128  # kParamRows: the parameters repeat every param_rows rows
FLAG_SHIFT = 256  # kShift
FLAG_SCALE = 512  # kScale
FLAG_RESIDUAL_GATE = 1024
# The gated RMSNorm's gate z (x's shape and dtype, read beside x):
# FLAG_GATE multiplies y by silu(z) (kGate); with FLAG_GATE_INPUT the
# norm's input is x * silu(z) instead (kGateInput: norm_before_gate=False)
FLAG_GATE = 2048
FLAG_GATE_INPUT = 4096
# The float32 residual stream: r and h in float32 under 16-bit x
# (WideResidualLoad); like FLAG_RESIDUAL_GATE it picks the load stage and
# is not a bit of the store's FLAGS word
FLAG_WIDE_RESIDUAL = 8192
CONDITIONED_FLAGS = (FLAG_PARAM_ROWS | FLAG_SHIFT | FLAG_SCALE | FLAG_RESIDUAL_GATE | FLAG_GATE
                     | FLAG_WIDE_RESIDUAL)
#: the gated RMSNorm's z (held beside x, as a residual is)
GATE_FLAGS = FLAG_GATE | FLAG_GATE_INPUT
#: what the store's FLAGS word holds of a plan's flags
STORE_FLAGS = ~(FLAG_RESIDUAL_GATE | FLAG_WIDE_RESIDUAL)
#: the flags that take a stored operand of the parameters' dtype
OPERAND_FLAGS = PARAM_FLAGS | FLAG_SHIFT | FLAG_SCALE | FLAG_RESIDUAL_GATE
#: the activations of the epilogue (``activation=``), their codes (Activation)
ACTIVATIONS = {"identity": 0, "relu": 1, "silu": 2, "gelu": 3, "gelu_tanh": 4}
#: the rounding points of rms_norm's ``rounding=``
ROUNDINGS = {"output": 0, "normalized": FLAG_ROUND_NORMALIZED}


def activation_flags(activation) -> int:
    """The FLAGS bits of ``activation`` (None or a name of ACTIVATIONS), validated."""
    if activation is None:
        return 0
    if not isinstance(activation, str):
        raise TypeError(f"activation must be None or one of {sorted(ACTIVATIONS)}, got {type(activation).__name__}")
    code = ACTIVATIONS.get(activation)
    if code is None:
        raise ValueError(f"activation must be None or one of {sorted(ACTIVATIONS)}, got {activation!r}")
    return code << ACTIVATION_SHIFT


def activation_name(flags: int) -> str | None:
    """The activation the FLAGS word ends with (None for identity)."""
    code = (flags & ACTIVATION_BITS) >> ACTIVATION_SHIFT
    return None if code == 0 else next(n for n, c in ACTIVATIONS.items() if c == code)


def rms_epilogue(weight_offset, rounding, activation, has_weight: bool, gate=None, norm_before_gate=True) -> int:
    """All of rms_norm's epilogue bits, validated (the defaults at once:
    every call passes here); ``gate``: the gate z or None, whose
    ``norm_before_gate`` False sets FLAG_GATE_INPUT (FLAG_GATE itself comes
    with the array: conditioning.check)."""
    if norm_before_gate is not True and not isinstance(norm_before_gate, (bool, np.bool_)):
        raise TypeError(f"norm_before_gate must be True or False, got {type(norm_before_gate).__name__}")
    gated = FLAG_GATE_INPUT if gate is not None and not norm_before_gate else 0
    if activation is None and rounding == "output" and type(weight_offset) is int and weight_offset == 0:
        return gated
    return rms_epilogue_flags(weight_offset, rounding, has_weight) | activation_flags(activation) | gated


def rms_epilogue_flags(weight_offset, rounding, has_weight: bool) -> int:
    """The FLAGS bits of rms_norm's ``weight_offset`` (0 or 1) and ``rounding``, validated."""
    if isinstance(weight_offset, (bool, np.bool_)) or not isinstance(weight_offset, (int, float, np.integer,
                                                                                     np.floating)):
        raise TypeError(f"weight_offset must be 0 or 1, got {type(weight_offset).__name__}")
    if weight_offset not in (0, 1):
        raise ValueError(f"weight_offset must be 0 or 1 (1: the weight read as 1 + weight), got {weight_offset!r}")
    if weight_offset and not has_weight:
        raise ValueError("weight_offset=1 needs a weight: it reads the weight as 1 + weight")
    if not isinstance(rounding, str):
        raise TypeError(f"rounding must be one of {sorted(ROUNDINGS)}, got {type(rounding).__name__}")
    bits = ROUNDINGS.get(rounding)
    if bits is None:
        raise ValueError(f"rounding must be one of {sorted(ROUNDINGS)}, got {rounding!r}")
    return bits | (FLAG_WEIGHT_OFFSET if weight_offset else 0)


def normalize_axes(axis, ndim: int, *, memo: bool = True) -> tuple[int, int]:
    """Return (first, last) of the adjacent axes named by ``axis``.

    ``axis`` is an int or a tuple/list of ints naming adjacent axes in any
    order; negative values count from the end. Memoized for the common
    forms of exact ints only (the per-call cost of a repeated call is a
    lookup): a memo keyed by equality would take (True,) or (1.0,) for a
    (1,) it saw, and validation would depend on call order. ``memo=False``
    skips the memo (code torch.compile traces: dynamo warns when it traces
    through a functools.lru_cache).
    """
    if memo and (type(axis) is int or (type(axis) is tuple and all(type(a) is int for a in axis))):
        return _normalize_axes_cached(axis, ndim)
    return _normalize_axes(axis, ndim)


@functools.lru_cache(maxsize=1024)
def _normalize_axes_cached(axis, ndim: int) -> tuple[int, int]:
    return _normalize_axes(axis, ndim)


def _normalize_axes(axis, ndim: int) -> tuple[int, int]:
    if isinstance(axis, (bool, np.bool_)):
        raise TypeError(f"axis must be an int or a tuple of ints, got {axis!r}")
    if isinstance(axis, (int, np.integer)):
        axes = (int(axis),)
    elif isinstance(axis, (tuple, list)) and all(
        isinstance(a, (int, np.integer)) and not isinstance(a, (bool, np.bool_)) for a in axis
    ):
        axes = tuple(int(a) for a in axis)
    else:
        raise TypeError(f"axis must be an int or a tuple of ints, got {axis!r}")
    if not axes:
        raise ValueError("axis must name at least one axis, got ()")
    resolved = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of range for an array of {ndim} dimension(s)")
        resolved.append(a % ndim)
    resolved.sort()
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"axis {axis!r} names an axis twice")
    if resolved != list(range(resolved[0], resolved[-1] + 1)):
        raise ValueError(f"the normalized axes must be adjacent, got {axis!r}")
    return resolved[0], resolved[-1]


def canonical_strides(shape, strides, itemsize: int = 1) -> tuple:
    """``strides`` with the stride of every size-1 axis replaced by the one a
    C-ordered array would have there (the next axis's stride times its
    extent; ``itemsize`` after the last axis). An axis of one element is
    never stepped along, so its stride is free: views such as ``x[:, -1:]``
    carry any value there, and two arrays of one layout must compare equal
    (an array already C-contiguous keeps its strides only if they are
    these). Units as given (bytes, or elements with itemsize 1)."""
    if 1 not in shape:
        return tuple(strides)
    out = list(strides)
    following = itemsize
    for axis in range(len(shape) - 1, -1, -1):
        if shape[axis] == 1:
            out[axis] = following
        following = out[axis] * shape[axis]
    return tuple(out)


def same_layout(shape, strides_a, strides_b) -> bool:
    """Whether two arrays of ``shape`` step through memory alike: equal
    strides on every axis of more than one element."""
    return all(n == 1 or a == b for n, a, b in zip(shape, strides_a, strides_b))


def collapse(shape, strides) -> tuple[int, int] | None:
    """Merge a run of dimensions into one (extent, stride), or None if their
    strides do not describe a single arithmetic progression."""
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    extent = math.prod(shape)
    if not dims:
        return extent, 0
    for (_, s0), (n1, s1) in zip(dims, dims[1:]):
        if s0 != s1 * n1:
            return None
    return extent, dims[-1][1]


def canonical_view(shape, strides, first: int, last: int):
    """(outer, reduced, inner, outer_stride, reduced_stride) for x with the
    axes first..last reduced, or None when the layout needs a contiguous copy
    first (a group of dimensions that does not collapse, or a contiguous axis
    that is not unit-stride)."""
    parts = [
        collapse(shape[:first], strides[:first]),
        collapse(shape[first : last + 1], strides[first : last + 1]),
        collapse(shape[last + 1 :], strides[last + 1 :]),
    ]
    if any(p is None for p in parts):
        return None
    (outer, s_outer), (reduced, s_reduced), (inner, s_inner) = parts
    if inner > 1 and s_inner != 1:
        return None
    if inner == 1 and reduced > 1 and s_reduced != 1:
        return None
    if inner == 1:
        s_reduced = 1
    return outer, reduced, inner, s_outer, s_reduced


def vector_width(itemsize: int, extent: int, strides, pointers) -> int:
    """Widest power-of-two vector (at most 16 bytes) such that ``extent`` and
    every stride (elements) are multiples of it and every (pointer, itemsize)
    pair is aligned to it."""
    vec = 16 // itemsize
    while vec > 1:
        if (
            extent % vec == 0
            and all(s % vec == 0 for s in strides)
            and all(p % (vec * size) == 0 for p, size in pointers)
        ):
            return vec
        vec //= 2
    return 1


def make_plan(norm, dtype, param_dtype, flags, residual, shape, strides, first, last, x_ptr, y_ptr, r_ptr, h_ptr,
              w_ptr, b_ptr, out_dtype=None, quant=None, conditioning=(), operand_ptrs=(), gate_ptr=0):
    """Plan for a call, or None when x must be made contiguous first.

    Pointers may be given modulo 32 (only their alignment matters); absent
    arrays pass 0. The residual r shares x's strides; y and h are
    C-contiguous. ``out_dtype``: y's dtype where it is not x's; ``quant``:
    the key of a one-byte quantized y's request (quantize.Quantize.key);
    ``conditioning``: Plan.conditioning, with ``operand_ptrs`` the
    addresses of the shift, scale and residual gate (rows of the
    parameters' dtype); ``gate_ptr``: the gate z's (C-contiguous, x's
    dtype; FLAG_GATE). The engine's key holds them in this order.
    """
    view = canonical_view(shape, strides, first, last)
    if view is None:
        return None
    outer, reduced, inner, s_outer, s_reduced = view
    itemsize = dtype.itemsize
    if out_dtype is not None and out_dtype == dtype:
        out_dtype = None
    out_itemsize = 1 if quant is not None else itemsize if out_dtype is None else out_dtype.itemsize
    r_itemsize = dtypes.accumulation(dtype).itemsize if flags & FLAG_WIDE_RESIDUAL else itemsize
    pointers = [(x_ptr, itemsize), (y_ptr, out_itemsize), (r_ptr, r_itemsize), (h_ptr, r_itemsize)]
    if inner == 1:
        extent = reduced
        other_strides = [s_outer] if outer > 1 else []
        if flags & OPERAND_FLAGS:
            pointers += [(p, param_dtype.itemsize) for p in (w_ptr, b_ptr) + tuple(operand_ptrs)]
        if flags & FLAG_GATE:
            pointers.append((gate_ptr, itemsize))
    else:
        extent = inner
        other_strides = [s for s, n in ((s_outer, outer), (s_reduced, reduced)) if n > 1]
    vec = vector_width(itemsize, extent, other_strides, pointers)
    peel_vec = vec
    if inner == 1 and not flags & (OPERAND_FLAGS | FLAG_GATE) and not residual and out_dtype is None:
        # every row of x must start as far off alignment as y's (C-contiguous,
        # a row each `reduced` elements): their strides and addresses differ
        # by whole vectors
        x_row_stride = s_outer if outer > 1 else reduced
        peel_vec = max(vec, vector_width(itemsize, 0, [x_row_stride - reduced], [(x_ptr - y_ptr, itemsize)]))
    params = param_dtype if flags & OPERAND_FLAGS else None
    return Plan(norm, dtype, params, flags, residual, outer, reduced, inner, s_outer,
                s_reduced, vec, peel_vec, out_dtype, quant, tuple(conditioning))



def output_type(plan) -> str:
    """The Y template argument of rows_cached and channel_apply (a Plan or
    a ChannelPlan): y's storage type."""
    return dtypes.KERNEL_TYPE[plan.dtype if plan.out_dtype is None else plan.out_dtype]


def kernel_types(plan: Plan) -> tuple[str, str]:
    """The (T, P) template arguments of a plan."""
    p = dtypes.NO_PARAMS if plan.param_dtype is None else dtypes.KERNEL_TYPE[plan.param_dtype]
    return dtypes.KERNEL_TYPE[plan.dtype], p


@dataclass(frozen=True)
class ChannelPlan:
    """What the channel family (cunorm/kernels/channels.cu) needs to know
    about a GroupNorm / InstanceNorm / BatchNorm call.

    x is dense with ``batch`` samples, ``channels`` channels and ``spatial``
    positions, channels-first (batch, channels, spatial) or channels-last
    (batch, spatial, channels) in memory. A statistic group is
    ``channels_per_group`` consecutive channels of one sample (per_sample) or
    of the whole batch. BatchNorm channels-last folds the batch into the
    positions (batch 1), its statistic spanning both anyway.
    vec: elements per vector along the contiguous axis (positions when
    channels-first, channels when channels-last).
    out_dtype: y's storage dtype where it is not x's (float32 for 16-bit x:
    GroupNorm under autocast), else None; y's alignment counts in vec.
    """

    norm: str
    dtype: np.dtype
    param_dtype: np.dtype | None
    flags: int
    channels_last: bool
    batch: int
    channels: int
    spatial: int
    channels_per_group: int
    per_sample: bool
    vec: int
    out_dtype: np.dtype | None = None

    @property
    def groups(self) -> int:
        return self.channels // self.channels_per_group

    @property
    def statistic_groups(self) -> int:
        return (self.batch if self.per_sample else 1) * self.groups

    @property
    def nbytes(self) -> int:
        """x's bytes."""
        return self.batch * self.channels * self.spatial * self.dtype.itemsize


def dense_order(shape, strides, order) -> bool:
    """Whether an array of ``shape`` and ``strides`` (elements) is dense with
    its axes laid out in ``order``, outermost first (size-1 axes ignored)."""
    expected = 1
    for axis in reversed(order):
        if shape[axis] != 1 and strides[axis] != expected:
            return False
        expected *= shape[axis]
    return True


def channel_orders(ndim: int, channel_axis: int) -> dict[bool, tuple[int, ...]]:
    """The memory order of each physical layout (channels_last -> axes,
    outermost first) of an array whose channel axis is ``channel_axis``."""
    spatial = [a for a in range(1, ndim) if a != channel_axis]
    return {False: (0, channel_axis, *spatial), True: (0, *spatial, channel_axis)}


def channel_layout(shape, strides, channel_axis: int, per_sample: bool) -> bool | None:
    """True for channels-last in memory, False for channels-first, None when
    x is dense in neither (it is then copied). When both hold (no spatial
    extent), channels-first for per-sample groups (a group is contiguous) and
    channels-last for BatchNorm (each channel a strided column)."""
    orders = channel_orders(len(shape), channel_axis)
    preferred = (False, True) if per_sample else (True, False)
    for last in preferred:
        if dense_order(shape, strides, orders[last]):
            return last
    return None


def make_channel_plan(norm, dtype, param_dtype, flags, channels_last, batch, channels, spatial,
                      channels_per_group, per_sample, x_ptr, y_ptr, out_dtype=None) -> ChannelPlan:
    """Plan for a dense x (pointers may be given modulo 32); ``out_dtype``:
    y's dtype where it is not x's."""
    if channels_last and not per_sample:
        batch, spatial = 1, batch * spatial
    if out_dtype is not None and out_dtype == dtype:
        out_dtype = None
    extent = channels if channels_last else spatial
    y_size = dtype.itemsize if out_dtype is None else out_dtype.itemsize
    vec = vector_width(dtype.itemsize, extent, [], [(x_ptr, dtype.itemsize), (y_ptr, y_size)])
    params = param_dtype if flags & PARAM_FLAGS else None
    return ChannelPlan(norm, dtype, params, flags, channels_last, batch, channels, spatial,
                       channels_per_group, per_sample, vec, out_dtype)
