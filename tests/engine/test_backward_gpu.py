"""The backward passes on the GPU against the float64 reference gradients
(skipped without a GPU): every op and dtype, short rows (one launch, rows in
registers), long rows and a strided axis (the streamed passes), the whole
array, the residual form's dh, both channel layouts, mixed parameter dtypes,
empty inputs, and bitwise reproducibility of dweight and dx.

The statistics come from cunorm's own forward (what a training step feeds
the backward), the same float32 values for the kernel and the reference.
Fresh random data every run; every allocation poisoned (NaN) first; inputs
checked unchanged afterwards. dx and the parameter gradients sum terms of
both signs, so their error is judged against the size of the reference
(atol = rtol * its root mean square), as for LayerNorm's outputs.
"""
import math

import numpy as np
import pytest

import cunorm
from cunorm._engine import dispatch_grad, dtypes, launches, tuning
from cunorm import reference
from helpers import DTYPE_IDS, DTYPES, RTOL, assert_close, output_scale, random

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _poison(poisoned):
    yield


def _close(got, ref, dtype, what, factor=1.0, magnitude=0.0):
    """``magnitude``: the size of the terms dx is the difference of (scale *
    dy * weight): a group whose exact dx cancels to ~0 (a row of one
    element) is judged against them."""
    rtol = RTOL[np.dtype(dtype)] * factor
    return assert_close(got, ref, dtype, rtol=rtol, atol=rtol * max(output_scale(ref), magnitude), what=what)


def _term_scale(dy, x, axis, weight, scale):
    """The root mean square of scale * dy * weight, scale per group."""
    from cunorm._engine.row_norms import axis_span

    first, last = axis_span(axis, x.ndim)
    s = np.expand_dims(np.asarray(scale, np.float64), tuple(range(first, last + 1)))
    w = 1.0 if weight is None else np.asarray(weight, np.float64).reshape(weight.shape + (1,) * (x.ndim - 1 - last))
    return output_scale(dy.astype(np.float64) * w * s)


def _lp_scale(x, p, axis):
    """1 / max(norm, eps) per group, from the reference's y = x * scale."""
    from cunorm._engine.row_norms import axis_span

    first, last = axis_span(axis, x.ndim)
    axes = tuple(range(first, last + 1))
    y = reference.normalize(x, p, axis=axis, exact=True) if p != "mean_abs" else \
        reference.mean_abs_normalize(x, axis=axis, exact=True)
    ax, ay = np.abs(x.astype(np.float64)).sum(axes), np.abs(y).sum(axes)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(ax > 0, ay / ax, 1e12)


def _unchanged(before, after):
    for b, a in zip(before, after):
        assert np.array_equal(b, a, equal_nan=True), "an input was written to"


def _computed_in(param_dtype, x_dtype):
    """The dtype a parameter's gradient is computed in: float32 unless x is
    float64 (a float64 bias of bf16 x is summed in float32, then cast)."""
    if np.dtype(x_dtype) == np.float64 or np.dtype(param_dtype).itemsize <= 4:
        return np.dtype(param_dtype)
    return np.dtype(np.float32)


def _param_factor(dtype, rows):
    # float32 sums of `rows` terms a column: sqrt(rows) roundings
    return 1.0 if np.dtype(dtype).itemsize == 2 else max(1.0, math.sqrt(rows))


