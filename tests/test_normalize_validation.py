"""normalize / mean_abs_normalize / frobenius_normalize: bad input gets a
clear TypeError/ValueError before any launch (the same bodies on NumPy and
CuPy arrays), and the float64 reference is what the definitions say."""
import math

import numpy as np
import pytest

import cunorm
from cunorm._engine import dispatch_rows
from cunorm import reference

from helpers import arr

OPS = [lambda x, **kw: cunorm.normalize(x, **kw), cunorm.mean_abs_normalize, cunorm.frobenius_normalize]
OP_IDS = ["normalize", "mean_abs", "frobenius"]


@pytest.mark.parametrize("p", [0, -1, -0.5, float("nan"), -math.inf])
def test_p_must_be_positive(xp, p):
    with pytest.raises(ValueError, match=r"p must be > 0 \(or inf\)"):
        cunorm.normalize(arr(xp, (2, 4)), p)


@pytest.mark.parametrize("p", ["2", None, True, [2], 1j])
def test_p_must_be_a_real_number(xp, p):
    with pytest.raises(TypeError, match="p must be a positive real number or inf"):
        cunorm.normalize(arr(xp, (2, 4)), p)


@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
@pytest.mark.parametrize("eps", [-1e-12, float("nan"), math.inf])
def test_bad_eps(xp, op, eps):
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        op(arr(xp, (2, 4)), eps=eps)


@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_bad_axes(xp, op):
    with pytest.raises(ValueError, match="out of range"):
        op(arr(xp, (2, 4)), axis=2)
    with pytest.raises(ValueError, match="adjacent"):
        op(arr(xp, (2, 3, 4)), axis=(0, 2))
    with pytest.raises(TypeError, match="axis must be an int or a tuple of ints"):
        op(arr(xp, (2, 4)), axis=1.0)


@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_scalar(xp, op):
    with pytest.raises(ValueError, match="at least one dimension"):
        op(xp.asarray(np.float32(1.0)), axis=None)


@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_wrong_dtype(xp, op):
    with pytest.raises(TypeError, match="x must have dtype"):
        op(xp.zeros((2, 4), dtype=np.int32))


def test_empty_outer_returns_empty(xp):
    y = cunorm.normalize(xp.zeros((0, 4), dtype=np.float32))
    assert y.shape == (0, 4)


def test_general_p_names():
    assert dispatch_rows.norm_info(dispatch_rows.power_norm_name(3.0)).policy == "cunorm::PowerNorm<0x4008000000000000ull>::Policy"
    assert dispatch_rows.power_norm_name(0.5) != dispatch_rows.power_norm_name(0.5000000001)


# --- the reference ------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 2, 3.5, 0.5, math.inf])
def test_reference_matches_linalg_norm(rng, p):
    x = rng.standard_normal((7, 33))
    norm = np.linalg.norm(x, ord=p, axis=1, keepdims=True)
    np.testing.assert_allclose(reference.normalize(x, p, exact=True), x / norm, rtol=1e-13)


def test_reference_mean_abs_and_frobenius(rng):
    x = rng.standard_normal((5, 6, 7))
    np.testing.assert_allclose(reference.mean_abs_normalize(x, axis=(1, 2), exact=True),
                               x / np.mean(np.abs(x), axis=(1, 2), keepdims=True), rtol=1e-13)
    np.testing.assert_allclose(reference.frobenius_normalize(x, exact=True), x / np.sqrt(np.sum(x * x)), rtol=1e-13)


def test_reference_eps_is_a_clamp(rng):
    x = np.zeros((2, 5))
    x[1] = 1e-15
    y = reference.normalize(x, 2, eps=1e-12, exact=True)
    assert np.all(y[0] == 0)
    np.testing.assert_allclose(y[1], 1e-15 / 1e-12)
    assert np.all(np.isnan(reference.normalize(x, 2, eps=0.0, exact=True)[0]))


def test_reference_nonfinite_group_is_nan_and_only_it(rng):
    x = rng.standard_normal((4, 9))
    x[2, 3] = np.inf
    for p in (1, 2, math.inf, 3.0):
        y = reference.normalize(x, p, exact=True)
        assert np.all(np.isnan(y[2])) and np.all(np.isfinite(np.delete(y, 2, axis=0)))


def test_numpy_path_is_the_reference(rng):
    x = rng.standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_array_equal(cunorm.normalize(x, 3.0, axis=0), reference.normalize(x, 3.0, axis=0))
    np.testing.assert_array_equal(cunorm.mean_abs_normalize(x), reference.mean_abs_normalize(x))
    np.testing.assert_array_equal(cunorm.frobenius_normalize(x), reference.frobenius_normalize(x))
    out = np.empty_like(x)
    assert cunorm.normalize(x, out=out) is out
    np.testing.assert_array_equal(out, reference.normalize(x))
