"""Bad input gets a clear TypeError/ValueError before any launch. The same
bodies run on NumPy arrays (CPU, in CI) and on CuPy arrays (GPU)."""
import numpy as np
import pytest

import cunorm

from helpers import arr


@pytest.mark.parametrize("bad", [[1.0, 2.0], 3.0, "x", None])
def test_wrong_kind(bad):
    with pytest.raises(TypeError, match="x must be a CuPy, NumPy, torch or JAX array"):
        cunorm.rms_norm(bad)


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.bool_, np.complex64, np.uint16])
def test_wrong_dtype(xp, dtype):
    x = xp.zeros((2, 4), dtype=dtype)
    with pytest.raises(TypeError, match=r"x must have dtype float16, bfloat16, float32 or float64, got"):
        cunorm.rms_norm(x)


def test_weight_wrong_dtype(xp):
    with pytest.raises(TypeError, match="weight must have dtype"):
        cunorm.rms_norm(arr(xp, (2, 4)), xp.ones(4, dtype=np.int64))


@pytest.mark.parametrize("axis", [2, -3, 5])
def test_axis_out_of_range(xp, axis):
    with pytest.raises(ValueError, match=f"axis {axis} is out of range for an array of 2 dimension"):
        cunorm.rms_norm(arr(xp, (2, 4)), axis=axis)


def test_axis_not_adjacent(xp):
    with pytest.raises(ValueError, match="adjacent"):
        cunorm.rms_norm(arr(xp, (2, 3, 4)), axis=(0, 2))


def test_axis_repeated(xp):
    with pytest.raises(ValueError, match="twice"):
        cunorm.rms_norm(arr(xp, (2, 3, 4)), axis=(1, -2))


@pytest.mark.parametrize("axis", [1.0, "1", (1, 1.5), True])
def test_axis_wrong_type(xp, axis):
    with pytest.raises(TypeError, match="axis must be an int or a tuple of ints"):
        cunorm.rms_norm(arr(xp, (2, 4)), axis=axis)


def test_axis_empty_tuple(xp):
    with pytest.raises(ValueError, match="at least one axis"):
        cunorm.rms_norm(arr(xp, (2, 4)), axis=())


def test_scalar_input(xp):
    with pytest.raises(ValueError, match="out of range for an array of 0 dimension"):
        cunorm.rms_norm(xp.asarray(np.float32(1.0)))


@pytest.mark.parametrize("shape", [(3,), (4, 1), (1, 4), ()])
def test_weight_wrong_shape(xp, shape):
    with pytest.raises(ValueError, match=r"weight must have the shape of the normalized axes \(4,\), got"):
        cunorm.rms_norm(arr(xp, (2, 4)), xp.ones(shape, dtype=np.float32))


def test_weight_shape_multi_axis(xp):
    x = arr(xp, (2, 3, 4))
    with pytest.raises(ValueError, match=r"\(3, 4\), got \(12,\)"):
        cunorm.rms_norm(x, xp.ones(12, dtype=np.float32), axis=(1, 2))


@pytest.mark.parametrize("eps", [-1e-6, float("nan"), float("inf")])
def test_bad_eps(xp, eps):
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        cunorm.rms_norm(arr(xp, (2, 4)), eps=eps)


@pytest.mark.parametrize("eps", ["1e-5", None, True])
def test_eps_wrong_type(xp, eps):
    with pytest.raises(TypeError, match="eps must be a real number"):
        cunorm.rms_norm(arr(xp, (2, 4)), eps=eps)


def test_out_wrong_shape(xp):
    with pytest.raises(ValueError, match="out must have x's shape"):
        cunorm.rms_norm(arr(xp, (2, 4)), out=xp.empty((2, 5), dtype=np.float32))


def test_out_wrong_dtype(xp):
    with pytest.raises(ValueError, match="dtype float32"):
        cunorm.rms_norm(arr(xp, (2, 4)), out=xp.empty((2, 4), dtype=np.float64))


