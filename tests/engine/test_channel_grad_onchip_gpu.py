"""channel_grad_onchip (BatchNorm's backward with a channel held in
registers across a cluster of blocks, x and dy read once) on the GPU
against the float64 reference, with its shape forced small: blocks of 32
threads and one vector of x a thread, so a channel spans clusters of 1 to 8
blocks (blocks left empty too) and planes straddle threads. Training and
eval, every dtype, parameters of x's and of float32 dtype, planes of odd
length (scalars) and of whole vectors, NaN confinement, bitwise
reproducibility, the four launches forced on the shapes the dispatch now
sends on chip, and the public default. Every allocation is poisoned (NaN)
first; inputs are checked unchanged.
"""
import numpy as np
import pytest

import cunorm
from cunorm._engine import dtypes, gradients
from cunorm import reference
from helpers import DTYPE_IDS, DTYPES, random
from test_backward_gpu import _close, _param_factor, _unchanged, check_param_grads
from test_channel_onchip_gpu import need_cluster

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _poison(poisoned):
    yield


def grads(dy, x, mean, rstd, weight, bias, training, override):
    """(dx, dweight, dbias) of batch_norm_backward through ``override``."""
    g = gradients.ChannelGradCall("batch", dy, x, mean, rstd, weight=weight, bias=bias, channel_axis=1,
                                  training=training, eps=1e-5)
    return gradients.run_channels(g, None, override=override)


