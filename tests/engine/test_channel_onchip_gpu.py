"""channel_onchip (a statistic group held in registers across a cluster of
blocks, x read once) on the GPU against the float64 reference, with its
shape forced small: blocks of 32 threads and one vector a thread, so a group
spans clusters of 1 to 8 blocks (blocks left empty too) and rows straddle
threads. GroupNorm and InstanceNorm channels-first and channels-last,
BatchNorm channels-first with its running estimates; every dtype,
parameters of x's and of float32 dtype, float32 y of 16-bit x, statistics
returned, NaN confinement, bitwise reproducibility. Every allocation is
poisoned (NaN) first; inputs are checked unchanged.
"""
import numpy as np
import pytest

from channel_checks import check, run, vec_of
from cunorm._engine import channel_norms, dtypes
from cunorm import reference
from helpers import DTYPE_IDS, DTYPES, RTOL, assert_close, output_scale, random

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _poison(poisoned):
    yield


def clusters_supported() -> bool:
    import cupy

    return int(cupy.cuda.Device().compute_capability) >= 90


def need_cluster(k):
    if k > 1 and not clusters_supported():
        pytest.skip("thread-block clusters need sm_90")


def small(k, items=1):
    """32-thread blocks of ``items`` vectors a thread, clusters of k."""
    return lambda dtype: {"threads": 32, "elements": items * vec_of(dtype), "cluster": k}


# (shape, groups, override): groups of 60 vectors over 64 vector slots
# (clusters of 1 to 8 blocks of 32 threads; past 2, blocks with nothing).
SHAPES = [({}, "the default"), (small(1, 2), "one block"), (small(2), "cluster of 2"),
          (small(4), "cluster of 4, a block empty"), (small(8), "cluster of 8, six blocks empty")]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape,what", SHAPES, ids=[w for _, w in SHAPES])
def test_group_norm_shapes(rng, dtype, shape, what):
    override = shape(dtype) if shape else {}
    need_cluster(override.get("cluster", 1))
    v = vec_of(dtype)
    x = random(rng, (3, 12, 5, 4 * v), dtype, scale=2.0, offset=0.5)
    check(x, "group", groups=4, weight=random(rng, (12,), dtype), bias=random(rng, (12,), dtype),
          override=override)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("params", ["none", "w", "b", "w b", "w b float32"])
@pytest.mark.parametrize("shape,groups", [((2, 6, 3), 3), ((1, 5), 1), ((4, 7, 9), 7), ((2, 64, 3), 8)],
                         ids=["cpg2", "one-group", "cpg1", "cpg8"])
def test_parameters_and_group_sizes(rng, dtype, params, shape, groups):
    x = random(rng, shape + (3 * vec_of(dtype),), dtype)  # planes of 3 vectors: a thread's items straddle channels
    pdtype = np.float32 if "float32" in params and dtype != np.float64 else dtype
    c = shape[1]
    w = random(rng, (c,), pdtype) if "w" in params else None
    b = random(rng, (c,), pdtype) if "b" in params else None
    k = 2 if clusters_supported() else 1
    check(x, "group", groups=groups, weight=w, bias=b, override={"threads": 32, "elements": 64, "cluster": k})


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("k", [1, 2, 8])
def test_batch_norm_rows_of_samples(rng, dtype, k):
    """A channel's planes of every sample: odd planes (scalars) and vector
    planes, rows cut across the blocks of a cluster; running estimates."""
    need_cluster(k)
    for shape in [(5, 3, 7, 7), (9, 4, 2 * vec_of(dtype))]:
        x = random(rng, shape, dtype, offset=1.0)
        c = shape[1]
        group = shape[0] * int(np.prod(shape[2:]))
        vec = 1 if shape[2] == 7 else vec_of(dtype)
        items = -(-group // (vec * 32 * k))
        check(x, "batch", weight=random(rng, (c,), dtype), bias=random(rng, (c,), dtype),
              override={"threads": 32, "elements": items * vec, "cluster": k}, rng=rng)
        check(x, "batch", override={}, rng=rng)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("k", [1, 4])
def test_channels_last_group_norm(rng, dtype, k):
    """NHWC: a row per position of the group's channels (whole vectors),
    parameters loaded as vectors."""
    need_cluster(k)
    v = vec_of(dtype)
    x = random(rng, (3, 5, 3, 4 * v), dtype, offset=-2.0)  # 4 groups of v channels
    check(x, "group", groups=4, axis=-1, weight=random(rng, (4 * v,), dtype), bias=random(rng, (4 * v,), dtype),
          override={"threads": 32, "elements": v, "cluster": k})
    check(x, "group", groups=2, axis=-1, override={})


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_instance_norm(rng, dtype):
    v = vec_of(dtype)
    x = random(rng, (3, 5, 7, 2 * v), dtype, offset=3.0)
    check(x, "instance", weight=random(rng, (5,), dtype), override=small(1, 1)(dtype))
    check(x, "instance", override={})


@pytest.mark.parametrize("dtype", [dtypes.float16, dtypes.bfloat16], ids=["f16", "bf16"])
def test_float32_output_of_16_bit_x(rng, dtype):
    x = random(rng, (2, 8, 6, 16), dtype)
    check(x, "group", groups=2, weight=random(rng, (8,), np.float32), bias=random(rng, (8,), np.float32),
          out_dtype=np.dtype(np.float32))


def test_mean_1e4_keeps_precision(rng):
    x = random(rng, (2, 8, 64, 64), np.float32, scale=1.0, offset=1e4)
    check(x, "group", groups=4)
    check(x, "batch", override={"threads": 256, "elements": 32, "cluster": 8 if clusters_supported() else 1}, rng=rng)


def test_nan_stays_in_its_group(rng):
    import cupy

    x = random(rng, (3, 8, 5, 8), np.float32)
    x[1, 5, 2, 3] = np.nan  # sample 1, group 2 (channels 4 and 5)
    k = 2 if clusters_supported() else 1
    y, mean, rstd = run(cupy.asarray(x), "group", groups=4, override={"threads": 32, "elements": 4, "cluster": k})
    bad = np.zeros(y.shape, bool)
    bad[1, 4:6] = True
    assert np.isnan(y[bad]).all() and np.isfinite(y[~bad]).all()
    assert np.isnan(mean[1, 2]) and np.isfinite(np.delete(mean.ravel(), 1 * 4 + 2)).all()
    y, mean, rstd = run(cupy.asarray(x), "batch", override={})  # BatchNorm: channel 5 only
    assert np.isnan(y[:, 5]).all() and np.isfinite(np.delete(y, 5, axis=1)).all()


@pytest.mark.parametrize("override", [{}, {"threads": 128, "elements": 16, "cluster": 2},
                                      {"threads": 64, "elements": 32, "cluster": 8}])
def test_bitwise_reproducible(rng, override):
    import cupy

    need_cluster(override.get("cluster", 1))
    x = cupy.asarray(random(rng, (4, 16, 32, 32), np.float32))
    w = cupy.asarray(random(rng, (16,), np.float32))
    first = run(x, "group", groups=4, weight=w, override=override)
    for _ in range(3):
        again = run(x, "group", groups=4, weight=w, override=override)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(first, again))


