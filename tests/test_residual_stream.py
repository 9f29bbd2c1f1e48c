"""The float32 residual stream (a float32 residual under 16-bit x: h = x +
r in float32, returned, normalized; y in x's dtype) on the CPU: the
reference, the NumPy path, the checks, the dispatch (rows_cached alone),
and the torch and JAX compositions under autograd and tracing."""
import numpy as np
import pytest

import cunorm
from cunorm import reference
from cunorm._engine import dispatch_rows, dtypes, plans
from helpers import arr, random

BF16 = dtypes.bfloat16


@pytest.mark.parametrize("kind", ["rms", "ln"])
def test_the_reference_keeps_h_in_float32(rng, kind):
    x, r = random(rng, (4, 7, 96), BF16), random(rng, (4, 7, 96), np.float32, 100.0)
    w = random(rng, (96,), BF16)
    fn = reference.rms_norm if kind == "rms" else reference.layer_norm
    y, h = fn(x, w, residual=r)
    assert y.dtype == BF16 and h.dtype == np.float32
    np.testing.assert_array_equal(h, x.astype(np.float32) + r)  # (one float32 add: exact in float64, then rounded)
    hf = h.astype(np.float64)
    center = 0.0 if kind == "rms" else hf.mean(-1, keepdims=True)
    spread = (hf * hf).mean(-1, keepdims=True) if kind == "rms" else hf.var(-1, keepdims=True)
    want = ((hf - center) / np.sqrt(spread + 1e-5) * w.astype(np.float64)).astype(BF16)
    np.testing.assert_array_equal(y.view(np.uint16), want.view(np.uint16))


def test_the_numpy_path_runs_the_reference(rng):
    x, r = random(rng, (3, 50), dtypes.float16), random(rng, (3, 50), np.float32)
    y, h, rstd = cunorm.rms_norm(x, residual=r, return_stats=True)
    want = reference.rms_norm(x, residual=r, return_stats=True)
    for got, exp in zip((y, h, rstd), want):
        assert got.dtype == exp.dtype
        np.testing.assert_array_equal(got, exp)


@pytest.mark.parametrize("x_dtype, r_dtype, kwargs, error, match", [
    (BF16, np.float64, {}, TypeError, r"residual must have x's dtype bfloat16 \(or float32 under 16-bit x"),
    (BF16, dtypes.float16, {}, TypeError, "residual must have x's dtype bfloat16"),
    (np.float32, BF16, {}, TypeError, "residual must have x's dtype float32"),
    (BF16, np.float32, {"axis": 1}, ValueError, "normalize over the trailing axes"),
    (BF16, np.float32, {"residual_gate": (2, 1, 16)}, ValueError, "residual_gate= takes a residual of x's dtype"),
    (BF16, np.float32, {"quantize": "int8"}, ValueError, "or float32 residual under 16-bit x"),
])
def test_bad_residuals_are_refused_before_anything_runs(xp, x_dtype, r_dtype, kwargs, error, match):
    x, r = arr(xp, (2, 5, 16), x_dtype), arr(xp, (2, 5, 16), r_dtype)
    given = {k: arr(xp, v, x_dtype) if isinstance(v, tuple) else v for k, v in kwargs.items()}
    with pytest.raises(error, match=match):
        cunorm.layer_norm(x, residual=r, **given)


H100 = dispatch_rows.Device(sm_count=132, compute_capability=90, max_shared_per_block=227 * 1024,
                            l2_bytes=50 * 1024 * 1024)


def _plan(norm, n, rows, dtype=BF16):
    flags = plans.FLAG_WEIGHT | plans.FLAG_WIDE_RESIDUAL
    return plans.make_plan(norm, dtype, dtype, flags, True, (rows, n), (n, 1), 1, 1, 0, 0, 0, 0, 0, 0, None, None,
                           (1, 1, 1), (0, 0, 0), 0)


@pytest.mark.parametrize("norm, longest", [("rms", 16384), ("ln", 8192)])
def test_the_stream_runs_in_the_cached_tier_whatever_the_rows(norm, longest):
    for n in (64, 1152, longest):
        kernels = {dispatch_rows.choose(_plan(norm, n, rows), H100).steps[0].kernel for rows in (1, 7, 4096)}
        (kernel,) = kernels  # (the launch follows the row alone: batch invariance)
        assert kernel.name == "rows_cached" and "WideResidualLoad<cunorm::bf16_t, float>" in kernel.expression
        assert "AffineStore<cunorm::bf16_t, 1, cunorm::bf16_t>" in kernel.expression  # (not a store bit)
    assert dispatch_rows.choose(_plan(norm, 2 * longest, 64), H100) is None


def test_a_float32_residual_keeps_32_byte_vectors_aligned():
    """r's and h's vectors are twice x's bytes: their alignment counts."""
    flags = plans.FLAG_WIDE_RESIDUAL
    plan = plans.make_plan("rms", BF16, None, flags, True, (4, 64), (64, 1), 1, 1, 0, 0, 16, 0, 0, 0, None, None,
                           (1, 1, 1), (0, 0, 0), 0)
    assert plan.vec == 4  # (r 16 bytes off a 32-byte boundary: vectors of 4 floats)


@pytest.mark.parametrize("kind", ["rms", "ln"])
def test_the_torch_composition_is_the_reference(rng, kind):
    torch = pytest.importorskip("torch")
    from cunorm.torch import _conditioned

    x, r = random(rng, (3, 64), BF16), random(rng, (3, 64), np.float32)
    w = random(rng, (64,), np.float32)
    tx = torch.tensor(x.astype(np.float32)).to(torch.bfloat16).requires_grad_()
    tr, tw = torch.tensor(r), torch.tensor(w)

    def plain(h, w, b, *, axis, eps, residual, return_stats, activation, **options):
        assert residual is None and h.dtype == torch.float32
        if kind == "rms":
            return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w
        return torch.nn.functional.layer_norm(h, h.shape[-1:], w, b, eps)

    y, h = _conditioned.conditioned(kind, plain, tx, tw, None, axis=-1, eps=1e-5, residual=tr, return_stats=False,
                                    epilogue=0, activation=None, shift=None, scale=None, residual_gate=None)
    want_y, want_h = (reference.rms_norm if kind == "rms" else reference.layer_norm)(x, w, residual=r, exact=True)
    assert y.dtype == torch.bfloat16 and h.dtype == torch.float32
    np.testing.assert_array_equal(h.detach().numpy(), want_h)
    np.testing.assert_allclose(y.detach().float().numpy(), want_y, rtol=8e-3, atol=8e-3)


def test_the_jax_composition_is_the_reference(rng):
    jax = pytest.importorskip("jax")
    import cunorm.jax as cj

    jnp = jax.numpy
    x, r = random(rng, (3, 64), BF16), random(rng, (3, 64), np.float32)

    def plain(h, w, b, *, axis, eps, residual, return_stats, activation, **options):
        assert residual is None and h.dtype == jnp.float32
        return h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + eps)

    y, h = cj._conditioned_composed(plain, jnp.asarray(x), None, None, jnp.asarray(r), None, None, None, None,
                                    axis=-1, eps=1e-5, return_stats=False, activation=None)
    want_y, want_h = reference.rms_norm(x, residual=r, exact=True)
    assert y.dtype == jnp.bfloat16 and h.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(h), want_h)
    np.testing.assert_allclose(np.asarray(y).astype(np.float64), want_y, rtol=8e-3, atol=8e-3)