def check(x_np, *, weight=None, bias=None, training=True, override, rng):
    import cupy

    dtype = x_np.dtype
    c = x_np.shape[1]
    x = cupy.asarray(x_np)
    dy_np = random(rng, x_np.shape, dtype)
    dy = cupy.asarray(dy_np)
    w = None if weight is None else cupy.asarray(weight)
    b = None if bias is None else cupy.asarray(bias)
    if training:
        _, mean, rstd = cunorm.batch_norm(x, w, b, return_stats=True)
    else:  # the running mean and variance
        mean = cupy.asarray(random(rng, (c,), np.float32))
        rstd = cupy.asarray(np.abs(random(rng, (c,), np.float32)) + 0.5)
    before = [cupy.asnumpy(a) for a in (x, dy, mean, rstd)]
    dx, dw, db = grads(dy, x, mean, rstd, w, b, training, override)
    _unchanged(before, [cupy.asnumpy(a) for a in (x, dy, mean, rstd)])
    ref = reference.batch_norm_backward(dy_np, x_np, cupy.asnumpy(mean), cupy.asnumpy(rstd), weight, bias,
                                        training=training, exact=True)
    assert dx.dtype == dtype
    what = f"{x_np.shape} {dtype} {override} training={training}"
    _close(cupy.asnumpy(dx), ref[0], dtype, f"dx {what}")
    check_param_grads((dw, db), ref[1:], (weight, bias), dtype, x_np.size // c, what)
    return dx, dw, db


# (batch, channels, plane): channels of 3 to 297 elements, planes of odd
# length (scalars) and of whole vectors, over blocks of 32 threads holding
# the fewest vectors that fit: clusters of 1 to 8 blocks, some empty
SHAPES = [(3, 5, (7, 7)), (2, 4, (4, 4)), (5, 3, (9,)), (4, 6, (8, 8)), (1, 7, (3,)), (9, 2, (33,))]


@pytest.mark.parametrize("cluster", [1, 2, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}x{'x'.join(map(str, s[2]))}")
def test_forced_small_blocks(shape, dtype, cluster, rng):
    need_cluster(cluster)
    batch, c, plane = shape
    x = random(rng, (batch, c, *plane), dtype)
    spatial = int(np.prod(plane))
    vec = 16 // np.dtype(dtype).itemsize
    vec = vec if spatial % vec == 0 else 1
    items = -(-batch * spatial // (vec * 32 * cluster))
    override = {"walk": "onchip", "threads": 32, "elements": items * vec, "cluster": cluster}
    check(x, weight=random(rng, (c,), dtype, offset=1.0), bias=random(rng, (c,), dtype), override=override,
          rng=rng)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("params", ["none", "weight", "bias", "float32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_parameters_and_modes(dtype, params, training, rng):
    x = random(rng, (6, 10, 7, 7), dtype)
    pdtype = np.float32 if params == "float32" and dtype != np.float64 else dtype
    w = random(rng, (10,), pdtype, offset=1.0) if params in ("weight", "float32") else None
    b = random(rng, (10,), pdtype) if params in ("bias", "float32") else None
    check(x, weight=w, bias=b, training=training, override={"walk": "onchip"}, rng=rng)


@pytest.mark.parametrize("walk", ["onchip", "split"])
@pytest.mark.parametrize("shape", [(64, 16, 7, 7), (32, 8, 14, 14), (8, 4, 28, 28), (2, 3, 130, 130)],
                         ids=lambda s: "x".join(map(str, s)))
def test_shapes_the_dispatch_takes(shape, walk, rng):
    """The ladder's own shapes (clusters on the largest channels) and the
    four launches on the same channels (the dispatch no longer sends them
    there, so they are forced)."""
    if walk == "onchip" and shape[0] * shape[2] * shape[3] > 16384:
        need_cluster(8)
    x = random(rng, shape, np.float32)
    c = shape[1]
    check(x, weight=random(rng, (c,), np.float32, offset=1.0), bias=random(rng, (c,), np.float32),
          override={"walk": walk}, rng=rng)


def test_mean_far_from_zero(rng):
    """x of mean 1e4 and unit spread (the saved statistics carry the shift)."""
    x = (random(rng, (16, 6, 7, 7), np.float32) + 1e4).astype(np.float32)
    check(x, weight=random(rng, (6,), np.float32, offset=1.0), override={"walk": "onchip"}, rng=rng)


def test_nan_stays_in_its_channel(rng):
    import cupy

    x = cupy.asarray(random(rng, (4, 5, 7, 7), np.float32))
    dy = cupy.asarray(random(rng, (4, 5, 7, 7), np.float32))
    w = cupy.asarray(random(rng, (5,), np.float32, offset=1.0))
    _, mean, rstd = cunorm.batch_norm(x, w, w, return_stats=True)
    dy[2, 3, 4, 1] = np.nan
    dx, dw, db = grads(dy, x, mean, rstd, w, w, True, {"walk": "onchip", "threads": 32, "elements": 8,
                                                       "cluster": 1})
    bad = cupy.asnumpy(cupy.isnan(dx).any(axis=(0, 2, 3)))
    assert bad.tolist() == [False, False, False, True, False]
    assert cupy.asnumpy(cupy.isnan(dw)).tolist() == [False, False, False, True, False]
    assert cupy.asnumpy(cupy.isnan(db)).tolist() == [False, False, False, True, False]


@pytest.mark.parametrize("cluster,elements", [(1, 16), (4, 4)])
def test_bitwise_reproducible(cluster, elements, rng):
    import cupy

    need_cluster(cluster)
    x = cupy.asarray(random(rng, (4, 6, 13, 13), np.float32))  # channels of 676 scalars, 1024 slots
    dy = cupy.asarray(random(rng, x.shape, np.float32))
    w = cupy.asarray(random(rng, (6,), np.float32, offset=1.0))
    _, mean, rstd = cunorm.batch_norm(x, w, w, return_stats=True)
    override = {"walk": "onchip", "threads": 64, "elements": elements, "cluster": cluster}
    first = [cupy.asnumpy(a).tobytes() for a in grads(dy, x, mean, rstd, w, w, True, override)]
    second = [cupy.asnumpy(a).tobytes() for a in grads(dy, x, mean, rstd, w, w, True, override)]
    assert first == second


def test_public_default_walk_and_replay(rng):
    """cunorm.batch_norm_backward takes the onchip walk on a small channel
    (the launch cache's replay too) and agrees with the reference."""
    import cupy

    from cunorm._engine import dispatch_grad, launches, plans

    x_np = random(rng, (8, 12, 7, 7), dtypes.bfloat16)
    plan = plans.make_channel_plan("batch", x_np.dtype, np.dtype(np.float32), 3, False, 8, 12, 49, 1, False, 0, 0)
    launch = dispatch_grad.choose_channel_grad(plan, True, launches.device_info(0))
    assert launch.tier == "channel_onchip"
    x = cupy.asarray(x_np)
    w = cupy.asarray(random(rng, (12,), np.float32, offset=1.0))
    _, mean, rstd = cunorm.batch_norm(x, w, w, return_stats=True)
    dy_np = random(rng, x_np.shape, x_np.dtype)
    dy = cupy.asarray(dy_np)
    ref = reference.batch_norm_backward(dy_np, x_np, cupy.asnumpy(mean), cupy.asnumpy(rstd), cupy.asnumpy(w),
                                        cupy.asnumpy(w), exact=True)
    for _ in range(3):
        dx, dw, db = cunorm.batch_norm_backward(dy, x, mean, rstd, w, w)
        _close(cupy.asnumpy(dx), ref[0], x_np.dtype, "dx")
        _close(cupy.asnumpy(dw), ref[1], np.float32, "dweight", factor=_param_factor(np.float32, 8 * 49))


def test_refusals():
    import cupy

    x = cupy.ones((2, 3, 4, 4), np.float32)
    _, mean, rstd = cunorm.batch_norm(x, return_stats=True)
    g = gradients.ChannelGradCall("batch", x, x.transpose(0, 2, 3, 1).copy().transpose(0, 3, 1, 2), mean, rstd,
                                  channel_axis=1)
    with pytest.raises(ValueError, match="channel_grad_onchip does not take"):
        gradients.run_channels(g, None, override={"walk": "onchip"})