def test_default_walk_of_the_public_functions(rng):
    """BatchNorm on ResNet-50's last activations and InstanceNorm with
    parameters take channel_onchip by default; the public call (its launch
    cache replayed on new data) matches the reference."""
    import cupy

    from cunorm import batch_norm, instance_norm

    x_np = random(rng, (16, 256, 7, 7), np.float32)
    x = cupy.asarray(x_np)
    call = channel_norms.ChannelCall("batch", x, eps=1e-5, channel_axis=1)
    assert channel_norms.execute(call, *channel_norms.prepare(call))[0] == "channel_onchip"
    for offset in (0.0, 2.0):
        x_np = random(rng, (16, 256, 7, 7), np.float32, offset=offset)
        wy = reference.batch_norm(x_np, exact=True)
        assert_close(cupy.asnumpy(batch_norm(cupy.asarray(x_np))), wy, np.float32,
                     atol=RTOL[dtypes.float32] * output_scale(wy))
    x_np = random(rng, (2, 8, 64, 64), np.float32)
    w_np = random(rng, (8,), np.float32)
    call = channel_norms.ChannelCall("instance", cupy.asarray(x_np), weight=cupy.asarray(w_np), eps=1e-5, channel_axis=1)
    assert channel_norms.execute(call, *channel_norms.prepare(call))[0] == "channel_onchip"
    wy = reference.instance_norm(x_np, w_np, exact=True)
    assert_close(cupy.asnumpy(instance_norm(cupy.asarray(x_np), cupy.asarray(w_np))), wy, np.float32,
                 atol=RTOL[dtypes.float32] * output_scale(wy))


def test_forced_onchip_refuses_what_it_cannot_hold(rng):
    import cupy

    x = cupy.asarray(random(rng, (2, 4, 8, 8), np.float32))  # groups of 128 floats
    call = channel_norms.ChannelCall("group", x, num_groups=2, eps=1e-5, channel_axis=1)
    with pytest.raises(ValueError, match="channel_onchip"):
        channel_norms.execute(call, *channel_norms.prepare(call),
                              override={"walk": "onchip", "threads": 8, "elements": 4, "cluster": 1})
    nhwc = cupy.asarray(random(rng, (2, 4, 4, 8), np.float32))  # 2 channels a group: not whole 4-float vectors
    call = channel_norms.ChannelCall("group", nhwc, num_groups=4, eps=1e-5, channel_axis=-1)
    with pytest.raises(ValueError, match="channel_onchip"):
        channel_norms.execute(call, *channel_norms.prepare(call), override={"walk": "onchip"})
    bn_nhwc = cupy.asarray(random(rng, (2, 4, 4, 8), np.float32))
    call = channel_norms.ChannelCall("batch", bn_nhwc, eps=1e-5, channel_axis=-1)
    with pytest.raises(ValueError, match="channel_onchip"):
        channel_norms.execute(call, *channel_norms.prepare(call), override={"walk": "onchip"})
