"""The float32 residual stream on the GPU: the fused kernel (rows_cached,
WideResidualLoad) against the float64 reference, h bitwise float32's x +
r, outputs poisoned first, inputs never written, batch invariance, the
launch cache; the fused backward (rows_grad_wide); torch (fused forward
and backward, eager and torch.compile) and JAX (eager, jit, grad)."""
import numpy as np
import pytest

import cunorm
from cunorm import reference
from cunorm._engine import dtypes
from helpers import RTOL, assert_close, output_scale, random, recording_backend, torch_on_gpu

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

HALF = [dtypes.bfloat16, dtypes.float16]
SHAPES = [(3, 17, 1152), (2, 5, 4096), (1, 1, 8192), (7, 1000), (2, 3, 16384)]


def _arrays(rng, shape, dtype, wdtype):
    x = random(rng, shape, dtype, 1.0)
    r = random(rng, shape, np.float32, 30.0, 3.0)  # (a residual stream much larger than x)
    w, b = random(rng, shape[-1:], wdtype, 0.5, 1.0), random(rng, shape[-1:], wdtype)
    return x, r, w, b


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "f16"])
@pytest.mark.parametrize("wdtype", ["x", "f32"])
@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_the_fused_kernel_matches_the_reference(rng, poisoned, shape, kind, wdtype, dtype):
    if kind == "ln" and shape[-1] > 8192:
        pytest.skip("past LayerNorm's register budget (test_long_rows_raise_a_value_error)")
    x, r, w, b = _arrays(rng, shape, dtype, dtype if wdtype == "x" else np.float32)
    dev = {k: cupy.asarray(v) for k, v in dict(x=x, r=r, w=w, b=b).items()}
    before = {k: v.copy() for k, v in dev.items()}
    if kind == "rms":
        y, h, rstd = cunorm.rms_norm(dev["x"], dev["w"], residual=dev["r"], return_stats=True)
        want = reference.rms_norm(x, w, residual=r, return_stats=True, exact=True)
    else:
        y, h, mean, rstd = cunorm.layer_norm(dev["x"], dev["w"], dev["b"], residual=dev["r"], return_stats=True)
        want = reference.layer_norm(x, w, b, residual=r, return_stats=True, exact=True)
    assert y.dtype == dtype and h.dtype == np.float32
    # h: one float32 add of x and r, bitwise
    assert np.array_equal(cupy.asnumpy(h), x.astype(np.float32) + r)
    assert_close(cupy.asnumpy(y), want[0], dtype, atol=RTOL[np.dtype(dtype)] * output_scale(want[0]), what="y")
    assert_close(cupy.asnumpy(rstd), want[-1], dtypes.float32, rtol=1e-4, what="rstd")
    for k, v in before.items():
        assert cupy.array_equal(v, dev[k]), k


def test_each_rows_result_is_the_same_whatever_the_batch(rng):
    x, r, w, _ = (cupy.asarray(a) for a in _arrays(rng, (4096, 4096), dtypes.bfloat16, dtypes.bfloat16))
    y, h = cunorm.rms_norm(x, w, residual=r)
    for i in (0, 1234, 4095):
        y1, h1 = cunorm.rms_norm(x[i:i + 1], w, residual=r[i:i + 1])
        assert cupy.array_equal(y1.view(cupy.uint16), y[i:i + 1].view(cupy.uint16))
        assert cupy.array_equal(h1, h[i:i + 1])


def test_a_cached_call_replays_what_the_first_computed(rng):
    from cunorm._engine import launch_cache

    x, r, w, b = (cupy.asarray(a) for a in _arrays(rng, (3, 9, 2048), dtypes.bfloat16, dtypes.bfloat16))
    first = cunorm.layer_norm(x, w, b, residual=r)
    assert launch_cache.ROWS.get(launch_cache.rows_key("ln", x, w, b, r, -1, 1e-5, False, 0, None)) is not None
    second = cunorm.layer_norm(x, w, b, residual=r)
    for a, c in zip(first, second):
        assert cupy.array_equal(a, c)
    r2 = cupy.asarray(random(rng, r.shape, np.float32, 30.0))
    y, h = cunorm.layer_norm(x, w, b, residual=r2)  # (new data through the replayed launcher)
    assert cupy.array_equal(h, x.astype(cupy.float32) + r2)


