"""The epilogue's options on the GPU (rms_norm's rounding and weight offset,
the fused activations of every family) against the float64 reference and
against the formulas of the layers they stand in for; and replace_norms on
timm's and transformers' layers and models: outputs and gradients against
the original layers (skipped without a GPU, and per library where it is not
installed)."""
import copy

import numpy as np
import pytest

import cunorm
from cunorm._engine import dtypes, plans
from cunorm import reference
from helpers import RTOL, assert_close, output_scale

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")
from cunorm import torch as cunorm_torch  # noqa: E402

F = torch.nn.functional
HALF = [torch.bfloat16, torch.float16, torch.float32]
HALF_IDS = ["bf16", "f16", "f32"]
ACTIVATIONS = ["relu", "silu", "gelu", "gelu_tanh"]
TORCH_ACT = {"relu": torch.relu, "silu": F.silu, "gelu": F.gelu,
             "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}


@pytest.fixture(autouse=True)
def cunorm_at_every_size(monkeypatch):
    """The layers under eager autograd run torch's op below
    EAGER_AUTOGRAD_MIN_ELEMENTS; these tests check cunorm's, at small sizes."""
    from cunorm.torch import _layers as _torch_layers

    monkeypatch.setattr(_torch_layers, "EAGER_AUTOGRAD_MIN_ELEMENTS", 0)


@pytest.fixture
def gen():
    seed = int.from_bytes(np.random.bytes(4), "little")
    print(f"torch seed {seed}")
    return torch.Generator(device="cuda").manual_seed(seed)


def randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float64) * scale).to(dtype)


def to_numpy(t):
    return cupy.asnumpy(cupy.from_dlpack(t.detach().contiguous()))


def ordered(t: torch.Tensor) -> torch.Tensor:
    """The floats' bit patterns as integers ordered like the values (adjacent
    floats differ by 1), for counting ulps."""
    bits = {2: torch.int16, 4: torch.int32}[t.element_size()]
    i = t.contiguous().view(bits).to(torch.int64)
    return torch.where(i < 0, torch.iinfo(bits).min - i, i)


def assert_within_one_ulp(ours, theirs, what, max_share=0.01, ulps_allowed=1):
    """16-bit outputs: bitwise equal but for elements ``ulps_allowed`` ulps
    apart (where the two float32 rstd differ in their last bits: the sums'
    orders differ), at most ``max_share`` of them. float32 outputs carry
    that rstd difference itself: within 4 ulps."""
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, what
    assert not torch.isnan(ours).any() and not torch.isnan(theirs).any(), what
    ulps = (ordered(ours) - ordered(theirs)).abs()
    if ours.dtype == torch.float32:
        assert int(ulps.max()) <= 4, f"{what}: {int(ulps.max())} ulps apart"
        return
    assert int(ulps.max()) <= ulps_allowed, f"{what}: {int(ulps.max())} ulps apart"
    assert float((ulps > 0).double().mean()) <= max_share, f"{what}: {float((ulps > 0).double().mean()):.3%} differ"


# -- rms_norm's rounding and weight offset ------------------------------------------------------------------------


def llama_rms(x, weight, eps):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def exact_rms(x, weight, eps, offset=0.0):
    """The RMSNorms' common formula in float64."""
    h = x.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (weight.double() + offset)


# Where the last bit of the float32 rstd differs, rounding="normalized"
# rounds h * rstd one ulp apart, and the weight (up to 2 here) scales that
# ulp before the product is rounded: 2 ulps of the output at most.
NORMALIZED_ULPS = 2


