"""The launch cache on the GPU (cunorm/_engine/launch_cache.py): a repeated signature
replays its prepared launches over new pointers, with outputs poisoned,
on other streams, under CUDA-graph capture, from threads at once, under
autocast and through autograd."""
from __future__ import annotations

import copy
import threading

import numpy as np
import pytest

import cunorm
from cunorm._engine import launch_cache
from cunorm import reference
from helpers import assert_close, clear_cunorm_caches, random

pytestmark = pytest.mark.gpu


def _cached(cache, before):
    assert len(cache) > before, "the call's signature was not cached"


def test_cupy_repeat_hits_the_cache_with_new_pointers(rng, poisoned):
    import cupy

    before = len(launch_cache.ROWS)
    w = cupy.asarray(random(rng, (1000,), np.float32))
    for i in range(3):  # the first fills the cache, the others replay it
        x_np = random(rng, (37, 1000), np.float32)
        y, rstd = cunorm.rms_norm(cupy.asarray(x_np), w, return_stats=True)
        ref, ref_rstd = reference.rms_norm(x_np, cupy.asnumpy(w), return_stats=True)
        assert_close(cupy.asnumpy(y), ref, np.float32, what=f"call {i}")
        assert_close(cupy.asnumpy(rstd), ref_rstd, np.float32, what=f"rstd {i}")
    _cached(launch_cache.ROWS, before)


@pytest.mark.parametrize("op", ["group", "batch_eval", "batch_train"])
def test_cupy_channel_repeat(op, rng, poisoned):
    import cupy

    c = 16
    w, b = (cupy.asarray(random(rng, (c,), np.float32)) for _ in range(2))
    rm, rv = cupy.zeros(c, np.float32), cupy.ones(c, np.float32)
    rm_np, rv_np = cupy.asnumpy(rm), cupy.asnumpy(rv)
    before = len(launch_cache.CHANNELS)
    for i in range(3):
        x_np = random(rng, (3, c, 5, 7), np.float32)
        x = cupy.asarray(x_np)
        if op == "group":
            y = cunorm.group_norm(x, 4, w, b)
            ref = reference.group_norm(x_np, 4, cupy.asnumpy(w), cupy.asnumpy(b))
        else:
            training = op == "batch_train"
            y = cunorm.batch_norm(x, w, b, running_mean=rm, running_var=rv, training=training)
            ref = reference.batch_norm(x_np, cupy.asnumpy(w), cupy.asnumpy(b), running_mean=rm_np,
                                       running_var=rv_np, training=training)
        # y = xhat * w + b cancels to near 0 for some elements: their error is
        # that of the larger terms, a few ulps of max |y|
        assert_close(cupy.asnumpy(y), ref, np.float32, atol=1e-6 * float(np.max(np.abs(ref))),
                     what=f"{op} call {i}")
    if op == "batch_train":  # the running buffers were updated in place by every call, cached or not
        # float32 statistics of O(1) data: ~1e-7 absolute error, on means near 0
        assert_close(cupy.asnumpy(rm), rm_np, np.float32, atol=1e-6, what="running_mean")
        assert_close(cupy.asnumpy(rv), rv_np, np.float32, atol=1e-6, what="running_var")
    _cached(launch_cache.CHANNELS, before)


def test_backward_repeat(rng, poisoned):
    import cupy

    before = len(launch_cache.ROWS_GRAD)
    w_np = random(rng, (300,), np.float32)
    for i in range(3):
        x_np, dy_np = random(rng, (9, 300), np.float32), random(rng, (9, 300), np.float32)
        x, dy, w = (cupy.asarray(a) for a in (x_np, dy_np, w_np))
        _, mean, rstd = cunorm.layer_norm(x, w, return_stats=True)
        dx, dw, db = cunorm.layer_norm_backward(dy, x, mean, rstd, w)
        rdx, rdw, _ = reference.layer_norm_backward(dy_np, x_np, cupy.asnumpy(mean), cupy.asnumpy(rstd), w_np)
        assert db is None
        assert_close(cupy.asnumpy(dx), rdx, np.float32, rtol=1e-4, what=f"dx {i}")
        assert_close(cupy.asnumpy(dw), rdw, np.float32, rtol=1e-4, what=f"dw {i}")
    _cached(launch_cache.ROWS_GRAD, before)


def test_a_changed_signature_misses(rng):
    """A new stride, dtype or eps is a new entry; the old one still serves."""
    import cupy

    x = cupy.asarray(random(rng, (8, 64), np.float32))
    cunorm.rms_norm(x)
    before = len(launch_cache.ROWS)
    cunorm.rms_norm(x, eps=1e-3)
    cunorm.rms_norm(x.astype(np.float16))
    cunorm.rms_norm(cupy.asarray(random(rng, (8, 128), np.float32))[:, :64])  # rows 128 apart
    assert len(launch_cache.ROWS) >= min(before + 3, launch_cache.MAX_ENTRIES)
    assert_close(cupy.asnumpy(cunorm.rms_norm(x, eps=1e-3)), reference.rms_norm(cupy.asnumpy(x), eps=1e-3),
                 np.float32)


