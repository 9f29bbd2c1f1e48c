"""Shared by the test modules: random inputs and the comparison against the
float64 reference."""
from __future__ import annotations

import numpy as np

from cunorm._engine import dtypes
from cunorm import reference

DTYPES = [dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64]
DTYPE_IDS = ["f16", "bf16", "f32", "f64"]

# Elementwise relative tolerance against the unrounded float64 reference: half
# an ulp of the output dtype (the one final rounding) plus the float32
# accumulation's error, with margin.
RTOL = {dtypes.float16: 1.5e-3, dtypes.bfloat16: 8e-3, dtypes.float32: 2e-5, dtypes.float64: 1e-12}


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


# Every public op, for the framework tests: name -> (call, ref, rows).
# call(ops, x, w, b) runs it from a namespace of ops (cunorm, cunorm.torch,
# cunorm.jax); ref(x, w, b) is the float64 reference on NumPy copies; rows
# tells the shapes: x (3, 760) with (760,) parameters for the row ops, x
# (3, 8, 5, 7) with (8,) parameters for the channel norms.
OP_CALLS = {
    "rms_norm": (lambda ops, x, w, b: ops.rms_norm(x, w),
                 lambda x, w, b: reference.rms_norm(x, w, exact=True), True),
    "layer_norm": (lambda ops, x, w, b: ops.layer_norm(x, w, b),
                   lambda x, w, b: reference.layer_norm(x, w, b, exact=True), True),
    "normalize": (lambda ops, x, w, b: ops.normalize(x, 3.0),
                  lambda x, w, b: reference.normalize(x, 3.0, exact=True), True),
    "mean_abs_normalize": (lambda ops, x, w, b: ops.mean_abs_normalize(x),
                           lambda x, w, b: reference.mean_abs_normalize(x, exact=True), True),
    "frobenius_normalize": (lambda ops, x, w, b: ops.frobenius_normalize(x),
                            lambda x, w, b: reference.frobenius_normalize(x, exact=True), True),
    "group_norm": (lambda ops, x, w, b: ops.group_norm(x, 4, w, b),
                   lambda x, w, b: reference.group_norm(x, 4, w, b, exact=True), False),
    "instance_norm": (lambda ops, x, w, b: ops.instance_norm(x, w, b),
                      lambda x, w, b: reference.instance_norm(x, w, b, exact=True), False),
    "batch_norm": (lambda ops, x, w, b: ops.batch_norm(x, w, b),
                   lambda x, w, b: reference.batch_norm(x, w, b, exact=True), False),
}


def op_shapes(name):
    """(x shape, parameter shape) of an OP_CALLS entry."""
    return ((3, 760), (760,)) if OP_CALLS[name][2] else ((3, 8, 5, 7), (8,))


def torch_on_gpu():
    """torch, with cunorm's operators registered; the test skips where torch
    is missing or sees no GPU."""
    import pytest

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    import cunorm.torch  # noqa: F401  (registers the operators)

    return torch


def recording_backend(traced: list):
    """A torch.compile backend that appends each traced graph's call
    targets (``str(node.target)``) to ``traced``, then compiles it with
    inductor."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        traced.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return compile_fx(gm, example_inputs)

    return backend


def dispatch_recorder():
    """A torch dispatch mode (a context manager) that appends each
    operator dispatched inside it to its ``called``, as ``str(op)``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recording(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.called = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.called.append(str(func))
            return func(*args, **(kwargs or {}))

    return Recording()


def clear_cunorm_caches():
    """Every lru_cache of cunorm's modules and the launch cache's entries:
    what a fake device planned must not reach a GPU test in the same
    process, and a Program's launches are chosen when it is built."""
    import sys

    from cunorm._engine import launch_cache

    launch_cache.clear()
    for name, module in list(sys.modules.items()):
        if name == "cunorm" or name.startswith("cunorm."):
            for value in vars(module).values():
                if callable(getattr(value, "cache_clear", None)):
                    value.cache_clear()
