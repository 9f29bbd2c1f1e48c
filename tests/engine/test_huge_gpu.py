"""Past 2**31 elements and past the grid's 65535 rows (GPU; marked huge: each
test needs 20-40 GB and skips itself when that is not free). Row, strided and
channel kernels, forward and backward, on arrays whose element offsets
overflow a 32-bit int, with a strided normalized extent within 256 of
2**31, and with more samples than a grid has rows in y, so the kernels'
64-bit offsets and grid-stride loops run.

Checked against float64 formulas computed on the GPU in slices (not the
NumPy reference: the arrays are too large to copy): every statistic, and y,
dx at the slices around each boundary; dweight and dbias against the float64
sums, judged against the sums of the magnitudes of their terms."""
import numpy as np
import pytest

import cunorm
from cunorm._engine import dtypes
from helpers import RTOL, assert_close

pytestmark = [pytest.mark.gpu, pytest.mark.huge]

#: float16 (CuPy's own casts, used to fill and check, are plain there)
F16 = dtypes.float16
#: elements per slice of the float64 checks (2 GB of float64)
SLICE = 1 << 28


def _need(gb):
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    free, _ = cupy.cuda.runtime.memGetInfo()
    if free < gb << 30:
        pytest.skip(f"needs {gb} GB of free GPU memory, {free >> 30} GB free")


