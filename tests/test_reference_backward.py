"""The reference backward functions, which every GPU backward test trusts,
checked independently: against central finite differences of the float64
reference forward (CPU). For each op, L = sum(dy * y) [+ sum(dh * h)] and
dL/dx, dL/dweight, dL/dbias from differences of L agree with the backward
to ~1e-7 of the gradient's largest entry (the differences' error is
O(step**2) + rounding / step, about 1e-10 here)."""
import numpy as np
import pytest

from cunorm import reference as R

STEP = 1e-5


def _numeric(loss, arrays):
    """Central differences of loss() with respect to each array, in place."""
    grads = []
    for a in arrays:
        g = np.empty_like(a)
        for i in np.ndindex(a.shape):
            keep = a[i]
            a[i] = keep + STEP
            up = loss()
            a[i] = keep - STEP
            down = loss()
            a[i] = keep
            g[i] = (up - down) / (2 * STEP)
        grads.append(g)
    return grads


def _close(got, want, what):
    scale = np.max(np.abs(want))
    assert scale > 0, what
    err = np.max(np.abs(np.asarray(got, np.float64) - want)) / scale
    assert err < 1e-7, f"{what}: finite differences off by {err:.2e} of the largest entry"


def _data(rng, shape):
    return rng.standard_normal(shape) * 1.5 + 0.3


