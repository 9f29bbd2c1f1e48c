"""replace_norms' registry without a GPU: which classes of torch.nn, timm and
transformers map to what, what is left alone and why, and that a swap keeps
the module's parameters, buffers, state_dict and repr. The timm and
transformers classes are stood in for by classes of the same module and
name (the registry knows them by those); the real ones are checked too
where the libraries are installed. Needs torch (skipped without it)."""
import copy

import pytest

torch = pytest.importorskip("torch")
from cunorm._engine import plans  # noqa: E402
from cunorm import torch as cunorm_torch  # noqa: E402
from cunorm.torch._zoo import decide, rule_for  # noqa: E402


def stand_in(module: str, name: str, base=torch.nn.Module, forward=None):
    """A class named ``module.name`` (a stand-in for a library's class)."""
    cls = type(name, (base,), {"forward": forward or (lambda self, x: x)})
    cls.__module__, cls.__qualname__ = module, name
    return cls


class HFRMSNorm(torch.nn.Module):
    def __init__(self, n, eps=1e-6, attr="variance_epsilon"):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        setattr(self, attr, eps)


def hf_class(family: str, name: str):
    return stand_in(f"transformers.models.{family}.modeling_{family}", name, HFRMSNorm)


def timm_norm_act(name: str, base, act, drop=None):
    cls = stand_in("timm.layers.norm_act", name, base)
    return cls, act, drop


@pytest.mark.parametrize("family,name", [("llama", "LlamaRMSNorm"), ("qwen3", "Qwen3RMSNorm"),
                                         ("gemma2", "Gemma2RMSNorm"), ("olmo2", "Olmo2RMSNorm"),
                                         ("t5", "T5LayerNorm"), ("deepseek_v3", "DeepseekV3RMSNorm"),
                                         ("phi3", "Phi3RMSNorm"), ("mixtral", "MixtralRMSNorm")])
def test_transformers_rms_norms_are_replaced(family, name):
    layer = hf_class(family, name)(16)
    replacement, reason = decide(layer)
    assert reason is None and issubclass(replacement, type(layer))
    assert replacement.forward.__wrapped__ is rule_for(type(layer)).forward


def test_unknown_transformers_norm_is_left_with_a_reason():
    layer = hf_class("cohere", "CohereLayerNorm")(16)
    replacement, reason = decide(layer)
    assert replacement is None and "formula" in reason


@pytest.mark.parametrize("name,base,args", [("LayerNorm", torch.nn.LayerNorm, (8,)),
                                            ("LayerNorm2d", torch.nn.LayerNorm, (8,)),
                                            ("GroupNorm", torch.nn.GroupNorm, (2, 8)),
                                            ("GroupNorm1", torch.nn.GroupNorm, (1, 8))])
def test_timm_norms_are_replaced_unless_fast_norm(name, base, args):
    cls = stand_in("timm.layers.norm", name, base)
    layer = cls(*args)
    layer._fast_norm = False
    replacement, reason = decide(layer)
    assert reason is None and replacement.__mro__[1] is cls
    layer._fast_norm = True
    replacement, reason = decide(layer)
    assert replacement is None and "fast_norm" in reason


@pytest.mark.parametrize("act,expected", [(torch.nn.ReLU(inplace=True), "relu"), (torch.nn.SiLU(), "silu"),
                                          (torch.nn.GELU(), "gelu"), (torch.nn.GELU(approximate="tanh"), "gelu_tanh"),
                                          (torch.nn.Identity(), None)])
def test_timm_norm_act_fuses_known_activations(act, expected):
    cls = stand_in("timm.layers.norm_act", "BatchNormAct2d", torch.nn.BatchNorm2d)
    layer = cls(8)
    layer.act, layer.drop = act, torch.nn.Identity()
    model = torch.nn.Sequential(layer)
    report = cunorm_torch.replace_norms(model, report=True)
    assert report.replaced == {"0": "timm.layers.norm_act.BatchNormAct2d"} and not report.left
    assert layer._cunorm_activation == expected
    assert isinstance(layer, cls) and type(layer) is not cls


@pytest.mark.parametrize("act,drop,why", [(torch.nn.Tanh(), torch.nn.Identity(), "activation Tanh"),
                                          (torch.nn.ReLU(), torch.nn.Dropout(0.1), "drop layer Dropout"),
                                          (torch.nn.LeakyReLU(), torch.nn.Identity(), "activation LeakyReLU")])
