"""group_norm, instance_norm and batch_norm on the GPU against the float64
reference (skipped without a GPU): both memory layouts, odd and empty
spatial extents, C not a multiple of 4, groups of one channel and of all,
every dtype, mixed parameter dtypes, running statistics against torch.

Fresh random data every run; every allocation poisoned (NaN) first; inputs
checked unchanged afterwards.
"""
import numpy as np
import pytest

import cunorm
from cunorm._engine import calls, dtypes
from cunorm import reference
from helpers import DTYPE_IDS, DTYPES, RTOL, assert_close, output_scale, random

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _poison(poisoned):
    yield


def to_layout(cupy, x_np, memory, channel_axis):
    """x_np (logical) as a CuPy array whose memory is C order ("c"), the other
    dense layout ("swapped": channels-last memory for a channels-first shape
    and vice versa), or dense in neither ("sliced": every other element of
    a buffer twice as long in the last axis, the elements between NaN, so a
    kernel reading them shows)."""
    if memory == "c":
        return cupy.asarray(x_np)
    if memory == "swapped":
        nd = x_np.ndim
        perm = (0, *range(2, nd), 1) if channel_axis % nd == 1 else (0, nd - 1, *range(1, nd - 1))
        return cupy.asarray(np.ascontiguousarray(np.transpose(x_np, perm))).transpose(np.argsort(perm))
    doubled = np.full((*x_np.shape[:-1], 2 * x_np.shape[-1]), np.nan, x_np.dtype)
    doubled[..., ::2] = x_np
    return cupy.asarray(doubled)[..., ::2]


def check(op, x_np, *, groups=None, weight=None, bias=None, channel_axis=1, memory="c", return_stats=True,
          running=None, training=True, momentum=0.1, eps=1e-5):
    import cupy

    fn = getattr(cunorm, f"{op}_norm")
    ref = getattr(reference, f"{op}_norm")
    x = to_layout(cupy, x_np, memory, channel_axis)
    kw = {"eps": eps, "channel_axis": channel_axis, "return_stats": return_stats}
    gkw, rkw = dict(kw), dict(kw)
    for name, value in (("weight", weight), ("bias", bias)):
        gkw[name] = None if value is None else cupy.asarray(value)
        rkw[name] = value
    if op == "batch":
        gkw.update(training=training, momentum=momentum)
        rkw.update(training=training, momentum=momentum)
        if running is not None:
            rm, rv = running
            gkw.update(running_mean=cupy.asarray(rm), running_var=cupy.asarray(rv))
            rkw.update(running_mean=rm.astype(np.float64), running_var=rv.astype(np.float64))
    args = (x, groups) if op == "group" else (x,)
    inputs = [x] + [gkw[k] for k in ("weight", "bias") if gkw.get(k) is not None]
    before = [a.copy() for a in inputs]
    got = fn(*args, **gkw)
    want = ref(x_np, *((groups,) if op == "group" else ()), exact=True, **rkw)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    y, wy = got[0], want[0]
    assert isinstance(y, cupy.ndarray) and y.dtype == x_np.dtype and y.shape == x_np.shape
    tol = RTOL[x_np.dtype]
    assert_close(cupy.asnumpy(y), wy, x_np.dtype, rtol=tol, atol=tol * output_scale(wy),
                 what=f"{op} y {x_np.shape} axis {channel_axis} {memory}")
    if memory != "sliced":  # y keeps x's memory layout
        big = [d for d in range(x.ndim) if x.shape[d] > 1]
        assert [y.strides[d] for d in big] == [x.strides[d] for d in big], (y.strides, x.strides)
    acc = dtypes.accumulation(x_np.dtype)
    if return_stats:
        st = 1e-12 if acc == np.float64 else 2e-5
        mean, rstd = (cupy.asnumpy(s) for s in got[1:])
        assert mean.dtype == acc and rstd.dtype == acc and mean.shape == want[1].shape
        assert_close(rstd, want[2], acc, rtol=st, what="rstd")
        spread = np.abs(want[1]) + 1.0 / np.where(np.isfinite(want[2]), want[2], 1.0)
        ok = np.isnan(want[1]) | (np.abs(mean - want[1]) <= st * spread)
        assert np.array_equal(np.isnan(mean), np.isnan(want[1])) and ok.all(), "mean"
    if op == "batch" and running is not None:
        for name, g, w in (("running_mean", gkw["running_mean"], rkw["running_mean"]),
                           ("running_var", gkw["running_var"], rkw["running_var"])):
            # updated in the accumulation dtype, stored in the buffer's
            rt = max(1e-12 if acc == np.float64 else 2e-5, RTOL[np.dtype(g.dtype)] if g.itemsize == 2 else 0)
            assert_close(cupy.asnumpy(g), w, g.dtype, rtol=rt, atol=rt, what=name)
    for a, b in zip(inputs, before):
        assert cupy.array_equal(a, b, equal_nan=True), "an input was written to"
    return got


