"""torch: tensors in and out zero-copy, torch's stream, torch's allocator
(CUDA graph capture), the registered operators under torch.compile, the
nn.Module layers and replace_norms, and the errors (skipped without a GPU)."""
import copy
import math

import numpy as np
import pytest

import cunorm
from cunorm import reference
from helpers import OP_CALLS, RTOL, assert_close, op_shapes, output_scale

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")
from cunorm import torch as cunorm_torch  # noqa: E402
from cunorm._interop import torch as torch_adapter  # noqa: E402
from cunorm.torch._layers import TORCH_LAYERS, default_rms_eps  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
DTYPE_IDS = ["f16", "bf16", "f32", "f64"]


@pytest.fixture(autouse=True)
def cunorm_at_every_size(monkeypatch):
    """The layers under eager autograd run torch's op below
    EAGER_AUTOGRAD_MIN_ELEMENTS; these tests check cunorm's, at small sizes."""
    from cunorm.torch import _layers as _torch_layers

    monkeypatch.setattr(_torch_layers, "EAGER_AUTOGRAD_MIN_ELEMENTS", 0)


def to_numpy(t):
    """A tensor's values as NumPy (bfloat16 as ml_dtypes.bfloat16), through CuPy."""
    return cupy.asnumpy(cupy.from_dlpack(t.detach().contiguous()))


def check(y, ref, dtype_np, what=""):
    tol = RTOL[np.dtype(dtype_np)]
    assert_close(to_numpy(y), ref, dtype_np, rtol=tol, atol=tol * output_scale(ref), what=what)


@pytest.fixture
def gen():
    """A torch generator on the GPU with a fresh seed (printed on failure)."""
    seed = int.from_bytes(np.random.bytes(4), "little")
    print(f"torch seed {seed}")
    return torch.Generator(device="cuda").manual_seed(seed)


def randn(gen, *shape, dtype=torch.float32, scale=1.0, offset=0.0):
    return (torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float64) * scale + offset).to(dtype)


@pytest.fixture
def poisoned_torch(monkeypatch):
    """Every allocation cunorm makes through torch during the test starts as
    all-ones bytes (NaN in every float dtype)."""
    allocate = torch_adapter._allocate

    def poisoned(nbytes, device):
        memory = allocate(nbytes, device)
        memory.memset_async(0xFF, nbytes)
        return memory

    monkeypatch.setattr(torch_adapter, "_allocate", poisoned)


# -- every op, every dtype, zero-copy -----------------------------------------------------------------------------

