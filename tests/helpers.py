"""Shared by the test modules: random inputs and the comparison against the
float64 reference."""
from __future__ import annotations

import numpy as np

from cunorm import _dtypes

DTYPES = [_dtypes.float16, _dtypes.bfloat16, _dtypes.float32, _dtypes.float64]
DTYPE_IDS = ["f16", "bf16", "f32", "f64"]

# Elementwise relative tolerance against the unrounded float64 reference: half
# an ulp of the output dtype (the one final rounding) plus the float32
# accumulation's error, with margin.
RTOL = {_dtypes.float16: 1.5e-3, _dtypes.bfloat16: 8e-3, _dtypes.float32: 2e-5, _dtypes.float64: 1e-12}


def arr(xp, shape, dtype=np.float32):
    """A fixed standard-normal array of ``xp`` (validation tests)."""
    return xp.asarray(np.random.default_rng(0).standard_normal(shape).astype(dtype))


def random(rng, shape, dtype, scale=1.0, offset=0.0):
    return (rng.standard_normal(shape) * scale + offset).astype(dtype)


def assert_close(y, ref, dtype, *, rtol=None, atol=None, what=""):
    """y (any array, rounded to ``dtype``) against a float64 reference:
    |y - ref| <= rtol * |ref| + atol elementwise, atol by default a thousandth
    of rtol times the largest |ref|.

    NaN never passes where the reference is finite, and vice versa.
    """
    y = np.asarray(y).astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert y.shape == ref.shape, f"{what}: shape {y.shape} != {ref.shape}"
    rtol = RTOL[np.dtype(dtype)] if rtol is None else rtol
    finite = np.isfinite(ref)
    assert np.array_equal(np.isnan(y), np.isnan(ref)), f"{what}: NaN pattern differs from the reference"
    assert np.all(np.isfinite(y[finite])), f"{what}: non-finite output where the reference is finite"
    err = np.abs(y[finite] - ref[finite])
    scale = np.abs(ref[finite])
    if atol is None:
        atol = rtol * 1e-3 * (float(np.max(scale)) if scale.size else 0.0)
    bad = err > rtol * scale + atol
    if bad.any():
        i = int(np.argmax(err - rtol * scale))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements off; worst |y-ref| {err[i]:.3g} at ref {ref[finite][i]:.6g}"
        )
    return float(np.max(err / np.maximum(scale, 1e-30))) if err.size else 0.0


def output_scale(ref):
    """Root mean square of a reference output (finite entries): LayerNorm's
    (x - mean) cancels for x near the mean, so its elementwise error is
    judged against the size of the outputs, as torch's tests do with atol."""
    ref = np.asarray(ref, dtype=np.float64)
    finite = ref[np.isfinite(ref)]
    return float(np.sqrt(np.mean(finite**2))) if finite.size else 0.0
