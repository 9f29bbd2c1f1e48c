"""The engine's entry: one call of an op, forward or backward.

A call whose whole signature the launch cache (launch_cache.py) holds is
a dictionary lookup and its launcher; any other call is validated, planned
and launched by its family's general path (row_norms.py, channel_norms.py,
gradients.py), which fills the cache where it ran over the arrays as given.

The engine knows no front end. A caller whose framework must see the call
passes ``route``: when the arrays' adapter says so (a torch tensor that
autograd records, or a call dynamo traces: ``_interop.torch_route``),
``route()`` runs instead of the engine, and its results are returned. A
caller that keeps the launcher a call ran (the torch layers' memo) passes
``trace``, a list that receives ``(launcher, inputs, results)``.
"""
from __future__ import annotations

from . import (channel_norms, conditioning, dtypes, gated_grad, gradients, launch_cache, modulated_grad, ops, plans,
               row_norms, wide_grad)
from .. import _interop, reference


def _noted(trace, cache, key, inputs, results):
    """results, with the launcher stored under ``key`` noted in ``trace``."""
    if key is not None:
        found = cache.get(key)
        if found is not None:
            trace.append((found, inputs, results))
    return results


def rows(norm, x, weight, bias, residual, axis, eps, return_stats, out, reference_fn, epilogue=0, out_dtype=None,
         route=None, trace=None, quantize=None, conditioned=None, group=None):
    """A row norm (``norm``: its policy name). ``reference_fn``: the float64
    forward of a NumPy call; ``epilogue``: the validated FLAGS bits of the
    epilogue's options; ``out_dtype``: y's dtype where it is not x's (the
    torch layers under autocast); ``quantize``: (format, static scale,
    bound, group, scale layout, unquantized y asked) of quantize=
    (quantize.py), which the general path validates; ``conditioned``:
    {name: array or None} of conditioning.OPERAND_NAMES (those absent: None),
    keyed in the launch cache with the other arrays; ``group``: rms_norm's
    group_size (without out= or quantize=), the call run over the
    arrays' grouped views (conditioning.split_groups) and keyed as given."""
    # (identity tests alone: the plain path takes them on every call)
    quantizing = quantize is not None and (quantize[0] is not None or quantize[1] is not None
                                           or quantize[2] is not None or quantize[3] is not None
                                           or quantize[4] is not None or quantize[5] is not False)
    if group is not None or (conditioned is not None and any(a is not None for a in conditioned.values())):
        conditioned = conditioned or {}
        operands = tuple(conditioned.get(name) for name in conditioning.OPERAND_NAMES)  # (the entry's order)
        key = None
        if out is None and not quantizing:
            key = launch_cache.rows_key(norm, x, weight, bias, residual, axis, eps, return_stats, epilogue, None,
                                        conditioned=operands, group=group)
            results = launch_cache.replay(launch_cache.ROWS, key, x, weight, bias, residual, *operands)
            if results is not None:
                return results
        if route is not None and _interop.torch_route(x, weight, bias, residual, *operands, out=out):
            return route()
        if group is not None:
            shape = tuple(x.shape)
            x, weight, gate, residual, _ = conditioning.split_groups(group, x, weight, conditioned.get("gate"),
                                                                     residual, None, axis)
            call = row_norms.Call(norm, x, -1, eps, None, weight=weight, residual=residual, return_stats=return_stats,
                                  epilogue=epilogue, conditioned={**conditioned, "gate": gate})
            results = row_norms.run(call, reference_fn, key=key, y_shape=shape)
            return conditioning.join_groups(results, shape, 1 + (residual is not None))
        q = quantize or (None, None, None, None, None, False)
        call = row_norms.Call(norm, x, axis, eps, out, weight=weight, bias=bias, residual=residual,
                              return_stats=return_stats, epilogue=epilogue, quant=q[0], quant_scale=q[1],
                              quant_scale_ub=q[2], quant_group=q[3], quant_scale_layout=q[4],
                              return_unquantized=q[5], conditioned=conditioned)  # (quantize= with them: refused)
        return row_norms.run(call, reference_fn, key=key)
    if quantizing:
        key = None
        if out is None:  # (no key under dynamo or where autograd records: the route below takes those)
            key = launch_cache.rows_key(norm, x, weight, bias, residual, axis, eps, return_stats, epilogue, None,
                                        quantize)
            results = launch_cache.replay(launch_cache.ROWS, key, x, weight, bias, residual, *quantize[1:3])
            if results is not None:
                return results
        if route is not None and _interop.torch_route(x, weight, bias, residual, *quantize[1:3]):
            return route()  # (cunorm.torch: its operator under dynamo; refused where autograd records)
        call = row_norms.Call(norm, x, axis, eps, out, weight=weight, bias=bias, residual=residual,
                              return_stats=return_stats, epilogue=epilogue, quant=quantize[0],
                              quant_scale=quantize[1], quant_scale_ub=quantize[2], quant_group=quantize[3],
                              quant_scale_layout=quantize[4], return_unquantized=quantize[5])
        return row_norms.run(call, reference_fn, key=key)
    key = None
    if out is None:
        key = launch_cache.rows_key(norm, x, weight, bias, residual, axis, eps, return_stats, epilogue, out_dtype)
        results = launch_cache.replay(launch_cache.ROWS, key, x, weight, bias, residual)
        if results is not None:
            if trace is None:
                return results
            return _noted(trace, launch_cache.ROWS, key, (x, weight, bias, residual), results)
    if route is not None and _interop.torch_route(x, weight, bias, residual, out=out):
        return route()
    call = row_norms.Call(norm, x, axis, eps, out, weight=weight, bias=bias, residual=residual,
                          return_stats=return_stats, epilogue=epilogue, out_dtype=out_dtype)
    results = row_norms.run(call, reference_fn, key=key)
    return results if trace is None else _noted(trace, launch_cache.ROWS, key, (x, weight, bias, residual), results)


