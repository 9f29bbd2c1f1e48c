"""Per-row operands of a row norm: per-head weights, adaLN's modulation
(``shift=``, ``scale=``) and the gated residual (``residual_gate=``).

Each is validated against x and brought to what rows_cached reads
(cunorm/kernels/stages.cuh: AffineStore's kParamRows, kShift, kScale;
ScaledResidualLoad): rows of the normalized axes' n elements, contiguous,
in the parameters' dtype, row r of x reading

- parameter row ``r % param_rows`` (a weight and bias over more trailing
  axes than the normalized ones: (heads, head_dim) over x of (B, S,
  heads, head_dim));
- modulation (and gate) row ``r // mod_div % mod_count`` (an array that
  broadcasts against x: per sample (B, 1, H) for x of (B, T, H), per
  token (B, T, H), one for all (H,)).

An array whose kept leading axes are not adjacent ((B, 1, S2, H) against
x of (B, S1, S2, H)) is broadcast out to one row a row of x first.

The gated RMSNorm's gate z (``gate=``) is of x's shape and dtype: row r
of x reads row r of z, C-contiguous (AffineStore's kGate).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import plans

#: the arrays, by keyword, and their FLAGS bits
OPERANDS = {"shift": plans.FLAG_SHIFT, "scale": plans.FLAG_SCALE, "residual_gate": plans.FLAG_RESIDUAL_GATE,
            "gate": plans.FLAG_GATE}
OPERAND_NAMES = tuple(OPERANDS)
#: the refusal of quantize= with any of them
NOT_QUANTIZED = ("quantize= takes no per-head weights, shift=, scale=, residual_gate=, gate= or float32 residual "
                 "under 16-bit x")


@dataclass
class Conditioning:
    """A call's per-row operands: the arrays (x's kind, validated, None
    where absent), the rows they read (Plan.conditioning) and the flags."""

    shift: object = None
    scale: object = None
    residual_gate: object = None
    gate: object = None
    param_rows: int = 1
    mod_div: int = 1
    mod_count: int = 1
    flags: int = 0
    #: the arrays keep no one pattern: each is broadcast out to x's rows
    expand: bool = False

    @property
    def arrays(self) -> dict:
        return {name: getattr(self, name) for name in OPERANDS if getattr(self, name) is not None}

    @property
    def arrays_in_order(self) -> tuple:
        """Every operand in OPERANDS' order, None where absent."""
        return tuple(getattr(self, name) for name in OPERANDS)

    @property
    def rows(self) -> tuple:
        """Plan.conditioning: (param_rows, mod_div, mod_count), () without
        per-row operands."""
        return (self.param_rows, self.mod_div, self.mod_count) if self.flags else ()


def per_head(p, axis) -> bool:
    """Whether a weight or bias ``p`` spans more axes than the normalized
    ones (``axis``: an int or adjacent ints)."""
    return p is not None and p.ndim > (len(axis) if isinstance(axis, (tuple, list)) else 1)


def requested(weight, bias, axis, *operands) -> bool:
    """Whether a call asks for per-row operands: per-head parameters, or
    any of ``operands`` (its shift, scale, residual_gate and gate)."""
    return any(a is not None for a in operands) or per_head(weight, axis) or per_head(bias, axis)


def check_wide(x_dtype, r_dtype, x_itemsize: int, r_float32: bool, last: int, ndim: int, residual_gate: bool) -> bool:
    """Whether a residual of ``r_dtype`` is the float32 residual stream
    under 16-bit x (True) or of x's dtype (False); raises TypeError for any
    other dtype, ValueError where the stream cannot run (not over the
    trailing axes, or with residual_gate). Plain values, so the torch front
    end checks a traced call alike."""
    if r_dtype == x_dtype:
        return False
    if not (x_itemsize == 2 and r_float32):
        raise TypeError(f"residual must have x's dtype {x_dtype} (or float32 under 16-bit x: the float32 residual "
                        f"stream), got {r_dtype}")
    if last != ndim - 1:
        raise ValueError(f"a float32 residual under {x_dtype} x runs over rows: normalize over the trailing axes, "
                         f"got axes ending at {last} of a {ndim}-d x")
    if residual_gate:
        raise ValueError(f"residual_gate= takes a residual of x's dtype, got a float32 residual under {x_dtype} x")
    return True