def _torch():
    return pytest.importorskip("torch")


def test_torch_outputs_are_written_every_call(rng):
    torch = _torch()
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    for i in range(4):
        # memory full of NaN freed just before: the next output reuses it
        torch.full((1 << 20,), float("nan"), device="cuda", dtype=torch.bfloat16)
        x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
        y = cunorm.rms_norm(x, w, eps=1e-6)
        ref = reference.rms_norm(x.float().cpu().numpy().astype(np.float64), w.float().cpu().numpy(), eps=1e-6)
        assert_close(y.float().cpu().numpy(), ref, np.dtype(cunorm._engine.dtypes.bfloat16), what=f"call {i}")


def test_torch_side_stream(rng):
    torch = _torch()
    x = torch.randn(64, 1024, device="cuda")
    w = torch.randn(1024, device="cuda")
    expected = cunorm.layer_norm(x, w)  # fills the cache on the default stream
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        y = cunorm.layer_norm(x, w)
    stream.synchronize()
    assert torch.equal(y, expected)


def test_torch_graph_capture_after_warm_up(rng):
    torch = _torch()
    x = torch.randn(5, 2048, device="cuda", dtype=torch.float16)
    w = torch.randn(2048, device="cuda", dtype=torch.float16)
    r = torch.randn_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            cunorm.rms_norm(x, w, residual=r)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, h = cunorm.rms_norm(x, w, residual=r)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    ref_y, ref_h = cunorm.rms_norm(x, w, residual=r)
    assert torch.equal(y, ref_y) and torch.equal(h, ref_h)


def test_torch_threads_share_a_signature(rng):
    torch = _torch()
    w = torch.randn(512, device="cuda")
    inputs = [torch.randn(33, 512, device="cuda") for _ in range(8)]
    expected = [cunorm.rms_norm(x, w) for x in inputs]
    torch.cuda.synchronize()
    results = [None] * len(inputs)
    errors = []

    def work(i):
        try:
            for _ in range(50):
                results[i] = cunorm.rms_norm(inputs[i], w)
            torch.cuda.current_stream().synchronize()
        except Exception as err:  # collected and re-raised in the main thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for got, want in zip(results, expected):
        assert torch.equal(got, want)


def test_torch_layers_under_autocast(rng):
    torch = _torch()
    from cunorm import torch as cunorm_torch

    for theirs in (torch.nn.RMSNorm(768, eps=1e-6, device="cuda"), torch.nn.LayerNorm(768, device="cuda")):
        with torch.no_grad():
            theirs.weight.normal_()
        x = torch.randn(4, 9, 768, device="cuda", dtype=torch.bfloat16)
        ours = cunorm_torch.replace_norms(type(theirs)(768, device="cuda"))
        ours.load_state_dict(theirs.state_dict())
        # torch runs layer_norm in float32 under autocast (its output float32), rms_norm in x's dtype
        in_float32 = isinstance(theirs, torch.nn.LayerNorm)
        plain = ours(x.float() if in_float32 else x)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            cast = ours(x)
            cast_again = ours(x)
            want_dtype = theirs(x).dtype
        assert cast.dtype == want_dtype == (torch.float32 if in_float32 else torch.bfloat16)
        assert torch.equal(cast, plain) and torch.equal(cast_again, plain)
        # inference: LayerNorm reads the bfloat16 x itself and writes float32
        # (one kernel, another thread layout than float32 x's: float32's
        # rounding apart); RMSNorm is cunorm's where ``plain`` (a small input
        # under autograd) was torch's: a float32 rstd one ulp apart may move
        # a bfloat16 output by one ulp (at most 2**-7 of it: 7 stored bits)
        before = len(launch_cache.ROWS)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            fused, fused_again = ours(x), ours(x)
        assert fused.dtype == want_dtype and torch.equal(fused, fused_again)
        tolerance = 1e-5 if in_float32 else 2.0 ** -7
        torch.testing.assert_close(fused, plain, rtol=tolerance, atol=1e-5)
        _cached(launch_cache.ROWS, before)