def test_long_rows_raise_a_value_error():
    x = cupy.ones((2, 16384), dtypes.bfloat16)
    with pytest.raises(ValueError, match="float32 residual"):
        cunorm.layer_norm(x, residual=cupy.zeros((2, 16384), cupy.float32))


@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_torch_runs_fused_forward_and_backward(rng, kind, compiled):
    """Outside autograd the fused forward (the conditioned operator under
    dynamo); where autograd records the stream's own Function (eager) or
    the plain operator and its backward operator (torch.compile, bitwise
    the eager route), gradients against torch's float64 autograd."""
    torch = torch_on_gpu()
    x, r, w, b = _arrays(rng, (4, 9, 1536), dtypes.bfloat16, np.float32)
    t = {k: torch.tensor(v.astype(np.float32), device="cuda") for k, v in dict(x=x, r=r, w=w, b=b).items()}
    t["x"] = t["x"].to(torch.bfloat16)

    def run(x, r, w, b):
        if kind == "rms":
            return cunorm.torch.rms_norm(x, w, residual=r)
        return cunorm.torch.layer_norm(x, w, b, residual=r)

    y, h = run(t["x"], t["r"], t["w"], t["b"])
    c = {k: cupy.from_dlpack(v) for k, v in t.items()}
    if kind == "rms":
        want_y, want_h = cunorm.rms_norm(c["x"], c["w"], residual=c["r"])
    else:
        want_y, want_h = cunorm.layer_norm(c["x"], c["w"], c["b"], residual=c["r"])
    assert torch.equal(y, torch.from_dlpack(want_y)) and torch.equal(h, torch.from_dlpack(want_h))
    leaves = {k: v.clone().requires_grad_() for k, v in t.items() if kind == "ln" or k != "b"}
    dy, dh = torch.randn_like(y, dtype=torch.float32).to(torch.bfloat16), torch.randn_like(h)

    def forward_and_grads(fn):
        y2, h2 = fn(leaves["x"], leaves["r"], leaves["w"], leaves.get("b"))
        return (y2, h2), torch.autograd.grad((y2.float() * dy.float()).sum() + (h2 * dh).sum(),
                                             list(leaves.values()))

    (y2, h2), grads = forward_and_grads(run)
    assert type(y2.grad_fn).__name__ == "WideRowNormBackward", type(y2.grad_fn).__name__
    assert y2.dtype == torch.bfloat16 and h2.dtype == torch.float32 and torch.equal(h2, h) and torch.equal(y2, y)
    assert grads[0].dtype == torch.bfloat16 and grads[1].dtype == torch.float32
    assert torch.equal(grads[0], grads[1].to(torch.bfloat16))  # (one float32 gradient, rounded once for x)
    if compiled:
        traced = []
        eager = grads
        (y3, h3), grads = forward_and_grads(torch.compile(run, backend=recording_backend(traced), fullgraph=True))
        name = "cunorm.rms_norm" if kind == "rms" else "cunorm.layer_norm"
        assert name in traced and not any("conditioned" in target for target in traced), traced
        assert torch.equal(y3, y) and torch.equal(h3, h)
        for k, g, e in zip(leaves, grads, eager):
            assert torch.equal(g, e), k
    doubles = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}
    hd = doubles["x"] + doubles["r"]
    if kind == "rms":
        yd = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-5) * doubles["w"]
    else:
        yd = torch.nn.functional.layer_norm(hd, (1536,), doubles["w"], doubles["b"], 1e-5)
    ref = torch.autograd.grad((yd * dy.double()).sum() + (hd * dh.double()).sum(), list(doubles.values()))
    for k, g, rg in zip(leaves, grads, ref):
        tol = 8e-3 if g.dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(g.double(), rg, rtol=tol, atol=tol * float(rg.abs().max()), msg=k)

    traced = []  # (outside autograd: the fused operator, bitwise the eager call)
    got = torch.compile(run, backend=recording_backend(traced), fullgraph=True)(t["x"], t["r"], t["w"], t["b"])
    assert any("norm_conditioned" in target for target in traced), traced
    assert torch.equal(got[1], h) and torch.equal(got[0], y)