# (shape NCHW, groups): problem shapes scaled down, odd spatial sizes, no
# spatial axes, C not a multiple of 4, one channel a group and all channels.
SHAPES = [
    ((3, 16, 32, 32), 4),
    ((2, 6, 7, 7), 3),
    ((4, 12, 1, 1), 6),
    ((5, 12), 4),
    ((2, 3, 5, 9), 3),
    ((2, 8, 13), 1),
    ((1, 64, 64, 64), 8),
    ((2, 4, 3, 1, 5), 2),
    ((3, 40, 6, 6), 5),
]


def nhwc(shape):
    return (shape[0], *shape[2:], shape[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape,groups", SHAPES)
@pytest.mark.parametrize("channel_axis", [1, -1])
def test_group_norm(rng, dtype, shape, groups, channel_axis):
    c = shape[1]
    logical = shape if channel_axis == 1 else nhwc(shape)
    x = random(rng, logical, dtype, scale=2.0, offset=0.5)
    w, b = random(rng, (c,), dtype), random(rng, (c,), dtype)
    check("group", x, groups=groups, channel_axis=channel_axis)
    check("group", x, groups=groups, weight=w, bias=b, channel_axis=channel_axis, memory="swapped")
    check("group", x, groups=groups, weight=w, channel_axis=channel_axis, memory="sliced")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(3, 16, 32, 32), (2, 6, 7, 7), (2, 3, 5, 9), (1, 5, 65535)])
@pytest.mark.parametrize("channel_axis", [1, -1])
def test_instance_norm(rng, dtype, shape, channel_axis):
    logical = shape if channel_axis == 1 else nhwc(shape)
    x = random(rng, logical, dtype, scale=1.5, offset=-0.3)
    check("instance", x, channel_axis=channel_axis)
    check("instance", x, weight=random(rng, (shape[1],), dtype), bias=random(rng, (shape[1],), dtype),
          channel_axis=channel_axis, memory="swapped")
    check("instance", x, channel_axis=channel_axis, memory="sliced")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
# (3, 37, 7, 7), (2, 300, 14, 14): plane rows (see test_backward_gpu's CHANNEL_CASES)
@pytest.mark.parametrize("shape", [(4, 16, 32, 32), (2, 6, 7, 7), (3, 5, 1, 1), (7, 12), (1, 3, 4097), (3, 37, 7, 7),
                                   (2, 300, 14, 14)])
@pytest.mark.parametrize("channel_axis", [1, -1])
def test_batch_norm(rng, dtype, shape, channel_axis):
    c = shape[1]
    logical = shape if channel_axis == 1 else nhwc(shape)
    x = random(rng, logical, dtype, scale=2.0, offset=1.0)
    acc = dtypes.accumulation(dtype)
    running = (rng.standard_normal(c).astype(acc), (rng.random(c) + 0.5).astype(acc))
    check("batch", x, channel_axis=channel_axis, running=running, momentum=0.3)
    w, b = random(rng, (c,), dtype), random(rng, (c,), dtype)
    check("batch", x, weight=w, bias=b, channel_axis=channel_axis, memory="swapped", running=running)
    check("batch", x, weight=w, channel_axis=channel_axis, memory="sliced", running=running)
    check("batch", x, weight=w, bias=b, channel_axis=channel_axis, running=running, training=False)
    # eval without statistics returned: one launch reading the running buffers
    check("batch", x, weight=w, bias=b, channel_axis=channel_axis, running=running, training=False,
          return_stats=False, memory="swapped")
    check("batch", x, weight=w, channel_axis=channel_axis, running=running, training=False, return_stats=False)


