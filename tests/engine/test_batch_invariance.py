"""Batch invariance (docs/ops.md): a row's results do not depend on how many
rows the call has. The CPU tests hold the dispatch to its rule (below
split_min_row_bytes a row, and for rows one backward block holds, the
kernel, its block and its per-row layout follow the row alone); the GPU
tests check the bits: every prefix of a batch gives the first rows of the
whole batch's results exactly, forward (y, h, statistics) and backward
(dx), on every tier the guarantee covers."""
import numpy as np
import pytest

from cunorm._engine import dispatch_rows, dispatch_grad, dtypes, tuning
from cunorm._engine.plans import make_plan

H100 = dispatch_rows.Device(sm_count=132)
A100 = dispatch_rows.Device(sm_count=108, compute_capability=80, max_shared_per_block=166912, l2_bytes=40 << 20)
ROWS = (1, 2, 3, 7, 64, 131, 132, 133, 1000, 4096, 65536)
DTYPES = (dtypes.bfloat16, dtypes.float16, dtypes.float32, dtypes.float64)


def _shape_of(launch):
    """What a row's arithmetic follows from: each step's kernel, block and
    shared memory, and the tier's per-row parameters (the grid aside)."""
    return (launch.tier, launch.threads_per_row, launch.stash_vecs,
            tuple((s.kernel.expression, s.block, s.shared_bytes) for s in launch.steps))


def _forward(norm, dtype, n, rows, residual, params, device):
    pdtype = dtypes.float32 if params and dtype != dtypes.float64 else (dtype if params else None)
    flags = (3 if norm == "ln" else 1) if params else 0
    plan = make_plan(norm, np.dtype(dtype), pdtype, flags, residual, (rows, n), (n, 1), 1, 1, 0, 0, 0, 0, 0, 0)
    return dispatch_rows.choose(plan, device)


@pytest.mark.parametrize("device", [H100, A100], ids=["H100", "A100"])
@pytest.mark.parametrize("norm", ["rms", "ln", "l2"])
def test_forward_dispatch_follows_the_row_alone(norm, device):
    """Every row length under split_min_row_bytes (odd ones too), every
    dtype, with and without residual and parameters: one launch shape for
    every number of rows."""
    lengths = sorted({1, 3, 64, 760, 896, 1000, 2048, 4095, 4096, 5120, 7168, 8192, 12288, 16383, 16384, 20000,
                      24576, 32767, 32768})
    checked = 0
    for dtype in DTYPES:
        for n in lengths:
            if n * np.dtype(dtype).itemsize >= tuning.SM90.split_min_row_bytes:
                continue
            for residual in ((False, True) if norm != "l2" else (False,)):
                for params in ((False, True) if norm != "l2" else (False,)):
                    shapes = {_shape_of(_forward(norm, dtype, n, rows, residual, params, device)) for rows in ROWS}
                    assert len(shapes) == 1, (norm, np.dtype(dtype).name, n, residual, params, shapes)
                    checked += 1
    assert checked > 50


def test_long_rows_are_the_documented_exception():
    """At and past split_min_row_bytes a row, few rows are split across
    blocks: the one place the number of rows chooses the tier."""
    n = tuning.SM90.split_min_row_bytes // 2
    assert _forward("rms", dtypes.bfloat16, n, 1, False, True, H100).tier == "split"
    assert _forward("rms", dtypes.bfloat16, n, 4096, False, True, H100).tier == "cached"
    assert _forward("rms", dtypes.bfloat16, n - 8, 1, False, True, H100).tier == "cached"