@pytest.mark.parametrize("module", ["cunorm", "cunorm.torch"])
@pytest.mark.parametrize("name", list(OP_CALLS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_every_op(gen, poisoned_torch, module, name, dtype):
    op = cunorm if module == "cunorm" else cunorm_torch
    call, ref, _ = OP_CALLS[name]
    shape, params = op_shapes(name)
    x = randn(gen, *shape, dtype=dtype)
    w, b = randn(gen, *params, dtype=dtype), randn(gen, *params, dtype=dtype)
    before = x.clone()
    cupy_before = cupy.get_default_memory_pool().used_bytes()
    y = call(op, x, w, b)
    assert isinstance(y, torch.Tensor) and y.dtype == dtype and y.shape == x.shape and y.device == x.device
    assert y.data_ptr() != x.data_ptr()
    # the output is torch's memory: CuPy's pool gave nothing out
    assert cupy.get_default_memory_pool().used_bytes() == cupy_before
    assert torch.equal(x, before), "x was written to"
    check(y, ref(to_numpy(x), to_numpy(w), to_numpy(b)), to_numpy(x).dtype, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_zero_copy_in_and_out(gen, monkeypatch, dtype):
    x = randn(gen, 64, 4096, dtype=dtype)[:, 7:]  # a view with an offset and row stride
    view = torch_adapter.to_cupy(x)
    assert view.data.ptr == x.data_ptr() and view.strides == tuple(s * x.element_size() for s in x.stride())
    seen = []
    allocate = torch_adapter._allocate

    def recording(nbytes, device):
        memory = allocate(nbytes, device)
        seen.append(memory.ptr)
        return memory

    monkeypatch.setattr(torch_adapter, "_allocate", recording)
    y, rstd = cunorm.rms_norm(x, return_stats=True)
    # y and rstd are the very buffers the kernel wrote, not copies
    assert y.data_ptr() in seen and rstd.data_ptr() in seen
    assert y._base is None and y.is_contiguous() and rstd.dtype == (torch.float64 if dtype == torch.float64
                                                                    else torch.float32)
    check(y, reference.rms_norm(to_numpy(x), exact=True), to_numpy(x).dtype)


def test_out_is_written_in_place(gen):
    x = randn(gen, 8, 1000)
    out = torch.full_like(x, float("nan"))
    ptr = out.data_ptr()
    r = cunorm.rms_norm(x, out=out)
    assert r is out and out.data_ptr() == ptr
    check(out, reference.rms_norm(to_numpy(x), exact=True), np.float32)


def test_channels_last_stays_channels_last(gen):
    x = randn(gen, 2, 16, 9, 11).to(memory_format=torch.channels_last)
    y = cunorm.group_norm(x, 4)
    assert y.is_contiguous(memory_format=torch.channels_last)
    check(y, reference.group_norm(to_numpy(x), 4, exact=True), np.float32)


def test_empty_tensors():
    x = torch.empty(0, 64, device="cuda", dtype=torch.bfloat16)
    y, rstd = cunorm.rms_norm(x, return_stats=True)
    assert y.shape == (0, 64) and y.dtype == x.dtype and y.device == x.device and rstd.shape == (0,)
    z = cunorm.group_norm(torch.empty(0, 8, 3, 3, device="cuda").to(memory_format=torch.channels_last), 2)
    assert z.shape == (0, 8, 3, 3)


def test_non_contiguous(gen):
    x = randn(gen, 4096, 64).t()  # (64, 4096), strides (1, 64)
    y = cunorm.rms_norm(x)
    check(y, reference.rms_norm(to_numpy(x), exact=True), np.float32)


# -- streams --------------------------------------------------------------------------------------------------------

def test_runs_on_torchs_current_stream(gen):
    """x is produced on a side stream behind ~100 ms of sleep; cunorm called
    under torch.cuda.stream(side) must return at once (no synchronize) and
    still read the produced x (it runs on side, after the producer)."""
    source = randn(gen, 256, 4096)
    x = torch.full_like(source, float("nan"))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # compile and load the kernels first: that takes host time
        cunorm.rms_norm(x)
        cunorm.group_norm(x.view(256, 64, 64), 8)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~100 ms of GPU clock cycles
        x.copy_(source)
        y = cunorm.rms_norm(x)
        h = cunorm.group_norm(x.view(256, 64, 64), 8)
        assert not side.query(), "cunorm waited for the stream (a synchronize)"
        consumed = y * 2
    side.synchronize()
    check(consumed / 2, reference.rms_norm(to_numpy(source), exact=True), np.float32)
    check(h, reference.group_norm(to_numpy(source).reshape(256, 64, 64), 8, exact=True), np.float32)


# -- CUDA graphs ----------------------------------------------------------------------------------------------------

GRAPH_CASES = {
    "rows cached": lambda x, w, b: cunorm.rms_norm(x.view(-1, 4096), w[:4096]),
    "rows + residual": lambda x, w, b: cunorm.layer_norm(x.view(-1, 4096), w[:4096], b[:4096],
                                                         residual=x.view(-1, 4096).flip(0))[0],
    "rows uncached": lambda x, w, b: cunorm.normalize(x.view(160, -1)),
    "split (workspace)": lambda x, w, b: cunorm.rms_norm(x.view(2, -1)),
    "whole array (workspace)": lambda x, w, b: cunorm.frobenius_normalize(x),
    "strided axis": lambda x, w, b: cunorm.rms_norm(x.view(8, 64, -1), axis=1),
    "group_norm (workspace)": lambda x, w, b: cunorm.group_norm(x.view(8, 64, -1), 8, w[:64], b[:64]),
    "float64 weight cast": lambda x, w, b: cunorm.rms_norm(x.view(-1, 4096), w[:4096].double()),
}
GRAPH_REFS = {
    "rows cached": lambda x, w, b: reference.rms_norm(x.reshape(-1, 4096), w[:4096], exact=True),
    "rows + residual": lambda x, w, b: reference.layer_norm(x.reshape(-1, 4096), w[:4096], b[:4096],
                                                            residual=x.reshape(-1, 4096)[::-1], exact=True)[0],
    "rows uncached": lambda x, w, b: reference.normalize(x.reshape(160, -1), exact=True),
    "split (workspace)": lambda x, w, b: reference.rms_norm(x.reshape(2, -1), exact=True),
    "whole array (workspace)": lambda x, w, b: reference.frobenius_normalize(x, exact=True),
    "strided axis": lambda x, w, b: reference.rms_norm(x.reshape(8, 64, -1), axis=1, exact=True),
    "group_norm (workspace)": lambda x, w, b: reference.group_norm(x.reshape(8, 64, -1), 8, w[:64], b[:64],
                                                                   exact=True),
    "float64 weight cast": lambda x, w, b: reference.rms_norm(x.reshape(-1, 4096), w[:4096], exact=True),
}


@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_cuda_graph_capture_and_replay(gen, case):
    """Capture a cunorm call in a torch.cuda.graph, change x in place, replay:
    the output buffer holds the norm of the new x."""
    x = randn(gen, 8, 64, 10240)  # 160 rows of 32768 for the uncached tier, 2 for the split one
    w, b = randn(gen, 4096), randn(gen, 4096)
    fn = GRAPH_CASES[case]
    side = torch.cuda.Stream()  # warm up (compile, load) off the capture, as torch advises
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(x, w, b)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fn(x, w, b)
    for _ in range(2):
        x.copy_(randn(gen, 8, 64, 10240))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(y, GRAPH_REFS[case](to_numpy(x), to_numpy(w), to_numpy(b)), np.float32, case)


def test_cuda_graph_batch_norm_running_stats(gen):
    x = randn(gen, 16, 32, 8, 8)
    bn = cunorm_torch.BatchNorm2d(32).cuda()
    ref_bn = torch.nn.BatchNorm2d(32).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with torch.no_grad():
            bn(x)
            ref_bn(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        y = bn(x)
    with torch.no_grad():
        for _ in range(3):
            x.copy_(randn(gen, 16, 32, 8, 8, offset=1.0))
            graph.replay()
            want = ref_bn(x)
            torch.cuda.synchronize()
            torch.testing.assert_close(y, want, rtol=2e-5, atol=2e-5)
            torch.testing.assert_close(bn.running_mean, ref_bn.running_mean, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(bn.running_var, ref_bn.running_var, rtol=1e-5, atol=1e-6)


# -- modules --------------------------------------------------------------------------------------------------------

MODULES = {
    "RMSNorm": lambda: torch.nn.RMSNorm((16, 24)),
    "RMSNorm eps=1e-6 no affine": lambda: torch.nn.RMSNorm(24, eps=1e-6, elementwise_affine=False),
    "LayerNorm": lambda: torch.nn.LayerNorm(24),
    "LayerNorm no bias": lambda: torch.nn.LayerNorm((16, 24), bias=False),
    "LayerNorm no affine": lambda: torch.nn.LayerNorm(24, elementwise_affine=False),
    "GroupNorm": lambda: torch.nn.GroupNorm(4, 16),
    "GroupNorm no affine": lambda: torch.nn.GroupNorm(16, 16, affine=False),
    "InstanceNorm2d": lambda: torch.nn.InstanceNorm2d(16),
    "InstanceNorm2d affine tracked": lambda: torch.nn.InstanceNorm2d(16, affine=True, track_running_stats=True),
    "BatchNorm2d": lambda: torch.nn.BatchNorm2d(16),
    "BatchNorm2d momentum=None": lambda: torch.nn.BatchNorm2d(16, momentum=None),
    "BatchNorm2d untracked": lambda: torch.nn.BatchNorm2d(16, track_running_stats=False),
}


def _module_input(gen, name, dtype=torch.float32):
    if name.startswith(("RMSNorm", "LayerNorm")):
        return randn(gen, 5, 16, 24, dtype=dtype, offset=0.5)
    return randn(gen, 4, 16, 6, 24, dtype=dtype, scale=2.0, offset=0.5)


def _randomize(module, gen):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(randn(gen, *p.shape))
        for name, buf in module.named_buffers():
            if buf.is_floating_point():
                buf.copy_(randn(gen, *buf.shape).abs() + (0.5 if "var" in name else 0.0))


@pytest.mark.parametrize("name", list(MODULES))
def test_module_matches_torch_and_shares_its_state_dict(gen, name):
    theirs = MODULES[name]().cuda()
    _randomize(theirs, gen)
    ours = cunorm_torch.replace_norms(MODULES[name]().cuda())
    assert type(ours).__name__ == type(theirs).__name__ and isinstance(ours, type(theirs))
    assert type(ours).__module__ == "cunorm.torch"
    # a checkpoint of either loads into the other, keys and all
    ours.load_state_dict(theirs.state_dict())
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert repr(ours) == repr(theirs)
    for training in (True, False, True):
        ours.train(training)
        theirs.train(training)
        x = _module_input(gen, name)
        with torch.no_grad():
            y, want = ours(x), theirs(x)
        torch.testing.assert_close(y, want, rtol=3e-5, atol=3e-5, msg=lambda m: f"{name} training={training}: {m}")
        for (key, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items()):
            torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6, msg=lambda m: f"{name} {key}: {m}")
    fresh = MODULES[name]().cuda()
    fresh.load_state_dict(ours.state_dict())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_modules_16_bit_with_float32_parameters(gen, dtype):
    """The usual mixed form: float32 parameters, 16-bit activations; within
    twice the error of torch's own output, both against float64."""
    for name in ("RMSNorm", "LayerNorm", "GroupNorm"):
        theirs = MODULES[name]().cuda()
        _randomize(theirs, gen)
        ours = cunorm_torch.replace_norms(MODULES[name]().cuda())
        ours.load_state_dict(theirs.state_dict())
        x = _module_input(gen, name, dtype)
        exact = MODULES[name]().cuda().double()
        exact.load_state_dict(theirs.state_dict())
        with torch.no_grad():
            y, want, truth = ours(x), theirs(x.float()).to(dtype), exact(x.double())
        assert y.dtype == dtype
        ours_err = (y.double() - truth).abs().max().item()
        theirs_err = (want.double() - truth).abs().max().item()
        assert ours_err <= 2 * theirs_err + 1e-6, f"{name}: {ours_err} vs torch {theirs_err}"


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.GroupNorm(8, 64), torch.nn.SiLU(),
            torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.InstanceNorm2d(64, affine=True), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10), torch.nn.LayerNorm(10))

    def forward(self, x):
        return self.body(x)


class Block(torch.nn.Module):
    """A pre-norm transformer block (RMSNorm attention, LayerNorm MLP)."""

    def __init__(self, d=256, heads=4):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.RMSNorm(d), torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


@pytest.mark.parametrize("model_name", ["convnet", "transformer block"])
def test_replace_norms_keeps_outputs_and_weights(gen, model_name):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen, device="cuda")))
    model = (ConvNet() if model_name == "convnet" else Block()).cuda()
    for m in model.modules():
        if isinstance(m, (torch.nn.BatchNorm2d, torch.nn.GroupNorm, torch.nn.LayerNorm, torch.nn.RMSNorm,
                          torch.nn.InstanceNorm2d)):
            _randomize(m, gen)
    x = randn(gen, 8, 3, 32, 32) if model_name == "convnet" else randn(gen, 4, 128, 256)
    params = {n: p for n, p in model.named_parameters()}
    model.eval()
    with torch.no_grad():
        before = model(x)
    norms_before = [type(m) for m in model.modules() if isinstance(m, tuple(TORCH_LAYERS))]
    assert cunorm_torch.replace_norms(model) is model
    swapped = [m for m in model.modules() if type(m).__module__ == "cunorm.torch"]
    assert len(swapped) == len(norms_before) > 0
    assert all(p is params[n] for n, p in model.named_parameters()), "parameters were replaced, not kept"
    with torch.no_grad():
        after = model(x)
        torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
        model.train()  # BatchNorm's batch statistics and running-buffer update
        state = {k: v.clone() for k, v in model.state_dict().items()}
        after = model(x)
        model.load_state_dict(state)
        torch_model = (ConvNet() if model_name == "convnet" else Block()).cuda().train()
        torch_model.load_state_dict(state)
        torch.testing.assert_close(after, torch_model(x), rtol=1e-4, atol=1e-4)


