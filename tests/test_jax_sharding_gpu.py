"""cunorm.jax inside jit programs partitioned over two GPUs
(cunorm/jax/_sharding.py): outputs and gradients against the call on one
GPU, the shardings the results keep, and the collectives in the compiled
program (skipped with fewer than two GPUs).

Row norms and the per-sample channel norms are batch invariant, so every
result but dweight and dbias (summed across the shards) is bitwise the
unsharded call's."""
import os

import numpy as np
import pytest

from helpers import random

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def env():
    jax = pytest.importorskip("jax")
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2:
        pytest.skip(f"needs two GPUs, JAX sees {len(gpus)}")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    import cunorm.jax as cj

    mesh = Mesh(np.array(gpus[:2]), ("d",))
    return jax, cj, mesh, lambda *spec: NamedSharding(mesh, PartitionSpec(*spec)), gpus[0]


def _hlo(jax, f, *args):
    return jax.jit(f).lower(*args).compile().as_text()


def _collectives(text):
    return {name for name in ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
            if name + "(" in text or name + "-start(" in text}


ROW_CASES = {
    "rms_norm": (lambda cj, x, w, b, r: cj.rms_norm(x, w), (64, 3, 512), -1),
    "rms_norm residual stats": (lambda cj, x, w, b, r: cj.rms_norm(x, w, residual=r, return_stats=True),
                                (64, 3, 512), -1),
    "layer_norm": (lambda cj, x, w, b, r: cj.layer_norm(x, w, b, activation="gelu"), (64, 1000), -1),
    "layer_norm two axes stats": (lambda cj, x, w, b, r: cj.layer_norm(x, w, b, axis=(1, 2), return_stats=True),
                                  (64, 6, 40), (1, 2)),
    "rms_norm strided axis": (lambda cj, x, w, b, r: cj.rms_norm(x, w, axis=1), (64, 24, 33), 1),
    "rms_norm quantized per row": (lambda cj, x, w, b, r: cj.rms_norm(x, w, quantize="float8_e4m3fn"),
                                   (64, 3, 512), -1),
    "layer_norm quantized per group": (lambda cj, x, w, b, r: cj.layer_norm(
        x, w, b, residual=r, quantize="int8", quant_group=128, return_unquantized=True), (64, 512), -1),
}


def _row_arrays(jax, rng, shape, axis, dtype):
    axes = (axis,) if isinstance(axis, int) else axis
    pshape = tuple(shape[a] for a in axes)
    x, r = (random(rng, shape, np.dtype(dtype)) for _ in range(2))
    w, b = (random(rng, pshape, np.float32) for _ in range(2))
    return x, w, b, r


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("case", list(ROW_CASES))
def test_row_norms_run_on_each_shard(rng, env, case, dtype):
    jax, cj, mesh, sharded, one = env
    jnp = jax.numpy
    f, shape, axis = ROW_CASES[case]
    x, w, b, r = _row_arrays(jax, rng, shape, axis, jnp.dtype(dtype))
    fn = lambda x, w, b, r: f(cj, x, w, b, r)  # noqa: E731
    args = [jax.device_put(x, sharded("d")), jax.device_put(w, sharded()), jax.device_put(b, sharded()),
            jax.device_put(r, sharded("d"))]
    outs = jax.jit(fn)(*args)
    alone = jax.jit(fn)(*[jax.device_put(a, one) for a in (x, w, b, r)])
    outs, alone = (o if isinstance(o, tuple) else (o,) for o in (outs, alone))
    for got, want in zip(outs, alone):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert got.sharding.is_equivalent_to(sharded("d"), got.ndim), got.sharding
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    assert not _collectives(_hlo(jax, fn, *args))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("case", ["rms_norm", "layer_norm", "rms_norm residual stats", "rms_norm strided axis"])
def test_row_gradients_sum_the_parameters_across_shards(rng, env, case, dtype):
    jax, cj, mesh, sharded, one = env
    jnp = jax.numpy
    f, shape, axis = ROW_CASES[case]
    x, w, b, r = _row_arrays(jax, rng, shape, axis, jnp.dtype(dtype))
    dy = random(rng, shape, np.float32)

    def loss(x, w, b, r, dy):
        out = f(cj, x, w, b, r)
        y = out[0] if isinstance(out, tuple) else out
        return jnp.sum(y.astype(jnp.float32) * dy)

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    used = 3 if "layer" in case else 2
    args = [jax.device_put(x, sharded("d")), jax.device_put(w, sharded()), jax.device_put(b, sharded()),
            jax.device_put(r, sharded("d")), jax.device_put(dy, sharded("d"))]
    got = jax.jit(grad)(*args)
    want = jax.jit(grad)(*[jax.device_put(a, one) for a in (x, w, b, r, dy)])
    np.testing.assert_array_equal(np.asarray(got[0].astype(jnp.float32)), np.asarray(want[0].astype(jnp.float32)))
    assert got[0].sharding.is_equivalent_to(sharded("d"), got[0].ndim)
    for g, wnt in zip(got[1:used], want[1:used]):  # (the sums' order differs: two partial sums, then their sum)
        assert g.sharding.is_fully_replicated
        np.testing.assert_allclose(np.asarray(g), np.asarray(wnt), rtol=2e-5, atol=1e-5 * float(np.abs(wnt).max()))
    assert _collectives(_hlo(jax, grad, *args)) == {"all-reduce"}


