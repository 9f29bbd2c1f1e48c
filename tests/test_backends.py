"""One body, every backend: each op of the table (cunorm/_engine/ops.py)
over a table of cases, run through NumPy (the public functions' reference
path), CuPy, torch eager, torch autograd, JAX eager, jax.jit and jax.grad,
against the float64 reference, forward and (where the backend takes
gradients) backward. Fresh random data every run; odd sizes; the channel
norms channels-first and channels-last. The white-box tests of the tiers
and the dispatch are the other test modules."""
import functools

import numpy as np
import pytest

import cunorm
from cunorm._engine import dtypes, ops
from helpers import RTOL, assert_close, output_scale, random

#: (case id, op, x shape, options): the normalized axes are the last for
#: the row ops; the channel norms' channel axis is 1, their x laid out
#: channels-last in memory when "channels_last" is set
CASES = [
    ("rms", "rms_norm", (5, 3, 129), {}),
    ("rms residual", "rms_norm", (7, 96), {"residual": True}),
    ("rms gemma", "rms_norm", (3, 200), {"weight_offset": 1}),
    ("ln", "layer_norm", (6, 257), {}),
    ("ln residual silu", "layer_norm", (4, 2, 64), {"residual": True, "activation": "silu"}),
    ("ln float32 residual", "layer_norm", (5, 160), {"residual": "float32"}),
    ("rms gated", "rms_norm", (4, 3, 96), {"gate": True}),
    ("rms gated first, groups", "rms_norm", (3, 128), {"gate": True, "norm_before_gate": False, "group_size": 32}),
    ("l3", "normalize", (5, 77), {"p": 3.0}),
    ("l2 axes", "normalize", (4, 6, 10), {"axis": (1, 2)}),
    ("mean abs", "mean_abs_normalize", (9, 33), {}),
    ("frobenius", "frobenius_normalize", (3, 5, 7), {}),
    ("gn", "group_norm", (3, 12, 5, 7), {"num_groups": 4}),
    ("gn nhwc gelu", "group_norm", (2, 12, 6, 3), {"num_groups": 3, "channels_last": True, "activation": "gelu"}),
    ("in", "instance_norm", (2, 6, 9, 5), {}),
    ("bn", "batch_norm", (4, 6, 5, 3), {}),
    ("bn nhwc", "batch_norm", (3, 8, 4, 5), {"channels_last": True}),
]

BACKENDS = ["numpy", pytest.param("cupy", marks=pytest.mark.gpu), pytest.param("torch", marks=pytest.mark.gpu),
            pytest.param("torch autograd", marks=pytest.mark.gpu), pytest.param("jax", marks=pytest.mark.gpu),
            pytest.param("jax.jit", marks=pytest.mark.gpu), pytest.param("jax.grad", marks=pytest.mark.gpu)]
#: the backends that take gradients, and the ops whose backward they run
GRADIENTS = {"torch autograd", "jax.grad"}


def _inputs(rng, op, shape, options, dtype):
    """The op's arrays (NumPy, ``dtype``) and keyword arguments."""
    x = random(rng, shape, dtype, scale=2.0, offset=0.5)
    if options.get("channels_last"):
        x = np.ascontiguousarray(np.moveaxis(x, 1, -1))
        x = np.moveaxis(x, -1, 1)  # (channels-last memory, NCHW shape)
    size = shape[1] if op.family == "channels" else shape[-1]
    arrays = {"x": x}
    for name in op.params:
        arrays[name] = random(rng, (size,), np.float32, 0.5, 1.0 if name == "weight" else 0.0)
    if options.get("residual"):  # (x's dtype, or the float32 residual stream)
        arrays["residual"] = random(rng, shape, np.float32 if options["residual"] == "float32" else dtype)
    if options.get("gate"):
        arrays["gate"] = random(rng, shape, dtype, scale=2.0)
    scalars = {k: v for k, v in options.items() if k not in ("residual", "gate", "channels_last", "p", "num_groups")}
    if op.running:
        scalars["training"] = True
    return arrays, scalars


def _call(module, op, arrays, scalars, options):
    fn = getattr(module, op.name)
    positional = [arrays["x"]]
    if "num_groups" in options:
        positional.append(options["num_groups"])
    if "p" in options:
        positional.append(options["p"])
    positional += [arrays[name] for name in op.params]
    keywords = dict(scalars)
    for name in ("residual", "gate"):
        if name in arrays:
            keywords[name] = arrays[name]
    return fn(*positional, **keywords)


def _first(results):
    return results[0] if isinstance(results, tuple) else results


def _reference(op, arrays, scalars, options):
    # (the residual keeps its dtype: the reference rounds h to it, as every backend does)
    wide = {k: v if v is None or k == "residual" else v.astype(np.float64) for k, v in arrays.items()}
    # (group_size is the public function's view of x: its NumPy path on float64 is the reference)
    return _first(_call(cunorm if "group_size" in scalars else _Reference(op), op, wide, scalars, options))


class _Reference:
    """cunorm.reference's function of an op, unrounded (exact=True)."""

    def __init__(self, op):
        setattr(self, op.name, functools.partial(op.reference, exact=True))


