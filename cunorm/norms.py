"""The public normalization ops."""
from __future__ import annotations

from . import _ops, reference

DEFAULT_EPS = 1e-5

def rms_norm(x, weight=None, *, axis=-1, eps=DEFAULT_EPS, residual=None, return_stats=False, out=None):
    """Root-mean-square normalization.

    ``y = h * rsqrt(mean(h**2 over axis) + eps) [* weight]`` where h is x, or
    ``x + residual`` (the fused pre-norm residual add). Statistics in float32
    (float64 for float64 x); y rounded once to x's dtype.

    Parameters
    ----------
    x : array
        A CuPy array, a CUDA torch tensor, a GPU JAX array, or any CUDA array
        that supports DLPack (zero-copy), of dtype float16, bfloat16, float32
        or float64, any shape and any strides. A NumPy array runs the float64
        NumPy reference instead (slow; for checking).
    weight : array, optional
        Shaped like the normalized axes (``x.shape[axis]``, or the tuple of
        the adjacent axes' sizes). Any of the four float dtypes; float32 with
        16-bit x is read as float32; other mixes are cast to float32 first.
    axis : int or tuple of int, default -1
        The axis, or several adjacent axes, to normalize over. ``axis=1`` of
        an NCHW array normalizes across channels at every (n, h, w).
    eps : float, default 1e-5
        Added to the mean square inside the square root; finite and >= 0.
        (torch.nn.RMSNorm's default is the dtype's machine epsilon instead.)
    residual : array, optional
        Of x's shape and dtype. ``h = x + residual`` is formed (rounded to x's
        dtype), normalized and returned, in one pass over memory.
    return_stats : bool, default False
        Also return the per-group ``rstd = rsqrt(mean(h**2) + eps)``, of
        shape x.shape without the normalized axes, float32 (float64 for
        float64 x).
    out : array, optional
        Where to write y: same kind, shape and dtype as x, C-contiguous. It
        may be x itself (in place); it may not otherwise overlap x or the
        residual.

    Returns
    -------
    y, or a tuple ``(y[, h][, rstd])``
        As the caller's array type (torch for torch input, JAX for JAX, CuPy
        for CuPy and other DLPack input, NumPy for NumPy), C-contiguous; y is
        ``out`` if given.

    Raises
    ------
    TypeError
        x, weight, residual or out is not an accepted array kind, a CPU
        tensor, or of a dtype other than the four floats; residual of another
        dtype than x; an array on the other side (NumPy vs GPU) from x.
    ValueError
        a bad axis (out of range, repeated, not adjacent), zero-length
        normalized axes, weight or residual of the wrong shape, eps negative
        or not finite, out of the wrong shape/dtype/layout or overlapping,
        arrays on different GPUs.

    Notes
    -----
    A group (the elements normalized together) holding Inf or NaN comes out
    all NaN; so does a group whose float32 sum of squares overflows
    (|x| beyond about 1e19). Other groups are unaffected.
    """
    call = _ops.Call("rms", x, axis, eps, out, weight=weight, residual=residual, return_stats=return_stats)
    return _ops.run(call, reference.rms_norm)


def layer_norm(x, weight=None, bias=None, *, axis=-1, eps=DEFAULT_EPS, residual=None, return_stats=False,
               out=None):
    """Layer normalization.

    ``y = (h - mean) * rsqrt(var + eps) [* weight] [+ bias]`` over the
    normalized axes, var biased (as torch.nn.LayerNorm), where h is x, or
    ``x + residual`` (the fused pre-norm residual add). Statistics in float32
    (float64 for float64 x), combined pairwise (Chan et al.), never as
    E[x^2] - E[x]^2; y rounded once to x's dtype.

    Parameters
    ----------
    x : array
        A CuPy array, a CUDA torch tensor, a GPU JAX array, or any CUDA array
        that supports DLPack (zero-copy), of dtype float16, bfloat16, float32
        or float64, any shape and any strides. A NumPy array runs the float64
        NumPy reference instead (slow; for checking).
    weight, bias : array, optional
        Each shaped like the normalized axes (for axis=(1, 2, 3) of
        (16, 64, 256, 256): (64, 256, 256)). Any of the four float dtypes;
        in x's dtype or float32 (float64 for float64 x) they are read as they
        are, other mixes are cast to float32 first.
    axis : int or tuple of int, default -1
        The axis, or several adjacent axes (typically the trailing ones), to
        normalize over.
    eps : float, default 1e-5
        Added to the variance inside the square root; finite and >= 0.
    residual : array, optional
        Of x's shape and dtype. ``h = x + residual`` is formed (rounded to x's
        dtype), normalized and returned, in one pass over memory.
    return_stats : bool, default False
        Also return the per-group ``mean`` and ``rstd = rsqrt(var + eps)``, of
        shape x.shape without the normalized axes, float32 (float64 for
        float64 x): what a backward pass needs.
    out : array, optional
        Where to write y: same kind, shape and dtype as x, C-contiguous; may
        be x itself (in place), may not otherwise overlap x or the residual.

    Returns
    -------
    y, or a tuple ``(y[, h][, mean, rstd])``
        As the caller's array type, C-contiguous; y is ``out`` if given.

    Raises
    ------
    TypeError
        as for :func:`rms_norm` (wrong array kind or dtype, residual dtype).
    ValueError
        as for :func:`rms_norm`, and for a bias of the wrong shape.

    Notes
    -----
    A group holding Inf or NaN comes out all NaN; other groups are
    unaffected.
    """
    call = _ops.Call("ln", x, axis, eps, out, weight=weight, bias=bias, residual=residual,
                     return_stats=return_stats)
    return _ops.run(call, reference.layer_norm)
