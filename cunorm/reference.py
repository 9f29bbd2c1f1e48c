"""The float64 NumPy reference: the slow, exact definition every kernel is
tested against, and what cunorm's public functions compute for NumPy input.

Each function computes in float64 and returns x's dtype (``exact=True``
returns the unrounded float64 result, which is what the tests compare to).
"""
from __future__ import annotations

import numpy as np


def _as_f64(a):
    return np.asarray(a).astype(np.float64)


def _weight_view(weight, ndim: int, last: int):
    """Weight shaped like the normalized axes, broadcast against x."""
    w = _as_f64(weight)
    return w.reshape(w.shape + (1,) * (ndim - 1 - last))


def rms_norm(x, weight=None, *, axis=-1, eps=1e-5, exact=False):
    """``x * rsqrt(mean(x**2 over axis) + eps) [* weight]`` in float64.

    A group holding Inf or NaN (or whose sum of squares overflows) comes out
    all NaN, as the kernels define it.
    """
    from ._plan import normalize_axes

    x = np.asarray(x)
    first, last = normalize_axes(axis, x.ndim)
    axes = tuple(range(first, last + 1))
    xf = _as_f64(x)
    with np.errstate(over="ignore", invalid="ignore"):
        sum_sq = np.sum(xf * xf, axis=axes, keepdims=True)
        n = int(np.prod([x.shape[a] for a in axes]))
        scale = 1.0 / np.sqrt(sum_sq / n + eps)
        scale = np.where(np.isfinite(sum_sq), scale, np.nan)
        y = xf * scale
        if weight is not None:
            y = y * _weight_view(weight, x.ndim, last)
    return y if exact else y.astype(x.dtype)
