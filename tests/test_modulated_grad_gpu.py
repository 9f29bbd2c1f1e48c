"""The fused backward of the modulated row norms (shift=, scale=,
residual_gate=; cunorm/kernels/modulated_grads.cu) on the GPU: every
gradient against the float64 reference, outputs poisoned first, inputs
never written, bitwise the same run to run and for a sample alone as in
its batch; torch's autograd through the fused route against float64
torch. The statistics and h come from cunorm's own forward, the same
values for the kernel and the reference. The gradients sum terms of both
signs, so their error is judged against the size of the reference (atol =
rtol * its root mean square)."""
import numpy as np
import pytest

import cunorm
from cunorm import backward
from cunorm._engine import dtypes, modulated_grad, plans
from helpers import DTYPE_IDS, DTYPES, RTOL, assert_close, output_scale, random, recording_backend, torch_on_gpu

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

# name: (x shape, weight?, bias?, modulation shapes, residual?)
CASES = {
    "dit per sample": ((3, 37, 1152), False, False, {"shift": (3, 1, 1152), "scale": (3, 1, 1152)}, False),
    "adaLN-Zero": ((2, 50, 384), False, False, {"shift": (2, 1, 384), "scale": (2, 1, 384),
                                                "residual_gate": (2, 1, 384)}, True),
    "affine, all three": ((2, 33, 520), True, True, {"shift": (2, 1, 520), "scale": (2, 1, 520),
                                                     "residual_gate": (2, 1, 520)}, True),
    "one for all, scale only": ((70, 200), True, True, {"scale": (200,)}, False),
    "shift only, plain residual": ((4, 17, 96), True, False, {"shift": (4, 1, 96)}, True),
    "gated residual alone": ((3, 19, 1000), True, True, {"residual_gate": (3, 1, 1000)}, True),
    "odd row": ((2, 16, 999), True, True, {"shift": (2, 1, 999), "scale": (2, 1, 999)}, False),
    "long rows": ((2, 24, 8192), True, True, {"shift": (2, 1, 8192), "scale": (2, 1, 8192)}, False),
    "long gated rows": ((2, 20, 6144), True, True, {"shift": (2, 1, 6144), "scale": (2, 1, 6144),
                                                    "residual_gate": (2, 1, 6144)}, True),
    # (runs of 36 units: more partial rows a modulation row than the sums' 32 threads a column)
    "long runs": ((2, 600, 72), True, True, {"shift": (2, 1, 72), "scale": (2, 1, 72),
                                             "residual_gate": (2, 1, 72)}, True),
}


def _arrays(rng, case, dtype, pdtype):
    shape, has_w, has_b, cond, has_r = CASES[case]
    n = shape[-1]
    x = random(rng, shape, dtype, 2.0, 0.5)
    w = random(rng, (n,), pdtype, 0.5, 1.0) if has_w else None
    b = random(rng, (n,), pdtype) if has_b else None
    r = random(rng, shape, dtype) if has_r else None
    named = {k: random(rng, s, pdtype, 0.5) for k, s in cond.items()}
    return x, w, b, r, named


def _forward(kind, x, w, b, r, named):
    if kind == "rms":
        return cunorm.rms_norm(x, w, residual=r, **named, return_stats=True)
    return cunorm.layer_norm(x, w, b, residual=r, **named, return_stats=True)


def _backward(kind, dy, h, stats, w, b, named, x, dh):
    gate = named.get("residual_gate")
    if kind == "rms":
        return backward.rms_norm_modulated_backward(dy, h, stats[-1], w, shift=named.get("shift"),
                                                    scale=named.get("scale"), residual_gate=gate,
                                                    x=x if gate is not None else None, dh=dh)
    return backward.layer_norm_modulated_backward(dy, h, stats[0], stats[1], w, b, shift=named.get("shift"),
                                                  scale=named.get("scale"), residual_gate=gate,
                                                  x=x if gate is not None else None, dh=dh)


