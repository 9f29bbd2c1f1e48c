"""The float32 residual stream (a float32 residual under 16-bit x: h = x +
r in float32, returned, normalized; y in x's dtype) on the CPU: the
reference, the NumPy path, the checks, the dispatch (rows_cached alone),
and the torch and JAX compositions under autograd and tracing."""
import numpy as np
import pytest

import cunorm
from cunorm import reference
from cunorm._engine import catalogue, dispatch_rows, dtypes, plans
from helpers import arr, dispatch_recorder, random

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


# -- the fused backward (wide_grad.py, rows_grad_wide) --------------------------------------------------------------

@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("with_dh", [True, False])
def test_the_backward_is_the_norms_gradient_of_h_twice(rng, kind, with_dh):
    """NumPy arrays: the float64 gradient of h (the norm's of dy, plus dh),
    x's rounded once to x's dtype, the residual's to float32."""
    from cunorm import backward

    x, r = random(rng, (4, 3, 96), BF16), random(rng, (4, 3, 96), np.float32, 20.0)
    w, b = random(rng, (96,), BF16, 0.5, 1.0), random(rng, (96,), np.float32)
    dy = random(rng, (4, 3, 96), BF16)
    dh = random(rng, (4, 3, 96), np.float32) if with_dh else None
    if kind == "rms":
        _, h, rstd = cunorm.rms_norm(x, w, residual=r, return_stats=True)
        got = backward.rms_norm_float32_residual_backward(dy, h, rstd, w, dh=dh)
        want, dw = reference.rms_norm_backward(dy, h, rstd, w, dh=dh, exact=True)
        db = None
    else:
        _, h, mean, rstd = cunorm.layer_norm(x, w, b, residual=r, return_stats=True)
        got = backward.layer_norm_float32_residual_backward(dy, h, mean, rstd, w, b, dh=dh)
        want, dw, db = reference.layer_norm_backward(dy, h, mean, rstd, w, b, dh=dh, exact=True)
    assert got.x.dtype == BF16 and got.residual.dtype == np.float32
    np.testing.assert_array_equal(got.x.view(np.uint16), want.astype(BF16).view(np.uint16))
    np.testing.assert_array_equal(got.residual, want.astype(np.float32))
    np.testing.assert_array_equal(got.weight.view(np.uint16), dw.astype(BF16).view(np.uint16))
    if kind == "ln":
        np.testing.assert_array_equal(got.bias, db.astype(np.float32))
    else:
        assert got.bias is None


@pytest.mark.parametrize("change, error, match", [
    ({"h": BF16}, TypeError, "h must be float32"),
    ({"dy": np.float32}, TypeError, "dy must have x's 16-bit dtype"),
    ({"dh": BF16}, TypeError, "dh must have h's dtype float32"),
    ({"dh_shape": (2, 5, 8)}, ValueError, r"dh must have h's shape \(2, 5, 16\)"),
    ({"dy_shape": (2, 16)}, ValueError, r"dy must have h's shape \(2, 5, 16\)"),
    ({"axis": (0, 1)}, ValueError, "normalize over the trailing axes"),
    ({"rstd": np.float64}, TypeError, "rstd must have dtype float32"),
])
def test_bad_backward_arguments_are_refused(xp, change, error, match):
    from cunorm import backward

    shape = (2, 5, 16)
    h = arr(xp, shape, change.get("h", np.float32))
    dy = arr(xp, change.get("dy_shape", shape), change.get("dy", BF16))
    dh = arr(xp, change.get("dh_shape", shape), change.get("dh", np.float32))
    axis = change.get("axis", -1)
    rstd = arr(xp, (16,) if axis == (0, 1) else (2, 5), change.get("rstd", np.float32))
    with pytest.raises(error, match=match):
        backward.rms_norm_float32_residual_backward(dy, h, rstd, axis=axis, dh=dh)


def test_the_backward_runs_rows_grad_wide_whatever_the_batch():
    """rows_grad_wide over rows of up to 8192 elements (16 float32 h a
    thread), the same kernel for any number of rows; None past them."""
    from cunorm._engine import wide_grad

    for n in (64, 1000, 1152, 4096, 8192):
        vec = plans.vector_width(2, n, [], [])
        kernels = {wide_grad.choose("ln", BF16, BF16, plans.FLAG_WEIGHT | plans.FLAG_BIAS, rows, n, vec,
                                    H100).steps[0].kernel for rows in (1, 7, 4096)}
        (kernel,) = kernels
        assert kernel.name == "rows_grad_wide" and kernel.cooperative
        assert kernel in set(catalogue.wide_grad_kernels())
        assert wide_grad.fits(n)
    assert wide_grad.choose("rms", BF16, None, 0, 64, 16384, 8, H100) is None and not wide_grad.fits(16384)
    # the next row fetched into L2 for one vector a thread or a block alone on its SM only
    fetched = {n: wide_grad.choose("rms", BF16, BF16, plans.FLAG_WEIGHT, 32768, n, 8, H100).prefetch_next
               for n in (1152, 3072, 4096, 8192)}
    assert fetched == {1152: True, 3072: False, 4096: False, 8192: True}
    assert not wide_grad.fusable((4, 8192), 0, 0) and wide_grad.fusable((4, 3, 8192), 2, 2)


@pytest.mark.parametrize("kind", ["rms", "ln"])
def test_the_torch_operator_differentiates_through_the_stream_backward(kind):
    """torch.ops.cunorm.{rms,layer}_norm with a float32 residual under bf16
    x, where autograd records (as torch.compile traces it): its formula
    calls the stream's backward operator (the fakes on meta tensors: no
    GPU), dx in bf16, dresidual in float32."""
    torch = pytest.importorskip("torch")
    import cunorm.torch  # noqa: F401  (registers the operators)

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, device="meta", dtype=dtype).requires_grad_()

    x, r, w, b = meta(3, 5, 256), meta(3, 5, 256, dtype=torch.float32), meta(256), meta(256)
    if kind == "rms":
        y, h, _ = torch.ops.cunorm.rms_norm(x, w, r, [-1], 1e-5, True, 0)
        leaves = (x, r, w)
    else:
        y, h, _, _ = torch.ops.cunorm.layer_norm(x, w, b, r, [-1], 1e-5, True, 0)
        leaves = (x, r, w, b)
    assert h.dtype == torch.float32
    with dispatch_recorder() as recording:
        grads = torch.autograd.grad((y, h), leaves, (torch.empty_like(y), torch.empty_like(h)))
    name = "rms_norm" if kind == "rms" else "layer_norm"
    assert [str(f) for f in recording.called if "cunorm" in f] == [f"cunorm.{name}_float32_residual_backward.default"]
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.float32] + [torch.bfloat16] * (len(leaves) - 2)
    assert all(tuple(g.shape) == tuple(a.shape) for g, a in zip(grads, leaves))
