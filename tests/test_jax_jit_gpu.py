"""cunorm.jax inside jax.jit, grad and vmap (cunorm/jax/_jit.py): the
custom calls against the eager path (the same kernels) and the float64
reference, gradients against jax.grad of a jax.numpy formulation (skipped
without a GPU)."""
import os

import numpy as np
import pytest

from cunorm import reference
from helpers import OP_CALLS, RTOL, assert_close, op_shapes, output_scale, random

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
pytestmark = pytest.mark.gpu

DTYPES = ["float16", "bfloat16", "float32", "float64"]


@pytest.fixture(scope="module")
def jx():
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    jax.config.update("jax_enable_x64", True)  # float64 x, as cunorm takes it
    import cunorm.jax

    return jax, jax.numpy, cunorm.jax


def _np(a):
    return np.asarray(a.astype("float64") if a.dtype != np.float64 else a)


def _put(jnp, a):
    return jnp.asarray(a)


@pytest.mark.parametrize("name", list(OP_CALLS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_jit_matches_the_eager_path_and_the_reference(rng, jx, name, dtype):
    jax, jnp, cj = jx
    call, ref, _ = OP_CALLS[name]
    shape, params = op_shapes(name)
    x_np = random(rng, shape, np.dtype(jnp.dtype(dtype)))
    w_np, b_np = (random(rng, params, np.float32) for _ in range(2))
    x, w, b = (_put(jnp, a) for a in (x_np, w_np, b_np))
    y = jax.jit(lambda x, w, b: call(cj, x, w, b))(x, w, b)
    eager = call(cj, x, w, b)
    assert y.dtype == x.dtype and y.shape == x.shape
    want = ref(x_np.astype(np.float64), w_np.astype(np.float64), b_np.astype(np.float64))
    assert_close(_np(y), want, x.dtype, atol=RTOL[np.dtype(x.dtype)] * output_scale(want), what=f"{name} jit")
    assert_close(_np(y), _np(eager), x.dtype, atol=RTOL[np.dtype(x.dtype)] * output_scale(want),
                 what=f"{name} jit against eager")


def _ref_rms(jnp, x, w, eps):
    xf = x.astype(jnp.float32)
    return xf * jax_rsqrt(jnp, jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * w


def jax_rsqrt(jnp, v):
    return 1.0 / jnp.sqrt(v)


def _ref_ln(jnp, x, w, b, eps):
    xf = x.astype(jnp.float32)
    m = jnp.mean(xf, axis=-1, keepdims=True)
    v = jnp.mean((xf - m) ** 2, axis=-1, keepdims=True)
    return (xf - m) * jax_rsqrt(jnp, v + eps) * w + b


def _ref_gn(jnp, x, groups, w, b, eps, last):
    xf = x.astype(jnp.float32)
    if last:
        xf = jnp.moveaxis(xf, -1, 1)
    n, c = xf.shape[:2]
    g = xf.reshape(n, groups, -1)
    m = g.mean(-1, keepdims=True)
    v = ((g - m) ** 2).mean(-1, keepdims=True)
    y = ((g - m) * jax_rsqrt(jnp, v + eps)).reshape(xf.shape)
    y = y * w.reshape((1, c) + (1,) * (xf.ndim - 2)) + b.reshape((1, c) + (1,) * (xf.ndim - 2))
    return jnp.moveaxis(y, 1, -1) if last else y


def _grad_close(got, want, what, rel):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.all(np.isfinite(got)), what
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert err < rel, f"{what}: relative error {err:.3g}"


GRAD_REL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 3e-3}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(7, 768), (3, 5, 1000), (4, 4096), (300, 32768), (16, 40000)],
                         ids=["short", "3-d", "cached", "clusters", "streamed"])