def channels(norm, x, num_groups, weight, bias, running_mean, running_var, training, momentum, eps, channel_axis,
             return_stats, out, epilogue=0, out_dtype=None, route=None, trace=None):
    """A channel norm (``norm``: "group", "instance" or "batch"), as rows."""
    key = None
    if out is None:
        key = launch_cache.channel_key(norm, x, num_groups, weight, bias, running_mean, running_var, training,
                                       momentum, eps, channel_axis, return_stats, epilogue, out_dtype)
        results = launch_cache.replay(launch_cache.CHANNELS, key, x, weight, bias, running_mean, running_var)
        if results is not None:
            if trace is None:
                return results
            return _noted(trace, launch_cache.CHANNELS, key, (x, weight, bias, running_mean, running_var), results)
    if route is not None and _interop.torch_route(x, weight, bias, out=out):
        return route()
    call = channel_norms.ChannelCall(norm, x, num_groups=num_groups, weight=weight, bias=bias, eps=eps,
                                     channel_axis=channel_axis, out=out, return_stats=return_stats,
                                     running_mean=running_mean, running_var=running_var, training=training,
                                     momentum=momentum, epilogue=epilogue, out_dtype=out_dtype)
    results = channel_norms.run(call, key=key)
    if trace is None:
        return results
    return _noted(trace, launch_cache.CHANNELS, key, (x, weight, bias, running_mean, running_var), results)


def rows_grad(norm, dy, x, mean, rstd, weight, bias, dh, axis, eps, reference_fn=None):
    """A row norm's backward: (dx, dweight[, dbias]) for RMSNorm and
    LayerNorm, dx for the Lp norms. ``reference_fn``: the float64 backward
    of a NumPy call (default: the table's, gradients.reference_rows)."""
    key = launch_cache.grad_key(norm, dy, x, mean, rstd, weight, bias, dh, (axis,), eps)
    results = launch_cache.replay(launch_cache.ROWS_GRAD, key, dy, x, mean, rstd, weight, bias, dh)
    if results is not None:
        return results
    g = gradients.RowGradCall(norm, dy, x, axis=axis, eps=eps, mean=mean, rstd=rstd, weight=weight, bias=bias, dh=dh)
    return gradients.run_rows(g, reference_fn, key=key)


