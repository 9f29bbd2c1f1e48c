"""cunorm for JAX: the ops on JAX GPU arrays, eager and inside ``jax.jit``.

Each function is the array-level op of the same name (``cunorm.rms_norm``
etc.; the same arguments without ``out=``).

- On concrete arrays, outside any transformation, x and the parameters go
  in zero-copy through DLPack and the results come back as JAX arrays over
  the kernels' output buffers, as before.
- Traced (inside ``jax.jit``, ``jax.grad``, ``jax.vmap``), each call is a
  JAX primitive lowered to XLA custom calls that launch the same kernels on
  XLA's stream over XLA's buffers (cunorm/jax/_jit.py): no build step, no
  host round trip. ``jax.grad`` runs cunorm's backward kernels
  (``jax.custom_vjp``); ``jax.vmap`` folds the mapped axis into the rows
  (row norms) or the samples (GroupNorm, InstanceNorm), and otherwise runs
  the call once per mapped index. Statistics returned with
  ``return_stats=True`` are not differentiated through (their cotangents
  are dropped, as torch treats them).
- BatchNorm with JAX running buffers in training returns the updated
  buffers, ``(y, [mean, rstd,] running_mean, running_var)``, in their
  dtypes: JAX arrays are never written.

Inside jit the epilogue options (``weight_offset``, ``rounding``,
``activation``) run fused in the forward kernel, as on concrete arrays.
Under ``jax.grad`` the forward differentiated is the norm (with its
rounding) followed by the weight offset and the activation as ``jax.numpy``
ops, so jax takes their gradients (cunorm's backward kernels take the
norm's); its y may differ from the fused one by a rounding (the activation
of y rounded to x's dtype), as torch's autograd path does. x is contiguous
as XLA lays it out; a channel axis other than 1 or the last is moved there
first.
"""
from __future__ import annotations

import dataclasses
import functools
import math

try:
    import jax
except ModuleNotFoundError as err:
    if err.name != "jax":
        raise
    raise ModuleNotFoundError("cunorm.jax needs JAX, which is not installed: pip install 'cunorm[jax]' (on a GPU "
                              "machine, 'jax[cuda12]' brings its CUDA plugin)", name="jax") from err
import jax.numpy as jnp
import numpy as np

from .._engine import channel_norms, conditioning, dtypes, gradients, row_norms, plans
from .. import norms
from .._engine.ops import DEFAULT_EPS, LP_EPS

__all__ = ["rms_norm", "layer_norm", "normalize", "mean_abs_normalize", "frobenius_normalize", "group_norm",
           "instance_norm", "batch_norm", "set_lowering_target"]


try:
    from jax.core import Tracer as _Tracer
except ImportError:  # (jax versions that keep it private)
    from jax._src.core import Tracer as _Tracer


def _traced(*arrays) -> bool:
    return any(isinstance(a, _Tracer) for a in arrays if a is not None)


def _check_kind(fn: str, x) -> None:
    if not isinstance(x, jax.Array):
        raise TypeError(f"cunorm.jax.{fn}: x must be a JAX array, got {type(x).__module__}.{type(x).__qualname__} "
                        f"(cunorm.{fn} takes any array)")


def _stand_in(a, written=False):
    """A NumPy view of a's shape and dtype over no memory: what the eager
    argument checks read (the same errors on every path). ``written``: an
    array the eager op would update (BatchNorm's running buffers, which
    the traced op returns instead), so writable: a small one of its own."""
    if a is None:
        return None
    if written:
        return np.empty(a.shape, np.dtype(a.dtype))
    return np.broadcast_to(np.zeros((), np.dtype(a.dtype)), a.shape)


def _no_unknown_kwargs(fn, kwargs):
    """Traced calls take no keyword the eager op lacks (the eager op raises
    the same TypeError)."""
    if kwargs:
        raise TypeError(f"cunorm.jax.{fn}() got an unexpected keyword argument {next(iter(kwargs))!r}")


