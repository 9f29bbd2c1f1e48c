"""Per-head weights, shift=, scale= and residual_gate= on the GPU: the
fused kernel (rows_cached) against the float64 reference, outputs
poisoned first, inputs never written, batch invariance; torch (fused
outside autograd, the unfused composition's gradients under it) and JAX
(eager fused, jit and grad)."""
import numpy as np
import pytest

import cunorm
from cunorm import reference
from cunorm._engine import dtypes
from helpers import DTYPE_IDS, DTYPES, RTOL, assert_close, output_scale, random, recording_backend, torch_on_gpu

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

# name: (x shape, weight shape or None, bias?, conditioning shapes, residual?)
CASES = {
    "dit per sample": ((3, 17, 1152), None, False, {"shift": (3, 1, 1152), "scale": (3, 1, 1152)}, False),
    "dit affine, gated residual": ((2, 9, 384), (384,), True, {"shift": (2, 1, 384), "scale": (2, 1, 384),
                                                               "residual_gate": (2, 1, 384)}, True),
    # (no affine: LayerNorm's kernel at three blocks an SM, the gate loaded where h is formed)
    "adaLN-Zero": ((2, 9, 1152), None, False, {"shift": (2, 1, 1152), "scale": (2, 1, 1152),
                                               "residual_gate": (2, 1, 1152)}, True),
    "per token": ((4, 5, 96), (96,), True, {"shift": (4, 5, 96), "scale": (4, 5, 96)}, False),
    "one for all, scale only": ((6, 40), None, False, {"scale": (40,)}, False),
    "shift only, per position": ((2, 7, 200), (200,), True, {"shift": (7, 200)}, False),
    "kept axes apart": ((2, 3, 4, 64), None, False, {"shift": (2, 1, 4, 64), "scale": (2, 1, 1, 64)}, False),
    "per-head weights": ((2, 5, 4, 32), (4, 32), True, {}, False),
    "per-head, modulated": ((2, 5, 8, 128), (8, 128), True, {"shift": (2, 1, 1, 128)}, True),
    "gated residual alone": ((3, 11, 1000), (1000,), True, {"residual_gate": (3, 1, 1000)}, True),
    "decode": ((1, 1, 3072), (3072,), True, {"shift": (1, 1, 3072), "scale": (1, 1, 3072)}, False),
}


def _arrays(rng, case, dtype, pdtype=np.float32):
    shape, wshape, has_bias, cond, has_r = CASES[case]
    x = random(rng, shape, dtype, 2.0, 0.5)
    w = None if wshape is None else random(rng, wshape, pdtype, 0.5, 1.0)
    b = None if wshape is None or not has_bias else random(rng, wshape, pdtype)
    r = random(rng, shape, dtype) if has_r else None
    named = {k: random(rng, s, pdtype, 0.5) for k, s in cond.items()}
    return x, w, b, r, named


