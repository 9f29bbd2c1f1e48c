"""The three launches (channel_partial, channel_finalize, channel_apply),
forced, against the float64 reference. Channels-first x: plane rows and
chunked planes, with the finalize launched and folded into the apply.
Channels-last x: grouped (a thread keeps one statistic: each vector's
channels in one group; vectors narrower than the plan's where a group is
not whole vectors of its width; a group across a whole tile of 256
vectors), paired (a thread keeps two, a vector straddling two groups; odd
and 2-mod-4 group sizes; forced on groups of whole vectors) and a
statistic per channel (groups narrower than a vector; a group across
tiles; forced). Positions cut in several
chunks with short tails; tiles of exactly a position's vectors and of a
power of two; every dtype; parameters of x's and of float32
dtype; float32 y of 16-bit x; NaN confinement; bitwise reproducibility.
Every allocation is poisoned (NaN) first; inputs are checked unchanged.
"""
import numpy as np
import pytest

from channel_checks import check, run
from cunorm._engine import dtypes
from helpers import DTYPE_IDS, DTYPES, random

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _poison(poisoned):
    yield


# (NHWC shape, groups, what): the layout each dtype takes is in
# tests/engine/test_plan.py::test_channels_last_grouped_walk.
SHAPES = [
    ((3, 7, 5, 64), 4, "cpg16"),  # grouped, 16-bit: two vectors a group
    ((2, 9, 5, 40), 2, "cpg20"),  # grouped, 16-bit: vectors of 4
    ((2, 3, 5, 4096), 16, "cpg256 tiles"),  # grouped across 2-8 tiles
    ((2, 7, 5, 24), 8, "cpg3"),  # a statistic per channel (float64: grouped, vectors of 1)
    ((2, 5, 7, 72), 8, "cpg9"),  # paired (float64: grouped, vectors of 1)
    ((2, 3, 5, 960), 32, "cpg30"),  # paired, 2 rows of 120 vectors (16-bit), 240 (float32); float64 per channel
    ((1, 3, 5, 6144), 2, "cpg3072"),  # a group's vectors across tiles: a statistic per channel
    ((4, 1, 1, 32), 32, "cpg1"),  # InstanceNorm-like, one position
    ((2, 5, 7, 320), 32, "cpg10"),  # paired, 6 rows of 40 vectors (16-bit), padded to 256 threads; float32 grouped
    ((1, 3, 5, 1020), 4, "cpg255"),  # paired, a row of 255 vectors (16-bit, float32), padded to 256 threads
]
# (tiles of a power of two: with idle threads past the last vector)
CHUNKS = [{}, {"chunks": 3}, {"chunks": 7, "grouped": False, "paired": False}, {"chunks": 5, "grouped": False},
          {"chunks": 2, "exact_tile": False}]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape,groups,what", SHAPES, ids=[w for *_, w in SHAPES])
@pytest.mark.parametrize("override", CHUNKS,
                         ids=["default", "3 chunks", "7 chunks per channel", "5 chunks paired", "pow2 tiles"])
def test_group_norm(rng, dtype, shape, groups, what, override):
    x = random(rng, shape, dtype, scale=2.0, offset=0.5)
    c = shape[-1]
    check(x, "group", groups=groups, weight=random(rng, (c,), dtype), bias=random(rng, (c,), dtype), axis=-1,
          override=override, walk="split", rng=rng)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("params", ["none", "w", "b", "w b float32"])
def test_parameters(rng, dtype, params):
    x = random(rng, (2, 11, 3, 48), dtype, offset=-1.0)  # 33 positions: chunk tails
    pdtype = np.float32 if "float32" in params and dtype != np.float64 else dtype
    w = random(rng, (48,), pdtype) if "w" in params else None
    b = random(rng, (48,), pdtype) if "b" in params else None
    check(x, "group", groups=3, weight=w, bias=b, axis=-1, override={"chunks": 4}, walk="split", rng=rng)
    check(x, "instance", weight=w, bias=b, axis=-1, override={"chunks": 4}, walk="split", rng=rng)


@pytest.mark.parametrize("dtype", [dtypes.float16, dtypes.bfloat16], ids=["f16", "bf16"])
def test_float32_output_of_16_bit_x(rng, dtype):
    x = random(rng, (2, 6, 5, 64), dtype)
    check(x, "group", groups=8, weight=random(rng, (64,), np.float32), bias=random(rng, (64,), np.float32), axis=-1,
          out_dtype=np.dtype(np.float32), walk="split", rng=rng)


