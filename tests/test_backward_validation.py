"""The backward functions' argument checks, against NumPy (CPU, in CI) and
CuPy (GPU): every error is raised before any launch and names what was
expected."""
import numpy as np
import pytest

import cunorm


def test_backward_errors(xp):
    x = xp.ones((4, 8), np.float32)
    _, rstd = cunorm.rms_norm(x, return_stats=True)
    with pytest.raises(ValueError, match="dy must have x's shape"):
        cunorm.rms_norm_backward(x[:2], x, rstd)
    with pytest.raises(TypeError, match="dy must have x's dtype"):
        cunorm.rms_norm_backward(x.astype(np.float64), x, rstd)
    with pytest.raises(TypeError, match="rstd must have dtype float32"):
        cunorm.rms_norm_backward(x, x, rstd.astype(np.float64))
    with pytest.raises(ValueError, match="statistics shape"):
        cunorm.rms_norm_backward(x, x, rstd[:2])
    with pytest.raises(ValueError, match="weight must have the shape"):
        cunorm.rms_norm_backward(x, x, rstd, xp.ones(7, np.float32))
    with pytest.raises(TypeError, match="rstd is required"):
        cunorm.rms_norm_backward(x, x, None)
    with pytest.raises(ValueError, match="dh must have x's shape"):
        cunorm.layer_norm_backward(x, x, rstd, rstd, dh=x[:1])


def test_gated_backward_errors(xp):
    from cunorm.backward import rms_norm_gated_backward

    x = xp.ones((4, 8), np.float32)
    _, rstd = cunorm.rms_norm(x, gate=x, return_stats=True)
    with pytest.raises(ValueError, match="gate must have x's shape"):
        rms_norm_gated_backward(x, x, rstd, gate=x[:2])
    with pytest.raises(TypeError, match="gate must have x's dtype"):
        rms_norm_gated_backward(x, x, rstd, gate=x.astype(np.float64))
    with pytest.raises(TypeError, match="gate is required"):
        rms_norm_gated_backward(x, x, rstd, gate=None)
    with pytest.raises(TypeError, match="norm_before_gate must be a bool"):
        rms_norm_gated_backward(x, x, rstd, gate=x, norm_before_gate="yes")
    with pytest.raises(ValueError, match="weight must have the shape"):
        rms_norm_gated_backward(x, x, rstd, xp.ones((2, 8), np.float32), gate=x)
    _, rstd0 = cunorm.rms_norm(x, axis=0, return_stats=True)
    with pytest.raises(ValueError, match="trailing axes"):
        rms_norm_gated_backward(x, x, rstd0, gate=x, axis=0)


def test_channel_backward_errors(xp):
    x = xp.ones((2, 6, 5), np.float32)
    _, mean, rstd = cunorm.group_norm(x, 3, return_stats=True)
    with pytest.raises(ValueError, match="statistics shape"):
        cunorm.group_norm_backward(x, x, mean, rstd, 2)
    with pytest.raises(ValueError, match="num_groups must be >= 1 and divide"):
        cunorm.group_norm_backward(x, x, mean, rstd, 4)
    with pytest.raises(TypeError, match="running_var is required"):
        cunorm.batch_norm_backward(x, x, xp.zeros(6, np.float32), None, training=False)
