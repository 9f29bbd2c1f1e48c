"""channel_stream (GroupNorm and InstanceNorm channels-first, x read from
DRAM once) on the GPU against the float64 reference, with its schedule
forced small: tiles of a few vectors (many tiles a group, the last one
short), slabs of one group, lags of 1 to more slabs than there are, every L2
hint. Every dtype, parameters of x's and of float32 dtype, float32 y of
16-bit x, statistics returned, NaN confinement, bitwise reproducibility.
Every allocation is poisoned (NaN) first; inputs are checked unchanged.
"""
import functools

import numpy as np
import pytest

from channel_checks import check as check_walk, run as run_walk, vec_of
from cunorm._engine import channel_norms, dtypes
from cunorm import reference
from helpers import DTYPE_IDS, DTYPES, RTOL, assert_close, output_scale, random

pytestmark = pytest.mark.gpu
run = functools.partial(run_walk, walk="stream")
check = functools.partial(check_walk, walk="stream")


@pytest.fixture(autouse=True)
def _poison(poisoned):
    yield


# (override, what it exercises)
SCHEDULES = [
    ({}, "the default"),
    ({"tile_vecs": 3, "slab_bytes": 1}, "tiles of 3 vectors, slabs of one group, lag 1"),
    ({"tile_vecs": 5, "slab_bytes": 1, "lag": 3}, "lag 3"),
    ({"tile_vecs": 7, "slab_bytes": 1 << 12, "lag": 1000}, "lag past the last slab: every partial first"),
    ({"tile_vecs": 64, "slab_bytes": 1, "hints": 0}, "no hints"),
    ({"tile_vecs": 2, "slab_bytes": 1, "hints": 1}, "streaming stores only"),
    ({"tile_vecs": 1, "slab_bytes": 3000, "hints": 2}, "last-use loads only, one-vector tiles"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("override,what", SCHEDULES, ids=[w for _, w in SCHEDULES])
def test_group_norm_schedules(rng, dtype, override, what):
    v = vec_of(dtype)
    x = random(rng, (3, 12, 5, 4 * v), dtype, scale=2.0, offset=0.5)
    check(x, "group", groups=4, weight=random(rng, (12,), dtype), bias=random(rng, (12,), dtype),
          override=override)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("params", ["none", "w", "b", "w b", "w b float32"])
@pytest.mark.parametrize("shape,groups", [((2, 6, 3), 3), ((1, 5), 1), ((4, 7, 9), 7), ((2, 64, 3), 8)],
                         ids=["cpg2", "one-group", "cpg1", "cpg8"])
def test_parameters_and_group_sizes(rng, dtype, params, shape, groups):
    x = random(rng, shape + (3 * vec_of(dtype),), dtype)  # planes of 3 vectors: tiles straddle channels
    pdtype = np.float32 if "float32" in params and dtype != np.float64 else dtype
    c = shape[1]
    w = random(rng, (c,), pdtype) if "w" in params else None
    b = random(rng, (c,), pdtype) if "b" in params else None
    check(x, "group", groups=groups, weight=w, bias=b, override={"tile_vecs": 4, "slab_bytes": 1})


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_instance_norm(rng, dtype):
    v = vec_of(dtype)
    x = random(rng, (3, 5, 7, 2 * v), dtype, offset=3.0)
    check(x, "instance", weight=random(rng, (5,), dtype), override={"tile_vecs": 4, "slab_bytes": 1, "lag": 2})
    check(x, "instance", override={"tile_vecs": 4})


@pytest.mark.parametrize("dtype", [dtypes.float16, dtypes.bfloat16], ids=["f16", "bf16"])
def test_float32_output_of_16_bit_x(rng, dtype):
    x = random(rng, (2, 8, 6, 16), dtype)
    check(x, "group", groups=2, weight=random(rng, (8,), np.float32), bias=random(rng, (8,), np.float32),
          override={"tile_vecs": 3, "slab_bytes": 1}, out_dtype=np.dtype(np.float32))


def test_mean_1e4_keeps_precision(rng):
    x = random(rng, (2, 8, 64, 64), np.float32, scale=1.0, offset=1e4)
    check(x, "group", groups=4, override={"tile_vecs": 32, "slab_bytes": 1})


def test_nan_stays_in_its_group(rng):
    import cupy

    x = random(rng, (3, 8, 5, 8), np.float32)
    x[1, 5, 2, 3] = np.nan  # sample 1, group 2 (channels 4 and 5)
    y, mean, rstd = run(cupy.asarray(x), "group", groups=4, override={"tile_vecs": 3, "slab_bytes": 1})
    bad = np.zeros(y.shape, bool)
    bad[1, 4:6] = True
    assert np.isnan(y[bad]).all() and np.isfinite(y[~bad]).all()
    assert np.isnan(mean[1, 2]) and np.isfinite(np.delete(mean.ravel(), 1 * 4 + 2)).all()


@pytest.mark.parametrize("override", [{}, {"tile_vecs": 3, "slab_bytes": 1}, {"tile_vecs": 16, "lag": 2}])
def test_bitwise_reproducible(rng, override):
    import cupy

    x = cupy.asarray(random(rng, (4, 16, 64, 64), np.float32))
    w = cupy.asarray(random(rng, (16,), np.float32))
    first = run(x, "group", groups=4, weight=w, override=override)
    for _ in range(3):
        again = run(x, "group", groups=4, weight=w, override=override)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(first, again))


def test_default_walk_of_the_public_functions(rng):
    """group_norm with parameters on x larger than L2 takes channel_stream;
    without parameters, the row family."""
    import cupy

    from cunorm import group_norm

    x_np = random(rng, (4, 64, 256, 256), np.float32)  # 64 MB
    x = cupy.asarray(x_np)
    w_np = random(rng, (64,), np.float32)
    w = cupy.asarray(w_np)
    call = channel_norms.ChannelCall("group", x, num_groups=8, weight=w, eps=1e-5, channel_axis=1)
    assert channel_norms.execute(call, *channel_norms.prepare(call))[0] == "channel_stream"
    wy = reference.group_norm(x_np, 8, w_np, exact=True)
    assert_close(cupy.asnumpy(group_norm(x, 8, w)), wy, np.float32, atol=RTOL[dtypes.float32] * output_scale(wy))
    # the second call of the signature replays the launch cache's entry (its
    # counters zeroed again): new data, a new result
    x2_np = random(rng, (4, 64, 256, 256), np.float32, offset=2.0)
    wy2 = reference.group_norm(x2_np, 8, w_np, exact=True)
    for _ in range(2):
        assert_close(cupy.asnumpy(group_norm(cupy.asarray(x2_np), 8, w)), wy2, np.float32,
                     atol=RTOL[dtypes.float32] * output_scale(wy2))
    call = channel_norms.ChannelCall("group", x, num_groups=8, eps=1e-5, channel_axis=1)
    assert channel_norms.execute(call, *channel_norms.prepare(call))[0].startswith("rows")


def test_forced_stream_refuses_what_it_cannot_run(rng):
    import cupy

    odd = cupy.asarray(random(rng, (2, 4, 5, 5), np.float32))  # 25 positions: no 16-byte vectors
    call = channel_norms.ChannelCall("group", odd, num_groups=2, eps=1e-5, channel_axis=1)
    with pytest.raises(ValueError, match="16-byte vectors"):
        channel_norms.execute(call, *channel_norms.prepare(call), override={"walk": "stream"})
    nhwc = cupy.asarray(random(rng, (2, 4, 4, 8), np.float32))
    call = channel_norms.ChannelCall("group", nhwc, num_groups=2, eps=1e-5, channel_axis=-1)
    with pytest.raises(ValueError, match="channel_stream"):
        channel_norms.execute(call, *channel_norms.prepare(call), override={"walk": "stream"})
