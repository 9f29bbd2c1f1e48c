"""Seeded random cases against independent float64 formulas (GPU): random
shapes (odd sizes, size-1 axes), normalized axes, dtypes, memory layouts
(C order, permuted, every other element, reversed, one element off
alignment) and parameter dtypes, forward and backward, every output
poisoned first. The formulas here are written from the definitions in
docs/ops.md, not taken from cunorm.reference.

The error of each element is judged against the conditioning of its
computation, not against the output alone: a normalized value
(x - mean) * rstd carries the rounding of x and of the statistics in units of
|x| * rstd, so the bound is RTOL[dtype] * (|ref| + |w| * (|x| + |mean|) *
rstd + |b|); a gradient's sum is judged against the sum of the magnitudes
of its terms. The seed is printed on failure."""
import ml_dtypes
import numpy as np
import pytest

import cunorm
from helpers import DTYPES, RTOL

pytestmark = pytest.mark.gpu

CASES = 40
MAX_ELEMENTS = 1 << 20
SIZES = (1, 2, 3, 5, 7, 16, 33, 64, 130, 257, 1000)
LAYOUTS = ("c", "permuted", "every_other", "reversed", "off_alignment")


def _shape(rng, ndim):
    while True:
        shape = tuple(int(s) for s in rng.choice(SIZES, size=ndim))
        if np.prod(shape) <= MAX_ELEMENTS:
            return shape


def _on_gpu(cupy, a, layout, rng):
    """a (NumPy) as a CuPy array of the same values in ``layout``."""
    if layout == "c" or a.ndim == 0:
        return cupy.asarray(a)
    if layout == "permuted":
        perm = rng.permutation(a.ndim)
        return cupy.asarray(np.ascontiguousarray(a.transpose(perm))).transpose(np.argsort(perm))
    if layout == "every_other":  # the elements between are NaN
        axis = int(rng.integers(a.ndim))
        wide = list(a.shape)
        wide[axis] *= 2
        big = np.full(wide, np.nan, a.dtype)
        index = [slice(None)] * a.ndim
        index[axis] = slice(None, None, 2)
        big[tuple(index)] = a
        return cupy.asarray(big)[tuple(index)]
    if layout == "reversed":
        axis = int(rng.integers(a.ndim))
        return cupy.flip(cupy.asarray(np.flip(a, axis).copy()), axis)
    flat = np.full(a.size + 1, np.nan, a.dtype)  # off_alignment: one element past a 16-byte boundary
    flat[1:] = a.ravel()
    return cupy.asarray(flat)[1:].reshape(a.shape)


def _data(rng, shape, dtype):
    # an offset and a spread per case: the statistics' conditioning varies
    return (rng.standard_normal(shape) * rng.choice([0.1, 1.0, 30.0]) + rng.choice([0.0, 1.0, -5.0])).astype(dtype)


def _check(got, want, bound, what, seed):
    """|got - want| <= bound elementwise, plus the spacing of the output's
    subnormals (a float16 output below 6e-5 is rounded to 6e-8 steps)."""
    bound = bound + float(ml_dtypes.finfo(got.dtype).smallest_subnormal)
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape} (seed {seed})"
    assert np.isfinite(got).all(), f"{what}: non-finite output (seed {seed})"
    excess = np.abs(got - want) - bound
    if (excess > 0).any():
        i = np.unravel_index(int(np.argmax(excess)), excess.shape)
        raise AssertionError(f"{what}: {int((excess > 0).sum())} of {excess.size} elements over their bound; worst "
                             f"at {i}: got {got[i]:.8g}, want {want[i]:.8g}, bound {bound[i]:.3g} (seed {seed})")


def _row_case(rng):
    ndim = int(rng.integers(1, 5))
    shape = _shape(rng, ndim)
    first = int(rng.integers(ndim))
    last = int(rng.integers(first, ndim))
    dtype = DTYPES[int(rng.integers(len(DTYPES)))]
    pdtype = dtype if rng.random() < 0.5 else np.dtype(np.float32)
    return shape, (first, last), dtype, pdtype, LAYOUTS[int(rng.integers(len(LAYOUTS)))]


def _stats(x64, axes, norm):
    if norm == "rms":
        return 0.0, 1 / np.sqrt(np.mean(x64**2, axis=axes, keepdims=True) + 1e-5)
    mean = np.mean(x64, axis=axes, keepdims=True)
    return mean, 1 / np.sqrt(np.mean((x64 - mean) ** 2, axis=axes, keepdims=True) + 1e-5)


def _param(p, ndim, first, last):
    """A parameter of the normalized axes, broadcast against x."""
    return p.astype(np.float64).reshape((1,) * first + p.shape + (1,) * (ndim - last - 1))


