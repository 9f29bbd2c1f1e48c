"""The backward passes of the ops, at the array level.

Each takes dy (the gradient of the forward's output y) and what the forward
had or returned: x (for the residual forms, the returned h = x + residual),
the axes or channel layout, the weight (and bias), and the statistics the
forward returned with ``return_stats=True`` (the Lp norms recompute their
norm from x instead). They return dx and the parameters' gradients.

Array kinds are the forward's: CuPy, CUDA torch tensors (zero-copy, on
torch's current stream), GPU JAX arrays and other DLPack arrays run the
kernels; NumPy arrays run the float64 reference. Statistics are float32
(float64 for float64 x), as the forward returns them.

dweight and dbias sum over every row (every sample and position): each block
of the kernels keeps float32 sums of its own rows and a second pass adds
those partials in a fixed order, so gradients are bitwise identical run to
run. They come back in the weight's (bias') dtype.

To train through cunorm with torch, use ``cunorm.torch``: its functions
and layers are differentiable (these functions are their backward).
"""
from __future__ import annotations

from ._engine import calls
from ._engine.ops import DEFAULT_EPS, LP_EPS
from ._engine.row_norms import lp_norm_name

__all__ = ["rms_norm_backward", "layer_norm_backward", "rms_norm_gated_backward", "rms_norm_modulated_backward",
           "layer_norm_modulated_backward", "rms_norm_float32_residual_backward",
           "layer_norm_float32_residual_backward", "normalize_backward", "mean_abs_normalize_backward",
           "frobenius_normalize_backward", "group_norm_backward", "instance_norm_backward", "batch_norm_backward"]

_DY_X = """dy : array
        The gradient of y: x's shape and dtype.
    x : array
        The forward's input; for the residual form, the h it returned."""

_ERRORS = """Raises
    ------
    TypeError
        dy, dh or a statistic of another array kind or dtype than the
        forward's (statistics: float32, or float64 for float64 x), a missing
        statistic; the forward's TypeErrors for x and the parameters.
    ValueError
        dy or dh not of x's shape, a statistic not of the forward's
        statistics shape; the forward's ValueErrors (axes, parameter shapes,
        eps, groups, channel axis)."""


def rms_norm_backward(dy, x, rstd, weight=None, *, axis=-1, dh=None):
    """The gradients of :func:`cunorm.rms_norm`.

    ``dx = rstd * (g - xhat * mean(g * xhat))`` with ``xhat = x * rstd`` and
    ``g = dy * weight``; ``dweight = sum(dy * xhat)`` over every row.

    Parameters
    ----------
    {dy_x}
    rstd : array
        The forward's ``rstd`` (``return_stats=True``).
    weight : array, optional
        The forward's weight.
    axis : int or tuple of int, default -1
        The forward's axes.
    dh : array, optional
        The residual form: the gradient that reached the returned h, added
        to dx (which is then the gradient of both x and residual).

    Returns
    -------
    (dx, dweight)
        dx of x's shape and dtype (C-contiguous); dweight of the weight's
        shape and dtype, None without a weight.

    {errors}
    """
    return calls.rows_grad("rms", dy, x, None, rstd, weight, None, dh, axis, 0.0)


def layer_norm_backward(dy, x, mean, rstd, weight=None, bias=None, *, axis=-1, dh=None):
    """The gradients of :func:`cunorm.layer_norm`.

    ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` with ``xhat = (x -
    mean) * rstd`` and ``g = dy * weight``; ``dweight = sum(dy * xhat)``,
    ``dbias = sum(dy)`` over every row.

    Parameters
    ----------
    {dy_x}
    mean, rstd : array
        The forward's statistics (``return_stats=True``).
    weight, bias : array, optional
        The forward's parameters (the bias only says that dbias is wanted).
    axis : int or tuple of int, default -1
        The forward's axes.
    dh : array, optional
        The residual form: the gradient that reached the returned h.

    Returns
    -------
    (dx, dweight, dbias)
        dx of x's shape and dtype; dweight and dbias of the parameters'
        shapes and dtypes, None for a parameter the forward did not have.

    {errors}
    """
    return calls.rows_grad("ln", dy, x, mean, rstd, weight, bias, dh, axis, 0.0)