def rows_grad_modulated(norm, dy, h, mean, rstd, weight, bias, dh, shift, scale, residual_gate, x, axis):
    """A modulated row norm's backward (modulated_grad.py): ModulatedGrads."""
    key = launch_cache.modulated_grad_key(norm, dy, h, x, dh, weight, bias, shift, scale, residual_gate, mean, rstd,
                                          axis)
    results = launch_cache.replay(launch_cache.ROWS_GRAD, key, dy, h, x, dh, weight, bias, shift, scale,
                                  residual_gate, mean, rstd)
    if results is not None:
        return modulated_grad.ModulatedGrads(*results)
    g = modulated_grad.ModulatedGradCall(norm, dy, h, mean=mean, rstd=rstd, weight=weight, bias=bias, dh=dh,
                                         shift=shift, scale=scale, residual_gate=residual_gate, x=x, axis=axis)
    return modulated_grad.run(g, key)


def rows_grad_gated(dy, x, rstd, weight, gate, norm_before_gate, axis):
    """The gated RMSNorm's backward (gated_grad.py): GatedGrads."""
    key = gated_grad.key(dy, x, rstd, weight, gate, norm_before_gate, axis)
    results = launch_cache.replay(launch_cache.ROWS_GRAD, key, dy, x, rstd, weight, gate)
    if results is not None:
        return gated_grad.GatedGrads(*results)
    return gated_grad.run(gated_grad.GatedGradCall(dy, x, rstd, weight, gate, norm_before_gate, axis), key)


def rows_grad_wide(norm, dy, h, mean, rstd, weight, bias, dh, axis):
    """The float32 residual stream's backward (wide_grad.py): WideResidualGrads."""
    key = wide_grad.key(norm, dy, h, mean, rstd, weight, bias, dh, axis)
    results = launch_cache.replay(launch_cache.ROWS_GRAD, key, dy, h, mean, rstd, weight, bias, dh)
    if results is not None:
        return wide_grad.WideResidualGrads(*results)
    return wide_grad.run(wide_grad.WideGradCall(norm, dy, h, mean, rstd, weight, bias, dh, axis), key)


def channel_grad(norm, dy, x, mean, rstd, num_groups, weight, bias, channel_axis, training, eps,
                 reference_fn=None):
    """A channel norm's backward: (dx, dweight, dbias)."""
    key = launch_cache.grad_key(norm, dy, x, mean, rstd, weight, bias, None, (num_groups, channel_axis, training),
                                eps)
    results = launch_cache.replay(launch_cache.CHANNELS_GRAD, key, dy, x, mean, rstd, weight, bias, None)
    if results is not None:
        return results
    g = gradients.ChannelGradCall(norm, dy, x, mean, rstd, num_groups=num_groups, weight=weight, bias=bias,
                                  channel_axis=channel_axis, training=training, eps=eps)
    return gradients.run_channels(g, reference_fn, key=key)


def layer_norm_float32(x, weight=None, bias=None, *, axis=-1, eps=ops.DEFAULT_EPS, activation=None, trace=None):
    """layer_norm of a 16-bit x returning float32 y in one pass (no cast of
    x first): what torch's autocast makes of a LayerNorm, for cunorm's torch
    layers in inference. No residual, statistics or out=; never routed (the
    layers call it outside autograd and dynamo)."""
    return rows("ln", x, weight, bias, None, axis, eps, False, None, reference.layer_norm,
                epilogue=plans.activation_flags(activation), out_dtype=dtypes.float32, trace=trace)


def group_norm_float32(x, num_groups, weight=None, bias=None, *, eps=ops.DEFAULT_EPS, activation=None,
                       trace=None):
    """group_norm of a 16-bit x (N, C, *) returning float32 y in one pass,
    as layer_norm_float32."""
    return channels("group", x, num_groups, weight, bias, None, None, True, 0.1, eps, 1, False, None,
                    epilogue=plans.activation_flags(activation), out_dtype=dtypes.float32, trace=trace)