@pytest.mark.parametrize("channels_last", [False, True])
def test_group_norm_layer_under_autocast(channels_last):
    """GroupNorm under bf16 autocast returns float32 as torch's: in
    inference one kernel reads the bfloat16 x and writes float32 (cached),
    within float32's rounding of the layer on x.float(); under autograd x
    is cast first."""
    torch = _torch()
    from cunorm import torch as cunorm_torch

    theirs = torch.nn.GroupNorm(8, 64, device="cuda")
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.bias.normal_()
    ours = cunorm_torch.replace_norms(copy.deepcopy(theirs))
    x = torch.randn(4, 64, 9, 9, device="cuda", dtype=torch.bfloat16)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    with torch.no_grad():
        plain = ours(x.float())
        before = len(launch_cache.CHANNELS)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            fused, fused_again, want = ours(x), ours(x), theirs(x)
    assert fused.dtype == want.dtype == torch.float32 and torch.equal(fused, fused_again)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused, want, rtol=1e-4, atol=1e-4)
    _cached(launch_cache.CHANNELS, before)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        trained = ours(x)
    assert trained.dtype == torch.float32 and trained.requires_grad
    torch.testing.assert_close(trained.detach(), plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer", ["RMSNorm", "LayerNorm", "GroupNorm", "BatchNorm2d"])
def test_torch_eager_training_matches_torch(layer, rng, monkeypatch):
    """The eager autograd route (autograd.Function over the cached
    launches): gradients as torch's own layer, step after step (at every
    size: the routing to torch's op for small inputs is off)."""
    torch = _torch()
    from cunorm.torch import _layers as _torch_layers
    from cunorm import torch as cunorm_torch

    monkeypatch.setattr(_torch_layers, "EAGER_AUTOGRAD_MIN_ELEMENTS", 0)

    make = {"RMSNorm": lambda: torch.nn.RMSNorm(64, device="cuda", dtype=torch.float64),
            "LayerNorm": lambda: torch.nn.LayerNorm(64, device="cuda", dtype=torch.float64),
            "GroupNorm": lambda: torch.nn.GroupNorm(4, 64, device="cuda", dtype=torch.float64),
            "BatchNorm2d": lambda: torch.nn.BatchNorm2d(64, device="cuda", dtype=torch.float64)}[layer]
    theirs = make()
    ours = cunorm_torch.replace_norms(make())
    ours.load_state_dict(theirs.state_dict())
    shape = (6, 64) if layer in ("RMSNorm", "LayerNorm") else (3, 64, 5, 4)
    for step in range(3):
        x = torch.randn(shape, device="cuda", dtype=torch.float64)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        dy = torch.randn(shape, device="cuda", dtype=torch.float64)
        theirs(xa).backward(dy)
        ours(xb).backward(dy)
        torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-9, atol=1e-9)
        for p_ours, p_theirs in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(p_ours.grad, p_theirs.grad, rtol=1e-9, atol=1e-9)
    for b_ours, b_theirs in zip(ours.buffers(), theirs.buffers()):
        torch.testing.assert_close(b_ours, b_theirs, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("layer", ["BatchNorm2d", "InstanceNorm2d"])
def test_bf16_model_eval_batch_norm_is_cached(layer):
    """A BatchNorm2d (or an InstanceNorm2d tracking running statistics) cast
    to bfloat16 (bfloat16 running buffers), in eval: the layer passes
    float32 copies of its buffers it keeps, so the call is cached; outputs
    as torch's layer within bf16's rounding, call after call."""
    torch = _torch()
    from cunorm import torch as cunorm_torch

    launch_cache.clear()  # (the two layers' calls share a signature)
    if layer == "BatchNorm2d":
        theirs = torch.nn.BatchNorm2d(16, device="cuda")
    else:
        theirs = torch.nn.InstanceNorm2d(16, affine=True, track_running_stats=True, device="cuda")
    with torch.no_grad():
        theirs.running_mean.uniform_(-1, 1)
        theirs.running_var.uniform_(0.5, 2)
    theirs = theirs.to(torch.bfloat16).eval()
    ours = cunorm_torch.replace_norms(copy.deepcopy(theirs))
    before = len(launch_cache.CHANNELS)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 16, 7, 9, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(ours(x).float(), theirs(x).float(), rtol=1.6e-2, atol=1.6e-2)
    _cached(launch_cache.CHANNELS, before)


@pytest.mark.parametrize("layer", ["LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm2d"])
def test_torch_layer_memo(layer, monkeypatch):
    """A replaced layer in inference keeps the launcher of its first call
    (_torch_layers.memoized): the next calls of that signature run it and
    nothing of the forward (poisoned outputs, new inputs each call, results
    as torch's layer), under autocast too; it follows a replaced
    parameter, a changed eps and a cast; BatchNorm in training is never
    memoized (its counter and buffers move as torch's, call after call)."""
    torch = _torch()
    from cunorm.torch import _layers as _torch_layers
    from cunorm import torch as cunorm_torch

    make = {"LayerNorm": lambda: torch.nn.LayerNorm(96), "RMSNorm": lambda: torch.nn.RMSNorm(96, eps=1e-5),
            "GroupNorm": lambda: torch.nn.GroupNorm(4, 96), "BatchNorm2d": lambda: torch.nn.BatchNorm2d(96)}[layer]
    shape = (5, 7, 96) if layer in ("LayerNorm", "RMSNorm") else (3, 96, 5, 7)
    theirs = make().cuda()
    with torch.no_grad():
        for p in theirs.parameters():
            p.uniform_(0.5, 2)
        if layer == "BatchNorm2d":
            theirs.running_mean.uniform_(-1, 1)
            theirs.running_var.uniform_(0.5, 2)
    theirs.eval()
    ours = cunorm_torch.replace_norms(copy.deepcopy(theirs))

    def check(what, dtype=torch.float32, autocast=False):
        for _ in range(3):
            torch.full((1 << 20,), float("nan"), device="cuda")  # freed: the output may reuse it
            x = torch.randn(shape, device="cuda", dtype=dtype)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                got, want = ours(x), theirs(x)
            assert got.dtype == want.dtype, what
            torch.testing.assert_close(got, want, rtol=2e-5 if dtype == torch.float32 else 1.6e-2, atol=2e-5
                                       if dtype == torch.float32 else 1.6e-2, msg=what)

    check("first calls")
    assert ours.__dict__.get("_cunorm_memo"), "nothing memoized"

    def forward_must_not_run(*args, **kwargs):
        raise AssertionError("the forward ran for a memoized signature")

    with monkeypatch.context() as patch:
        patch.setattr(_torch_layers, "runs_original", forward_must_not_run)
        check("memoized calls")
    with torch.no_grad():
        ours.weight.data = ours.weight.data * 2
        theirs.weight.data = theirs.weight.data * 2
    check("a replaced weight")
    ours.eps = theirs.eps = 0.25
    check("a changed eps")
    if layer in ("LayerNorm", "GroupNorm"):
        check("under autocast", torch.bfloat16, autocast=True)
        assert len(ours.__dict__["_cunorm_memo"]) == 2
    ours.double()
    theirs.double()
    check("cast to float64", torch.float64)
    if layer == "BatchNorm2d":
        ours.float().train()
        theirs.float().train()
        check("training, no_grad")
        assert not ours.__dict__.get("_cunorm_memo")
        assert int(ours.num_batches_tracked) == int(theirs.num_batches_tracked) == 3
        torch.testing.assert_close(ours.running_mean, theirs.running_mean)
        torch.testing.assert_close(ours.running_var, theirs.running_var)


def test_dependent_launches_give_the_plain_launches_bits(rng, monkeypatch):
    """On sm_90 and later every step after a Program's first (not
    cooperative) launches dependent on the one before it; the results,
    forward and backward, of Programs of two and three steps are bitwise
    those of the same Programs launched plainly, on fresh data."""
    torch = _torch()
    from cunorm._engine import launches
    import cunorm.torch as ct

    def t(*shape):
        return torch.from_numpy(random(rng, shape, np.float32)).cuda().to(torch.bfloat16)

    x, w, b, dy = t(2, 1280, 32, 32), t(1280), t(1280), t(2, 1280, 32, 32)
    xm, wm, dym = t(8, 512, 1152), t(1152), t(8, 512, 1152)
    shift, scale = t(8, 1, 1152), t(8, 1, 1152)

    def grads(f, *inputs, dy):
        leaves = [a.detach().requires_grad_() for a in inputs]
        out = f(*leaves)
        return [out.detach()] + list(torch.autograd.grad(out, leaves, dy))

    def run():
        return {"group_norm": grads(lambda x, w, b: ct.group_norm(x, 32, w, b), x, w, b, dy=dy),
                "modulated": grads(lambda x, w, s, c: ct.rms_norm(x, w, shift=s, scale=c), xm, wm, shift, scale,
                                   dy=dym)}

    built = []
    build = launches.ProgramBuilder.build
    monkeypatch.setattr(launches.ProgramBuilder, "build", lambda self: built.append(build(self)) or built[-1])
    results = {}
    for dependent in (True, False):
        monkeypatch.setattr(launches, "dependent_launch", dependent)
        clear_cunorm_caches()
        built.clear()
        results[dependent] = run()
        torch.cuda.synchronize()
        on_sm90 = dependent and torch.cuda.get_device_capability() >= (9, 0)
        assert max(len(p.steps) for p in built) >= 3
        for p in built:
            assert p.steps[0].dependent is None
            for s in p.steps[1:]:
                assert (s.dependent is not None) == (on_sm90 and not s.cooperative), s.step
    clear_cunorm_caches()
    for case, got in results[True].items():
        assert all(torch.equal(a, b) for a, b in zip(got, results[False][case])), case
        assert all(bool(torch.isfinite(a.float()).all()) for a in got), case