@pytest.mark.parametrize("norm", ["rms", "ln"])
def test_row_grads_match_jax_numpy(rng, jx, norm, shape, dtype):
    jax, jnp, cj = jx
    x = _put(jnp, random(rng, shape, np.dtype(jnp.dtype(dtype))))
    w = _put(jnp, random(rng, shape[-1:], np.float32) + 1)
    b = _put(jnp, random(rng, shape[-1:], np.float32))
    dy = _put(jnp, random(rng, shape, np.float32))
    eps = 1e-5
    if norm == "rms":
        ours = lambda x, w, b: cj.rms_norm(x, w, eps=eps)  # noqa: E731
        theirs = lambda x, w, b: _ref_rms(jnp, x, w, eps)  # noqa: E731
    else:
        ours = lambda x, w, b: cj.layer_norm(x, w, b, eps=eps)  # noqa: E731
        theirs = lambda x, w, b: _ref_ln(jnp, x, w, b, eps)  # noqa: E731
    loss = lambda f: jax.jit(jax.grad(lambda x, w, b: jnp.sum(f(x, w, b).astype(jnp.float32) * dy),  # noqa: E731
                                      argnums=(0, 1, 2)))
    got = loss(ours)(x, w, b)
    want = loss(theirs)(x.astype(jnp.float32), w, b)
    for g, h, what in zip(got, want, ("dx", "dw", "db")):
        if norm == "rms" and what == "db":
            continue
        _grad_close(g, h, f"{norm} {what}", GRAD_REL[dtype])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_strided_axis_grads_match_jax_numpy(rng, jx, dtype):
    """LayerNorm over a middle axis (the strided backward, its dweight and
    dbias left to column_sum)."""
    jax, jnp, cj = jx
    x = _put(jnp, random(rng, (8, 64, 33), np.dtype(jnp.dtype(dtype))))
    w, b = (_put(jnp, random(rng, (64,), np.float32)) for _ in range(2))
    dy = _put(jnp, random(rng, (8, 64, 33), np.float32))

    def theirs(x, w, b):
        moved = jnp.moveaxis(x, 1, -1)
        return jnp.moveaxis(_ref_ln(jnp, moved, w, b, 1e-5), -1, 1)

    loss = lambda f: jax.jit(jax.grad(lambda x, w, b: jnp.sum(f(x, w, b).astype(jnp.float32) * dy),  # noqa: E731
                                      argnums=(0, 1, 2)))
    got = loss(lambda x, w, b: cj.layer_norm(x, w, b, axis=1, eps=1e-5))(x, w, b)
    want = loss(theirs)(x.astype(jnp.float32), w, b)
    for g, h, what in zip(got, want, ("dx", "dw", "db")):
        _grad_close(g, h, f"strided {what}", GRAD_REL[dtype])


def test_residual_grads_and_outputs(rng, jx):
    jax, jnp, cj = jx
    x, r = (_put(jnp, random(rng, (6, 512), np.float32)) for _ in range(2))
    w = _put(jnp, random(rng, (512,), np.float32))
    y, h = jax.jit(lambda x, r, w: cj.rms_norm(x, w, residual=r))(x, r, w)
    np.testing.assert_array_equal(np.asarray(h), np.asarray(x + r))
    def f(x, r, w):
        y, h = cj.rms_norm(x, w, residual=r)
        return jnp.sum(jnp.sin(y) + 2 * h)

    g = lambda x, r, w: jnp.sum(jnp.sin(_ref_rms(jnp, x + r, w, 1e-5)) + 2 * (x + r))  # noqa: E731
    for a, b_, what in zip(jax.grad(f, (0, 1, 2))(x, r, w), jax.grad(g, (0, 1, 2))(x, r, w), "xrw"):
        _grad_close(a, b_, f"d{what}", 1e-5)