def check_rows(op, x_np, *, axis=-1, weight=None, bias=None, residual=False, rng, p=None):
    import cupy

    dtype = x_np.dtype
    x = cupy.asarray(x_np)
    dy_np = random(rng, x_np.shape, dtype)
    dy = cupy.asarray(dy_np)
    w = None if weight is None else cupy.asarray(weight)
    b = None if bias is None else cupy.asarray(bias)
    dh_np = random(rng, x_np.shape, dtype) if residual else None
    dh = None if dh_np is None else cupy.asarray(dh_np)
    inputs = [a for a in (x, dy, w, b, dh) if a is not None]
    before = [cupy.asnumpy(a) for a in inputs]
    axes = axis
    if op == "rms":
        _, rstd = cunorm.rms_norm(x, w, axis=axis, return_stats=True)
        dx, dw = cunorm.rms_norm_backward(dy, x, rstd, w, axis=axis, dh=dh)
        rdx, rdw = reference.rms_norm_backward(dy_np, x_np, cupy.asnumpy(rstd), weight, axis=axes, dh=dh_np,
                                               exact=True)
        grads = [(dw, rdw, "dweight", weight)]
        terms = _term_scale(dy_np, x_np, axis, weight, cupy.asnumpy(rstd))
    elif op == "ln":
        _, mean, rstd = cunorm.layer_norm(x, w, b, axis=axis, return_stats=True)
        dx, dw, db = cunorm.layer_norm_backward(dy, x, mean, rstd, w, b, axis=axis, dh=dh)
        rdx, rdw, rdb = reference.layer_norm_backward(dy_np, x_np, cupy.asnumpy(mean), cupy.asnumpy(rstd), weight,
                                                      bias, axis=axes, dh=dh_np, exact=True)
        grads = [(dw, rdw, "dweight", weight), (db, rdb, "dbias", bias)]
        terms = _term_scale(dy_np, x_np, axis, weight, cupy.asnumpy(rstd))
    else:
        if op == "mean_abs":
            dx = cunorm.mean_abs_normalize_backward(dy, x, axis=axis)
            rdx = reference.normalize_backward(dy_np, x_np, 1.0, axis=axes, mean=True, exact=True)
        else:
            dx = cunorm.normalize_backward(dy, x, p, axis=axis)
            rdx = reference.normalize_backward(dy_np, x_np, p, axis=axes, exact=True)
        grads = []
        terms = _term_scale(dy_np, x_np, axis, None, _lp_scale(x_np, "mean_abs" if op == "mean_abs" else p, axis))
    _unchanged(before, [cupy.asnumpy(a) for a in inputs])
    assert dx.dtype == dtype and dx.flags.c_contiguous
    _close(cupy.asnumpy(dx), rdx, dtype, f"{op} dx", factor=4.0 if op not in ("rms", "ln") else 1.0,
           magnitude=terms)
    param = weight if weight is not None else bias
    rows = x_np.size // (param.size if param is not None else 1)
    for got, ref, name, param in grads:
        if param is None:
            assert got is None
            continue
        assert got.dtype == param.dtype and got.shape == param.shape
        prec = _computed_in(param.dtype, dtype)
        _close(cupy.asnumpy(got), ref, prec, f"{op} {name}", factor=_param_factor(prec, rows))
    return dx


# 600x4096: more rows than resident blocks, so a cached block sums several
# rows into its column partials; 3x16384: the cached path's longest 16-bit rows;
# 40x40000: streamed rows whose pass 2 cuts the rows into parts (column_sum
# adds their partials, 16 bytes of columns a thread); 150x20000 and
# 140x32768: rows a block cannot hold, on clusters on sm_90 (16-bit and
# float32; float64 streams), the last cluster block's slice short at 20000
ROW_SHAPES = [(1, 1), (3, 3), (37, 760), (5, 4097), (600, 4096), (2, 8192), (3, 16384), (3, 65535), (40, 40000),
              (150, 20000), (140, 32768), (2, 3, 96)]
ROW_IDS = ["1x1", "3x3", "37x760", "5x4097", "600x4096", "2x8192", "3x16384", "3x65535", "40x40000", "150x20000",
           "140x32768", "2x3x96"]