# -- autograd: gradients through cunorm ------------------------------------------------------------------------------

def _double(gen, *shape, requires_grad=True):
    return randn(gen, *shape, dtype=torch.float64).requires_grad_(requires_grad)


GRADCHECKS = {
    # name -> (function of the inputs, input shapes); float64, fresh data
    "rms_norm": (lambda x, w: cunorm_torch.rms_norm(x, w), [(3, 40), (40,)]),
    "rms_norm long rows": (lambda x, w: cunorm_torch.rms_norm(x, w), [(2, 9000), (9000,)]),
    "rms_norm residual": (lambda x, r, w: sum(t.sum() * (i + 1) for i, t in
                                              enumerate(cunorm_torch.rms_norm(x, w, residual=r))), [(3, 40)] * 2 + [(40,)]),
    "layer_norm": (lambda x, w, b: cunorm_torch.layer_norm(x, w, b, axis=(1, 2)), [(2, 5, 6), (5, 6), (5, 6)]),
    "layer_norm strided": (lambda x, w, b: cunorm_torch.layer_norm(x, w, b, axis=1), [(2, 6, 4, 5), (6,), (6,)]),
    "layer_norm residual": (lambda x, r, w, b: sum(t.sum() * (i + 1) for i, t in enumerate(
        cunorm_torch.layer_norm(x, w, b, residual=r))), [(3, 40)] * 2 + [(40,)] * 2),
    "normalize p=2": (lambda x: cunorm_torch.normalize(x), [(3, 40)]),
    "normalize p=3": (lambda x: cunorm_torch.normalize(x, 3.0, axis=0), [(7, 5)]),
    "normalize p=1": (lambda x: cunorm_torch.normalize(x, 1.0), [(3, 40)]),
    "normalize p=inf": (lambda x: cunorm_torch.normalize(x, math.inf), [(3, 40)]),
    "mean_abs_normalize": (lambda x: cunorm_torch.mean_abs_normalize(x), [(3, 40)]),
    "frobenius_normalize": (lambda x: cunorm_torch.frobenius_normalize(x), [(3, 4, 5)]),
    "group_norm": (lambda x, w, b: cunorm_torch.group_norm(x, 2, w, b), [(2, 6, 4, 5), (6,), (6,)]),
    "group_norm channels_last": (lambda x, w, b: cunorm_torch.group_norm(
        x.to(memory_format=torch.channels_last), 3, w, b), [(2, 6, 4, 5), (6,), (6,)]),
    "instance_norm": (lambda x, w, b: cunorm_torch.instance_norm(x, w, b), [(2, 3, 4, 5), (3,), (3,)]),
    "batch_norm": (lambda x, w, b: cunorm_torch.batch_norm(x, w, b), [(3, 4, 5, 2), (4,), (4,)]),
    "batch_norm eval": (lambda x, w, b: cunorm_torch.batch_norm(
        x, w, b, running_mean=torch.full((4,), 0.3, device="cuda", dtype=torch.float64),
        running_var=torch.full((4,), 1.7, device="cuda", dtype=torch.float64), training=False),
        [(3, 4, 5, 2), (4,), (4,)]),
}