def gemma_rms(x, weight, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("shape", [(7, 4096), (3, 5, 127), (2, 32768), (1, 64)])
def test_rounding_normalized_is_llamas(gen, dtype, shape):
    x = randn(gen, *shape, dtype=dtype, scale=3.0)
    w = randn(gen, shape[-1], dtype=dtype)
    ours = cunorm.rms_norm(x, w, eps=1e-6, rounding="normalized")
    assert_within_one_ulp(ours, llama_rms(x, w, 1e-6), f"rounding=normalized {dtype} {shape}",
                          ulps_allowed=NORMALIZED_ULPS)
    default = cunorm.rms_norm(x, w, eps=1e-6)
    if dtype != torch.float32:  # rounding twice is measurably not rounding once
        assert not torch.equal(default, ours)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("wdtype", [None, torch.float32], ids=["w=x", "w32"])
def test_weight_offset_is_gemmas(gen, dtype, wdtype):
    x = randn(gen, 9, 3072, dtype=dtype)
    w = randn(gen, 3072, dtype=wdtype or dtype, scale=0.1)
    ours = cunorm.rms_norm(x, w, eps=1e-6, weight_offset=1)
    assert_within_one_ulp(ours, gemma_rms(x, w, 1e-6), f"weight_offset=1 {dtype}")


@pytest.mark.parametrize("dtype", dtypes.SUPPORTED, ids=["f16", "bf16", "f32", "f64"])
@pytest.mark.parametrize("activation", ACTIVATIONS + ["identity"])
def test_row_activations_against_the_reference(rng, dtype, activation, poisoned):
    x = cupy.asarray((rng.standard_normal((6, 1000)) * 2).astype(dtype))
    w, b = (cupy.asarray(rng.standard_normal(1000).astype(dtype)) for _ in range(2))
    xs = cupy.asnumpy(x)
    for y, ref in ((cunorm.rms_norm(x, w, activation=activation),
                    reference.rms_norm(xs, cupy.asnumpy(w), activation=activation, exact=True)),
                   (cunorm.layer_norm(x, w, b, activation=activation),
                    reference.layer_norm(xs, cupy.asnumpy(w), cupy.asnumpy(b), activation=activation, exact=True)),
                   (cunorm.rms_norm(x.T, activation=activation, axis=0),  # the strided family
                    reference.rms_norm(xs.T, activation=activation, axis=0, exact=True))):
        tol = RTOL[np.dtype(dtype)]
        assert_close(cupy.asnumpy(y), ref, dtype, rtol=tol, atol=tol * output_scale(ref), what=activation)
    assert cupy.array_equal(x, cupy.asarray(xs)), "x was written"


@pytest.mark.parametrize("dtype", [dtypes.bfloat16, dtypes.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("last", [False, True], ids=["nchw", "nhwc"])
def test_channel_activations_against_the_reference(rng, dtype, activation, last, poisoned):
    shape = (3, 12, 5, 7)
    xs = (rng.standard_normal(shape) * 2 + 0.5).astype(dtype)
    x = cupy.asarray(np.moveaxis(xs, 1, -1)) if last else cupy.asarray(xs)
    axis = -1 if last else 1
    w, b = (rng.standard_normal(12).astype(dtype) for _ in range(2))
    rm, rv = rng.standard_normal(12).astype(np.float32), rng.random(12).astype(np.float32) + 0.5
    xn = cupy.asnumpy(x)
    cases = [(cunorm.group_norm(x, 4, cupy.asarray(w), cupy.asarray(b), channel_axis=axis, activation=activation),
              reference.group_norm(xn, 4, w, b, channel_axis=axis, activation=activation, exact=True)),
             (cunorm.group_norm(x, 3, channel_axis=axis, activation=activation),  # no parameters
              reference.group_norm(xn, 3, channel_axis=axis, activation=activation, exact=True)),
             (cunorm.instance_norm(x, channel_axis=axis, activation=activation),
              reference.instance_norm(xn, channel_axis=axis, activation=activation, exact=True)),
             (cunorm.batch_norm(x, cupy.asarray(w), cupy.asarray(b), channel_axis=axis, activation=activation),
              reference.batch_norm(xn, w, b, channel_axis=axis, activation=activation, exact=True)),
             (cunorm.batch_norm(x, cupy.asarray(w), None, running_mean=cupy.asarray(rm),
                                running_var=cupy.asarray(rv), training=False, channel_axis=axis,
                                activation=activation),
              reference.batch_norm(xn, w, None, running_mean=rm, running_var=rv, training=False, channel_axis=axis,
                                   activation=activation, exact=True))]
    for i, (y, ref) in enumerate(cases):
        tol = RTOL[np.dtype(dtype)]
        assert_close(cupy.asnumpy(y), ref, dtype, rtol=tol, atol=tol * output_scale(ref), what=f"{activation} {i}")


def test_activation_keeps_nan_groups(poisoned):
    x = cupy.ones((4, 64), dtype=cupy.float32)
    x[1, 3] = cupy.nan
    for activation in ACTIVATIONS:
        y = cupy.asnumpy(cunorm.layer_norm(x + cupy.arange(64, dtype=cupy.float32), activation=activation))
        assert np.isnan(y[1]).all() and not np.isnan(np.delete(y, 1, axis=0)).any(), activation


def test_epilogue_options_are_checked_before_launch():
    x = cupy.ones((2, 8), dtype=cupy.float32)
    with pytest.raises(ValueError, match="activation"):
        cunorm.group_norm(x.reshape(2, 8, 1), 2, activation="tanh")
    with pytest.raises(ValueError, match="needs a weight"):
        cunorm.rms_norm(x, weight_offset=1)
    with pytest.raises(TypeError, match="rounding"):
        cunorm.rms_norm(x, rounding=None)


# -- the torch functions under autograd ----------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_gradients_are_torchs(gen, activation):
    x = randn(gen, 4, 6, 9, 11, scale=2.0).requires_grad_()
    w, b = randn(gen, 6).requires_grad_(), randn(gen, 6).requires_grad_()
    dy = randn(gen, 4, 6, 9, 11)
    ours = cunorm_torch.group_norm(x, 3, w, b, activation=activation)
    theirs = TORCH_ACT[activation](F.group_norm(x, 3, w, b))
    torch.testing.assert_close(ours, theirs, rtol=2e-5, atol=2e-5)
    g_ours = torch.autograd.grad(ours, (x, w, b), dy)
    g_theirs = torch.autograd.grad(theirs, (x, w, b), dy)
    for a, t in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, t, rtol=1e-4, atol=1e-4)


def test_operators_refuse_a_backward_through_unfused_options(gen):
    """The registered operators with an activation or weight offset in their
    epilogue argument do not differentiate them: a backward raises (the
    functions run them as torch ops instead)."""
    x = randn(gen, 4, 8, 5, 3).requires_grad_()
    w = randn(gen, 3)
    silu = plans.activation_flags("silu")
    for y in (torch.ops.cunorm.rms_norm(x, w, None, [-1], 1e-5, True, silu)[0],
              torch.ops.cunorm.rms_norm(x, w, None, [-1], 1e-5, True, 4)[0],
              torch.ops.cunorm.group_norm(x, 2, None, None, 1e-5, 1, True, silu)[0]):
        with pytest.raises(RuntimeError, match="does not differentiate"):
            y.sum().backward()
    y = torch.ops.cunorm.rms_norm(x, w, None, [-1], 1e-5, True, 8)[0]  # the rounding point: differentiated
    y.sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_gemma_and_llama_gradients(gen, dtype):
    x = randn(gen, 5, 256, dtype=dtype).requires_grad_()
    w = randn(gen, 256, dtype=dtype, scale=0.5).requires_grad_()
    dy = randn(gen, 5, 256, dtype=dtype)
    for kw, formula, offset in (({"weight_offset": 1}, gemma_rms, 1.0), ({"rounding": "normalized"}, llama_rms, 0.0)):
        ours = cunorm_torch.rms_norm(x, w, eps=1e-6, **kw)
        theirs = formula(x, w, 1e-6)
        assert_within_one_ulp(ours.detach(), theirs.detach(), f"{kw} forward", ulps_allowed=NORMALIZED_ULPS)
        # the float64 gradients of float64 leaves (of x and w themselves they
        # would be rounded to x's dtype on the way back)
        xe, we = (t.detach().double().requires_grad_() for t in (x, w))
        exact = exact_rms(xe, we, 1e-6, offset)
        for a, t, e in zip(torch.autograd.grad(ours, (x, w), dy), torch.autograd.grad(theirs, (x, w), dy),
                           torch.autograd.grad(exact, (xe, we), dy.double())):
            err_ours, err_theirs = (a.double() - e).norm(), (t.double() - e).norm()
            assert a.dtype == t.dtype and err_ours <= 2 * err_theirs + 1e-6 * e.norm(), (kw, err_ours, err_theirs)


# -- timm ----------------------------------------------------------------------------------------------------------


def _timm():
    try:
        import timm.layers
    except ImportError:
        pytest.skip("timm is not installed")
    return timm


def _timm_layers(timm, channels):
    L = timm.layers
    return {
        "LayerNorm": (L.LayerNorm(channels), (3, 17, channels)),
        "LayerNorm2d": (L.LayerNorm2d(channels), (2, channels, 9, 7)),
        "RmsNorm": (L.RmsNorm(channels), (3, 17, channels)),
        "RmsNorm2d": (L.RmsNorm2d(channels), (2, channels, 9, 7)),
        "GroupNorm": (L.GroupNorm(channels, 4), (2, channels, 9, 7)),  # (timm's order: channels, groups)
        "GroupNorm1": (L.GroupNorm1(channels), (2, channels, 9, 7)),
        "GroupNormAct": (L.GroupNormAct(channels, 4, act_layer="silu"), (2, channels, 9, 7)),
        "BatchNormAct2d": (L.BatchNormAct2d(channels, act_layer="relu"), (4, channels, 9, 7)),
        "BatchNormAct2d gelu": (L.BatchNormAct2d(channels, act_layer="gelu"), (4, channels, 9, 7)),
        "LayerNormAct": (L.LayerNormAct(channels, act_layer="gelu_tanh"), (3, 17, channels)),
        "LayerNormAct2d": (L.LayerNormAct2d(channels, act_layer="relu"), (2, channels, 9, 7)),
        "LayerNorm2dFp32": (L.LayerNorm2dFp32(channels), (2, channels, 9, 7)),
    }


def _randomize(module, gen):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(randn(gen, *p.shape, scale=0.5) + 1.0)
        for name in ("running_mean", "running_var"):
            buf = getattr(module, name, None)
            if buf is not None:
                buf.copy_(randn(gen, *buf.shape).abs() + 0.5)


@pytest.mark.parametrize("name", ["LayerNorm", "LayerNorm2d", "RmsNorm", "RmsNorm2d", "GroupNorm", "GroupNorm1",
                                  "GroupNormAct", "BatchNormAct2d", "BatchNormAct2d gelu", "LayerNormAct",
                                  "LayerNormAct2d", "LayerNorm2dFp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_timm_layers(gen, name, dtype, training):
    timm = _timm()
    layer, shape = _timm_layers(timm, 24)[name]
    assert layer.weight.shape == (24,)
    layer = layer.cuda().to(dtype)
    _randomize(layer, gen)
    layer.train(training)
    original = copy.deepcopy(layer)
    report = cunorm_torch.replace_norms(layer, report=True)
    assert report.replaced and not report.left, str(report)
    x = randn(gen, *shape, dtype=dtype, scale=2.0)
    if len(shape) == 4 and "Batch" not in name:
        x = x.to(memory_format=torch.channels_last)
    exact = copy.deepcopy(original).double()
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_(), x.double().requires_grad_()]
    outs = [m(xi) for m, xi in zip((layer, original, exact), xs)]
    dy = randn(gen, *shape, dtype=dtype)
    tol = RTOL[np.dtype(dtypes.bfloat16 if dtype == torch.bfloat16 else np.float32)]
    ref = to_numpy(outs[2])
    assert_close(to_numpy(outs[0].float()), ref, np.float64, rtol=2 * tol, atol=2 * tol * output_scale(ref),
                 what=f"{name} forward")
    if training:
        grads = [torch.autograd.grad(o, [xi, *m.parameters()], dy.to(o.dtype))
                 for o, xi, m in zip(outs, xs, (layer, original, exact))]
        for g_ours, g_theirs, g_exact in zip(*grads):
            err_ours = (g_ours.double() - g_exact).norm()
            err_theirs = (g_theirs.double() - g_exact).norm()
            assert err_ours <= 2 * err_theirs + 1e-5 * g_exact.norm(), (name, float(err_ours), float(err_theirs))
        for a, b in zip(layer.buffers(), original.buffers()):  # running statistics, num_batches_tracked
            torch.testing.assert_close(a.double(), b.double(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("name", ["LayerNorm", "LayerNorm2d", "LayerNormAct2d", "RmsNorm", "RmsNorm2d", "GroupNormAct",
                                  "BatchNormAct2d"])
def test_timm_layers_memo(gen, name):
    """In inference a replaced timm layer's later calls of a signature run
    the launcher its first call kept (_torch_layers.memoized); the 2d
    layers keep theirs for the NHWC view they normalize, apart from an
    NCHW x of the same shape and strides (RmsNorm2d: (2,8,8,8) channels-last
    has the NCHW one's view). Results as the original's, call after call,
    the layouts alternated."""
    timm = _timm()
    layer, shape = _timm_layers(timm, 8)[name]
    shape = (2, 8, 8, 8) if len(shape) == 4 else shape
    layer = layer.cuda()
    _randomize(layer, gen)
    layer.eval()
    original = copy.deepcopy(layer)
    cunorm_torch.replace_norms(layer)
    with torch.no_grad():
        for i in range(6):
            x = randn(gen, *shape, scale=2.0)
            if len(shape) == 4 and i % 2:
                x = x.to(memory_format=torch.channels_last)
            torch.testing.assert_close(layer(x), original(x), rtol=2e-5, atol=2e-5, msg=f"call {i}")
    assert layer.__dict__.get("_cunorm_memo"), "nothing memoized"


LAYOUT_CASES = [(name, layout) for name in ("LayerNorm2d", "LayerNormAct2d", "RmsNorm2d", "GroupNorm", "LayerNorm")
                for layout in ("nchw", "channels_last", "permuted")
                if not (name == "RmsNorm2d" and layout == "permuted")]  # (kept dense: the NCHW result differs)


@pytest.mark.parametrize("name,layout", LAYOUT_CASES)
def test_timm_layers_keep_the_originals_memory_layout(gen, name, layout):
    """The result is laid out in memory as the original's (LayerNorm2d's
    channels-last from an NCHW input, as timm's permute gives; RmsNorm2d's
    as x), which the convolutions after it are fastest on; a permuted view
    into a row norm (ConvNeXt's blocks) is normalized as the original
    normalizes it. (RmsNorm2d on an array dense in neither layout returns
    NCHW where timm's elementwise formula keeps x's order.)"""
    timm = _timm()
    layer, shape = _timm_layers(timm, 24)[name]
    layer = layer.cuda()
    _randomize(layer, gen)
    original = copy.deepcopy(layer)
    cunorm_torch.replace_norms(layer)
    x = randn(gen, 2, 24, 9, 7)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    elif layout == "permuted":
        x = x.transpose(2, 3).contiguous().transpose(2, 3)  # dense in neither layout
    if name == "LayerNorm":  # over the channels of the 4-D tensor seen as NHWC (ConvNeXt's blocks)
        x = x.permute(0, 2, 3, 1)
    with torch.no_grad():
        got, want = layer(x), original(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if name == "GroupNorm" and layout == "channels_last":
        # torch's group_norm returns NCHW; cunorm's keeps a channels-last x
        # channels-last (no copy; the layout the convolutions around it use)
        assert got.is_contiguous(memory_format=torch.channels_last) and want.is_contiguous()
    else:
        assert got.stride() == want.stride(), (got.stride(), want.stride())


# -- transformers ---------------------------------------------------------------------------------------------------


def _hf_norm(family, name, hidden, eps=1e-6):
    try:
        import importlib

        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError:
        pytest.skip("transformers is not installed")
    return getattr(module, name)(hidden, eps=eps)


HF_NORMS = [("llama", "LlamaRMSNorm"), ("qwen2", "Qwen2RMSNorm"), ("qwen3", "Qwen3RMSNorm"),
            ("mistral", "MistralRMSNorm"), ("phi3", "Phi3RMSNorm"), ("gemma", "GemmaRMSNorm"),
            ("gemma3", "Gemma3RMSNorm"), ("olmo2", "Olmo2RMSNorm"), ("t5", "T5LayerNorm"),
            ("deepseek_v3", "DeepseekV3RMSNorm")]


@pytest.mark.parametrize("family,name", HF_NORMS, ids=[n for _, n in HF_NORMS])
@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("shape", [(2, 33, 1024), (2, 7, 16, 128)], ids=["hidden", "per-head"])
def test_transformers_rms_norms(gen, family, name, dtype, shape):
    layer = _hf_norm(family, name, shape[-1]).cuda().to(dtype)
    with torch.no_grad():
        layer.weight.copy_(randn(gen, shape[-1], scale=0.3) + (0.0 if "Gemma" in name else 1.0))
    original = copy.deepcopy(layer)
    assert cunorm_torch.replace_norms(layer, report=True).replaced == {"": f"{type(original).__module__}.{name}"}
    x = randn(gen, *shape, dtype=dtype, scale=4.0)
    with torch.no_grad():
        assert_within_one_ulp(layer(x), original(x), f"{name} {dtype}",
                              ulps_allowed=1 if "Gemma" in name or "Olmo" in name else NORMALIZED_ULPS)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    dy = randn(gen, *shape, dtype=dtype)
    we = original.weight.detach().double().requires_grad_()
    xe = x.double().requires_grad_()
    offset = 1.0 if "Gemma" in name else 0.0
    g = [torch.autograd.grad(m(xi), (xi, m.weight), dy.to(xi.dtype)) for m, xi in ((layer, xs[0]), (original, xs[1]))]
    g.append(torch.autograd.grad(exact_rms(xe, we, 1e-6, offset), (xe, we), dy.double()))
    for a, t, e in zip(*g):
        err_ours, err_theirs = (a.double() - e).norm(), (t.double() - e).norm()
        assert a.dtype == t.dtype and err_ours <= 2 * err_theirs + 1e-6 * e.norm(), (name, err_ours, err_theirs)


def test_transformers_mixed_dtypes_fall_back_to_the_original(gen):
    layer = _hf_norm("llama", "LlamaRMSNorm", 256).cuda()  # float32 weight
    original = copy.deepcopy(layer)
    cunorm_torch.replace_norms(layer)
    x = randn(gen, 3, 256, dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.float32 and torch.equal(y, original(x))


# -- whole models -----------------------------------------------------------------------------------------------------


def _model_error(model, make_input, gen, dtype):
    """max |model(x) - float64 copy(x)| / max |float64 copy(x)| for the model
    untouched and after replace_norms."""
    exact = copy.deepcopy(model).double()
    x = make_input(gen)
    with torch.no_grad():
        ref = exact(x if x.dtype == torch.long else x.double())
        before = model(x if x.dtype == torch.long else x.to(dtype))
        report = cunorm_torch.replace_norms(model, report=True)
        after = model(x if x.dtype == torch.long else x.to(dtype))
    scale = ref.abs().max()
    return float((before.double() - ref).abs().max() / scale), float((after.double() - ref).abs().max() / scale), report


def _logits(out):
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("name", ["resnetv2_50x1_bit", "convnext_atto", "efficientnet_b0"])
def test_timm_models_end_to_end(gen, name):
    timm = _timm()
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen, device="cuda")))
    model = timm.create_model(name, pretrained=False, num_classes=10).cuda().eval()
    for m in model.modules():
        if "Norm" in type(m).__name__:
            _randomize(m, gen)
    err_before, err_after, report = _model_error(model, lambda g: randn(g, 2, 3, 96, 96), gen, torch.float32)
    assert report.replaced and not report.left, str(report)
    assert err_after <= 2 * err_before + 1e-6, (name, err_before, err_after)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "t5"])
def test_transformers_models_end_to_end(gen, family):
    try:
        import transformers
    except ImportError:
        pytest.skip("transformers is not installed")
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen, device="cuda")))
    small = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, head_dim=32)
    if family == "t5":
        model = transformers.T5EncoderModel(transformers.T5Config(d_model=128, d_ff=256, num_layers=2, num_heads=4,
                                                                  d_kv=32, vocab_size=256))
    else:
        config = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config,
                  "gemma2": transformers.Gemma2Config}[family](**small)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = model.cuda().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(randn(gen, *p.shape, scale=0.3) + 1.0)

    class Logits(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids):
            return _logits(self.inner(input_ids=ids))

    err_before, err_after, report = _model_error(
        Logits(model), lambda g: torch.randint(0, 256, (2, 19), generator=g, device="cuda"), gen, torch.float32)
    assert report.replaced and not report.left, str(report)
    assert err_after <= 2 * err_before + 1e-6, (family, err_before, err_after)