@pytest.mark.parametrize("shape", ROW_SHAPES, ids=ROW_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", ["rms", "ln"])
def test_rows_backward(op, dtype, shape, rng):
    n = shape[-1]
    x = random(rng, shape, dtype)
    w = random(rng, (n,), dtype, offset=1.0)
    b = random(rng, (n,), dtype) if op == "ln" else None
    check_rows(op, x, weight=w, bias=b, rng=rng)


@pytest.mark.parametrize("shape", [(4, 760), (3, 65535)], ids=["cached", "streamed"])
@pytest.mark.parametrize("op", ["rms", "ln"])
def test_rows_backward_residual_and_params(op, shape, rng):
    """dh added to dx; no parameters; float32 parameters of bf16 x; weight or bias alone."""
    n = shape[-1]
    bf16 = dtypes.bfloat16
    x = random(rng, shape, bf16)
    check_rows(op, x, residual=True, rng=rng)
    check_rows(op, x, weight=random(rng, (n,), np.float32), residual=True, rng=rng)
    if op == "ln":
        check_rows(op, x, bias=random(rng, (n,), bf16), rng=rng)
        check_rows(op, x, weight=random(rng, (n,), bf16), bias=random(rng, (n,), np.float64), rng=rng)


@pytest.mark.parametrize("dtype", [dtypes.bfloat16, np.float32], ids=["bf16", "f32"])
def test_streamed_backward_one_part(dtype, rng):
    """Few long rows (problem 40's regime): pass 2 has one row chunk and
    writes dweight/dbias itself, no column_sum."""
    from cunorm._engine import gradients

    device = launches.device_info(0)
    n = tuning.of(device).grad_apply_blocks_per_sm * device.sm_count * dispatch_grad.GRAD_BLOCK_THREADS * 8 + 8
    x = random(rng, (2, n), dtype)
    vec = 16 // x.itemsize
    launch = gradients._rows_launch("ln", np.dtype(dtype), np.dtype(dtype), 3, 2, n, 1, vec, 0)
    assert launch.tier == "streamed" and launch.parts == 1
    check_rows("ln", x, weight=random(rng, (n,), dtype, offset=1.0), bias=random(rng, (n,), dtype), rng=rng)
    check_rows("rms", x, weight=random(rng, (n,), dtype, offset=1.0), rng=rng)


@pytest.mark.parametrize("op", ["rms", "ln"])
def test_cluster_backward(op, rng):
    """Rows a block cannot hold run rows_grad_cached on clusters (sm_90):
    more rows than resident clusters (several rows a cluster); dh; no
    parameters; float32 parameters of bf16 x; a weight alone."""
    from cunorm._engine import gradients

    if launches.device_info(0).compute_capability < 90:
        pytest.skip("thread-block clusters need sm_90")
    bf16 = dtypes.bfloat16
    shape = (1000, 24576)
    launch = gradients._rows_launch(op, np.dtype(bf16), np.dtype(np.float32), 1, *shape, 1, 8, 0)
    assert launch.tier == "cached" and launch.steps[0].kernel.cluster > 1
    n = shape[-1]
    x = random(rng, shape, bf16)
    check_rows(op, x, weight=random(rng, (n,), np.float32, offset=1.0), residual=True, rng=rng)
    check_rows(op, x, rng=rng)
    if op == "ln":
        check_rows(op, x, weight=random(rng, (n,), bf16, offset=1.0), bias=random(rng, (n,), bf16), rng=rng)


@pytest.mark.parametrize("shape, dtype", [((1001, 40), np.float32), ((20001, 64), dtypes.bfloat16),
                                          ((4099, 256), dtypes.bfloat16), ((3001, 200), np.float16)],
                         ids=["1001x40-f32", "20001x64-bf16", "4099x256-bf16", "3001x200-f16"])
@pytest.mark.parametrize("op", ["rms", "ln"])
def test_short_rows_share_blocks(op, shape, dtype, rng):
    """Rows of at most 64 threads share a block, a row a slot (parts of a
    warp for 40 and 64 elements): a row count no multiple of the slots,
    more rows than resident slots (a slot walks several), dh, no parameters,
    float32 parameters; each row's dx bitwise the one it gets alone or in a
    shorter batch."""
    import cupy
    from cunorm._engine import gradients

    n = shape[-1]
    vec = max(v for v in (1, 2, 4, 8) if v * np.dtype(dtype).itemsize <= 16 and n % v == 0)
    launch = gradients._rows_launch(op, np.dtype(dtype), np.dtype(dtype), 3 if op == "ln" else 1, *shape, 1, vec, 0)
    assert launch.steps[0].kernel.template_args[-1] == 1 and launch.row_threads < launch.steps[0].block[0]
    x = random(rng, shape, dtype)
    w = random(rng, (n,), dtype, offset=1.0)
    b = random(rng, (n,), dtype) if op == "ln" else None
    check_rows(op, x, weight=w, bias=b, residual=True, rng=rng)
    check_rows(op, x, rng=rng)
    check_rows(op, x, weight=random(rng, (n,), np.float32, offset=1.0), rng=rng)
    xs, dys = cupy.asarray(x), cupy.asarray(random(rng, shape, dtype))
    ws = cupy.asarray(w)

    def dx_of(rows):
        if op == "rms":
            _, rstd = cunorm.rms_norm(xs[:rows], ws, return_stats=True)
            return cunorm.rms_norm_backward(dys[:rows], xs[:rows], rstd, ws)[0]
        _, mean, rstd = cunorm.layer_norm(xs[:rows], ws, cupy.asarray(b), return_stats=True)
        return cunorm.layer_norm_backward(dys[:rows], xs[:rows], mean, rstd, ws, cupy.asarray(b))[0]

    whole = cupy.asnumpy(dx_of(shape[0]))
    for rows in (1, 7, shape[0] // 3):
        part = cupy.asnumpy(dx_of(rows))
        assert np.array_equal(part.view(np.uint8), whole[:rows].view(np.uint8)), rows


def test_cached_backward_grid_fills_the_gpu():
    """A cached block whose column sums need more than 48 KB of shared
    memory (LayerNorm, 16384 bf16 a row: 128 KB) still gets a block an SM:
    the occupancy query comes after the opt-in to that much."""
    from cunorm._engine import gradients

    launch = gradients._rows_launch("ln", np.dtype(dtypes.bfloat16), np.dtype(dtypes.bfloat16), 3, 4096, 16384, 1, 8, 0)
    (step,) = launch.steps
    assert launch.tier == "cached" and step.shared_bytes > 48 * 1024
    assert launches.persistent_grid(step, 0)[0] >= launches.device_info(0).sm_count


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 37])
@pytest.mark.parametrize("n", [4096, 1001])
def test_cached_backward_few_rows(rows, n, rng):
    """A grid of few blocks (decode-sized batches) sums the parameter
    partials with one slice a partial row and wide column units; n = 1001
    takes the one-column units (not a multiple of 4)."""
    from cunorm._engine import gradients

    dtype = dtypes.bfloat16
    x = random(rng, (rows, n), dtype)
    launch = gradients._rows_launch("ln", np.dtype(dtype), np.dtype(dtype), 3, rows, n, 1, 8 if n % 8 == 0 else 1, 0)
    assert launch.tier == "cached"
    check_rows("ln", x, weight=random(rng, (n,), dtype, offset=1.0), bias=random(rng, (n,), dtype), rng=rng)
    check_rows("rms", x, weight=random(rng, (n,), dtype, offset=1.0), rng=rng)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", ["rms", "ln"])
