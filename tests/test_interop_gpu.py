"""torch and JAX arrays in, their own type out, zero-copy (skipped without a GPU)."""
import numpy as np
import pytest

import cunorm
from cunorm import _dtypes, reference
from helpers import assert_close, random

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_torch_in_torch_out(rng, dtype):
    torch = pytest.importorskip("torch")
    import cupy

    x = torch.randn(64, 4096, device="cuda").to(getattr(torch, dtype))
    w = torch.randn(4096, device="cuda").to(getattr(torch, dtype))
    before = x.clone()
    # zero-copy in: the kernels read the tensor's own memory
    assert cupy.from_dlpack(x).data.ptr == x.data_ptr()
    y = cunorm.rms_norm(x, w)
    assert isinstance(y, torch.Tensor) and y.device == x.device and y.dtype == x.dtype and y.shape == x.shape
    assert torch.equal(x, before)
    x_np = cupy.asnumpy(cupy.from_dlpack(x))
    w_np = cupy.asnumpy(cupy.from_dlpack(w))
    ref = reference.rms_norm(x_np, w_np, exact=True)
    assert_close(cupy.asnumpy(cupy.from_dlpack(y)), ref, np.dtype(x_np.dtype))


def test_torch_out_is_written_in_place(rng):
    torch = pytest.importorskip("torch")
    x = torch.randn(8, 1000, device="cuda")
    out = torch.full_like(x, float("nan"))
    ptr = out.data_ptr()
    r = cunorm.rms_norm(x, out=out)
    assert r is out and out.data_ptr() == ptr
    expected = torch.nn.functional.rms_norm(x.double(), (1000,), eps=1e-5).float()
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=1e-6)


def test_torch_requires_grad_input():
    torch = pytest.importorskip("torch")
    w = torch.nn.Parameter(torch.ones(256, device="cuda"))
    x = torch.randn(4, 256, device="cuda")
    y = cunorm.rms_norm(x, w)
    assert isinstance(y, torch.Tensor) and not y.requires_grad


def test_torch_cpu_tensor_is_refused():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"torch tensor on cpu.*\.cuda\(\)"):
        cunorm.rms_norm(torch.ones(2, 4))


def test_torch_int_tensor_is_refused():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="x must have dtype"):
        cunorm.rms_norm(torch.ones(2, 4, dtype=torch.int32, device="cuda"))


def test_torch_non_contiguous(rng):
    torch = pytest.importorskip("torch")
    x = torch.randn(4096, 64, device="cuda").t()  # (64, 4096), strides (1, 64)
    y = cunorm.rms_norm(x)
    expected = torch.nn.functional.rms_norm(x.double(), (4096,), eps=1e-5).float()
    torch.testing.assert_close(y, expected, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_jax_in_jax_out(rng, dtype):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        pytest.skip("JAX sees no GPU")
    x_np = random(rng, (32, 1024), np.dtype(getattr(_dtypes, dtype)))
    x = jax.device_put(jnp.asarray(x_np), gpus[0])
    y = cunorm.rms_norm(x)
    assert isinstance(y, jax.Array) and y.dtype == x.dtype and y.shape == x.shape
    assert np.array_equal(np.asarray(x).view(np.uint8), x_np.view(np.uint8)), "the JAX input was written to"
    assert_close(np.asarray(y), reference.rms_norm(x_np, exact=True), x_np.dtype)


def test_jax_traced_is_refused():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")

    @jax.jit
    def f(x):
        return cunorm.rms_norm(x)

    with pytest.raises(TypeError, match="eager JAX arrays only"):
        f(jnp.ones((2, 8)))