@pytest.mark.parametrize("last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape,groups", [((2, 12, 5, 7), 3), ((3, 64, 9, 9), 32), ((8, 320, 16, 16), 32)])
def test_group_norm_jit_and_grads(rng, jx, shape, groups, dtype, last):
    jax, jnp, cj = jx
    n, c = shape[:2]
    xs = (n,) + shape[2:] + (c,) if last else shape
    x = _put(jnp, random(rng, xs, np.dtype(jnp.dtype(dtype))))
    w, b = (_put(jnp, random(rng, (c,), np.float32)) for _ in range(2))
    dy = _put(jnp, random(rng, xs, np.float32))
    axis = -1 if last else 1
    ours = lambda x, w, b: cj.group_norm(x, groups, w, b, channel_axis=axis)  # noqa: E731
    theirs = lambda x, w, b: _ref_gn(jnp, x, groups, w, b, 1e-5, last)  # noqa: E731
    y = jax.jit(ours)(x, w, b)
    want = reference.group_norm(_np(x), groups, _np(w), _np(b), channel_axis=axis % len(xs), exact=True)
    assert_close(_np(y), want, x.dtype, atol=RTOL[np.dtype(x.dtype)] * output_scale(want), what="group_norm jit")
    loss = lambda f: jax.jit(jax.grad(lambda x, w, b: jnp.sum(f(x, w, b).astype(jnp.float32) * dy),  # noqa: E731
                                      argnums=(0, 1, 2)))
    for g, h, what in zip(loss(ours)(x, w, b), loss(theirs)(x.astype(jnp.float32), w, b), ("dx", "dw", "db")):
        _grad_close(g, h, f"group_norm {what}", GRAD_REL[dtype] * 2)


def test_batch_norm_training_returns_the_running_buffers(rng, jx):
    jax, jnp, cj = jx
    x = _put(jnp, random(rng, (16, 8, 5, 5), np.float32, offset=2.0))
    w, b = (_put(jnp, random(rng, (8,), np.float32)) for _ in range(2))
    rm, rv = jnp.zeros(8, jnp.float32), jnp.ones(8, jnp.float32)
    y, mean, rstd, rm2, rv2 = jax.jit(lambda x, w, b, rm, rv: cj.batch_norm(
        x, w, b, running_mean=rm, running_var=rv, momentum=0.25, return_stats=True))(x, w, b, rm, rv)
    xn = _np(x)
    m, v = xn.mean((0, 2, 3)), xn.var((0, 2, 3))
    count = xn.size // 8
    np.testing.assert_allclose(np.asarray(mean), m, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(rm2), 0.25 * m, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(rv2), 0.75 + 0.25 * v * count / (count - 1), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(rm), 0)  # the inputs are untouched
    ye = cj.batch_norm(x, w, b, running_mean=rm2, running_var=rv2, training=False)
    want = reference.batch_norm(xn, _np(w), _np(b), running_mean=_np(rm2), running_var=_np(rv2), training=False,
                                exact=True)
    # (an output near zero comes from terms near one cancelling: its error is
    # judged against the terms, w * xhat and b)
    terms = np.abs(want - _np(b)[None, :, None, None]) + np.abs(_np(b))[None, :, None, None]
    assert_close(_np(ye), want, np.float32, atol=RTOL[np.dtype(np.float32)] * float(terms.max()),
                 what="batch_norm eval")
    g = jax.grad(lambda x: jnp.sum(cj.batch_norm(x, w, b, running_mean=rm2, running_var=rv2, training=False) * x))(x)
    gw = jax.grad(lambda x: jnp.sum(((x - rm2[None, :, None, None]) / jnp.sqrt(rv2[None, :, None, None] + 1e-5)
                                     * w[None, :, None, None] + b[None, :, None, None]) * x))(x)
    _grad_close(g, gw, "batch_norm eval dx", 1e-5)


@pytest.mark.parametrize("name", ["rms_norm", "layer_norm", "group_norm", "instance_norm", "normalize"])
def test_vmap_matches_a_loop(rng, jx, name):
    jax, jnp, cj = jx
    call = OP_CALLS[name][0]
    shape, params = op_shapes(name)
    xs = _put(jnp, random(rng, (3,) + shape, np.float32))
    w, b = (_put(jnp, random(rng, params, np.float32)) for _ in range(2))
    got = jax.jit(jax.vmap(lambda x: call(cj, x, w, b)))(xs)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(got[i]), np.asarray(call(cj, xs[i], w, b)), rtol=2e-5, atol=2e-6)
    gv = jax.vmap(jax.grad(lambda x: jnp.sum(call(cj, x, w, b) ** 2)))(xs)
    for i in range(3):
        gi = jax.grad(lambda x: jnp.sum(call(cj, x, w, b) ** 2))(xs[i])
        np.testing.assert_allclose(np.asarray(gv[i]), np.asarray(gi), rtol=1e-4, atol=1e-5)