@pytest.mark.parametrize("norm", ["rms", "ln"])
@pytest.mark.parametrize("shape,axis", [((3, 7), -1), ((2, 3, 4, 2), (1, 2)), ((4, 5, 3), 1)], ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_row_norm_backward(rng, norm, shape, axis, residual):
    x, r = _data(rng, shape), _data(rng, shape)
    axes = (axis,) if isinstance(axis, int) else axis
    pshape = tuple(shape[a] for a in axes)
    w, b = _data(rng, pshape), _data(rng, pshape)
    dy, dh = rng.standard_normal(shape), rng.standard_normal(shape)
    res = r if residual else None
    kw = dict(axis=axis, eps=1e-5, exact=True, residual=res)
    fwd = (lambda: R.rms_norm(x, w, **kw)) if norm == "rms" else (lambda: R.layer_norm(x, w, b, **kw))

    def loss():
        out = fwd()
        return np.sum(dy * out[0]) + np.sum(dh * out[1]) if residual else np.sum(dy * out)

    params = [x, w] if norm == "rms" else [x, w, b]
    want = _numeric(loss, params)
    h = x + r if residual else x
    if norm == "rms":
        _, rstd = R.rms_norm(h, w, axis=axis, eps=1e-5, exact=True, return_stats=True)
        got = R.rms_norm_backward(dy, h, rstd, w, axis=axis, dh=dh if residual else None, exact=True)
    else:
        _, mean, rstd = R.layer_norm(h, w, b, axis=axis, eps=1e-5, exact=True, return_stats=True)
        got = R.layer_norm_backward(dy, h, mean, rstd, w, b, axis=axis, dh=dh if residual else None, exact=True)
    for g, n, name in zip(got, want, ("dx", "dweight", "dbias")):
        _close(g, n, f"{norm} {name}")


@pytest.mark.parametrize("p,mean", [(2.0, False), (1.0, False), (3.0, False), (0.5, False), (np.inf, False),
                                    (1.0, True)], ids=["l2", "l1", "l3", "l0.5", "linf", "mean_abs"])
@pytest.mark.parametrize("axis", [-1, 0, None], ids=["last", "first", "all"])
def test_lp_backward(rng, p, mean, axis):
    # |x| at least 0.3 and distinct: |x|**p is smooth there (p < 1 is steep
    # near 0, p = 1 has a kink at 0, inf a tie between two largest)
    x = rng.choice([-1.0, 1.0], size=(4, 6)) * (0.3 + rng.permutation(24).reshape(4, 6) * 0.07
                                                + rng.random((4, 6)) * 0.01)
    dy = rng.standard_normal((4, 6))
    fwd = (lambda: R.mean_abs_normalize(x, axis=axis, exact=True)) if mean else (
        lambda: R.normalize(x, p, axis=axis, exact=True) if axis is not None else
        R.normalize(x, p, axis=(0, 1), exact=True))
    (want,) = _numeric(lambda: np.sum(dy * fwd()), [x])
    got = R.normalize_backward(dy, x, p, axis=axis if axis is not None else (0, 1), mean=mean, exact=True)
    _close(got, want, f"p={p} mean={mean} dx")


def test_frobenius_is_l2_over_every_axis(rng):
    x = _data(rng, (3, 5))
    np.testing.assert_allclose(R.frobenius_normalize(x, exact=True), R.normalize(x, 2.0, axis=(0, 1), exact=True),
                               rtol=1e-15)


@pytest.mark.parametrize("op", ["group", "instance", "batch", "batch_eval"])
@pytest.mark.parametrize("channel_axis", [1, -1])
def test_channel_backward(rng, op, channel_axis):
    shape = (3, 4, 5) if channel_axis == 1 else (3, 5, 4)
    x, dy = _data(rng, shape), rng.standard_normal(shape)
    w, b = _data(rng, 4), _data(rng, 4)
    rm, rv = rng.standard_normal(4), rng.random(4) + 0.5
    kw = dict(channel_axis=channel_axis, eps=1e-5, exact=True)
    if op == "group":
        fwd = lambda **extra: R.group_norm(x, 2, w, b, **kw, **extra)  # noqa: E731
    elif op == "instance":
        fwd = lambda **extra: R.instance_norm(x, w, b, **kw, **extra)  # noqa: E731
    elif op == "batch":
        fwd = lambda **extra: R.batch_norm(x, w, b, **kw, **extra)  # noqa: E731
    else:
        fwd = lambda **extra: R.batch_norm(x, w, b, running_mean=rm, running_var=rv, training=False,  # noqa: E731
                                           **kw, **extra)
    want = _numeric(lambda: np.sum(dy * fwd()), [x, w, b])
    if op == "batch_eval":
        got = R.batch_norm_backward(dy, x, rm, rv, w, b, training=False, eps=1e-5, channel_axis=channel_axis,
                                    exact=True)
    else:
        _, mean, rstd = fwd(return_stats=True)
        bwd = {"group": lambda: R.group_norm_backward(dy, x, mean, rstd, 2, w, b, channel_axis=channel_axis, exact=True),
               "instance": lambda: R.instance_norm_backward(dy, x, mean, rstd, w, b, channel_axis=channel_axis,
                                                            exact=True),
               "batch": lambda: R.batch_norm_backward(dy, x, mean, rstd, w, b, channel_axis=channel_axis,
                                                      exact=True)}[op]
        got = bwd()
    for g, n, name in zip(got, want, ("dx", "dweight", "dbias")):
        _close(g, n, f"{op} {name}")


@pytest.mark.parametrize("before", [True, False], ids=["norm-then-gate", "gate-then-norm"])
@pytest.mark.parametrize("weighted", [True, False], ids=["weight", "no-weight"])
def test_gated_rms_norm_backward(rng, before, weighted):
    x, z = _data(rng, (3, 7)), rng.standard_normal((3, 7)) * 2.0
    w = _data(rng, (7,)) if weighted else None
    dy = rng.standard_normal((3, 7))
    kw = dict(gate=z, norm_before_gate=before, eps=1e-5, exact=True)
    want = _numeric(lambda: np.sum(dy * R.rms_norm(x, w, **kw)), [x, z] + ([w] if weighted else []))
    _, rstd = R.rms_norm(x, w, return_stats=True, **kw)
    dx, dw, dz = R.rms_norm_gated_backward(dy, x, rstd, w, gate=z, norm_before_gate=before, exact=True)
    for g, n, name in zip((dx, dz, dw), want, ("dx", "dgate", "dweight")):
        _close(g, n, f"gated {name}")
    assert weighted or dw is None


@pytest.mark.parametrize("op", ["rms", "ln", "gated"])
def test_parameters_per_head(rng, op):
    """A weight (and bias) per head, (heads, n) over x of (B, heads, n):
    their gradients in their own shape, each head's row summed over that
    head's rows alone."""
    x, z, dy = _data(rng, (3, 2, 5)), rng.standard_normal((3, 2, 5)) * 2.0, rng.standard_normal((3, 2, 5))
    w, b = _data(rng, (2, 5)), _data(rng, (2, 5))
    kw = dict(eps=1e-5, exact=True)
    if op == "gated":
        want = _numeric(lambda: np.sum(dy * R.rms_norm(x, w, gate=z, **kw)), [x, w])
        _, rstd = R.rms_norm(x, w, gate=z, return_stats=True, **kw)
        got = R.rms_norm_gated_backward(dy, x, rstd, w, gate=z, exact=True)[:2]
    elif op == "rms":
        want = _numeric(lambda: np.sum(dy * R.rms_norm(x, w, **kw)), [x, w])
        _, rstd = R.rms_norm(x, w, return_stats=True, **kw)
        got = R.rms_norm_backward(dy, x, rstd, w, exact=True)
    else:
        want = _numeric(lambda: np.sum(dy * R.layer_norm(x, w, b, **kw)), [x, w, b])
        _, mean, rstd = R.layer_norm(x, w, b, return_stats=True, **kw)
        got = R.layer_norm_backward(dy, x, mean, rstd, w, b, exact=True)
    for g, n, name in zip(got, want, ("dx", "dweight", "dbias")):
        assert np.shape(g) == n.shape, name
        _close(g, n, f"{op} per head {name}")