CHANNEL_CASES = {
    "group_norm NCHW": (lambda cj, x, w, b: cj.group_norm(x, 4, w, b), (8, 32, 9, 7), 1),
    "group_norm NHWC silu": (lambda cj, x, w, b: cj.group_norm(x, 8, w, b, channel_axis=-1, activation="silu"),
                             (8, 5, 6, 32), -1),
    "instance_norm stats": (lambda cj, x, w, b: cj.instance_norm(x, w, b, return_stats=True), (8, 12, 50), 1),
    "group_norm without parameters": (lambda cj, x, w, b: cj.group_norm(x, 4), (8, 32, 9, 7), 1),
}


@pytest.mark.parametrize("case", list(CHANNEL_CASES))
def test_per_sample_channel_norms_run_on_each_shard(rng, env, case):
    jax, cj, mesh, sharded, one = env
    jnp = jax.numpy
    f, shape, axis = CHANNEL_CASES[case]
    x = random(rng, shape, np.dtype(jnp.bfloat16))
    w, b = (random(rng, (shape[axis],), np.float32) for _ in range(2))
    dy = random(rng, shape, np.float32)
    fn = lambda x, w, b: f(cj, x, w, b)  # noqa: E731
    args = [jax.device_put(x, sharded("d")), jax.device_put(w, sharded()), jax.device_put(b, sharded())]
    outs, alone = jax.jit(fn)(*args), jax.jit(fn)(*[jax.device_put(a, one) for a in (x, w, b)])
    outs, alone = (o if isinstance(o, tuple) else (o,) for o in (outs, alone))
    for got, want in zip(outs, alone):
        assert got.sharding.is_equivalent_to(sharded("d"), got.ndim), got.sharding
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    assert not _collectives(_hlo(jax, fn, *args))

    def loss(x, w, b, dy):
        out = fn(x, w, b)
        y = out[0] if isinstance(out, tuple) else out
        return jnp.sum(y.astype(jnp.float32) * dy)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    got = jax.jit(grad)(*args, jax.device_put(dy, sharded("d")))
    want = jax.jit(grad)(*[jax.device_put(a, one) for a in (x, w, b, dy)])
    np.testing.assert_array_equal(np.asarray(got[0].astype(jnp.float32)), np.asarray(want[0].astype(jnp.float32)))
    if "without" not in case:
        for g, wnt in zip(got[1:], want[1:]):
            np.testing.assert_allclose(np.asarray(g), np.asarray(wnt), rtol=2e-5,
                                       atol=1e-5 * float(np.abs(wnt).max()))
        assert _collectives(_hlo(jax, grad, *args, jax.device_put(dy, sharded("d")))) == {"all-reduce"}