def rms_norm_gated_backward(dy, x, rstd, weight=None, *, gate, norm_before_gate=True, axis=-1):
    """The gradients of the gated :func:`cunorm.rms_norm` (``gate=``), fused
    (cunorm/kernels/backward.cu's rows_grad_gated).

    With ``s = silu(z)`` and ``s' = sigmoid(z) * (1 + z * (1 - sigmoid(z)))``:
    ``norm_before_gate=True`` (``y = xhat * weight * s``): dx and dweight
    are :func:`rms_norm_backward`'s of ``dy * s``, and ``dgate = dy * xhat *
    weight * s'``; ``norm_before_gate=False`` (``y = norm(u) * weight``, ``u
    = x * s``): ``du`` is rms_norm_backward's of u, ``dx = du * s``,
    ``dgate = du * x * s'``, ``dweight = sum(dy * u * rstd)``. Computed in
    float32 (float64 for float64 x); the forward's roundings pass the
    gradient unchanged, as autograd's casts do.

    Parameters
    ----------
    dy : array
        The gradient of y: x's shape and dtype.
    x : array
        The forward's input.
    rstd : array
        The forward's ``rstd`` (``return_stats=True``; of x * silu(z) where
        the gate comes first).
    weight : array, optional
        The forward's weight, over the normalized axes. With the weight
        offset, pass ``1 + weight``.
    gate : array
        The forward's gate z: x's shape and dtype.
    norm_before_gate : bool, default True
        The forward's.
    axis : int or tuple of int, default -1
        The forward's axes: trailing ones. For ``group_size``, pass the
        arrays split into groups (a weight a group is per-head: not taken).

    Returns
    -------
    grads : tuple
        A named tuple (``GatedGrads``: x, weight, gate) of gradients in the
        inputs' shapes and dtypes (weight None without one).

    Raises
    ------
    TypeError
        As :func:`rms_norm_backward`, for gate as for dy;
        norm_before_gate not a bool.
    ValueError
        As :func:`rms_norm_backward`; axes that are not trailing; rows of
        over 16384 16-bit, 8192 32-bit or 4096 64-bit elements on the GPU
        (fewer where the row length leaves narrower vectors).
    """
    return calls.rows_grad_gated(dy, x, rstd, weight, gate, norm_before_gate, axis)


_MODULATED = """The forward: ``h = residual + residual_gate * x`` (or ``x +
    residual``, or x), ``y = (norm(h) * weight [+ bias]) * (1 + scale) +
    shift``. The backward, with ``g = dy * (1 + scale)``: the norm's
    gradient of g reaches h (plus dh), the residual takes it and x takes it
    times residual_gate; ``dshift``, ``dscale = sum(dy * (xhat * weight +
    bias))`` and ``dresidual_gate = sum(dh_total * x)`` are summed over
    the axes each array broadcasts along, ``dweight`` and ``dbias`` over
    every row. Per-modulation-row sums are added in a fixed order that
    depends on the rows each modulation row covers and the GPU, not on the
    batch; no atomics.

    Parameters
    ----------
    dy : array
        The gradient of y: x's shape and dtype.
    h : array
        The normalized input: the h the forward returned with a residual,
        else x.
    {stats}
    shift, scale, residual_gate : array, optional
        The forward's modulation arrays (at least one).
    x : array, optional
        With residual_gate: the x it scaled.
    axis : int or tuple of int, default -1
        The forward's axes (trailing).
    dh : array, optional
        The gradient that reached the returned h.

    Returns
    -------
    grads : tuple
        A named tuple (``ModulatedGrads``: x, residual, weight, bias,
        shift, scale, residual_gate) of gradients in the inputs' shapes and dtypes, None
        where the forward had no such input; ``residual`` is None without
        a residual gate (the residual's gradient is then x's).

    Raises
    ------
    TypeError, ValueError
        As the forward's, for the arrays and their shapes; ValueError for
        a call the fused kernels do not take on the GPU: modulation arrays
        of different broadcast patterns, runs of under 16 rows of one
        modulation row (per token, or under 16 rows in all), per-head weights, rows of over 8192
        elements (4096 for float64; with residual_gate 4096 float32,
        2048 float64). cunorm.torch's autograd composes
        those from torch's ops."""


