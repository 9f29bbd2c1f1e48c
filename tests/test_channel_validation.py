"""group_norm, instance_norm and batch_norm: bad input gets a clear
TypeError/ValueError before any launch. The same bodies run on NumPy arrays
(CPU, in CI) and on CuPy arrays (GPU)."""
import numpy as np
import pytest

import cunorm

from helpers import arr


@pytest.mark.parametrize("groups", [0, -1, 3, 5])
def test_groups_must_divide_channels(xp, groups):
    with pytest.raises(ValueError, match=f"num_groups must be >= 1 and divide the 4 channels, got {groups}"):
        cunorm.group_norm(arr(xp, (2, 4, 3)), groups)


@pytest.mark.parametrize("groups", [2.0, "2", None, True])
def test_groups_must_be_int(xp, groups):
    with pytest.raises(TypeError, match="num_groups must be an int"):
        cunorm.group_norm(arr(xp, (2, 4, 3)), groups)


@pytest.mark.parametrize("op", ["group", "instance", "batch"])
@pytest.mark.parametrize("name", ["weight", "bias"])
@pytest.mark.parametrize("shape", [(3,), (4, 1), (1, 4), ()])
def test_param_shape(xp, op, name, shape):
    x = arr(xp, (2, 4, 3))
    args = (x, 2) if op == "group" else (x,)
    with pytest.raises(ValueError, match=rf"{name} must have shape \(4,\), one per channel"):
        getattr(cunorm, f"{op}_norm")(*args, **{name: arr(xp, shape)})


@pytest.mark.parametrize("op", ["group", "instance", "batch"])
def test_param_dtype(xp, op):
    x = arr(xp, (2, 4, 3))
    args = (x, 2) if op == "group" else (x,)
    with pytest.raises(TypeError, match="weight must have dtype"):
        getattr(cunorm, f"{op}_norm")(*args, weight=xp.ones(4, dtype=np.int32))


@pytest.mark.parametrize("axis", [0, 2, -2, 4, -5])
def test_channel_axis_first_or_last(xp, axis):
    with pytest.raises(ValueError, match=f"channel_axis must be 1 .channels-first. or -1 .channels-last. .* got {axis}"):
        cunorm.group_norm(arr(xp, (2, 4, 3, 5)), 1, channel_axis=axis)


@pytest.mark.parametrize("axis", [1.0, None, True, (1,)])
def test_channel_axis_type(xp, axis):
    with pytest.raises(TypeError, match="channel_axis must be an int"):
        cunorm.instance_norm(arr(xp, (2, 4, 3)), channel_axis=axis)


@pytest.mark.parametrize("op", ["group", "instance", "batch"])
def test_needs_two_dims(xp, op):
    x = arr(xp, (4,))
    with pytest.raises(ValueError, match=r"a batch and a channel axis \(N, C, ...\), got shape \(4,\)"):
        getattr(cunorm, f"{op}_norm")(*((x, 1) if op == "group" else (x,)))


@pytest.mark.parametrize("eps", [-1e-5, float("nan"), float("inf")])
@pytest.mark.parametrize("op", ["group", "instance", "batch"])
def test_bad_eps(xp, op, eps):
    x = arr(xp, (2, 4, 3))
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        getattr(cunorm, f"{op}_norm")(*((x, 2) if op == "group" else (x,)), eps=eps)


def test_instance_norm_single_spatial_element(xp):
    with pytest.raises(ValueError, match="more than one spatial element"):
        cunorm.instance_norm(arr(xp, (2, 4, 1, 1)))


def test_batch_norm_single_value_per_channel(xp):
    with pytest.raises(ValueError, match="more than one value per channel"):
        cunorm.batch_norm(arr(xp, (1, 4, 1)))
    cunorm.batch_norm(arr(xp, (1, 4, 1)), running_mean=xp.zeros(4), running_var=xp.ones(4), training=False)


def test_batch_norm_eval_needs_running(xp):
    with pytest.raises(ValueError, match="pass running_mean and running_var"):
        cunorm.batch_norm(arr(xp, (2, 4, 3)), running_mean=xp.zeros(4, dtype=np.float32), training=False)


@pytest.mark.parametrize("name", ["running_mean", "running_var"])
def test_running_shape(xp, name):
    with pytest.raises(ValueError, match=rf"{name} must have shape \(4,\)"):
        cunorm.batch_norm(arr(xp, (2, 4, 3)), **{name: xp.zeros(3, dtype=np.float32)})


def test_running_dtype(xp):
    with pytest.raises(TypeError, match="running_mean must have dtype"):
        cunorm.batch_norm(arr(xp, (2, 4, 3)), running_mean=xp.zeros(4, dtype=np.int64))


def test_running_only_for_batch_norm(xp):
    from cunorm._engine import channel_norms

    with pytest.raises(ValueError, match="running_mean is a batch_norm argument"):
        channel_norms.ChannelCall("group", arr(xp, (2, 4, 3)), num_groups=2, eps=1e-5, channel_axis=1,
                                  running_mean=xp.zeros(4, dtype=np.float32))


@pytest.mark.parametrize("momentum", [-0.1, 1.5, float("nan")])
def test_bad_momentum(xp, momentum):
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\]"):
        cunorm.batch_norm(arr(xp, (2, 4, 3)), momentum=momentum)


@pytest.mark.parametrize("momentum", [None, "0.1", True])
def test_momentum_type(xp, momentum):
    with pytest.raises(TypeError, match="momentum must be a real number"):
        cunorm.batch_norm(arr(xp, (2, 4, 3)), momentum=momentum)


@pytest.mark.parametrize("flag", ["training", "return_stats"])
def test_flags_must_be_bool(xp, flag):
    with pytest.raises(TypeError, match=f"{flag} must be True or False"):
        cunorm.batch_norm(arr(xp, (2, 4, 3)), **{flag: 1})


def test_out_wrong_shape(xp):
    with pytest.raises(ValueError, match="out must have x's shape"):
        cunorm.group_norm(arr(xp, (2, 4, 3)), 2, out=xp.empty((2, 4, 4), dtype=np.float32))


@pytest.mark.gpu
def test_out_wrong_layout():
    import cupy

    x = arr(cupy, (2, 4, 3, 5))
    out = cupy.empty((2, 3, 5, 4), dtype=np.float32).transpose(0, 3, 1, 2)  # channels-last memory
    with pytest.raises(ValueError, match="out must have x's memory layout"):
        cunorm.group_norm(x, 2, out=out)


@pytest.mark.gpu
def test_out_overlapping_x():
    x = arr(__import__("cupy"), (2, 4, 3))
    with pytest.raises(ValueError, match="out overlaps x"):
        cunorm.instance_norm(x, out=x)


@pytest.mark.gpu
def test_mixed_sides():
    import cupy

    with pytest.raises(TypeError, match="weight is a NumPy array but x is a GPU array"):
        cunorm.group_norm(arr(cupy, (2, 4, 3)), 2, weight=np.ones(4, np.float32))
    with pytest.raises(TypeError, match="running_mean is a NumPy array but x is a GPU array"):
        cunorm.batch_norm(arr(cupy, (2, 4, 3)), running_mean=np.zeros(4, np.float32))
