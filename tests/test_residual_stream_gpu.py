"""The float32 residual stream on the GPU: the fused kernel (rows_cached,
WideResidualLoad) against the float64 reference, h bitwise float32's x +
r, outputs poisoned first, inputs never written, batch invariance, the
launch cache; torch (fused outside autograd, the composition's gradients
under it, torch.compile) and JAX (eager, jit, grad)."""
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
def test_torch_runs_fused_and_differentiates_the_composition(rng, kind):
    torch = torch_on_gpu()
    x, r, w, b = _arrays(rng, (4, 9, 1536), dtypes.bfloat16, np.float32)
    t = {k: torch.tensor(v.astype(np.float32), device="cuda") for k, v in dict(x=x, r=r, w=w, b=b).items()}
    t["x"] = t["x"].to(torch.bfloat16)

    def run(x, r, w, b):
        if kind == "rms":
            return cunorm.rms_norm(x, w, residual=r)
        return cunorm.layer_norm(x, w, b, residual=r)

    y, h = run(t["x"], t["r"], t["w"], t["b"])
    want_y, want_h = run(*(cupy.from_dlpack(a) for a in (t["x"], t["r"], t["w"], t["b"])))
    assert torch.equal(y, torch.from_dlpack(want_y)) and torch.equal(h, torch.from_dlpack(want_h))
    leaves = {k: v.clone().requires_grad_() for k, v in t.items()}
    y2, h2 = run(leaves["x"], leaves["r"], leaves["w"], leaves["b"])
    assert y2.dtype == torch.bfloat16 and h2.dtype == torch.float32 and torch.equal(h2, h)
    dy, dh = torch.randn_like(y2, dtype=torch.float32), torch.randn_like(h2)
    grads = torch.autograd.grad((y2.float() * dy).sum() + (h2 * dh).sum(), list(leaves.values()),
                                allow_unused=True)
    doubles = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}
    y3, h3 = run(doubles["x"], doubles["r"], doubles["w"], doubles["b"])
    ref = torch.autograd.grad((y3 * dy.double()).sum() + (h3 * dh.double()).sum(), list(doubles.values()),
                              allow_unused=True)
    for name, g, rg in zip(leaves, grads, ref):
        if kind == "rms" and name == "b":
            continue
        torch.testing.assert_close(g.double(), rg, rtol=2e-2, atol=2e-2 * float(rg.abs().max()), msg=name)

    traced = []  # (outside autograd: the fused operator, bitwise the eager call)
    got = torch.compile(run, backend=recording_backend(traced), fullgraph=True)(t["x"], t["r"], t["w"], t["b"])
    assert any("norm_conditioned" in target for target in traced), traced
    assert torch.equal(got[1], h) and torch.equal(got[0], y)


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

    def loss(r, w):
        y, h = block(args[0], r, w)
        return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(h)

    def loss_xla(r, w):
        h = args[0].astype(jnp.float32) + r
        y = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-5) * w
        return jnp.sum(y.astype(jnp.bfloat16).astype(jnp.float32) ** 2) + jnp.sum(h)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(*args[1:])
    ref = jax.jit(jax.grad(loss_xla, argnums=(0, 1)))(*args[1:])
    for g, rg in zip(grads, ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(rg), rtol=2e-2,
                                   atol=2e-2 * float(np.abs(np.asarray(rg)).max()))


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