def rms_norm_modulated_backward(dy, h, rstd, weight=None, *, shift=None, scale=None, residual_gate=None, x=None,
                                axis=-1, dh=None):
    """The gradients of :func:`cunorm.rms_norm` with ``shift=``, ``scale=``
    or ``residual_gate=``, fused (cunorm/kernels/modulated_grads.cu).

    {body}
    """
    return calls.rows_grad_modulated("rms", dy, h, None, rstd, weight, None, dh, shift, scale, residual_gate, x, axis)


def layer_norm_modulated_backward(dy, h, mean, rstd, weight=None, bias=None, *, shift=None, scale=None,
                                  residual_gate=None, x=None, axis=-1, dh=None):
    """The gradients of :func:`cunorm.layer_norm` with ``shift=``,
    ``scale=`` or ``residual_gate=``, fused (cunorm/kernels/modulated_grads.cu).

    {body}
    """
    return calls.rows_grad_modulated("ln", dy, h, mean, rstd, weight, bias, dh, shift, scale, residual_gate, x, axis)


_FLOAT32_RESIDUAL = """The forward took 16-bit x and a float32 residual:
    ``h = float32(x) + residual`` in float32, returned as float32 and
    normalized, y rounded once to x's dtype. The backward forms the gradient
    of h, the norm's of dy plus dh, in float32, and returns it twice: as x's
    gradient rounded once to x's dtype and as the residual's in float32,
    from one pass (cunorm/kernels/backward.cu's rows_grad_wide) that reads
    dy, h and dh once. dweight and dbias as :func:`{plain}`.

    Parameters
    ----------
    dy : array
        The gradient of y: h's shape, x's dtype (float16 or bfloat16).
    h : array
        The float32 h the forward returned.
    {stats}
    axis : int or tuple of int, default -1
        The forward's axes: trailing ones.
    dh : array, optional
        The float32 gradient that reached the returned h.

    Returns
    -------
    grads : tuple
        A named tuple (``WideResidualGrads``: x, residual, weight, bias):
        x's gradient in dy's dtype, the residual's in float32 (the same
        values before the rounding), weight and bias in their shapes and
        dtypes (None where the forward had none).

    Raises
    ------
    TypeError
        h not float32, dy not 16-bit, dh not float32; as :func:`{plain}`
        otherwise.
    ValueError
        Axes that are not trailing, rows of over 8192 elements on the GPU;
        as :func:`{plain}` otherwise."""


def rms_norm_float32_residual_backward(dy, h, rstd, weight=None, *, axis=-1, dh=None):
    """The gradients of :func:`cunorm.rms_norm` with 16-bit x and a float32
    ``residual=``, fused.

    {body}
    """
    return calls.rows_grad_wide("rms", dy, h, None, rstd, weight, None, dh, axis)


def layer_norm_float32_residual_backward(dy, h, mean, rstd, weight=None, bias=None, *, axis=-1, dh=None):
    """The gradients of :func:`cunorm.layer_norm` with 16-bit x and a
    float32 ``residual=``, fused.

    {body}
    """
    return calls.rows_grad_wide("ln", dy, h, mean, rstd, weight, bias, dh, axis)


def normalize_backward(dy, x, p=2.0, *, axis=-1, eps=LP_EPS):
    """The gradient of :func:`cunorm.normalize`, the norm recomputed from x.

    ``dx = dy / N - sum(dy * x) / N**2 * dN/dx`` where the norm ``N >= eps``,
    ``dy / eps`` where the clamp holds (as torch's ``F.normalize``). For
    p = inf the norm's gradient goes to the elements of largest magnitude,
    shared evenly between ties; for p < 1 it is infinite at zeros.

    Parameters
    ----------
    dy : array
        The gradient of y: x's shape and dtype.
    x : array
        The forward's input.
    p, axis, eps
        The forward's.

    Returns
    -------
    dx
        x's shape and dtype.

    {errors}
    """
    return calls.rows_grad(lp_norm_name(p), dy, x, None, None, None, None, None, axis, eps)


def mean_abs_normalize_backward(dy, x, *, axis=-1, eps=LP_EPS):
    """The gradient of :func:`cunorm.mean_abs_normalize` (as
    :func:`normalize_backward`, with ``dN/dx = sign(x) / n``)."""
    return calls.rows_grad("mean_abs", dy, x, None, None, None, None, None, axis, eps)