def _run(xp_call, kind, x, w, b, r, named, **kw):
    if kind == "rms":
        return xp_call.rms_norm(x, w, residual=r, **named, **kw)
    return xp_call.layer_norm(x, w, b, residual=r, **named, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_fused_kernel_matches_the_reference(rng, poisoned, case, kind, dtype):
    pdtype = np.float64 if dtype == dtypes.float64 else np.float32
    x, w, b, r, named = _arrays(rng, case, dtype, pdtype)
    if kind == "rms":
        b = None
    dev = {k: None if v is None else cupy.asarray(v) for k, v in dict(x=x, w=w, b=b, r=r, **named).items()}
    before = {k: v.copy() for k, v in dev.items() if v is not None}
    got = _run(cunorm, kind, dev["x"], dev["w"], dev["b"], dev["r"], {k: dev[k] for k in named},
               return_stats=True)
    fn = reference.rms_norm if kind == "rms" else reference.layer_norm
    extra = {} if kind == "rms" else {"bias": b}
    want = fn(x, w, **extra, residual=r, **named, return_stats=True, exact=True)
    got, want = list(got), list(want)
    scale = output_scale(want[0])
    assert_close(cupy.asnumpy(got[0]), want[0], dtype, atol=RTOL[np.dtype(dtype)] * scale, what="y")
    if r is not None:  # h: one rounding of r + g * x (the reference's: of its float64 value)
        assert_close(cupy.asnumpy(got[1]), want[1].astype(np.float64), dtype, what="h")
    for g, s in zip(got[-2 if kind == "ln" else -1:], want[-2 if kind == "ln" else -1:]):
        assert_close(cupy.asnumpy(g), s, dtypes.float32 if dtype != dtypes.float64 else dtype, rtol=1e-4,
                     atol=1e-5, what="statistics")
    for k, v in before.items():  # inputs never written
        assert cupy.array_equal(v, dev[k]), k


@pytest.mark.parametrize("kind", ["rms", "ln"])
def test_each_rows_result_is_the_same_whatever_the_batch(rng, kind):
    """Batch invariance: a row's y is bitwise the same alone and among
    4096 rows."""
    x = cupy.asarray(random(rng, (4096, 3072), dtypes.bfloat16))
    shift, scale = (cupy.asarray(random(rng, (4096, 3072), np.float32)) for _ in range(2))
    w = cupy.asarray(random(rng, (3072,), np.float32))
    fn = cunorm.rms_norm if kind == "rms" else cunorm.layer_norm
    whole = fn(x, w, shift=shift, scale=scale)
    for i in (0, 1234, 4095):
        alone = fn(x[i:i + 1], w, shift=shift[i:i + 1], scale=scale[i:i + 1])
        assert cupy.array_equal(alone.view(cupy.uint16), whole[i:i + 1].view(cupy.uint16))


@pytest.mark.parametrize("case", ["dit affine, gated residual", "per-head, modulated", "per-head weights",
                                  "kept axes apart"])
def test_a_cached_call_replays_what_the_first_computed(rng, case):
    """The launch cache: a second call with the same signature runs the
    stored launcher (an entry exists once the first call copied nothing),
    with the same results, on new data too; a shift of another broadcast
    pattern is another signature."""
    from cunorm._engine import launch_cache

    x, w, b, r, named = _arrays(rng, case, dtypes.bfloat16, dtypes.bfloat16)
    dev = lambda a: None if a is None else cupy.asarray(a)  # noqa: E731
    args = (dev(x), dev(w), dev(b), dev(r), {k: dev(v) for k, v in named.items()})
    first = _run(cunorm, "ln", *args[:4], args[4])
    operands = tuple(args[4].get(n) for n in ("shift", "scale", "residual_gate", "gate"))
    key = launch_cache.rows_key("ln", *args[:4], -1, 1e-5, False, 0, None,
                                conditioned=operands if any(o is not None for o in operands) else None)
    # (an entry where the rows the kernel read were the given arrays: not broadcast out)
    assert (launch_cache.ROWS.get(key) is not None) == (case != "kept axes apart")
    second = _run(cunorm, "ln", *args[:4], args[4])
    first, second = (o if isinstance(o, tuple) else (o,) for o in (first, second))
    for a, c in zip(first, second):
        assert cupy.array_equal(a.view(cupy.uint16), c.view(cupy.uint16))
    x2, *_ = _arrays(rng, case, dtypes.bfloat16, dtypes.bfloat16)
    got = _run(cunorm, "ln", dev(x2), *args[1:4], args[4])
    want = reference.layer_norm(x2, w, b, residual=r, **named, exact=True)
    got, want = (o if isinstance(o, tuple) else (o,) for o in (got, want))
    assert_close(cupy.asnumpy(got[0]), want[0], dtypes.bfloat16, atol=8e-3 * output_scale(want[0]), what="y")
    if "shift" in named:
        per_token = {**args[4], "shift": cupy.asarray(np.broadcast_to(named["shift"], x.shape).copy())}
        other = _run(cunorm, "ln", *args[:4], per_token)
        other = other if isinstance(other, tuple) else (other,)
        assert cupy.array_equal(other[0].view(cupy.uint16), first[0].view(cupy.uint16))


# x shape, parameter shape: heads of a block a row; short rows (a block a row where the plain weight's rows share
# one); more heads than blocks are resident (a grid run in turn, column_sum after it)
PER_HEAD_GRADS = {"heads of 128": ((3, 7, 8, 128), (8, 128)), "groups of 1024": ((2, 9, 4, 1024), (4, 1024)),
                  "short rows": ((5, 6, 64), (6, 64)), "more heads than resident blocks": ((2, 5000, 64), (5000, 64))}


@pytest.mark.parametrize("dtype", [np.float32, dtypes.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("case", list(PER_HEAD_GRADS))
def test_the_backward_takes_parameters_per_head(rng, case, kind, dtype):
    """rms_norm_backward and layer_norm_backward with a weight (and bias)
    per head: dweight and dbias in the parameters' shape, each head's own
    sum, dx against the float64 reference."""
    from cunorm.backward import layer_norm_backward, rms_norm_backward

    shape, pshape = PER_HEAD_GRADS[case]
    x, dy = random(rng, shape, dtype, 2.0, 0.5), random(rng, shape, dtype)
    w, b = random(rng, pshape, np.float32, 0.5, 1.0), random(rng, pshape, np.float32)
    dev = {k: cupy.asarray(v) for k, v in dict(x=x, dy=dy, w=w, b=b).items()}
    if kind == "rms":
        _, rstd = cunorm.rms_norm(dev["x"], dev["w"], return_stats=True)
        got = rms_norm_backward(dev["dy"], dev["x"], rstd, dev["w"])
        want = reference.rms_norm_backward(dy, x, cupy.asnumpy(rstd), w, exact=True)
    else:
        _, mean, rstd = cunorm.layer_norm(dev["x"], dev["w"], dev["b"], return_stats=True)
        got = layer_norm_backward(dev["dy"], dev["x"], mean, rstd, dev["w"], dev["b"])
        want = reference.layer_norm_backward(dy, x, cupy.asnumpy(mean), cupy.asnumpy(rstd), w, b, exact=True)
    for name, g, ref in zip(("dx", "dweight", "dbias"), got, want):
        assert g.shape == ref.shape, (name, g.shape)
        tol = RTOL[np.dtype(dtype)] if name == "dx" else 1e-4
        assert_close(cupy.asnumpy(g), ref, dtype if name == "dx" else np.float32, rtol=tol,
                     atol=tol * output_scale(ref), what=name)


@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_torch_differentiates_per_head_parameters_fused(rng, kind, residual, compiled):
    """Per-head parameters alone (QK-norm with a weight a head): where
    eager autograd records, the plain norm's autograd Function, whose
    backward takes them (a block a row); under torch.compile the plain
    operator, whose autograd formula runs the same kernels (bitwise the
    eager results); gradients against torch's autograd of the same call in
    float64."""
    torch = torch_on_gpu()
    shape, pshape = (3, 7, 8, 128), (8, 128)
    arrays = dict(x=random(rng, shape, np.float32, 2.0, 0.5), w=random(rng, pshape, np.float32, 0.5, 1.0),
                  b=random(rng, pshape, np.float32) if kind == "ln" else None,
                  r=random(rng, shape, np.float32) if residual else None)
    leaves = {k: torch.tensor(v, device="cuda").requires_grad_() for k, v in arrays.items() if v is not None}

    def call(a):
        return _run(cunorm.torch, kind, a["x"], a["w"], a.get("b"), a.get("r"), {})

    def forward_and_grads(fn):
        out = fn(leaves)
        y = out[0] if isinstance(out, tuple) else out
        loss = (y * dy).sum() + (out[1].sum() if isinstance(out, tuple) else 0)
        return out, torch.autograd.grad(loss, list(leaves.values()))

    dy = torch.randn(shape, device="cuda")
    out, grads = forward_and_grads(call)
    y = out[0] if isinstance(out, tuple) else out
    assert "RowNorm" in type(y.grad_fn).__name__, type(y.grad_fn).__name__
    if compiled:
        traced = []
        eager_out, eager_grads = out, grads
        out, grads = forward_and_grads(torch.compile(call, backend=recording_backend(traced), fullgraph=True))
        want = "cunorm.rms_norm" if kind == "rms" else "cunorm.layer_norm"
        assert want in traced and not any("conditioned" in t for t in traced), traced
        for got, eager in zip(out if isinstance(out, tuple) else (out,),
                              eager_out if isinstance(eager_out, tuple) else (eager_out,)):
            assert torch.equal(got, eager)
        for name, g, e in zip(leaves, grads, eager_grads):
            assert torch.equal(g, e), name
    doubles = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}
    h = doubles["x"] + doubles["r"] if residual else doubles["x"]
    if kind == "rms":
        ref_y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * doubles["w"]
    else:
        ref_y = torch.nn.functional.layer_norm(h, (128,), eps=1e-5) * doubles["w"] + doubles["b"]
    ref_grads = torch.autograd.grad((ref_y * dy.double()).sum() + (h.sum() if residual else 0),
                                    list(doubles.values()))
    for name, g, rg in zip(leaves, grads, ref_grads):
        assert g.shape == rg.shape, name
        torch.testing.assert_close(g.double(), rg, rtol=2e-4, atol=2e-4 * float(rg.abs().max()), msg=name)


def test_rows_past_the_register_tier_raise_a_value_error():
    x = cupy.ones((2, 65536), cupy.float32)
    with pytest.raises(ValueError, match="rows_cached"):
        cunorm.layer_norm(x, shift=cupy.zeros((2, 65536), cupy.float32))


# --- torch ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("case", ["dit affine, gated residual", "per-head, modulated", "per token"])
def test_torch_runs_fused_and_differentiates_the_composition(rng, case, kind):
    torch = torch_on_gpu()
    x, w, b, r, named = _arrays(rng, case, np.float32)
    if kind == "rms":
        b = None
    t = {k: None if v is None else torch.tensor(v, device="cuda") for k, v in dict(x=x, w=w, b=b, r=r,
                                                                                   **named).items()}
    fused = _run(cunorm, kind, t["x"], t["w"], t["b"], t["r"], {k: t[k] for k in named})
    fused = fused[0] if isinstance(fused, tuple) else fused
    want = _run(cunorm, kind, cupy.asarray(x), None if w is None else cupy.asarray(w),
                None if b is None else cupy.asarray(b), None if r is None else cupy.asarray(r),
                {k: cupy.asarray(v) for k, v in named.items()})
    want = want[0] if isinstance(want, tuple) else want
    assert torch.equal(fused, torch.as_tensor(want, device="cuda"))  # (the same kernel)
    leaves = {k: v.clone().requires_grad_() for k, v in t.items() if v is not None}
    out = _run(cunorm, kind, leaves["x"], leaves.get("w"), leaves.get("b"), leaves.get("r"),
               {k: leaves[k] for k in named})
    y = out[0] if isinstance(out, tuple) else out
    dy = torch.randn_like(y)
    loss = (y * dy).sum() + (out[1].sum() if isinstance(out, tuple) else 0)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    doubles = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}
    ref = _run(cunorm, kind, doubles["x"], doubles.get("w"), doubles.get("b"), doubles.get("r"),
               {k: doubles[k] for k in named})
    ref_y = ref[0] if isinstance(ref, tuple) else ref
    ref_loss = (ref_y * dy.double()).sum() + (ref[1].sum() if isinstance(ref, tuple) else 0)
    ref_grads = torch.autograd.grad(ref_loss, list(doubles.values()))
    for name, g, rg in zip(leaves, grads, ref_grads):
        torch.testing.assert_close(g.double(), rg, rtol=2e-4, atol=2e-4 * float(rg.abs().max()), msg=name)


@pytest.mark.parametrize("case", ["dit affine, gated residual", "per-head weights"])
def test_torch_compile_runs_the_fused_operator(rng, case):
    """Traced outside autograd, the call is one registered operator: the
    eager call's kernel, bitwise its results."""
    torch = torch_on_gpu()
    x, w, b, r, named = _arrays(rng, case, np.float32)
    t = {k: None if a is None else torch.tensor(a, device="cuda")
         for k, a in dict(x=x, w=w, b=b, r=r, **named).items()}

    def block(t):
        return cunorm.layer_norm(t["x"], t["w"], t["b"], residual=t["r"], **{k: t[k] for k in named})

    traced = []
    got = torch.compile(block, backend=recording_backend(traced), fullgraph=True)(t)
    if case == "per-head weights":  # (parameters per head alone: the plain norm's operator, heads_alone)
        assert "cunorm.layer_norm" in traced and not any("conditioned" in name for name in traced), traced
    else:
        assert any("layer_norm_conditioned" in target for target in traced), traced
    want = block(t)
    for g, e in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g, e)