def _run_case(rng, case, kind, dtype):
    """(got, want): the fused backward on the GPU, the reference on NumPy
    copies of the same inputs (h and the statistics from the GPU forward)."""
    pdtype = np.float64 if dtype == dtypes.float64 else np.float32
    x, w, b, r, named = _arrays(rng, case, dtype, pdtype)
    if kind == "rms":
        b = None
    dev = lambda a: None if a is None else cupy.asarray(a)  # noqa: E731
    out = _forward(kind, dev(x), dev(w), dev(b), dev(r), {k: dev(v) for k, v in named.items()})
    h = out[1] if r is not None else dev(x)
    stats = out[2:] if r is not None else out[1:]
    dy = random(rng, x.shape, dtype)
    dh = random(rng, x.shape, dtype) if r is not None else None
    inputs = {"dy": dev(dy), "h": h, "x": dev(x), "dh": dev(dh), "w": dev(w), "b": dev(b),
              **{k: dev(v) for k, v in named.items()}}
    before = {k: v.copy() for k, v in inputs.items() if v is not None}
    got = _backward(kind, inputs["dy"], h, stats, inputs["w"], inputs["b"], {k: inputs[k] for k in named},
                    inputs["x"], inputs["dh"])
    for k, v in before.items():  # inputs never written
        assert cupy.array_equal(v, inputs[k]), k
    host = lambda a: None if a is None else cupy.asnumpy(a)  # noqa: E731
    want = _backward(kind, dy, host(h), [host(s) for s in stats], w, b, named, x, dh)
    return got, want, inputs, stats


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_gradient_matches_the_reference(rng, poisoned, case, kind, dtype):
    shape, _, _, cond, _ = CASES[case]
    itemsize, n = np.dtype(dtype).itemsize, shape[-1]
    runs = modulated_grad.UNIT_MIN_ROWS  # (the row length alone decides here)
    if modulated_grad.plan(runs, n, plans.vector_width(itemsize, n, [], []), itemsize, runs, 1, 132,
                           "residual_gate" in cond) is None:  # (float32 and float64 hold shorter rows)
        assert dtype != dtypes.bfloat16
        # (the backward's refusal, or the conditioned forward's where its rows hold less)
        with pytest.raises(ValueError, match="rows of up to|fits in one block's registers"):
            _run_case(rng, case, kind, dtype)
        return
    got, want, _, _ = _run_case(rng, case, kind, dtype)
    for name, g, ref in zip(modulated_grad.ModulatedGrads._fields, got, want):
        assert (g is None) == (ref is None), name
        if g is None:
            continue
        g = cupy.asnumpy(g)
        assert g.shape == ref.shape and g.dtype == ref.dtype, name
        # parameter-like sums round once from float32 sums of many terms
        rtol = RTOL[np.dtype(dtype)] * (1 if name in ("x", "residual") else 4)
        if name not in ("x", "residual"):
            rtol = max(rtol, RTOL[np.dtype(ref.dtype)] * 4, 1e-4 if dtype != dtypes.float64 else 1e-11)
        assert_close(g, ref, ref.dtype if name not in ("x", "residual") else dtype, rtol=rtol,
                     atol=rtol * output_scale(ref), what=name)


@pytest.mark.parametrize("kind", ["rms", "ln"])
def test_bitwise_the_same_run_to_run_and_for_a_sample_alone(rng, kind):
    """Batch invariance: sample 1's dx, dshift, dscale and dgate are
    bitwise the same computed alone as among 5 samples, and twice."""
    dtype = dtypes.bfloat16
    x, w, b, r, named = _arrays(rng, "affine, all three", dtype, np.float32)
    big = lambda a: cupy.asarray(np.concatenate([a] * 3, axis=0)[:5]) if a is not None else None  # noqa: E731
    xs, rs = big(x), big(r)
    ms = {k: big(v) for k, v in named.items()}
    dys = cupy.asarray(random(rng, xs.shape, dtype))
    ws, bs = cupy.asarray(w), cupy.asarray(b) if kind == "ln" else None
    if kind == "rms":
        bs = None

    def grads(sl):
        sub = {k: v[sl] for k, v in ms.items()}
        out = _forward(kind, xs[sl], ws, bs, rs[sl], sub)
        return _backward(kind, dys[sl], out[1], out[2:], ws, bs, sub, xs[sl], None)

    whole, again, alone = grads(slice(None)), grads(slice(None)), grads(slice(1, 2))
    for name, a, c, one in zip(modulated_grad.ModulatedGrads._fields, whole, again, alone):
        if a is None:
            continue
        assert cupy.array_equal(a, c), name
        if name in ("x", "residual", "shift", "scale", "residual_gate"):
            assert cupy.array_equal(a[1:2].view(cupy.uint8), one.view(cupy.uint8)), name