def wide(x, residual) -> bool:
    """Whether a call's residual is of another dtype than x (the float32
    residual stream under 16-bit x; the engine checks which)."""
    return residual is not None and residual.dtype != x.dtype


def param_rows(name: str, shape: tuple, x_shape: tuple, norm_shape: tuple, last: int) -> int:
    """The parameter rows of a weight or bias of ``shape``: 1 over the
    normalized axes alone; the product of its leading axes where it spans
    more of x's trailing axes (per-head weights, the normalized axes
    trailing). Raises ValueError for any other shape."""
    if shape == norm_shape:
        return 1
    extra = len(shape) - len(norm_shape)
    if extra > 0 and last == len(x_shape) - 1 and shape == x_shape[len(x_shape) - len(shape):]:
        return math.prod(shape[:extra])
    raise ValueError(f"{name} must have the shape of the normalized axes {norm_shape}, got {shape} (or, per head, "
                     f"that of more of x's trailing axes: {x_shape[-len(norm_shape) - 1:]})")


def _kept(x_shape: tuple, first: int, shape: tuple) -> list[int]:
    """The axes before ``first`` along which an array of ``shape``,
    broadcast against x, varies (its extent is x's, over 1)."""
    own = ((1,) * (len(x_shape) - len(shape)) + tuple(shape))[:first]
    return [i for i, (a, n) in enumerate(zip(own, x_shape[:first])) if a == n and n != 1]


def broadcast_rows(x_shape: tuple, first: int, shape: tuple) -> tuple[int, int] | None:
    """(mod_div, mod_count) with which row r of x (its axes before
    ``first``, the normalized ones after) reads row r // mod_div %
    mod_count of an array of ``shape`` broadcast against x; None where the
    axes it keeps are not adjacent."""
    lead = x_shape[:first]
    kept = _kept(x_shape, first, shape)
    if not kept:
        return 1, 1
    if kept != list(range(kept[0], kept[-1] + 1)):
        return None
    return math.prod(lead[kept[-1] + 1:]), math.prod(lead[kept[0]:kept[-1] + 1])


def check(call, given: dict) -> Conditioning:
    """The call's per-row operands (``given``: {keyword: array or None},
    each of x's kind and a float dtype already), validated against x;
    ``call``: a row_norms.Call with its weight, bias and residual
    checked."""
    shape_of = lambda a: None if a is None else tuple(a.shape)  # noqa: E731
    rows, pattern = check_shapes(call.norm, tuple(call.x.shape), call.x.dtype, call.first, call.last,
                                 shape_of(call.weight), shape_of(call.bias), call.residual is not None, call.epilogue,
                                 {name: None if a is None else (tuple(a.shape), a.dtype) for name, a in given.items()})
    cond = Conditioning(param_rows=rows, flags=plans.FLAG_PARAM_ROWS if rows > 1 else 0)
    for name, a in given.items():
        if a is not None:
            setattr(cond, name, a)
            cond.flags |= OPERANDS[name]
    if pattern == "expand":
        cond.mod_div, cond.mod_count, cond.expand = 1, math.prod(call.x.shape[:call.first]), True
    elif pattern is not None:
        cond.mod_div, cond.mod_count = pattern
    return cond


