"""The float64 NumPy reference: the slow, exact definition every kernel is
tested against, and what cunorm's public functions compute for NumPy input.

Each function computes in float64 and returns x's dtype (``exact=True``
returns the unrounded float64 results, which is what the tests compare to).
A group whose statistic is not finite (an Inf or NaN in it) comes out all
NaN, as the kernels define it.
"""
from __future__ import annotations

import numpy as np


def apply_activation(y, name):
    """The epilogue's activation (None: identity) of float64 y."""
    if name is None or name == "identity":
        return y
    if name == "relu":
        return np.where(y < 0, 0.0, y)  # (a NaN stays NaN)
    if name == "silu":
        with np.errstate(over="ignore"):
            return y / (1.0 + np.exp(-y))
    if name == "gelu":
        from math import erf

        return y * 0.5 * (1.0 + np.vectorize(erf, otypes=[np.float64])(y / np.sqrt(2.0)))
    if name == "gelu_tanh":
        return 0.5 * y * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (y + 0.044715 * y**3)))
    raise ValueError(f"unknown activation {name!r}")


def rms_norm(x, weight=None, *, axis=-1, eps=1e-5, residual=None, return_stats=False, weight_offset=0,
             rounding="output", activation=None, shift=None, scale=None, residual_gate=None, gate=None,
             norm_before_gate=True, exact=False):
    """``act(modulate(h * rsqrt(mean(h**2 over axis) + eps) [* (weight_offset + weight)]))``
    with h = x (+ residual, or residual + residual_gate * x) and
    ``modulate(v) = v * (1 + scale) + shift``; ``rounding="normalized"``
    rounds the normalized h to x's dtype before the weight multiplies.
    weight may span more of x's trailing axes (per-head weights); shift,
    scale and residual_gate broadcast against x. With ``gate`` z: the
    result times silu(z) (``norm_before_gate``; under rounding="normalized"
    with a weight of x's 16-bit dtype, the weighted value is rounded to it
    first), or h = x * silu(z) normalized (``norm_before_gate=False``).
    Returns y, then h if residual is given, then rstd if return_stats."""
    return _normalize("rms", x, weight, None, axis, eps, residual, return_stats, exact,
                      (weight_offset, rounding, activation), (shift, scale, residual_gate),
                      (gate, norm_before_gate))


def layer_norm(x, weight=None, bias=None, *, axis=-1, eps=1e-5, residual=None, return_stats=False,
               activation=None, shift=None, scale=None, residual_gate=None, exact=False):
    """``act(modulate((h - mean) * rsqrt(var + eps) [* weight] [+ bias]))``
    over axis, var biased, with h and modulate as for rms_norm. Returns y,
    then h if residual is given, then mean and rstd if return_stats."""
    return _normalize("ln", x, weight, bias, axis, eps, residual, return_stats, exact, (0, "output", activation),
                      (shift, scale, residual_gate))


def _silu(z):
    with np.errstate(over="ignore"):
        return z / (1.0 + np.exp(-z))