# the long rows' Jacobians take about 20 GB: run alone with the huge tests
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.huge) if n == "rms_norm long rows" else n
                                  for n in GRADCHECKS])
def test_gradcheck_float64(gen, name):
    fn, shapes = GRADCHECKS[name]
    inputs = [_double(gen, *s) for s in shapes]
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-4)


GRAD_MODULES = ["RMSNorm", "LayerNorm", "GroupNorm", "GroupNorm channels_last", "InstanceNorm2d affine tracked",
                "BatchNorm2d"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", GRAD_MODULES)
def test_module_gradients_within_twice_torchs_error(gen, name, dtype):
    """loss.backward() through a cunorm layer: the gradients of x and of the
    parameters against a float64 torch layer, within twice the error of
    torch's own layer in the same dtype (which sees the same rounded dy)
    plus a floor: float32's, or half a unit in the last place of the
    gradient's own dtype at its largest magnitude, which rounding the exact
    value to that dtype may cost alone (a GroupNorm's six float16 dweights
    near 73: ulp 0.0625, so 0.031 of rounding, against which torch's error
    was a lucky 0.017 and ours 0.035 in one run)."""
    base = name.replace(" channels_last", "")
    theirs = MODULES[base]().cuda()
    _randomize(theirs, gen)
    ours = cunorm_torch.replace_norms(copy.deepcopy(theirs))
    exact = copy.deepcopy(theirs).double()
    x = _module_input(gen, base, torch.float64)
    if name != base:
        x = x.to(memory_format=torch.channels_last)
    dy = torch.randn(x.shape, generator=gen, device="cuda", dtype=torch.float64)

    def grads(module, xin, in_dtype):
        module = module.to(in_dtype)
        xin = xin.detach().to(in_dtype).requires_grad_()
        module.zero_grad()
        (module(xin).to(torch.float64) * dy).sum().backward()
        return [xin.grad.double()] + [p.grad.double() for p in module.parameters()]

    truth = grads(exact, x, torch.float64)
    got = grads(ours, x, dtype)
    want = grads(theirs, x, dtype)
    floor = 1e-12 if dtype == torch.float64 else max(1e-6, torch.finfo(dtype).eps / 2)
    for a, b, t, what in zip(got, want, truth, ["dx"] + [n for n, _ in ours.named_parameters()]):
        ours_err = (a - t).abs().max().item()
        theirs_err = (b - t).abs().max().item()
        assert ours_err <= 2 * theirs_err + floor * t.abs().max().item(), f"{name} {what}: {ours_err} vs {theirs_err}"


def _train(model, data, steps, lr):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for step in range(steps):
        x, target = data(step)
        loss = torch.nn.functional.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return np.array(losses)


class GNConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.GroupNorm(8, 32), torch.nn.SiLU(),
            torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.GroupNorm(4, 32), torch.nn.SiLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10))

    def forward(self, x):
        return self.body(x)