@pytest.mark.parametrize("norm", ["rms", "ln"])
def test_row_norms_forward_and_backward(norm, rng, poisoned):
    import cupy

    seed = int(rng.integers(1 << 31))
    rng = np.random.default_rng(seed)
    for case in range(CASES):
        shape, (first, last), dtype, pdtype, layout = _row_case(rng)
        axes = tuple(range(first, last + 1))
        x_np, dy_np = _data(rng, shape, dtype), rng.standard_normal(shape).astype(dtype)
        w_np = (rng.standard_normal(shape[first : last + 1]) + 1).astype(pdtype)
        b_np = rng.standard_normal(shape[first : last + 1]).astype(pdtype)
        x, dy = _on_gpu(cupy, x_np, layout, rng), _on_gpu(cupy, dy_np, layout, rng)
        w, b = cupy.asarray(w_np), cupy.asarray(b_np)
        what = f"{norm} case {case}: {shape} axes {axes} {np.dtype(dtype).name} params {np.dtype(pdtype).name} {layout}"
        if norm == "rms":
            y, rstd = cunorm.rms_norm(x, w, axis=axes, return_stats=True)
            dx, dw = cunorm.rms_norm_backward(dy, x, rstd, w, axis=axes)
            db = None
        else:
            y, mean, rstd = cunorm.layer_norm(x, w, b, axis=axes, return_stats=True)
            dx, dw, db = cunorm.layer_norm_backward(dy, x, mean, rstd, w, b, axis=axes)
        x64, dy64 = x_np.astype(np.float64), dy_np.astype(np.float64)
        mu, rs = _stats(x64, axes, norm)
        w64 = _param(w_np, len(shape), first, last)
        b64 = _param(b_np, len(shape), first, last) if norm == "ln" else 0.0
        xhat = (x64 - mu) * rs
        want = xhat * w64 + b64
        tol = RTOL[np.dtype(dtype)]
        _check(cupy.asnumpy(y), want, tol * (np.abs(want) + np.abs(w64) * (np.abs(x64) + np.abs(mu)) * rs
                                             + np.abs(b64)), what + " y", seed)
        assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == pdtype, what
        g = dy64 * w64
        mean_g = np.mean(g, axis=axes, keepdims=True) if norm == "ln" else 0.0
        proj = np.mean(g * xhat, axis=axes, keepdims=True)
        want_dx = rs * (g - mean_g - xhat * proj)
        cond = (np.abs(x64) + np.abs(mu)) * rs  # xhat's rounding is in these units
        spread = rs * (np.abs(g) + (norm == "ln") * np.mean(np.abs(g), axis=axes, keepdims=True)
                       + cond * np.mean(np.abs(g) * cond, axis=axes, keepdims=True))
        _check(cupy.asnumpy(dx), want_dx, tol * (np.abs(want_dx) + spread), what + " dx", seed)
        outer = tuple(a for a in range(len(shape)) if a not in axes)
        ptol = max(RTOL[np.dtype(pdtype)], RTOL[np.dtype(dtype)])  # (the sum is rounded to the parameter's dtype)
        for got, terms, size, name in ((dw, dy64 * xhat, np.abs(dy64) * cond, "dweight"),
                                       (db, dy64, np.abs(dy64), "dbias")):
            if got is None:
                continue
            want_p, magnitude = np.sum(terms, axis=outer), np.sum(size, axis=outer)
            _check(cupy.asnumpy(got), want_p, ptol * (np.abs(want_p) + magnitude) + 1e-30, what + " " + name, seed)


@pytest.mark.parametrize("kind", ["l1", "l2", "l3", "linf", "mean_abs"])
def test_lp_norms_forward(kind, rng, poisoned):
    import cupy

    seed = int(rng.integers(1 << 31))
    rng = np.random.default_rng(seed)
    p = {"l1": 1.0, "l2": 2.0, "l3": 3.0, "linf": np.inf, "mean_abs": 1.0}[kind]
    for case in range(CASES):
        shape, (first, last), dtype, _, layout = _row_case(rng)
        axes = tuple(range(first, last + 1))
        x_np = _data(rng, shape, dtype)
        x = _on_gpu(cupy, x_np, layout, rng)
        what = f"{kind} case {case}: {shape} axes {axes} {np.dtype(dtype).name} {layout}"
        if kind == "mean_abs":
            y = cunorm.mean_abs_normalize(x, axis=axes)
        else:
            y = cunorm.normalize(x, p, axis=axes)
        a = np.abs(x_np.astype(np.float64))
        if kind == "mean_abs":
            n = np.mean(a, axis=axes, keepdims=True)
        elif p == np.inf:
            n = np.max(a, axis=axes, keepdims=True)
        else:
            n = np.sum(a**p, axis=axes, keepdims=True) ** (1 / p)
        want = x_np.astype(np.float64) / np.maximum(n, 1e-12)
        tol = RTOL[np.dtype(dtype)] * (4 if p == 3.0 else 1)  # (pow and its root: a few more roundings)
        _check(cupy.asnumpy(y), want, tol * 2 * np.abs(want) + 1e-30, what, seed)