def _backward_reference(op, arrays, scalars, options, dy):
    """(dx, {parameter: gradient}) of sum(y * dy), in float64, through the
    public backward functions on NumPy arrays (the table's references)."""
    wide = {k: v.astype(np.float64) for k, v in arrays.items()}
    x = wide["x"] + wide["residual"] if "residual" in wide else wide["x"]
    forward = _call(cunorm, op, wide, {**scalars, "return_stats": True}, options) if op.statistics else None
    if any(k in scalars for k in ("weight_offset", "activation")):
        return None  # (their gradients are the framework's ops: checked against torch's in test_torch_gpu.py)
    if "gate" in wide:
        return None  # (the framework's ops around cunorm's norm: checked in test_gated_gpu.py)
    backward = getattr(cunorm, f"{op.name}_backward")
    axis = options.get("axis", -1 if op.family == "rows" else None)
    if op.family == "rows" and not op.statistics:
        extra = (options["p"],) if "p" in options else ()
        kwargs = {} if op.name == "frobenius_normalize" else {"axis": axis}
        return backward(dy, x, *extra, **kwargs), {}
    stats = list(forward[-len(op.statistics):])
    params = [wide[name] for name in op.params]
    if op.family == "rows":
        dx, *grads = backward(dy, x, *stats, *params)
    else:
        groups = (options["num_groups"],) if "num_groups" in options else ()
        dx, *grads = backward(dy, x, *stats, *groups, *params)
    return dx, dict(zip(op.params, grads))


# --- the backends ----------------------------------------------------------------------------------------------------

def _run(backend, op, arrays, scalars, options, dy):
    """(y, dx, {parameter: gradient}) as NumPy arrays (the gradients None
    where the backend takes none)."""
    if backend == "numpy":
        return np.asarray(_first(_call(cunorm, op, arrays, scalars, options))), None, None
    if backend == "cupy":
        import cupy

        y = _first(_call(cunorm, op, {k: cupy.asarray(v) for k, v in arrays.items()}, scalars, options))
        assert isinstance(y, cupy.ndarray)
        return cupy.asnumpy(y), None, None
    if backend.startswith("torch"):
        return _run_torch(backend, op, arrays, scalars, options, dy)
    return _run_jax(backend, op, arrays, scalars, options, dy)


def _torch_tensor(torch, a, grad=False):
    dtype = getattr(torch, str(a.dtype))
    t = torch.from_numpy(np.ascontiguousarray(a).astype(np.float32)).to("cuda", dtype)
    if a.ndim == 4 and not a.flags.c_contiguous:  # (channels-last memory)
        t = t.contiguous(memory_format=torch.channels_last)
    return t.requires_grad_(grad)


def _numpy_of(t):
    return t.detach().float().cpu().numpy()


def _run_torch(backend, op, arrays, scalars, options, dy):
    torch = pytest.importorskip("torch")
    import cunorm.torch

    grad = backend == "torch autograd"
    tensors = {k: _torch_tensor(torch, v, grad) for k, v in arrays.items()}
    y = _first(_call(cunorm.torch, op, tensors, scalars, options))
    assert isinstance(y, torch.Tensor)
    if not grad:
        return _numpy_of(y), None, None
    (y.float() * _torch_tensor(torch, dy.astype(np.float32))).sum().backward()
    return _numpy_of(y), _numpy_of(tensors["x"].grad), {name: _numpy_of(tensors[name].grad) for name in op.params}


def _run_jax(backend, op, arrays, scalars, options, dy):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cunorm.jax

    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("jax without its CUDA plugin")
    values = {k: jax.device_put(jnp.asarray(v), gpu) for k, v in arrays.items()}
    names = list(values)

    def f(*args):
        return _first(_call(cunorm.jax, op, dict(zip(names, args)), scalars, options))

    if backend == "jax":
        return np.asarray(f(*values.values()).astype(jnp.float32)), None, None
    if backend == "jax.jit":
        return np.asarray(jax.jit(f)(*values.values()).astype(jnp.float32)), None, None
    g = jnp.asarray(dy.astype(np.float32))
    y = f(*values.values())
    wanted = [i for i, n in enumerate(names) if n == "x" or n in op.params]
    grads = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * g), argnums=wanted)(*values.values())
    found = dict(zip([names[i] for i in wanted], grads))
    return (np.asarray(y.astype(jnp.float32)), np.asarray(found["x"].astype(jnp.float32)),
            {name: np.asarray(found[name]) for name in op.params})


# --- the one body ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_op_on_every_backend(request, rng, backend, dtype, case):
    _, name, shape, options = case
    if backend == "cupy":
        request.getfixturevalue("poisoned")  # (every CuPy allocation starts as NaN)
    op = ops.OPS[name]
    dt = np.dtype(getattr(dtypes, dtype))
    if backend in GRADIENTS and dt != np.float32:
        pytest.skip("gradients are compared in float32 (test_backward_gpu.py covers 16-bit dx)")
    if backend == "numpy" and dt != np.float32:
        pytest.skip("the NumPy path is the reference itself at any dtype")
    arrays, scalars = _inputs(rng, op, shape, options, dt)
    kept = {k: v.copy() for k, v in arrays.items()}
    dy = random(rng, shape, np.float64)
    y, dx, grads = _run(backend, op, arrays, scalars, options, dy)
    if backend == "numpy":  # (the other backends get copies; tests/test_views_gpu.py checks their inputs)
        for k, v in arrays.items():
            assert np.array_equal(v, kept[k], equal_nan=True) and v.dtype == kept[k].dtype, f"{k} was written to"
    want = _reference(op, arrays, scalars, options)
    tol = RTOL[dt]
    assert y.shape == want.shape
    assert_close(y, want, dt, rtol=tol, atol=tol * output_scale(want), what=f"{backend} y")
    if dx is None:
        return
    expected = _backward_reference(op, arrays, scalars, options, dy)
    if expected is None:
        return
    want_dx, want_grads = expected
    rtol = 20 * RTOL[np.dtype(np.float32)]
    assert_close(dx, want_dx, np.float32, rtol=rtol, atol=rtol * output_scale(want_dx), what=f"{backend} dx")
    for pname, g in grads.items():
        assert_close(g, want_grads[pname], np.float32, rtol=rtol, atol=rtol * output_scale(want_grads[pname]),
                     what=f"{backend} d{pname}")