def test_a_two_layer_model_trains_as_its_jax_numpy_twin(rng, jx):
    jax, jnp, cj = jx
    k = 384
    ones, zeros = jnp.ones(k, jnp.float32), jnp.zeros(k, jnp.float32)
    params = {"w1": _put(jnp, random(rng, (k, k), np.float32) / k**0.5), "g1": ones, "b1": zeros,
              "w2": _put(jnp, random(rng, (k, k), np.float32) / k**0.5), "g2": ones}
    x, target = (_put(jnp, random(rng, (33, k), np.float32)) for _ in range(2))

    def model(norm_ln, norm_rms):
        def f(p, x):
            h = jax.nn.gelu(norm_ln(x @ p["w1"], p["g1"], p["b1"]))
            return jnp.mean((norm_rms(h @ p["w2"], p["g2"]) - target) ** 2)
        return jax.jit(jax.value_and_grad(f))

    ours = model(lambda x, g, b: cj.layer_norm(x, g, b), lambda x, g: cj.rms_norm(x, g))
    theirs = model(lambda x, g, b: _ref_ln(jnp, x, g, b, 1e-5), lambda x, g: _ref_rms(jnp, x, g, 1e-5))
    for _ in range(2):
        (la, ga), (lb, gb) = ours(params, x), theirs(params, x)
        np.testing.assert_allclose(float(la), float(lb), rtol=1e-5)
        for key in params:
            _grad_close(ga[key], gb[key], key, 1e-4)
        params = {key: params[key] - 0.1 * ga[key] for key in params}


def test_odd_sizes_and_float64(rng, jx):
    jax, jnp, cj = jx
    for shape in [(1, 1), (5, 3), (2, 7, 1031), (1, 65537)]:
        x_np = random(rng, shape, np.float64)
        y = jax.jit(lambda x: cj.layer_norm(x, eps=1e-6))(jnp.asarray(x_np))
        assert_close(np.asarray(y), reference.layer_norm(x_np, eps=1e-6, exact=True), np.float64,
                     atol=1e-12 * max(output_scale(reference.layer_norm(x_np, eps=1e-6, exact=True)), 1),
                     what=f"{shape}")
    x = jnp.asarray(np.full((4, 8), np.nan, np.float32))
    assert np.isnan(np.asarray(jax.jit(lambda x: cj.rms_norm(x))(x))).all()


@pytest.mark.parametrize("shape", [(37, 4096), (300, 32768), (4, 1 << 20)], ids=["cached", "long rows", "split"])
@pytest.mark.parametrize("norm", ["rms", "ln"])
def test_statistics_alone_when_y_is_never_read(rng, jx, norm, shape):
    """A jitted call whose y nothing reads writes its statistics alone
    (_rows_dce; rows_cached with a null y): bitwise the eager call's."""
    jax, jnp, cj = jx
    x = _put(jnp, random(rng, shape, np.dtype(jnp.bfloat16)))
    w = _put(jnp, random(rng, shape[-1:], np.float32) + 1)
    if norm == "rms":
        eager = cj.rms_norm(x, w, return_stats=True)[1:]
        stats = jax.jit(lambda x, w: cj.rms_norm(x, w, return_stats=True)[1:])(x, w)
    else:
        eager = cj.layer_norm(x, w, w, return_stats=True)[1:]
        stats = jax.jit(lambda x, w: cj.layer_norm(x, w, w, return_stats=True)[1:])(x, w)
    assert len(stats) == len(eager) > 0
    for got, want in zip(stats, eager):
        assert got.shape == want.shape and np.array_equal(np.asarray(got), np.asarray(want))