class RMSTransformer(torch.nn.Module):
    def __init__(self, d=128):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(d, 4) for _ in range(2)])
        for block in self.blocks:
            block.norm2 = torch.nn.RMSNorm(d)
        self.out = torch.nn.RMSNorm(d)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.out(x)


@pytest.mark.parametrize("model_name", ["groupnorm convnet", "rmsnorm transformer"])
def test_training_tracks_torchs_loss_curve(model_name):
    """300 SGD steps of the same model from the same weights on the same
    data, with torch's norm layers and with cunorm's: the loss curves agree
    (float32; the two differ by rounding only, which training amplifies
    slowly)."""
    torch.manual_seed(0)
    if model_name == "groupnorm convnet":
        theirs = GNConvNet().cuda()
        gen = torch.Generator(device="cuda").manual_seed(1)
        # two fixed batches with fixed targets: a task the net can fit
        batches = [(torch.randn(16, 3, 16, 16, generator=gen, device="cuda"),
                    torch.randn(16, 10, generator=gen, device="cuda")) for _ in range(2)]

        def data(step):
            return batches[step % 2]
    else:
        theirs = RMSTransformer().cuda()
        gen = torch.Generator(device="cuda").manual_seed(1)
        proj = torch.randn(128, 128, generator=gen, device="cuda") / 12

        def data(step):
            x = torch.randn(8, 32, 128, generator=gen, device="cuda")
            return x, torch.tanh(x @ proj)
    ours = cunorm_torch.replace_norms(copy.deepcopy(theirs))
    state = gen.get_state()
    theirs_losses = _train(theirs, data, 300, 0.02)
    gen.set_state(state)
    ours_losses = _train(ours, data, 300, 0.02)
    assert np.all(np.isfinite(ours_losses))
    assert ours_losses[-20:].mean() < 0.8 * ours_losses[:20].mean(), "the model did not learn"
    rel = np.abs(ours_losses - theirs_losses) / theirs_losses
    assert rel[:50].max() < 1e-3 and rel.max() < 2e-2, (rel[:50].max(), rel.max())


