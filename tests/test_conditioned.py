"""Per-head weights, shift=, scale= and residual_gate= (cunorm/_engine/
conditioning.py): the rows each array is read by, the float64 reference
against a direct formulation, the argument checks on every path (NumPy
here; CuPy on a GPU), and the kernels' dispatch (pure)."""
import numpy as np
import pytest

import cunorm
from cunorm import reference
from cunorm._engine import conditioning, dispatch_grad, dispatch_rows, dtypes, plans
from helpers import arr, random


@pytest.mark.parametrize("x_shape, first, shape, rows", [
    ((4, 7, 16), 2, (4, 1, 16), (7, 4)),  # per sample
    ((4, 7, 16), 2, (4, 7, 16), (1, 28)),  # per token
    ((4, 7, 16), 2, (7, 16), (1, 7)),  # per position, shared by the batch
    ((4, 7, 16), 2, (16,), (1, 1)),  # one for all
    ((4, 7, 16), 2, (1, 1, 16), (1, 1)),
    ((2, 3, 5, 8), 3, (2, 3, 1, 8), (5, 6)),  # two adjacent kept axes
    ((2, 3, 5, 8), 3, (2, 1, 5, 8), None),  # kept axes not adjacent: broadcast out first
    ((1, 7, 16), 2, (1, 7, 16), (1, 7)),
])
def test_each_row_reads_its_broadcast_row(x_shape, first, shape, rows):
    assert conditioning.broadcast_rows(x_shape, first, shape) == rows
    if rows is None:
        return
    div, count = rows
    lead = x_shape[:first]
    index = np.arange(int(np.prod(shape[:-1] if len(shape) > 1 else (1,)))).reshape(
        ((1,) * (len(x_shape) - len(shape)) + tuple(shape))[:first])
    want = np.broadcast_to(index, lead).reshape(-1)
    got = (np.arange(int(np.prod(lead))) // div) % count
    assert np.array_equal(np.unique(want, return_inverse=True)[1], got)


def _direct(x, w, b, shift, scale, gate, residual, kind):
    """The formula written out in float64."""
    w, b, shift, scale, gate = (None if a is None else a.astype(np.float64) for a in (w, b, shift, scale, gate))
    xf = x.astype(np.float64)
    h = xf if residual is None else (residual.astype(np.float64) + (1.0 if gate is None else gate) * xf)
    h = h.astype(x.dtype).astype(np.float64)
    if kind == "ln":
        v = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-5)
    else:
        v = h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-5)
    v = v * (1.0 if w is None else w) + (0.0 if b is None else b)
    return v * (1 + (0.0 if scale is None else scale)) + (0.0 if shift is None else shift), h


@pytest.mark.parametrize("kind", ["rms", "ln"])
def test_the_reference_is_the_formula(rng, kind):
    x, r = random(rng, (3, 5, 4, 8), np.float32), random(rng, (3, 5, 4, 8), np.float32)
    w, b = random(rng, (4, 8), np.float32), random(rng, (4, 8), np.float32)
    shift, scale, gate = (random(rng, (3, 1, 1, 8), np.float32) for _ in range(3))
    fn = reference.rms_norm if kind == "rms" else reference.layer_norm
    bias = {} if kind == "rms" else {"bias": b}
    y, h = fn(x, w, **bias, residual=r, shift=shift, scale=scale, residual_gate=gate, exact=True)
    want, want_h = _direct(x, w, b if kind == "ln" else None, shift, scale, gate, r, kind)
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(h.astype(np.float64), want_h)


def test_the_numpy_path_runs_the_reference(rng):
    x = random(rng, (2, 6, 24), np.float32)
    shift, scale = random(rng, (2, 1, 24), np.float32), random(rng, (24,), np.float32)
    y = cunorm.layer_norm(x, shift=shift, scale=scale, activation="silu")
    want = reference.layer_norm(x, shift=shift, scale=scale, activation="silu")
    np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"shift": (3, 1, 16)}, ValueError, r"shift must broadcast against x \(2, 5, 16\)"),
    ({"scale": (2, 5, 8)}, ValueError, "span the normalized axes"),
    ({"shift": (1, 2, 5, 16)}, ValueError, "shift must broadcast"),
    ({"residual_gate": (2, 1, 16)}, ValueError, "pass residual= too"),
    ({"shift": (2, 1, 16), "axis": 1}, ValueError, "normalize over the trailing axes"),
    ({"weight": (3, 16)}, ValueError, r"weight must have the shape of the normalized axes \(16,\), got \(3, 16\)"),
    ({"weight": (5, 16), "bias": (16,)}, ValueError, "weight and bias must have one shape"),
    ({"shift": (2, 1, 16), "quantize": "int8"}, ValueError, "quantize= takes no"),
])
def test_bad_operands_are_refused_before_anything_runs(xp, kwargs, error, match):
    x = arr(xp, (2, 5, 16))
    given = {k: arr(xp, v) if isinstance(v, tuple) else v for k, v in kwargs.items()}
    if "residual_gate" in given and "pass residual" not in match:
        given["residual"] = arr(xp, (2, 5, 16))
    with pytest.raises(error, match=match):
        cunorm.layer_norm(x, **given)


