"""quantize= on rms_norm and layer_norm: validation on every path, the
NumPy reference's semantics, the plan and the kernel the dispatch picks
(CPU only)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cunorm
from cunorm._engine import declarations, dispatch_rows, dtypes, plans, quantize
from cunorm._engine.dispatch_rows import Device

H100 = Device(sm_count=132)
ONE = np.array([0.05], np.float32)


def _x(rng, shape=(3, 64), dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("op", [cunorm.rms_norm, cunorm.layer_norm])
def test_bad_requests_raise_before_anything_runs(op):
    rng = np.random.default_rng()
    x = _x(rng)
    with pytest.raises(ValueError, match="quantize must be"):
        op(x, quantize="float8")
    with pytest.raises(TypeError, match="quantize must be"):
        op(x, quantize=8)
    with pytest.raises(TypeError, match="float64"):
        op(x.astype(np.float64), quantize="int8")
    with pytest.raises(ValueError, match="pass quantize= too"):
        op(x, quant_scale=ONE)
    with pytest.raises(ValueError, match="exclude"):
        op(x, quantize="int8", quant_scale=ONE, quant_scale_ub=ONE)
    with pytest.raises(TypeError, match="float32 array"):
        op(x, quantize="int8", quant_scale=ONE.astype(np.float64))
    with pytest.raises(ValueError, match="one element"):
        op(x, quantize="int8", quant_scale=np.ones(2, np.float32))
    with pytest.raises(ValueError, match="trailing axes"):
        op(x, quantize="int8", axis=0)
    with pytest.raises(ValueError, match="out="):
        op(x, quantize="int8", out=np.empty_like(x))
    with pytest.raises(ValueError, match="64 or 128"):
        op(x, quantize="int8", quant_group=32)
    with pytest.raises(TypeError, match="an int"):
        op(x, quantize="int8", quant_group=64.0)
    with pytest.raises(ValueError, match="exclude"):
        op(x, quantize="int8", quant_group=64, quant_scale=ONE)
    with pytest.raises(ValueError, match="multiple of it"):
        op(_x(rng, (3, 96)), quantize="int8", quant_group=64)
    with pytest.raises(ValueError, match="pass quant_group= too"):
        op(x, quantize="int8", quant_scale_layout="column_major_tma")
    with pytest.raises(ValueError, match="quant_scale_layout must be"):
        op(x, quantize="int8", quant_group=64, quant_scale_layout="tma")
    with pytest.raises(TypeError, match="quant_scale_layout must be"):
        op(x, quantize="int8", quant_group=64, quant_scale_layout=1)
    for given in ({"quant_group": 64}, {"quant_scale_layout": "row_major"}):
        with pytest.raises(ValueError, match="pass quantize= too"):
            op(x, **given)


@pytest.mark.parametrize("fmt", list(quantize.FORMATS))
def test_reference_saturates_rounds_to_even_and_keeps_nan(fmt):
    spec = quantize.Quantize(quantize.FORMATS[fmt], quantize.STATIC)
    qmax = spec.format.qmax
    y = np.array([[0.0, 1e30, -1e30, np.nan, qmax, -qmax, 2.5, 3.5]])
    q, scales = quantize.reference(y, spec, scale=np.ones(1, np.float32))
    assert scales is None and q.dtype == spec.format.numpy
    got = q.astype(np.float64)
    assert got[0, 1] == qmax and got[0, 2] == -qmax and got[0, 4] == qmax and got[0, 5] == -qmax
    if fmt == "int8":
        assert got[0, 3] == 0 and got[0, 6] == 2 and got[0, 7] == 4  # (round half to even)
    else:
        assert np.isnan(got[0, 3])


@pytest.mark.parametrize("fmt", list(quantize.FORMATS))
def test_dynamic_scales_are_max_over_qmax_with_a_floor_and_a_bound(fmt):
    rng = np.random.default_rng()
    spec = quantize.FORMATS[fmt]
    y = rng.standard_normal((4, 100)) * 3
    y[2] = 0.0
    q, scales = quantize.reference(y, quantize.Quantize(spec, quantize.ROW))
    assert scales.shape == (4, 1) and scales.dtype == np.float32
    want = np.maximum(np.abs(y).max(axis=1, keepdims=True) / spec.qmax, spec.min_scale)
    np.testing.assert_allclose(scales, want, rtol=1e-6)
    assert scales[2, 0] == np.float32(spec.min_scale) and not q.astype(np.float64)[2].any()
    assert np.abs(q.astype(np.float64)).max() == spec.qmax  # each row reaches the format's largest
    bound = np.array([1.0], np.float32)
    _, capped = quantize.reference(y, quantize.Quantize(spec, quantize.ROW_BOUNDED), bound=bound)
    np.testing.assert_allclose(capped, np.maximum(np.minimum(want * spec.qmax, 1.0) / spec.qmax, spec.min_scale),
                               rtol=1e-6)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("op,params", [(cunorm.rms_norm, ("weight",)), (cunorm.layer_norm, ("weight", "bias"))])
def test_numpy_results_in_order(op, params, residual):
    rng = np.random.default_rng()
    x = _x(rng, (2, 3, 40), dtypes.bfloat16)
    kwargs = {name: rng.random(40).astype(np.float32) for name in params}
    r = _x(rng, x.shape, x.dtype) if residual else None
    out = op(x, **kwargs, residual=r, return_stats=True, quantize="float8_e4m3fn")
    q, scales, *rest = out
    assert q.dtype == np.dtype(ml_dtypes.float8_e4m3fn) and q.shape == x.shape
    assert scales.shape == (2, 3, 1) and scales.dtype == np.float32
    if residual:
        h, *rest = rest
        assert h.dtype == x.dtype
    assert all(s.dtype == np.float32 and s.shape == (2, 3) for s in rest)
    exact = op(x, **kwargs, residual=r, return_stats=False) if not residual else op(x, **kwargs, residual=r)[0]
    dequantized = q.astype(np.float64) * scales
    np.testing.assert_allclose(dequantized, exact.astype(np.float64), atol=0.07 * np.abs(exact.astype(
        np.float64)).max())
    static = op(x, **kwargs, residual=r, quantize="int8", quant_scale=ONE)
    assert (static[0] if residual else static).dtype == np.int8


def test_the_dispatch_runs_the_cached_tier_with_the_quantizing_store():
    for quant, store in [(("float8_e4m3fn", quantize.ROW), "cunorm::QuantStore<float, 1, cunorm::e4m3_t, 1, 0>"),
                         (("int8", quantize.STATIC), "cunorm::QuantStore<float, 1, signed char, 0, 0>")]:
        for n, rows in ((4096, 1), (4096, 32768), (16384, 16)):  # (few long rows would otherwise split)
            plan = plans.make_plan("rms", dtypes.bfloat16, dtypes.float32, 1, False, (rows, n), (n, 1), 1, 1, 0, 0,
                                   0, 0, 0, 0, None, quant)
            launch = dispatch_rows.choose(plan, H100)
            assert launch.tier == "cached"
            assert store in launch.steps[0].kernel.expression
            assert plan.vec == 8
    # rows over the register budget: rows_uncached's sweeps, whatever the number of rows (never split),
    # without a stash or odd elements (a row's vector is x's own alignment: plan.vec, not peel_vec)
    for n, rows, dtype, residual in ((1 << 20, 4, dtypes.float32, False), (16384, 1, dtypes.bfloat16, True),
                                     (16384, 32768, dtypes.bfloat16, True), (8192 + 8, 3, dtypes.float32, True)):
        size = dtype.itemsize
        plan = plans.make_plan("ln", dtype, None, 0, residual, (rows, n), (n, 1), 1, 1, 0, 0, 0, 0, 0, 0, None,
                               ("int8", quantize.ROW))
        launch = dispatch_rows.choose(plan, H100)
        assert launch.tier == "uncached" and launch.stash_vecs == 0, (n, rows)
        assert "rows_uncached" in launch.steps[0].kernel.expression
        assert "cunorm::QuantStore<cunorm::none_t, 0, signed char, 1, 0>" in launch.steps[0].kernel.expression
        assert f", {plan.vec}>" in launch.steps[0].kernel.expression and plan.vec == 16 // size
        with pytest.raises(ValueError, match="cached or uncached tier"):
            dispatch_rows.choose(plan, H100, override={"tier": "split"})
    # a row that starts one element off its vector: the sweeps walk it in x's own vectors
    offset = plans.make_plan("rms", dtypes.float32, None, 0, False, (8, 65536), (65537, 1), 1, 1, 4, 0, 0, 0, 0, 0,
                             None, ("float8_e4m3fn", quantize.STATIC))
    assert dispatch_rows.choose(offset, H100).steps[0].kernel.expression.endswith(", 1>")


def test_quant_store_is_formatted_from_closed_sets():
    stage = declarations.quant_store("float", 1, "cunorm::e5m2_t", 2, 128)
    assert stage.expression == "cunorm::QuantStore<float, 1, cunorm::e5m2_t, 2, 128>"
    with pytest.raises(TypeError):
        declarations.quant_store("float", 1, "e5m2_t; }", 2).expression


@pytest.mark.parametrize("static", [False, True])
def test_the_torch_operator_fake_gives_each_output(static):
    """torch.compile sees torch.ops.cunorm.row_norm_quantized through its
    fake: the outputs' shapes and dtypes, in order (no GPU needed)."""
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    import cunorm.torch  # noqa: F401  (registers the operators)

    with FakeTensorMode():
        x = torch.empty(3, 5, 64, dtype=torch.bfloat16)
        w = torch.empty(64, dtype=torch.float32)
        scale = torch.empty(1, dtype=torch.float32) if static else None
        out = torch.ops.cunorm.row_norm_quantized(x, w, w, x, [-1], 1e-5, True, 0, "ln", "float8_e5m2", scale, None,
                                                  None, None, True)
        want = [((3, 5, 64), torch.float8_e5m2)] + ([] if static else [((3, 5, 1), torch.float32)]) + \
            [((3, 5, 64), torch.bfloat16)] * 2 + [((3, 5), torch.float32), ((3, 5), torch.float32)]
        assert [(tuple(t.shape), t.dtype) for t in out] == want
        with pytest.raises(ValueError, match="quantize must be"):
            torch.ops.cunorm.row_norm_quantized(x, w, None, None, [-1], 1e-5, False, 0, "rms", "fp8", None, None,
                                                None, None, False)
        with pytest.raises(ValueError, match="norm must be"):
            torch.ops.cunorm.row_norm_quantized(x, w, None, None, [-1], 1e-5, False, 0, "l2", "int8", None, None,
                                                None, None, False)