# --- JAX -----------------------------------------------------------------------------------------------------------


def test_jax_eager_jit_and_grad(rng):
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    import cunorm.jax as cj

    jnp = jax.numpy
    x, w, b, r, named = _arrays(rng, "dit affine, gated residual", np.float32)
    args = [jnp.asarray(a) for a in (x, w, b, r, named["shift"], named["scale"], named["residual_gate"])]

    def block(x, w, b, r, shift, scale, gate):
        return cj.layer_norm(x, w, b, residual=r, shift=shift, scale=scale, residual_gate=gate)

    eager = block(*args)
    jitted = jax.jit(block)(*args)
    want = reference.layer_norm(x, w, b, residual=r, **named, exact=True)
    for got in (eager, jitted):
        assert_close(np.asarray(got[0]), want[0], np.float32, atol=2e-5 * output_scale(want[0]), what="y")
        assert_close(np.asarray(got[1]), want[1], np.float32, what="h")

    def loss(*a):
        y, h = block(*a)
        return jnp.sum(y * y) + jnp.sum(h)

    def loss_xla(*a):  # (the same formula in jax.numpy, float32)
        xf, wf, bf, rf, sf, cf, gf = a
        h = rf + gf * xf
        m = h.mean(-1, keepdims=True)
        v = ((h - m) ** 2).mean(-1, keepdims=True)
        y = ((h - m) * jax.lax.rsqrt(v + 1e-5) * wf + bf) * (1 + cf) + sf
        return jnp.sum(y * y) + jnp.sum(h)

    grads = jax.jit(jax.grad(loss, argnums=tuple(range(7))))(*args)
    ref = jax.jit(jax.grad(loss_xla, argnums=tuple(range(7))))(*args)
    for g, rg in zip(grads, ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(rg), rtol=2e-3,
                                   atol=2e-3 * float(np.abs(np.asarray(rg)).max()))