@pytest.mark.parametrize("dtype", [dtypes.bfloat16, dtypes.float16])
def test_float32_params_with_16_bit_x(rng, dtype):
    x = random(rng, (2, 8, 9, 11), dtype)
    w, b = random(rng, (8,), np.float32), random(rng, (8,), np.float32)
    check("group", x, groups=2, weight=w, bias=b)
    xl = random(rng, (2, 9, 11, 8), dtype)
    check("group", xl, groups=2, weight=w, bias=random(rng, (8,), np.float64), channel_axis=-1)
    running = (np.zeros(8, np.float32), np.ones(8, np.float32))
    check("batch", xl, weight=w, channel_axis=-1, running=running)


@pytest.mark.parametrize("running_dtype", [dtypes.bfloat16, np.float64])
def test_running_buffers_of_other_dtypes(rng, running_dtype):
    x = random(rng, (4, 6, 5, 5), np.float32)
    running = (np.zeros(6, running_dtype), np.ones(6, running_dtype))
    check("batch", x, running=running)


@pytest.mark.parametrize("running_dtype", [dtypes.bfloat16, np.float64])
@pytest.mark.parametrize("with_stats", [False, True], ids=["one-launch", "with-stats"])
def test_eval_with_converted_running_buffers_is_not_replayed(rng, running_dtype, with_stats):
    """Eval-mode BatchNorm over running buffers of another dtype than the
    statistics' runs over float32 copies: a second call with other buffers
    of the same signature must read those (a launch-cache entry would read
    the new buffers as float32)."""
    cupy = pytest.importorskip("cupy")
    x = cupy.asarray(random(rng, (4, 6, 5, 5), np.float32))
    for _ in range(2):
        rm, rv = random(rng, (6,), running_dtype), (rng.random(6) + 0.5).astype(running_dtype)
        results = cunorm.batch_norm(x, running_mean=cupy.asarray(rm), running_var=cupy.asarray(rv), training=False,
                                    return_stats=with_stats)
        y = results[0] if with_stats else results
        ref = reference.batch_norm(cupy.asnumpy(x), running_mean=rm, running_var=rv, training=False, exact=True)
        assert_close(cupy.asnumpy(y), ref, np.float32)


def test_large_groups_are_chunked(rng):
    """Groups big enough to be split over many blocks in both layouts."""
    x = random(rng, (2, 4, 256, 257), np.float32, scale=1.0, offset=3.0)
    check("group", x, groups=2, weight=random(rng, (4,), np.float32))
    check("instance", np.ascontiguousarray(np.moveaxis(x, 1, -1)), channel_axis=-1)
    check("batch", x, running=(np.zeros(4, np.float32), np.ones(4, np.float32)))


def test_stable_statistics_mean_1e4(rng):
    """Groups of mean 1e4 and std 1 in float32 keep float32's precision."""
    x = random(rng, (2, 8, 64, 64), np.float32, scale=1.0, offset=1e4)
    check("group", x, groups=4)
    check("batch", np.ascontiguousarray(np.moveaxis(x, 1, -1)), channel_axis=-1)


def test_nonfinite_group_is_nan_and_only_it(rng):
    import cupy

    x = random(rng, (2, 8, 5, 5), np.float32)
    x[1, 5, 2, 2] = np.nan  # sample 1, group 2 (channels 4 and 5)
    y = cupy.asnumpy(cunorm.group_norm(cupy.asarray(x), 4))
    bad = np.zeros(y.shape, bool)
    bad[1, 4:6] = True
    assert np.isnan(y[bad]).all() and np.isfinite(y[~bad]).all()
    xb = random(rng, (2, 8, 5, 5), np.float32)
    xb[0, 3, 0, 0] = np.inf  # channel 3 across the batch
    yb = cupy.asnumpy(cunorm.batch_norm(cupy.asarray(xb), weight=cupy.ones(8, np.float32)))
    assert np.isnan(yb[:, 3]).all() and np.isfinite(np.delete(yb, 3, axis=1)).all()


