"""rms_norm on the GPU against the float64 reference (skipped without a GPU).

Fresh random data every run; every output buffer poisoned with NaN first; the
input checked unchanged afterwards.
"""
import numpy as np
import pytest

import cunorm
from cunorm._engine import dispatch_rows, dtypes, row_norms
from cunorm import reference
from helpers import DTYPE_IDS, DTYPES, RTOL, assert_close, random

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _poison(poisoned):
    yield


def run_and_check(x_np, w_np=None, axis=-1, eps=1e-5, *, x_view=None, weight_dtype=None):
    import cupy

    x = cupy.asarray(x_np) if x_view is None else x_view
    w = None if w_np is None else cupy.asarray(w_np)
    before = x.copy()
    y = cunorm.rms_norm(x, w, axis=axis, eps=eps)
    assert isinstance(y, cupy.ndarray) and y.dtype == x.dtype and y.shape == x.shape
    ref = reference.rms_norm(cupy.asnumpy(x), w_np, axis=axis, eps=eps, exact=True)
    assert_close(cupy.asnumpy(y), ref, x.dtype, what=f"shape {x.shape} axis {axis}")
    assert cupy.array_equal(x, before, equal_nan=True), "the input was written to"
    return y


ROW_SHAPES = [(1, 1), (3, 1), (5, 3), (7, 760), (3, 1024), (2, 1025), (9, 4097), (2, 4096), (1, 4096), (3, 65535),
              (100000, 8), (1000, 33), (64, 8192), (4, 32768), (2, 131072), (200, 70000)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rows(rng, dtype, shape):
    x = random(rng, shape, dtype)
    w = random(rng, shape[-1:], dtype)
    run_and_check(x, w)
    run_and_check(x)


STRIDED = [((2, 64, 33, 17), 1), ((3, 760, 5), 1), ((4, 64, 64, 64), 1), ((2, 3, 4097), 1), ((4, 6, 7, 9), (1, 2)),
           ((2, 5, 1), 1), ((1, 1, 7), 1), ((3, 4096, 8), 1), ((5, 7, 1000), 0), ((2, 300, 128), 1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape, axis", STRIDED, ids=lambda v: str(v))
def test_strided_axis(rng, dtype, shape, axis):
    x = random(rng, shape, dtype)
    first, last = (axis, axis) if isinstance(axis, int) else axis
    w = random(rng, shape[first : last + 1], dtype)
    run_and_check(x, w, axis=axis)


@pytest.mark.parametrize("dtype", [dtypes.bfloat16, dtypes.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape, axis", [((6, 4096), -1), ((3, 64, 40), 1)])
def test_float32_weight_with_16bit_x(rng, dtype, shape, axis):
    x = random(rng, shape, dtype)
    w = random(rng, (shape[axis],), np.float32)
    run_and_check(x, w, axis=axis)


def test_float64_weight_with_bf16_x_is_cast(rng):
    x = random(rng, (6, 256), dtypes.bfloat16)
    run_and_check(x, random(rng, 256, np.float64))


def test_problem_36_shape_scaled(rng):
    x = random(rng, (8, 64, 128, 128), np.float32)
    run_and_check(x, axis=1)


def test_problem_36_full_shape():
    """(112, 64, 512, 512) fp32, axis 1: 7.5 GB in, 7.5 GB out. Every sample
    is independent, so the first and last are checked against the float64
    reference; every element must have been written (poisoned output)."""
    import cupy

    x = cupy.random.standard_normal((112, 64, 512, 512), dtype=np.float32)
    y = cunorm.rms_norm(x, axis=1)
    assert bool(cupy.isfinite(y).all()), "unwritten (poisoned) or non-finite elements"
    for sample in (0, 111):
        x_np = cupy.asnumpy(x[sample : sample + 1])
        ref = reference.rms_norm(x_np, axis=1, exact=True)
        assert_close(cupy.asnumpy(y[sample : sample + 1]), ref, np.float32, what=f"sample {sample}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_non_contiguous_views(rng, dtype):
    import cupy

    base = random(rng, (64, 2 * 4096), dtype)
    xb = cupy.asarray(base)
    run_and_check(None, x_view=xb[::2, :4096])  # row stride > row length
    run_and_check(None, x_view=xb[:, 1:4097])  # misaligned start: scalar path
    run_and_check(None, x_view=xb[:, ::2])  # element stride 2 along the row: copied first
    run_and_check(None, x_view=xb.T[:300], axis=0)  # transposed
    nhwc = cupy.asarray(random(rng, (2, 9, 11, 24), dtype))
    run_and_check(None, x_view=nhwc.transpose(0, 3, 1, 2), axis=1)  # channels-last, axis 1
    run_and_check(None, x_view=nhwc[:, ::-1], axis=-1)  # negative stride on an outer axis


TIERS = ["cached-group", "cached-block", "uncached", "split", "split-tiles", "split-many-chunks", "split-odd-tiles",
         "resident"]


def tier_override(name, plan):
    """An override that forces the named tier and is valid for the plan."""
    n_vec = plan.reduced // plan.vec
    if name == "cached-group":
        if n_vec > 32 * dispatch_rows.VECS_PER_THREAD_CHOICES[-1]:
            pytest.skip("row too long for a group of 32 lanes")
        return {"tier": "cached", "threads": 32}
    if name == "cached-block":
        per = dispatch_rows.VECS_PER_THREAD_CHOICES[-1]
        return {"tier": "cached", "threads": max(64, dispatch_rows.next_pow2(-(-n_vec // per)))}
    if name == "split-many-chunks":
        return {"tier": "split", "chunks": 37}
    if name == "split-tiles":  # the finalize, then the apply in tiles (x of 256 MB or more unless forced)
        return {"tier": "split", "tiles": True}
    if name == "split-odd-tiles":  # the apply's tiles: fewer vectors than threads, and a thread's several
        return {"tier": "split", "tiles": True, "apply_tile": 37 if n_vec % 2 else 300}
    return {"tier": name}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", TIERS)
@pytest.mark.parametrize("shape", [(37, 1000), (50, 200), (5, 4097), (3, 8192)], ids=lambda s: "x".join(map(str, s)))
def test_every_rows_tier(rng, dtype, name, shape):
    import cupy

    x = cupy.asarray(random(rng, shape, dtype))
    w_np = random(rng, shape[-1:], dtype)
    w = cupy.asarray(w_np)
    y = cupy.empty_like(x)
    plan, _ = row_norms.launch_on("rms", x, y, w=w, first=1, last=1, eps=1e-5)
    override = tier_override(name, plan)
    y.fill(np.nan)
    if override["tier"] == "cached" and not dispatch_rows.rows_cache_fits(plan, override["threads"]):
        with pytest.raises(ValueError, match="over the register budget"):  # a forced tier that does not fit
            row_norms.launch_on("rms", x, y, w=w, first=1, last=1, eps=1e-5, override=override)
        return
    plan, launch = row_norms.launch_on("rms", x, y, w=w, first=1, last=1, eps=1e-5, override=override)
    assert launch.tier == override["tier"]
    ref = reference.rms_norm(cupy.asnumpy(x), w_np, exact=True)
    assert_close(cupy.asnumpy(y), ref, dtype, what=name)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("override", [{"tier": "uncached"}, {"bx": 4, "by": 64}, {"bx": 32, "by": 2}], ids=str)
def test_every_strided_variant(rng, dtype, override):
    import cupy

    x = cupy.asarray(random(rng, (3, 300, 40), dtype))
    y = cupy.empty_like(x)
    row_norms.launch_on("rms", x, y, first=1, last=1, eps=1e-5, override=override)
    assert_close(cupy.asnumpy(y), reference.rms_norm(cupy.asnumpy(x), axis=1, exact=True), dtype, what=str(override))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape, axis", [((6, 1000), -1), ((6, 70000), -1), ((3, 16, 50), 1)], ids=str)
def test_nonfinite_confined_to_group(rng, dtype, shape, axis):
    import cupy

    x_np = random(rng, shape, dtype)
    if axis == -1:
        x_np[1, 17] = np.inf
        x_np[3, 0] = np.nan
        x_np[4, -1] = -np.inf
    else:
        x_np[0, 3, 7] = np.inf
        x_np[2, 15, 49] = np.nan
    y = cunorm.rms_norm(cupy.asarray(x_np), axis=axis)
    ref = reference.rms_norm(x_np, axis=axis, exact=True)
    assert np.isnan(ref).any()
    assert_close(cupy.asnumpy(y), ref, dtype)


def test_out_argument_and_in_place(rng):
    import cupy

    x_np = random(rng, (33, 4096), np.float32)
    x = cupy.asarray(x_np)
    out = cupy.full_like(x, np.nan)
    assert cunorm.rms_norm(x, out=out) is out
    ref = reference.rms_norm(x_np, exact=True)
    assert_close(cupy.asnumpy(out), ref, np.float32)
    assert cunorm.rms_norm(x, out=x) is x
    assert_close(cupy.asnumpy(x), ref, np.float32)


@pytest.mark.parametrize("shape, axis", [((4, 1 << 20), -1), ((8, 4096), -1), ((4, 64, 4096), 1)], ids=str)
def test_bitwise_reproducible(rng, shape, axis):
    import cupy

    x = cupy.asarray(random(rng, shape, np.float32))
    a = cunorm.rms_norm(x, axis=axis)
    b = cunorm.rms_norm(x, axis=axis)
    assert cupy.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_error_within_twice_torch(rng):
    """flash-attention's criterion: against the float64 truth, our error is at
    most twice torch's own RMSNorm on the same bf16 input."""
    torch = pytest.importorskip("torch")
    import cupy

    x_np = random(rng, (512, 4096), dtypes.bfloat16)
    w_np = random(rng, 4096, dtypes.bfloat16)
    ref = reference.rms_norm(x_np, w_np, eps=1e-5, exact=True)
    ours = cupy.asnumpy(cunorm.rms_norm(cupy.asarray(x_np), cupy.asarray(w_np))).astype(np.float64)
    xt = torch.from_dlpack(cupy.asarray(x_np))
    wt = torch.from_dlpack(cupy.asarray(w_np))
    theirs = torch.nn.functional.rms_norm(xt, (4096,), wt, eps=1e-5).float().cpu().numpy().astype(np.float64)
    err_ours = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    err_torch = np.linalg.norm(theirs - ref) / np.linalg.norm(ref)
    assert err_ours <= 2 * err_torch + 1e-7, (err_ours, err_torch)