def _normalize(kind, x, weight, bias, axis, eps, residual, return_stats, exact, epilogue, conditioned=(None,) * 3,
               gated=(None, True)):
    from ._engine.dtypes import accumulation
    from ._engine.plans import normalize_axes

    x = np.asarray(x)
    first, last = normalize_axes(axis, x.ndim)
    axes = tuple(range(first, last + 1))
    shift, mod_scale, gate = (None if a is None else np.asarray(a).astype(np.float64) for a in conditioned)
    if residual is not None:
        # h is rounded to the residual's dtype (x's, or float32 under 16-bit x), and the norm sees that h.
        xg = x.astype(np.float64) if gate is None else gate * x.astype(np.float64)
        h = (xg + np.asarray(residual).astype(np.float64)).astype(np.asarray(residual).dtype)
    else:
        h = x
    hf = h.astype(np.float64)
    z, norm_before_gate = gated
    z = None if z is None else _silu(np.asarray(z).astype(np.float64))
    if z is not None and not norm_before_gate:
        hf = hf * z
    n = int(np.prod([x.shape[a] for a in axes]))
    with np.errstate(over="ignore", invalid="ignore"):
        if kind == "rms":
            sum_sq = np.sum(hf * hf, axis=axes, keepdims=True)
            center = np.zeros_like(sum_sq)
            scale = 1.0 / np.sqrt(sum_sq / n + eps)
            finite = np.isfinite(sum_sq)
        else:
            center = np.mean(hf, axis=axes, keepdims=True)
            var = np.mean((hf - center) ** 2, axis=axes, keepdims=True)
            scale = 1.0 / np.sqrt(var + eps)
            finite = np.isfinite(var) & np.isfinite(center)
        scale = np.where(finite, scale, np.nan)
        center = np.where(finite, center, np.nan)  # a non-finite group's statistics are NaN
        y = (hf - np.where(finite, center, 0.0)) * scale
        weight_offset, rounding, act = epilogue
        if rounding == "normalized":
            y = y.astype(x.dtype).astype(np.float64)
        tail = (1,) * (x.ndim - 1 - last)
        if weight is not None:
            w = np.asarray(weight).astype(np.float64) + weight_offset
            y = y * w.reshape(w.shape + tail)
        if z is not None and norm_before_gate:
            if rounding == "normalized" and weight is not None and np.asarray(weight).dtype == x.dtype \
                    and x.dtype.itemsize == 2:
                y = y.astype(x.dtype).astype(np.float64)  # (weight * h.to(dtype) in that dtype)
            y = y * z
        if bias is not None:
            b = np.asarray(bias).astype(np.float64)
            y = y + b.reshape(b.shape + tail)
        if mod_scale is not None:
            y = y * (1.0 + mod_scale)
        if shift is not None:
            y = y + shift
        y = apply_activation(y, act)
    results = [y if exact else y.astype(x.dtype)]
    if residual is not None:
        results.append(h)
    if return_stats:
        stats_dtype = np.float64 if exact else accumulation(x.dtype)
        if kind == "ln":
            results.append(np.squeeze(center, axis=axes).astype(stats_dtype))
        results.append(np.squeeze(scale, axis=axes).astype(stats_dtype))
    return results[0] if len(results) == 1 else tuple(results)


def normalize(x, p=2.0, *, axis=-1, eps=1e-12, exact=False):
    """``x / max(norm_p(x over axis), eps)`` (torch's F.normalize); axis may
    be None (every axis). p = inf is the largest magnitude."""
    return _lp(x, float(p), False, axis, eps, exact)


def mean_abs_normalize(x, *, axis=-1, eps=1e-12, exact=False):
    """``x / max(mean(|x| over axis), eps)``."""
    return _lp(x, 1.0, True, axis, eps, exact)


def frobenius_normalize(x, *, axis=None, eps=1e-12, exact=False):
    """``x / max(sqrt(sum(x**2)), eps)`` over every axis (or the given ones)."""
    return _lp(x, 2.0, False, axis, eps, exact)


def _lp(x, p, mean, axis, eps, exact):
    from ._engine.plans import normalize_axes

    x = np.asarray(x)
    if axis is None:
        axes = tuple(range(x.ndim))
    else:
        first, last = normalize_axes(axis, x.ndim)
        axes = tuple(range(first, last + 1))
    xf = x.astype(np.float64)
    a = np.abs(xf)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if p == np.inf:
            statistic = np.max(a, axis=axes, keepdims=True)
            norm = statistic
        elif p == 2.0:
            statistic = np.sum(xf * xf, axis=axes, keepdims=True)
            norm = np.sqrt(statistic)
        elif p == 1.0:
            statistic = np.sum(a, axis=axes, keepdims=True)
            norm = statistic / int(np.prod([x.shape[i] for i in axes])) if mean else statistic
        else:
            statistic = np.sum(a**p, axis=axes, keepdims=True)
            norm = statistic ** (1.0 / p)
        y = xf / np.maximum(norm, eps)
        y = np.where(np.isfinite(statistic), y, np.nan)
    return y if exact else y.astype(x.dtype)


