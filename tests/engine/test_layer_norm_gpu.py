"""layer_norm, the fused residual (both norms) and the returned statistics on
the GPU, against the float64 reference (skipped without a GPU).

Fresh random data every run; every allocation poisoned (NaN) first; inputs
checked unchanged afterwards.
"""
import functools

import numpy as np
import pytest

import cunorm
from cunorm._engine import calls, dispatch_rows, dtypes, row_norms
from cunorm import reference
from helpers import DTYPE_IDS, DTYPES, RTOL, assert_close, output_scale, random

pytestmark = pytest.mark.gpu

OPS = {"rms": (cunorm.rms_norm, reference.rms_norm), "ln": (cunorm.layer_norm, reference.layer_norm)}


@pytest.fixture(autouse=True)
def _poison(poisoned):
    yield


def check(norm, x_np, *, axis=-1, weight=None, bias=None, residual=None, return_stats=False, eps=1e-5, rtol=None):
    """Run the op on the GPU and compare every result with the reference."""
    import cupy

    fn, ref_fn = OPS[norm]
    kwargs = {"axis": axis, "eps": eps, "return_stats": return_stats}
    ref_kwargs = dict(kwargs)
    gpu = {"weight": weight, "residual": residual}
    if norm == "ln":
        gpu["bias"] = bias
    for name, value in gpu.items():
        kwargs[name] = None if value is None else cupy.asarray(value)
        ref_kwargs[name] = value
    x = cupy.asarray(x_np)
    before = [a.copy() for a in [x] + [v for v in kwargs.values() if isinstance(v, cupy.ndarray)]]
    got = fn(x, **kwargs)
    want = ref_fn(x_np, exact=True, **ref_kwargs)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    names = ["y"] + (["h"] if residual is not None else []) + (
        (["mean", "rstd"] if norm == "ln" else ["rstd"]) if return_stats else [])
    for name, g, w in zip(names, got, want):
        assert isinstance(g, cupy.ndarray), name
        if name == "h":  # h is x + r rounded once: exact
            assert g.dtype == x.dtype and g.shape == x.shape
            np.testing.assert_array_equal(cupy.asnumpy(g).astype(np.float64), w.astype(np.float64), err_msg="h")
        elif name == "y":
            assert g.dtype == x.dtype and g.shape == x.shape
            tol = RTOL[x.dtype] if rtol is None else rtol
            atol = tol * output_scale(w) if norm == "ln" else None
            assert_close(cupy.asnumpy(g), w, x.dtype, rtol=tol, atol=atol, what=f"{norm} y {x.shape} axis {axis}")
        else:
            assert g.dtype == dtypes.accumulation(x.dtype) and g.shape == w.shape, name
            tol = 1e-12 if g.dtype == np.float64 else 2e-5
            if name == "rstd":
                assert_close(cupy.asnumpy(g), w, g.dtype, rtol=tol, what=name)
            else:  # a mean near zero: its error is judged against the group's spread
                spread = np.abs(w) + 1.0 / np.where(np.isfinite(want[-1]), want[-1], 1.0)
                g_np = cupy.asnumpy(g).astype(np.float64)
                assert np.array_equal(np.isnan(g_np), np.isnan(w)), "mean: NaN pattern"
                ok = np.isnan(w) | (np.abs(g_np - w) <= tol * spread)
                assert ok.all(), f"mean off in {int((~ok).sum())} groups"
    after = [x] + [v for v in kwargs.values() if isinstance(v, cupy.ndarray)]
    for a, b in zip(after, before):
        assert cupy.array_equal(a, b, equal_nan=True), "an input was written to"
    return got


LENGTHS = [1, 2, 3, 760, 1024, 1025, 4097, 65535, 262144]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n", LENGTHS)
def test_layer_norm_rows(rng, dtype, n):
    rows = 3 if n > 4096 else 37
    x = random(rng, (rows, n), dtype, scale=2.0, offset=0.5)
    check("ln", x, weight=random(rng, n, dtype), bias=random(rng, n, dtype))
    check("ln", x)


@pytest.mark.parametrize("rows", [1, 7, 1000, 100000])
def test_layer_norm_row_counts(rng, rows):
    x = random(rng, (rows, 64), dtypes.bfloat16)
    check("ln", x, weight=random(rng, 64, np.float32), bias=random(rng, 64, np.float32))