@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_jax_grad_takes_per_head_parameters_fused(rng, kind, residual):
    """jax.grad of per-head parameters alone binds the plain row backward
    (cunorm_rows_grad, over the heads), eager and inside jit; gradients
    against the float64 reference with dh (the cotangent of h) added."""
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    import cunorm.jax as cj

    jnp = jax.numpy
    shape, pshape = (3, 7, 8, 128), (8, 128)
    x, w, b = (random(rng, shape, np.float32, 2.0, 0.5), random(rng, pshape, np.float32, 0.5, 1.0),
               random(rng, pshape, np.float32))
    r, dy, dh = (random(rng, shape, np.float32) for _ in range(3))
    args = [jnp.asarray(a) for a in ((x, w, b, r) if kind == "ln" else (x, w, r))]

    def loss(*a):
        out = (cj.layer_norm(a[0], a[1], a[2], residual=a[3] if residual else None) if kind == "ln"
               else cj.rms_norm(a[0], a[1], residual=a[2] if residual else None))
        y, h = out if residual else (out, None)
        return jnp.sum(y * dy) + (jnp.sum(h * dh) if residual else 0)

    grad = jax.grad(loss, argnums=tuple(range(len(args))))
    assert "cunorm_rows_grad" in str(jax.make_jaxpr(grad)(*args))
    h = x + r if residual else x  # (h rounded to float32, as the kernel stores it)
    extra = dict(dh=dh) if residual else {}
    if kind == "rms":
        _, rstd = reference.rms_norm(h, w, return_stats=True, exact=True)
        want = reference.rms_norm_backward(dy, h, rstd, w, exact=True, **extra)
    else:
        _, mean, rstd = reference.layer_norm(h, w, b, return_stats=True, exact=True)
        want = reference.layer_norm_backward(dy, h, mean, rstd, w, b, exact=True, **extra)
    for got in (grad(*args), jax.jit(grad)(*args)):
        got = got[:-1] if not residual else got  # (the residual's gradient is dx: checked as dx)
        for name, g, ref in zip(("dx", "dweight", "dbias"), got, want):
            assert g.shape == ref.shape, (name, g.shape)
            assert_close(np.asarray(g), ref, np.float32, atol=2e-5 * output_scale(ref), what=name)
        if residual:
            np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(got[-1]))