def test_a_shift_of_another_kind_or_dtype_is_a_type_error(xp):
    x = arr(xp, (2, 5, 16))
    with pytest.raises(TypeError, match="scale must have dtype"):
        cunorm.rms_norm(x, scale=xp.zeros((2, 1, 16), dtype=np.int32))
    if xp is not np:
        with pytest.raises(TypeError, match="shift is a NumPy array but x is a GPU array"):
            cunorm.rms_norm(x, shift=np.zeros((2, 1, 16), np.float32))


H100 = dispatch_rows.Device(sm_count=132, compute_capability=90, max_shared_per_block=227 * 1024,
                            l2_bytes=50 * 1024 * 1024)


@pytest.mark.parametrize("norm", ["rms", "ln"])
@pytest.mark.parametrize("n", [64, 1152, 3072, 8192])
@pytest.mark.parametrize("rows", [1, 7, 4096])
def test_per_row_operands_take_the_cached_tier_whatever_the_rows(norm, n, rows):
    """rows_cached alone takes them, and its launch follows the row alone
    (batch invariance)."""
    from cunorm._engine import dtypes

    flags = plans.FLAG_WEIGHT | plans.FLAG_SHIFT | plans.FLAG_SCALE | plans.FLAG_RESIDUAL_GATE
    plan = plans.make_plan(norm, dtypes.bfloat16, dtypes.float32, flags, True, (rows, n), (n, 1), 1, 1, 0, 0, 0, 0,
                           0, 0, None, None, (1, rows, 1), (0, 0, 0))
    launch = dispatch_rows.choose(plan, H100)
    assert launch.tier == "cached"
    assert "ScaledResidualLoad" in launch.steps[0].kernel.expression
    assert f"AffineStore<float, {flags & plans.STORE_FLAGS}," in launch.steps[0].kernel.expression
    one = plans.make_plan(norm, dtypes.bfloat16, dtypes.float32, flags, True, (1, n), (n, 1), 1, 1, 0, 0, 0, 0, 0, 0,
                          None, None, (1, 1, 1), (0, 0, 0))
    assert dispatch_rows.choose(one, H100).steps[0].kernel == launch.steps[0].kernel


def test_rows_past_the_register_tier_are_refused_clearly():
    from cunorm._engine import dtypes

    flags = plans.FLAG_SHIFT | plans.FLAG_SCALE
    plan = plans.make_plan("ln", dtypes.float32, dtypes.float32, flags, False, (4, 1 << 16), (1 << 16, 1), 1, 1, 0,
                           0, 0, 0, 0, 0, None, None, (1, 4, 1), (0, 0))
    assert dispatch_rows.choose(plan, H100) is None