# channels-first (NCHW shape, groups, override): plane rows (one chunk, rows
# of 8-32 threads a plane, a block's rows across groups and past the last
# channel) and chunks of 256-thread blocks
CHANNELS_FIRST = [
    ((3, 12, 5, 7), 4, {}),  # 35 positions: vectors of one, rows of 16 threads
    ((2, 20, 16, 16), 5, {}),  # 4 channels a group: a block's 8-32 rows across groups and past the last
    ((2, 10, 64, 64), 2, {}),  # 5 channels a group, 8 rows a block, the last past the channels (float64: chunks)
    ((2, 6, 128, 96), 3, {"chunks": 5}),  # planes over 1024 vectors: 256-thread blocks, 5 chunks, the last short
    ((1, 4, 128, 129), 1, {"chunks": 5}),  # one group of every channel, odd positions
    # the apply's own tiles (the three launches): fewer vectors than threads, a thread's several and a short last
    ((2, 6, 128, 96), 3, {"chunks": 5, "apply_tile": 37}),
    ((1, 4, 128, 129), 1, {"chunks": 2, "apply_tile": 300}),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape,groups,override", CHANNELS_FIRST, ids=[str(s) for s, *_ in CHANNELS_FIRST])
@pytest.mark.parametrize("walk", ["split", "folded"])
def test_channels_first(rng, dtype, shape, groups, override, walk):
    """The three launches and the apply that finalizes each group itself
    (its rows combining the group's partials, the first of them writing the
    statistics) give y and the statistics of the reference."""
    x = random(rng, shape, dtype, scale=2.0, offset=0.5)
    c = shape[1]
    check(x, "group", groups=groups, weight=random(rng, (c,), dtype), bias=random(rng, (c,), dtype), axis=1,
          override=override, walk=walk, rng=rng)
    check(x, "instance", axis=1, override=override, walk=walk, rng=rng)
    if walk == "split":  # (BatchNorm never folds)
        check(x, "batch", weight=random(rng, (c,), dtype), bias=random(rng, (c,), dtype), axis=1,
              override=override, walk=walk, rng=rng)


def test_folded_is_bitwise_reproducible(rng):
    import cupy

    x = cupy.asarray(random(rng, (2, 20, 16, 16), np.float32))
    first = run(x, "group", groups=5, axis=1, walk="folded")
    again = run(x, "group", groups=5, axis=1, walk="folded")
    for a, b in zip(first, again):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("channels,groups", [(64, 4), (40, 8)], ids=["grouped", "paired"])
def test_mean_1e4_keeps_precision(rng, channels, groups):
    x = random(rng, (2, 64, 64, channels), np.float32, scale=1.0, offset=1e4)
    check(x, "group", groups=groups, axis=-1, override={"chunks": 5}, walk="split", rng=rng)


NAN_CASES = [(32, 4, {}), (32, 4, {"grouped": False, "paired": False}), (40, 8, {}), (40, 8, {"paired": False})]


@pytest.mark.parametrize("channels,groups,override", NAN_CASES,
                         ids=["grouped", "per channel", "paired", "paired per channel"])
def test_nan_stays_in_its_group(rng, channels, groups, override):
    import cupy

    x = random(rng, (3, 5, 8, channels), np.float32)
    cpg = channels // groups
    x[1, 2, 3, 13] = np.nan  # sample 1, channel 13 (groups of 5: channels 10 to 14, straddling two vectors)
    y, mean, rstd = run(cupy.asarray(x), "group", groups=groups, axis=-1, override={"chunks": 3, **override},
                        walk="split")
    g = 13 // cpg
    bad = np.zeros(y.shape, bool)
    bad[1, ..., g * cpg:(g + 1) * cpg] = True
    assert np.isnan(y[bad]).all() and np.isfinite(y[~bad]).all()
    assert np.isnan(mean[1, g]) and np.isfinite(np.delete(mean.ravel(), 1 * groups + g)).all()


@pytest.mark.parametrize("channels,override", [(64, {}), (64, {"chunks": 9}), (64, {"grouped": False}),
                                               (64, {"grouped": False, "paired": False}), (40, {})])
def test_bitwise_reproducible(rng, channels, override):
    import cupy

    x = cupy.asarray(random(rng, (4, 32, 32, channels), np.float32))
    first = run(x, "group", groups=8, axis=-1, override=override, walk="split")
    again = run(x, "group", groups=8, axis=-1, override=override, walk="split")
    for a, b in zip(first, again):
        assert a.tobytes() == b.tobytes()
