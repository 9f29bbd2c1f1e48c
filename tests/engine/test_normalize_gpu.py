"""normalize, mean_abs_normalize and frobenius_normalize on the GPU against
the float64 reference (skipped without a GPU).

Fresh random data every run; every output buffer poisoned with NaN first; the
input checked unchanged afterwards.
"""
import math

import numpy as np
import pytest

import cunorm
from cunorm._engine import row_norms
from cunorm import reference
from helpers import DTYPE_IDS, DTYPES, RTOL, assert_close, random

pytestmark = pytest.mark.gpu

#: p = 1, 2, inf, general p (its own kernel), and the mean-abs form
FORMS = [1, 2, math.inf, 3.5, 0.5, "mean_abs"]


@pytest.fixture(autouse=True)
def _poison(poisoned):
    yield


def call(form, x, **kw):
    if form == "mean_abs":
        return cunorm.mean_abs_normalize(x, **kw)
    return cunorm.normalize(x, form, **kw)


def ref_of(form, x, **kw):
    if form == "mean_abs":
        return reference.mean_abs_normalize(x, exact=True, **kw)
    return reference.normalize(x, form, exact=True, **kw)


def tolerance(form, dtype):
    # general p: pow per element and the 1/p-th root of a sum (float32 pow
    # is within 2 ulp; the root divides the sum's error by p)
    rtol = RTOL[np.dtype(dtype)]
    return rtol * 4 if form in (3.5, 0.5) and np.dtype(dtype).itemsize < 8 else rtol


def atol(dtype):
    """float16 outputs of a long L1-normalized row are ~1e-7, below float16's
    normal range (6.1e-5): there the one rounding is to a subnormal spacing
    of 2**-24, not to a relative ulp."""
    return 2.0**-24 if np.dtype(dtype) == np.float16 else None


def run_and_check(form, x_np, *, axis=-1, eps=1e-12, x_view=None):
    import cupy

    x = cupy.asarray(x_np) if x_view is None else x_view
    before = x.copy()
    y = call(form, x, axis=axis, eps=eps)
    assert isinstance(y, cupy.ndarray) and y.dtype == x.dtype and y.shape == x.shape
    ref = ref_of(form, cupy.asnumpy(x), axis=axis, eps=eps)
    assert_close(cupy.asnumpy(y), ref, x.dtype, rtol=tolerance(form, x.dtype), atol=atol(x.dtype),
                 what=f"p={form} {x.shape} axis {axis}")
    assert cupy.array_equal(x, before, equal_nan=True), "the input was written to"
    return y


ROW_SHAPES = [(1, 1), (3, 1), (5, 3), (7, 760), (2, 1025), (9, 4097), (1, 4096), (3, 65535), (1000, 33),
              (300, 65535), (64, 8192), (2, 131072), (150, 70001)]