class FunctionalBlock(torch.nn.Module):
    """Block with its norms as cunorm.torch's functions: under torch.compile
    they stay cunorm's registered operators (replaced layers trace the
    originals' forward there)."""

    def __init__(self, d=128, heads=4):
        super().__init__()
        self.block = Block(d, heads)
        self.norm3 = torch.nn.GroupNorm(4, d)

    def forward(self, x):
        b = self.block
        h = cunorm_torch.rms_norm(x, b.norm1.weight, eps=b.norm1.eps or 1e-6)
        x = x + b.attn(h, h, h, need_weights=False)[0]
        x = x + b.mlp(cunorm_torch.layer_norm(x, b.norm2.weight, b.norm2.bias))
        g = self.norm3
        return cunorm_torch.group_norm(x.transpose(1, 2), g.num_groups, g.weight, g.bias).transpose(1, 2)


def test_torch_compile_training_step(gen):
    """A compiled training step (forward and backward) through cunorm's
    registered operators: the backward operators trace too (fullgraph), the
    graph holds cunorm's operators, and the gradients agree with eager."""
    torch._dynamo.reset()
    model = FunctionalBlock(128, 4).cuda()
    x = randn(gen, 4, 32, 128)

    def step(m, x):
        return m(x).square().mean()

    eager = copy.deepcopy(model)
    step(eager, x).backward()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._inductor.compile(gm, example_inputs)

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    compiled(model, x).backward()
    for (name, a), b in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
    targets = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    assert {"cunorm.rms_norm", "cunorm.layer_norm", "cunorm.group_norm"} <= targets, targets


def test_backward_without_statistics_names_the_fix(gen):
    x = randn(gen, 4, 64).requires_grad_()
    y = torch.ops.cunorm.rms_norm(x, None, None, [-1], 1e-5, False, 0)[0]
    with pytest.raises(RuntimeError, match="return_stats=False while autograd recorded"):
        y.sum().backward()


def test_inference_with_parameters_that_require_grad_builds_no_graph(gen):
    w = torch.nn.Parameter(randn(gen, 760))
    with torch.no_grad():
        assert not cunorm.rms_norm(randn(gen, 3, 760), w).requires_grad


def test_out_with_grad_is_refused():
    x = torch.randn(4, 64, device="cuda", requires_grad=True)
    with pytest.raises(RuntimeError, match="out= is not differentiable"):
        cunorm.rms_norm(x, out=torch.empty(4, 64, device="cuda"))


# -- torch.compile --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_name", ["convnet", "transformer block"])
def test_torch_compile_fullgraph(gen, model_name):
    """A model after replace_norms compiles with fullgraph=True (no graph
    break: its layers trace their originals' forward) and agrees with
    cunorm's eager model."""
    torch._dynamo.reset()
    model = (ConvNet() if model_name == "convnet" else Block()).cuda().eval()
    cunorm_torch.replace_norms(model)
    x = randn(gen, 8, 3, 32, 32) if model_name == "convnet" else randn(gen, 4, 128, 256)
    if model_name == "convnet":
        x = x.to(memory_format=torch.channels_last)  # the fake ops must give the real strides
        model = model.to(memory_format=torch.channels_last)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)