@pytest.mark.parametrize("norm", ["group", "instance", "batch"])
def test_channel_norms_forward_and_backward(norm, rng, poisoned):
    import cupy

    seed = int(rng.integers(1 << 31))
    rng = np.random.default_rng(seed)
    for case in range(CASES):
        ndim = int(rng.integers(2, 5))
        shape = list(_shape(rng, ndim))
        shape[1] = int(rng.choice([2, 4, 6, 12, 32]))
        if norm == "instance" and np.prod(shape[2:]) < 2:
            shape.append(3)
        if norm == "batch" and shape[0] * np.prod(shape[2:]) < 2:
            shape[0] = 2
        shape = tuple(shape)
        c = shape[1]
        groups = int(rng.choice([g for g in (1, 2, 3, 4) if c % g == 0])) if norm == "group" else None
        channel_axis = 1 if rng.random() < 0.5 else -1
        dtype = DTYPES[int(rng.integers(len(DTYPES)))]
        pdtype = dtype if rng.random() < 0.5 else np.dtype(np.float32)
        layout = LAYOUTS[int(rng.integers(len(LAYOUTS)))]
        logical = shape if channel_axis == 1 else (shape[0], *shape[2:], shape[1])
        x_np, dy_np = _data(rng, logical, dtype), rng.standard_normal(logical).astype(dtype)
        w_np, b_np = (rng.standard_normal(c) + 1).astype(pdtype), rng.standard_normal(c).astype(pdtype)
        x, dy = _on_gpu(cupy, x_np, layout, rng), _on_gpu(cupy, dy_np, layout, rng)
        w, b = cupy.asarray(w_np), cupy.asarray(b_np)
        what = (f"{norm} case {case}: {logical} channel_axis {channel_axis} groups {groups} "
                f"{np.dtype(dtype).name} params {np.dtype(pdtype).name} {layout}")
        extra = (groups,) if norm == "group" else ()
        y, mean, rstd = getattr(cunorm, f"{norm}_norm")(x, *extra, w, b, channel_axis=channel_axis, return_stats=True)
        dx, dw, db = getattr(cunorm, f"{norm}_norm_backward")(dy, x, mean, rstd, *extra, w, b,
                                                              channel_axis=channel_axis)
        # channels first, then (N, G, C/G, S): the groups' elements on the axes named below
        x64 = np.moveaxis(x_np.astype(np.float64), channel_axis, 1).reshape(shape[0], c, -1)
        dy64 = np.moveaxis(dy_np.astype(np.float64), channel_axis, 1).reshape(shape[0], c, -1)
        per = {"group": groups, "instance": c, "batch": c}[norm]
        xg = x64.reshape(shape[0], per, -1)
        axes = (0, 2) if norm == "batch" else (2,)
        mu = np.mean(xg, axis=axes, keepdims=True)
        rs = 1 / np.sqrt(np.mean((xg - mu) ** 2, axis=axes, keepdims=True) + 1e-5)
        xhat = ((xg - mu) * rs).reshape(x64.shape)
        mu_e = np.broadcast_to(mu, xg.shape).reshape(x64.shape)
        rs_e = np.broadcast_to(rs, xg.shape).reshape(x64.shape)
        w64, b64 = w_np.astype(np.float64)[:, None], b_np.astype(np.float64)[:, None]
        want = xhat * w64 + b64
        tol = RTOL[np.dtype(dtype)]

        def logical_of(a):  # (N, C, S) back to x's logical shape
            return np.moveaxis(a.reshape(shape), 1, channel_axis)

        _check(cupy.asnumpy(y), logical_of(want),
               logical_of(tol * (np.abs(want) + np.abs(w64) * (np.abs(x64) + np.abs(mu_e)) * rs_e + np.abs(b64))),
               what + " y", seed)
        g = (dy64 * w64).reshape(xg.shape)
        xh = xhat.reshape(xg.shape)
        mean_g = np.mean(g, axis=axes, keepdims=True)
        proj = np.mean(g * xh, axis=axes, keepdims=True)
        want_dx = (rs * (g - mean_g - xh * proj)).reshape(x64.shape)
        cond = ((np.abs(x64) + np.abs(mu_e)) * rs_e)  # xhat's rounding is in these units
        cg = cond.reshape(xg.shape)
        spread = rs * (np.abs(g) + np.mean(np.abs(g), axis=axes, keepdims=True)
                       + cg * np.mean(np.abs(g) * cg, axis=axes, keepdims=True))
        _check(cupy.asnumpy(dx), logical_of(want_dx), logical_of(tol * (np.abs(want_dx) + spread.reshape(x64.shape))),
               what + " dx", seed)
        ptol = max(RTOL[np.dtype(pdtype)], tol)  # (the sum is rounded to the parameter's dtype)
        for got, terms, size, name in ((dw, dy64 * xhat, np.abs(dy64) * cond, "dweight"),
                                       (db, dy64, np.abs(dy64), "dbias")):
            want_p, magnitude = terms.sum(axis=(0, 2)), size.sum(axis=(0, 2))
            _check(cupy.asnumpy(got), want_p, ptol * (np.abs(want_p) + magnitude) + 1e-30, what + " " + name, seed)
