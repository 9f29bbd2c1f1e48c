"""The float64 reference of group_norm, instance_norm and batch_norm against
loop definitions (CPU)."""
import numpy as np
import pytest

import cunorm
from cunorm import reference


def loop_group_norm(x, groups, w, b, eps):
    n, c = x.shape[:2]
    y = np.empty(x.shape)
    cg = c // groups
    for i in range(n):
        for g in range(groups):
            block = x[i, g * cg : (g + 1) * cg].astype(np.float64)
            mean = block.mean()
            var = ((block - mean) ** 2).mean()
            for k in range(cg):
                ch = g * cg + k
                y[i, ch] = (x[i, ch] - mean) / np.sqrt(var + eps) * w[ch] + b[ch]
    return y


@pytest.mark.parametrize("shape,groups", [((3, 6, 5, 7), 3), ((2, 4), 2), ((2, 8, 9), 8), ((1, 4, 3), 1)])
def test_group_norm_loop(rng, shape, groups):
    x = rng.standard_normal(shape) * 3 + 2
    w, b = rng.standard_normal(shape[1]), rng.standard_normal(shape[1])
    y = reference.group_norm(x, groups, w, b, exact=True)
    np.testing.assert_allclose(y, loop_group_norm(x, groups, w, b, 1e-5), rtol=1e-12, atol=1e-12)


def test_channels_last_is_a_transpose(rng):
    x = rng.standard_normal((2, 5, 3, 8))  # (N, H, W, C)
    w = rng.standard_normal(8)
    y = reference.group_norm(x, 4, w, None, channel_axis=-1, exact=True)
    want = reference.group_norm(np.moveaxis(x, -1, 1), 4, w, None, exact=True)
    np.testing.assert_allclose(y, np.moveaxis(want, 1, -1), rtol=1e-13)


def test_instance_norm_is_group_norm_per_channel(rng):
    x = rng.standard_normal((2, 3, 4, 5))
    np.testing.assert_allclose(reference.instance_norm(x, exact=True), reference.group_norm(x, 3, exact=True))


def test_batch_norm_training_and_running(rng):
    x = rng.standard_normal((4, 3, 5, 2)) * 2 + 1
    rm, rv = rng.standard_normal(3), rng.random(3) + 0.5
    rm0, rv0 = rm.copy(), rv.copy()
    y, mean, rstd = reference.batch_norm(x, running_mean=rm, running_var=rv, momentum=0.25, return_stats=True,
                                         exact=True)
    per_channel = np.moveaxis(x, 1, 0).reshape(3, -1)
    m, v = per_channel.mean(axis=1), per_channel.var(axis=1)
    np.testing.assert_allclose(mean, m)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(v + 1e-5))
    np.testing.assert_allclose(y, (x - m[:, None, None]) / np.sqrt(v[:, None, None] + 1e-5))
    n = per_channel.shape[1]
    np.testing.assert_allclose(rm, 0.75 * rm0 + 0.25 * m)
    np.testing.assert_allclose(rv, 0.75 * rv0 + 0.25 * v * n / (n - 1))


def test_batch_norm_eval_uses_running(rng):
    x = rng.standard_normal((4, 3, 5))
    rm, rv = rng.standard_normal(3), rng.random(3) + 0.5
    w, b = rng.standard_normal(3), rng.standard_normal(3)
    y = reference.batch_norm(x, w, b, running_mean=rm, running_var=rv, training=False, exact=True)
    want = (x - rm[:, None]) / np.sqrt(rv[:, None] + 1e-5) * w[:, None] + b[:, None]
    np.testing.assert_allclose(y, want)


def test_nonfinite_group_is_nan_and_only_it(rng):
    x = rng.standard_normal((2, 4, 6)).astype(np.float32)
    x[1, 2, 3] = np.inf
    y, mean, rstd = cunorm.group_norm(x, 2, return_stats=True)
    assert np.isnan(y[1, 2:]).all() and np.isfinite(y[1, :2]).all() and np.isfinite(y[0]).all()
    assert np.isnan(mean[1, 1]) and np.isfinite(mean).sum() == 3


def test_numpy_path_updates_running_in_place(rng):
    x = rng.standard_normal((4, 3, 5)).astype(np.float32)
    rm, rv = np.zeros(3, np.float32), np.ones(3, np.float32)
    cunorm.batch_norm(x, running_mean=rm, running_var=rv)
    assert rm.dtype == np.float32 and np.any(rm != 0) and np.any(rv != 1)