#: the epilogue's activations as jax.numpy (under jax.grad), in the
#: accumulation dtype, as the kernels and torch compute them
JAX_ACTIVATIONS = {"relu": jax.nn.relu, "silu": jax.nn.silu,
                   "gelu": functools.partial(jax.nn.gelu, approximate=False),
                   "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


def _activated(outs: tuple, epilogue: int) -> tuple:
    """outs with the epilogue's activation applied to y (the first), in the
    accumulation dtype, rounded once to y's."""
    name = plans.activation_name(epilogue)
    if name is None:
        return outs
    y = outs[0]
    acc = dtypes.accumulation(np.dtype(y.dtype))
    return (JAX_ACTIVATIONS[name](y.astype(acc)).astype(y.dtype),) + tuple(outs[1:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _epilogue_vjp(fused, unfused, spec, args):
    """fused(spec, *args) (the epilogue in the forward kernel), differentiated
    as unfused(spec, *args) (the norm, then the epilogue's parts its backward
    does not take, as jax.numpy ops)."""
    return fused(spec, *args)


def _epilogue_fwd(fused, unfused, spec, args):
    return jax.vjp(lambda a: unfused(spec, *a), args)  # (results, jax's pullback as the residual)


def _epilogue_bwd(fused, unfused, spec, pullback, cotangents):
    return pullback(cotangents)


_epilogue_vjp.defvjp(_epilogue_fwd, _epilogue_bwd)


def _jit_module():
    from . import _custom_call, _jit

    _custom_call.check_jax_version()
    return _jit


def set_lowering_target(arch=None, *, sm_count=None, l2_bytes=None):
    """Lower cunorm's calls inside ``jax.jit`` for the GPU architecture
    ``arch`` instead of this process's GPU: for lowering and ``jax.export``
    on a host without one (it needs jax's CUDA plugin, not a GPU).

    ``arch`` is "sm_80" (A100), "sm_86" (A40, RTX 30), "sm_89" (L40S,
    RTX 40) or "sm_90" (H100, H200), or the compute capability as an int.
    Launches are planned for that architecture's reference part;
    ``sm_count`` and ``l2_bytes`` give another part's multiprocessors and
    L2 (an H100 PCIe: ``set_lowering_target("sm_90", sm_count=114)``).
    A program lowered so runs on any GPU of that compute capability (its
    grids were sized for the part named). ``None`` goes back to the
    process's GPU. Returns the target now in force (None: the GPU).

    Without a target and without a GPU, lowering raises a RuntimeError
    that names this function.
    """
    from . import _custom_call

    _custom_call.check_jax_version()
    return _custom_call.set_lowering_target(arch, sm_count=sm_count, l2_bytes=l2_bytes)


def _no_out(fn, kwargs):
    if "out" in kwargs:
        raise TypeError(f"cunorm.jax.{fn} has no out=: JAX arrays are immutable (use the result)")


# --- row norms ------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _row_vjp(spec, x, r, w, b):
    jj = _jit_module()
    return tuple(jj.rows_p.bind(*[a for a in (x, r, w, b) if a is not None], spec=spec))


def _rows_fwd(spec, x, r, w, b):
    jj = _jit_module()
    full = dataclasses.replace(spec, stats=True)
    named = dict(zip(jj._rows_outputs(full), jj.rows_p.bind(*[a for a in (x, r, w, b) if a is not None],
                                                            spec=full)))
    public = tuple(named[n] for n in jj._rows_outputs(spec))
    return public, (named.get("h", x), w, b, named.get("center"), named.get("scale"), r is not None)


def _rows_bwd(spec, saved, cotangents):
    jj = _jit_module()
    x, w, b, center, scale, has_r = saved
    ct = dict(zip(jj._rows_outputs(spec), cotangents))
    grad_spec = jj.RowGradSpec(dataclasses.replace(spec, residual=False, stats=True), dh=has_r)
    args = [ct["y"], x] + ([ct["h"]] if has_r else []) + ([w] if w is not None else []) + [
        s for s in (center, scale) if s is not None]
    grads = dict(zip(grad_spec.outputs(), jj.rows_grad_p.bind(*args, spec=grad_spec)))
    dw = None if w is None else grads["dw"].astype(w.dtype)
    db = None if b is None else grads["db"].astype(b.dtype)
    return grads["dx"], grads["dx"] if has_r else None, dw, db


_row_vjp.defvjp(_rows_fwd, _rows_bwd)


def _rows_unfused(spec, x, r, w, b):
    """The row norm with its rounding only (cunorm's backward), the weight
    offset as 1 + w in the accumulation dtype (as the kernel forms it) and
    the activation after it: what jax.grad differentiates."""
    inner = dataclasses.replace(spec, epilogue=spec.epilogue & ~plans.UNFUSED_IN_BACKWARD)
    if spec.epilogue & plans.FLAG_WEIGHT_OFFSET:
        acc = dtypes.accumulation(spec.dtype)
        w = w.astype(acc) + 1
        inner = dataclasses.replace(inner, pdtype=np.dtype(acc))
    return _activated(_row_vjp(inner, x, r, w, b), spec.epilogue)


def _row_traced(fn, norm, x, weight, bias, residual, axis, eps, return_stats, epilogue=0, quantize=None):
    """A row norm inside jit. ``quantize``: quantize='s (format, static
    scale, bound, group, scale layout, unquantized y asked), where y is
    written quantized: the row primitive bound without a vjp (a quantized y
    has no gradient: jax.grad through it raises jax's own error), results
    as the eager call's (q[, scales][, y][, h][, statistics])."""
    if not isinstance(x, _Tracer):
        _check_kind(fn, x)
    fmt, scale, bound, group, layout, plain = quantize or (None,) * 5 + (False,)
    call = row_norms.Call(norm, _stand_in(x), axis, eps, None, weight=_stand_in(weight), bias=_stand_in(bias),
                          residual=_stand_in(residual), return_stats=return_stats, quant=fmt,
                          quant_scale=_stand_in(scale), quant_scale_ub=_stand_in(bound), quant_group=group,
                          quant_scale_layout=layout, return_unquantized=plain)
    if call.quant is not None and call.quant.layout != "row_major":
        raise ValueError(f"cunorm.jax.{fn}: quant_scale_layout={layout!r} is a strided view, which JAX arrays "
                         "cannot be: take the row-major scales and transpose them (XLA fuses the copy)")
    _, pdtype = row_norms.kernel_params(call.x.dtype, call.weight, call.bias)
    w = None if weight is None else weight.astype(pdtype)
    b = None if bias is None else bias.astype(pdtype)
    x = jnp.asarray(x)
    h = None
    if residual is not None and call.last != x.ndim - 1:  # a strided axis: h formed first, unfused
        h = x = (x + residual).astype(x.dtype)
        residual = None
    spec = _jit_module().RowSpec(norm, tuple(x.shape), np.dtype(x.dtype), call.first, call.last, call.eps,
                                 residual=residual is not None, weight=w is not None, bias=b is not None,
                                 pdtype=None if pdtype is None else np.dtype(pdtype), stats=call.return_stats,
                                 epilogue=epilogue, quant=None if call.quant is None else call.quant.key)
    if not x.size:
        raise ValueError(f"cunorm.jax.{fn} inside jax.jit: x has no elements")
    if call.quant is not None:
        given = scale if scale is not None else bound
        arrays = [x, residual, w, b, None if given is None else jnp.reshape(given, (1,))]
        outs = list(_jit_module().rows_p.bind(*[a for a in arrays if a is not None], spec=spec))
    elif epilogue & plans.UNFUSED_IN_BACKWARD:
        outs = list(_epilogue_vjp(_row_vjp, _rows_unfused, spec, (x, residual, w, b)))
    else:
        outs = list(_row_vjp(spec, x, residual, w, b))
    if h is not None:
        outs.insert(1, h)
    return outs[0] if len(outs) == 1 else tuple(outs)


def _conditioned_traced(plain, norm, x, weight, bias, *, axis, eps, residual, return_stats, activation, shift,
                        scale, residual_gate, gate=None, norm_before_gate=True, epilogue=0, **options):
    """A traced call with per-head weights, shift=, scale=,
    residual_gate=, gate= or a float32 residual, checked as the eager call
    checks it: one fused forward (the row primitive with its per-row
    operands, cunorm/jax/_modulated.py); under jax.grad, shift=, scale= and
    residual_gate= of one per-sample pattern run the fused modulated
    backward, gate= over whole rows the fused gated backward
    (cunorm/jax/_gated.py), the float32 residual alone its fused backward
    (cunorm/jax/_wide.py), per-head parameters alone the plain row
    norm's vjp (its backward over the heads), the other forms the gradient of
    _conditioned_composed. Rows
    rows_cached does not take run _conditioned_composed. ``plain``: the
    traced call without the per-row operands."""
    arrays = {"shift": shift, "scale": scale, "residual_gate": residual_gate, "gate": gate}
    call = row_norms.Call(norm, _stand_in(x), axis, eps, None, weight=_stand_in(weight), bias=_stand_in(bias),
                          residual=_stand_in(residual), return_stats=return_stats, epilogue=epilogue,
                          conditioned={k: _stand_in(a) for k, a in arrays.items()})
    kw = dict(axis=axis, eps=eps, return_stats=return_stats, activation=activation,
              norm_before_gate=norm_before_gate, epilogue=epilogue, **options)
    composed = lambda *a: _conditioned_composed(plain, *a, **kw)  # noqa: E731
    args = (x, weight, bias, residual, shift, scale, residual_gate, gate)
    jm = _modulated_module()
    spec = jm.forward_spec(call, x, weight, bias, residual, arrays, epilogue, return_stats)
    if spec is None:
        return composed(*args)
    if _heads_alone(spec):  # (the plain row norm's vjp: its backward takes them)
        given = jm.prepare(spec, *args)
        plain = (given["x"], given.get("r"), given.get("w"), given.get("b"))
        outs = (_epilogue_vjp(_row_vjp, _rows_unfused, spec, plain) if epilogue & plans.UNFUSED_IN_BACKWARD
                else _row_vjp(spec, *plain))
    elif jm.fusable_backward(spec):
        outs = jm.modulated_vjp(spec, jm.prepare(spec, *args))
    elif gate is not None and _gated_module().fusable_backward(spec):
        outs = _gated_module().gated_vjp(spec, jm.prepare(spec, *args))
    elif spec.rdtype is not None and _wide_module().fusable_backward(spec):
        outs = _wide_module().wide_vjp(spec, jm.prepare(spec, *args))
    else:  # (the fused forward, differentiated as the composed formula)
        outs = _epilogue_vjp(lambda s, *a: jm.bind_forward(s, jm.prepare(s, *a)),
                             lambda s, *a: _as_tuple(composed(*a)), spec, args)
    return outs[0] if len(outs) == 1 else tuple(outs)


def _heads_alone(spec) -> bool:
    """Whether a prepared conditioned call's only per-row operands are
    parameters per head that the plain backward takes
    (gradients.per_head_fits), as cunorm.torch's heads_alone asks."""
    if spec.operands or spec.rdtype is not None or not spec.param_ndim or spec.last != len(spec.shape) - 1:
        return False
    n = math.prod(spec.shape[spec.first:])
    return gradients.per_head_fits(n, spec.dtype.itemsize, spec.weight, spec.bias)


def _conditioned_composed(plain, x, weight, bias, residual, shift, scale, residual_gate, gate, *, axis, eps,
                          return_stats, activation, norm_before_gate=True, epilogue=0, **options):
    """The conditioned call as the plain norm (``plain``) and jax.numpy ops
    around it (conditioning.gated, conditioning.composed), as cunorm.torch
    runs it where autograd records (cunorm/torch/_conditioned.py)."""
    acc = dtypes.accumulation(np.dtype(x.dtype))
    if gate is not None:
        return conditioning.gated(
            lambda h, w, **kw: plain(h, w, None, **kw), x, weight, gate, norm_before_gate=bool(norm_before_gate),
            normalized=bool(epilogue & plans.FLAG_ROUND_NORMALIZED), offset=bool(epilogue & plans.FLAG_WEIGHT_OFFSET),
            round_weighted=weight is not None and weight.dtype == x.dtype and np.dtype(x.dtype).itemsize == 2,
            to=_astype, acc=acc, silu=lambda v: v / (1 + jnp.exp(-v)), return_stats=return_stats, axis=axis, eps=eps)
    return conditioning.composed(plain, x, weight, bias, to=_astype, acc=acc, activate=JAX_ACTIVATIONS.get(activation),
                                 axis=axis, eps=eps, residual=residual, residual_gate=residual_gate, shift=shift,
                                 scale=scale, return_stats=return_stats, activation=activation, **options)


def _as_tuple(results):
    return tuple(results) if isinstance(results, tuple) else (results,)


def _modulated_module():
    _jit_module()
    from . import _modulated

    return _modulated


def _gated_module():
    _modulated_module()
    from . import _gated

    return _gated


def _wide_module():
    _modulated_module()
    from . import _wide

    return _wide


def _astype(a, dtype):
    return a.astype(dtype)


def rms_norm(x, weight=None, *, axis=-1, eps=DEFAULT_EPS, residual=None, return_stats=False, weight_offset=0,
             rounding="output", activation=None, quantize=None, quant_scale=None, quant_scale_ub=None,
             quant_group=None, quant_scale_layout=None, return_unquantized=False, shift=None, scale=None,
             residual_gate=None, gate=None, norm_before_gate=True, group_size=None, **kwargs):
    _no_out("rms_norm", kwargs)
    if group_size is not None and _traced(x, weight, residual, quant_scale, quant_scale_ub, shift, scale,
                                          residual_gate, gate):
        _no_unknown_kwargs("rms_norm", kwargs)
        return conditioning.in_groups(
            rms_norm, group_size, x, weight, gate=gate, residual=residual, axis=axis, eps=eps,
            return_stats=return_stats, weight_offset=weight_offset, rounding=rounding, activation=activation,
            quantize=quantize, quant_scale=quant_scale, quant_scale_ub=quant_scale_ub, quant_group=quant_group,
            quant_scale_layout=quant_scale_layout, return_unquantized=return_unquantized, shift=shift, scale=scale,
            residual_gate=residual_gate, norm_before_gate=norm_before_gate)
    if _traced(x, weight, residual, quant_scale, quant_scale_ub, shift, scale, residual_gate, gate):
        _no_unknown_kwargs("rms_norm", kwargs)
        epilogue = plans.rms_epilogue(weight_offset, rounding, activation, weight is not None, gate,
                                      norm_before_gate)
        if conditioning.requested(weight, None, axis, shift, scale, residual_gate, gate) or \
                conditioning.wide(x, residual):
            if quantize is not None:
                raise ValueError(conditioning.NOT_QUANTIZED)
            return _conditioned_traced(
                lambda x, w, b, **kw: rms_norm(x, w, **kw), "rms", x, weight, None, axis=axis, eps=eps,
                residual=residual, return_stats=return_stats, activation=activation, shift=shift, scale=scale,
                residual_gate=residual_gate, gate=gate, norm_before_gate=norm_before_gate, epilogue=epilogue,
                weight_offset=weight_offset, rounding=rounding)
        quant = (quantize, quant_scale, quant_scale_ub, quant_group, quant_scale_layout, return_unquantized)
        return _row_traced("rms_norm", "rms", x, weight, None, residual, axis, eps, return_stats, epilogue, quant)
    _check_kind("rms_norm", x)
    return norms.rms_norm(x, weight, axis=axis, eps=eps, residual=residual, return_stats=return_stats,
                          weight_offset=weight_offset, rounding=rounding, activation=activation, quantize=quantize,
                          quant_scale=quant_scale, quant_scale_ub=quant_scale_ub, quant_group=quant_group,
                          quant_scale_layout=quant_scale_layout, return_unquantized=return_unquantized,
                          shift=shift, scale=scale, residual_gate=residual_gate, gate=gate,
                          norm_before_gate=norm_before_gate, group_size=group_size, **kwargs)


def layer_norm(x, weight=None, bias=None, *, axis=-1, eps=DEFAULT_EPS, residual=None, return_stats=False,
               activation=None, quantize=None, quant_scale=None, quant_scale_ub=None, quant_group=None,
               quant_scale_layout=None, return_unquantized=False, shift=None, scale=None, residual_gate=None,
               **kwargs):
    _no_out("layer_norm", kwargs)
    if _traced(x, weight, bias, residual, quant_scale, quant_scale_ub, shift, scale, residual_gate):
        _no_unknown_kwargs("layer_norm", kwargs)
        epilogue = plans.activation_flags(activation)
        if conditioning.requested(weight, bias, axis, shift, scale, residual_gate) or conditioning.wide(x, residual):
            if quantize is not None:
                raise ValueError(conditioning.NOT_QUANTIZED)
            return _conditioned_traced(layer_norm, "ln", x, weight, bias, axis=axis, eps=eps, residual=residual,
                                       return_stats=return_stats, activation=activation, shift=shift, scale=scale,
                                       residual_gate=residual_gate, epilogue=epilogue)
        quant = (quantize, quant_scale, quant_scale_ub, quant_group, quant_scale_layout, return_unquantized)
        return _row_traced("layer_norm", "ln", x, weight, bias, residual, axis, eps, return_stats, epilogue, quant)
    _check_kind("layer_norm", x)
    return norms.layer_norm(x, weight, bias, axis=axis, eps=eps, residual=residual, return_stats=return_stats,
                            activation=activation, quantize=quantize, quant_scale=quant_scale,
                            quant_scale_ub=quant_scale_ub, quant_group=quant_group,
                            quant_scale_layout=quant_scale_layout, return_unquantized=return_unquantized,
                            shift=shift, scale=scale, residual_gate=residual_gate, **kwargs)


def normalize(x, p=2.0, *, axis=-1, eps=LP_EPS, **kwargs):
    _no_out("normalize", kwargs)
    if _traced(x):
        _no_unknown_kwargs("normalize", kwargs)
        return _row_traced("normalize", row_norms.lp_norm_name(p), x, None, None, None, axis, eps, False)
    _check_kind("normalize", x)
    return norms.normalize(x, p, axis=axis, eps=eps, **kwargs)


def mean_abs_normalize(x, *, axis=-1, eps=LP_EPS, **kwargs):
    _no_out("mean_abs_normalize", kwargs)
    if _traced(x):
        _no_unknown_kwargs("mean_abs_normalize", kwargs)
        return _row_traced("mean_abs_normalize", "mean_abs", x, None, None, None, axis, eps, False)
    _check_kind("mean_abs_normalize", x)
    return norms.mean_abs_normalize(x, axis=axis, eps=eps, **kwargs)


def frobenius_normalize(x, *, axis=None, eps=LP_EPS, **kwargs):
    _no_out("frobenius_normalize", kwargs)
    if _traced(x):
        _no_unknown_kwargs("frobenius_normalize", kwargs)
        return _row_traced("frobenius_normalize", "l2", x, None, None, None, axis, eps, False)
    _check_kind("frobenius_normalize", x)
    return norms.frobenius_normalize(x, axis=axis, eps=eps, **kwargs)


# --- channel norms ----------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _channel_vjp(spec, x, w, b, rm, rv):
    jj = _jit_module()
    return tuple(jj.channels_p.bind(*[a for a in (x, w, b, rm, rv) if a is not None], spec=spec))


def _channels_fwd(spec, x, w, b, rm, rv):
    jj = _jit_module()
    from_running = spec.norm == "batch" and not spec.training
    full = spec if from_running else dataclasses.replace(spec, stats=True)
    outs = jj.channels_p.bind(*[a for a in (x, w, b, rm, rv) if a is not None], spec=full)
    named = dict(zip(full.outputs(), outs))
    if from_running:
        mean, rstd = rm, jax.lax.rsqrt(rv + jnp.asarray(spec.eps, rv.dtype))
    else:
        mean, rstd = named["mean"], named["rstd"]
    return tuple(named[n] for n in spec.outputs()), (x, w, b, mean, rstd)


def _channels_bwd(spec, saved, cotangents):
    jj = _jit_module()
    x, w, b, mean, rstd = saved
    ct = dict(zip(spec.outputs(), cotangents))
    grad_spec = jj.ChannelGradSpec(spec)
    args = [ct["y"], x, mean, rstd] + ([w] if w is not None else [])
    grads = dict(zip(grad_spec.outputs(), jj.channels_grad_p.bind(*args, spec=grad_spec)))
    dw = None if w is None else grads["dw"].astype(w.dtype)
    db = None if b is None else grads["db"].astype(b.dtype)
    return grads["dx"], dw, db, None, None  # (the running buffers: not differentiated)


_channel_vjp.defvjp(_channels_fwd, _channels_bwd)


def _channels_unfused(spec, x, w, b, rm, rv):
    """The channel norm, then its activation (what jax.grad differentiates)."""
    return _activated(_channel_vjp(dataclasses.replace(spec, epilogue=0), x, w, b, rm, rv), spec.epilogue)


def _channel_jax(fn, norm, x, num_groups, weight, bias, running_mean, running_var, training, momentum, eps,
                 channel_axis, return_stats, activation):
    epilogue = plans.activation_flags(activation)
    call = channel_norms.ChannelCall(norm, _stand_in(x), num_groups=num_groups, weight=_stand_in(weight),
                                     bias=_stand_in(bias), eps=eps, channel_axis=channel_axis,
                                     return_stats=return_stats, running_mean=_stand_in(running_mean, True),
                                     running_var=_stand_in(running_var, True), training=training, momentum=momentum)
    if not call.x.size:
        raise ValueError(f"cunorm.jax.{fn} inside jax.jit: x has no elements")
    _, pdtype = row_norms.kernel_params(call.x.dtype, call.weight, call.bias)
    w = None if weight is None else weight.astype(pdtype)
    b = None if bias is None else bias.astype(pdtype)
    x = jnp.asarray(x)
    ndim, axis = x.ndim, call.channel_axis
    moved = axis not in (1, ndim - 1)
    if moved:  # the kernels take channels first or last
        x = jnp.moveaxis(x, axis, -1)
    last = ndim > 2 and (moved or axis == ndim - 1)
    acc = np.dtype(jnp.float64 if x.dtype == jnp.float64 else jnp.float32)
    running = running_mean is not None
    rm = None if not running else running_mean.astype(acc)
    rv = None if not running else running_var.astype(acc)
    jj = _jit_module()
    spec = jj.ChannelSpec(norm, tuple(x.shape), np.dtype(x.dtype), last, call.groups, call.eps,
                          momentum=call.momentum, training=call.training, weight=w is not None, bias=b is not None,
                          pdtype=None if pdtype is None else np.dtype(pdtype), running=running,
                          stats=call.return_stats, epilogue=epilogue)
    if epilogue:
        outs = _epilogue_vjp(_channel_vjp, _channels_unfused, spec, (x, w, b, rm, rv))
    else:
        outs = _channel_vjp(spec, x, w, b, rm, rv)
    named = dict(zip(spec.outputs(), outs))
    y = jnp.moveaxis(named["y"], -1, axis) if moved else named["y"]
    outs = [y]
    if call.return_stats:
        outs += [named["mean"], named["rstd"]]
    if running and call.training:
        outs += [named["running_mean"].astype(running_mean.dtype), named["running_var"].astype(running_var.dtype)]
    return outs[0] if len(outs) == 1 else tuple(outs)


def group_norm(x, num_groups, weight=None, bias=None, *, eps=DEFAULT_EPS, channel_axis=1, return_stats=False,
               activation=None, **kwargs):
    _no_out("group_norm", kwargs)
    if _traced(x, weight, bias):
        _no_unknown_kwargs("group_norm", kwargs)
        return _channel_jax("group_norm", "group", x, num_groups, weight, bias, None, None, True, 0.1, eps,
                            channel_axis, return_stats, activation)
    _check_kind("group_norm", x)
    return norms.group_norm(x, num_groups, weight, bias, eps=eps, channel_axis=channel_axis,
                            return_stats=return_stats, activation=activation, **kwargs)


def instance_norm(x, weight=None, bias=None, *, eps=DEFAULT_EPS, channel_axis=1, return_stats=False,
                  activation=None, **kwargs):
    _no_out("instance_norm", kwargs)
    if _traced(x, weight, bias):
        _no_unknown_kwargs("instance_norm", kwargs)
        return _channel_jax("instance_norm", "instance", x, None, weight, bias, None, None, True, 0.1, eps,
                            channel_axis, return_stats, activation)
    _check_kind("instance_norm", x)
    return norms.instance_norm(x, weight, bias, eps=eps, channel_axis=channel_axis, return_stats=return_stats,
                               activation=activation, **kwargs)


def batch_norm(x, weight=None, bias=None, *, running_mean=None, running_var=None, training=True, momentum=0.1,
               eps=DEFAULT_EPS, channel_axis=1, return_stats=False, activation=None, **kwargs):
    _no_out("batch_norm", kwargs)
    jax_running = isinstance(running_mean, jax.Array) or isinstance(running_var, jax.Array)
    if _traced(x, weight, bias, running_mean, running_var) or jax_running:
        if not _traced(x):
            _check_kind("batch_norm", x)
        _no_unknown_kwargs("batch_norm", kwargs)
        return _channel_jax("batch_norm", "batch", x, None, weight, bias, running_mean, running_var, training,
                            momentum, eps, channel_axis, return_stats, activation)
    _check_kind("batch_norm", x)
    return norms.batch_norm(x, weight, bias, running_mean=running_mean, running_var=running_var, training=training,
                            momentum=momentum, eps=eps, channel_axis=channel_axis, return_stats=return_stats,
                            activation=activation, **kwargs)


for _name in __all__[:-1]:  # (the ops; set_lowering_target has its own)
    _f = globals()[_name]
    _f.__doc__ = (f"``cunorm.{_name}`` on JAX arrays, eager or traced (no ``out=``; see the module).\n\n"
                  + (getattr(norms, _name).__doc__ or ""))
del _name, _f