@pytest.mark.parametrize("norm", ["rms", "ln"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(5, 1), (9, 760), (33, 4096), (3, 65535), (2, 300000)], ids=str)
def test_residual(rng, norm, dtype, shape):
    x = random(rng, shape, dtype)
    r = random(rng, shape, dtype)
    w = random(rng, shape[-1], dtype)
    b = random(rng, shape[-1], dtype) if norm == "ln" else None
    check(norm, x, weight=w, bias=b, residual=r, return_stats=True)


@pytest.mark.parametrize("norm", ["rms", "ln"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_residual_strided_axis(rng, norm, dtype):
    x = random(rng, (3, 40, 9, 5), dtype)
    check(norm, x, axis=1, residual=random(rng, x.shape, dtype), return_stats=True)


@pytest.mark.parametrize("dtype", [dtypes.bfloat16, dtypes.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("which", ["weight", "bias", "both"])
def test_float32_params_with_16bit_x(rng, dtype, which):
    x = random(rng, (20, 4096), dtype)
    w = random(rng, 4096, np.float32) if which in ("weight", "both") else None
    b = random(rng, 4096, np.float32) if which in ("bias", "both") else None
    check("ln", x, weight=w, bias=b)


def test_mixed_param_dtypes_are_cast(rng):
    x = random(rng, (20, 1024), dtypes.bfloat16)
    check("ln", x, weight=random(rng, 1024, np.float32), bias=random(rng, 1024, dtypes.bfloat16))
    check("ln", x, weight=random(rng, 1024, np.float64), bias=random(rng, 1024, np.float16))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape, axis", [((2, 64, 33, 17), 1), ((4, 6, 7, 9), (1, 2)), ((3, 4097, 8), 1),
                                         ((2, 5, 1), 1), ((4, 6, 7, 9), (1, 2, 3))], ids=str)
def test_layer_norm_axes(rng, dtype, shape, axis):
    x = random(rng, shape, dtype)
    first, last = (axis, axis) if isinstance(axis, int) else (axis[0], axis[-1])
    norm_shape = shape[first : last + 1]
    check("ln", x, axis=axis, weight=random(rng, norm_shape, dtype), bias=random(rng, norm_shape, dtype),
          return_stats=True)


@pytest.mark.parametrize("norm", ["rms", "ln"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("override", [{"tier": "cached", "threads": 32}, {"tier": "cached", "threads": 256},
                                      {"tier": "uncached"}, {"tier": "split"}, {"tier": "split", "chunks": 7},
                                      {"tier": "split", "tiles": True},
                                      {"tier": "split", "tiles": True, "apply_tile": 37},
                                      {"tier": "split", "tiles": True, "apply_tile": 300},
                                      {"tier": "resident"}],
                         ids=lambda o: "-".join(map(str, o.values())))
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_every_rows_tier(rng, norm, dtype, override, residual):
    """Each tier forced on the same input, with residual, stats and affine."""
    import cupy

    shape = (23, 1000)
    x_np, r_np = random(rng, shape, dtype), random(rng, shape, dtype)
    w_np, b_np = random(rng, 1000, dtype), random(rng, 1000, dtype)
    x, r, w, b = (cupy.asarray(a) for a in (x_np, r_np, w_np, b_np))
    y, h = cupy.empty_like(x), cupy.empty_like(x)
    center, scale = cupy.empty(23, dtypes.accumulation(dtype)), cupy.empty(23, dtypes.accumulation(dtype))
    run = functools.partial(row_norms.launch_on, norm, x, y, w=w, b=b if norm == "ln" else None, r=r if residual else None,
                            h=h if residual else None, center=center, scale=scale, first=1, last=1, eps=1e-5)
    plan, _ = run()
    if override["tier"] == "cached" and not dispatch_rows.rows_cache_fits(plan, override["threads"]):
        with pytest.raises(ValueError, match="over the register budget"):  # a forced tier that does not fit
            run(override=override)
        return
    for out in (y, h, center, scale):
        out.fill(np.nan)
    _, launch = run(override=override)
    assert launch.tier == override["tier"]
    ref_fn = OPS[norm][1]
    kw = {"bias": b_np} if norm == "ln" else {}
    want = ref_fn(x_np, w_np, residual=r_np if residual else None, return_stats=True, exact=True, **kw)
    assert_close(cupy.asnumpy(y), want[0], dtype, atol=RTOL[dtype] * output_scale(want[0]), what=str(override))
    if residual:
        np.testing.assert_array_equal(cupy.asnumpy(h), want[1])
    tol = 1e-12 if dtype == np.float64 else 2e-5
    assert_close(cupy.asnumpy(scale), want[-1], scale.dtype, rtol=tol)
    if norm == "ln":
        spread = np.abs(want[-2]) + 1.0 / want[-1]
        assert np.all(np.abs(cupy.asnumpy(center) - want[-2]) <= tol * spread), "mean"


def test_large_mean_small_spread_within_torch(rng):
    """Rows of mean 1e4 and std 1 in float32: the error against the float64
    truth stays at or below torch's own LayerNorm on the same input."""
    torch = pytest.importorskip("torch")
    import cupy

    x_np = random(rng, (256, 4096), np.float32, scale=1.0, offset=1e4)
    ref = reference.layer_norm(x_np, exact=True)
    ours = cupy.asnumpy(cunorm.layer_norm(cupy.asarray(x_np))).astype(np.float64)
    theirs = torch.nn.functional.layer_norm(torch.from_dlpack(cupy.asarray(x_np)), (4096,), eps=1e-5)
    theirs = theirs.cpu().numpy().astype(np.float64)
    err_ours = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    err_torch = np.linalg.norm(theirs - ref) / np.linalg.norm(ref)
    assert err_ours <= err_torch * 1.0001 + 1e-9, (err_ours, err_torch)
    assert err_ours < 1e-4


@pytest.mark.parametrize("dtype,offset", [(dtypes.bfloat16, 100.0), (dtypes.float16, 1000.0)], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape", [(256, 1000), (64, 8192), (4, 1 << 17)], ids=str)
def test_16bit_large_mean_small_spread(rng, dtype, offset, shape):
    """16-bit rows take no pivot (norms.cuh, LayerNorm): at about the
    largest mean over spread 16-bit data can hold (a std of two ulps of the
    mean), y is within its own rounding of the float64 truth, in every tier."""
    import cupy

    x_np = random(rng, shape, dtype, scale=1.0, offset=offset)
    w_np, b_np = random(rng, shape[-1], dtype), random(rng, shape[-1], dtype)
    ref = reference.layer_norm(x_np, w_np, b_np, exact=True)
    y = cunorm.layer_norm(*(cupy.asarray(a) for a in (x_np, w_np, b_np)))
    assert_close(cupy.asnumpy(y), ref, dtype, atol=RTOL[dtype] * output_scale(ref), what=f"ln y {shape}")


@pytest.mark.parametrize("dtype", [dtypes.bfloat16, dtypes.float16], ids=["bf16", "f16"])
def test_error_within_twice_torch(rng, dtype):
    torch = pytest.importorskip("torch")
    import cupy

    x_np = random(rng, (512, 4096), dtype)
    w_np, b_np = random(rng, 4096, dtype), random(rng, 4096, dtype)
    ref = reference.layer_norm(x_np, w_np, b_np, exact=True)
    x, w, b = (cupy.asarray(a) for a in (x_np, w_np, b_np))
    ours = cupy.asnumpy(cunorm.layer_norm(x, w, b)).astype(np.float64)
    theirs = torch.nn.functional.layer_norm(torch.from_dlpack(x), (4096,), torch.from_dlpack(w), torch.from_dlpack(b))
    theirs = theirs.float().cpu().numpy().astype(np.float64)
    err_ours = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    err_torch = np.linalg.norm(theirs - ref) / np.linalg.norm(ref)
    assert err_ours <= 2 * err_torch + 1e-7, (err_ours, err_torch)


@pytest.mark.parametrize("norm", ["rms", "ln"])
@pytest.mark.parametrize("shape", [(16, 1 << 20), (64, 4096), (3, 64, 4096)], ids=str)
def test_bitwise_reproducible(rng, norm, shape):
    import cupy

    x = cupy.asarray(random(rng, shape, np.float32))
    r = cupy.asarray(random(rng, shape, np.float32))
    axis = 1 if len(shape) == 3 else -1
    a = OPS[norm][0](x, axis=axis, residual=r, return_stats=True)
    b = OPS[norm][0](x, axis=axis, residual=r, return_stats=True)
    for u, v in zip(a, b):
        assert cupy.array_equal(u.view(np.uint8), v.view(np.uint8))


@pytest.mark.parametrize("norm", ["rms", "ln"])
def test_nonfinite_confined_to_group(rng, norm):
    x = random(rng, (6, 3000), np.float32)
    x[1, 17] = np.inf
    x[3, 0] = np.nan
    got = check(norm, x, residual=random(rng, x.shape, np.float32), return_stats=True)
    y = got[0].get()
    assert np.isnan(y[[1, 3]]).all() and np.isfinite(y[[0, 2, 4, 5]]).all()


def test_problem_40_full_shape(rng):
    """(16, 64, 256, 256) fp32 over axes 1-3 with weight and bias: 16 rows of
    4M elements. Rows are independent: the first and last are checked."""
    import cupy

    x = cupy.random.standard_normal((16, 64, 256, 256), dtype=np.float32) * 3 + 1
    w = cupy.random.standard_normal((64, 256, 256), dtype=np.float32)
    b = cupy.random.standard_normal((64, 256, 256), dtype=np.float32)
    y, mean, rstd = cunorm.layer_norm(x, w, b, axis=(1, 2, 3), return_stats=True)
    assert bool(cupy.isfinite(y).all())
    w_np, b_np = cupy.asnumpy(w), cupy.asnumpy(b)
    for row in (0, 15):
        x_np = cupy.asnumpy(x[row : row + 1])
        ref_y, ref_mean, ref_rstd = reference.layer_norm(x_np, w_np, b_np, axis=(1, 2, 3), return_stats=True,
                                                         exact=True)
        assert_close(cupy.asnumpy(y[row : row + 1]), ref_y, np.float32, atol=2e-5 * output_scale(ref_y), what=f"row {row}")
        assert np.all(np.abs(cupy.asnumpy(mean[row : row + 1]) - ref_mean) <= 1e-5 * (np.abs(ref_mean) + 1 / ref_rstd))
        assert_close(cupy.asnumpy(rstd[row : row + 1]), ref_rstd, np.float32, rtol=1e-5)


def test_torch_layer_norm_residual_returns_torch(rng):
    torch = pytest.importorskip("torch")
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda")
    b = torch.randn(1024, device="cuda")
    y, h, mean, rstd = cunorm.layer_norm(x, w, b, residual=r, return_stats=True)
    assert all(isinstance(t, torch.Tensor) for t in (y, h, mean, rstd))
    assert y.dtype == h.dtype == torch.bfloat16 and mean.dtype == rstd.dtype == torch.float32
    assert torch.equal(h, (x.float() + r.float()).to(torch.bfloat16))
    expected = torch.nn.functional.layer_norm(h.double(), (1024,), w.double(), b.double())
    torch.testing.assert_close(y.double(), expected, rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [dtypes.bfloat16, dtypes.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape", [(37, 768), (5, 3, 96), (300, 760), (7, 4097), (2, 1 << 20)],
                         ids=["768", "3-d", "760", "odd", "split tier"])
@pytest.mark.parametrize("params", ["none", "w", "w b", "w b 16-bit"])
def test_layer_norm_float32_output_of_16_bit_x(rng, dtype, shape, params):
    """The autocast form (calls.layer_norm_float32): 16-bit x read as it
    is, y written in float32 by rows_cached, or, where another tier takes
    the rows (the split tier, long rows), x cast first. y against the
    float64 reference of the same 16-bit values at float32's tolerance;
    poisoned outputs, x unchanged, a repeat (the launch cache's entry)
    bitwise equal."""
    import cupy

    x_np = random(rng, shape, dtype, scale=3.0, offset=1.0)
    n = shape[-1]
    pdtype = dtype if params.endswith("16-bit") else np.float32
    w_np = random(rng, (n,), pdtype, 0.5, 1.0) if "w" in params else None
    b_np = random(rng, (n,), pdtype) if " b" in params else None
    x = cupy.asarray(x_np)
    w = None if w_np is None else cupy.asarray(w_np)
    b = None if b_np is None else cupy.asarray(b_np)
    y = calls.layer_norm_float32(x, w, b, eps=1e-5)
    assert y.dtype == np.float32 and y.shape == shape and y.flags.c_contiguous
    want = reference.layer_norm(x_np.astype(np.float64), w_np, b_np, eps=1e-5, exact=True)
    tol = RTOL[np.dtype(np.float32)]
    assert_close(cupy.asnumpy(y), want, np.float32, rtol=tol, atol=tol * output_scale(want), what="float32 y")
    again = calls.layer_norm_float32(x, w, b, eps=1e-5)
    assert again.data.ptr != y.data.ptr and bool((again == y).all())
    np.testing.assert_array_equal(cupy.asnumpy(x), x_np)


def test_layer_norm_float32_output_refuses_other_dtypes():
    import cupy

    with pytest.raises(TypeError, match="float16 or bfloat16 x, got float32"):
        calls.layer_norm_float32(cupy.ones((2, 8), np.float32))
