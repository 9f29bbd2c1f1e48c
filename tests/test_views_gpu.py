"""Views whose size-1 axes carry any stride (the last position of a decode
step, ``hs[:, -1:, :]``; ``big[::2]`` with a leading size-1 axis), from
CuPy and torch: every op, with and without a residual and ``out=``,
forward and backward, against the float64 reference. A size-1 axis is
never stepped along, so its stride must not change what a call does."""
import numpy as np
import pytest

import cunorm
from cunorm import reference
from helpers import OP_CALLS, RTOL, assert_close, output_scale

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

BF16 = np.dtype("bfloat16")
DTYPES = [np.dtype(np.float32), BF16]


def _check(y, ref, dtype, what=""):
    tol = RTOL[dtype]
    assert_close(numpy_of(y), ref, dtype, rtol=tol, atol=tol * output_scale(ref), what=what)


def _strides(shape, rng):
    """C strides (elements) where an axis has more than one element, a random
    one (up to 2**20, 0 included) where it has one."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step if n > 1 else int(rng.integers(0, 1 << 20)))
        step *= n
    return tuple(reversed(out))


def view(kind, values, rng):
    """``values`` (NumPy) as a CuPy array or torch tensor whose size-1 axes
    carry random strides, over a NaN-filled buffer."""
    shape, dtype = values.shape, values.dtype
    strides = _strides(shape, rng)
    extent = sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    if kind == "cupy":
        base = cupy.full(extent + 8, np.nan, dtype)
        v = cupy.ndarray(shape, dtype, base.data, strides=tuple(s * dtype.itemsize for s in strides))
        v[...] = cupy.asarray(values)
        return v
    import torch

    t = torch.from_dlpack(cupy.asarray(values)).contiguous()
    base = torch.full((extent + 8,), float("nan"), dtype=t.dtype, device="cuda")
    v = base.as_strided(shape, strides)
    v.copy_(t)
    return v


def plain(kind, values):
    a = cupy.asarray(values)
    if kind == "cupy":
        return a
    import torch

    return torch.from_dlpack(a).clone()


def numpy_of(a):
    return cupy.asnumpy(a) if isinstance(a, cupy.ndarray) else cupy.asnumpy(cupy.from_dlpack(a.detach().contiguous()))


@pytest.fixture(params=["cupy", "torch"])
def kind(request):
    if request.param == "torch":
        pytest.importorskip("torch")
    return request.param


ROW_SHAPES = [(1, 1, 760), (1, 3, 1, 4096), (2, 1, 1, 33)]
CHANNEL_SHAPES = [(1, 8, 1, 7), (1, 8, 7, 1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=str)
@pytest.mark.parametrize("name", ["rms_norm", "layer_norm", "normalize", "mean_abs_normalize",
                                  "frobenius_normalize"])
def test_row_ops(kind, rng, name, shape, dtype):
    call, ref, _ = OP_CALLS[name]
    xn = rng.standard_normal(shape).astype(dtype)
    wn, bn = (rng.standard_normal(shape[-1:]).astype(np.float32) for _ in range(2))
    x = view(kind, xn, rng)
    before = numpy_of(x)
    y = call(cunorm, x, plain(kind, wn), plain(kind, bn))
    _check(y, ref(xn, wn, bn), dtype, name)
    assert np.array_equal(numpy_of(x).view(np.uint8), before.view(np.uint8))  # x never written


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", ROW_SHAPES + [(1, 64, 1, 33)], ids=str)
@pytest.mark.parametrize("residual_view", [True, False])
@pytest.mark.parametrize("out", [None, "fresh", "x"])
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_residual_and_out(kind, rng, op, out, residual_view, shape, dtype):
    """The fused residual on views (it recursed forever where r's strides
    and x's differed only on size-1 axes), into out= or in place."""
    axis = 1 if shape == (1, 64, 1, 33) else -1
    xn, rn = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    wn = rng.standard_normal(shape[axis]).astype(np.float32)
    x = view(kind, xn, rng)
    r = view(kind, rn, rng) if residual_view else plain(kind, rn)
    o = None
    if out == "fresh":
        o = view(kind, np.full(shape, np.nan, dtype), rng)
    elif out == "x":
        o = x
    fn = getattr(cunorm, op)
    y, h = fn(x, plain(kind, wn), axis=axis, residual=r, out=o)
    ref_y, ref_h = getattr(reference, op)(xn, wn, axis=axis, residual=rn, exact=True)
    _check(y, ref_y, dtype, f"{op} y")
    assert np.array_equal(numpy_of(h).astype(np.float64), ref_h.astype(np.float64)), "h = x + r rounded"
    if o is not None:
        assert y is o


def test_the_decode_step_of_the_report():
    """The report's case: the last position of (1, 37, 4096) bf16 hidden
    states, a residual of (1, 1, 4096), through cunorm.rms_norm."""
    torch = pytest.importorskip("torch")
    hs = torch.randn(1, 37, 4096, device="cuda", dtype=torch.bfloat16)
    x = hs[:, -1:, :]
    assert x.stride() == (151552, 4096, 1)
    r = torch.randn(1, 1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(4096, device="cuda")
    y, h = cunorm.rms_norm(x, w, residual=r)
    ref_y, ref_h = reference.rms_norm(numpy_of(x), numpy_of(w), residual=numpy_of(r), exact=True)
    _check(y, ref_y, BF16)
    assert np.array_equal(numpy_of(h).astype(np.float64), ref_h.astype(np.float64))
    y2, h2 = cunorm.layer_norm(x, w, residual=r)  # and LayerNorm
    _check(y2, reference.layer_norm(numpy_of(x), numpy_of(w), residual=numpy_of(r), exact=True)[0], BF16)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", CHANNEL_SHAPES, ids=str)
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("with_out", [False, True])
@pytest.mark.parametrize("name", ["group_norm", "instance_norm", "batch_norm"])
def test_channel_ops(kind, rng, name, with_out, channels_last, shape, dtype):
    if channels_last:
        shape = (shape[0],) + shape[2:] + (shape[1],)
    axis = -1 if channels_last else 1
    xn = rng.standard_normal(shape).astype(dtype)
    c = shape[axis]
    wn, bn = (rng.standard_normal(c).astype(np.float32) for _ in range(2))
    x = view(kind, xn, rng)
    kw = {"channel_axis": axis}
    if with_out:
        kw["out"] = view(kind, np.full(shape, np.nan, dtype), rng)
    if name == "group_norm":
        y = cunorm.group_norm(x, 4, plain(kind, wn), plain(kind, bn), **kw)
        ref = reference.group_norm(xn, 4, wn, bn, channel_axis=axis, exact=True)
    else:
        y = getattr(cunorm, name)(x, plain(kind, wn), plain(kind, bn), **kw)
        ref = getattr(reference, name)(xn, wn, bn, channel_axis=axis, exact=True)
    _check(y, ref, dtype, name)
    if with_out:
        assert y is kw["out"]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("name", ["rms_norm", "layer_norm", "group_norm"])
def test_backward(kind, rng, name, dtype):
    """dy and x as views with free strides on their size-1 axes."""
    shape = (1, 8, 1, 7) if name == "group_norm" else (1, 1, 760)
    xn, dyn = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    wn = rng.standard_normal(shape[1] if name == "group_norm" else shape[-1]).astype(np.float32)
    x, dy, w = view(kind, xn, rng), view(kind, dyn, rng), plain(kind, wn)
    if name == "group_norm":
        _, mean, rstd = cunorm.group_norm(x, 4, w, return_stats=True)
        dx, dw, _ = cunorm.group_norm_backward(dy, x, mean, rstd, 4, w)
        rdx, rdw, _ = reference.group_norm_backward(dyn, xn, numpy_of(mean), numpy_of(rstd), 4, wn, exact=True)
    elif name == "rms_norm":
        _, rstd = cunorm.rms_norm(x, w, return_stats=True)
        dx, dw = cunorm.rms_norm_backward(dy, x, rstd, w)
        rdx, rdw = reference.rms_norm_backward(dyn, xn, numpy_of(rstd), wn, exact=True)
    else:
        _, mean, rstd = cunorm.layer_norm(x, w, return_stats=True)
        dx, dw, _ = cunorm.layer_norm_backward(dy, x, mean, rstd, w)
        rdx, rdw, _ = reference.layer_norm_backward(dyn, xn, numpy_of(mean), numpy_of(rstd), wn, exact=True)
    _check(dx, rdx, dtype, "dx")
    _check(dw, rdw, np.dtype(np.float32), "dw")


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_autograd_through_a_decode_view(rng, op):
    """torch autograd (the registered operators' route) on hs[:, -1:, :]
    with a residual: y, h and the gradients of x, residual and weight."""
    torch = pytest.importorskip("torch")
    import cunorm.torch as ct

    hs = torch.randn(1, 9, 300, device="cuda", dtype=torch.float64, requires_grad=True)
    x = hs[:, -1:, :]
    r = torch.randn(1, 1, 300, device="cuda", dtype=torch.float64, requires_grad=True)
    w = torch.randn(300, device="cuda", dtype=torch.float64, requires_grad=True)
    y, h = getattr(ct, op)(x, w, residual=r)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    hf = (x + r).detach()
    if op == "rms_norm":
        want = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    else:
        want = torch.nn.functional.layer_norm(hf, (300,), w, eps=1e-5)
    assert torch.allclose(y, want, rtol=1e-10, atol=1e-10)
    hf.requires_grad_(True)
    wd = w.detach().clone().requires_grad_(True)
    if op == "rms_norm":
        want = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5) * wd
    else:
        want = torch.nn.functional.layer_norm(hf, (300,), wd, eps=1e-5)
    (want * g).sum().backward()
    assert torch.allclose(r.grad, hf.grad, rtol=1e-9, atol=1e-9)
    assert torch.allclose(hs.grad[:, -1:], hf.grad, rtol=1e-9, atol=1e-9)
    assert torch.allclose(w.grad, wd.grad, rtol=1e-9, atol=1e-9)
