"""quantize= on the GPU against the float64 reference: CuPy and torch
tensors, every format and scaling, with and without a residual and
parameters, odd sizes, fresh random data each run."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cunorm
from cunorm._engine import dtypes, quantize

pytestmark = pytest.mark.gpu

FORMATS = list(quantize.FORMATS)


def _decoded(q, fmt):
    """Quantized values as float64 (raw FP8 bits viewed as their format)."""
    q = np.asarray(q)
    if fmt != "int8" and q.dtype == np.uint8:
        q = q.view(quantize.FORMATS[fmt].numpy)
    return q.astype(np.float64)


def _check(q, scales, ref_q, ref_scales, exact_y, fmt, static_scale=None):
    """q equals the reference's quantization except where y / scale lies
    next to a rounding boundary; those are one step apart and rare."""
    if ref_scales is not None:
        np.testing.assert_allclose(scales, ref_scales, rtol=1e-6)
        scale = ref_scales.astype(np.float64)
    else:
        scale = np.float64(static_scale[0])
    got, want = _decoded(q, fmt), _decoded(ref_q, fmt)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    differ = ~((got == want) | (np.isnan(got) & np.isnan(want)))
    if differ.any():
        v = (exact_y / scale)[differ]
        lo, hi = np.minimum(got[differ], want[differ]), np.maximum(got[differ], want[differ])
        midpoint = (lo + hi) / 2
        # float32's y carries a few ulps of the row's largest terms (LayerNorm's centering, the bias)
        row_max = np.broadcast_to(np.nanmax(np.abs(exact_y / scale), axis=-1, keepdims=True), exact_y.shape)[differ]
        near = np.abs(v - midpoint) <= 1e-5 * np.abs(v) + 4e-6 * row_max
        assert near.all(), (v[~near][:5], got[differ][~near][:5], want[differ][~near][:5], row_max[~near][:5])
        assert differ.sum() <= max(2, 1e-3 * differ.size), differ.sum()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scaling", ["row", "static", "bounded"])
@pytest.mark.parametrize("op,dtype,residual", [
    ("rms", dtypes.bfloat16, False), ("rms", dtypes.bfloat16, True), ("rms", dtypes.float16, False),
    ("ln", dtypes.bfloat16, True), ("ln", dtypes.float32, False)])
def test_cupy_matches_the_reference(op, dtype, residual, fmt, scaling):
    import cupy

    rng = np.random.default_rng()
    rows, n = int(rng.integers(1, 300)), int(rng.choice([4096, 2048 + 8, 777, 7168, 64]))
    x = (rng.standard_normal((rows, n)) * 2).astype(dtype)
    w = (rng.random(n) + 0.5).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if op == "ln" else None
    r = rng.standard_normal((rows, n)).astype(dtype) if residual else None
    static = np.array([np.float32(rng.uniform(0.01, 0.05))]) if scaling == "static" else None
    bound = np.array([np.float32(3.0)]) if scaling == "bounded" else None
    fn = cunorm.rms_norm if op == "rms" else cunorm.layer_norm
    params = (w,) if op == "rms" else (w, b)
    kwargs = dict(quantize=fmt, quant_scale=static, quant_scale_ub=bound)
    ref = fn(x, *params, residual=r, **kwargs)
    # (the reference's float64 y before any rounding)
    exact_y = cunorm.reference.rms_norm(x, w, residual=r, exact=True) if op == "rms" else \
        cunorm.reference.layer_norm(x, w, b, residual=r, exact=True)
    exact_y = exact_y[0] if residual else exact_y
    dev = lambda a: None if a is None else cupy.asarray(a)  # noqa: E731
    got = fn(dev(x), *[dev(p) for p in params], residual=dev(r), quantize=fmt, quant_scale=dev(static),
             quant_scale_ub=dev(bound))
    got = got if isinstance(got, tuple) else (got,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    assert got[0].dtype == quantize.FORMATS[fmt].device and got[0].shape == x.shape
    dynamic = scaling != "static"
    scales = cupy.asnumpy(got[1]) if dynamic else None
    _check(cupy.asnumpy(got[0]), scales, ref[0], ref[1] if dynamic else None, exact_y, fmt, static)
    if residual:
        np.testing.assert_array_equal(cupy.asnumpy(got[-1]).view(np.uint16 if dtype.itemsize == 2 else np.uint32),
                                      ref[-1].view(np.uint16 if dtype.itemsize == 2 else np.uint32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_tensors_come_back_in_torch_dtypes(fmt):
    torch = pytest.importorskip("torch")
    x = torch.randn(37, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    with torch.no_grad():
        q, scales = cunorm.rms_norm(x, w, quantize=fmt)
    assert q.dtype == getattr(torch, fmt) and q.shape == x.shape and scales.shape == (37, 1)
    ref_q, ref_scales = cunorm.rms_norm(x.float().cpu().numpy().astype(ml_dtypes.bfloat16),
                                        w.float().cpu().numpy().astype(ml_dtypes.bfloat16), quantize=fmt)
    exact_y = cunorm.reference.rms_norm(x.float().cpu().numpy().astype(ml_dtypes.bfloat16),
                                        w.float().cpu().numpy().astype(ml_dtypes.bfloat16), exact=True)
    raw = q.view(torch.uint8) if fmt != "int8" else q
    _check(raw.cpu().numpy(), scales.cpu().numpy(), ref_q, ref_scales, exact_y, fmt)
    x.requires_grad_(True)
    with pytest.raises(RuntimeError, match="inference only"):
        cunorm.rms_norm(x, w, quantize=fmt)


def test_static_scale_is_read_when_the_kernel_runs():
    """A captured CUDA graph replays with the scale's new value."""
    import cupy

    x = cupy.asarray(np.random.default_rng().standard_normal((8, 1024)).astype(dtypes.bfloat16))
    scale = cupy.asarray(np.array([0.05], np.float32))  # (|y| < 6: no saturation)
    first = cunorm.rms_norm(x, quantize="int8", quant_scale=scale)
    scale[...] = 0.1
    second = cunorm.rms_norm(x, quantize="int8", quant_scale=scale)
    assert not cupy.array_equal(first, second)
    assert int(cupy.abs(second.astype(np.int32) * 2 - first.astype(np.int32)).max()) <= 1