EPILOGUES = {"gemma": {"weight_offset": 1}, "llama": {"rounding": "normalized"}, "silu": {"activation": "silu"},
             "all": {"weight_offset": 1, "rounding": "normalized", "activation": "gelu_tanh"}}


def _act(jax, name, y):
    if name is None:
        return y
    return {"relu": jax.nn.relu, "silu": jax.nn.silu, "gelu": lambda v: jax.nn.gelu(v, approximate=False),
            "gelu_tanh": lambda v: jax.nn.gelu(v, approximate=True)}[name](y)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("shape", [(37, 4096), (16, 40000)], ids=["cached", "streamed"])
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
def test_rms_epilogue_inside_jit(rng, jx, epilogue, shape, dtype):
    """weight_offset, rounding and activation inside jit: the eager call's
    kernels (against the eager call and the float64 reference); under
    jax.grad, gradients against a jax.numpy formulation (the rounding passed
    straight through, as cunorm's backward takes it)."""
    jax, jnp, cj = jx
    kw = EPILOGUES[epilogue]
    x_np = random(rng, shape, np.dtype(jnp.dtype(dtype)))
    w_np = random(rng, shape[-1:], np.float32) * 0.5
    x, w = _put(jnp, x_np), _put(jnp, w_np)
    y = jax.jit(lambda x, w: cj.rms_norm(x, w, **kw))(x, w)
    eager = cj.rms_norm(x, w, **kw)
    want = reference.rms_norm(x_np.astype(np.float64), w_np.astype(np.float64), exact=True, **kw)
    tol = RTOL[np.dtype(x.dtype)] * output_scale(want)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(_np(y), want, x.dtype, atol=tol, what=f"{epilogue} jit")
    assert_close(_np(y), _np(eager), x.dtype, atol=tol, what=f"{epilogue} jit against eager")

    def theirs(x, w):
        xf = x.astype(jnp.float32)
        v = xf * jax_rsqrt(jnp, jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-5)
        if kw.get("rounding") == "normalized":
            v = v.astype(x.dtype).astype(jnp.float32)
        return _act(jax, kw.get("activation"), v * (w + 1 if kw.get("weight_offset") else w))

    dy = _put(jnp, random(rng, shape, np.float32))
    loss = lambda f: jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * dy),  # noqa: E731
                                      argnums=(0, 1)))
    got = loss(lambda x, w: cj.rms_norm(x, w, **kw))(x, w)
    ref = loss(theirs)(x, w)
    for g, h, what in zip(got, ref, ("dx", "dw")):
        _grad_close(g, h, f"{epilogue} {what}", GRAD_REL[dtype])


@pytest.mark.parametrize("case", ["layer_norm gelu", "group_norm NHWC silu", "group_norm rows silu",
                                  "instance_norm rows", "batch_norm relu"])