@pytest.mark.parametrize("case", ["adaLN-Zero", "affine, all three", "shift only, plain residual"])
def test_a_cached_call_replays_what_the_first_computed(rng, case):
    """The launch cache: the first call over arrays as given stores a
    launcher; the second runs it, bitwise the same, and on new dy matches
    the reference."""
    from cunorm._engine import launch_cache

    launch_cache.clear()
    first, _, inputs, stats = _run_case(rng, case, "ln", dtypes.bfloat16)
    assert len(launch_cache.ROWS_GRAD) == 1
    named = {k: inputs[k] for k in CASES[case][3]}
    second = _backward("ln", inputs["dy"], inputs["h"], stats, inputs["w"], inputs["b"], named, inputs["x"],
                       inputs["dh"])
    for name, a, c in zip(modulated_grad.ModulatedGrads._fields, first, second):
        assert (a is None) == (c is None), name
        if a is not None:
            assert a.shape == c.shape and a.dtype == c.dtype, name
            assert cupy.array_equal(a, c), name
    dy2 = cupy.asarray(random(rng, inputs["dy"].shape, dtypes.bfloat16))
    third = _backward("ln", dy2, inputs["h"], stats, inputs["w"], inputs["b"], named, inputs["x"], inputs["dh"])
    host = lambda a: None if a is None else cupy.asnumpy(a)  # noqa: E731
    want = _backward("ln", host(dy2), host(inputs["h"]), [host(s) for s in stats], host(inputs["w"]),
                     host(inputs["b"]), {k: host(v) for k, v in named.items()}, host(inputs["x"]), host(inputs["dh"]))
    assert_close(cupy.asnumpy(third.x), want.x, dtypes.bfloat16, atol=8e-3 * output_scale(want.x), what="dx")
    if want.shift is not None:
        assert_close(cupy.asnumpy(third.shift), want.shift, want.shift.dtype, rtol=1e-4,
                     atol=1e-4 * output_scale(want.shift), what="dshift")


def test_calls_the_fused_kernels_do_not_take_raise_value_errors(rng):
    x = cupy.asarray(random(rng, (4, 5, 64), np.float32))
    per_token = cupy.asarray(random(rng, (4, 5, 64), np.float32))
    y, rstd = cunorm.rms_norm(x, shift=per_token, return_stats=True)
    with pytest.raises(ValueError, match="per token"):
        backward.rms_norm_modulated_backward(x, x, rstd, shift=per_token)
    one = cupy.asarray(random(rng, (1, 1, 64), np.float32))
    _, rstd_one = cunorm.rms_norm(one, shift=one, return_stats=True)
    with pytest.raises(ValueError, match="one modulation row over 1 row$"):
        backward.rms_norm_modulated_backward(one, one, rstd_one, shift=one)
    with pytest.raises(TypeError, match="needs x"):
        backward.rms_norm_modulated_backward(x, x, rstd, residual_gate=cupy.ones((4, 1, 64), cupy.float32))
    with pytest.raises(ValueError, match="broadcast against x"):
        backward.rms_norm_modulated_backward(x, x, rstd, shift=cupy.ones((4, 2, 64), cupy.float32))


# --- torch ---------------------------------------------------------------------------------------------------------


_AUTOGRAD_CASES = [(case, route) for case in ("adaLN-Zero", "affine, all three", "one for all, scale only",
                                             "shift only, plain residual") for route in ("eager", "compile")
                   if route == "eager" or case in ("adaLN-Zero", "affine, all three")]