def test_torch_compile_channels_last_operators(gen):
    """cunorm's channel operators in a compiled function on channels-last
    input: the fake implementations give the real strides, so what follows
    them compiles against the layout the kernels write."""
    torch._dynamo.reset()
    x = randn(gen, 8, 16, 12, 10).to(memory_format=torch.channels_last)
    w, b = randn(gen, 16), randn(gen, 16)
    rm, rv = randn(gen, 16), randn(gen, 16).abs() + 0.5

    def f(x):
        g = cunorm_torch.group_norm(x, 4, w, b)
        e = cunorm_torch.batch_norm(x, w, b, running_mean=rm, running_var=rv, training=False)
        return g * 2 + e, g

    with torch.no_grad():
        (got, g_got), (want, g_want) = torch.compile(f, fullgraph=True)(x), f(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert g_got.stride() == g_want.stride() == x.stride()


def test_torch_compile_top_level_ops(gen):
    """The top-level ops called on tensors inside a compiled function become
    the registered ops: no graph break."""
    torch._dynamo.reset()

    def f(x, w):
        h = cunorm.rms_norm(x * 2, w)
        return cunorm.group_norm(h.view(4, 64, -1), 8) + 1

    x, w = randn(gen, 4, 64, 96), randn(gen, 96)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(f, fullgraph=True)(x, w), f(x, w), rtol=1e-5, atol=1e-5)


def test_opcheck():
    """torch's own checks of the registrations (schema, fake vs real, autograd registration)."""
    x = torch.randn(4, 8, 6, 5, device="cuda")
    w = torch.randn(8, device="cuda")
    samples = [
        (torch.ops.cunorm.rms_norm.default, (x, None, None, [-1], 1e-5, True, 0)),
        (torch.ops.cunorm.rms_norm.default, (x, w[:5], None, [-1], 1e-5, False, 8 | 4 | 32)),  # the epilogue's bits
        (torch.ops.cunorm.layer_norm.default, (x, None, None, x.clone(), [2, 3], 1e-5, True, 0)),
        (torch.ops.cunorm.normalize.default, (x, "l2", [], 1e-12)),
        (torch.ops.cunorm.group_norm.default, (x.to(memory_format=torch.channels_last), 4, w, w, 1e-5, 1, True, 16)),
        (torch.ops.cunorm.instance_norm.default, (x, w, None, 1e-5, 1, False, 0)),
        (torch.ops.cunorm.batch_norm.default, (x, w, w, torch.zeros(8, device="cuda"), torch.ones(8, device="cuda"),
                                               True, 0.1, 1e-5, 1, True, 0)),
    ]
    y, rstd = torch.ops.cunorm.rms_norm.default(x, w[:5], None, [-1], 1e-5, True, 0)
    samples += [
        (torch.ops.cunorm.rms_norm_backward.default, (torch.randn_like(y), x, rstd, w[:5], None, [-1])),
        (torch.ops.cunorm.row_norm_quantized.default, (x, None, None, None, [-1], 1e-5, False, 0, "rms", "int8",
                                                       None, None, None, None, False)),
    ]
    for op, args in samples:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_an_operator_without_a_formula_refuses_a_recorded_call(gen):
    """A backward operator (or the quantized one) called where autograd
    would record its outputs raises, naming the fix; under no_grad it runs."""
    x, w = randn(gen, 6, 40), randn(gen, 40)
    y, rstd = torch.ops.cunorm.rms_norm(x, w, None, [-1], 1e-5, True, 0)
    dy = torch.randn_like(y).requires_grad_()
    with pytest.raises(RuntimeError, match=r"cunorm::rms_norm_backward has no gradient.*torch.no_grad\(\)"):
        torch.ops.cunorm.rms_norm_backward(dy, x, rstd, w, None, [-1])
    with pytest.raises(RuntimeError, match="cunorm::row_norm_quantized has no gradient"):
        torch.ops.cunorm.row_norm_quantized(x.requires_grad_(), w, None, None, [-1], 1e-5, False, 0, "rms", "int8",
                                            None, None, None, None, False)
    with torch.no_grad():
        dx, dw = torch.ops.cunorm.rms_norm_backward(dy, x, rstd, w, None, [-1])
    xd, wd = x.detach().double().requires_grad_(), w.double().requires_grad_()
    want_dx, want_dw = torch.autograd.grad(torch.nn.functional.rms_norm(xd, (40,), wd, eps=1e-5), (xd, wd),
                                           dy.detach().double())
    torch.testing.assert_close(dx.double(), want_dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.double(), want_dw, rtol=1e-5, atol=1e-5)


def test_the_operators_formula_under_create_graph(gen):
    """A backward with create_graph=True through a forward operator gives the
    first-order gradients (the plain backward's, bitwise) and a second
    backward through them raises, as torch's once_differentiable (dy
    requiring grad: otherwise the gradients require none)."""
    x, w = randn(gen, 5, 72).requires_grad_(), randn(gen, 72).requires_grad_()
    dy = randn(gen, 5, 72).requires_grad_()
    y = torch.ops.cunorm.layer_norm(x, w, None, None, [-1], 1e-5, True, 0)[0]
    plain = torch.autograd.grad(y, (x, w), dy, retain_graph=True)
    first = torch.autograd.grad(y, (x, w), dy, create_graph=True)
    for a, b in zip(first, plain):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        first[0].sum().backward()


# -- errors ---------------------------------------------------------------------------------------------------------