def _filled(shape, dtype, memory_order=None):
    """Fresh standard-normal data of ``shape`` (logical), filled in slices of
    axis 0; ``memory_order``: the axes in memory order (default C order)."""
    import cupy

    order = memory_order or tuple(range(len(shape)))
    stored = cupy.empty([shape[a] for a in order], dtype)
    step = max(1, SLICE // max(1, int(np.prod(stored.shape[1:]))))
    for i in range(0, stored.shape[0], step):
        part = stored[i : i + step]
        part[...] = cupy.random.standard_normal(part.shape, dtype=np.float32).astype(dtype)
    return stored.transpose(np.argsort(order))


def _slices(n, per):
    step = max(1, SLICE // per)
    return [(i, min(n, i + step)) for i in range(0, n, step)]


def _check_sums(got, want, magnitude, what):
    """A sum over many terms, judged against the sum of their magnitudes:
    |got - want| <= 1e-4 * sum|terms| (float32 accumulation over 10**8
    terms in a fixed tree)."""
    import cupy

    err = cupy.abs(got.astype(cupy.float64) - want)
    worst = float(cupy.max(err / magnitude))
    assert worst <= 1e-4, f"{what}: off by {worst:.2e} of the sum of magnitudes"
    assert not bool(cupy.isnan(got).any()), what


def test_rows_past_2_31_elements_forward_and_backward():
    """LayerNorm float16 of 524291 rows of 4096 (2**31 + 12288 elements): row
    524288 starts at element 2**31."""
    import cupy

    _need(24)
    rows, n = 524291, 4096
    x, dy = _filled((rows, n), F16), _filled((rows, n), F16)
    w = cupy.random.standard_normal(n, dtype=np.float32) + 1
    b = cupy.random.standard_normal(n, dtype=np.float32)
    y, mean, rstd = cunorm.layer_norm(x, w, b, return_stats=True)
    dx, dw, db = cunorm.layer_norm_backward(dy, x, mean, rstd, w, b)
    want_dw = cupy.zeros(n, np.float64)
    want_db, mag_dw, mag_db = cupy.zeros_like(want_dw), cupy.zeros_like(want_dw), cupy.zeros_like(want_dw)
    checked = {0, 1, 524287, 524288, rows - 1}
    for i0, i1 in _slices(rows, n):
        xs, gs = x[i0:i1].astype(np.float64), dy[i0:i1].astype(np.float64)
        mu = xs.mean(axis=1, keepdims=True)
        rs = 1 / cupy.sqrt(((xs - mu) ** 2).mean(axis=1, keepdims=True) + 1e-5)
        assert_close(cupy.asnumpy(mean[i0:i1]), cupy.asnumpy(mu[:, 0]), np.float32, atol=1e-5, what="mean")
        assert_close(cupy.asnumpy(rstd[i0:i1]), cupy.asnumpy(rs[:, 0]), np.float32, what="rstd")
        xhat = (xs - mu) * rs
        want_dw += (gs * xhat).sum(axis=0)
        want_db += gs.sum(axis=0)
        mag_dw += cupy.abs(gs * xhat).sum(axis=0)
        mag_db += cupy.abs(gs).sum(axis=0)
        for r in sorted(c for c in checked if i0 <= c < i1):
            k = r - i0
            assert_close(cupy.asnumpy(y[r]), cupy.asnumpy(xhat[k] * w + b), F16, atol=RTOL[F16], what=f"y row {r}")
            g = gs[k] * w
            want_dx = rs[k] * (g - g.mean() - xhat[k] * (g * xhat[k]).mean())
            assert_close(cupy.asnumpy(dx[r]), cupy.asnumpy(want_dx), F16, atol=RTOL[F16] * float(cupy.abs(
                want_dx).max()), what=f"dx row {r}")
    _check_sums(dw, want_dw, mag_dw, "dweight")
    _check_sums(db, want_db, mag_db, "dbias")


def test_long_rows_past_2_31_elements_forward_and_backward():
    """RMSNorm float32 of 2 rows of 2**30 + 64 (the split tiers); the second
    row holds element 2**31."""
    import cupy

    _need(40)
    rows, n = 2, (1 << 30) + 64
    x, dy = _filled((rows, n), np.float32), _filled((rows, n), np.float32)
    y, rstd = cunorm.rms_norm(x, return_stats=True)
    dx = cunorm.rms_norm_backward(dy, x, rstd)[0]
    for r in range(rows):
        sq = sum(float(cupy.sum(cupy.square(x[r, i0:i1].astype(np.float64)))) for i0, i1 in _slices(n, 1))
        rs = 1 / np.sqrt(sq / n + 1e-5)
        assert_close(cupy.asnumpy(rstd[r : r + 1]), np.array([rs]), np.float32, what=f"rstd row {r}")
        proj = sum(float(cupy.sum(dy[r, i0:i1].astype(np.float64) * x[r, i0:i1].astype(np.float64)))
                   for i0, i1 in _slices(n, 1)) * rs * rs / n  # mean(dy * xhat) / rstd
        for start in (0, (1 << 30) - 64 - 4096, n - 4096):  # row 1: 2**31 is at 2**30 - 64
            s = slice(start, start + 8192 if start < n - 4096 else n)
            xs, gs = x[r, s].astype(np.float64), dy[r, s].astype(np.float64)
            assert_close(cupy.asnumpy(y[r, s]), cupy.asnumpy(xs * rs), np.float32, what=f"y row {r} at {start}")
            want_dx = rs * (gs - xs * proj)
            assert_close(cupy.asnumpy(dx[r, s]), cupy.asnumpy(want_dx), np.float32,
                         atol=1e-4 * float(cupy.abs(want_dx).max()), what=f"dx row {r} at {start}")


def test_strided_extent_near_2_31():
    """RMSNorm over axis 1 of (1, 2**31 - 100, 2) float16: the channel loop's
    index runs to within 100 + blockDim.y of 2**31."""
    import cupy

    _need(24)
    c = (1 << 31) - 100
    x = _filled((1, c, 2), F16)
    y = cunorm.rms_norm(x, axis=1)
    sq = sum(cupy.square(x[0, i0:i1].astype(np.float64)).sum(axis=0) for i0, i1 in _slices(c, 2))
    rs = 1 / cupy.sqrt(sq / c + 1e-5)
    for start in (0, c // 2, c - 4096):
        s = slice(start, start + 4096)
        assert_close(cupy.asnumpy(y[0, s]), cupy.asnumpy(x[0, s].astype(np.float64) * rs), F16,
                     what=f"channels from {start}")


def test_strided_outer_past_grid_forward_and_backward():
    """RMSNorm over axis 1 of (70000, 32, 1024) float16 (2.3e9 elements): more
    outer positions than a grid's 65535 rows in y."""
    import cupy

    _need(24)
    shape = (70000, 32, 1024)
    x, dy = _filled(shape, F16), _filled(shape, F16)
    w = cupy.random.standard_normal(32, dtype=np.float32) + 1
    y, rstd = cunorm.rms_norm(x, w, axis=1, return_stats=True)
    dx, dw = cunorm.rms_norm_backward(dy, x, rstd, w, axis=1)
    want_dw, mag = cupy.zeros(32, np.float64), cupy.zeros(32, np.float64)
    for i0, i1 in _slices(shape[0], 32 * 1024):
        xs, gs = x[i0:i1].astype(np.float64), dy[i0:i1].astype(np.float64)
        rs = 1 / cupy.sqrt((xs**2).mean(axis=1, keepdims=True) + 1e-5)
        assert_close(cupy.asnumpy(rstd[i0:i1]), cupy.asnumpy(rs.reshape(rstd[i0:i1].shape)), np.float32, what="rstd")
        xhat = xs * rs
        want_dw += (gs * xhat).sum(axis=(0, 2))
        mag += cupy.abs(gs * xhat).sum(axis=(0, 2))
        for i in (i for i in (0, 65534, 65535, 65536, 69999) if i0 <= i < i1):
            k = i - i0
            assert_close(cupy.asnumpy(y[i]), cupy.asnumpy(xhat[k] * w[:, None]), F16, what=f"y sample {i}")
            g = gs[k] * w[:, None]
            want_dx = rs[k] * (g - xhat[k] * (g * xhat[k]).mean(axis=0))
            assert_close(cupy.asnumpy(dx[i]), cupy.asnumpy(want_dx), F16,
                         atol=RTOL[F16] * float(cupy.abs(want_dx).max()), what=f"dx sample {i}")
    _check_sums(dw, want_dw, mag, "dweight")


@pytest.mark.parametrize("op", ["group", "batch"])
def test_channel_norm_past_2_31_and_grid_forward_and_backward(op):
    """GroupNorm (8 groups, channels-first) and BatchNorm (channels-last) of
    (70000, 32, 1000) float16: 2.24e9 elements, more samples than 65535."""
    import cupy

    _need(30)
    shape, groups = (70000, 32, 1000), 8 if op == "group" else 32
    order = (0, 1, 2) if op == "group" else (0, 2, 1)
    x, dy = _filled(shape, F16, order), _filled(shape, F16, order)
    w = cupy.random.standard_normal(32, dtype=np.float32) + 1
    b = cupy.random.standard_normal(32, dtype=np.float32)
    if op == "group":
        y, mean, rstd = cunorm.group_norm(x, groups, w, b, return_stats=True)
        dx, dw, db = cunorm.group_norm_backward(dy, x, mean, rstd, groups, w, b)
    else:
        y, mean, rstd = cunorm.batch_norm(x, w, b, return_stats=True)
        dx, dw, db = cunorm.batch_norm_backward(dy, x, mean, rstd, w, b)
        assert x.strides[1] == 2 and y.strides == x.strides and dx.strides == x.strides
    per = 32 * 1000
    parts = _slices(shape[0], per)

    def grouped(a):  # (n, 32, 1000) -> (n, groups, 32 // groups * 1000), float64
        return a.astype(np.float64).reshape(a.shape[0], groups, -1)

    if op == "batch":  # the batch's per-channel statistics first
        total, total_sq = cupy.zeros(32, np.float64), cupy.zeros(32, np.float64)
        for i0, i1 in parts:
            xs = x[i0:i1].astype(np.float64)
            total += xs.sum(axis=(0, 2))
            total_sq += (xs**2).sum(axis=(0, 2))
        count = shape[0] * shape[2]
        mu_c = total / count
        rs_c = 1 / cupy.sqrt(total_sq / count - mu_c**2 + 1e-5)
        assert_close(cupy.asnumpy(mean), cupy.asnumpy(mu_c), np.float32, atol=1e-5, what="mean")
        assert_close(cupy.asnumpy(rstd), cupy.asnumpy(rs_c), np.float32, what="rstd")
    sums = {k: cupy.zeros(32, np.float64) for k in ("dw", "db", "mag_dw", "mag_db", "g", "gx")}
    w64, b64 = w.astype(np.float64)[:, None], b.astype(np.float64)[:, None]
    xhats = {}
    for i0, i1 in parts:
        if op == "group":
            xg = grouped(x[i0:i1])
            mu = xg.mean(axis=2, keepdims=True)
            rs = 1 / cupy.sqrt(xg.var(axis=2, keepdims=True) + 1e-5)
            assert_close(cupy.asnumpy(mean[i0:i1]), cupy.asnumpy(mu[..., 0]), np.float32, atol=1e-5, what="mean")
            assert_close(cupy.asnumpy(rstd[i0:i1]), cupy.asnumpy(rs[..., 0]), np.float32, what="rstd")
            xhat = ((xg - mu) * rs).reshape(i1 - i0, 32, -1)
        else:
            xhat = (x[i0:i1].astype(np.float64) - mu_c[:, None]) * rs_c[:, None]
        gs = dy[i0:i1].astype(np.float64)
        sums["dw"] += (gs * xhat).sum(axis=(0, 2))
        sums["db"] += gs.sum(axis=(0, 2))
        sums["mag_dw"] += cupy.abs(gs * xhat).sum(axis=(0, 2))
        sums["mag_db"] += cupy.abs(gs).sum(axis=(0, 2))
        for i in (i for i in (0, 65535, 65536, 69999) if i0 <= i < i1):
            xhats[i] = xhat[i - i0].copy()
            assert_close(cupy.asnumpy(y[i]), cupy.asnumpy(xhat[i - i0] * w64 + b64), F16, atol=RTOL[F16],
                         what=f"y sample {i}")
    _check_sums(dw, sums["dw"], sums["mag_dw"], "dweight")
    _check_sums(db, sums["db"], sums["mag_db"], "dbias")
    for i, xhat in xhats.items():
        g = dy[i].astype(np.float64) * w64
        if op == "group":  # per sample and group: rstd * (g - mean(g) - xhat * mean(g * xhat))
            gg, xg = g.reshape(groups, -1), xhat.reshape(groups, -1)
            rs = rstd[i].astype(np.float64)[:, None]
            want_dx = (rs * (gg - gg.mean(axis=1, keepdims=True) - xg * (gg * xg).mean(axis=1, keepdims=True)))
            want_dx = want_dx.reshape(32, -1)
        else:  # per channel over the batch: the batch's sums of dy and dy * xhat
            count = shape[0] * shape[2]
            want_dx = rs_c[:, None] * w64 * (dy[i].astype(np.float64) - (sums["db"] / count)[:, None]
                                             - xhat * (sums["dw"] / count)[:, None])
        assert_close(cupy.asnumpy(dx[i]), cupy.asnumpy(want_dx), F16,
                     atol=RTOL[F16] * float(cupy.abs(want_dx).max()), what=f"dx sample {i}")
