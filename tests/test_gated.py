"""The gated RMSNorm (``gate=``, ``norm_before_gate=``, ``group_size=``)
on the CPU: the reference against the formula, the NumPy path, the checks,
the dispatch (rows_cached alone, the row's budget), and the unfused
compositions the torch and JAX front ends run under autograd and tracing
against the reference and Qwen3-Next's rounding."""
import numpy as np
import pytest

import cunorm
from cunorm import reference
from cunorm._engine import conditioning, dispatch_rows, dtypes, plans
from helpers import arr, dispatch_recorder, random


def _silu(z):
    return z / (1.0 + np.exp(-z))


def _formula(x, w, z, before, eps=1e-5, group=None):
    """The float64 gated RMSNorm, written out."""
    x, z = x.astype(np.float64), _silu(z.astype(np.float64))
    h = x if before else x * z
    shape = h.shape
    if group is not None:
        h = h.reshape(shape[:-1] + (shape[-1] // group, group))
    y = (h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps)).reshape(shape)
    if w is not None:
        y = y * w.astype(np.float64)
    return y * z if before else y


@pytest.mark.parametrize("before", [True, False])
@pytest.mark.parametrize("weighted", [True, False])
def test_the_reference_is_the_formula(rng, before, weighted):
    x, z = random(rng, (3, 7, 48), np.float32), random(rng, (3, 7, 48), np.float32, 2.0)
    w = random(rng, (48,), np.float32) if weighted else None
    y = reference.rms_norm(x, w, gate=z, norm_before_gate=before, exact=True)
    np.testing.assert_allclose(y, _formula(x, w, z, before), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("before", [True, False])
def test_the_numpy_path_runs_the_reference_in_groups(rng, before):
    x, z, w = random(rng, (2, 5, 64), np.float32), random(rng, (2, 5, 64), np.float32), random(rng, (64,), np.float32)
    out = np.full(x.shape, np.nan, np.float32)
    y, rstd = cunorm.rms_norm(x, w, gate=z, norm_before_gate=before, group_size=16, return_stats=True, out=out)
    assert y is out and rstd.shape == (2, 5, 4)
    np.testing.assert_allclose(y, _formula(x, w, z, before, group=16), rtol=2e-6, atol=2e-6)
    h = (x if before else x * _silu(z.astype(np.float64))).reshape(2, 5, 4, 16)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(np.mean(h.astype(np.float64) ** 2, -1) + 1e-5), rtol=1e-6)


def test_qwen3_next_rounding_in_the_reference(rng):
    """rounding="normalized" with a weight of x's 16-bit dtype and the gate
    after the norm: the weighted value is rounded to x's dtype before the
    gate multiplies (`weight * h.to(dtype)` in bfloat16)."""
    bf16 = dtypes.bfloat16
    x, z, w = (random(rng, (4, 96), bf16) for _ in range(3))
    xf = x.astype(np.float64)
    normalized = (xf / np.sqrt(np.mean(xf * xf, -1, keepdims=True) + 1e-6)).astype(bf16).astype(np.float64)
    weighted = (normalized * w.astype(np.float64)).astype(bf16).astype(np.float64)
    want = (weighted * _silu(z.astype(np.float64))).astype(bf16)
    got = reference.rms_norm(x, w, eps=1e-6, rounding="normalized", gate=z)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"gate": (2, 5, 8)}, ValueError, r"gate must have x's shape \(2, 5, 16\), got \(2, 5, 8\)"),
    ({"gate": (2, 5, 16), "residual": (2, 5, 16)}, ValueError, "gate= takes no residual"),
    ({"gate": (2, 5, 16), "shift": (2, 1, 16)}, ValueError, "gate= takes no shift"),
    ({"gate": (2, 5, 16), "activation": "silu"}, ValueError, "gate= takes no activation"),
    ({"gate": (2, 5, 16), "axis": 1}, ValueError, "normalize over the trailing axes"),
    ({"gate": (2, 5, 16), "quantize": "int8"}, ValueError, "quantize= takes no"),
    ({"gate": (2, 5, 16), "norm_before_gate": 0}, TypeError, "norm_before_gate must be True or False"),
    ({"group_size": 5}, ValueError, "group_size must be a positive divisor of x's last extent 16, got 5"),
    ({"group_size": 0}, ValueError, "positive divisor"),
    ({"group_size": 4.0}, TypeError, "group_size must be an int"),
    ({"group_size": 4, "axis": 1}, ValueError, "pass axis=-1"),
    ({"group_size": 4, "weight": (4, 4)}, ValueError, r"weight must have the shape of x's last axis \(16,\)"),
])
def test_bad_gates_and_groups_are_refused_before_anything_runs(xp, kwargs, error, match):
    x = arr(xp, (2, 5, 16))
    given = {k: arr(xp, v) if isinstance(v, tuple) else v for k, v in kwargs.items()}
    with pytest.raises(error, match=match):
        cunorm.rms_norm(x, **given)