def test_statistics_across_shards_gather_first(rng, env):
    """BatchNorm's statistics span the batch, and a row norm's normalized
    axis sharded must be whole: x is gathered, the results agree with the
    call on one GPU."""
    jax, cj, mesh, sharded, one = env
    x = random(rng, (8, 16, 5, 5), np.float32)
    w, b = (random(rng, (16,), np.float32) for _ in range(2))
    fn = lambda x, w, b: cj.batch_norm(x, w, b, return_stats=True)  # noqa: E731
    args = [jax.device_put(x, sharded("d")), jax.device_put(w, sharded()), jax.device_put(b, sharded())]
    for got, want in zip(jax.jit(fn)(*args), jax.jit(fn)(*[jax.device_put(a, one) for a in (x, w, b)])):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert "all-gather" in _collectives(_hlo(jax, fn, *args))
    x = random(rng, (6, 1024), np.float32)
    wr = random(rng, (1024,), np.float32)
    fn = lambda x, w: cj.rms_norm(x, w)  # noqa: E731
    args = [jax.device_put(x, sharded(None, "d")), jax.device_put(wr, sharded())]
    got = jax.jit(fn)(*args)
    assert "all-gather" in _collectives(_hlo(jax, fn, *args))
    want = jax.jit(fn)(jax.device_put(x, one), jax.device_put(wr, one))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_inside_shard_map_each_call_is_the_shards_own(rng, env):
    jax, cj, mesh, sharded, one = env
    from jax.sharding import PartitionSpec as P

    try:
        from jax import shard_map
    except ImportError:  # (older jax)
        from jax.experimental.shard_map import shard_map
    x = random(rng, (16, 256), np.float32)
    f = shard_map(lambda x: cj.rms_norm(x), mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    got = jax.jit(f)(jax.device_put(x, sharded("d")))
    want = jax.jit(cj.rms_norm)(jax.device_put(x, one))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("split", ["batch", "tokens"])
def test_conditioned_calls_read_their_own_rows_on_each_shard(rng, env, split):
    """adaLN-Zero (residual_gate, shift and scale per sample, a weight)
    with x split by the batch or by the tokens: each shard's kernels read
    the modulation rows of its own rows. The forward is bitwise the
    unsharded call's with no collective; under jax.grad (the fused
    modulated backward) dx and the residual's gradient are too, sharded as
    x, and the per-sample sums split with the batch are bitwise, split by
    the tokens summed across the shards (all-reduce), as dweight is."""
    jax, cj, mesh, sharded, one = env
    jnp = jax.numpy
    shape = (8, 64, 256)
    x, r, dy, dh = (random(rng, shape, np.float32) for _ in range(4))
    mods = [random(rng, (shape[0], 1, shape[-1]), np.float32, 0.5) for _ in range(3)]
    w = random(rng, shape[-1:], np.float32, 0.5, 1.0)

    def loss(x, r, w, shift, scale, gate, dy, dh):
        y, h = cj.layer_norm(x, w, residual=r, shift=shift, scale=scale, residual_gate=gate)
        return jnp.sum(y * dy) + jnp.sum(h * dh), (y, h)

    rows = sharded("d") if split == "batch" else sharded(None, "d")
    mod = sharded("d") if split == "batch" else sharded()
    args = [jax.device_put(x, rows), jax.device_put(r, rows), jax.device_put(w, sharded())] + [
        jax.device_put(m, mod) for m in mods] + [jax.device_put(dy, rows), jax.device_put(dh, rows)]
    alone = [jax.device_put(a, one) for a in (x, r, w, *mods, dy, dh)]
    forward = lambda *a: loss(*a)[1]  # noqa: E731
    for got, want in zip(jax.jit(forward)(*args), jax.jit(forward)(*alone)):
        assert got.sharding.is_equivalent_to(rows, got.ndim), got.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not _collectives(_hlo(jax, forward, *args))
    grad = jax.grad(lambda *a: loss(*a)[0], argnums=tuple(range(6)))
    got, want = jax.jit(grad)(*args), jax.jit(grad)(*alone)
    for g, wnt in zip(got[:2], want[:2]):
        assert g.sharding.is_equivalent_to(rows, g.ndim)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(wnt))
    for g, wnt in zip(got[2:], want[2:]):  # dweight, dshift, dscale, dgate
        if split == "batch" and g.ndim == 3:
            assert g.sharding.is_equivalent_to(mod, g.ndim)
            np.testing.assert_array_equal(np.asarray(g), np.asarray(wnt))
        else:
            np.testing.assert_allclose(np.asarray(g), np.asarray(wnt), rtol=2e-5,
                                       atol=1e-5 * float(np.abs(wnt).max()))
    assert _collectives(_hlo(jax, grad, *args)) == {"all-reduce"}