def test_torch_rows_past_the_fused_backward_compose(rng):
    """Rows of 16384 (past rows_grad_wide's 8192): the composition's
    gradients, against float64 autograd."""
    torch = torch_on_gpu()
    x = torch.randn(2, 16384, device="cuda").to(torch.bfloat16).requires_grad_()
    r = (30 * torch.randn(2, 16384, device="cuda")).requires_grad_()
    y, h = cunorm.torch.rms_norm(x, residual=r)
    assert "WideRowNorm" not in type(y.grad_fn).__name__
    gx, gr = torch.autograd.grad(y.float().sum() + h.sum(), (x, r))
    xd, rd = x.detach().double().requires_grad_(), r.detach().double().requires_grad_()
    hd = xd + rd
    yd = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-5)
    ref = torch.autograd.grad(yd.sum() + hd.sum(), (xd, rd))
    for g, rg in zip((gx, gr), ref):
        torch.testing.assert_close(g.double(), rg, rtol=8e-3, atol=8e-3 * float(rg.abs().max()))


GRAD_SHAPES = [(3, 17, 1152), (2, 5, 4096), (1, 1, 8192), (7, 1000), (5, 3, 60), (4096, 64), (9, 2, 1, 200)]


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "f16"])
@pytest.mark.parametrize("params", ["none", "x", "f32"])
@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("with_dh", [True, False], ids=["dh", "no-dh"])
@pytest.mark.parametrize("shape", GRAD_SHAPES, ids=[str(s) for s in GRAD_SHAPES])
def test_the_fused_backward_matches_the_reference(rng, poisoned, shape, with_dh, kind, params, dtype):
    """rows_grad_wide against the float64 gradient of h: x's rounded once
    to x's dtype, the residual's float32 (the same values: dx is dres
    rounded, bitwise), dweight and dbias; inputs never written."""
    from cunorm import backward

    pdtype = None if params == "none" else dtype if params == "x" else np.float32
    x, r, w, b = _arrays(rng, shape, dtype, pdtype or np.float32)
    w, b = (None, None) if params == "none" else (w, b if kind == "ln" else None)
    dy = random(rng, shape, dtype, 2.0)
    dh = random(rng, shape, np.float32) if with_dh else None
    dev = {k: None if v is None else cupy.asarray(v) for k, v in dict(x=x, r=r, w=w, b=b, dy=dy, dh=dh).items()}
    if kind == "rms":
        _, h, rstd = cunorm.rms_norm(dev["x"], dev["w"], residual=dev["r"], return_stats=True)
        mean = None
    else:
        _, h, mean, rstd = cunorm.layer_norm(dev["x"], dev["w"], dev["b"], residual=dev["r"], return_stats=True)
    kept = {k: v.copy() for k, v in dict(dev, h=h, rstd=rstd, mean=mean).items() if v is not None}
    if kind == "rms":
        got = backward.rms_norm_float32_residual_backward(dev["dy"], h, rstd, dev["w"], dh=dev["dh"])
        want = reference.rms_norm_backward(dy, cupy.asnumpy(h), cupy.asnumpy(rstd), w, dh=dh, exact=True) + (None,)
    else:
        got = backward.layer_norm_float32_residual_backward(dev["dy"], h, mean, rstd, dev["w"], dev["b"],
                                                            dh=dev["dh"])
        want = reference.layer_norm_backward(dy, cupy.asnumpy(h), cupy.asnumpy(mean), cupy.asnumpy(rstd), w, b,
                                             dh=dh, exact=True)
    assert got.x.dtype == dtype and got.residual.dtype == np.float32
    assert cupy.array_equal(got.x.view(cupy.uint16), got.residual.astype(dtype).view(cupy.uint16))
    assert_close(cupy.asnumpy(got.x), want[0], dtype, atol=RTOL[np.dtype(dtype)] * output_scale(want[0]), what="dx")
    assert_close(cupy.asnumpy(got.residual), want[0], dtypes.float32, rtol=1e-4, atol=1e-4 * output_scale(want[0]),
                 what="dresidual")
    for name, g, ref, p in (("dweight", got.weight, want[1], w), ("dbias", got.bias, want[2], b)):
        if p is None:
            assert g is None, name
            continue
        assert g.dtype == p.dtype and g.shape == p.shape, name
        tol = RTOL[np.dtype(p.dtype)] if p.dtype != np.float32 else 1e-4
        assert_close(cupy.asnumpy(g), ref, p.dtype, rtol=tol, atol=tol * output_scale(ref), what=name)
    for k, v in kept.items():  # inputs never written
        current = {"h": h, "rstd": rstd, "mean": mean}.get(k, dev.get(k))
        assert cupy.array_equal(v, current), k