def test_strided_axis_backward(op, dtype, rng):
    """axis 1 of (N, C, H, W) and of (2, 3, 760), and two middle axes."""
    x = random(rng, (3, 24, 5, 7), dtype)
    check_rows(op, x, axis=1, weight=random(rng, (24,), dtype), bias=random(rng, (24,), dtype) if op == "ln" else None,
               rng=rng)
    x = random(rng, (2, 3, 760), dtype)
    check_rows(op, x, axis=1, weight=random(rng, (3,), dtype), rng=rng)
    x = random(rng, (2, 3, 4, 5), dtype)
    check_rows(op, x, axis=(1, 2), weight=random(rng, (3, 4), dtype), rng=rng)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape, tier", [((300, 16, 64), "strided_cached"), ((5, 256, 48), "strided_cached"),
                                         ((2, 3000, 7), "strided")],
                         ids=["one pass, more outer indices than blocks", "one pass, 256 indices", "three passes"])
def test_strided_backward_tiers(shape, tier, dtype, rng):
    """Both strided tiers, with the gradient of h (dh) added and without."""
    x = random(rng, shape, dtype)
    assert _strided_tier(x) == tier
    w, b = random(rng, (shape[1],), dtype), random(rng, (shape[1],), dtype)
    check_rows("ln", x, axis=1, weight=w, bias=b, rng=rng)
    check_rows("rms", x, axis=1, weight=w, residual=True, rng=rng)
    check_rows("ln", x, axis=1, rng=rng)


