"""A channel walk forced (tests/engine/test_channel_onchip_gpu.py,
tests/engine/test_channel_split_gpu.py, tests/engine/test_channel_stream_gpu.py) and checked against the float64 reference:
y, the returned statistics and BatchNorm's running estimates."""
import numpy as np

from cunorm._engine import channel_norms, dtypes
from cunorm import reference
from helpers import RTOL, assert_close, output_scale, random


def run(x, op, *, groups=None, weight=None, bias=None, running=(None, None), axis=1, override=None, out_dtype=None,
        walk="onchip"):
    """(y, mean, rstd) of the walk ``walk`` with ``override``, as NumPy:
    "split" is the three launches, "folded" the apply finalizing each group
    itself (channels-first, per-sample groups)."""
    import cupy

    kw = {"num_groups": groups} if op == "group" else {}
    if op == "batch":
        kw.update(running_mean=running[0], running_var=running[1])
    call = channel_norms.ChannelCall(op, x, weight=weight, bias=bias, eps=1e-5, channel_axis=axis, return_stats=True,
                                     out_dtype=out_dtype, **kw)
    prepared = channel_norms.prepare(call)
    forced = {"walk": "split", "fold": walk == "folded"} if walk in ("split", "folded") else {"walk": walk}
    took, _ = channel_norms.execute(call, *prepared, override={**forced, **(override or {})})
    assert took == f"channel_{walk}", took
    y, stats = prepared[1], prepared[3]
    return [cupy.asnumpy(a) for a in (y, *stats)]


def check(x_np, op, *, groups=None, weight=None, bias=None, axis=1, override=None, out_dtype=None, rng=None,
          walk="onchip"):
    """The walk's y, statistics and running estimates against the float64
    reference; the inputs unchanged."""
    import cupy

    rng = rng or np.random.default_rng()

    x = cupy.asarray(x_np)
    w = None if weight is None else cupy.asarray(weight)
    b = None if bias is None else cupy.asarray(bias)
    acc = dtypes.accumulation(x_np.dtype)
    c = x_np.shape[axis]
    running = ((cupy.asarray(random(rng, (c,), acc)), cupy.asarray(np.abs(random(rng, (c,), acc)) + 0.5))
               if op == "batch" else (None, None))
    running_before = [None if r is None else cupy.asnumpy(r) for r in running]
    before = [a.copy() for a in (x, w, b) if a is not None]
    y, mean, rstd = run(x, op, groups=groups, weight=w, bias=b, running=running, axis=axis, override=override,
                        out_dtype=out_dtype, walk=walk)
    fn = getattr(reference, f"{op}_norm")
    args = (x_np, groups) if op == "group" else (x_np,)
    kw = {"running_mean": running_before[0].copy(), "running_var": running_before[1].copy()} if op == "batch" else {}
    wy, wmean, wrstd = fn(*args, weight, bias, exact=True, return_stats=True, channel_axis=axis, **kw)
    assert y.dtype == (out_dtype or x_np.dtype)
    tol = RTOL[x_np.dtype]
    assert_close(y, wy, x_np.dtype, rtol=tol, atol=tol * output_scale(wy), what=f"{op} {x_np.shape} {override}")
    st = 1e-12 if acc == np.float64 else 2e-5
    assert_close(rstd, wrstd, acc, rtol=st, what="rstd")
    spread = np.abs(wmean) + 1.0 / wrstd
    assert (np.abs(mean - wmean) <= st * spread).all(), "mean"
    if op == "batch":
        for got, want in zip(running, (kw["running_mean"], kw["running_var"])):
            assert_close(cupy.asnumpy(got), want, acc, rtol=st, atol=st * float(np.max(np.abs(want))),
                         what="running")
    for a, a0 in zip([a for a in (x, w, b) if a is not None], before):
        assert cupy.array_equal(a, a0, equal_nan=True), "an input was written to"


def vec_of(dtype):
    """Elements of a 16-byte vector of ``dtype``."""
    return 16 // np.dtype(dtype).itemsize
