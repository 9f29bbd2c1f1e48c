"""The public normalization ops."""
from __future__ import annotations

import functools

from ._engine import calls, conditioning, plans, row_norms
from . import reference
from ._engine.ops import DEFAULT_EPS, LP_EPS  # the defaults, in the table of ops

# The description of x, shared by the docstrings (filled in at the end).
_ROW_X = """x : array
        A CuPy array, a CUDA torch tensor, a GPU JAX array, or any CUDA array
        that supports DLPack (zero-copy), of dtype float16, bfloat16, float32
        or float64, any shape and any strides. A NumPy array runs the float64
        NumPy reference instead (slow; for checking). torch tensors run on
        torch's current stream with outputs from torch's allocator; while
        autograd records (a tensor requires grad) or dynamo traces
        (torch.compile) the op runs as its registered torch operator
        (cunorm.torch), whose autograd formula is cunorm.backward."""


_cunorm_torch = None


def _torch():
    """cunorm.torch, imported on first need (it registers the torch
    operators). This module is the layer above the front ends: it routes a
    torch call that autograd or dynamo must see to cunorm.torch's function,
    which calls the engine itself, never this module."""
    global _cunorm_torch
    if _cunorm_torch is None:
        from . import torch as cunorm_torch

        _cunorm_torch = cunorm_torch
    return _cunorm_torch


def rms_norm(x, weight=None, *, axis=-1, eps=DEFAULT_EPS, residual=None, return_stats=False, weight_offset=0,
             rounding="output", activation=None, out=None, quantize=None, quant_scale=None, quant_scale_ub=None,
             quant_group=None, quant_scale_layout=None, return_unquantized=False, shift=None, scale=None,
             residual_gate=None, gate=None, norm_before_gate=True, group_size=None):
    """Root-mean-square normalization.

    ``y = h * rsqrt(mean(h**2 over axis) + eps) [* weight]`` where h is x, or
    ``x + residual`` (the fused pre-norm residual add). Statistics in float32
    (float64 for float64 x); y rounded once to x's dtype (``rounding`` moves
    the rounding where Hugging Face's Llama family rounds).

    Parameters
    ----------
    {x}
    weight : array, optional
        Shaped like the normalized axes (``x.shape[axis]``, or the tuple of
        the adjacent axes' sizes), or like more of x's trailing axes when
        the normalized axes are the last ones: a weight per head, (heads,
        head_dim) over x of (B, S, heads, head_dim) normalized over
        head_dim. Any of the four float dtypes; float32 with 16-bit x is
        read as float32; other mixes are cast to float32 first.
    axis : int or tuple of int, default -1
        The axis, or several adjacent axes, to normalize over. ``axis=1`` of
        an NCHW array normalizes across channels at every (n, h, w).
    eps : float, default 1e-5
        Added to the mean square inside the square root; finite and >= 0.
        (torch.nn.RMSNorm's default is the dtype's machine epsilon instead.)
    residual : array, optional
        Of x's shape and dtype. ``h = x + residual`` is formed (rounded to x's
        dtype), normalized and returned, in one pass over memory. A float32
        residual under 16-bit x is the float32 residual stream: h is formed
        and returned in float32 (never rounded to x's dtype), y is x's dtype;
        over the trailing axes, fused (rows of up to 16384 16-bit elements
        for rms_norm, 8192 for layer_norm; longer raise a ValueError).
    return_stats : bool, default False
        Also return the per-group ``rstd = rsqrt(mean(h**2) + eps)``, of
        shape x.shape without the normalized axes, float32 (float64 for
        float64 x).
    weight_offset : int, default 0
        0 or 1: 1 multiplies by ``1 + weight`` (formed in float32) instead
        of the weight, the Gemma family's RMSNorm.
    rounding : str, default "output"
        Where the result is rounded to x's dtype. "output": once, after the
        weight (torch.nn.RMSNorm, OLMo2). "normalized": ``h * rstd`` is
        rounded to x's dtype first and the weight multiplies that, the
        product rounded again: Hugging Face's Llama, Mistral, Qwen, Phi-3,
        DeepSeek-V3 and T5 RMSNorms (bitwise, to their rstd's last float32
        bit, when the weight has x's dtype).
    activation : str, optional
        None (the default), "relu", "silu", "gelu", "gelu_tanh" or
        "identity": applied to y in the same pass, in float32 with torch's formulas
        (``gelu``: the exact erf form; ``gelu_tanh``: torch's
        ``approximate="tanh"``), before the one rounding.
    out : array, optional
        Where to write y: same kind, shape and dtype as x, C-contiguous. It
        may be x itself (in place); it may not otherwise overlap x or the
        residual.
    {quantize}
    {conditioned}
    {gated}

    Returns
    -------
    y, or a tuple ``(y[, scales][, unquantized y][, h][, rstd])``
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
        a bad axis (out of range, repeated, not adjacent), weight or residual of the wrong shape, eps negative
        or not finite, out of the wrong shape/dtype/layout or overlapping,
        arrays on different GPUs.

    Notes
    -----
    A group (the elements normalized together) holding Inf or NaN comes out
    all NaN; so does a group whose float32 sum of squares overflows
    (``|x|`` beyond about 1e19). Other groups are unaffected.
    """
    if group_size is not None and (out is not None or quantize is not None or quant_scale is not None
                                   or quant_scale_ub is not None or quant_group is not None
                                   or quant_scale_layout is not None or return_unquantized is not False):
        # (the plain grouped call goes to the engine whole, which keys it as given)
        return conditioning.in_groups(
            rms_norm, group_size, x, weight, gate=gate, residual=residual, axis=axis, out=out, eps=eps,
            return_stats=return_stats, weight_offset=weight_offset, rounding=rounding, activation=activation,
            quantize=quantize, quant_scale=quant_scale, quant_scale_ub=quant_scale_ub, quant_group=quant_group,
            quant_scale_layout=quant_scale_layout, return_unquantized=return_unquantized, shift=shift, scale=scale,
            residual_gate=residual_gate, norm_before_gate=norm_before_gate)
    epilogue = plans.rms_epilogue(weight_offset, rounding, activation, weight is not None, gate, norm_before_gate)
    conditioned = {"shift": shift, "scale": scale, "residual_gate": residual_gate, "gate": gate}
    return calls.rows("rms", x, weight, None, residual, axis, eps, return_stats, out, reference.rms_norm, epilogue,
                      None, lambda: _torch().rms_norm(x, weight, axis=axis, eps=eps, residual=residual,
                                                      return_stats=return_stats, weight_offset=weight_offset,
                                                      rounding=rounding, activation=activation, quantize=quantize,
                                                      quant_scale=quant_scale, quant_scale_ub=quant_scale_ub,
                                                      quant_group=quant_group,
                                                      quant_scale_layout=quant_scale_layout,
                                                      return_unquantized=return_unquantized,
                                                      norm_before_gate=norm_before_gate, group_size=group_size,
                                                      **conditioned),
                      quantize=(quantize, quant_scale, quant_scale_ub, quant_group, quant_scale_layout,
                                return_unquantized), conditioned=conditioned, group=group_size)