def test_the_fused_backward_is_reproducible_and_batch_invariant(rng):
    """Twice bitwise the same; each row's dx and dresidual bitwise the same
    whatever the rows beside it (dweight sums over all of them)."""
    from cunorm import backward

    bf16 = dtypes.bfloat16
    for shape in ((4096, 1024), (2048, 128), (64, 8192)):
        x, r, w, b = (cupy.asarray(a) for a in _arrays(rng, shape, bf16, bf16))
        dy, dh = cupy.asarray(random(rng, shape, bf16)), cupy.asarray(random(rng, shape, np.float32))
        _, h, mean, rstd = cunorm.layer_norm(x, w, b, residual=r, return_stats=True)
        whole = backward.layer_norm_float32_residual_backward(dy, h, mean, rstd, w, b, dh=dh)
        again = backward.layer_norm_float32_residual_backward(dy, h, mean, rstd, w, b, dh=dh)
        for a, c in zip(whole, again):
            assert cupy.array_equal(a, c)
        for i in (0, 1234 % shape[0], shape[0] - 1):
            part = backward.layer_norm_float32_residual_backward(dy[i:i + 1], h[i:i + 1], mean[i:i + 1],
                                                                 rstd[i:i + 1], w, b, dh=dh[i:i + 1])
            assert cupy.array_equal(part.x.view(cupy.uint16), whole.x[i:i + 1].view(cupy.uint16))
            assert cupy.array_equal(part.residual, whole.residual[i:i + 1])


def test_a_cached_backward_replays_what_the_first_computed(rng):
    from cunorm import backward
    from cunorm._engine import launch_cache, wide_grad

    bf16 = dtypes.bfloat16
    x, r, w, _ = (cupy.asarray(a) for a in _arrays(rng, (3, 9, 2048), bf16, np.float32))
    dy, dh = cupy.asarray(random(rng, x.shape, bf16)), cupy.asarray(random(rng, x.shape, np.float32))
    _, h, rstd = cunorm.rms_norm(x, w, residual=r, return_stats=True)
    first = backward.rms_norm_float32_residual_backward(dy, h, rstd, w, dh=dh)
    key = wide_grad.key("rms", dy, h, None, rstd, w, None, dh, -1)
    assert launch_cache.ROWS_GRAD.get(key) is not None
    second = backward.rms_norm_float32_residual_backward(dy, h, rstd, w, dh=dh)
    assert type(second).__name__ == "WideResidualGrads"
    for a, c in zip(first, second):
        assert (a is None and c is None) or cupy.array_equal(a, c)
    dy2 = cupy.asarray(random(rng, x.shape, bf16))  # (new data through the replayed launcher)
    third = backward.rms_norm_float32_residual_backward(dy2, h, rstd, w, dh=dh)
    fresh = wide_grad.run(wide_grad.WideGradCall("rms", dy2, h, None, rstd, w, None, dh, -1))
    for a, c in zip(third, fresh):
        assert (a is None and c is None) or cupy.array_equal(a, c)