@pytest.mark.parametrize("form", FORMS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rows(rng, form, dtype, shape):
    run_and_check(form, random(rng, shape, dtype))


STRIDED = [((2, 64, 33, 17), 1), ((3, 760, 5), 1), ((2, 3, 4097), 1), ((4, 6, 7, 9), (1, 2)), ((5, 7, 1000), 0),
           ((4, 6, 7, 9), None), ((3, 1, 5), None)]


@pytest.mark.parametrize("form", FORMS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape, axis", STRIDED, ids=str)
def test_strided_axes_and_whole(rng, form, dtype, shape, axis):
    run_and_check(form, random(rng, shape, dtype), axis=axis)


UNCACHED = [{"tier": "uncached"}, {"tier": "uncached", "stash_bytes": 0}, {"tier": "uncached", "stash_bytes": 4096},
            {"tier": "uncached", "threads": 256}, {"tier": "uncached", "blocks_per_sm": 0},
            {"tier": "split"}, {"tier": "split", "chunks": 7}, {"tier": "split", "tiles": True},
            {"tier": "split", "tiles": True, "apply_tile": 300}]


@pytest.mark.parametrize("override", UNCACHED, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n", [65535, 4097, 70001, 131071])
def test_long_row_tiers(rng, override, dtype, n):
    """Every part of rows_uncached (stash, registers, the rest read twice,
    the peeled head and tail of misaligned rows) and the split tier,
    forced, against the reference."""
    import cupy

    rows = 200
    x = cupy.asarray(random(rng, (rows, n), dtype))
    for norm, form in (("l2", 2), ("mean_abs", "mean_abs"), ("linf", math.inf)):
        y = cupy.empty_like(x)
        row_norms.launch_on(norm, x, y, first=1, last=1, eps=1e-12, override=override)
        assert_close(cupy.asnumpy(y), ref_of(form, cupy.asnumpy(x)), dtype, atol=atol(dtype),
                     what=f"{norm} {override} n={n}")


@pytest.mark.parametrize("offset", [1, 3, 4, 8])
def test_misaligned_views(rng, offset):
    """Rows starting at every misalignment: a contiguous block at an offset
    into a buffer (x's rows share y's misalignment only for offsets that are
    multiples of 4 floats) and a column slice (row stride n + 1)."""
    import cupy

    rows, n = 160, 65535
    flat = cupy.asarray(random(rng, rows * n + 16, np.float32))
    x = flat[offset : offset + rows * n].reshape(rows, n)
    run_and_check(2, None, x_view=x)
    wide = cupy.asarray(random(rng, (rows, n + 1), np.float32))
    run_and_check("mean_abs", None, x_view=wide[:, offset % 2 :][:, :n])


@pytest.mark.parametrize("form", FORMS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_zero_rows_take_the_eps_path(rng, form, dtype):
    """An all-zero group: zeros with eps > 0 (0 / eps), NaN with eps = 0
    (0 / 0, as x / norm); the other groups unaffected."""
    import cupy

    for shape in ((6, 65535), (6, 1000), (6, 1)):
        x = random(rng, shape, dtype)
        x[2] = 0
        y = cupy.asnumpy(call(form, cupy.asarray(x))).astype(np.float64)
        assert np.all(y[2] == 0)
        assert_close(np.delete(y, 2, axis=0), np.delete(ref_of(form, x), 2, axis=0), dtype,
                     rtol=tolerance(form, dtype), atol=atol(dtype))
        y0 = cupy.asnumpy(call(form, cupy.asarray(x), eps=0.0)).astype(np.float64)
        assert np.all(np.isnan(y0[2])) and np.all(np.isfinite(np.delete(y0, 2, axis=0)))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_one_element_groups(rng, dtype):
    """A group of one element: x / max(|x|, eps), the sign of x."""
    import cupy

    x = random(rng, (5000, 1), dtype)
    for form in (1, 2, math.inf, 3.5, "mean_abs"):
        y = cupy.asnumpy(call(form, cupy.asarray(x)))
        assert_close(y, np.sign(x.astype(np.float64)), dtype, rtol=tolerance(form, dtype), what=f"p={form}")


@pytest.mark.parametrize("form", FORMS, ids=str)
@pytest.mark.parametrize("n", [1000, 65535])
def test_nan_and_inf_stay_in_their_group(rng, form, n):
    import cupy

    x = random(rng, (8, n), np.float32)
    x[1, n // 2] = np.nan
    x[5, 0] = np.inf
    y = cupy.asnumpy(call(form, cupy.asarray(x)))
    assert np.all(np.isnan(y[1])) and np.all(np.isnan(y[5]))
    keep = [0, 2, 3, 4, 6, 7]
    assert_close(y[keep], ref_of(form, x[keep]), np.float32, rtol=tolerance(form, np.float32))


def test_out_and_in_place(rng):
    import cupy

    x = cupy.asarray(random(rng, (300, 65535), np.float32))
    ref = ref_of(2, cupy.asnumpy(x))
    out = cupy.empty_like(x)
    assert cunorm.normalize(x, out=out) is out
    assert_close(cupy.asnumpy(out), ref, np.float32)
    assert cunorm.normalize(x, out=x) is x
    assert_close(cupy.asnumpy(x), ref, np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5, 7), (4097, 3), (2, 1000, 1001)], ids=str)
def test_frobenius(rng, dtype, shape):
    import cupy

    x = random(rng, shape, dtype)
    y = cunorm.frobenius_normalize(cupy.asarray(x))
    assert_close(cupy.asnumpy(y), reference.frobenius_normalize(x, exact=True), dtype, atol=atol(dtype))
    y1 = cunorm.frobenius_normalize(cupy.asarray(x), axis=-1)
    assert_close(cupy.asnumpy(y1), reference.normalize(x, 2, exact=True), dtype, atol=atol(dtype))


def test_frobenius_is_deterministic(rng):
    """The whole-array sum is combined from per-block partials in a fixed
    order: two runs are bitwise equal."""
    import cupy

    x = cupy.asarray(random(rng, (64, 1 << 20), np.float32))
    a = cunorm.frobenius_normalize(x)
    b = cunorm.frobenius_normalize(x)
    assert cupy.array_equal(a, b)


@pytest.mark.huge
def test_frobenius_problem_37_shape():
    """Problem 37 at full size (7.5 GB in, 7.5 GB out), checked against a
    float64 sum of squares taken on the GPU in slices."""
    import cupy

    free, _ = cupy.cuda.runtime.memGetInfo()
    if free < 24 << 30:
        pytest.skip(f"needs 24 GB of free GPU memory, {free >> 30} GB free")
    shape = (112, 64, 512, 512)
    x = cupy.empty(shape, dtype=np.float32)
    for i in range(shape[0]):  # fresh data, filled in slices
        x[i] = cupy.random.standard_normal(shape[1:], dtype=np.float32)
    y = cunorm.frobenius_normalize(x)
    total = sum(float(cupy.sum(cupy.square(x[i].astype(np.float64)))) for i in range(shape[0]))
    scale = 1.0 / math.sqrt(total)
    for i in (0, 55, 111):
        assert_close(cupy.asnumpy(y[i]), cupy.asnumpy(x[i]).astype(np.float64) * scale, np.float32,
                     what=f"sample {i}")
    assert not bool(cupy.isnan(y).any())