def test_timm_norm_act_with_other_activation_or_drop_is_left(act, drop, why):
    cls = stand_in("timm.layers.norm_act", "GroupNormAct", torch.nn.GroupNorm)
    layer = cls(2, 8)
    layer.act, layer.drop, layer._fast_norm = act, drop, False
    report = cunorm_torch.replace_norms(torch.nn.Sequential(layer), report=True)
    assert not report.replaced and why in report.left["0"]
    assert type(layer) is cls


def test_torch_layers_and_their_unknown_subclasses():
    class MyLayerNorm(torch.nn.LayerNorm):
        def forward(self, x):
            return super().forward(x) * 2

    class FancyNorm(torch.nn.Module):  # a norm-like leaf of an unknown formula
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(4))

    class NormHead(torch.nn.Module):  # not a norm: a block holding parameters in children
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

    model = torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.BatchNorm3d(4), torch.nn.InstanceNorm1d(4),
                                torch.nn.InstanceNorm3d(4, affine=True), torch.nn.RMSNorm(4), MyLayerNorm(4),
                                FancyNorm(), NormHead(), torch.nn.Linear(4, 4))
    keys, text = list(model.state_dict()), repr(model)
    report = cunorm_torch.replace_norms(model, report=True)
    assert sorted(report.replaced) == ["0", "1", "2", "3", "4"]
    assert report.replaced["0"] == "torch.nn.modules.batchnorm.BatchNorm1d"
    assert "subclass of torch.nn.LayerNorm" in report.left["5"]
    assert "formula" in report.left["6"] and "7" not in report.left
    assert type(model[0]) is cunorm_torch.BatchNorm1d and type(model[3]) is cunorm_torch.InstanceNorm3d
    assert type(model[5]) is MyLayerNorm
    assert list(model.state_dict()) == keys and repr(model) == text
    again = cunorm_torch.replace_norms(model, report=True)  # idempotent: already cunorm's
    assert again.replaced == report.replaced and again.left == report.left
    assert "5 replaced, 2 left alone" in str(again)


def test_replace_norms_returns_the_model_and_checks_it():
    model = torch.nn.Sequential(torch.nn.LayerNorm(4))
    assert cunorm_torch.replace_norms(model) is model
    with pytest.raises(TypeError, match="torch.nn.Module"):
        cunorm_torch.replace_norms([model])


def test_replacement_classes_are_made_once_per_class():
    cls = hf_class("llama", "LlamaRMSNorm")
    a, b = cls(8), cls(8)
    cunorm_torch.replace_norms(torch.nn.Sequential(a, b))
    assert type(a) is type(b) and type(a)._cunorm_original is cls


# -- the epilogue's options ----------------------------------------------------------------------------------------


def test_epilogue_flags():
    assert plans.rms_epilogue_flags(0, "output", True) == 0
    assert plans.rms_epilogue_flags(1, "normalized", True) == plans.FLAG_WEIGHT_OFFSET | plans.FLAG_ROUND_NORMALIZED
    assert plans.activation_flags("silu") == 2 << plans.ACTIVATION_SHIFT
    for name in plans.ACTIVATIONS:
        assert plans.activation_name(plans.activation_flags(name) | 3) == (None if name == "identity" else name)
    with pytest.raises(ValueError, match="needs a weight"):
        plans.rms_epilogue_flags(1, "output", False)
    with pytest.raises(ValueError, match="rounding"):
        plans.rms_epilogue_flags(0, "input", True)
    with pytest.raises(TypeError, match="activation"):
        plans.activation_flags(torch.nn.ReLU())