def test_nan_rows_and_zero_rows():
    import cupy

    x = np.random.default_rng().standard_normal((4, 256)).astype(np.float32)
    x[1] = 0.0
    x[2, 5] = np.nan
    q, scales = cunorm.rms_norm(cupy.asarray(x), quantize="float8_e4m3fn")
    q, scales = cupy.asnumpy(q).view(ml_dtypes.float8_e4m3fn).astype(np.float64), cupy.asnumpy(scales)
    assert scales[1, 0] == np.float32(quantize.FORMATS["float8_e4m3fn"].min_scale) and not q[1].any()
    assert np.isnan(q[2]).all()  # a group holding NaN is NaN throughout (as the plain op)
    assert np.isfinite(q[[0, 3]]).all() and np.isfinite(scales).all()
    qi = cupy.asnumpy(cunorm.rms_norm(cupy.asarray(x), quantize="int8")[0])
    assert not qi[2].any()  # int8 has no NaN: 0


@pytest.mark.parametrize("kind", ["cupy", "torch"])
@pytest.mark.parametrize("scaling", ["row", "static", "bounded"])
def test_a_repeated_call_replays_its_launch(kind, scaling):
    """The second call of a signature is the launch cache's: the same
    results, bitwise, in the same types; a new static scale is read."""
    import cupy

    from cunorm._engine import launch_cache

    rng = np.random.default_rng()
    x = (rng.standard_normal((5, 1000)) * 3).astype(dtypes.bfloat16)
    w = rng.random(1000).astype(np.float32)
    r = rng.standard_normal((5, 1000)).astype(dtypes.bfloat16)
    one = np.array([0.02 if scaling == "static" else 2.0], np.float32)
    if kind == "torch":
        torch = pytest.importorskip("torch")
        dev = lambda a: torch.from_dlpack(cupy.asarray(a))  # noqa: E731
    else:
        dev = cupy.asarray
    xs, ws, rs, ones = dev(x), dev(w), dev(r), dev(one)
    kwargs = {"quantize": "float8_e4m3fn", "residual": rs}
    if scaling == "static":
        kwargs["quant_scale"] = ones
    elif scaling == "bounded":
        kwargs["quant_scale_ub"] = ones
    launch_cache.clear()
    first = cunorm.layer_norm(xs, ws, **kwargs)
    key = launch_cache.rows_key("ln", xs, ws, None, rs, -1, 1e-5, False, 0, None,
                                ("float8_e4m3fn", kwargs.get("quant_scale"), kwargs.get("quant_scale_ub"), None,
                                 None, False))
    assert key is not None and launch_cache.ROWS.get(key) is not None
    second = cunorm.layer_norm(xs, ws, **kwargs)
    assert len(first) == len(second) == (2 if scaling == "static" else 3)
    for a, b in zip(first, second):
        assert type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
        bits = (lambda t: cupy.asarray(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)) \
            if kind == "torch" else cupy.asarray
        assert cupy.array_equal(bits(a), bits(b))
    if scaling == "static":
        ones[...] = 0.04  # (read by the replayed launch)
        third = cunorm.layer_norm(xs, ws, **kwargs)
        assert not cupy.array_equal(bits(third[0]), bits(first[0]))