def layer_norm(x, weight=None, bias=None, *, axis=-1, eps=DEFAULT_EPS, residual=None, return_stats=False,
               activation=None, out=None, quantize=None, quant_scale=None, quant_scale_ub=None, quant_group=None,
               quant_scale_layout=None, return_unquantized=False, shift=None, scale=None, residual_gate=None):
    """Layer normalization.

    ``y = (h - mean) * rsqrt(var + eps) [* weight] [+ bias]`` over the
    normalized axes, var biased (as torch.nn.LayerNorm), where h is x, or
    ``x + residual`` (the fused pre-norm residual add). Statistics in float32
    (float64 for float64 x), combined pairwise (Chan et al.), never as
    E[x^2] - E[x]^2; y rounded once to x's dtype.

    Parameters
    ----------
    {x}
    weight, bias : array, optional
        Each shaped like the normalized axes (for axis=(1, 2, 3) of
        (16, 64, 256, 256): (64, 256, 256)), or both like more of x's
        trailing axes (per head, as for :func:`rms_norm`). Any of the four
        float dtypes; in x's dtype or float32 (float64 for float64 x) they
        are read as they are, other mixes are cast to float32 first.
    axis : int or tuple of int, default -1
        The axis, or several adjacent axes (typically the trailing ones), to
        normalize over.
    eps : float, default 1e-5
        Added to the variance inside the square root; finite and >= 0.
    residual : array, optional
        Of x's shape and dtype. ``h = x + residual`` is formed (rounded to x's
        dtype), normalized and returned, in one pass over memory. A float32
        residual under 16-bit x is the float32 residual stream: h is formed
        and returned in float32 (never rounded to x's dtype), y is x's dtype;
        over the trailing axes, fused (rows of up to 16384 16-bit elements
        for rms_norm, 8192 for layer_norm; longer raise a ValueError).
    return_stats : bool, default False
        Also return the per-group ``mean`` and ``rstd = rsqrt(var + eps)``, of
        shape x.shape without the normalized axes, float32 (float64 for
        float64 x): what a backward pass needs.
    activation : str, optional
        As for :func:`rms_norm`: applied in the same pass, before the one
        rounding.
    out : array, optional
        Where to write y: same kind, shape and dtype as x, C-contiguous; may
        be x itself (in place), may not otherwise overlap x or the residual.
    {quantize}
    {conditioned}

    Returns
    -------
    y, or a tuple ``(y[, scales][, unquantized y][, h][, mean, rstd])``
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
    epilogue = plans.activation_flags(activation)
    conditioned = {"shift": shift, "scale": scale, "residual_gate": residual_gate}
    return calls.rows("ln", x, weight, bias, residual, axis, eps, return_stats, out, reference.layer_norm, epilogue,
                      None, lambda: _torch().layer_norm(x, weight, bias, axis=axis, eps=eps, residual=residual,
                                                        return_stats=return_stats, activation=activation,
                                                        quantize=quantize, quant_scale=quant_scale,
                                                        quant_scale_ub=quant_scale_ub, quant_group=quant_group,
                                                        quant_scale_layout=quant_scale_layout,
                                                        return_unquantized=return_unquantized, **conditioned),
                      quantize=(quantize, quant_scale, quant_scale_ub, quant_group, quant_scale_layout,
                                return_unquantized), conditioned=conditioned)


def normalize(x, p=2.0, *, axis=-1, eps=LP_EPS, out=None):
    """Lp normalization, as torch's ``F.normalize``.

    ``y = x / max(norm_p(x over axis), eps)`` with ``norm_p = sum(|x|**p)
    ** (1/p)``; p = inf is the largest magnitude. The norm in float32
    (float64 for float64 x); y rounded once to x's dtype.

    Parameters
    ----------
    {x}
    p : float, default 2
        Any p > 0, or ``math.inf``. 1, 2 and inf run at memory speed; any
        other p evaluates ``pow`` per element and compiles its own kernel on
        first use (about a second, then cached on disk).
    axis : int, tuple of int, or None, default -1
        The axis, or several adjacent axes, to normalize over; None for every
        axis (the whole array is one group: see :func:`frobenius_normalize`).
    eps : float, default 1e-12
        The smallest norm divided by (a clamp, not added); finite and >= 0.
        An all-zero group gives zeros for eps > 0, NaN for eps = 0.
    out : array, optional
        Where to write y: same kind, shape and dtype as x, C-contiguous; may
        be x itself (in place), may not otherwise overlap x.

    Returns
    -------
    y
        x's shape and dtype, as the caller's array type, C-contiguous; ``out``
        if given.

    Raises
    ------
    TypeError
        x or out not an accepted array kind or of a dtype other than the four
        floats; p not a real number.
    ValueError
        p <= 0 or NaN, a bad axis (out of range, repeated, not adjacent),
        eps negative or not finite, a bad out.

    Notes
    -----
    A group holding Inf or NaN comes out all NaN (torch gives 0 and NaN
    there), as does a group whose float32 statistic overflows (for p = 2,
    ``|x|`` beyond about 1e19; for large p much sooner: ``|x|**p`` is summed).
    Other groups are unaffected.
    """
    return calls.rows(row_norms.lp_norm_name(p), x, None, None, None, axis, eps, False, out,
                      functools.partial(reference.normalize, p=float(p)), 0, None,
                      lambda: _torch().normalize(x, p, axis=axis, eps=eps))


def mean_abs_normalize(x, *, axis=-1, eps=LP_EPS, out=None):
    """Mean-absolute-value normalization: ``y = x / max(mean(|x| over axis),
    eps)`` (KernelBench problem 38, with eps=0: ``x / mean(abs(x))``).

    The L1 norm divided by the group's size: ``normalize(x, 1) * n`` but for
    where eps clamps, at the same speed. Parameters, returns, errors and notes as for
    :func:`normalize` (without p).

    Parameters
    ----------
    {x}
    axis : int, tuple of int, or None, default -1
    eps : float, default 1e-12
        The smallest mean divided by; finite and >= 0.
    out : array, optional

    Returns
    -------
    y
    """
    return calls.rows("mean_abs", x, None, None, None, axis, eps, False, out, reference.mean_abs_normalize, 0, None,
                      lambda: _torch().mean_abs_normalize(x, axis=axis, eps=eps))


def frobenius_normalize(x, *, axis=None, eps=LP_EPS, out=None):
    """Frobenius normalization: ``y = x / max(sqrt(sum(x**2)), eps)`` over the
    whole array (KernelBench problem 37), or over the given adjacent axes.

    ``normalize(x, 2, axis=axis)`` with every axis by default. The whole
    array is one group: its sum of squares is combined from per-block
    partials in a fixed order (bitwise the same every run), then every
    element is scaled: x is read twice, y written once.

    Parameters
    ----------
    {x}
    axis : int, tuple of int, or None, default None
    eps : float, default 1e-12
    out : array, optional

    Returns
    -------
    y

    Raises
    ------
    TypeError, ValueError
        As for :func:`normalize`.
    """
    return calls.rows("l2", x, None, None, None, axis, eps, False, out, reference.frobenius_normalize, 0, None,
                      lambda: _torch().frobenius_normalize(x, axis=axis, eps=eps))


_CHANNEL_X = """x : array
        ``(N, C, *spatial)`` with ``channel_axis=1`` (NCHW), or ``(N, *spatial, C)``
        with ``channel_axis=-1`` (channels-last, NHWC); any number of spatial
        axes, including none. Array kinds and dtypes as for
        :func:`layer_norm`. Dense channels-first or channels-last memory is
        used as it is (a torch channels_last tensor with channel_axis=1 runs
        as channels-last); any other layout is copied once."""


def group_norm(x, num_groups, weight=None, bias=None, *, eps=DEFAULT_EPS, channel_axis=1, return_stats=False,
               activation=None, out=None):
    """Group normalization (torch.nn.GroupNorm).

    The C channels are split into ``num_groups`` groups of consecutive
    channels; each (sample, group) is normalized over its channels and every
    spatial position, ``y = (x - mean) * rsqrt(var + eps) [* weight[c]]
    [+ bias[c]]``, var biased, statistics in float32 (float64 for float64 x)
    combined pairwise (Chan et al.); y rounded once to x's dtype.

    Parameters
    ----------
    {x}
    num_groups : int
        At least 1, dividing C.
    weight, bias : array, optional
        Of shape (C,), per channel; dtypes as for :func:`layer_norm`.
    eps : float, default 1e-5
        Added to the variance; finite and >= 0.
    channel_axis : int, default 1
        1 (channels-first) or -1 (channels-last).
    return_stats : bool, default False
        Also return ``mean`` and ``rstd`` of shape (N, num_groups), float32
        (float64 for float64 x).
    activation : str, optional
        As for :func:`rms_norm` ("relu", "silu", "gelu", "gelu_tanh"):
        applied in the same pass, before the one rounding (timm's
        GroupNormAct, a UNet's GroupNorm + SiLU).
    out : array, optional
        Where to write y: x's shape, dtype and memory layout; not overlapping x.

    Returns
    -------
    y, or ``(y, mean, rstd)``
        The caller's array type, with x's memory layout (C order if x had to
        be copied).

    Raises
    ------
    TypeError
        a wrong array kind or dtype, num_groups not an int.
    ValueError
        num_groups < 1 or not dividing C, weight/bias not of shape (C,), a
        channel_axis other than 1 or -1, x of fewer than 2 dimensions, eps
        negative or not finite, a bad ``out``.

    Notes
    -----
    A group holding Inf or NaN comes out all NaN; other groups are unaffected.
    """
    return calls.channels("group", x, num_groups, weight, bias, None, None, True, 0.1, eps, channel_axis,
                          return_stats, out, plans.activation_flags(activation), None,
                          lambda: _torch().group_norm(x, num_groups, weight, bias, eps=eps, channel_axis=channel_axis,
                                                      return_stats=return_stats, activation=activation))


def instance_norm(x, weight=None, bias=None, *, eps=DEFAULT_EPS, channel_axis=1, return_stats=False,
                  activation=None, out=None):
    """Instance normalization (``torch.nn.InstanceNorm*d``, using the input's
    statistics): GroupNorm with one channel per group; each (sample, channel)
    is normalized over its spatial positions.

    Parameters
    ----------
    {x}
        At least two spatial elements (as torch requires).
    weight, bias : array, optional
        Of shape (C,) (torch's ``affine=True``).
    eps, channel_axis, activation, out
        As for :func:`group_norm`.
    return_stats : bool, default False
        Also return ``mean`` and ``rstd`` of shape (N, C).

    Returns
    -------
    y, or ``(y, mean, rstd)``

    Raises
    ------
    TypeError, ValueError
        As for :func:`group_norm`; ValueError also for a single spatial
        element.
    """
    return calls.channels("instance", x, None, weight, bias, None, None, True, 0.1, eps, channel_axis, return_stats,
                          out, plans.activation_flags(activation), None,
                          lambda: _torch().instance_norm(x, weight, bias, eps=eps, channel_axis=channel_axis,
                                                         return_stats=return_stats, activation=activation))


def batch_norm(x, weight=None, bias=None, *, running_mean=None, running_var=None, training=True, momentum=0.1,
               eps=DEFAULT_EPS, channel_axis=1, return_stats=False, activation=None, out=None):
    """Batch normalization (``torch.nn.BatchNorm*d``'s forward).

    Training (the default): each channel is normalized with its statistics
    over the batch and every spatial position (var biased), and the running
    buffers, when given, are updated in place as torch updates them:
    ``running = (1 - momentum) * running + momentum * statistic`` with the
    unbiased variance ``var * n / (n - 1)``. Eval (``training=False``): each
    channel is normalized with running_mean and running_var, which are then
    required and left unchanged.

    Parameters
    ----------
    {x}
    weight, bias : array, optional
        Of shape (C,).
    running_mean, running_var : array, optional
        Of shape (C,), the same kind of array as x (CuPy or torch; not JAX,
        whose arrays cannot change), any of the four float dtypes. The only
        arrays cunorm writes besides its outputs.
    training : bool, default True
    momentum : float, default 0.1
        In [0, 1]. (torch's ``momentum=None``, a cumulative average, is not
        supported: pass 1 / batches_seen yourself.)
    eps, channel_axis, activation, out
        As for :func:`group_norm` (timm's BatchNormAct2d).
    return_stats : bool, default False
        Also return the ``mean`` and ``rstd`` used, of shape (C,).

    Returns
    -------
    y, or ``(y, mean, rstd)``

    Raises
    ------
    TypeError
        as for :func:`group_norm`; a JAX running buffer.
    ValueError
        as for :func:`group_norm`; running buffers not of shape (C,);
        training=False without both running buffers; training with a single
        value per channel; momentum outside [0, 1].
    """
    return calls.channels("batch", x, None, weight, bias, running_mean, running_var, training, momentum, eps,
                          channel_axis, return_stats, out, plans.activation_flags(activation), None,
                          lambda: _torch().batch_norm(x, weight, bias, running_mean=running_mean,
                                                      running_var=running_var, training=training, momentum=momentum,
                                                      eps=eps, channel_axis=channel_axis, return_stats=return_stats,
                                                      activation=activation))


# quantize=, shared by rms_norm's and layer_norm's docstrings
_QUANTIZE = """quantize : str, optional
        Write y quantized, one byte an element, in the same pass:
        "float8_e4m3fn", "float8_e5m2" (OCP FP8) or "int8" (symmetric). y is
        formed in float32 from the statistics and the parameters (after the
        activation; no rounding to x's dtype first), divided by its scale,
        rounded to nearest even and saturated to the format's finite range
        (448, 57344, 127); NaN stays NaN in the FP8 formats and becomes 0 in
        int8. For rows over the trailing axes of float16, bfloat16 or
        float32 x, of any length (rows longer than the registers hold:
        16-bit rows over 32768 elements, 16384 with a residual for rms_norm
        and 8192 for layer_norm, float32 half of those, are read a second
        time, from L2); inference only (no gradient; a registered operator under
        torch.compile; a primitive inside jax.jit); no ``out=``. The quantized y comes back as torch's
        or JAX's dtype of that name, as uint8 raw bits in a CuPy array (CuPy
        has no FP8 dtype: view them with ml_dtypes after ``.get()``), as
        int8 for int8, and as an ml_dtypes array from NumPy.
    quant_scale : array, optional
        The static scale: a one-element float32 array on x's device (read
        when the kernel runs, so a captured CUDA graph sees its changes).
        Without it each row (or group: ``quant_group``) gets its own scale,
        ``max|y| / qmax`` (never below ``1 / (qmax * 512)``: an all-zero
        row's), returned after y as float32: a row's of x's shape with the
        normalized axes 1 (``q * scales`` broadcasts back to y).
    quant_scale_ub : array, optional
        A one-element float32 bound on max|y| before the per-row (or
        per-group) scale is formed (vLLM's ``scale_ub``); not with
        ``quant_scale``.
    quant_group : int, optional
        64 or 128: a scale for each group of that many consecutive elements
        of the row (the row's length a multiple of it) in place of one a
        row, returned as float32 of shape ``x.shape[:-k] + (n // group,)``
        (k normalized axes of n elements in all). Not with ``quant_scale``.
    quant_scale_layout : str, optional
        How group scales are laid out: "row_major" (the default,
        C-contiguous), "column_major" (the same shape, the rows axis
        contiguous: the transpose of a (groups, rows) array) or
        "column_major_tma" (column-major with the rows padded to a multiple
        of 4, 16 bytes, as TMA-fed FP8 GEMMs such as DeepGEMM read them; the
        padding entries are not written). Not for JAX arrays, which carry no
        strides.
    return_unquantized : bool, default False
        Also return y unquantized, in x's dtype, as the call without
        ``quantize=`` forms it (rounded once), after the scales: one more
        write of y in the same pass, for a consumer that reads both."""

# shift=, scale=, residual_gate=, shared likewise
_CONDITIONED = """shift, scale : array, optional
        adaLN's modulation: ``y = act(v * (1 + scale) + shift)`` where v is
        the affine norm (after the weight and bias), as DiT's modulate()
        follows its LayerNorm; formed in float32 (float64 for float64 x)
        and rounded once. Each broadcasts against x and spans the
        normalized axes: per sample ((B, 1, H) for x of (B, T, H)), per
        token ((B, T, H)) or one for all ((H,)). The normalized axes must
        be the trailing ones.
    residual_gate : array, optional
        With ``residual``: ``h = residual + residual_gate * x`` (adaLN-Zero's
        gated residual), formed in float32 and rounded once to x's dtype,
        normalized and returned; broadcast as shift and scale.
        Per-head weights, shift, scale and residual_gate run fused in one
        pass (rows_cached), for rows that fit one block's registers: 16-bit
        rows of up to 32768 elements (with residual_gate 16384 for rms_norm,
        8192 for layer_norm), float32 rows half of those; longer rows raise
        a ValueError. Where
        autograd records, dynamo traces or ``jax.jit`` traces, they run as
        the plain norm followed by the framework's own elementwise ops
        (gradients through those), whose y may differ from the fused one by
        a rounding or two."""

# gate=, norm_before_gate=, group_size= (rms_norm's)
_GATED = """gate : array, optional
        The gated RMSNorm's z, of x's shape and dtype: ``y = norm(x) *
        weight * silu(z)`` (``norm_before_gate=True``, Qwen3-Next's and
        Mamba's default), or ``y = norm(x * silu(z)) * weight``
        (``norm_before_gate=False``, Mamba-2's and transformers'
        MambaRMSNormGated); formed in float32 (float64 for float64 x), the
        input x * silu(z) never rounded, y rounded once. Under
        ``rounding="normalized"`` the normalized value is rounded to x's
        dtype before the weight multiplies and, with a weight of x's
        16-bit dtype and the gate after the norm, the weighted value too
        before the gate: Qwen3NextRMSNormGated's roundings. Over the
        trailing axes, with no residual, shift, scale or residual_gate.
        Fused in one pass (rows_cached, z read beside x), for rows of up
        to 16384 16-bit elements (8192 float32); longer rows raise a
        ValueError.
    norm_before_gate : bool, default True
        Whether the gate multiplies after the norm (True) or its input (False).
    group_size : int, optional
        Normalize each run of ``group_size`` elements of x's last axis on
        its own (Mamba's ``group_size``: a group per head), with
        ``axis=-1`` and a weight over the whole last axis; rstd then has a
        value per group, of shape ``x.shape[:-1] + (n // group_size,)``."""

for _f in (rms_norm, layer_norm):
    _f.__doc__ = _f.__doc__.replace("{quantize}", _QUANTIZE).replace("{conditioned}", _CONDITIONED)
rms_norm.__doc__ = rms_norm.__doc__.replace("{gated}", _GATED)
for _f, _x in ((rms_norm, _ROW_X), (layer_norm, _ROW_X), (normalize, _ROW_X), (mean_abs_normalize, _ROW_X),
               (frobenius_normalize, _ROW_X), (group_norm, _CHANNEL_X), (instance_norm, _CHANNEL_X),
               (batch_norm, _CHANNEL_X)):
    _f.__doc__ = _f.__doc__.replace("{x}", _x)
del _f, _x