@pytest.mark.parametrize("name", ["relu", "silu", "gelu", "gelu_tanh"])
def test_reference_activations_are_torchs(name):
    from cunorm import reference

    y = torch.linspace(-8, 8, 1001, dtype=torch.float64)
    ours = torch.from_numpy(reference.apply_activation(y.numpy(), name))
    theirs = {"relu": torch.relu, "silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
              "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}[name](y)
    torch.testing.assert_close(ours, theirs, rtol=1e-14, atol=1e-15)


def test_real_libraries_are_recognized():
    """The real classes, where timm and transformers are installed."""
    found = 0
    try:
        import timm.layers
    except ImportError:  # (not installed, or its torchvision missing)
        timm = None
    if timm is not None:
        for name in ("LayerNorm", "LayerNorm2d", "GroupNorm", "GroupNorm1", "RmsNorm", "RmsNorm2d", "GroupNormAct",
                     "BatchNormAct2d", "LayerNormAct"):
            assert rule_for(getattr(timm.layers, name)) is not None, name
            found += 1
    try:
        import transformers.models.llama.modeling_llama as llama
        import transformers.models.gemma.modeling_gemma as gemma
    except ImportError:
        llama = None
    if llama is not None:
        assert rule_for(llama.LlamaRMSNorm).forward.__name__ == "_hf_llama_rms"
        assert rule_for(gemma.GemmaRMSNorm).forward.__name__ == "_hf_gemma_rms"
        found += 2
    if not found:
        pytest.skip("neither timm nor transformers is installed")


def _layer_cases():
    """(label, original layer, input) of each torch.nn class replace_norms swaps."""
    return [("RMSNorm", torch.nn.RMSNorm(12), torch.randn(3, 5, 12)),
            ("LayerNorm", torch.nn.LayerNorm(12), torch.randn(3, 5, 12)),
            ("GroupNorm", torch.nn.GroupNorm(2, 6), torch.randn(3, 6, 5, 7)),
            ("InstanceNorm2d", torch.nn.InstanceNorm2d(6, affine=True), torch.randn(3, 6, 5, 7)),
            ("BatchNorm2d", torch.nn.BatchNorm2d(6), torch.randn(3, 6, 5, 7)),
            ("BatchNormAct2d", None, torch.randn(3, 6, 5, 7))]


def _randomized(layer):
    with torch.no_grad():
        for p in layer.parameters():
            p.uniform_(0.5, 2)
        for name, b in layer.named_buffers():
            if name == "running_var":
                b.uniform_(0.5, 2)
            elif name == "running_mean":
                b.uniform_(-1, 1)
    return layer


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("case", [c[0] for c in _layer_cases()])
def test_replaced_layers_under_torch_compile_trace_the_originals(case, training):
    """Under dynamo a replaced layer traces the forward of the class it
    replaced (inductor generates and fuses the norm): the graph holds no
    cunorm operator, and the compiled layer computes what the original
    computes (running buffers included). Runs on CPU: nothing of cunorm's
    launches."""
    label, theirs, x = next(c for c in _layer_cases() if c[0] == case)
    if theirs is None:  # timm's BatchNormAct2d, its ReLU fused by replace_norms
        timm = pytest.importorskip("timm")
        theirs = timm.layers.BatchNormAct2d(6, act_layer=torch.nn.ReLU)
    theirs = _randomized(theirs).train(training)
    ours = cunorm_torch.replace_norms(copy.deepcopy(theirs))
    assert type(ours) is not type(theirs)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    got = torch.compile(ours, backend=backend, fullgraph=True)(x)
    want = theirs(x)
    assert torch.equal(got, want)
    for (name, a), b in zip(ours.named_buffers(), theirs.buffers()):
        assert torch.equal(a, b), name
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    assert targets and not any("cunorm" in t for t in targets), targets


@pytest.mark.parametrize("case", [c[0] for c in _layer_cases() if c[1] is not None])
def test_small_inputs_under_autograd_run_the_original(case, monkeypatch):
    """Under eager autograd a replaced torch.nn layer runs torch's forward
    below EAGER_AUTOGRAD_MIN_ELEMENTS (on CPU: the same values and
    gradients, bit for bit), and cunorm's at and above it (on CPU tensors
    that is a TypeError asking for CUDA: the call reached cunorm). Without
    autograd (no_grad, or nothing requiring grad), cunorm's at any size."""
    from cunorm.torch import _layers as _torch_layers

    _, theirs, x = next(c for c in _layer_cases() if c[0] == case)
    theirs = _randomized(theirs).train()
    ours = cunorm_torch.replace_norms(copy.deepcopy(theirs))
    xs = [x.clone().requires_grad_() for _ in range(2)]
    dy = torch.randn_like(x)
    got, want = ours(xs[0]), theirs(xs[1])
    assert torch.equal(got, want)
    got.backward(dy)
    want.backward(dy)
    assert torch.equal(xs[0].grad, xs[1].grad)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a.grad, b.grad), name
    monkeypatch.setattr(_torch_layers, "EAGER_AUTOGRAD_MIN_ELEMENTS", x.numel())
    with pytest.raises(TypeError, match="cunorm runs on CUDA tensors"):
        ours(x.clone().requires_grad_())
    monkeypatch.setattr(_torch_layers, "EAGER_AUTOGRAD_MIN_ELEMENTS", x.numel() + 1)
    with torch.no_grad(), pytest.raises(TypeError, match="cunorm runs on CUDA tensors"):
        ours(x.clone().requires_grad_())
    for p in ours.parameters():
        p.requires_grad_(False)
    with pytest.raises(TypeError, match="cunorm runs on CUDA tensors"):
        ours(x)


