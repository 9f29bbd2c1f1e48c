"""JAX arrays; CuPy's current stream and arrays on other GPUs (skipped
without a GPU; torch is tested in test_torch_gpu.py)."""
import numpy as np
import pytest

import cunorm
from cunorm._engine import dtypes
from cunorm import reference
from helpers import OP_CALLS, RTOL, assert_close, op_shapes, output_scale, random

pytestmark = pytest.mark.gpu


@pytest.fixture
def jax_gpu():
    jax = pytest.importorskip("jax")
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        pytest.skip("JAX sees no GPU")
    return gpus[0]


def _jax(x_np, device):
    import jax
    import jax.numpy as jnp

    return jax.device_put(jnp.asarray(x_np), device)


@pytest.mark.parametrize("namespace", ["cunorm", "cunorm.jax"])
@pytest.mark.parametrize("name", list(OP_CALLS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_jax_in_jax_out(rng, jax_gpu, namespace, name, dtype):
    import jax

    import cunorm.jax

    ops = cunorm if namespace == "cunorm" else cunorm.jax
    call, ref, _ = OP_CALLS[name]
    dt = np.dtype(getattr(dtypes, dtype))
    shape, params = op_shapes(name)
    x_np, w_np, b_np = random(rng, shape, dt), random(rng, params, dt), random(rng, params, dt)
    x, w, b = (_jax(a, jax_gpu) for a in (x_np, w_np, b_np))
    y = call(ops, x, w, b)
    assert isinstance(y, jax.Array) and y.dtype == x.dtype and y.shape == x.shape
    assert np.array_equal(np.asarray(x).view(np.uint8), x_np.view(np.uint8)), "the JAX input was written to"
    want = ref(x_np, w_np, b_np)
    tol = RTOL[dt]
    assert_close(np.asarray(y), want, dt, rtol=tol, atol=tol * output_scale(want))


def test_jax_zero_copy(jax_gpu):
    import cupy

    from cunorm._interop import jax as jax_adapter

    x = _jax(np.ones((32, 1024), np.float32), jax_gpu)
    assert jax_adapter.to_cupy(x).data.ptr == x.unsafe_buffer_pointer()
    y = cupy.ones((4, 256), np.float32)
    assert jax_adapter.from_cupy(y).unsafe_buffer_pointer() == y.data.ptr


@pytest.mark.parametrize("name", list(OP_CALLS))
def test_jax_traced_is_refused_by_the_array_level_ops(jax_gpu, name):
    import jax

    call = OP_CALLS[name][0]
    shape, params = op_shapes(name)
    w = _jax(np.ones(params, np.float32), jax_gpu)

    @jax.jit
    def f(x):
        return call(cunorm, x, w, w)

    with pytest.raises(TypeError, match="cunorm.jax's function of the same name"):
        f(_jax(np.ones(shape, np.float32), jax_gpu))


def test_jax_buffers_are_never_written(jax_gpu):
    import cunorm.jax

    x = _jax(np.ones((4, 8, 3), np.float32), jax_gpu)
    with pytest.raises(TypeError, match="must not write into"):
        cunorm.rms_norm(x, out=_jax(np.zeros((4, 8, 3), np.float32), jax_gpu))
    with pytest.raises(TypeError, match="running_mean is a JAX array"):
        cunorm.batch_norm(x, running_mean=_jax(np.zeros(8, np.float32), jax_gpu),
                          running_var=_jax(np.ones(8, np.float32), jax_gpu))
    with pytest.raises(TypeError, match="no out="):
        cunorm.jax.rms_norm(x, out=x)
    with pytest.raises(TypeError, match="x must be a JAX array"):
        cunorm.jax.rms_norm(np.ones((2, 4), np.float32))


# -- CuPy: the current stream, arrays on another GPU ---------------------------------------------------------------------------------------

def test_runs_on_cupys_current_stream(rng):
    """The same for CuPy: a kernel that spins ~100 ms, then x written, on a
    CuPy stream; cunorm under that stream must not wait and must see x."""
    import cupy

    spin = cupy.RawKernel(r'''
    extern "C" __global__ void spin(long long cycles) {
        long long start = clock64();
        while (clock64() - start < cycles) {}
    }''', "spin")
    source = cupy.asarray(rng.standard_normal((256, 4096)).astype(np.float32))
    x = cupy.full_like(source, np.nan)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:  # compile and load first
        spin((1,), (1,), (np.int64(1),))
        cunorm.rms_norm(x)
    cupy.cuda.Device().synchronize()
    with stream:
        spin((1,), (1,), (np.int64(200_000_000),))  # ~100 ms of GPU clock cycles
        x[...] = source
        y = cunorm.rms_norm(x)
        assert not stream.done, "cunorm waited for the stream (a synchronize)"
    stream.synchronize()
    assert_close(cupy.asnumpy(y), reference.rms_norm(cupy.asnumpy(source), exact=True), np.float32)


def _gpu_count():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no GPU, no driver
        return 0


@pytest.mark.skipif("_gpu_count() < 2")
def test_cupy_array_on_another_gpu(rng):
    import cupy

    x_np = random(rng, (64, 3000), np.float32)
    w_np = random(rng, (3000,), np.float32)
    with cupy.cuda.Device(1):
        x, w = cupy.asarray(x_np), cupy.asarray(w_np)
        stream = cupy.cuda.Stream(non_blocking=True)
    assert cupy.cuda.runtime.getDevice() == 0
    y = cunorm.layer_norm(x, w)  # launched on GPU 1, though GPU 0 is current
    assert y.data.device_id == 1 and cupy.cuda.runtime.getDevice() == 0
    want = reference.layer_norm(x_np, w_np, exact=True)
    assert_close(cupy.asnumpy(y), want, np.float32, atol=RTOL[np.dtype(np.float32)] * output_scale(want))
    with cupy.cuda.Device(1), stream:  # GPU 1's current stream
        z = cunorm.group_norm(x.reshape(64, 30, 100), 5)
    stream.synchronize()
    want = reference.group_norm(x_np.reshape(64, 30, 100), 5, exact=True)
    assert_close(cupy.asnumpy(z), want, np.float32, atol=RTOL[np.dtype(np.float32)] * output_scale(want))
    with cupy.cuda.Device(0):
        w0 = cupy.asarray(w_np)
    with pytest.raises(ValueError, match="weight is on GPU 0 but x is on GPU 1"):
        cunorm.rms_norm(x, w0)