@pytest.mark.parametrize("device", [H100, A100], ids=["H100", "A100"])
@pytest.mark.parametrize("norm", ["rms", "ln"])
def test_backward_dispatch_follows_the_row_alone(norm, device):
    """Rows one backward block holds (grad_cached_shape's single block):
    the cached tier at every number of rows, one kernel and block."""
    checked = 0
    for dtype in DTYPES:
        itemsize = np.dtype(dtype).itemsize
        for n in (64, 760, 1024, 2048, 4096, 5120, 8192, 12288, 16384):
            vec = max(v for v in (1, 2, 4, 8) if v * itemsize <= 16 and n % v == 0)
            shape = dispatch_grad.grad_cached_shape(n // vec, vec, itemsize, tuning.SM90)
            if shape is None or shape[2] != 1:
                continue
            for flags in (0, 1, 3):
                pdtype = None if not flags else dtypes.float32 if itemsize < 8 else dtypes.float64
                launches = [dispatch_grad.choose_rows_grad(norm, np.dtype(dtype), pdtype, flags, rows, n, 1, vec,
                                                           device) for rows in ROWS]
                fits = launches[0].tier == "cached"
                if not fits:  # (its column sums over the shared memory: streamed at every size, one shape)
                    assert {launch.tier for launch in launches} == {"streamed"}
                    continue
                assert {(launch.tier, tuple((s.kernel.expression, s.block, s.shared_bytes) for s in launch.steps))
                        for launch in launches} == {(launches[0].tier, tuple(
                            (s.kernel.expression, s.block, s.shared_bytes) for s in launches[0].steps))}, (n, dtype)
                checked += 1
    assert checked > 40


# --- on the GPU: the bits --------------------------------------------------------------------------------------------

CASES = [
    # (name, norm, dtype, hidden, residual): each names the tier it reaches on an H100 / H200
    ("group of lanes a row", "rms", "bfloat16", 896, False),
    ("block a row", "rms", "bfloat16", 4096, False),
    ("block a row, residual", "rms", "bfloat16", 4096, True),
    ("block a row, LayerNorm", "ln", "bfloat16", 16384, False),
    ("block a row, fp32 residual", "rms", "float32", 8192, True),
    ("uncached, fp32 residual", "ln", "float32", 8192, True),
    ("uncached, residual", "ln", "bfloat16", 16384, True),
    ("uncached, odd row", "rms", "float32", 16383, False),
    ("fp16 odd width", "ln", "float16", 4097, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name,norm,dtype,hidden,residual", CASES, ids=[c[0] for c in CASES])
def test_forward_bits_do_not_depend_on_the_rows(rng, name, norm, dtype, hidden, residual):
    import cupy

    import cunorm

    dtype = np.dtype(dtype)
    total = 2048
    x = cupy.asarray(rng.standard_normal((total, hidden)).astype(dtype))
    r = cupy.asarray(rng.standard_normal((total, hidden)).astype(dtype)) if residual else None
    w = cupy.asarray(rng.standard_normal(hidden).astype(np.float32))
    b = cupy.asarray(rng.standard_normal(hidden).astype(np.float32))

    def run(rows):
        kw = {"residual": None if r is None else r[:rows], "return_stats": True}
        out = cunorm.rms_norm(x[:rows], w, **kw) if norm == "rms" else cunorm.layer_norm(x[:rows], w, b, **kw)
        return [cupy.asnumpy(a) for a in out]

    whole = run(total)
    for rows in (1, 2, 3, 7, 64, 131, 133, 1000):
        for part, full in zip(run(rows), whole):
            assert np.array_equal(part.view(np.uint8), full[:rows].view(np.uint8)), (name, rows)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["rms", "ln"])
@pytest.mark.parametrize("dtype,hidden", [("bfloat16", 4096), ("bfloat16", 16384), ("float32", 8192),
                                          ("float16", 1000)])
def test_backward_dx_bits_do_not_depend_on_the_rows(rng, norm, dtype, hidden):
    """dx per row (dweight sums over the rows and is not covered)."""
    import cupy

    import cunorm

    dtype = np.dtype(dtype)
    total = 1024
    x = cupy.asarray(rng.standard_normal((total, hidden)).astype(dtype))
    dy = cupy.asarray(rng.standard_normal((total, hidden)).astype(dtype))
    w = cupy.asarray(rng.standard_normal(hidden).astype(np.float32))
    if norm == "rms":
        _, rstd = cunorm.rms_norm(x, w, return_stats=True)
        dx = lambda rows: cunorm.rms_norm_backward(dy[:rows], x[:rows], rstd[:rows], w)[0]  # noqa: E731
    else:
        _, mean, rstd = cunorm.layer_norm(x, w, return_stats=True)
        dx = lambda rows: cunorm.layer_norm_backward(dy[:rows], x[:rows], mean[:rows], rstd[:rows], w)[0]  # noqa: E731
    whole = cupy.asnumpy(dx(total))
    for rows in (1, 2, 5, 64, 131, 133, 700):
        assert np.array_equal(cupy.asnumpy(dx(rows)).view(np.uint8), whole[:rows].view(np.uint8)), rows


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_strided_axis_bits_do_not_depend_on_the_batch(rng, dtype):
    """A norm over a strided axis (the channels of NCHW): each sample's
    results are the same whatever the batch."""
    import cupy

    import cunorm

    x = cupy.asarray(rng.standard_normal((96, 64, 9, 17)).astype(dtype))
    w = cupy.asarray(rng.standard_normal(64).astype(np.float32))
    whole = [cupy.asnumpy(a) for a in cunorm.layer_norm(x, w, axis=1, return_stats=True)]
    for n in (1, 2, 5, 33):
        part = [cupy.asnumpy(a) for a in cunorm.layer_norm(x[:n], w, axis=1, return_stats=True)]
        for p, f in zip(part, whole):
            assert np.array_equal(p.view(np.uint8), f[:n].view(np.uint8)), n


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_strided_axis_backward_bits_do_not_depend_on_the_batch(rng, dtype):
    """The backward over a strided axis: each sample's dx is the same
    whatever the batch."""
    import cupy

    import cunorm

    x = cupy.asarray(rng.standard_normal((96, 64, 9, 17)).astype(dtype))
    dy = cupy.asarray(rng.standard_normal(x.shape).astype(dtype))
    w = cupy.asarray(rng.standard_normal(64).astype(np.float32))
    _, mean, rstd = cunorm.layer_norm(x, w, w, axis=1, return_stats=True)
    whole = cupy.asnumpy(cunorm.layer_norm_backward(dy, x, mean, rstd, w, w, axis=1)[0])
    for n in (1, 2, 5, 33):
        part = cupy.asnumpy(cunorm.layer_norm_backward(dy[:n], x[:n], mean[:n], rstd[:n], w, w, axis=1)[0])
        assert np.array_equal(part.view(np.uint8), whole[:n].view(np.uint8)), n