def test_a_gate_of_another_dtype_is_a_type_error(xp):
    x = arr(xp, (2, 5, 16))
    with pytest.raises(TypeError, match="gate must have x's dtype float32, got float64"):
        cunorm.rms_norm(x, gate=xp.zeros((2, 5, 16)))


def test_the_engine_refuses_a_gate_on_another_norm(xp):
    from cunorm._engine import row_norms

    x = arr(xp, (2, 5, 16))
    with pytest.raises(ValueError, match="not the ln norm's"):
        row_norms.Call("ln", x, -1, 1e-5, None, conditioned={"gate": xp.zeros(x.shape, x.dtype)})


def test_a_non_contiguous_out_is_refused_with_groups(xp):
    x = arr(xp, (2, 5, 16))
    out = xp.zeros((2, 5, 32), np.float32)[..., ::2]
    with pytest.raises(ValueError, match="out must be C-contiguous"):
        cunorm.rms_norm(x, group_size=4, out=out)


H100 = dispatch_rows.Device(sm_count=132, compute_capability=90, max_shared_per_block=227 * 1024,
                            l2_bytes=50 * 1024 * 1024)


def _gated_plan(dtype, n, rows, extra=0):
    flags = plans.FLAG_WEIGHT | plans.FLAG_GATE | extra
    return plans.make_plan("rms", dtype, dtype, flags, False, (rows, n), (n, 1), 1, 1, 0, 0, 0, 0, 0, 0, None,
                           None, (1, 1, 1), (0, 0, 0), 0)


@pytest.mark.parametrize("n", [64, 1152, 4096, 16384])
@pytest.mark.parametrize("extra", [0, plans.FLAG_GATE_INPUT | plans.FLAG_ROUND_NORMALIZED])
def test_gated_rows_take_the_cached_tier_whatever_the_rows(n, extra):
    kernels = set()
    for rows in (1, 7, 4096):
        launch = dispatch_rows.choose(_gated_plan(dtypes.bfloat16, n, rows, extra), H100)
        assert launch.tier == "cached"
        kernels.add(launch.steps[0].kernel)
    (kernel,) = kernels  # (the launch follows the row alone: batch invariance)
    assert f"AffineStore<cunorm::bf16_t, {plans.FLAG_WEIGHT | plans.FLAG_GATE | extra}," in kernel.expression
    assert "XLoad" in kernel.expression


@pytest.mark.parametrize("dtype, longest", [(dtypes.bfloat16, 16384), (dtypes.float32, 8192),
                                            (dtypes.float64, 2048)])
def test_the_longest_gated_rows(dtype, longest):
    """The register budget (z held beside x, as a residual): the docstring's bounds."""
    assert dispatch_rows.choose(_gated_plan(dtype, longest, 64), H100).tier == "cached"
    assert dispatch_rows.choose(_gated_plan(dtype, 2 * longest, 64), H100) is None


def _composed(rng, before, normalized, dtype=np.float32):
    x, z = random(rng, (3, 40), dtype), random(rng, (3, 40), dtype, 2.0)
    w = random(rng, (40,), dtype)
    return x, z, w


@pytest.mark.parametrize("before", [True, False])
@pytest.mark.parametrize("normalized", [False, True])
def test_the_torch_composition_is_the_reference(rng, before, normalized):
    """Where autograd records: the plain norm (here torch's formula on the
    CPU) over x (or x * silu(z)) in float32 and torch's ops around it."""
    torch = pytest.importorskip("torch")
    from cunorm.torch import _conditioned

    x, z, w = _composed(rng, before, normalized)
    tx, tz, tw = (torch.tensor(a) for a in (x, z, w))
    tx.requires_grad_()  # (autograd records: the composition)

    def plain(h, w, b, *, axis, eps, return_stats, **options):
        assert w is None and b is None and h.dtype == torch.float32
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (h * rstd, rstd[..., 0]) if return_stats else h * rstd

    epilogue = plans.rms_epilogue(0, "normalized" if normalized else "output", None, True, z, before)
    y, rstd = _conditioned.conditioned("rms", plain, tx, tw, None, axis=-1, eps=1e-5, residual=None,
                                       return_stats=True, epilogue=epilogue, activation=None, shift=None,
                                       scale=None, residual_gate=None, gate=tz)
    want, want_rstd = reference.rms_norm(x, w, gate=z, norm_before_gate=before, return_stats=True,
                                         rounding="normalized" if normalized else "output")
    np.testing.assert_allclose(y.detach().numpy(), want, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(rstd.detach().numpy(), want_rstd, rtol=1e-6)


def test_the_torch_composition_rounds_as_qwen3_next(rng):
    """bfloat16 x, z and weight, rounding="normalized": bitwise
    Qwen3NextRMSNormGated's formula (its float32 mean in place of cunorm's
    statistic, which is the only difference)."""
    torch = pytest.importorskip("torch")
    from cunorm.torch import _conditioned

    x, z, w = (torch.tensor(random(rng, (5, 64), np.float32)).to(torch.bfloat16) for _ in range(3))
    w.requires_grad_()  # (autograd records: the composition)

    def plain(h, w, b, *, axis, eps, return_stats, **options):
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)

    epilogue = plans.rms_epilogue(0, "normalized", None, True, z, True)
    y = _conditioned.conditioned("rms", plain, x, w, None, axis=-1, eps=1e-6, residual=None, return_stats=False,
                                 epilogue=epilogue, activation=None, shift=None, scale=None, residual_gate=None,
                                 gate=z)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    want = ((w * h.to(torch.bfloat16)) * torch.nn.functional.silu(z.to(torch.float32))).to(torch.bfloat16)
    assert torch.equal(y.detach().view(torch.int16), want.detach().view(torch.int16))