def test_cpu_tensor_is_refused():
    with pytest.raises(TypeError, match=r"x is a torch tensor on cpu.*x\.cuda\(\)"):
        cunorm.rms_norm(torch.ones(2, 4))
    with pytest.raises(TypeError, match=r"weight is a torch tensor on cpu.*weight\.to\(x\.device\)"):
        cunorm.layer_norm(torch.ones(2, 4, device="cuda"), torch.ones(4))
    with pytest.raises(TypeError, match=r"x is a torch tensor on cpu"):
        cunorm_torch.replace_norms(torch.nn.Sequential(torch.nn.LayerNorm(4)))(torch.ones(2, 4))


def test_an_inference_tensor_is_written_only_inside_inference_mode(gen):
    """torch allows no in-place update of an inference tensor outside
    inference mode: as out= or a running buffer to update, a ValueError
    before anything is written (the functions of cunorm.torch check both
    buffers before the operator runs); inside inference mode it is updated."""
    with torch.inference_mode():
        rm, rv = torch.zeros(8, device="cuda"), torch.ones(8, device="cuda")
        out = torch.full((4, 8, 5), float("nan"), device="cuda")
    x = randn(gen, 4, 8, 5)
    calls = [lambda: cunorm.batch_norm(x, running_mean=rm, running_var=torch.ones(8, device="cuda")),
             lambda: cunorm.batch_norm(x, running_mean=torch.zeros(8, device="cuda"), running_var=rv),
             lambda: cunorm_torch.batch_norm(x, running_mean=torch.zeros(8, device="cuda"), running_var=rv),
             lambda: cunorm.rms_norm(x, out=out)]
    for call in calls:
        with pytest.raises(ValueError, match="is an inference tensor"):
            call()
    assert not rm.any() and bool((rv == 1).all()) and bool(out.isnan().all())
    with torch.inference_mode():
        cunorm.batch_norm(x, running_mean=rm, running_var=rv)
        assert cunorm.rms_norm(x, out=out) is out
    assert rm.abs().sum() > 0 and not bool(out.isnan().any())


def test_wrong_dtype_is_refused():
    with pytest.raises(TypeError, match=r"x must have dtype float16, bfloat16, float32 or float64, got torch.int32"):
        cunorm.rms_norm(torch.ones(2, 4, dtype=torch.int32, device="cuda"))
    with pytest.raises(TypeError, match=r"weight must have dtype .* got torch.complex64"):
        cunorm.rms_norm(torch.ones(2, 4, device="cuda"), torch.ones(4, dtype=torch.complex64, device="cuda"))
    with pytest.raises(TypeError, match="to_dense"):
        cunorm.rms_norm(torch.ones(2, 4, device="cuda").to_sparse())


def test_bad_arguments_to_the_torch_functions():
    x = torch.ones(2, 4, device="cuda")
    with pytest.raises(TypeError, match="return_stats must be True or False"):
        cunorm_torch.rms_norm(x, return_stats=1)
    with pytest.raises(TypeError, match="eps must be a real number"):
        cunorm_torch.layer_norm(x, eps="1e-5")
    with pytest.raises(ValueError, match="axis"):
        cunorm_torch.rms_norm(x, axis=2)
    with pytest.raises(TypeError, match="num_groups must be an int"):
        cunorm_torch.group_norm(x.view(2, 4, 1), 2.0)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        cunorm_torch.replace_norms(x)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_another_gpu(gen):
    x = randn(gen, 16, 1000).to("cuda:1")
    w = torch.randn(1000, device="cuda:1")
    assert torch.cuda.current_device() == 0
    y = cunorm.rms_norm(x, w)
    assert y.device == x.device and torch.cuda.current_device() == 0
    check(y, reference.rms_norm(to_numpy(x), to_numpy(w), exact=True), np.float32)
    with torch.cuda.stream(torch.cuda.Stream("cuda:1")):  # torch's current stream of GPU 1
        z = cunorm.group_norm(x.view(16, 8, -1), 4)
    torch.cuda.synchronize("cuda:1")
    check(z, reference.group_norm(to_numpy(x).reshape(16, 8, -1), 4, exact=True), np.float32)
    with pytest.raises(ValueError, match=r"weight is on GPU 0 but x is on GPU 1: .*weight\.to\(x\.device\)"):
        cunorm.rms_norm(x, w.to("cuda:0"))


def test_default_rms_eps_is_torchs():
    """nn.RMSNorm(eps=None) uses the epsilon of torch's compute type."""
    x = torch.full((2, 64), 1e-4, device="cuda", dtype=torch.bfloat16)
    theirs = torch.nn.RMSNorm(64).cuda()
    ours = cunorm_torch.replace_norms(torch.nn.RMSNorm(64).cuda())
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x))
    assert math.isclose(default_rms_eps(torch.bfloat16), torch.finfo(torch.float32).eps)
