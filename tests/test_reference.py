"""The NumPy reference against independent formulas (CPU)."""
import numpy as np
import pytest

import cunorm
from cunorm import reference
from helpers import DTYPES, DTYPE_IDS, random


def test_rms_rows_matches_norm_formula(rng):
    x = rng.standard_normal((7, 33))
    w = rng.standard_normal(33)
    y = reference.rms_norm(x, w, eps=0.0, exact=True)
    expected = x / (np.linalg.norm(x, axis=1, keepdims=True) / np.sqrt(33)) * w
    np.testing.assert_allclose(y, expected, rtol=1e-13)


def test_rms_adjacent_axes_equal_flattened(rng):
    x = rng.standard_normal((3, 4, 5, 6))
    w = rng.standard_normal((4, 5))
    y = reference.rms_norm(x, w, axis=(1, 2), eps=1e-3, exact=True)
    flat = x.transpose(0, 3, 1, 2).reshape(3, 6, 20)
    ms = np.einsum("abk,abk->ab", flat, flat)[..., None] / 20
    expected = (flat / np.sqrt(ms + 1e-3) * w.reshape(20)).reshape(3, 6, 4, 5).transpose(0, 2, 3, 1)
    np.testing.assert_allclose(y, expected, rtol=1e-13)


def test_rms_loop_definition(rng):
    x = rng.standard_normal((2, 3, 4))
    y = reference.rms_norm(x, axis=1, eps=1e-5, exact=True)
    for a in range(2):
        for c in range(4):
            col = x[a, :, c]
            np.testing.assert_allclose(y[a, :, c], col / np.sqrt(np.mean(col**2) + 1e-5), rtol=1e-14)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_returns_input_dtype(rng, dtype):
    x = random(rng, (4, 9), dtype)
    y = cunorm.rms_norm(x)
    assert y.dtype == dtype and y.shape == x.shape


def test_rms_nonfinite_group_is_nan_and_only_it(rng):
    x = rng.standard_normal((4, 16))
    x[1, 3] = np.inf
    x[2, 0] = np.nan
    y = reference.rms_norm(x, exact=True)
    assert np.isnan(y[1]).all() and np.isnan(y[2]).all()
    assert np.isfinite(y[[0, 3]]).all()


def test_numpy_path_is_the_reference(rng):
    x = random(rng, (5, 12), np.float32)
    w = random(rng, 12, np.float32)
    np.testing.assert_array_equal(cunorm.rms_norm(x, w, eps=1e-3), reference.rms_norm(x, w, eps=1e-3))


def test_numpy_out_is_written_and_returned(rng):
    x = random(rng, (5, 12), np.float32)
    out = np.full_like(x, np.nan)
    r = cunorm.rms_norm(x, out=out)
    assert r is out
    np.testing.assert_array_equal(out, reference.rms_norm(x))


def test_numpy_input_not_written(rng):
    x = random(rng, (5, 12), np.float32)
    before = x.copy()
    cunorm.rms_norm(x)
    np.testing.assert_array_equal(x, before)


def test_layer_norm_matches_definition(rng):
    x = rng.standard_normal((5, 3, 8)) * 4 + 2
    w = rng.standard_normal((3, 8))
    b = rng.standard_normal((3, 8))
    y, mean, rstd = reference.layer_norm(x, w, b, axis=(1, 2), eps=1e-3, return_stats=True, exact=True)
    flat = x.reshape(5, 24)
    mu = flat.sum(axis=1) / 24
    var = ((flat - mu[:, None]) ** 2).sum(axis=1) / 24
    expected = ((flat - mu[:, None]) / np.sqrt(var[:, None] + 1e-3)).reshape(5, 3, 8) * w + b
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(mean, mu, rtol=1e-13)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(var + 1e-3), rtol=1e-13)


def test_layer_norm_strided_axis_loop(rng):
    x = rng.standard_normal((2, 6, 3))
    y = reference.layer_norm(x, axis=1, eps=0.0, exact=True)
    for a in range(2):
        for c in range(3):
            col = x[a, :, c]
            np.testing.assert_allclose(y[a, :, c], (col - col.mean()) / col.std(), rtol=1e-12)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_residual_is_rounded_sum_then_norm(rng, op):
    x = random(rng, (4, 64), np.float16)
    r = random(rng, (4, 64), np.float16)
    y, h = getattr(reference, op)(x, residual=r, exact=True)
    h_expected = (x.astype(np.float64) + r.astype(np.float64)).astype(np.float16)
    np.testing.assert_array_equal(h, h_expected)
    np.testing.assert_array_equal(y, getattr(reference, op)(h_expected, exact=True))


def test_stats_dtypes_and_shapes(rng):
    x = random(rng, (3, 5, 7), np.float32)
    y, mean, rstd = cunorm.layer_norm(x, axis=1, return_stats=True)
    assert y.dtype == np.float32 and mean.dtype == rstd.dtype == np.float32 and mean.shape == (3, 7)
    y, rstd = cunorm.rms_norm(x.astype(np.float64), axis=-1, return_stats=True)
    assert rstd.dtype == np.float64 and rstd.shape == (3, 5)