def test_bitwise_reproducible(rng):
    import cupy

    x = cupy.asarray(random(rng, (2, 16, 128, 128), np.float32))
    for fn in (lambda: cunorm.group_norm(x, 4), lambda: cunorm.batch_norm(x),
               lambda: cunorm.instance_norm(x.transpose(0, 2, 3, 1), channel_axis=-1)):
        assert fn().tobytes() == fn().tobytes()


def test_against_torch_with_running_stats(rng):
    torch = pytest.importorskip("torch")
    x = torch.randn(4, 6, 9, 7, device="cuda") * 2 + 1
    w, b = torch.randn(6, device="cuda"), torch.randn(6, device="cuda")
    rm, rv = torch.randn(6, device="cuda"), torch.rand(6, device="cuda") + 0.5
    rm_t, rv_t = rm.clone(), rv.clone()
    y = cunorm.batch_norm(x, w, b, running_mean=rm, running_var=rv, momentum=0.2)
    y_t = torch.nn.functional.batch_norm(x, rm_t, rv_t, w, b, training=True, momentum=0.2)
    assert isinstance(y, torch.Tensor)
    torch.testing.assert_close(y, y_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rm, rm_t, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rv, rv_t, rtol=1e-6, atol=1e-6)
    # eval mode leaves the buffers alone
    before = rm.clone(), rv.clone()
    y = cunorm.batch_norm(x, w, b, running_mean=rm, running_var=rv, training=False)
    torch.testing.assert_close(y, torch.nn.functional.batch_norm(x, rm, rv, w, b, training=False))
    assert torch.equal(rm, before[0]) and torch.equal(rv, before[1])
    # channels_last torch tensors: same values, channels_last result
    xc = x.to(memory_format=torch.channels_last)
    g = cunorm.group_norm(xc, 3, w, b)
    torch.testing.assert_close(g, torch.nn.functional.group_norm(x, 3, w, b), rtol=1e-5, atol=1e-5)
    assert g.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(cunorm.instance_norm(xc), torch.nn.functional.instance_norm(x), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("dtype", [dtypes.bfloat16, dtypes.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("shape,groups", [((4, 64, 9, 7), 8), ((2, 320, 16, 16), 32), ((3, 24, 5), 24)],
                         ids=["odd planes", "unet", "1-d"])
@pytest.mark.parametrize("params", ["none", "w b", "w b 16-bit"])
def test_group_norm_float32_output_of_16_bit_x(rng, poisoned, dtype, last, shape, groups, params):
    """The autocast form (calls.group_norm_float32): 16-bit x read as it
    is, float32 y in x's layout (without parameters on channels-first x,
    the row family's LayerNorm writes it), against the float64 reference
    of the same 16-bit values at float32's tolerance; x unchanged, a repeat
    (the launch cache's entry) bitwise equal."""
    import cupy

    x_np = random(rng, shape, dtype, scale=2.0, offset=0.5)
    c = shape[1]
    pdtype = dtype if params.endswith("16-bit") else np.float32
    w_np = random(rng, (c,), pdtype, 0.5, 1.0) if params != "none" else None
    b_np = random(rng, (c,), pdtype) if params != "none" else None
    x = cupy.asarray(x_np)
    if last and len(shape) == 4:
        x = cupy.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    w = None if w_np is None else cupy.asarray(w_np)
    b = None if b_np is None else cupy.asarray(b_np)
    y = calls.group_norm_float32(x, groups, w, b, eps=1e-5)
    assert y.dtype == np.float32 and y.shape == shape and y.strides == tuple(s * 2 for s in x.strides)
    want = reference.group_norm(x_np.astype(np.float64), groups, w_np, b_np, eps=1e-5)
    tol = RTOL[np.dtype(np.float32)]
    assert_close(cupy.asnumpy(y), want, np.float32, rtol=tol, atol=tol * output_scale(want), what="float32 y")
    again = calls.group_norm_float32(x, groups, w, b, eps=1e-5)
    assert bool((again == y).all())
    np.testing.assert_array_equal(cupy.asnumpy(x), x_np)
