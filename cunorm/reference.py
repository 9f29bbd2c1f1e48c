"""The float64 NumPy reference: the slow, exact definition every kernel is
tested against, and what cunorm's public functions compute for NumPy input.

Each function computes in float64 and returns x's dtype (``exact=True``
returns the unrounded float64 results, which is what the tests compare to).
A group whose statistic is not finite (an Inf or NaN in it) comes out all
NaN, as the kernels define it.
"""
from __future__ import annotations

import numpy as np


def rms_norm(x, weight=None, *, axis=-1, eps=1e-5, residual=None, return_stats=False, exact=False):
    """``h * rsqrt(mean(h**2 over axis) + eps) [* weight]`` with h = x
    (+ residual). Returns y, then h if residual is given, then rstd if
    return_stats."""
    return _normalize("rms", x, weight, None, axis, eps, residual, return_stats, exact)


def layer_norm(x, weight=None, bias=None, *, axis=-1, eps=1e-5, residual=None, return_stats=False, exact=False):
    """``(h - mean) * rsqrt(var + eps) [* weight] [+ bias]`` over axis, var
    biased, with h = x (+ residual). Returns y, then h if residual is given,
    then mean and rstd if return_stats."""
    return _normalize("ln", x, weight, bias, axis, eps, residual, return_stats, exact)


def _normalize(kind, x, weight, bias, axis, eps, residual, return_stats, exact):
    from ._dtypes import accumulation
    from ._plan import normalize_axes

    x = np.asarray(x)
    first, last = normalize_axes(axis, x.ndim)
    axes = tuple(range(first, last + 1))
    if residual is not None:
        # h is rounded to x's dtype, and the norm sees exactly that h.
        h = (x.astype(np.float64) + np.asarray(residual).astype(np.float64)).astype(x.dtype)
    else:
        h = x
    hf = h.astype(np.float64)
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
        tail = (1,) * (x.ndim - 1 - last)
        if weight is not None:
            w = np.asarray(weight).astype(np.float64)
            y = y * w.reshape(w.shape + tail)
        if bias is not None:
            b = np.asarray(bias).astype(np.float64)
            y = y + b.reshape(b.shape + tail)
    results = [y if exact else y.astype(x.dtype)]
    if residual is not None:
        results.append(h)
    if return_stats:
        stats_dtype = np.float64 if exact else accumulation(x.dtype)
        if kind == "ln":
            results.append(np.squeeze(center, axis=axes).astype(stats_dtype))
        results.append(np.squeeze(scale, axis=axes).astype(stats_dtype))
    return results[0] if len(results) == 1 else tuple(results)