def _strided_tier(x) -> str:
    from cunorm._engine.plans import vector_width

    outer, reduced, inner = x.shape[0], x.shape[1], int(np.prod(x.shape[2:]))
    vec = vector_width(x.itemsize, inner, [], [(0, x.itemsize)])
    return dispatch_grad.choose_rows_grad("ln", x.dtype, x.dtype, 3, outer, reduced, inner, vec,
                                          launches.device_info(0)).tier


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, math.inf, "mean_abs"])
@pytest.mark.parametrize("shape,axis", [((37, 760), -1), ((3, 65535), -1), ((3, 24, 5, 7), 1), ((3, 5, 7), None)],
                         ids=["cached", "streamed", "strided", "whole"])
def test_normalize_backward(p, dtype, shape, axis, rng):
    x = random(rng, shape, dtype)
    if p == math.inf:  # ties at the largest magnitude share the gradient
        x.reshape(-1)[:2] = 9.0
        x.reshape(-1)[-1] = -9.0
    if p == "mean_abs":
        check_rows("mean_abs", x, axis=axis, rng=rng)
    else:
        check_rows("lp", x, axis=axis, p=p, rng=rng)


def test_normalize_backward_clamped_and_nan(rng):
    import cupy

    x = np.zeros((3, 760), np.float32)
    x[1] = random(rng, (760,), np.float32)
    x[2, 5] = np.nan
    dy = random(rng, x.shape, np.float32)
    dx = cupy.asnumpy(cunorm.normalize_backward(cupy.asarray(dy), cupy.asarray(x)))
    assert_close(dx[0], dy[0].astype(np.float64) / 1e-12, np.float32, what="clamped: dy / eps")
    assert np.all(np.isfinite(dx[1])) and np.all(np.isnan(dx[2]))


def test_frobenius_backward_whole_array(rng):
    import cupy

    x = random(rng, (64, 3, 97, 41), np.float32)
    dy = random(rng, x.shape, np.float32)
    dx = cunorm.frobenius_normalize_backward(cupy.asarray(dy), cupy.asarray(x))
    _close(cupy.asnumpy(dx), reference.normalize_backward(dy, x, 2.0, axis=None, exact=True), np.float32,
           "frobenius dx", factor=4.0)