def test_torch_compile_and_cuda_graphs():
    """Under torch.compile the call is the registered operator; captured in
    a CUDA graph it replays with the static scale's new value."""
    torch = pytest.importorskip("torch")
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(2048, device="cuda", dtype=torch.bfloat16) + 0.5
    r = torch.randn_like(x)

    def step(x, w, r):
        q, scales, h = cunorm.rms_norm(x, w, residual=r, quantize="float8_e4m3fn")
        return q.float() * scales, h

    with torch.no_grad():
        eager = step(x, w, r)
        compiled = torch.compile(step, fullgraph=True)(x, w, r)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    scale = torch.tensor([0.01], device="cuda")
    static = torch.cuda.Stream()
    with torch.no_grad(), torch.cuda.stream(static):
        cunorm.rms_norm(x, w, quantize="int8", quant_scale=scale)  # (warm: compiled and cached outside the capture)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=static):
            out = cunorm.rms_norm(x, w, quantize="int8", quant_scale=scale)
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    first = out.clone()
    with torch.no_grad():
        assert torch.equal(first, cunorm.rms_norm(x, w, quantize="int8", quant_scale=scale))
    scale.fill_(0.05)
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(out, first)
    with torch.no_grad():
        assert torch.equal(out, cunorm.rms_norm(x, w, quantize="int8", quant_scale=scale))