def test_out_not_contiguous(xp):
    with pytest.raises(ValueError, match="C-contiguous"):
        cunorm.rms_norm(arr(xp, (4, 2)), out=xp.empty((2, 4), dtype=np.float32).T)


def test_mixed_sides():
    pytest.importorskip("cupy")
    x = np.ones((2, 4), dtype=np.float32)
    import cupy

    try:
        w = cupy.ones(4, dtype=np.float32)
    except Exception:
        pytest.skip("no GPU to make a GPU weight")
    with pytest.raises(TypeError, match="weight is a GPU array but x is a NumPy array"):
        cunorm.rms_norm(x, w)


@pytest.mark.gpu
def test_numpy_weight_with_gpu_x():
    import cupy

    with pytest.raises(TypeError, match="weight is a NumPy array but x is a GPU array"):
        cunorm.rms_norm(cupy.ones((2, 4), dtype=np.float32), np.ones(4, dtype=np.float32))


@pytest.mark.gpu
def test_out_overlapping_x():
    import cupy

    buf = cupy.ones(12, dtype=np.float32)
    x = buf[:8].reshape(2, 4)
    with pytest.raises(ValueError, match="overlaps"):
        cunorm.rms_norm(x, out=buf[4:].reshape(2, 4))


def test_bias_wrong_shape(xp):
    with pytest.raises(ValueError, match=r"bias must have the shape of the normalized axes \(4,\), got \(5,\)"):
        cunorm.layer_norm(arr(xp, (2, 4)), None, xp.ones(5, dtype=np.float32))


def test_bias_wrong_dtype(xp):
    with pytest.raises(TypeError, match="bias must have dtype"):
        cunorm.layer_norm(arr(xp, (2, 4)), None, xp.ones(4, dtype=np.int32))


@pytest.mark.parametrize("op", [cunorm.rms_norm, cunorm.layer_norm])
def test_residual_wrong_shape(xp, op):
    with pytest.raises(ValueError, match=r"residual must have x's shape \(2, 4\), got \(4,\)"):
        op(arr(xp, (2, 4)), residual=arr(xp, (4,)))


@pytest.mark.parametrize("op", [cunorm.rms_norm, cunorm.layer_norm])
def test_residual_wrong_dtype(xp, op):
    with pytest.raises(TypeError, match=r"residual must have x's dtype float32 \(or float32 under 16-bit.*float16"):
        op(arr(xp, (2, 4)), residual=arr(xp, (2, 4), np.float16))


def test_residual_wrong_kind():
    with pytest.raises(TypeError, match="residual must be a CuPy, NumPy, torch or JAX array"):
        cunorm.layer_norm(np.ones((2, 4), np.float32), residual=[[1.0] * 4] * 2)


@pytest.mark.parametrize("flag", [1, "yes", None])
def test_return_stats_must_be_bool(xp, flag):
    with pytest.raises(TypeError, match="return_stats must be True or False"):
        cunorm.layer_norm(arr(xp, (2, 4)), return_stats=flag)


def test_layer_norm_axis_errors(xp):
    with pytest.raises(ValueError, match="adjacent"):
        cunorm.layer_norm(arr(xp, (2, 3, 4)), axis=(0, 2))
    with pytest.raises(ValueError, match="eps must be finite"):
        cunorm.layer_norm(arr(xp, (2, 3, 4)), eps=-1.0)


@pytest.mark.gpu
def test_out_overlapping_residual():
    import cupy

    x = cupy.ones((2, 4), dtype=np.float32)
    r = cupy.ones((2, 4), dtype=np.float32)
    with pytest.raises(ValueError, match="out overlaps residual"):
        cunorm.rms_norm(x, residual=r, out=r)


def test_axis_validation_does_not_depend_on_what_was_seen_before():
    """(True,) and (1.0,) are refused after (1,) has been accepted (the
    axis memo keys exact ints only)."""
    x = np.ones((3, 4), np.float32)
    cunorm.layer_norm(x, axis=(1,))
    cunorm.layer_norm(x, axis=1)
    for bad in ((True,), (1.0,), True, 1.0):
        with pytest.raises(TypeError, match="axis must be an int"):
            cunorm.layer_norm(x, axis=bad)