@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case, route", _AUTOGRAD_CASES, ids=[f"{c}-{r}" for c, r in _AUTOGRAD_CASES])
def test_torch_autograd_runs_the_fused_backward(rng, case, route, kind, dtype):
    """Eager autograd takes ModulatedRowNorm; torch.compile the registered
    operator and its autograd formula (the modulated backward operator)."""
    torch = torch_on_gpu()
    tdtype = getattr(torch, dtype)
    x, w, b, r, named = _arrays(rng, case, np.float32, np.float32)
    if kind == "rms":
        b = None
    t = {k: torch.tensor(v, device="cuda").to(tdtype if k in ("x", "r") else torch.float32)
         for k, v in dict(x=x, w=w, b=b, r=r, **named).items() if v is not None}
    leaves = {k: v.clone().requires_grad_() for k, v in t.items()}

    def call(a):
        if kind == "rms":
            return cunorm.torch.rms_norm(a["x"], a.get("w"), residual=a.get("r"), **{k: a[k] for k in named})
        return cunorm.torch.layer_norm(a["x"], a.get("w"), a.get("b"), residual=a.get("r"),
                                       **{k: a[k] for k in named})

    traced = []
    out = (call if route == "eager" else torch.compile(call, backend=recording_backend(traced), fullgraph=True))(leaves)
    y = out[0] if isinstance(out, tuple) else out
    if route == "eager":
        assert "ModulatedRowNorm" in type(y.grad_fn).__name__
    else:
        assert any("norm_conditioned" in target for target in traced), traced
    dy = torch.randn_like(y)
    loss = (y.float() * dy.float()).sum() + (out[1].float().sum() if isinstance(out, tuple) else 0)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    if route == "compile":  # the same kernels as the eager route's
        eager = call(leaves)
        eager_y = eager[0] if isinstance(eager, tuple) else eager
        assert torch.equal(y, eager_y)
        eager_loss = (eager_y.float() * dy.float()).sum() + (eager[1].float().sum() if isinstance(eager, tuple)
                                                             else 0)
        for name, g, e in zip(leaves, grads, torch.autograd.grad(eager_loss, list(leaves.values()))):
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6 * float(e.abs().max()), msg=name)
    doubles = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}
    h = doubles["r"] + doubles["residual_gate"] * doubles["x"] if "residual_gate" in doubles else (
        doubles["x"] + doubles["r"] if "r" in doubles else doubles["x"])
    n = x.shape[-1]
    if kind == "rms":
        yh = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    else:
        yh = torch.nn.functional.layer_norm(h, (n,), eps=1e-5)
    yh = yh * doubles["w"] if "w" in doubles else yh
    yh = yh + doubles["b"] if "b" in doubles else yh
    yh = yh * (1 + doubles["scale"]) if "scale" in doubles else yh
    yh = yh + doubles["shift"] if "shift" in doubles else yh
    ref_loss = (yh * dy.double()).sum() + (h.sum() if "r" in doubles else 0)
    ref_grads = torch.autograd.grad(ref_loss, list(doubles.values()))
    tol = 2e-4 if dtype == "float32" else 3e-2
    for name, g, rg in zip(leaves, grads, ref_grads):
        torch.testing.assert_close(g.double(), rg, rtol=tol, atol=tol * float(rg.pow(2).mean().sqrt()), msg=name)


# --- JAX -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("case", ["adaLN-Zero", "affine, all three", "one for all, scale only"])
def test_jax_jit_runs_the_fused_forward_and_backward(rng, case, kind):
    """Inside jax.jit the call is the eager call's kernel (bitwise its y and
    h) and jax.grad runs the fused backward (its primitive in the traced
    program): every gradient against the float64 reference of the same h
    and statistics."""
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    import cunorm.jax as cj

    jnp = jax.numpy
    x, w, b, r, named = _arrays(rng, case, np.float32, np.float32)
    if kind == "rms":
        b = None
    leaves = {k: jnp.asarray(v) for k, v in dict(x=x, w=w, b=b, r=r, **named).items() if v is not None}

    def forward(a):
        kw = {k: a[k] for k in named}
        if kind == "rms":
            return cj.rms_norm(a["x"], a.get("w"), residual=a.get("r"), **kw)
        return cj.layer_norm(a["x"], a.get("w"), a.get("b"), residual=a.get("r"), **kw)

    jitted, eager = jax.jit(forward)(leaves), forward(leaves)
    for got, want in zip(jitted if r is not None else [jitted], eager if r is not None else [eager]):
        assert np.array_equal(np.asarray(got), np.asarray(want))
    dy = random(rng, x.shape, np.float32)
    dh = random(rng, x.shape, np.float32) if r is not None else None

    def loss(a):
        out = forward(a)
        y, h = (out[0], out[1]) if r is not None else (out, None)
        return jnp.sum(y * dy) + (jnp.sum(h * dh) if h is not None else 0.0)

    assert "cunorm_rows_grad_modulated" in str(jax.make_jaxpr(jax.grad(loss))(leaves))
    got = jax.jit(jax.grad(loss))(leaves)
    out = _forward(kind, cupy.asarray(x), None if w is None else cupy.asarray(w),
                   None if b is None else cupy.asarray(b), None if r is None else cupy.asarray(r),
                   {k: cupy.asarray(v) for k, v in named.items()})
    h = cupy.asnumpy(out[1]) if r is not None else x
    stats = [cupy.asnumpy(s) for s in (out[2:] if r is not None else out[1:])]
    want = _backward(kind, dy, h, stats, w, b, named, x, dh)
    gate = "residual_gate" in named
    expected = {"x": want.x, "w": want.weight, "b": want.bias, "r": want.residual if gate else want.x,
                "shift": want.shift, "scale": want.scale, "residual_gate": want.residual_gate}
    for name, g in got.items():
        ref = expected[name]
        rtol = RTOL[np.dtype(np.float32)] * (1 if name in ("x", "r") else 4)
        assert_close(np.asarray(g), ref, np.float32, rtol=max(rtol, 1e-4 if name not in ("x", "r") else rtol),
                     atol=max(rtol, 1e-4) * output_scale(ref), what=name)