@pytest.mark.parametrize("layout", quantize.LAYOUTS)
@pytest.mark.parametrize("group", quantize.GROUPS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", ["rms bf16 residual", "ln f32 bounded", "rms f16 offset view"])
def test_group_scales_match_the_reference(case, fmt, group, layout):
    """Per-group scales: q and the scales as the reference's, the scales'
    layout as asked, h bitwise; a view whose rows start off a vector is
    copied first and gives the same; a row's results do not depend on the
    batch."""
    import cupy

    rng = np.random.default_rng()
    op, dtype = case.split()[0], {"bf16": dtypes.bfloat16, "f32": np.float32, "f16": dtypes.float16}[case.split()[1]]
    rows, n = int(rng.integers(1, 200)), group * int(rng.choice([1, 3, 32, 56, 57]))
    offset = 1 if "view" in case else 0
    base = (rng.standard_normal((rows, n + offset)) * 2).astype(dtype)
    x = base[:, offset:]
    w = (rng.random(n) + 0.5).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if op == "ln" else None
    r = rng.standard_normal((rows, n)).astype(dtype) if "residual" in case else None
    bound = np.array([np.float32(2.5)]) if "bounded" in case else None
    fn = cunorm.rms_norm if op == "rms" else cunorm.layer_norm
    params = (w,) if op == "rms" else (w, b)
    kwargs = dict(quantize=fmt, quant_scale_ub=bound, quant_group=group, quant_scale_layout=layout)
    ref = fn(np.ascontiguousarray(x), *params, residual=r, **kwargs)
    exact_y = cunorm.reference.rms_norm(x, w, residual=r, exact=True) if op == "rms" else \
        cunorm.reference.layer_norm(x, w, b, residual=r, exact=True)
    exact_y = exact_y[0] if r is not None else exact_y
    dev = lambda a: None if a is None else cupy.asarray(a)  # noqa: E731
    xs = cupy.asarray(base)[:, offset:]
    got = fn(xs, *[dev(p) for p in params], residual=dev(r), quant_scale_ub=dev(bound), **{
        k: v for k, v in kwargs.items() if k != "quant_scale_ub"})
    assert got[0].dtype == quantize.FORMATS[fmt].device and got[0].shape == x.shape
    scales = got[1]
    assert scales.shape == (rows, n // group) and scales.strides == ref[1].strides
    per_element = lambda s: np.repeat(np.asarray(s), group, axis=-1)  # noqa: E731
    _check(cupy.asnumpy(got[0]), per_element(cupy.asnumpy(scales)), ref[0], per_element(ref[1]), exact_y, fmt)
    if r is not None:
        np.testing.assert_array_equal(cupy.asnumpy(got[2]).view(np.uint16), ref[2].view(np.uint16))
    again = fn(xs, *[dev(p) for p in params], residual=dev(r), quant_scale_ub=dev(bound), **{
        k: v for k, v in kwargs.items() if k != "quant_scale_ub"})  # (the launch cache's, where x was not copied)
    assert again[1].strides == scales.strides
    assert all(cupy.array_equal(a, b) for a, b in zip(again, got))
    if rows > 1:  # the last row alone: bitwise what it was in the batch (both aligned alike: contiguous)
        rest = {k: v for k, v in kwargs.items() if k != "quant_scale_ub"}
        xc = cupy.ascontiguousarray(xs)
        batch = fn(xc, *[dev(p) for p in params], residual=dev(r), quant_scale_ub=dev(bound), **rest)
        alone = fn(xc[-1:], *[dev(p) for p in params], residual=None if r is None else dev(r[-1:]),
                   quant_scale_ub=dev(bound), **rest)
        assert cupy.array_equal(alone[0], batch[0][-1:]) and cupy.array_equal(alone[1], batch[1][-1:])


def test_group_scales_in_torch_compile_and_the_launch_cache():
    """torch: group scales in the layout asked, the same under torch.compile
    (the fake's strides); a repeated row-major call replays bitwise."""
    torch = pytest.importorskip("torch")
    x = torch.randn(37, 7168, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(7168, device="cuda", dtype=torch.bfloat16) + 0.5

    def step(x, w, layout):
        return cunorm.rms_norm(x, w, quantize="float8_e4m3fn", quant_group=128, quant_scale_layout=layout)

    with torch.no_grad():
        for layout, strides in ((None, (56, 1)), ("column_major", (1, 37)), ("column_major_tma", (1, 40))):
            q, scales = step(x, w, layout)
            assert q.dtype == torch.float8_e4m3fn and scales.shape == (37, 56) and scales.stride() == strides
            cq, cscales = torch.compile(step, fullgraph=True)(x, w, layout)
            assert cscales.stride() == strides
            assert torch.equal(cq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(cscales, scales)
            again = step(x, w, layout)
            assert torch.equal(again[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(again[1], scales)


@pytest.mark.parametrize("kwargs", [{}, {"quant_group": 64}, {"quant_scale": "static"}, {"quant_scale_ub": 1.5},
                                    {"return_unquantized": True}], ids=["row", "group", "static", "bounded", "plain"])
def test_jax_eager_and_jit_agree(kwargs):
    """cunorm.jax inside jax.jit: the same results, bitwise, as the eager
    call, in JAX's dtypes."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    import cunorm.jax as cj

    rng = np.random.default_rng()
    x = jnp.asarray((rng.standard_normal((45, 2048)) * 2).astype(dtypes.bfloat16))
    w = jnp.asarray((rng.random(2048) + 0.5).astype(np.float32))
    r = jnp.asarray(rng.standard_normal((45, 2048)).astype(dtypes.bfloat16))
    given = {k: (jnp.asarray(np.array([0.02 if v == "static" else v], np.float32))
                 if k in ("quant_scale", "quant_scale_ub") else v) for k, v in kwargs.items()}

    def f(x, w, r, **given):
        return cj.layer_norm(x, w, residual=r, quantize="float8_e4m3fn", **given)

    eager = f(x, w, r, **given)
    static = {k: given.pop(k) for k in ("quant_group", "return_unquantized") if k in given}
    jitted = jax.jit(lambda x, w, r, **g: f(x, w, r, **static, **g))(x, w, r, **given)
    assert len(eager) == len(jitted) == (2 if "quant_scale" in kwargs else 4 if "return_unquantized" in kwargs else 3)
    assert eager[0].dtype == jnp.float8_e4m3fn
    for a, b in zip(eager, jitted):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(np.asarray(a).view(np.uint8) if a.dtype.itemsize == 1 else np.asarray(a),
                              np.asarray(b).view(np.uint8) if b.dtype.itemsize == 1 else np.asarray(b))


@pytest.mark.parametrize("kind", ["cupy", "torch"])
@pytest.mark.parametrize("mode", ["row", "group", "static"])
def test_the_unquantized_y_on_request(kind, mode):
    """return_unquantized=True: y in x's dtype beside q, as the plain call
    forms it (the same kernel's value rounded once; bitwise where the plain
    call takes the same launch), q unchanged; the launch cache replays it."""
    import cupy

    rng = np.random.default_rng()
    rows, n = int(rng.integers(1, 300)), int(rng.choice([1024, 4096, 7168]))
    x = (rng.standard_normal((rows, n)) * 2).astype(dtypes.bfloat16)
    w = (rng.random(n) + 0.5).astype(dtypes.bfloat16)
    b = rng.standard_normal(n).astype(dtypes.bfloat16)
    r = rng.standard_normal((rows, n)).astype(dtypes.bfloat16)
    if kind == "torch":
        torch = pytest.importorskip("torch")
        dev = lambda a: torch.from_dlpack(cupy.asarray(a))  # noqa: E731
        bits = lambda t: cupy.asarray(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)  # noqa: E731
    else:
        dev, bits = cupy.asarray, cupy.asarray
    xs, ws, bs, rs = dev(x), dev(w), dev(b), dev(r)
    kwargs = {"row": {}, "group": {"quant_group": 128}, "static": {"quant_scale": dev(np.array([0.03], np.float32))}}
    quant = dict(quantize="float8_e4m3fn", **kwargs[mode])
    without = cunorm.layer_norm(xs, ws, bs, residual=rs, **quant)
    for _ in range(2):  # (the second call: the launch cache's)
        got = cunorm.layer_norm(xs, ws, bs, residual=rs, return_unquantized=True, **quant)
        assert len(got) == len(without) + 1
        assert cupy.array_equal(bits(got[0]), bits(without[0]))
        y, h = got[-2], got[-1]
        assert y.dtype == xs.dtype and y.shape == xs.shape
        assert cupy.array_equal(bits(h), bits(without[-1]))
        plain, _ = cunorm.layer_norm(xs, ws, bs, residual=rs)
        exact = cunorm.reference.layer_norm(x, w, b, residual=r, exact=True)[0]
        wide = (lambda a: a.float().cpu().numpy()) if kind == "torch" else cupy.asnumpy  # noqa: E731
        got_y, plain_y = (wide(a).astype(np.float64) for a in (y, plain))
        scale = np.abs(exact).max()
        assert np.abs(got_y - exact).max() <= 2 ** -7 * scale and np.abs(plain_y - got_y).max() <= 2 ** -7 * scale


@pytest.mark.parametrize("case", [
    "ln bf16 residual 16384 row", "rms bf16 65536 static", "rms f32 residual 9216 group128 column_major_tma",
    "ln f32 16512 group64 bounded", "ln f16 residual 12288 row unquantized"])
def test_rows_beyond_the_register_budget(case):
    """Rows too long for rows_cached's registers take rows_uncached's
    sweeps (the CPU tests check the dispatch): q, the scales and the
    unquantized y as the reference's, h bitwise, the launch cache's replay
    bitwise, a row's results the same alone as in the batch."""
    import cupy

    rng = np.random.default_rng()
    words = case.split()
    op, dtype = words[0], {"bf16": dtypes.bfloat16, "f32": np.float32, "f16": dtypes.float16}[words[1]]
    n = int(next(w for w in words if w.isdigit()))
    group = int(next((w[5:] for w in words if w.startswith("group")), 0)) or None
    layout = next((w for w in words if w.startswith("column")), None)
    rows = int(rng.integers(2, 24))
    x = (rng.standard_normal((rows, n)) * 2).astype(dtype)
    w = (rng.random(n) + 0.5).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if op == "ln" else None
    r = rng.standard_normal((rows, n)).astype(dtype) if "residual" in words else None
    static = np.array([np.float32(rng.uniform(0.01, 0.05))]) if "static" in words else None
    bound = np.array([np.float32(2.5)]) if "bounded" in words else None
    fn = cunorm.rms_norm if op == "rms" else cunorm.layer_norm
    params = (w,) if op == "rms" else (w, b)
    kwargs = dict(quantize="float8_e4m3fn", quant_group=group, quant_scale_layout=layout,
                  return_unquantized="unquantized" in words)
    ref = fn(x, *params, residual=r, quant_scale=static, quant_scale_ub=bound, **kwargs)
    exact_y = cunorm.reference.rms_norm(x, w, residual=r, exact=True) if op == "rms" else \
        cunorm.reference.layer_norm(x, w, b, residual=r, exact=True)
    exact_y = exact_y[0] if r is not None else exact_y
    dev = lambda a: None if a is None else cupy.asarray(a)  # noqa: E731
    call = lambda xs, rs: fn(xs, *[dev(p) for p in params], residual=rs, quant_scale=dev(static),  # noqa: E731
                             quant_scale_ub=dev(bound), **kwargs)
    got = call(dev(x), dev(r))
    got = got if isinstance(got, tuple) else (got,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    assert len(got) == len(ref) and got[0].shape == x.shape
    if static is None:
        assert got[1].shape == ref[1].shape and got[1].strides == ref[1].strides
        per_element = (lambda s: np.repeat(np.asarray(s), group, axis=-1)) if group else (lambda s: s)  # noqa: E731
        _check(cupy.asnumpy(got[0]), per_element(cupy.asnumpy(got[1])), ref[0], per_element(ref[1]), exact_y,
               "float8_e4m3fn")
    else:
        _check(cupy.asnumpy(got[0]), None, ref[0], None, exact_y, "float8_e4m3fn", static)
    bits = np.uint16 if np.dtype(dtype).itemsize == 2 else np.uint32
    if r is not None:
        np.testing.assert_array_equal(cupy.asnumpy(got[-1]).view(bits), ref[-1].view(bits))
    if "unquantized" in words:
        y = cupy.asnumpy(got[2]).astype(np.float64)
        assert np.abs(y - exact_y).max() <= 2 ** -7 * np.abs(exact_y).max()
    again = call(dev(x), dev(r))  # (the launch cache's)
    again = again if isinstance(again, tuple) else (again,)
    assert all(cupy.array_equal(a, c) for a, c in zip(again, got))
    alone = call(dev(x[-1:]), None if r is None else dev(r[-1:]))
    alone = alone if isinstance(alone, tuple) else (alone,)
    assert all(cupy.array_equal(a, c[-1:]) for a, c in zip(alone, got))