@pytest.mark.parametrize("layout", quantize.LAYOUTS)
@pytest.mark.parametrize("group", quantize.GROUPS)
def test_group_scales_cover_their_groups_in_the_asked_layout(group, layout):
    """Each group of the row gets max|y| / qmax of its own elements (an
    all-zero group the floor), as x's leading axes then the groups, laid
    out as asked (column-major: rows contiguous, padded to 4 for TMA)."""
    rng = np.random.default_rng()
    x = _x(rng, (3, 5, 4 * group))
    x[1, 2, group:2 * group] = 0.0
    w = (rng.random(4 * group) + 0.5).astype(np.float32)
    q, scales = cunorm.rms_norm(x, w, quantize="float8_e4m3fn", quant_group=group, quant_scale_layout=layout)
    assert q.shape == x.shape and scales.shape == (3, 5, 4) and scales.dtype == np.float32
    padded = {"row_major": None, "column_major": 15, "column_major_tma": 16}[layout]
    want_strides = (20 * 4, 4 * 4, 4) if padded is None else (5 * 4, 4, padded * 4)
    assert scales.strides == want_strides
    y = cunorm.reference.rms_norm(x.astype(np.float64), w.astype(np.float64))
    groups = np.abs(y).reshape(3, 5, 4, group)
    want = np.maximum((groups.max(axis=-1) / 448.0).astype(np.float32), np.float32(1 / (448 * 512)))
    np.testing.assert_allclose(scales, want, rtol=1e-6)
    assert scales[1, 2, 1] == np.float32(1 / (448 * 512)) and not q.astype(np.float64)[1, 2, group:2 * group].any()
    dequantized = q.astype(np.float64).reshape(3, 5, 4, group) * scales[..., None]
    assert np.abs(dequantized.reshape(y.shape) - y).max() <= 0.07 * np.abs(y).max()
    bounded = cunorm.rms_norm(x, w, quantize="int8", quant_group=group, quant_scale_ub=np.array([0.5], np.float32))
    assert np.all(bounded[1] <= np.float32(0.5 / 127) * (1 + 1e-6))