def check_shapes(norm: str, x_shape: tuple, x_dtype, first: int, last: int, weight_shape, bias_shape,
                 residual: bool, epilogue: int, given: dict) -> tuple:
    """check's validation on plain values, so the torch front end checks a
    traced call alike: ``given`` {keyword: (shape, dtype) or None}; the
    parameters' shapes None where absent. Returns (the parameter rows, the
    rows the arrays read): (mod_div, mod_count) of their one broadcast
    pattern, None without them, "expand" where their patterns differ. No
    shape is hashed (a traced shape's sizes may be symbolic)."""
    params = [p for p in (weight_shape, bias_shape) if p is not None]
    norm_shape = tuple(x_shape[first:last + 1])
    if len(params) == 2 and params[0] != params[1]:
        raise ValueError(f"weight and bias must have one shape, got {params[0]} and {params[1]}")
    rows = param_rows("weight" if weight_shape is not None else "bias", params[0], x_shape, norm_shape,
                      last) if params else 1
    patterns = []
    if given.get("gate") is not None:
        z_shape, z_dtype = given["gate"]
        check_gate(norm, x_shape, x_dtype, z_shape, z_dtype, last, residual, epilogue,
                   [name for name in OPERAND_NAMES if name != "gate" and given.get(name) is not None])
    for name, found in given.items():
        if found is None or name == "gate":
            continue
        if name == "residual_gate" and not residual:
            raise ValueError("residual_gate scales x in h = residual + residual_gate * x: pass residual= too")
        if last != len(x_shape) - 1:
            raise ValueError(f"{name}= conditions rows: normalize over the trailing axes, got axes "
                             f"{first}..{last} of a {len(x_shape)}-d x")
        shape = found[0]
        aligned = (1,) * (len(x_shape) - len(shape)) + shape
        if len(shape) > len(x_shape) or len(shape) < len(norm_shape) or aligned[first:] != norm_shape or \
                any(s != 1 and s != n for s, n in zip(aligned[:first], x_shape[:first])):
            raise ValueError(f"{name} must broadcast against x {x_shape} and span the normalized axes "
                             f"{norm_shape} (per sample, per token, or one for all), got {shape}")
        patterns.append(broadcast_rows(x_shape, first, shape))
    if not patterns:
        return rows, None
    if None in patterns or any(p != patterns[0] for p in patterns[1:]):
        return rows, "expand"
    return rows, patterns[0]


def check_gate(norm: str, x_shape: tuple, x_dtype, z_shape: tuple, z_dtype, last: int, residual: bool,
               epilogue: int, others: list) -> None:
    """The gate z of rms_norm: x's shape and dtype, over the trailing axes
    (``last``: the last normalized axis), with no residual, activation or
    other per-row operand (``others``: their names). Plain values, so the
    torch front end checks a traced call alike."""
    if norm != "rms":
        raise ValueError(f"gate= is rms_norm's (the gated RMSNorm), not the {norm} norm's")
    if tuple(z_shape) != tuple(x_shape):
        raise ValueError(f"gate must have x's shape {tuple(x_shape)}, got {tuple(z_shape)}")
    if z_dtype != x_dtype:
        raise TypeError(f"gate must have x's dtype {x_dtype}, got {z_dtype}")
    if last != len(x_shape) - 1:
        raise ValueError(f"gate= gates rows: normalize over the trailing axes, got axes ending at {last} of a "
                         f"{len(x_shape)}-d x")
    if epilogue & plans.ACTIVATION_BITS:
        raise ValueError("gate= takes no activation: the gate's silu(z) multiplies the normalized value")
    if residual or others:
        raise ValueError(f"gate= takes no {', '.join(list(others) + ['residual'] * residual)}: "
                         "the gated RMSNorm is x (times silu(gate)) normalized, times the weight")


def dtypes_of(cond: Conditioning) -> list:
    """The dtypes of the arrays stored as the parameters (the parameters'
    storage dtype counts them; the gate z keeps x's)."""
    return [a.dtype for name, a in cond.arrays.items() if name != "gate"]


