"""cunorm.torch.SyncBatchNorm (cunorm/torch/_sync.py).

CPU: convert_sync_batchnorm keeps every parameter, buffer and setting; with
no process group the layer is torch's fallback (cunorm's BatchNorm, torch's
on CPU tensors).
One GPU: the synchronized forward and backward over a process group of one
rank (the collectives run, the combination is the identity) against a
float64 computation, within twice torch's own error, the running buffers
as torch updates them.
Two GPUs (skipped with fewer): two ranks launched as torchrun would, even,
uneven and empty batches, against the single-process float64 computation
over the concatenated batch, bitwise the same statistics on both ranks.
"""
import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import cunorm.torch as ct  # noqa: E402
from cunorm.torch import _sync as _torch_sync  # noqa: E402


def _model():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               ct.BatchNorm2d(8, momentum=None), torch.nn.SyncBatchNorm(8, eps=1e-3, affine=False))


def test_convert_keeps_parameters_buffers_and_settings():
    model = _model()
    with torch.no_grad():
        model[1].running_mean.uniform_()
        model[1].weight.uniform_()
        model[3].num_batches_tracked.fill_(5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    converted = ct.convert_sync_batchnorm(model)
    norms = [m for m in converted.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert [type(m) for m in norms] == [ct.SyncBatchNorm] * 3
    after = converted.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert norms[1].momentum is None and norms[2].eps == 1e-3 and not norms[2].affine
    assert all(m.process_group is None for m in norms)
    group = object()  # (any value: convert only stores it)
    assert all(m.process_group is group for m in ct.convert_sync_batchnorm(_model(), group).modules()
               if isinstance(m, ct.SyncBatchNorm))
    single = ct.convert_sync_batchnorm(torch.nn.BatchNorm1d(4))
    assert type(single) is ct.SyncBatchNorm and single.num_features == 4


def test_a_group_not_on_nccl_gathers_through_torch_distributed(tmp_path):
    """No communicator of cunorm's outside NCCL (and no collective to agree
    on one); the gather writes rank r's elements at target + r * count and
    nothing else."""
    from cunorm.torch import _collectives

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        assert _collectives.communicator(dist.group.WORLD, -1) is None
        block = torch.full((10,), float("nan"))
        block[2:5] = torch.tensor([1.0, 2.0, 3.0])
        _collectives.all_gather(block, 2, 6, 3, dist.group.WORLD, 1)
        assert torch.equal(block[6:9], block[2:5])
        assert block[[0, 1, 5, 9]].isnan().all()
    finally:
        dist.destroy_process_group()


def test_without_a_process_group_it_is_torchs_fallback():
    """Not distributed: the layer is BatchNorm, as torch's SyncBatchNorm is."""
    ours, theirs = ct.SyncBatchNorm(6, momentum=0.3), torch.nn.SyncBatchNorm(6, momentum=0.3)
    x = torch.randn(5, 6, 4, 3) * 3 + 1
    for _ in range(2):
        torch.testing.assert_close(ours(x), theirs(x))
    torch.testing.assert_close(ours.running_var, theirs.running_var)
    assert int(ours.num_batches_tracked) == 2
    ours.eval(), theirs.eval()
    torch.testing.assert_close(ours(x), theirs(x))
    with pytest.raises(ValueError, match="expected at least 2D input"):
        ours(torch.randn(6))


# --- on the GPU -------------------------------------------------------------------------------------------------------


def _reference(x, w, b, dy, eps):
    """float64 BatchNorm training over x (all of it): y, mean, unbiased
    var, dx, dw, db."""
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    y = torch.nn.functional.batch_norm(x64, None, None, w64, b64, True, 0.0, eps)
    y.backward(dy.double())
    dims = [0] + list(range(2, x.dim()))
    return (y.detach(), x64.detach().mean(dims), x64.detach().var(dims, unbiased=True), x64.grad, w64.grad,
            b64.grad)


def _err(got, want):
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


@pytest.fixture
def one_rank_group(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape,layout", [((8, 16, 14, 14), "nchw"), ((8, 16, 14, 14), "nhwc"), ((5, 24, 7, 9), "odd"),
                                          ((33, 3), "2-d")], ids=["nchw", "nhwc", "odd", "2-d"])
@pytest.mark.parametrize("own", [True, False], ids=["own communicator", "torch.distributed"])
def test_synchronized_step_on_one_rank_matches_float64(one_rank_group, dtype, shape, layout, own):
    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    x = torch.randn(shape, device="cuda", generator=gen) * 2 + 5
    if layout == "nhwc":
        x = x.to(memory_format=torch.channels_last)
    x = x.to(dtype).requires_grad_()
    c = shape[1]
    w = (torch.rand(c, device="cuda", generator=gen) + 0.5).requires_grad_()
    b = torch.randn(c, device="cuda", generator=gen).requires_grad_()
    dy = torch.randn(shape, device="cuda", generator=gen).to(dtype)
    eps, momentum = 1e-5, 0.25
    rm, rv = torch.randn(c, device="cuda", generator=gen), torch.rand(c, device="cuda", generator=gen) + 0.5
    rm0, rv0 = rm.clone(), rv.clone()
    x_before = x.detach().clone()
    y = _torch_sync.SyncBatchNormFunction.apply(x, w, b, rm, rv, eps, momentum, one_rank_group, 1, own)
    y.backward(dy)
    assert torch.equal(x.detach(), x_before) and y.dtype == dtype and y.shape == x.shape
    want_y, mean, var, want_dx, want_dw, want_db = _reference(x_before, w, b, dy, eps)
    # torch's own error, same dtype, same math
    xt, wt, bt = (t.detach().clone().requires_grad_() for t in (x_before, w, b))
    yt = torch.nn.functional.batch_norm(xt, None, None, wt, bt, True, 0.0, eps)
    yt.backward(dy)
    for ours, theirs, want, what in ((y, yt, want_y, "y"), (x.grad, xt.grad, want_dx, "dx"),
                                     (w.grad, wt.grad, want_dw, "dw"), (b.grad, bt.grad, want_db, "db")):
        assert torch.isfinite(ours).all(), what
        floor = 4 * torch.finfo(dtype).eps if what in ("y", "dx") else 1e-6
        assert _err(ours, want) <= 2 * _err(theirs, want) + floor, (what, _err(ours, want), _err(theirs, want))
    torch.testing.assert_close(rm.double(), (1 - momentum) * rm0.double() + momentum * mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rv.double(), (1 - momentum) * rv0.double() + momentum * var, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_one_value_a_channel_is_refused_as_torch_refuses_it(one_rank_group):
    """One value a channel on one rank: torch's error (a rank's single value
    is valid where other ranks may add more)."""
    x = torch.randn(1, 4, device="cuda")
    block = torch.full((_torch_sync.gathered_end(4, 1) + 16,), float("nan"), device="cuda")
    _torch_sync.local_statistics(x, False, block)
    local = block[:12].view(3, 4)
    assert torch.equal(local[1], x[0]) and torch.equal(local[0], torch.ones(4, device="cuda"))
    assert torch.isinf(local[2]).all()  # (rstd of no spread: M2 = 0)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        _torch_sync.SyncBatchNormFunction.apply(x, None, None, None, None, 1e-5, 0.1, one_rank_group, 1, True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_the_combine_launch_is_chans_update_in_rank_order(dtype):
    """channel_sync_combine against sync_stats' float64 Chan update over
    gathered blocks with an empty rank, a one-value rank and a channel
    without spread; the running buffers as torch updates them."""
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    import numpy as np

    from cunorm._engine import sync_batch, sync_stats

    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    ranks, channels = 5, 37
    counts = torch.tensor([7.0, 0.0, 1.0, 300.0, 64.0])
    means = torch.randn(ranks, channels, generator=gen, dtype=torch.float64) * 3 + 1000
    var = torch.rand(ranks, channels, generator=gen, dtype=torch.float64) + 0.1
    var[:, 3] = 0  # no spread anywhere in channel 3 ...
    means[:, 3] = 2.5  # ... and one value
    var[2] = 0  # the one-value rank
    var[1], means[1] = 0, 0  # the empty rank sends zeros
    rstd = var.rsqrt()
    rstd[1] = 0
    blocks = torch.stack([counts[:, None].expand(ranks, channels), means, rstd], 1).to(dtype).cuda()
    rm = torch.randn(channels, generator=gen, dtype=torch.float64).to(dtype).cuda()
    rv = (torch.rand(channels, generator=gen, dtype=torch.float64) + 0.5).to(dtype).cuda()
    rm0, rv0 = rm.double().cpu(), rv.double().cpu()
    eps, momentum = 1e-5, 0.3
    # the combine alone: the forward's second Program for an empty batch
    program = sync_batch.apply_program(np.dtype("float32" if dtype == torch.float32 else "float64"), None, 0, False,
                                       (0, channels), 0, 0, ranks, eps, momentum, True, torch.cuda.current_device())
    mean, got_var, got_rstd, count = torch.full((4, channels), float("nan"), dtype=dtype, device="cuda")
    _torch_sync._run(program, torch.cuda.current_device(), gathered=blocks, buffer_mean=rm, buffer_var=rv,
                     running_mean=mean, running_var=got_var, global_rstd=got_rstd, count=count)
    count = count[0]
    b = blocks.double().cpu()
    m2 = torch.where(b[:, 0] > 0, b[:, 0] / b[:, 2] ** 2, torch.zeros(()))
    n, want_mean, want_m2 = sync_stats.combine(b[:, 0], b[:, 1], m2)
    want_rm, want_rv = sync_stats.running_update(rm0, rv0, want_mean, want_m2, n, momentum)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    # Each delta (a rank's mean less the running one) carries the running
    # mean's rounding, u x |mean|, so the variance's relative error grows as
    # |mean| / std (means near 1000 here: up to about 1e-3 in float32)
    u = 2.0 ** -24 if dtype == torch.float32 else 2.0 ** -53
    spread = float((want_m2 / n)[want_m2 > 0].sqrt().min())
    var_tol = dict(tol, rtol=max(tol["rtol"], 16 * u * float(b[:, 1].abs().max()) / spread))
    assert float(count) == float(n[0]) == 372
    torch.testing.assert_close(mean.double().cpu(), want_mean, **tol)
    torch.testing.assert_close(got_var.double().cpu(), want_m2 / n, **var_tol)
    torch.testing.assert_close(got_rstd.double().cpu(), (want_m2 / n + eps).rsqrt(), **var_tol)
    torch.testing.assert_close(rm.double().cpu(), want_rm, **tol)
    torch.testing.assert_close(rv.double().cpu(), want_rv, **var_tol)
    assert float(got_var[3]) == 0


# --- two GPUs -----------------------------------------------------------------------------------------------------------


def _rank(rank, world, store_path, sizes, dtype_name, out_dir):
    torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(1234)  # the same full batch on every rank
    full = torch.randn(sum(sizes), 16, 6, 5, generator=gen) * 2 + 3
    dy_full = torch.randn(full.shape, generator=gen)
    lo = sum(sizes[:rank])
    saved = {}
    for own in (True, False):  # cunorm's own communicator, then torch.distributed's collectives
        x = full[lo:lo + sizes[rank]].to("cuda", dtype).requires_grad_()
        layer = ct.SyncBatchNorm(16, momentum=0.2).cuda()
        layer.own_communicator = own
        with torch.no_grad():
            layer.weight.uniform_(0.5, 1.5, generator=torch.Generator("cuda").manual_seed(7))
        y = layer(x)
        y.backward(dy_full[lo:lo + sizes[rank]].to("cuda", dtype))
        saved[own] = {"y": y.detach().cpu(), "dx": x.grad.cpu(), "dw": layer.weight.grad.cpu(),
                      "db": layer.bias.grad.cpu(), "rm": layer.running_mean.cpu(), "rv": layer.running_var.cpu()}
    from cunorm.torch import _collectives
    saved[True]["own communicator made"] = _collectives.communicator(dist.group.WORLD, rank) is not None
    for key, value in saved[False].items():  # (the same gathered bytes either way)
        saved[True][f"{key} equal through torch.distributed"] = torch.equal(saved[True][key], value)
    torch.save(saved[True], os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [(4, 4), (3, 5), (0, 8)], ids=["even", "uneven", "empty rank"])
def test_two_ranks_match_the_concatenated_batch(tmp_path, sizes):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(2, str(tmp_path / "store"), sizes, "float32", str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in ranks:
        assert r["own communicator made"]
        assert all(r[f"{key} equal through torch.distributed"] for key in ("y", "dx", "dw", "db", "rm", "rv"))
    gen = torch.Generator().manual_seed(1234)
    full = torch.randn(sum(sizes), 16, 6, 5, generator=gen) * 2 + 3
    dy = torch.randn(full.shape, generator=gen)
    w = torch.empty(16, device="cuda").uniform_(0.5, 1.5, generator=torch.Generator("cuda").manual_seed(7)).cpu()
    want_y, mean, var, want_dx, _, _ = _reference(full, w, torch.zeros(16), dy, 1e-5)
    assert _err(torch.cat([r["y"] for r in ranks]), want_y) < 1e-5
    assert _err(torch.cat([r["dx"] for r in ranks]), want_dx) < 1e-5
    # the running buffers: bitwise the same on both ranks, as torch updates them
    assert torch.equal(ranks[0]["rm"], ranks[1]["rm"]) and torch.equal(ranks[0]["rv"], ranks[1]["rv"])
    torch.testing.assert_close(ranks[0]["rm"].double(), 0.2 * mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ranks[0]["rv"].double(), 0.8 + 0.2 * var, rtol=1e-5, atol=1e-6)
    # each rank's weight and bias gradients are its own batch's (DDP averages them)
    lo = sizes[0]
    for r, (a, b_) in enumerate(((0, lo), (lo, sum(sizes)))):
        xhat = (full[a:b_].double() - mean.view(1, -1, 1, 1)) / (var * (sum(sizes) * 30 - 1) / (sum(sizes) * 30)
                                                                 + 1e-5).sqrt().view(1, -1, 1, 1)
        torch.testing.assert_close(ranks[r]["db"].double(), dy[a:b_].double().sum((0, 2, 3)), rtol=1e-4,
                                   atol=1e-4)
        torch.testing.assert_close(ranks[r]["dw"].double(), (dy[a:b_].double() * xhat).sum((0, 2, 3)),
                                   rtol=1e-4, atol=1e-4)


def _train_rank(rank, world, store_path, out_dir):
    """Two SGD steps of a small conv net under DistributedDataParallel, its
    BatchNorms converted by cunorm's convert_sync_batchnorm and, from the
    same initial weights, by torch's."""
    torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    results = {}
    for name, convert in (("cunorm", ct.convert_sync_batchnorm),
                          ("torch", torch.nn.SyncBatchNorm.convert_sync_batchnorm)):
        torch.manual_seed(0)  # the same initial weights on every rank and for both conversions
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                                  torch.nn.Conv2d(16, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                  torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))
        model = torch.nn.parallel.DistributedDataParallel(convert(net).cuda(), device_ids=[rank])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
        for _ in range(2):
            x = torch.randn(6, 3, 12, 12, generator=gen).cuda()
            target = torch.randint(0, 4, (6,), generator=gen).cuda()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), target).backward()
            opt.step()
        results[name] = {k: v.detach().cpu() for k, v in model.module.state_dict().items()}
    torch.save(results, os.path.join(out_dir, f"train{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.gpu
def test_two_step_training_under_ddp_matches_torchs_syncbatchnorm(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    import torch.multiprocessing as mp

    mp.spawn(_train_rank, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"train{r}.pt") for r in range(2)]
    ours, theirs = ranks[0]["cunorm"], ranks[0]["torch"]
    assert ours.keys() == theirs.keys()
    for key in ours:
        # every rank holds the same model (DDP's averaged gradients, the synchronized statistics) ...
        assert torch.equal(ours[key], ranks[1]["cunorm"][key]), key
        # ... and it is torch's SyncBatchNorm's within float32 rounding
        torch.testing.assert_close(ours[key].double(), theirs[key].double(), rtol=1e-4, atol=1e-5, msg=key)