def test_rows_past_the_fused_backward_raise_a_value_error():
    from cunorm import backward

    h = cupy.ones((2, 16384), cupy.float32)
    with pytest.raises(ValueError, match="rows of at most 8192"):
        backward.rms_norm_float32_residual_backward(cupy.ones((2, 16384), dtypes.bfloat16), h,
                                                    cupy.ones(2, cupy.float32))


def test_jax_eager_jit_and_grad(rng):
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    import cunorm.jax as cj

    jnp = jax.numpy
    x, r, w, _ = _arrays(rng, (4, 9, 1536), dtypes.bfloat16, np.float32)
    args = [jnp.asarray(a) for a in (x, r, w)]

    def block(x, r, w):
        return cj.rms_norm(x, w, residual=r)

    want_y, want_h = reference.rms_norm(x, w, residual=r, exact=True)
    for y, h in (block(*args), jax.jit(block)(*args)):
        assert y.dtype == jnp.bfloat16 and h.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(h), want_h)
        assert_close(np.asarray(y), want_y, dtypes.bfloat16, atol=8e-3 * output_scale(want_y), what="y")

    def loss(x, r, w):
        y, h = block(x, r, w)
        return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(h * h)

    def loss_xla(x, r, w):
        h = x.astype(jnp.float32) + r
        y = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-5) * w
        return jnp.sum(y.astype(jnp.bfloat16).astype(jnp.float32) ** 2) + jnp.sum(h * h)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    kinds = [e.primitive.name for e in jax.make_jaxpr(grad)(*args).eqns]
    assert "cunorm_rows_grad_wide" in kinds, kinds  # (the fused backward)
    ref = jax.jit(jax.grad(loss_xla, argnums=(0, 1, 2)))(*args)
    for grads in (grad(*args), jax.jit(grad)(*args)):
        assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.float32, jnp.float32]
        np.testing.assert_array_equal(np.asarray(grads[0]), np.asarray(grads[1].astype(jnp.bfloat16)))
        for g, rg in zip(grads, ref):
            np.testing.assert_allclose(np.asarray(g).astype(np.float64), np.asarray(rg).astype(np.float64),
                                       rtol=2e-2, atol=2e-2 * float(np.abs(np.asarray(rg).astype(np.float64)).max()))


@pytest.mark.parametrize("kind", ["rms", "ln"])
def test_the_stream_combines_with_per_head_weights_and_modulation(rng, poisoned, kind):
    x, r = random(rng, (2, 7, 8, 128), dtypes.bfloat16), random(rng, (2, 7, 8, 128), np.float32, 10.0)
    w, b = random(rng, (8, 128), np.float32, 0.5, 1.0), random(rng, (8, 128), np.float32)
    shift, scale = random(rng, (2, 1, 1, 128), np.float32), random(rng, (2, 1, 1, 128), np.float32, 0.3)
    dev = [cupy.asarray(a) for a in (x, r, w, b, shift, scale)]
    extra = {} if kind == "rms" else {"bias": dev[3]}
    fn = cunorm.rms_norm if kind == "rms" else cunorm.layer_norm
    y, h = fn(dev[0], dev[2], residual=dev[1], shift=dev[4], scale=dev[5], activation="silu", **extra)
    ref = reference.rms_norm if kind == "rms" else reference.layer_norm
    want_y, want_h = ref(x, w, **({} if kind == "rms" else {"bias": b}), residual=r, shift=shift, scale=scale,
                         activation="silu", exact=True)
    assert np.array_equal(cupy.asnumpy(h), want_h.astype(np.float32))
    assert_close(cupy.asnumpy(y), want_y, dtypes.bfloat16, atol=8e-3 * output_scale(want_y), what="y")