def check_channels(op, x_np, *, groups=None, weight=None, bias=None, channel_axis=1, memory="c", training=True,
                   rng):
    import cupy

    from test_channel_gpu import to_layout

    dtype = x_np.dtype
    x = to_layout(cupy, x_np, memory, channel_axis)
    dy_np = random(rng, x_np.shape, dtype)
    dy = to_layout(cupy, dy_np, "sliced" if memory == "sliced" else "c", channel_axis)
    w = None if weight is None else cupy.asarray(weight)
    b = None if bias is None else cupy.asarray(bias)
    before = [cupy.asnumpy(a) for a in (x, dy)]
    kw = {"channel_axis": channel_axis}
    c = x_np.shape[channel_axis]
    if op == "batch" and not training:
        mean = cupy.asarray(random(rng, (c,), np.float32))
        var = cupy.asarray(np.abs(random(rng, (c,), np.float32)) + 0.5)
        dx, dw, db = cunorm.batch_norm_backward(dy, x, mean, var, w, b, training=False, **kw)
        ref = reference.batch_norm_backward(dy_np, x_np, cupy.asnumpy(mean), cupy.asnumpy(var), weight, bias,
                                            training=False, exact=True, **kw)
    else:
        fwd = getattr(cunorm, f"{op}_norm")
        args = (x, groups) if op == "group" else (x,)
        _, mean, rstd = fwd(*args, w, b, return_stats=True, **kw)
        bwd = getattr(cunorm, f"{op}_norm_backward")
        rbwd = getattr(reference, f"{op}_norm_backward")
        extra = (groups,) if op == "group" else ()
        dx, dw, db = bwd(dy, x, mean, rstd, *extra, w, b, **kw)
        ref = rbwd(dy_np, x_np, cupy.asnumpy(mean), cupy.asnumpy(rstd), *extra, weight, bias, exact=True, **kw)
    _unchanged(before, [cupy.asnumpy(a) for a in (x, dy)])
    assert dx.dtype == dtype
    if memory == "swapped":  # dx keeps x's memory layout
        assert dx.strides == x.strides
    _close(cupy.asnumpy(dx), ref[0], dtype, f"{op} dx")
    check_param_grads((dw, db), ref[1:], (weight, bias), dtype, x_np.size // c, op)


def check_param_grads(grads, refs, params, dtype, rows, what):
    """dweight and dbias (None where their parameter is) against the
    reference's, in the parameter's dtype, judged for ``rows`` terms."""
    import cupy

    for got, want, param, name in zip(grads, refs, params, ("dweight", "dbias")):
        if param is None:
            assert got is None
            continue
        assert got.dtype == param.dtype
        prec = _computed_in(param.dtype, dtype)
        _close(cupy.asnumpy(got), want, prec, f"{what} {name}", factor=_param_factor(prec, rows))


# (2, 4, 128, 130): channels of 16640 positions, several chunks each (the
# last one partial) in channels-first memory; the small planes run as plane
# rows (Tuning.channel_plane_rows_max_vecs), (4, 37, 7, 7) with a block's
# last rows past the last channel, (2, 300, 14, 14) over 38 blocks of them
CHANNEL_CASES = [
    ("group", (3, 8, 5, 7), 4), ("group", (2, 6, 33), 1), ("group", (2, 6, 33), 6), ("group", (4, 64, 9, 9), 8),
    ("group", (2, 4, 128, 130), 2), ("instance", (3, 8, 5, 7), None), ("batch", (3, 8, 5, 7), None),
    ("batch", (5, 6, 1), None), ("batch", (4, 37, 7, 7), None), ("batch", (2, 300, 14, 14), None),
    ("group", (3, 40, 6, 6), 5),
]


@pytest.mark.parametrize("memory", ["c", "swapped", "sliced"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CHANNEL_CASES, ids=lambda c: f"{c[0]}{c[2] or ''}-{'x'.join(map(str, c[1]))}")
def test_channel_backward(case, dtype, memory, rng):
    op, shape, groups = case
    c = shape[1]
    x = random(rng, shape, dtype)
    check_channels(op, x, groups=groups, weight=random(rng, (c,), dtype, offset=1.0), bias=random(rng, (c,), dtype),
                   memory=memory, rng=rng)


@pytest.mark.parametrize("op", ["group", "instance", "batch"])
def test_channel_backward_channels_last_and_params(op, rng):
    x = random(rng, (2, 5, 7, 16), dtypes.bfloat16)
    groups = 4 if op == "group" else None
    check_channels(op, x, groups=groups, channel_axis=-1, rng=rng)
    check_channels(op, x, groups=groups, channel_axis=-1, weight=random(rng, (16,), np.float32), rng=rng)
    check_channels(op, x, groups=groups, channel_axis=-1, bias=random(rng, (16,), dtypes.bfloat16), rng=rng)


@pytest.mark.parametrize("memory", ["c", "swapped"])
def test_batch_norm_backward_eval(memory, rng):
    x = random(rng, (3, 8, 5, 7), np.float32)
    check_channels("batch", x, weight=random(rng, (8,), np.float32), bias=random(rng, (8,), np.float32),
                   memory=memory, training=False, rng=rng)


def test_backward_of_empty_rows_gives_zero_parameter_gradients():
    import cupy

    x = cupy.empty((0, 760), np.float32)
    w = cupy.ones(760, np.float32)
    dx, dw, db = cunorm.layer_norm_backward(x, x, cupy.empty(0, np.float32), cupy.empty(0, np.float32), w, w)
    assert dx.shape == (0, 760) and float(cupy.abs(dw).sum()) == 0 and float(cupy.abs(db).sum()) == 0


@pytest.mark.parametrize("case", ["cached", "clusters", "streamed", "strided", "channels", "channels_last"])
def test_gradients_are_bitwise_reproducible(case, rng):
    """Two runs on the same inputs give the same bytes (no float atomics:
    partials are added in a fixed order)."""
    import cupy

    if case.startswith("channels"):
        last = case == "channels_last"
        x = cupy.asarray(random(rng, (16, 64, 32, 32), np.float32))
        if last:
            x = cupy.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
        dy = cupy.asarray(random(rng, x.shape, np.float32))
        w = cupy.asarray(random(rng, (64,), np.float32))
        _, mean, rstd = cunorm.group_norm(x, 8, w, w, return_stats=True)
        run = lambda: cunorm.group_norm_backward(dy, x, mean, rstd, 8, w, w)  # noqa: E731
    else:
        shape, axis = {"cached": ((4096, 1024), -1), "clusters": ((300, 16384), -1), "streamed": ((64, 100000), -1),
                       "strided": ((16, 64, 32, 32), 1)}[case]
        x = cupy.asarray(random(rng, shape, np.float32))
        dy = cupy.asarray(random(rng, shape, np.float32))
        w = cupy.asarray(random(rng, (shape[1],), np.float32))
        _, mean, rstd = cunorm.layer_norm(x, w, w, axis=axis, return_stats=True)
        run = lambda: cunorm.layer_norm_backward(dy, x, mean, rstd, w, w, axis=axis)  # noqa: E731
    first = [cupy.asnumpy(a).tobytes() for a in run()]
    second = [cupy.asnumpy(a).tobytes() for a in run()]
    assert first == second


def test_backward_refuses_mixed_array_kinds():
    import cupy

    x = cupy.ones((4, 8), np.float32)
    _, rstd = cunorm.rms_norm(x, return_stats=True)
    with pytest.raises(TypeError, match="dy is a NumPy array"):
        cunorm.rms_norm_backward(np.ones((4, 8), np.float32), x, rstd)


def _batch_norm_backward_f64(dy, x, w, channel_axis):
    """Training BatchNorm's (dx, dw, db) in float64 on the GPU, from the
    formula (independent of the reference module): xhat = (x - mean) * rstd,
    dx = w * rstd * (dy - mean(dy) - xhat * mean(dy * xhat)) per channel."""
    import cupy

    axes = tuple(a for a in range(x.ndim) if a != channel_axis % x.ndim)
    x64, dy64 = x.astype(cupy.float64), dy.astype(cupy.float64)
    mean = x64.mean(axis=axes, keepdims=True)
    rstd = 1.0 / cupy.sqrt(((x64 - mean) ** 2).mean(axis=axes, keepdims=True) + 1e-5)
    xhat = (x64 - mean) * rstd
    shape = [1] * x.ndim
    shape[channel_axis] = -1
    w64 = w.astype(cupy.float64).reshape(shape)
    dx = w64 * rstd * (dy64 - dy64.mean(axis=axes, keepdims=True) - xhat * (dy64 * xhat).mean(axis=axes, keepdims=True))
    return dx, (dy64 * xhat).sum(axis=axes), dy64.sum(axis=axes)


@pytest.mark.parametrize("shape,channel_axis", [((70000, 4, 3), 1), ((70000, 3, 4), -1), ((1, 17_000_000, 3), 1)],
                         ids=["samples-first", "samples-last", "channel-tiles"])
def test_batch_norm_backward_past_the_grid_limits(shape, channel_axis, rng):
    """More samples (z) or channel tiles (y) than a grid holds (65535): the
    backward's kernels walk the rest by grid stride (the launch used to be
    refused); against the float64 formula, computed on the GPU."""
    import cupy

    c = shape[channel_axis]
    x = cupy.random.standard_normal(shape, dtype=np.float32)
    dy = cupy.random.standard_normal(shape, dtype=np.float32)
    w = cupy.random.uniform(0.5, 2, c).astype(np.float32)
    b = cupy.random.uniform(-1, 1, c).astype(np.float32)
    _, mean, rstd = cunorm.batch_norm(x, w, b, channel_axis=channel_axis, return_stats=True)
    dx, dw, db = cunorm.batch_norm_backward(dy, x, mean, rstd, w, b, channel_axis=channel_axis)
    want = _batch_norm_backward_f64(dy, x, w, channel_axis)
    for got, ref, name in zip((dx, dw, db), want, ("dx", "dweight", "dbias")):
        err = float(cupy.max(cupy.abs(got.astype(cupy.float64) - ref)) / cupy.max(cupy.abs(ref)))
        assert err < 1e-4, (name, err)
        assert not bool(cupy.isnan(got).any()), name