def test_group_dispatch_gives_a_group_its_lanes():
    """A group's lanes (group / vector elements) sit in one row's threads,
    within a warp; a vector too narrow for that is refused (the engine
    copies such views first)."""
    for n, rows in ((128, 1), (128, 4096), (4096, 32768), (7168, 7)):
        for group in quantize.GROUPS:
            key = ("float8_e4m3fn", quantize.ROW, group, quantize.COLUMN_MAJOR_TMA)
            plan = plans.make_plan("rms", dtypes.bfloat16, dtypes.bfloat16, 1, False, (rows, n), (n, 1), 1, 1, 0, 0,
                                   0, 0, 0, 0, None, key)
            launch = dispatch_rows.choose(plan, H100)
            assert launch.tier == "cached" and launch.threads_per_row >= group // plan.vec
            assert f"QuantStore<cunorm::bf16_t, 1, cunorm::e4m3_t, 1, {group}>" in launch.steps[0].kernel.expression
            assert quantize.kernel_strides(quantize.by_key(key), rows, n) == (1, -(-rows // 4) * 4)
    narrow = plans.make_plan("rms", dtypes.float32, None, 0, False, (4, 256), (258, 1), 1, 1, 0, 0, 0, 0, 0, 0,
                             None, ("int8", quantize.ROW, 128, quantize.ROW_MAJOR))
    assert narrow.vec == 2
    with pytest.raises(ValueError, match="over a warp"):
        dispatch_rows.choose(narrow, H100)


def test_the_torch_fake_lays_out_group_scales():
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    import cunorm.torch  # noqa: F401  (registers the operators)

    with FakeTensorMode():
        x = torch.empty(3, 5, 256, dtype=torch.bfloat16)
        for layout, strides in ((None, (10, 2, 1)), ("column_major", (5, 1, 15)), ("column_major_tma", (5, 1, 16))):
            q, scales = torch.ops.cunorm.row_norm_quantized(x, None, None, None, [-1], 1e-5, False, 0, "rms", "int8",
                                                            None, None, 128, layout, False)
            assert q.dtype == torch.int8 and scales.shape == (3, 5, 2) and scales.stride() == strides