def test_activation_and_unparametrized_channel_norms_inside_jit(rng, jx, case):
    """The activation in each family inside jit (the eager call's kernels)
    and its gradient (jax's, after cunorm's backward); GroupNorm and
    InstanceNorm without parameters on channels-first x (the row family,
    reshaped back)."""
    jax, jnp, cj = jx
    act = {"gelu": "gelu", "silu": "silu", "relu": "relu"}.get(case.split()[-1])
    shape, c = {"layer_norm": ((64, 1000), 1000), "group_norm NHWC": ((4, 16, 16, 320), 320),
                "group_norm rows": ((3, 8, 5, 7), 8), "instance_norm rows": ((3, 16, 33), 16),
                "batch_norm": ((4, 16, 9, 9), 16)}[case.rsplit(" ", 1)[0] if act else case]
    x = _put(jnp, random(rng, shape, np.float32))
    w, b = (_put(jnp, random(rng, (c,), np.float32)) for _ in range(2))
    dy = _put(jnp, random(rng, shape, np.float32))

    def ours(x, w, b):
        if case.startswith("layer_norm"):
            return cj.layer_norm(x, w, b, activation=act)
        if case.startswith("group_norm NHWC"):
            return cj.group_norm(x, 32, w, b, channel_axis=-1, activation=act)
        if case.startswith("group_norm rows"):
            return cj.group_norm(x, 4, activation=act)
        if case.startswith("instance_norm"):
            return cj.instance_norm(x)
        return cj.batch_norm(x, w, b, activation=act)

    def theirs(x, w, b):
        if case.startswith("layer_norm"):
            y = _ref_ln(jnp, x, w, b, 1e-5)
        elif case.startswith("group_norm NHWC"):
            y = _ref_gn(jnp, x, 32, w, b, 1e-5, True)
        elif case.startswith("group_norm rows"):
            y = _ref_gn(jnp, x, 4, jnp.ones(c), jnp.zeros(c), 1e-5, False)
        elif case.startswith("instance_norm"):
            y = _ref_gn(jnp, x, c, jnp.ones(c), jnp.zeros(c), 1e-5, False)
        else:
            m = x.mean((0, 2, 3), keepdims=True)
            v = ((x - m) ** 2).mean((0, 2, 3), keepdims=True)
            y = (x - m) * jax_rsqrt(jnp, v + 1e-5) * w.reshape(1, c, 1, 1) + b.reshape(1, c, 1, 1)
        return _act(jax, act, y)

    y = jax.jit(ours)(x, w, b)
    assert y.shape == x.shape and y.dtype == x.dtype
    eager = ours(x, w, b)
    np.testing.assert_allclose(np.asarray(y), np.asarray(eager), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(y), np.asarray(theirs(x, w, b)), rtol=1e-4, atol=1e-4)
    loss = lambda f: jax.jit(jax.grad(lambda x, w, b: jnp.sum(f(x, w, b) * dy), argnums=(0, 1, 2)))  # noqa: E731
    for g, h, what in zip(loss(ours)(x, w, b), loss(theirs)(x, w, b), ("dx", "dw", "db")):
        if "rows" in case and what != "dx":
            continue
        _grad_close(g, h, f"{case} {what}", 1e-4)


@pytest.mark.parametrize("case", ["rows", "long rows", "grads", "long grads", "group_norm NHWC", "batch_norm grads"])
def test_a_named_target_lowers_as_the_gpu_itself(jx, case):
    """set_lowering_target with this GPU's architecture, multiprocessors and
    L2 lowers to the very program the GPU's own lowering gives: the same
    plans, and persistent grids capped alike (the occupancy rules against
    the driver's occupancy query)."""
    jax, jnp, cj = jx
    from cunorm._engine import launches, targets

    device = launches.device_info(0)
    bf16 = jnp.bfloat16
    loss = lambda f: jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), (0, 1))  # noqa: E731
    f, shapes = {
        "rows": (lambda x, w: cj.rms_norm(x, w), [((4096, 4096), bf16), ((4096,), jnp.float32)]),
        "long rows": (lambda x, w: cj.layer_norm(x, w), [((1024, 65536), bf16), ((65536,), jnp.float32)]),
        "grads": (loss(lambda x, w: cj.layer_norm(x, w)), [((8192, 4096), bf16), ((4096,), jnp.float32)]),
        "long grads": (loss(lambda x, w: cj.rms_norm(x, w)), [((1024, 32768), bf16), ((32768,), jnp.float32)]),
        "group_norm NHWC": (lambda x, w: cj.group_norm(x, 32, w, w, channel_axis=-1),
                            [((8, 64, 64, 320), bf16), ((320,), jnp.float32)]),
        "batch_norm grads": (loss(lambda x, w: cj.batch_norm(x, w, w)), [((32, 256, 28, 28), jnp.float32),
                                                                         ((256,), jnp.float32)]),
    }[case]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]

    def lowered():
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    cj.set_lowering_target(None)
    own = lowered()
    try:
        target = cj.set_lowering_target(f"sm_{device.compute_capability}", sm_count=device.sm_count,
                                        l2_bytes=device.l2_bytes)
        assert target.device == device, "the named architecture's shared memory a block differs from this GPU's"
        named = lowered()
    finally:
        cj.set_lowering_target(None)
    assert named == own
    assert "triton_kernel_call" in own
    assert targets.device_id(target) < 0