def test_composite_originals_run_cunorm_under_autograd_at_any_size():
    """A norm whose original is several torch ops (transformers' RMSNorms,
    timm's RmsNorm) is cunorm's under eager autograd however small x is."""
    cls = hf_class("llama", "LlamaRMSNorm")
    layer = cunorm_torch.replace_norms(cls(8))
    assert type(layer)._cunorm_fused_original is False
    with pytest.raises(TypeError, match="cunorm runs on CUDA tensors"):
        layer(torch.randn(2, 8, requires_grad=True))
    assert rule_for(stand_in("timm.layers.norm", "RmsNorm")).fused_original is False
    assert rule_for(stand_in("timm.layers.norm", "LayerNorm")).fused_original is True


def test_eval_batch_norm_keeps_statistics_dtype_copies_of_16_bit_buffers():
    """A BatchNorm cast to bfloat16, in eval: its running buffers as float32
    copies, made once and kept (so the call is the launch cache's), made
    again when a buffer is written or replaced; float32 buffers as they are."""
    from cunorm.torch._layers import statistics_dtype_running

    bn = torch.nn.BatchNorm2d(5).to(torch.bfloat16).eval()
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
    x = torch.randn(2, 5, 3, 3, dtype=torch.bfloat16)
    mean, var = statistics_dtype_running(bn, x, bn.running_mean, bn.running_var)
    assert mean.dtype == var.dtype == torch.float32 and torch.equal(mean, bn.running_mean.float())
    again = statistics_dtype_running(bn, x, bn.running_mean, bn.running_var)
    assert again[0] is mean and again[1] is var
    with torch.no_grad():
        bn.running_var.fill_(3.0)
    _, var = statistics_dtype_running(bn, x, bn.running_mean, bn.running_var)
    assert torch.equal(var, torch.full((5,), 3.0))
    bn.running_mean = torch.zeros(5, dtype=torch.bfloat16)
    mean, _ = statistics_dtype_running(bn, x, bn.running_mean, bn.running_var)
    assert torch.equal(mean, torch.zeros(5))
    plain = torch.nn.BatchNorm2d(5).eval()
    got = statistics_dtype_running(plain, x, plain.running_mean, plain.running_var)
    assert got[0] is plain.running_mean and got[1] is plain.running_var
    x64 = x.double()  # float64 x: float64 statistics
    assert statistics_dtype_running(plain, x64, plain.running_mean, plain.running_var)[0].dtype == torch.float64


class _Launcher:
    """A stand-in launcher (CPU tensors): returns ``y`` and records its arguments."""

    def __init__(self, y):
        self.y, self.calls = y, []

    def __call__(self, *args):
        self.calls.append(args)
        return self.y


def _fill(layer, x, extra=None):
    """The memo of ``layer`` given one launch over x and its weight and bias."""
    from cunorm.torch import _layers as _torch_layers

    y = torch.empty_like(x)
    launch = _Launcher(y)
    inputs = (x, layer.weight, layer.bias if extra is None else extra, None)
    _torch_layers._memo_fill(layer, x, (launch, inputs, y), y)
    return launch, y