def frobenius_normalize_backward(dy, x, *, axis=None, eps=LP_EPS):
    """The gradient of :func:`cunorm.frobenius_normalize`: ``normalize_backward``
    with p = 2 over every axis by default."""
    return calls.rows_grad("l2", dy, x, None, None, None, None, None, axis, eps)


def group_norm_backward(dy, x, mean, rstd, num_groups, weight=None, bias=None, *, channel_axis=1):
    """The gradients of :func:`cunorm.group_norm`, from its (N, num_groups)
    mean and rstd (``return_stats=True``).

    With ``xhat = (x - mean) * rstd`` and ``g = dy * weight[c]``, over each
    (sample, group): ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))``;
    ``dweight[c] = sum(dy * xhat)``, ``dbias[c] = sum(dy)`` over samples and
    positions.

    Parameters
    ----------
    dy : array
        The gradient of y: x's shape and dtype, any layout (copied to x's
        when it differs).
    x, num_groups, weight, bias, channel_axis
        The forward's (the bias only says that dbias is wanted).
    mean, rstd : array
        The forward's statistics.

    Returns
    -------
    (dx, dweight, dbias)
        dx with x's memory layout (channels-first or channels-last; C order
        if x is neither); dweight and dbias (C,) in the parameters' dtypes,
        None for a parameter the forward did not have.

    {errors}
    """
    return calls.channel_grad("group", dy, x, mean, rstd, num_groups, weight, bias, channel_axis, True, DEFAULT_EPS)


def instance_norm_backward(dy, x, mean, rstd, weight=None, bias=None, *, channel_axis=1):
    """The gradients of :func:`cunorm.instance_norm`, from its (N, C) mean
    and rstd: :func:`group_norm_backward` with a group per channel."""
    return calls.channel_grad("instance", dy, x, mean, rstd, None, weight, bias, channel_axis, True, DEFAULT_EPS)


def batch_norm_backward(dy, x, mean, rstd, weight=None, bias=None, *, training=True, eps=DEFAULT_EPS,
                        channel_axis=1):
    """The gradients of :func:`cunorm.batch_norm`.

    Training (``training=True``): mean and rstd are the (C,) batch
    statistics the forward returned (``return_stats=True``), and dx couples
    every element of a channel as in :func:`group_norm_backward`. Eval
    (``training=False``): pass the running mean and running variance as
    ``mean`` and ``rstd`` (and the forward's eps); the statistics are
    constants and ``dx = dy * weight / sqrt(running_var + eps)``.

    Returns
    -------
    (dx, dweight, dbias)
        As for :func:`group_norm_backward`.

    {errors}
    """
    return calls.channel_grad("batch", dy, x, mean, rstd, None, weight, bias, channel_axis, training, eps)


for _f in (rms_norm_backward, layer_norm_backward, normalize_backward, group_norm_backward, instance_norm_backward,
           batch_norm_backward):
    _f.__doc__ = _f.__doc__.replace("{errors}", _ERRORS).replace("{dy_x}", _DY_X)
for _f, _stats in ((rms_norm_modulated_backward, """rstd : array
        The forward's ``rstd`` (``return_stats=True``).
    weight : array, optional
        The forward's weight."""), (layer_norm_modulated_backward, """mean, rstd : array
        The forward's statistics (``return_stats=True``).
    weight, bias : array, optional
        The forward's parameters.""")):
    _f.__doc__ = _f.__doc__.replace("{body}", _MODULATED.replace("{stats}", _stats))
for _f, _plain, _stats in (
        (rms_norm_float32_residual_backward, "rms_norm_backward", """rstd : array
        The forward's ``rstd`` (``return_stats=True``; float32).
    weight : array, optional
        The forward's weight (over the normalized axes, or per head)."""),
        (layer_norm_float32_residual_backward, "layer_norm_backward", """mean, rstd : array
        The forward's statistics (``return_stats=True``; float32).
    weight, bias : array, optional
        The forward's parameters (over the normalized axes, or per head).""")):
    _f.__doc__ = _f.__doc__.replace("{body}", _FLOAT32_RESIDUAL.replace("{stats}", _stats).replace("{plain}", _plain))
del _f, _stats, _plain