def test_out_may_not_overlap_a_shift(xp):
    x, out = arr(xp, (2, 3, 8)), xp.zeros((2, 3, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="out overlaps shift"):
        cunorm.rms_norm(x, shift=out[:, :1, :], out=out)
    assert not out.any()  # (nothing written)


def _composed_case(rng, heads):
    shape = (2, 3, 4, 8) if heads else (2, 3, 32)
    x, r = random(rng, shape, np.float32), random(rng, shape, np.float32)
    pshape = shape[-2:] if heads else shape[-1:]
    w, b = random(rng, pshape, np.float32), random(rng, pshape, np.float32)
    lead = (shape[0],) + (1,) * (len(shape) - 2) + (shape[-1],)
    shift, scale, gate = (random(rng, lead, np.float32) for _ in range(3))
    want = reference.layer_norm(x, w, b, residual=r, shift=shift, scale=scale, residual_gate=gate,
                                activation="silu", exact=True)
    return (x, w, b, r, shift, scale, gate), want


@pytest.mark.parametrize("heads", [False, True])
def test_the_torch_composition_is_the_formula(rng, heads):
    """Where autograd records: the plain norm (here torch's own, on the CPU)
    and torch's ops around it (cunorm/torch/_conditioned.py)."""
    torch = pytest.importorskip("torch")
    from cunorm.torch import _conditioned

    arrays, want = _composed_case(rng, heads)
    x, w, b, r, shift, scale, gate = (torch.tensor(a) for a in arrays)
    x.requires_grad_()

    def plain(x, w, b, *, axis, eps, residual, return_stats, activation):
        assert residual is None and activation is None and (w is None) == heads
        return torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, eps)

    y, h = _conditioned.conditioned("ln", plain, x, w, b, axis=-1, eps=1e-5, residual=r, return_stats=False,
                                    epilogue=0, activation="silu", shift=shift, scale=scale, residual_gate=gate)
    np.testing.assert_allclose(y.detach().numpy(), want[0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(h.detach().numpy(), want[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("heads", [False, True])
def test_the_jax_composition_is_the_formula(rng, heads):
    jax = pytest.importorskip("jax")
    import cunorm.jax as cj

    jnp = jax.numpy
    arrays, want = _composed_case(rng, heads)

    def plain(x, w, b, *, axis, eps, residual, return_stats, activation):
        assert residual is None and activation is None and (w is None) == heads
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        y = (x - m) / jnp.sqrt(v + eps)
        return y if w is None else y * w + b

    x, w, b, r, shift, scale, gate = (jnp.asarray(a) for a in arrays)
    y, h = cj._conditioned_composed(plain, x, w, b, r, shift, scale, gate, None, axis=-1, eps=1e-5,
                                    return_stats=False, activation="silu")
    np.testing.assert_allclose(np.asarray(y), want[0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(h), want[1], rtol=1e-6, atol=1e-6)


def test_which_calls_ask_for_per_row_operands():
    w, heads = np.ones(8), np.ones((4, 8))
    assert not conditioning.requested(w, w, -1, None, None, None)
    assert conditioning.requested(heads, None, -1, None, None, None)
    assert conditioning.requested(None, heads, -1)
    assert not conditioning.requested(heads, heads, (2, 3))  # (both axes normalized: not per head)
    assert conditioning.requested(w, None, -1, None, np.ones(8), None)


def test_per_head_parameters_alone_run_as_the_plain_norm():
    """heads_alone: per-head parameters and no other per-row operand, over
    rows the plain backward takes a block a row, run as the plain norm
    (its autograd Function in eager mode, its operator under dynamo);
    anything else keeps the conditioned route."""
    torch = pytest.importorskip("torch")
    from cunorm._engine import gradients
    from cunorm.torch._conditioned import heads_alone

    x, w = torch.empty(3, 7, 8, 128, dtype=torch.bfloat16), torch.empty(8, 128)
    assert heads_alone("rms", x, w, None, -1, None, None, None, None, None)
    assert heads_alone("ln", x, None, w, -1, x, None, None, None)  # (a bias per head, a residual)
    assert not heads_alone("rms", x, w, None, -1, None, torch.empty(3, 1, 1, 128), None, None, None)  # (a shift)
    assert not heads_alone("rms", x, w[0], None, -1, None, None, None, None, None)  # (not per head)
    assert not heads_alone("rms", x, w, None, -1, x.float(), None, None, None, None)  # (the float32 stream)
    long_rows = torch.empty(2, 4, 32768, dtype=torch.bfloat16)
    assert not heads_alone("rms", long_rows, torch.empty(4, 32768), None, -1, None, None, None, None, None)
    assert gradients.per_head_fits(16384, 2, True, True) and not gradients.per_head_fits(16392, 2, True, False)
    assert gradients.per_head_fits(4096, 8, True, False) and not gradients.per_head_fits(8192, 8, True, False)
    A100_LIKE = dispatch_rows.Device(sm_count=108, compute_capability=80, max_shared_per_block=166912)
    for n in (64, 1000, 4096, 8188, 16380, 16384):  # (as the dispatch: a block a row where it fits)
        plain = dispatch_grad.choose_rows_grad("ln", np.dtype(dtypes.bfloat16), np.dtype(np.float32), 3, 8, n, 1,
                                               plans.vector_width(2, n, [], []), A100_LIKE, heads=2)
        assert gradients.per_head_fits(n, 2, True, True) == (plain is not None), n

    def traced(x, w):  # (the same answer under dynamo: fullgraph, no graph break)
        return x + 1 if heads_alone("rms", x, w, None, -1, None, None, None, None, None) else x

    x32 = torch.zeros(3, 7, 8, 128)
    assert torch.equal(torch.compile(traced, backend="eager", fullgraph=True)(x32, w), x32 + 1)
    # the whole route under dynamo and AOT autograd (meta tensors: the operators' fakes), LayerNorm with
    # weight and bias per head and a residual: each gradient in its input's shape
    import cunorm.torch as ct
    from torch._dynamo.backends.debugging import aot_eager

    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return aot_eager(gm, example_inputs)

    meta = [torch.empty(s, device="meta", dtype=d).requires_grad_() for s, d in
            (((3, 7, 8, 128), torch.bfloat16), ((8, 128), torch.float32), ((8, 128), torch.float32),
             ((3, 7, 8, 128), torch.bfloat16))]
    y, h = torch.compile(lambda x, w, b, r: ct.layer_norm(x, w, b, residual=r), backend=backend,
                         fullgraph=True)(*meta)
    grads = torch.autograd.grad(y.sum() + h.sum(), meta)
    assert [g.shape for g in grads] == [a.shape for a in meta]
    assert "cunorm.layer_norm" in seen and not any("conditioned" in t for t in seen), seen


def test_dynamo_traces_without_lru_cache_warnings(monkeypatch):
    """torch.compile of the conditioned norms (modulated, gated) warns
    nothing about functools.lru_cache: dynamo warns once a process, so its
    record of warned messages is emptied first."""
    torch = pytest.importorskip("torch")
    import warnings

    import cunorm.torch as ct

    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())
    meta = lambda *shape: torch.empty(*shape, device="meta", dtype=torch.bfloat16)  # noqa: E731
    modulated = torch.compile(lambda x, s, c: ct.layer_norm(x, shift=s, scale=c), backend="eager", fullgraph=True)
    gated = torch.compile(lambda x, z: ct.rms_norm(x, gate=z), backend="eager", fullgraph=True)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        modulated(meta(2, 8, 64), meta(2, 1, 64), meta(2, 1, 64))
        gated(meta(2, 8, 64), meta(2, 8, 64))
    assert not [str(w.message)[:200] for w in caught if "lru_cache" in str(w.message)]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_dynamo_traces_the_fused_operators(dynamic):
    """torch.compile (aot_eager, meta tensors: the operators' fakes) takes
    the conditioned operator forward and, where autograd records, its
    autograd formula: adaLN-Zero's gradients reach x, the residual and the
    modulation tensor in their shapes, over two token counts (symbolic with
    ``dynamic``); the gated RMSNorm over groups in inference; a bad shift
    is refused while tracing (fullgraph: dynamo's error holds ours)."""
    torch = pytest.importorskip("torch")
    import cunorm.torch as ct
    from torch._dynamo.backends.debugging import aot_eager

    traced = []

    def backend(gm, example_inputs):
        traced.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return aot_eager(gm, example_inputs)

    def adaln(x, r, mod):
        shift, scale, gate = (m.unsqueeze(1) for m in mod.chunk(6, -1)[:3])
        return ct.layer_norm(x, residual=r, shift=shift, scale=scale, residual_gate=gate, eps=1e-6)

    meta = lambda *shape: torch.empty(*shape, device="meta", dtype=torch.bfloat16)  # noqa: E731
    compiled = torch.compile(adaln, backend=backend, fullgraph=True, dynamic=dynamic)
    for tokens in (32, 48):
        x, r, mod = (a.requires_grad_() for a in (meta(2, tokens, 256), meta(2, tokens, 256), meta(2, 6 * 256)))
        y, h = compiled(x, r, mod)
        grads = torch.autograd.grad(y.sum() + h.sum(), [x, r, mod])
        assert [g.shape for g in grads] == [x.shape, r.shape, mod.shape]
    assert "cunorm.layer_norm_conditioned" in traced
    with torch.no_grad():
        gated = torch.compile(lambda x, z, w: ct.rms_norm(x, w, gate=z, group_size=64), backend=backend,
                              fullgraph=True, dynamic=dynamic)
        assert gated(meta(2, 32, 256), meta(2, 32, 256), meta(256)).shape == (2, 32, 256)
    assert "cunorm.rms_norm_conditioned" in traced
    bad = torch.compile(lambda x, s: ct.rms_norm(x, shift=s), backend=backend, fullgraph=True, dynamic=dynamic)
    with pytest.raises(RuntimeError, match="must broadcast against x"):  # (dynamo's error, holding ours)
        with torch.no_grad():
            bad(meta(2, 32, 256), meta(2, 3, 256))