def test_layer_memo_runs_the_kept_launcher_while_nothing_changed():
    """A replaced layer's memo (_torch_layers.memoized): a call of a seen
    signature in inference runs the kept launcher over x and the module's
    tensors; it is not taken where autograd records, for another
    signature, or once a parameter is replaced, cast or moved (pointer and
    dtype checked); setting an attribute clears it; pickle and deepcopy
    leave it behind. (CPU tensors: a call that reaches cunorm's forward
    raises the TypeError asking for CUDA.)"""
    import pickle

    from cunorm.torch import _layers as _torch_layers

    layer = cunorm_torch.replace_norms(torch.nn.LayerNorm(8))
    x = torch.randn(3, 8)
    launch, y = _fill(layer, x)
    with torch.no_grad():
        assert layer(x) is y and layer(torch.randn(3, 8)) is y
    assert launch.calls[-1][1] is layer.weight and launch.calls[-1][2] is layer.bias
    assert _torch_layers.memo_run(layer, x) is None  # grad on, the parameters require it
    with torch.no_grad(), pytest.raises(TypeError, match="cunorm runs on CUDA tensors"):
        layer(torch.randn(4, 8))  # another signature
    with torch.no_grad(), pytest.raises(TypeError, match="cunorm runs on CUDA tensors"):
        layer(x.t().contiguous().t())  # other strides
    assert pickle.loads(pickle.dumps(layer)).__dict__.get("_cunorm_memo") is None
    assert copy.deepcopy(layer).__dict__.get("_cunorm_memo") is None
    assert "_cunorm_memo" in layer.__dict__
    layer.eps = 1e-3
    assert "_cunorm_memo" not in layer.__dict__
    for change in (lambda m: setattr(m.weight, "data", m.weight.data.clone()),
                   lambda m: m.to(torch.float64),
                   lambda m: m._parameters.__setitem__("bias", torch.nn.Parameter(m.bias.detach().clone()))):
        _, y = _fill(layer, x)
        with torch.no_grad():
            assert _torch_layers.memo_run(layer, x) is y
            change(layer)
            assert _torch_layers.memo_run(layer, x) is None


def test_layer_memo_keeps_only_a_launch_over_x_and_the_modules_tensors():
    """Nothing is kept where the launch ran over a copy of x or a tensor not
    the module's (a cast parameter), or returned another result than the
    forward; entries of a module's memoized functions are apart (tags); at most MEMO_SIGNATURES signatures are kept; BatchNorm in
    training with running buffers is never memoized (its counter and
    buffers move every call)."""
    from cunorm.torch import _layers as _torch_layers

    layer = cunorm_torch.replace_norms(torch.nn.LayerNorm(8))
    x = torch.randn(3, 8)
    y = torch.empty_like(x)
    for inputs, result in (((x.clone(), layer.weight, layer.bias, None), y),
                           ((x, layer.weight.double(), layer.bias, None), y),
                           ((x, layer.weight, layer.bias, None), torch.empty_like(x))):
        _torch_layers._memo_fill(layer, x, (_Launcher(result), inputs, result), y)
        assert not layer.__dict__.get("_cunorm_memo")
    launch = _Launcher(y)
    _torch_layers._memo_fill(layer, x, (launch, (x, layer.weight, layer.bias, None), y), y, tag=1)
    with torch.no_grad():  # another memoized function's entry (a view's) is not the forward's
        assert _torch_layers.memo_run(layer, x) is None and _torch_layers.memo_run(layer, x, 1) is y
    for n in range(1, _torch_layers.MEMO_SIGNATURES + 3):
        _fill(layer, torch.randn(n, 8))
        assert 0 < len(layer.__dict__["_cunorm_memo"]) <= _torch_layers.MEMO_SIGNATURES
    bn = cunorm_torch.replace_norms(torch.nn.BatchNorm2d(4))
    assert not _torch_layers.not_updating_running(bn)
    assert _torch_layers.not_updating_running(bn.eval())
    assert _torch_layers.not_updating_running(cunorm_torch.replace_norms(
        torch.nn.BatchNorm2d(4, track_running_stats=False)))


def test_registered_normalize_refuses_unknown_norm_names():
    """torch.ops.cunorm.normalize takes a norm name: anything but cunorm's
    own names is a ValueError before any other check or launch."""
    from cunorm._interop import torch as adapter

    for bad in ("lp:0x1;}", "lp:4008000000000000ull>::X", "frobenius"):
        with pytest.raises(ValueError, match="unknown norm"):
            torch.ops.cunorm.normalize(torch.randn(2, 3), bad, [-1], 1e-12)
    assert adapter._streams.maxsize == 256  # (the stream map is bounded)