@pytest.mark.parametrize("offset", [False, True])
def test_the_torch_operator_differentiates_through_the_gated_backward(offset):
    """torch.ops.cunorm.rms_norm_conditioned with a gate, where autograd
    records (as torch.compile traces it): its formula calls
    rms_norm_gated_backward (the fakes on meta tensors: no GPU), each
    gradient in its input's shape and dtype, a weight a head's too."""
    torch = pytest.importorskip("torch")
    import cunorm.torch  # noqa: F401  (registers the operators)

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, device="meta", dtype=dtype).requires_grad_()

    x, z, w = meta(3, 5, 256), meta(3, 5, 256), meta(256)
    epilogue = plans.rms_epilogue(1 if offset else 0, "output", None, True, z, not offset)
    y, rstd = torch.ops.cunorm.rms_norm_conditioned(x, w, None, None, None, None, z, [-1], 1e-5, True, epilogue)
    with dispatch_recorder() as recording:
        grads = torch.autograd.grad(y, (x, w, z), torch.empty_like(y))
    assert [str(f) for f in recording.called if "cunorm" in f] == ["cunorm.rms_norm_gated_backward.default"]
    assert [(tuple(g.shape), g.dtype) for g in grads] == [((3, 5, 256), torch.bfloat16), ((256,), torch.bfloat16),
                                                          ((3, 5, 256), torch.bfloat16)]
    heads = meta(2, 128, dtype=torch.float32)  # (a weight a group of 128)
    y, _ = torch.ops.cunorm.rms_norm_conditioned(x.view(3, 5, 2, 128), heads, None, None, None, None,
                                                 z.view(3, 5, 2, 128), [-1], 1e-5, True, epilogue)
    grads = torch.autograd.grad(y, (x, heads, z), torch.empty_like(y))
    assert [(tuple(g.shape), g.dtype) for g in grads] == [((3, 5, 256), torch.bfloat16), ((2, 128), torch.float32),
                                                          ((3, 5, 256), torch.bfloat16)]


@pytest.mark.parametrize("before", [True, False])
def test_the_jax_composition_is_the_reference(rng, before):
    jax = pytest.importorskip("jax")
    import cunorm.jax as cj

    jnp = jax.numpy
    x, z, w = _composed(rng, before, False)

    def plain(h, w, b, *, axis, eps, return_stats, **options):
        assert w is None and b is None
        return h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + eps)

    y = cj._conditioned_composed(plain, jnp.asarray(x), jnp.asarray(w), None, None, None, None, None,
                                 jnp.asarray(z), axis=-1, eps=1e-5, return_stats=False, activation=None,
                                 norm_before_gate=before)
    np.testing.assert_allclose(np.asarray(y), _formula(x, w, z, before), rtol=2e-6, atol=2e-6)


def test_groups_split_and_join_any_array_kind():
    x, w, z = np.zeros((2, 3, 12)), np.arange(12.0), np.ones((2, 3, 12))
    xs, ws, zs, rs, outs = conditioning.split_groups(4, x, w, z, None, None, -1)
    assert xs.shape == zs.shape == (2, 3, 3, 4) and ws.shape == (3, 4) and rs is None and outs is None
    assert np.shares_memory(xs, x)
    y, rstd = conditioning.join_groups((xs, np.ones((2, 3, 3))), (2, 3, 12), 1)
    assert y.shape == (2, 3, 12) and rstd.shape == (2, 3, 3)
    assert conditioning.requested(None, None, -1, None, None, None, z)