@pytest.mark.parametrize("eps", [1e39, 1e-46])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "group_norm", "batch_norm"])
def test_an_eps_float32_cannot_hold_is_refused(op, eps):
    """An eps the float32 statistics would hold as inf or 0 is a ValueError
    on the NumPy path as on the GPU's (float64 x keeps float64 statistics
    and takes it)."""
    x = np.random.default_rng().standard_normal((4, 6, 5)).astype(np.float32)
    call = {"group_norm": lambda a, e: cunorm.group_norm(a, 2, eps=e),
            "batch_norm": lambda a, e: cunorm.batch_norm(a, eps=e)}.get(op, lambda a, e: getattr(cunorm, op)(a, eps=e))
    with pytest.raises(ValueError, match="does not survive the cast to float32"):
        call(x, eps)
    assert np.isfinite(call(x.astype(np.float64), eps)).all()


def test_a_masked_array_is_refused():
    """A NumPy masked array's mask would be ignored: a TypeError names it,
    for x and for a parameter alike."""
    x = np.ones((3, 4), np.float32)
    masked = np.ma.masked_array(x, mask=x > 0)
    with pytest.raises(TypeError, match="masked array"):
        cunorm.layer_norm(masked)
    with pytest.raises(TypeError, match="masked array"):
        cunorm.layer_norm(x, np.ma.masked_array(np.ones(4, np.float32)))


def test_overlapping_outputs_and_running_buffers_are_refused_on_every_path():
    """out overlapping x (other than x itself), running buffers aliasing each
    other or x: ValueError before anything is written, NumPy as GPU."""
    base = np.random.default_rng().standard_normal(65).astype(np.float32)
    x, shifted = base[:60].reshape(4, 3, 5), base[5:].reshape(4, 3, 5)  # (shifted: x's memory, 5 on)
    before = x.copy()
    with pytest.raises(ValueError, match="out overlaps x"):
        cunorm.layer_norm(x, out=shifted)
    with pytest.raises(ValueError, match="out overlaps x"):
        cunorm.group_norm(x, 3, out=shifted)
    buf = np.zeros(6, np.float32)
    with pytest.raises(ValueError, match="running_mean and running_var overlap"):
        cunorm.batch_norm(x, running_mean=buf[:3], running_var=buf[2:5], training=True)
    with pytest.raises(ValueError, match="running_var overlaps x"):
        cunorm.batch_norm(x, running_mean=np.zeros(3, np.float32), running_var=x.reshape(-1)[:3], training=True)
    assert np.array_equal(x, before)
    y = cunorm.layer_norm(x.copy(), out=None)
    inplace = x.copy()
    assert cunorm.layer_norm(inplace, out=inplace) is inplace and np.allclose(inplace, y, atol=1e-6)


@pytest.mark.gpu
def test_views_that_are_not_whole_elements_are_refused():
    """A CuPy view made from a byte offset or byte strides that are not whole
    elements: ValueError naming the argument, for x, a parameter, out and dy
    alike (the kernels would round the address down)."""
    import cupy

    base = cupy.zeros(256, np.float32)
    good = cupy.ones((4, 8), np.float32)
    shifted = cupy.ndarray((4, 8), np.float32, base.data + 2)
    odd_strides = cupy.ndarray((4, 8), np.float32, base.data, strides=(34, 4))
    for bad in (shifted, odd_strides):
        with pytest.raises(ValueError, match="x is a view whose address or strides are not whole 4-byte"):
            cunorm.rms_norm(bad)
        with pytest.raises(ValueError, match="out is a view"):
            cunorm.rms_norm(good, out=bad)
        with pytest.raises(ValueError, match="x is a view"):
            cunorm.group_norm(bad.reshape(4, 8, 1) if bad is shifted else cupy.ndarray(
                (4, 8, 1), np.float32, base.data, strides=(34, 4, 4)), 2)
        _, rstd = cunorm.rms_norm(good, return_stats=True)
        with pytest.raises(ValueError, match="dy is a view"):
            cunorm.rms_norm_backward(bad, good, rstd)
    with pytest.raises(ValueError, match="weight is a view"):
        cunorm.rms_norm(good, cupy.ndarray((8,), np.float32, base.data + 1))
    assert float(cupy.abs(base).sum()) == 0  # nothing was written


