"""The public normalization ops."""
from __future__ import annotations

from . import _ops, reference

DEFAULT_EPS = 1e-5


def rms_norm(x, weight=None, *, axis=-1, eps=DEFAULT_EPS, out=None):
    """Root-mean-square normalization.

    ``y = x * rsqrt(mean(x**2 over axis) + eps) [* weight]``, with the
    statistics in float32 (float64 for float64 x) and y rounded once to x's
    dtype.

    Parameters
    ----------
    x : array
        A CuPy array, a CUDA torch tensor, a GPU JAX array, or any CUDA array
        that supports DLPack (zero-copy), of dtype float16, bfloat16, float32
        or float64, any shape and any strides. A NumPy array runs the float64
        NumPy reference instead (slow; for checking).
    weight : array, optional
        Shaped like the normalized axes, ``x.shape[axis]`` (or the product
        of the adjacent axes' shapes, as a tuple of them). Any of the four
        float dtypes; float32 with 16-bit x is read as float32.
    axis : int or tuple of int, default -1
        The axis, or several adjacent axes, to normalize over. ``axis=1`` of
        an NCHW array normalizes across channels at every (n, h, w).
    eps : float, default 1e-5
        Added to the mean square inside the square root; finite and >= 0.
        (torch.nn.RMSNorm's default is the dtype's machine epsilon instead.)
    out : array, optional
        Where to write y: same kind, shape and dtype as x, C-contiguous. It
        may be x itself (in place); it may not otherwise overlap x.

    Returns
    -------
    array
        y, of x's shape and dtype, as the caller's array type (a torch tensor
        for torch input, a JAX array for JAX input, CuPy for CuPy and other
        DLPack input, NumPy for NumPy), C-contiguous; ``out`` if given.

    Raises
    ------
    TypeError
        x, weight or out is not an accepted array kind, a CPU tensor, or of
        a dtype other than the four floats; weight/out on the other side
        (NumPy vs GPU) from x.
    ValueError
        a bad axis (out of range, repeated, not adjacent), zero-length
        normalized axes, weight of the wrong shape, eps negative or not
        finite, out of the wrong shape/dtype/layout, arrays on different GPUs.

    Notes
    -----
    A group (the elements normalized together) holding Inf or NaN comes out
    all NaN; so does a group whose float32 sum of squares overflows
    (|x| beyond about 1e19). Other groups are unaffected.
    """
    call = _ops.Call(x, weight, axis, eps, out)
    return _ops.run("rms", call, reference.rms_norm)