def kernel_rows(cond: Conditioning, x_shape: tuple, first: int, dtype) -> dict:
    """The arrays as rows_cached reads them ({slot: CuPy array}): rows of
    n elements, C-contiguous, in ``dtype`` (the parameters' storage
    dtype), broadcast out to x's rows where they keep no one pattern; the
    gate z C-contiguous in x's dtype."""
    import cupy

    n = math.prod(x_shape[first:])
    out = {}
    if cond.gate is not None:
        out["gate"] = cupy.ascontiguousarray(cond.gate)
    for name, slot in (("shift", "shift"), ("scale", "mod_scale"), ("residual_gate", "res_gate")):
        a = getattr(cond, name)
        if a is None:
            continue
        if cond.expand:
            a = cupy.broadcast_to(a, x_shape)
        else:
            kept = _kept(x_shape, first, tuple(a.shape))
            a = a.reshape(((1,) * (len(x_shape) - a.ndim)) + tuple(a.shape))
            a = a[tuple(slice(None) if i in kept else 0 for i in range(first))]  # (the kept axes, then n)
        out[slot] = cupy.ascontiguousarray(a, dtype=dtype).reshape(-1, n)
    return out


def modulate(y, weight, bias, shift, scale, *, offset: bool, cast, activate=None):
    """The unfused form's ops after the plain norm, in any framework's
    arrays: ``cast(a)`` is a in the accumulation dtype; the per-head weight
    (``offset``: read as 1 + weight) and bias where given, then ``y * (1 +
    scale) + shift``, then ``activate`` (a function, or None). Returns the
    value in the accumulation dtype (the caller rounds it once)."""
    y = cast(y)
    if weight is not None:
        y = y * (cast(weight) + 1 if offset else cast(weight))
    if bias is not None:
        y = y + cast(bias)
    if scale is not None:
        y = y * (1 + cast(scale))
    if shift is not None:
        y = y + cast(shift)
    return y if activate is None else activate(y)


