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
