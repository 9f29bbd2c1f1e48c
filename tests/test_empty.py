"""The one rule for empty input, on every op, NumPy and GPU alike: x with no
elements gives empty outputs of the usual shapes and dtypes, launches
nothing and leaves the running buffers as they are; the backward gives an
empty dx and zero parameter gradients (sums over nothing). Statistics that
have entries but are formed over no elements (``return_stats`` over a
zero-length normalized axis, BatchNorm's over an empty batch) are NaN."""
import numpy as np
import pytest

import cunorm

F32 = np.float32


def _zeros(xp, shape):
    return xp.zeros(shape, dtype=F32)


ROW_OPS = {
    "rms_norm": lambda x, w, **kw: cunorm.rms_norm(x, w, **kw),
    "layer_norm": lambda x, w, **kw: cunorm.layer_norm(x, w, w, **kw),
    "normalize": lambda x, w, **kw: cunorm.normalize(x, **kw),
    "normalize_p3": lambda x, w, **kw: cunorm.normalize(x, p=3.0, **kw),
    "mean_abs_normalize": lambda x, w, **kw: cunorm.mean_abs_normalize(x, **kw),
    "frobenius_normalize": lambda x, w, **kw: cunorm.frobenius_normalize(x, axis=-1, **kw),
}


@pytest.mark.parametrize("op", ROW_OPS)
@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (2, 0, 5)])
def test_row_ops_of_empty_x_return_empty(xp, op, shape):
    x = _zeros(xp, shape)
    w = xp.ones(shape[-1], dtype=F32)
    y = ROW_OPS[op](x, w)
    assert type(y) is type(x) and y.shape == x.shape and y.dtype == x.dtype
    out = xp.empty(shape, dtype=F32)
    assert ROW_OPS[op](x, w, out=out) is out


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_statistics_of_empty_rows(xp, op):
    x, w = _zeros(xp, (0, 5)), xp.ones(5, dtype=F32)
    y, *stats = ROW_OPS[op](x, w, return_stats=True, residual=_zeros(xp, (0, 5)))
    assert y.shape == (0, 5) and stats[0].shape == (0, 5)  # h
    assert [s.shape for s in stats[1:]] == [(0,)] * (2 if op == "layer_norm" else 1)
    y, *stats = ROW_OPS[op](_zeros(xp, (3, 0)), xp.ones(0, dtype=F32), return_stats=True)
    assert y.shape == (3, 0) and len(stats) == (2 if op == "layer_norm" else 1)
    for s in stats:
        assert s.shape == (3,) and s.dtype == F32 and bool(xp.isnan(s).all())


@pytest.mark.parametrize("shape", [(0, 4, 3), (2, 4, 0), (0, 4, 1)])
def test_channel_ops_of_empty_x_return_empty(xp, shape):
    x = _zeros(xp, shape)
    w = xp.ones(4, dtype=F32)
    for y in (cunorm.group_norm(x, 2, w, w), cunorm.instance_norm(x, w, w), cunorm.batch_norm(x, w, w),
              cunorm.batch_norm(x, running_mean=_zeros(xp, 4), running_var=xp.ones(4, dtype=F32), training=False)):
        assert type(y) is type(x) and y.shape == shape and y.dtype == x.dtype


def test_empty_batch_leaves_running_buffers(xp):
    x = _zeros(xp, (0, 4, 3))
    mean, var = xp.asarray(np.arange(4, dtype=F32)), xp.asarray(np.arange(1, 5, dtype=F32))
    before = (mean.copy(), var.copy())
    y = cunorm.batch_norm(x, running_mean=mean, running_var=var, momentum=0.5)
    assert y.shape == (0, 4, 3)
    assert mean.tobytes() == before[0].tobytes() and var.tobytes() == before[1].tobytes()


def test_statistics_of_empty_channel_groups(xp):
    y, mean, rstd = cunorm.group_norm(_zeros(xp, (0, 4, 3)), 2, return_stats=True)
    assert mean.shape == rstd.shape == (0, 2)
    for y, mean, rstd in (cunorm.batch_norm(_zeros(xp, (0, 4, 3)), return_stats=True),
                          cunorm.group_norm(_zeros(xp, (2, 4, 0)), 2, return_stats=True)):
        assert mean.shape in ((4,), (2, 2)) and bool(xp.isnan(mean).all()) and bool(xp.isnan(rstd).all())


def test_backward_of_empty_x(xp):
    x, w = _zeros(xp, (0, 5)), xp.full(5, 2.0, dtype=F32)
    dx, dw, db = cunorm.layer_norm_backward(x, x, _zeros(xp, 0), _zeros(xp, 0), w, w)
    assert dx.shape == (0, 5) and dw.tolist() == [0.0] * 5 and db.tolist() == [0.0] * 5
    dx, dw = cunorm.rms_norm_backward(_zeros(xp, (3, 0)), _zeros(xp, (3, 0)), _zeros(xp, 3), xp.ones(0, dtype=F32))
    assert dx.shape == (3, 0) and dw.shape == (0,)
    assert cunorm.normalize_backward(_zeros(xp, (3, 0)), _zeros(xp, (3, 0))).shape == (3, 0)
    xc, wc = _zeros(xp, (0, 4, 3)), xp.full(4, 2.0, dtype=F32)
    for dx, dw, db in (cunorm.group_norm_backward(xc, xc, _zeros(xp, (0, 2)), _zeros(xp, (0, 2)), 2, wc, wc),
                       cunorm.batch_norm_backward(xc, xc, _zeros(xp, 4), _zeros(xp, 4), wc, wc)):
        assert dx.shape == (0, 4, 3) and dw.tolist() == [0.0] * 4 and db.tolist() == [0.0] * 4


@pytest.mark.gpu
def test_torch_layers_train_on_an_empty_batch():
    torch = pytest.importorskip("torch")
    import cunorm.torch as ct

    # (not InstanceNorm: torch's own raises on an empty batch, and a small
    # input under autograd runs the original's forward)
    layers = [(ct.BatchNorm2d(4), (0, 4, 3, 3)), (ct.LayerNorm(5), (0, 5)), (ct.GroupNorm(2, 4), (0, 4, 3)),
              (ct.RMSNorm(5), (0, 5))]
    for layer, shape in layers:
        layer = layer.cuda().train()
        buffers = {k: v.clone() for k, v in layer.named_buffers() if k != "num_batches_tracked"}
        x = torch.zeros(shape, device="cuda", requires_grad=True)
        y = layer(x)
        y.sum().backward()
        assert y.shape == shape and x.grad.shape == shape, type(layer)
        for p in layer.parameters():
            assert p.grad is not None and bool((p.grad == 0).all()), type(layer)
        for k, v in layer.named_buffers():
            if k in buffers:
                assert torch.equal(v, buffers[k]), (type(layer), k)