def _channels_first(x, channel_axis):
    """x as (N, C, S) float64 with the channel axis moved to 1 and the
    spatial axes flattened, and the function that undoes it."""
    x = np.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"x must have a batch and a channel axis, got shape {x.shape}")
    ca = channel_axis % x.ndim
    moved = np.moveaxis(x, ca, 1)
    shape = moved.shape

    def back(a):
        return np.moveaxis(a.reshape(shape), 1, ca)

    return moved.reshape(shape[0], shape[1], int(np.prod(shape[2:]))).astype(np.float64), back


def _grouped(xf, num_groups, per_sample, eps):
    """center, scale and the finite mask of every statistic group of xf
    (N, C, S): groups of C // num_groups channels, per sample or over the
    whole batch; keepdims so they broadcast against (N, G, C // G, S)."""
    n, c, s = xf.shape
    xg = xf.reshape(n, num_groups, c // num_groups, s)
    axes = (2, 3) if per_sample else (0, 2, 3)
    with np.errstate(over="ignore", invalid="ignore"):
        center = np.mean(xg, axis=axes, keepdims=True)
        var = np.mean((xg - center) ** 2, axis=axes, keepdims=True)
        finite = np.isfinite(var) & np.isfinite(center)
        scale = np.where(finite, 1.0 / np.sqrt(var + eps), np.nan)
    return np.where(finite, center, np.nan), scale, var, xg


def _channel_affine(xg, center, scale, weight, bias):
    n, g, cg, s = xg.shape
    with np.errstate(over="ignore", invalid="ignore"):
        y = (xg - center) * scale  # a non-finite group's NaN scale makes it NaN
        if weight is not None:
            y = y * np.asarray(weight).astype(np.float64).reshape(1, g, cg, 1)
        if bias is not None:
            y = y + np.asarray(bias).astype(np.float64).reshape(1, g, cg, 1)
    return y


def group_norm(x, num_groups, weight=None, bias=None, *, eps=1e-5, channel_axis=1, return_stats=False,
               activation=None, exact=False):
    """GroupNorm: statistics per (sample, group of C // num_groups channels)
    over the group's channels and every spatial position, var biased; then
    per channel ``* weight[c] + bias[c]``. Returns y, then (mean, rstd) of
    shape (N, num_groups) if return_stats."""
    from ._engine.dtypes import accumulation

    x = np.asarray(x)
    xf, back = _channels_first(x, channel_axis)
    center, scale, _, xg = _grouped(xf, num_groups, True, eps)
    y = back(apply_activation(_channel_affine(xg, center, scale, weight, bias), activation))
    results = [y if exact else y.astype(x.dtype)]
    if return_stats:
        stats_dtype = np.float64 if exact else accumulation(x.dtype)
        results += [center.reshape(xf.shape[0], num_groups).astype(stats_dtype),
                    scale.reshape(xf.shape[0], num_groups).astype(stats_dtype)]
    return results[0] if len(results) == 1 else tuple(results)


def instance_norm(x, weight=None, bias=None, *, eps=1e-5, channel_axis=1, return_stats=False, activation=None,
                  exact=False):
    """InstanceNorm: GroupNorm with one channel per group. Statistics of
    shape (N, C)."""
    x = np.asarray(x)
    return group_norm(x, x.shape[channel_axis % max(x.ndim, 1)] if x.ndim >= 2 else 1, weight, bias, eps=eps,
                      channel_axis=channel_axis, return_stats=return_stats, activation=activation, exact=exact)


def batch_norm(x, weight=None, bias=None, *, running_mean=None, running_var=None, training=True, momentum=0.1,
               eps=1e-5, channel_axis=1, return_stats=False, activation=None, exact=False):
    """BatchNorm: per-channel statistics over the batch and every spatial
    position. Training: batch statistics (var biased), and the running
    buffers, when given, updated in place as torch does:
    ``running = (1 - momentum) * running + momentum * stat`` with the
    unbiased variance. Eval: the running statistics. Statistics returned
    (mean, rstd of the normalization used) of shape (C,)."""
    from ._engine.dtypes import accumulation

    x = np.asarray(x)
    xf, back = _channels_first(x, channel_axis)
    n, c, s = xf.shape
    if training:
        center, scale, var, xg = _grouped(xf, c, False, eps)
        count = n * s
        updates = []  # (buffer, value): both checked before either is written
        if running_mean is not None:
            updates.append((running_mean, (1 - momentum) * running_mean.astype(np.float64)
                            + momentum * center.reshape(c)))
        if running_var is not None:
            unbiased = var.reshape(c) * (count / (count - 1))
            updates.append((running_var, (1 - momentum) * running_var.astype(np.float64) + momentum * unbiased))
        for buffer, _ in updates:
            if not buffer.flags.writeable:
                raise ValueError("batch_norm: a running buffer is read-only; pass writable arrays")
        for buffer, value in updates:
            buffer[...] = value
    else:
        xg = xf.reshape(n, c, 1, s)
        center = np.asarray(running_mean).astype(np.float64).reshape(1, c, 1, 1)
        with np.errstate(invalid="ignore", divide="ignore"):
            scale = 1.0 / np.sqrt(np.asarray(running_var).astype(np.float64).reshape(1, c, 1, 1) + eps)
    y = back(apply_activation(_channel_affine(xg, center, scale, weight, bias), activation))
    results = [y if exact else y.astype(x.dtype)]
    if return_stats:
        stats_dtype = np.float64 if exact else accumulation(x.dtype)
        results += [center.reshape(c).astype(stats_dtype), scale.reshape(c).astype(stats_dtype)]
    return results[0] if len(results) == 1 else tuple(results)


# --- gradients -----------------------------------------------------------------
# Each takes what the forward saved (x or h, its statistics, the weight) and
# dy, computes in float64 from those statistics, and returns dx (plus dh
# when given: the gradient that reached h) and the parameters' gradients
# (None where the forward had no such parameter). NaN statistics give NaN.


def _row_axes(x, axis):
    from ._engine.plans import normalize_axes

    if axis is None:
        return tuple(range(x.ndim)), x.ndim - 1
    first, last = normalize_axes(axis, x.ndim)
    return tuple(range(first, last + 1)), last


def _param_grads(dy, xhat, axes, weight, bias, exact):
    """sum of dy * xhat and of dy over every axis but the parameter's own:
    the normalized ones, and for per-head parameters the trailing axes
    before them that the parameter spans too."""
    def summed(a, p):
        spanned = range(axes[-1] + 1 - np.ndim(p), axes[-1] + 1)
        total = np.sum(a, axis=tuple(i for i in range(dy.ndim) if i not in spanned))
        return total if exact else total.astype(np.asarray(p).dtype)

    dw = None if weight is None else summed(dy * xhat, weight)
    db = None if bias is None else summed(dy, bias)
    return dw, db


def rms_norm_backward(dy, x, rstd, weight=None, *, axis=-1, dh=None, exact=False):
    """(dx, dweight) of rms_norm: ``dx = rstd * (g - xhat * mean(g * xhat))``
    with ``xhat = x * rstd``, ``g = dy * weight``; ``dweight = sum(dy * xhat)``."""
    x = np.asarray(x)
    axes, last = _row_axes(x, axis)
    n = int(np.prod([x.shape[a] for a in axes]))
    xf, dyf = x.astype(np.float64), np.asarray(dy).astype(np.float64)
    r = np.expand_dims(np.asarray(rstd).astype(np.float64), axes)
    tail = (1,) * (x.ndim - 1 - last)
    w = 1.0 if weight is None else np.asarray(weight).astype(np.float64).reshape(np.shape(weight) + tail)
    xhat = xf * r
    g = dyf * w
    dx = r * (g - xhat * np.sum(g * xhat, axis=axes, keepdims=True) / n)
    if dh is not None:
        dx = dx + np.asarray(dh).astype(np.float64)
    dw, _ = _param_grads(dyf, xhat, axes, weight, None, exact)
    return (dx if exact else dx.astype(x.dtype)), dw


def rms_norm_gated_backward(dy, x, rstd, weight=None, *, gate, norm_before_gate=True, axis=-1, exact=False):
    """(dx, dweight, dgate) of the gated rms_norm, with ``s = silu(z)`` and
    ``s' = sigmoid(z) * (1 + z * (1 - sigmoid(z)))``: norm_before_gate (y
    = xhat * w * s): rms_norm_backward of ``dy * s``, ``dz = dy * xhat * w
    * s'``; else (y = norm(u) * w, u = x * s): ``du`` rms_norm_backward's
    of u, ``dx = du * s``, ``dz = du * x * s'``. rstd: the forward's (of u
    for the gate before the norm)."""
    x = np.asarray(x)
    axes, last = _row_axes(x, axis)
    xf, dyf, zf = x.astype(np.float64), np.asarray(dy).astype(np.float64), np.asarray(gate).astype(np.float64)
    with np.errstate(over="ignore"):
        sigmoid = 1.0 / (1.0 + np.exp(-zf))
    s, slope = zf * sigmoid, sigmoid * (1.0 + zf * (1.0 - sigmoid))
    tail = (1,) * (x.ndim - 1 - last)
    w = 1.0 if weight is None else np.asarray(weight).astype(np.float64).reshape(np.shape(weight) + tail)
    r = np.expand_dims(np.asarray(rstd).astype(np.float64), axes)
    if norm_before_gate:
        dx, dw = rms_norm_backward(dyf * s, xf, rstd, weight, axis=axis, exact=True)
        dz = dyf * xf * r * w * slope
    else:
        du, dw = rms_norm_backward(dyf, xf * s, rstd, weight, axis=axis, exact=True)
        dx, dz = du * s, du * xf * slope
    if exact:
        return dx, dw, dz
    return dx.astype(x.dtype), None if dw is None else dw.astype(np.asarray(weight).dtype), dz.astype(x.dtype)


def layer_norm_backward(dy, x, mean, rstd, weight=None, bias=None, *, axis=-1, dh=None, exact=False):
    """(dx, dweight, dbias) of layer_norm: ``dx = rstd * (g - mean(g) - xhat *
    mean(g * xhat))`` with ``xhat = (x - mean) * rstd``, ``g = dy * weight``."""
    x = np.asarray(x)
    axes, last = _row_axes(x, axis)
    n = int(np.prod([x.shape[a] for a in axes]))
    xf, dyf = x.astype(np.float64), np.asarray(dy).astype(np.float64)
    mu = np.expand_dims(np.asarray(mean).astype(np.float64), axes)
    r = np.expand_dims(np.asarray(rstd).astype(np.float64), axes)
    tail = (1,) * (x.ndim - 1 - last)
    w = 1.0 if weight is None else np.asarray(weight).astype(np.float64).reshape(np.shape(weight) + tail)
    xhat = (xf - mu) * r
    g = dyf * w
    dx = r * (g - np.sum(g, axis=axes, keepdims=True) / n - xhat * np.sum(g * xhat, axis=axes, keepdims=True) / n)
    if dh is not None:
        dx = dx + np.asarray(dh).astype(np.float64)
    dw, db = _param_grads(dyf, xhat, axes, weight, bias, exact)
    return (dx if exact else dx.astype(x.dtype)), dw, db


def normalize_backward(dy, x, p=2.0, *, axis=-1, eps=1e-12, mean=False, exact=False):
    """dx of normalize (``mean=True``: of mean_abs_normalize), the norm
    recomputed from x: ``dx = dy / N - sum(dy * x) / N**2 * dN/dx`` where
    the norm N >= eps, ``dy / eps`` where the clamp holds. For p = inf,
    dN/dx is sign(x) shared evenly by the elements of largest magnitude."""
    x = np.asarray(x)
    p = float(p)
    axes, _ = _row_axes(x, axis)
    n = int(np.prod([x.shape[a] for a in axes]))
    xf, dyf = x.astype(np.float64), np.asarray(dy).astype(np.float64)
    a = np.abs(xf)
    sign = np.sign(xf)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if p == np.inf:
            norm = np.max(a, axis=axes, keepdims=True)
            at_max = a == norm
            dnorm = sign * at_max / np.sum(at_max, axis=axes, keepdims=True)
        elif p == 2.0:
            norm = np.sqrt(np.sum(xf * xf, axis=axes, keepdims=True))
            dnorm = xf / norm
        elif p == 1.0:
            norm = np.sum(a, axis=axes, keepdims=True) / (n if mean else 1)
            dnorm = sign / (n if mean else 1)
        else:
            norm = np.sum(a**p, axis=axes, keepdims=True) ** (1.0 / p)
            dnorm = sign * (a / norm) ** (p - 1)
        clamped = ~(norm >= eps)
        denom = np.maximum(norm, eps)
        through = np.where(clamped, 0.0, np.sum(dyf * xf, axis=axes, keepdims=True) / denom**2)
        dx = dyf / denom - through * np.where(clamped, 0.0, dnorm)
        dx = np.where(np.isfinite(norm), dx, np.nan)
    return dx if exact else dx.astype(x.dtype)


def _channel_backward(dy, x, mean, rstd, num_groups, per_sample, weight, bias, channel_axis, training, exact):
    """(dx, dweight, dbias) of a channel norm from its statistics, broadcast
    as (N or 1, G, 1, 1) over x viewed as (N, G, C // G, S)."""
    x = np.asarray(x)
    xf, back = _channels_first(x, channel_axis)
    dyf, _ = _channels_first(np.asarray(dy), channel_axis)
    n, c, s = xf.shape
    g = num_groups
    shape = (n if per_sample else 1, g, 1, 1)
    mu = np.asarray(mean).astype(np.float64).reshape(shape)
    r = np.asarray(rstd).astype(np.float64).reshape(shape)
    xg, dyg = xf.reshape(n, g, c // g, s), dyf.reshape(n, g, c // g, s)
    w = 1.0 if weight is None else np.asarray(weight).astype(np.float64).reshape(1, g, c // g, 1)
    xhat = (xg - mu) * r
    grad = dyg * w
    if training:
        axes = (2, 3) if per_sample else (0, 2, 3)
        count = (c // g) * s * (1 if per_sample else n)
        dx = r * (grad - np.sum(grad, axis=axes, keepdims=True) / count
                  - xhat * np.sum(grad * xhat, axis=axes, keepdims=True) / count)
    else:
        dx = r * grad
    dx = back(dx)
    dw = db = None
    if weight is not None:
        dw = np.sum(dyg * xhat, axis=(0, 3)).reshape(c)
        dw = dw if exact else dw.astype(np.asarray(weight).dtype)
    if bias is not None:
        db = np.sum(dyg, axis=(0, 3)).reshape(c)
        db = db if exact else db.astype(np.asarray(bias).dtype)
    return (dx if exact else dx.astype(x.dtype)), dw, db


def group_norm_backward(dy, x, mean, rstd, num_groups, weight=None, bias=None, *, channel_axis=1, exact=False):
    """(dx, dweight, dbias) of group_norm from its (N, num_groups) mean and rstd."""
    return _channel_backward(dy, x, mean, rstd, num_groups, True, weight, bias, channel_axis, True, exact)


def instance_norm_backward(dy, x, mean, rstd, weight=None, bias=None, *, channel_axis=1, exact=False):
    """(dx, dweight, dbias) of instance_norm from its (N, C) mean and rstd."""
    x = np.asarray(x)
    c = x.shape[channel_axis % x.ndim]
    return _channel_backward(dy, x, mean, rstd, c, True, weight, bias, channel_axis, True, exact)


def batch_norm_backward(dy, x, mean, rstd, weight=None, bias=None, *, training=True, eps=1e-5, channel_axis=1,
                        exact=False):
    """(dx, dweight, dbias) of batch_norm. Training: from the batch's (C,)
    mean and rstd. Eval (``training=False``): mean and rstd are the running
    mean and variance (rstd = 1 / sqrt(running_var + eps)) and dx is
    elementwise."""
    x = np.asarray(x)
    c = x.shape[channel_axis % x.ndim]
    if not training:
        rstd = 1.0 / np.sqrt(np.asarray(rstd).astype(np.float64) + eps)
    return _channel_backward(dy, x, mean, rstd, c, False, weight, bias, channel_axis, training, exact)