def split_groups(group_size, x, weight, gate, residual, out, axis):
    """rms_norm's ``group_size``: x's last axis of n elements seen as (n /
    group_size, group_size), the weight as (n / group_size, group_size)
    (a weight per group: per-head weights), the gate, residual and out
    alike, normalized over the new last axis. Any array kind with
    ``reshape`` (NumPy, CuPy, torch, JAX). Returns the reshaped (x, weight,
    gate, residual, out); raises TypeError or ValueError for a bad
    group_size, axis, weight or out."""
    if isinstance(group_size, (bool, np.bool_)) or not isinstance(group_size, (int, np.integer)):
        raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
    g = int(group_size)
    shape = tuple(x.shape)
    if not shape:
        raise ValueError("group_size splits x's last axis: x has none")
    n = shape[-1]
    if g <= 0 or n % g:
        raise ValueError(f"group_size must be a positive divisor of x's last extent {n}, got {g}")
    if not (type(axis) is int and axis in (-1, len(shape) - 1)):
        raise ValueError(f"group_size splits x's last axis into groups: pass axis=-1, got axis={axis!r}")
    if weight is not None and tuple(weight.shape) != (n,):
        raise ValueError(f"with group_size, weight must have the shape of x's last axis {(n,)}, got "
                         f"{tuple(weight.shape)}")
    if out is not None:
        from .. import _interop

        adapter = _interop.adapter_for(out, "out")
        view = out if adapter is _interop.NUMPY else adapter.to_cupy(out, "out")
        if not view.flags.c_contiguous:  # (a reshape would copy it and lose the result)
            raise ValueError("out must be C-contiguous")
    split = shape[:-1] + (n // g, g)
    rows = lambda a: None if a is None else a.reshape(split)  # noqa: E731
    return (rows(x), None if weight is None else weight.reshape((n // g, g)), rows(gate), rows(residual),
            rows(out))


def join_groups(results, shape: tuple, arrays: int, out=None):
    """The results of a call split by split_groups with the first
    ``arrays`` of them (y, and h with a residual) back in x's ``shape``
    (y is ``out`` where given); the statistics keep a value per group."""
    if not isinstance(results, tuple):
        return out if out is not None else results.reshape(shape)
    joined = [a.reshape(shape) for a in results[:arrays]]
    if out is not None:
        joined[0] = out
    return tuple(joined) + tuple(results[arrays:])


def in_groups(rms_norm, group_size, x, weight, *, gate, residual, axis, out=None, **options):
    """``rms_norm`` (any front end's) of x in runs of ``group_size``:
    the call split by split_groups, the results joined by join_groups;
    ``options``: the call's others, passed on."""
    shape = tuple(x.shape)
    xg, wg, zg, rg, og = split_groups(group_size, x, weight, gate, residual, out, axis)
    if out is not None:
        options["out"] = og
    results = rms_norm(xg, wg, axis=-1, residual=rg, gate=zg, **options)
    return join_groups(results, shape, 1 + (residual is not None), out)


def composed(plain, x, weight, bias, *, to, acc, activate, axis, eps, residual, residual_gate, shift, scale,
             return_stats, activation, **options):
    """The unfused form of a call with per-row operands (no gate), in any
    framework's arrays: the float32 residual stream's or the gated
    residual's h formed first, ``plain(x, weight, bias, *, axis, eps,
    residual, return_stats, activation, **options)`` (the framework's
    differentiable norm without per-row operands) over it, then modulate's
    ops (per-head parameters, shift and scale, ``activate``: the
    activation as a function) in ``acc``, y rounded once to x's dtype.
    ``to(a, dtype)``: a in dtype. Returns y (then h, then the statistics)."""
    y_dtype = x.dtype
    h = None
    if wide(x, residual):  # (h = x + r in the residual's float32, the norm over it)
        h = to(x, residual.dtype) + residual
        x, residual = h, None
    if residual_gate is not None:
        if residual is None:
            raise ValueError("residual_gate scales x in h = residual + residual_gate * x: pass residual= too")
        h = to(to(residual, acc) + to(residual_gate, acc) * to(x, acc), x.dtype)
        x, residual = h, None
    heads = per_head(weight, axis) or per_head(bias, axis)
    after = heads or shift is not None or scale is not None
    offset = heads and bool(options.get("weight_offset", 0))
    if heads and "weight_offset" in options:
        options = {**options, "weight_offset": 0}  # (1 + w multiplies below)
    results = plain(x, None if heads else weight, None if heads else bias, axis=axis, eps=eps, residual=residual,
                    return_stats=return_stats, activation=None if after else activation, **options)
    results = list(results) if isinstance(results, tuple) else [results]
    if after:
        y = modulate(results[0], weight if heads else None, bias if heads else None, shift, scale, offset=offset,
                     cast=lambda a: to(a, acc), activate=activate)
        results[0] = to(y, results[0].dtype)
    results[0] = to(results[0], y_dtype)
    if h is not None:
        results.insert(1, h)
    return results[0] if len(results) == 1 else tuple(results)


def gated(plain, x, weight, gate, *, norm_before_gate: bool, normalized: bool, offset: bool, round_weighted: bool,
          to, acc, silu, return_stats: bool, **options):
    """The gated RMSNorm as the plain norm and elementwise ops, in any
    framework's arrays: ``plain(h, None, return_stats=..., **options)``
    normalizes h in ``acc``, the accumulation dtype (``to(a, dtype)``: a in
    dtype; ``silu``: the framework's). The roundings are the fused
    kernel's (AffineStore's kGate, kGateInput): ``normalized`` rounds the
    normalized value to x's dtype before the weight (1 + weight with
    ``offset``), ``round_weighted`` the weighted value before the gate
    multiplies. Returns y (and rstd)."""
    cast = lambda a: to(a, acc)  # noqa: E731
    narrow = lambda a: to(a, x.dtype)  # noqa: E731
    z = silu(cast(gate))
    h = cast(x) if norm_before_gate else cast(x) * z
    results = plain(h, None, return_stats=return_stats, **options)
    y, stats = (results[0], results[1:]) if isinstance(results, tuple) else (results, ())
    if normalized:
        y = cast(narrow(y))
    if weight is not None:
        y = y * (cast(weight) + 1 if offset else cast(weight))
        if norm_before_gate and normalized and round_weighted:
            y = cast(narrow(y))
    if norm_before_gate:
        y = y * z
    return (narrow(y),) + tuple(stats) if stats else narrow(y)