AUTOCAST_LAYERS = ["LayerNorm", "GroupNorm", "BatchNorm2d", "RMSNorm", "timm LayerNorm2d", "timm GroupNormAct",
                   "timm LayerNormAct", "timm RmsNorm"]


def _autocast_layer(name):
    if name.startswith("timm "):
        return _timm_layers(_timm(), 24)[name[5:]]
    return {"LayerNorm": (torch.nn.LayerNorm(24), (3, 17, 24)),
            "GroupNorm": (torch.nn.GroupNorm(4, 24), (2, 24, 9, 7)),
            "BatchNorm2d": (torch.nn.BatchNorm2d(24), (4, 24, 9, 7)),
            "RMSNorm": (torch.nn.RMSNorm(24), (3, 17, 24))}[name]


@pytest.mark.parametrize("name", AUTOCAST_LAYERS)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_layers_under_autocast_return_what_torchs_return(gen, name, training):
    """Under bf16 autocast torch runs layer_norm and group_norm in float32
    (a 16-bit input comes out float32), BatchNorm and RMSNorm in the input's
    dtype: the replaced layers give the same dtypes, values within 2x the
    original's error against float64, and x's gradient in x's dtype."""
    layer, shape = _autocast_layer(name)
    layer = layer.cuda().train(training)
    _randomize(layer, gen)
    ours = cunorm_torch.replace_norms(copy.deepcopy(layer))
    x = randn(gen, *shape, dtype=torch.bfloat16, scale=2.0)
    xs = [x.clone().requires_grad_(training) for _ in range(2)]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got, want = ours(xs[0]), layer(xs[1])
    assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
    exact = copy.deepcopy(layer).double().train(training)
    ref = exact(x.double()).detach()
    err_ours, err_theirs = (got.double() - ref).norm(), (want.double() - ref).norm()
    assert err_ours <= 2 * err_theirs + 1e-6 * ref.norm(), (name, float(err_ours), float(err_theirs))
    if training:
        dy = randn(gen, *shape, dtype=got.dtype)
        (gx,), (gx_theirs,) = torch.autograd.grad(got, [xs[0]], dy), torch.autograd.grad(want, [xs[1]], dy)
        assert gx.dtype == gx_theirs.dtype == torch.bfloat16
