"""The gated RMSNorm on the GPU: the fused kernel (rows_cached, z read
beside x) against the float64 reference, outputs poisoned first, inputs
never written, batch invariance, the launch cache; torch (fused outside
autograd, the composition's gradients under it, torch.compile), JAX (eager,
jit, grad) and replace_norms on transformers' gated norms."""
import copy

import numpy as np
import pytest

import cunorm
from cunorm import reference
from cunorm._engine import dtypes, plans
from helpers import DTYPE_IDS, DTYPES, RTOL, assert_close, output_scale, random, recording_backend, torch_on_gpu

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

# name: (x shape, weight?, group_size)
CASES = {
    "mamba-2 row": ((3, 17, 1152), True, None),
    "qwen3-next heads": ((2, 9, 8, 128), True, None),
    "groups of a row": ((4, 5, 2048), True, 256),
    "no weight, odd row": ((6, 1000), False, None),
    "decode": ((1, 1, 4096), True, None),
    "longest 16-bit row": ((3, 16384), True, None),
}


def _arrays(rng, case, dtype, wdtype):
    shape, weighted, group = CASES[case]
    x = random(rng, shape, dtype, 2.0, 0.3)
    z = random(rng, shape, dtype, 2.0)
    w = random(rng, shape[-1:], wdtype, 0.5, 1.0) if weighted else None
    return x, z, w, group


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("before", [True, False], ids=["norm-then-gate", "gate-then-norm"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_fused_kernel_matches_the_reference(rng, poisoned, case, before, dtype):
    row = CASES[case][0][-1] if CASES[case][2] is None else CASES[case][2]
    if row > {2: 16384, 4: 8192, 8: 2048}[dtype.itemsize]:
        pytest.skip("past the register budget (test_rows_past_the_register_tier_raise_a_value_error)")
    wdtype = np.float64 if dtype == dtypes.float64 else np.float32
    x, z, w, group = _arrays(rng, case, dtype, wdtype)
    dev = {k: None if v is None else cupy.asarray(v) for k, v in dict(x=x, z=z, w=w).items()}
    before_call = {k: v.copy() for k, v in dev.items() if v is not None}
    out = cupy.full(x.shape, np.nan, x.dtype)
    y, rstd = cunorm.rms_norm(dev["x"], dev["w"], gate=dev["z"], norm_before_gate=before, group_size=group,
                              return_stats=True, out=out)
    assert y is out
    xg, wg, zg = x, w, z
    if group is not None:
        split = x.shape[:-1] + (x.shape[-1] // group, group)
        xg, zg, wg = x.reshape(split), z.reshape(split), None if w is None else w.reshape(-1, group)
    want, want_rstd = reference.rms_norm(xg, wg, gate=zg, norm_before_gate=before, return_stats=True, exact=True)
    want = want.reshape(x.shape)
    assert_close(cupy.asnumpy(y), want, dtype, atol=RTOL[np.dtype(dtype)] * output_scale(want), what="y")
    assert_close(cupy.asnumpy(rstd), want_rstd, dtypes.float32 if dtype != dtypes.float64 else dtype, rtol=1e-4,
                 what="rstd")
    for k, v in before_call.items():  # inputs never written
        assert cupy.array_equal(v, dev[k]), k


@pytest.mark.parametrize("before", [True, False])
def test_16bit_weights_round_where_the_reference_rounds(rng, before):
    """rounding="normalized", weight of x's dtype: the reference's roundings
    (Qwen3-Next's with the gate after the norm, Mamba-2's before), within
    an ulp or two where float32 and float64 rstd round apart."""
    bf16 = dtypes.bfloat16
    x, z, w = random(rng, (64, 2048), bf16, 2.0), random(rng, (64, 2048), bf16, 2.0), random(rng, (2048,), bf16)
    got = cunorm.rms_norm(cupy.asarray(x), cupy.asarray(w), eps=1e-6, rounding="normalized", gate=cupy.asarray(z),
                          norm_before_gate=before)
    want = reference.rms_norm(x, w, eps=1e-6, rounding="normalized", gate=z, norm_before_gate=before)
    ulps = np.abs(cupy.asnumpy(got).view(np.int16).astype(np.int64) - want.view(np.int16).astype(np.int64))
    assert ulps.max() <= 3 and (ulps > 0).mean() <= 0.01, (ulps.max(), (ulps > 0).mean())


def test_each_rows_result_is_the_same_whatever_the_batch(rng):
    x, z = (cupy.asarray(random(rng, (4096, 4096), dtypes.bfloat16)) for _ in range(2))
    w = cupy.asarray(random(rng, (4096,), dtypes.bfloat16))
    for before in (True, False):
        whole = cunorm.rms_norm(x, w, gate=z, norm_before_gate=before)
        for i in (0, 1234, 4095):
            alone = cunorm.rms_norm(x[i:i + 1], w, gate=z[i:i + 1], norm_before_gate=before)
            assert cupy.array_equal(alone.view(cupy.uint16), whole[i:i + 1].view(cupy.uint16))


def test_a_cached_call_replays_what_the_first_computed(rng):
    from cunorm._engine import launch_cache

    x, z, w, _ = (cupy.asarray(a) if a is not None else None
                  for a in _arrays(rng, "mamba-2 row", dtypes.bfloat16, dtypes.bfloat16))
    first = cunorm.rms_norm(x, w, gate=z, norm_before_gate=False)
    key = launch_cache.rows_key("rms", x, w, None, None, -1, 1e-5, False, plans.FLAG_GATE_INPUT,
                                None, conditioned=(None, None, None, z))
    assert launch_cache.ROWS.get(key) is not None
    second = cunorm.rms_norm(x, w, gate=z, norm_before_gate=False)
    assert cupy.array_equal(first.view(cupy.uint16), second.view(cupy.uint16))
    z2 = cupy.asarray(random(rng, z.shape, dtypes.bfloat16))
    got = cunorm.rms_norm(x, w, gate=z2, norm_before_gate=False)  # (new data through the replayed launcher)
    want = reference.rms_norm(cupy.asnumpy(x), cupy.asnumpy(w), gate=cupy.asnumpy(z2), norm_before_gate=False,
                              exact=True)
    assert_close(cupy.asnumpy(got), want, dtypes.bfloat16, atol=8e-3 * output_scale(want), what="y")
    other = cunorm.rms_norm(x, w, gate=z)  # (norm_before_gate is in the signature)
    assert not cupy.array_equal(other.view(cupy.uint16), first.view(cupy.uint16))


def test_a_grouped_call_is_keyed_as_given(rng):
    """group_size: the engine runs the groups' views of the caller's arrays
    and keys the call as given, so a repeated call replays its launcher
    with no reshape, y and h in x's shape, rstd a value a group."""
    from cunorm._engine import launch_cache

    x, z, w, group = (cupy.asarray(a) if isinstance(a, np.ndarray) else a
                      for a in _arrays(rng, "groups of a row", dtypes.bfloat16, dtypes.bfloat16))
    first = cunorm.rms_norm(x, w, gate=z, norm_before_gate=False, group_size=group, return_stats=True)
    key = launch_cache.rows_key("rms", x, w, None, None, -1, 1e-5, True, plans.FLAG_GATE_INPUT, None,
                                conditioned=(None, None, None, z), group=group)
    assert launch_cache.ROWS.get(key) is not None
    y, rstd = cunorm.rms_norm(x, w, gate=z, norm_before_gate=False, group_size=group, return_stats=True)
    assert y.shape == x.shape and rstd.shape == x.shape[:-1] + (x.shape[-1] // group,)
    assert cupy.array_equal(y.view(cupy.uint16), first[0].view(cupy.uint16)) and cupy.array_equal(rstd, first[1])
    split = x.shape[:-1] + (x.shape[-1] // group, group)
    viewed = cunorm.rms_norm(x.reshape(split), w.reshape(-1, group), gate=z.reshape(split), norm_before_gate=False)
    assert cupy.array_equal(y.view(cupy.uint16), viewed.reshape(x.shape).view(cupy.uint16))
    torch = torch_on_gpu()
    import cunorm.torch as cunorm_torch

    t = [torch.from_dlpack(a) for a in (x, w, z)]
    for fn in (cunorm.rms_norm, cunorm_torch.rms_norm):
        got = fn(t[0], t[1], gate=t[2], norm_before_gate=False, group_size=group)
        assert isinstance(got, torch.Tensor) and got.shape == t[0].shape
        assert torch.equal(got.view(torch.int16), torch.from_dlpack(y).view(torch.int16))


def test_rows_past_the_register_tier_raise_a_value_error():
    x = cupy.ones((2, 32768), cupy.float32)
    with pytest.raises(ValueError, match="rows_cached"):
        cunorm.rms_norm(x, gate=x)


# --- the fused backward (rows_grad_gated) -------------------------------------------------------------------------

# name: (x shape, weight?): whole rows (no group_size)
GRAD_CASES = {
    "mamba-2 row": ((3, 17, 1152), True),
    "qwen3-next heads": ((2, 9, 8, 128), True),
    "short rows, no weight": ((37, 96), False),
    "odd row": ((6, 1000), True),
    "decode": ((1, 1, 4096), True),
    "longest 16-bit row": ((3, 16384), True),
    "8-byte vectors of 16-bit data": ((4, 8188), True),
}


def _grad_arrays(rng, shape, weighted, dtype):
    wdtype = np.float64 if dtype == dtypes.float64 else np.float32
    return (random(rng, shape, dtype, 2.0, 0.3), random(rng, shape, dtype, 2.0),
            random(rng, shape[-1:], wdtype, 0.5, 1.0) if weighted else None, random(rng, shape, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("before", [True, False], ids=["norm-then-gate", "gate-then-norm"])
@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_the_fused_backward_matches_the_reference(rng, poisoned, case, before, dtype):
    from cunorm.backward import rms_norm_gated_backward

    shape, weighted = GRAD_CASES[case]
    if shape[-1] > {2: 16384, 4: 8192, 8: 2048}[dtype.itemsize]:
        pytest.skip("past the forward's register budget (test_rows_past_the_register_tier_raise_a_value_error)")
    x, z, w, dy = _grad_arrays(rng, shape, weighted, dtype)
    dev = {k: None if v is None else cupy.asarray(v) for k, v in dict(x=x, z=z, w=w, dy=dy).items()}
    _, rstd = cunorm.rms_norm(dev["x"], dev["w"], gate=dev["z"], norm_before_gate=before, return_stats=True)
    kept = {k: v.copy() for k, v in dev.items() if v is not None}
    got = rms_norm_gated_backward(dev["dy"], dev["x"], rstd, dev["w"], gate=dev["z"], norm_before_gate=before)
    want = reference.rms_norm_gated_backward(dy, x, cupy.asnumpy(rstd), w, gate=z, norm_before_gate=before,
                                             exact=True)
    rtol = RTOL[np.dtype(dtype)]
    for name, g, ref in zip(("dx", "dweight", "dgate"), got, want):
        if ref is None:
            assert g is None, name
            continue
        assert g.dtype == (w.dtype if name == "dweight" else dtype), name
        # (dweight: float32 sums of at most 51 rows, rounded once to the weight's dtype)
        tol = RTOL[np.dtype(w.dtype)] if name == "dweight" else rtol
        assert_close(cupy.asnumpy(g), ref, w.dtype if name == "dweight" else dtype, rtol=tol,
                     atol=tol * output_scale(ref), what=name)
    for k, v in kept.items():  # inputs never written
        assert cupy.array_equal(v, dev[k]), k


@pytest.mark.parametrize("before", [True, False], ids=["norm-then-gate", "gate-then-norm"])
@pytest.mark.parametrize("shape, pshape", [((3, 7, 8, 128), (8, 128)), ((2, 9, 4, 1024), (4, 1024)),
                                           ((2, 5000, 64), (5000, 64))],
                         ids=["heads of 128", "groups of 1024", "more heads than resident blocks"])
def test_the_fused_backward_takes_a_weight_per_head(rng, poisoned, shape, pshape, before):
    """A weight per head or group (bf16 x, float32 weight): dweight of the
    weight's shape, each head's own sum; dx and dgate against the float64
    reference."""
    from cunorm.backward import rms_norm_gated_backward

    bf16 = dtypes.bfloat16
    x, z, dy = random(rng, shape, bf16, 2.0, 0.3), random(rng, shape, bf16, 2.0), random(rng, shape, bf16)
    w = random(rng, pshape, np.float32, 0.5, 1.0)
    dev = {k: cupy.asarray(v) for k, v in dict(x=x, z=z, w=w, dy=dy).items()}
    _, rstd = cunorm.rms_norm(dev["x"], dev["w"], gate=dev["z"], norm_before_gate=before, return_stats=True)
    got = rms_norm_gated_backward(dev["dy"], dev["x"], rstd, dev["w"], gate=dev["z"], norm_before_gate=before)
    want = reference.rms_norm_gated_backward(dy, x, cupy.asnumpy(rstd), w, gate=z, norm_before_gate=before,
                                             exact=True)
    for name, g, ref in zip(("dx", "dweight", "dgate"), got, want):
        assert g.shape == ref.shape, (name, g.shape)
        tol = 1e-4 if name == "dweight" else RTOL[np.dtype(bf16)]
        assert_close(cupy.asnumpy(g), ref, np.float32 if name == "dweight" else bf16, rtol=tol,
                     atol=tol * output_scale(ref), what=name)


def test_the_fused_backward_is_reproducible_and_batch_invariant(rng):
    """Run twice, bitwise the same; each row's dx and dgate the same
    bitwise whatever the rows beside it (dweight sums over all of them)."""
    from cunorm.backward import rms_norm_gated_backward

    bf16 = dtypes.bfloat16
    for shape in ((4096, 1024), (2048, 128)):
        x, z, w, dy = (None if a is None else cupy.asarray(a) for a in _grad_arrays(rng, shape, True, bf16))
        for before in (True, False):
            _, rstd = cunorm.rms_norm(x, w, gate=z, norm_before_gate=before, return_stats=True)
            whole = rms_norm_gated_backward(dy, x, rstd, w, gate=z, norm_before_gate=before)
            again = rms_norm_gated_backward(dy, x, rstd, w, gate=z, norm_before_gate=before)
            for a, b in zip(whole, again):
                assert cupy.array_equal(a, b)
            for i in (0, 1234 % shape[0], shape[0] - 1):
                part = rms_norm_gated_backward(dy[i:i + 1], x[i:i + 1], rstd[i:i + 1], w, gate=z[i:i + 1],
                                               norm_before_gate=before)
                assert cupy.array_equal(part.x.view(cupy.uint16), whole.x[i:i + 1].view(cupy.uint16))
                assert cupy.array_equal(part.gate.view(cupy.uint16), whole.gate[i:i + 1].view(cupy.uint16))


def test_a_cached_backward_replays_what_the_first_computed(rng):
    from cunorm._engine import gated_grad, launch_cache
    from cunorm.backward import rms_norm_gated_backward

    x, z, w, dy = (None if a is None else cupy.asarray(a)
                   for a in _grad_arrays(rng, (64, 1152), True, dtypes.bfloat16))
    _, rstd = cunorm.rms_norm(x, w, gate=z, norm_before_gate=False, return_stats=True)
    first = rms_norm_gated_backward(dy, x, rstd, w, gate=z, norm_before_gate=False)
    key = gated_grad.key(dy, x, rstd, w, z, False, -1)
    assert launch_cache.ROWS_GRAD.get(key) is not None
    second = rms_norm_gated_backward(dy, x, rstd, w, gate=z, norm_before_gate=False)
    assert type(second).__name__ == "GatedGrads"
    for a, b in zip(first, second):
        assert cupy.array_equal(a, b)
    dy2 = cupy.asarray(random(rng, x.shape, dtypes.bfloat16))  # (new data through the replayed launcher)
    got = rms_norm_gated_backward(dy2, x, rstd, w, gate=z, norm_before_gate=False)
    want = reference.rms_norm_gated_backward(cupy.asnumpy(dy2), cupy.asnumpy(x), cupy.asnumpy(rstd),
                                             cupy.asnumpy(w), gate=cupy.asnumpy(z), norm_before_gate=False,
                                             exact=True)
    assert_close(cupy.asnumpy(got.gate), want[2], dtypes.bfloat16, atol=8e-3 * output_scale(want[2]), what="dgate")


def test_rows_past_one_block_raise_a_value_error():
    from cunorm.backward import rms_norm_gated_backward

    x = cupy.ones((2, 16386), cupy.float16)  # (a row of 16386 elements: vectors of 2, too many for one block)
    with pytest.raises(ValueError, match="rows one block holds"):
        rms_norm_gated_backward(x, x, cupy.ones(2, cupy.float32), gate=x)


# --- torch ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("before", [True, False])
@pytest.mark.parametrize("case", ["mamba-2 row", "groups of a row"])
def test_torch_runs_fused_and_differentiates(rng, case, before):
    """Whole rows, and groups with a weight a group: GatedRowNorm (the
    fused backward), against torch's autograd of the formula in float64."""
    torch = torch_on_gpu()
    x, z, w, group = _arrays(rng, case, np.float32, np.float32)
    t = {k: torch.tensor(v, device="cuda") for k, v in dict(x=x, z=z, w=w).items()}
    fused = cunorm.rms_norm(t["x"], t["w"], gate=t["z"], norm_before_gate=before, group_size=group)
    want = cunorm.rms_norm(cupy.asarray(x), cupy.asarray(w), gate=cupy.asarray(z), norm_before_gate=before,
                           group_size=group)
    assert torch.equal(fused, torch.as_tensor(want, device="cuda"))  # (the same kernel)
    leaves = {k: v.clone().requires_grad_() for k, v in t.items()}
    y, rstd = cunorm.rms_norm(leaves["x"], leaves["w"], gate=leaves["z"], norm_before_gate=before,
                              group_size=group, return_stats=True)
    node = y.grad_fn
    while "View" in type(node).__name__:  # (the groups' view back to x's shape)
        node = node.next_functions[0][0]
    assert "GatedRowNorm" in type(node).__name__, type(node).__name__
    torch.testing.assert_close(y, fused, rtol=2e-6, atol=2e-6 * float(fused.abs().max()))
    dy = torch.randn_like(y)
    grads = torch.autograd.grad((y * dy).sum(), list(leaves.values()))
    doubles = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}
    ref = cunorm.rms_norm(doubles["x"], doubles["w"], gate=doubles["z"], norm_before_gate=before, group_size=group)
    ref_grads = torch.autograd.grad((ref * dy.double()).sum(), list(doubles.values()))
    for name, g, rg in zip(leaves, grads, ref_grads):
        torch.testing.assert_close(g.double(), rg, rtol=2e-4, atol=2e-4 * float(rg.abs().max()), msg=name)


@pytest.mark.parametrize("before", [True, False])
def test_torch_fused_backward_in_bf16_with_the_weight_offset(rng, before):
    """bf16 Qwen3-Next-like heads, rounding="normalized", weight_offset=1:
    the fused gradients against torch's autograd of the same call in
    float64 (the kernel's weight 1 + w, dweight back in w's dtype)."""
    torch = torch_on_gpu()
    bf16 = dtypes.bfloat16
    x, z, _, dy = _grad_arrays(rng, (4, 33, 4, 128), False, bf16)
    w = random(rng, (128,), bf16, 0.3)
    leaves = [torch.tensor(a.astype(np.float32), device="cuda").to(torch.bfloat16).requires_grad_() for a in (x, z, w)]
    kw = dict(norm_before_gate=before, weight_offset=1, rounding="normalized", eps=1e-6)
    y = cunorm.rms_norm(leaves[0], leaves[2], gate=leaves[1], **kw)
    assert "GatedRowNorm" in type(y.grad_fn).__name__
    t_dy = torch.tensor(dy.astype(np.float32), device="cuda").to(torch.bfloat16)
    grads = torch.autograd.grad(y, leaves, t_dy)
    doubles = [a.detach().double().requires_grad_() for a in leaves]
    ref = cunorm.rms_norm(doubles[0], doubles[2], gate=doubles[1], **kw)
    ref_grads = torch.autograd.grad(ref, doubles, t_dy.double())
    for name, g, rg in zip(("dx", "dgate", "dweight"), grads, ref_grads):
        assert g.dtype == torch.bfloat16, name
        # (the float64 reference skips the forward's bf16 roundings: a few bf16 ulps apart)
        torch.testing.assert_close(g.double(), rg, rtol=2e-2, atol=2e-2 * float(rg.abs().max()), msg=name)


def test_torch_compile_runs_the_fused_operator(rng):
    """Traced outside autograd, the gated norm is one registered operator
    (over the groups' views): bitwise the eager call's results."""
    torch = torch_on_gpu()
    x, z, w, _ = _arrays(rng, "qwen3-next heads", np.float32, np.float32)
    t = [torch.tensor(a, device="cuda") for a in (x, z, w)]

    def block(x, z, w):
        return cunorm.rms_norm(x, w, gate=z, norm_before_gate=False, group_size=32)

    traced = []
    got = torch.compile(block, backend=recording_backend(traced), fullgraph=True)(*t)
    assert any("rms_norm_conditioned" in target for target in traced), traced
    assert torch.equal(got, block(*t))


@pytest.mark.parametrize("case, group, kw", [
    ("mamba-2 row", None, dict(norm_before_gate=False)),
    ("qwen3-next heads", None, dict(weight_offset=1, rounding="normalized", eps=1e-6)),
    ("no weight, odd row", None, dict(norm_before_gate=True)),
    ("groups of a row", 256, dict(norm_before_gate=False)),
], ids=["gate-then-norm", "heads-offset", "no-weight", "groups-with-a-weight"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_compile_differentiates_through_the_fused_backward(rng, monkeypatch, case, group, kw, dtype):
    """Where autograd records under torch.compile, whole rows and groups
    (a weight a group included) run the registered operator and its
    autograd formula (rms_norm_gated_backward): the eager route's kernels,
    so y and the gradients bitwise."""
    torch = torch_on_gpu()
    from cunorm._engine import calls

    ran = []
    fused = calls.rows_grad_gated
    monkeypatch.setattr(calls, "rows_grad_gated", lambda *a: ran.append(1) or fused(*a))
    x, z, w, _ = _arrays(rng, case, np.float32, np.float32)
    tdtype = getattr(torch, dtype)
    leaves = {k: torch.tensor(v, device="cuda").to(tdtype).requires_grad_() for k, v in dict(x=x, z=z, w=w).items()
              if v is not None}

    def call(a):
        return cunorm.torch.rms_norm(a["x"], a.get("w"), gate=a["z"], group_size=group, **kw)

    traced = []
    y = torch.compile(call, backend=recording_backend(traced), fullgraph=True)(leaves)
    assert any("rms_norm_conditioned" in target for target in traced), traced
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, list(leaves.values()), dy)
    assert ran
    eager = call(leaves)
    pairs = [("y", y, eager)] + list(zip(leaves, grads, torch.autograd.grad(eager, list(leaves.values()), dy)))
    for name, got, want in pairs:
        assert got.dtype == want.dtype and torch.equal(got, want), name


# --- JAX -----------------------------------------------------------------------------------------------------------


def test_jax_eager_jit_and_grad(rng):
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    import cunorm.jax as cj

    jnp = jax.numpy
    x, z, w, group = _arrays(rng, "groups of a row", np.float32, np.float32)
    args = [jnp.asarray(a) for a in (x, z, w)]

    def block(x, z, w):
        return cj.rms_norm(x, w, gate=z, group_size=group)

    split = x.shape[:-1] + (x.shape[-1] // group, group)
    want = reference.rms_norm(x.reshape(split), w.reshape(-1, group), gate=z.reshape(split), exact=True)
    for got in (block(*args), jax.jit(block)(*args)):
        assert_close(np.asarray(got), want.reshape(x.shape), np.float32, atol=2e-5 * output_scale(want), what="y")

    def loss_xla(x, z, w):
        h = x.reshape(split)
        y = (h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-5)).reshape(x.shape)
        return jnp.sum((y * w * jax.nn.silu(z)) ** 2)

    grad = jax.grad(lambda *a: jnp.sum(block(*a) ** 2), argnums=(0, 1, 2))
    assert "cunorm_rows_grad_gated" in str(jax.make_jaxpr(grad)(*args))  # (a weight a group: the fused backward)
    grads = jax.jit(grad)(*args)
    ref = jax.jit(jax.grad(loss_xla, argnums=(0, 1, 2)))(*args)
    for g, rg in zip(grads, ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(rg), rtol=2e-3,
                                   atol=2e-3 * float(np.abs(np.asarray(rg)).max()))


@pytest.mark.parametrize("before", [True, False], ids=["norm-then-gate", "gate-then-norm"])
@pytest.mark.parametrize("offset", [0, 1], ids=["weight", "1 + weight"])
def test_jax_grad_runs_the_fused_backward(rng, before, offset):
    """jax.grad of a gated call over whole rows binds rows_grad_gated's
    primitive (eager and inside jit), its gradients the float64
    reference's."""
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    import cunorm.jax as cj

    jnp = jax.numpy
    x, z, w, dy = _grad_arrays(rng, (3, 17, 1152), True, np.float32)
    args = [jnp.asarray(a) for a in (x, z, w)]

    def loss(x, z, w):
        return jnp.sum(cj.rms_norm(x, w, gate=z, norm_before_gate=before, weight_offset=offset) * dy)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    assert "cunorm_rows_grad_gated" in str(jax.make_jaxpr(grad)(*args))
    w_eff = w.astype(np.float64) + offset
    _, rstd = reference.rms_norm(x, w_eff, gate=z, norm_before_gate=before, return_stats=True, exact=True)
    want = reference.rms_norm_gated_backward(dy, x, rstd, w_eff, gate=z, norm_before_gate=before, exact=True)
    for got in (grad(*args), jax.jit(grad)(*args)):
        for name, g, ref in zip(("dx", "dgate", "dweight"), got, (want[0], want[2], want[1])):
            assert_close(np.asarray(g), ref, np.float32, atol=2e-5 * output_scale(ref), what=name)


# --- replace_norms -------------------------------------------------------------------------------------------------

GATED = [("qwen3_next", "Qwen3NextRMSNormGated"), ("mamba2", "MambaRMSNormGated")]


@pytest.mark.parametrize("family,name", GATED, ids=[n for _, n in GATED])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_transformers_gated_norms(rng, family, name, dtype):
    torch = torch_on_gpu()
    import importlib

    from test_zoo_gpu import assert_within_one_ulp

    try:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError:
        pytest.skip(f"transformers has no {family}")
    dtype = getattr(torch, dtype)
    layer = getattr(module, name)(128, eps=1e-6).cuda().to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(random(rng, (128,), np.float32, 0.3, 1.0)))
    original = copy.deepcopy(layer)
    import cunorm.torch as cunorm_torch

    assert cunorm_torch.replace_norms(layer, report=True).replaced == {"": f"{type(original).__module__}.{name}"}
    x = torch.tensor(random(rng, (64, 128), np.float32, 3.0), device="cuda").to(dtype)
    z = torch.tensor(random(rng, (64, 128), np.float32, 2.0), device="cuda").to(dtype)
    with torch.no_grad():
        assert_within_one_ulp(layer(x, z), original(x, z), f"{name} {dtype}", ulps_allowed=3)
        if family == "mamba2":  # (no gate: Llama's RMSNorm)
            assert_within_one_ulp(layer(x), original(x), f"{name} {dtype} no gate", ulps_allowed=2)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    g = [torch.autograd.grad(m(xi, z).float().square().sum(), (xi, m.weight)) for m, xi in ((layer, xs[0]),
                                                                                            (original, xs[1]))]
    for a, t in zip(*g):
        torch.testing.assert_close(a.float(), t.float(), rtol=3e-2, atol=3e-2 * float(t.float().abs().max()))