def test_eps_float32_limits_are_numpys_cast():
    """check_eps's two thresholds refuse exactly the eps NumPy's float32
    cast turns into inf or 0, at each boundary and one float64 step inside."""
    from cunorm._engine import row_norms

    for edge in (row_norms._F32_ROUNDS_TO_INF, row_norms._F32_ROUNDS_TO_ZERO):
        for value in (edge, float(np.nextafter(edge, 1.0)), float(np.nextafter(edge, 0.0))):
            with np.errstate(over="ignore"):
                held = np.float32(value)
            lost = not np.isfinite(held) or held == 0
            try:
                row_norms.check_eps(value, np.dtype(np.float32))
                refused = False
            except ValueError:
                refused = True
            assert refused == lost, value
            row_norms.check_eps(value, np.dtype(np.float64))  # float64 statistics hold every finite eps


def _readonly(a):
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("which", ["running_mean", "running_var"])
def test_a_read_only_running_buffer_is_refused_before_anything_is_written(which):
    """NumPy path: a read-only running buffer (either one) is a ValueError
    naming it, and neither buffer changes (the reference used to write
    running_mean, then fail on running_var)."""
    x = np.random.default_rng().standard_normal((4, 3, 5)).astype(np.float32)
    buffers = {"running_mean": np.zeros(3, np.float32), "running_var": np.ones(3, np.float32)}
    _readonly(buffers[which])
    before = {k: v.copy() for k, v in buffers.items()}
    with pytest.raises(ValueError, match=f"{which} is a read-only NumPy array"):
        cunorm.batch_norm(x, **buffers)
    for k, v in buffers.items():
        assert np.array_equal(v, before[k]), k
    # the reference itself checks both before it writes either
    with pytest.raises(ValueError, match="read-only"):
        cunorm.reference.batch_norm(x, **buffers)
    for k, v in buffers.items():
        assert np.array_equal(v, before[k]), k
    # eval mode only reads them: a read-only buffer is fine there
    y = cunorm.batch_norm(x, **buffers, training=False)
    assert np.isfinite(y).all()


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "normalize", "group_norm"])
def test_a_read_only_out_is_refused(op):
    x = np.random.default_rng().standard_normal((4, 6, 5)).astype(np.float32)
    out = _readonly(np.full_like(x, np.nan))
    args = (x, 2) if op == "group_norm" else (x,)
    with pytest.raises(ValueError, match="out is a read-only NumPy array"):
        getattr(cunorm, op)(*args, out=out)
    assert np.isnan(out).all()


def test_out_overlapping_a_parameter_or_running_buffer_is_refused():
    """out may not overlap anything the call reads (weight, bias, running
    buffers), nor a running buffer the weight: ValueError, nothing written."""
    rng = np.random.default_rng()
    x = rng.standard_normal((4, 6)).astype(np.float32)
    out = np.zeros((4, 6), np.float32)
    with pytest.raises(ValueError, match="out overlaps weight"):
        cunorm.rms_norm(x, out[1], out=out)
    with pytest.raises(ValueError, match="out overlaps bias"):
        cunorm.layer_norm(x, None, out[2], out=out)
    xc = rng.standard_normal((4, 3, 5)).astype(np.float32)
    outc = np.zeros((4, 3, 5), np.float32)
    with pytest.raises(ValueError, match="out overlaps running_var"):
        cunorm.batch_norm(xc, running_mean=np.zeros(3, np.float32), running_var=outc[0, :, 0], out=outc)
    w = np.ones(6, np.float32)
    with pytest.raises(ValueError, match="running_mean overlaps weight"):
        cunorm.batch_norm(xc, w[:3], running_mean=w[:3], running_var=np.ones(3, np.float32))
    assert not outc.any() and not out.any() and np.array_equal(w, np.ones(6, np.float32))
