"""The benchmark's case runners: cunorm against torch eager, torch.compile
and Liger (when importable) on the current GPU, each returning one result row.

Per case: median ms and its spread (min, max), effective GB/s (the fewest
bytes: x read once, y written once, parameters once) and floor% = effective
GB/s over the device-to-device copy bandwidth measured at the start of the
same run (bytes read + written), and the max relative error against the
float64 reference on the first groups. Used by ``python -m cunorm bench``
(cunorm/bench/__init__.py) and by the repository's bench/bench.py.
"""
from __future__ import annotations

import contextlib
import importlib
import statistics
import time

import cupy
import numpy as np

import cunorm
from .._engine import dtypes, row_norms

try:
    import torch
except ImportError:  # torch columns stay empty
    torch = None

_busy = None


def time_gpu(fn, reps=20, warmup=3):
    """Median and spread (min, max) in ms of fn()'s GPU time over reps.

    Before each timed call the GPU is kept busy with a 1 GB fill (~250 us,
    which also evicts L2), so the host has queued fn's launches before the GPU
    reaches the start event: the events then time the GPU work alone, not the
    Python-side launch cost (reported separately as host overhead).
    """
    global _busy
    if _busy is None:
        _busy = cupy.empty(256 << 20, dtype=np.float32)
    for _ in range(warmup):
        fn()
    cupy.cuda.runtime.deviceSynchronize()
    events = []
    for _ in range(reps):
        _busy.fill(0)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        events.append((start, stop))
    stop.synchronize()
    times = [cupy.cuda.get_elapsed_time(a, b) for a, b in events]
    return statistics.median(times), min(times), max(times)


def time_single(fn, reps=25, warmup=3):
    """Median ms of one call timed as a user times it: CUDA events around
    the call on an idle GPU (synchronized before each), host time inside.
    The events go on the current stream (torch's and CuPy's default)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        cupy.cuda.runtime.deviceSynchronize()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def single_columns(row, nbytes, copy_bw, ours, eager=None, compiled=None):
    """The single-call columns of a case: cunorm called as users call it
    (torch tensors in where torch is importable, a new output), torch eager
    and torch.compile, each as ms and floor%."""
    for label, fn in (("single", ours), ("torch_single", eager), ("compile_single", compiled)):
        if fn is None:
            continue
        try:
            ms = time_single(fn)
        except Exception as err:  # report, keep going (a peer that fails on this case)
            row[f"{label}_error"] = repr(err)[:200]
            continue
        row[f"{label}_ms"] = ms
        row[f"{label}_floor_pct"] = 100 * nbytes / (ms * 1e-3) / 1e9 / copy_bw


def copy_bandwidth(nbytes=4 << 30):
    src = cupy.ones(nbytes // 4, dtype=np.float32)
    dst = cupy.empty_like(src)
    ms, _, _ = time_gpu(lambda: dst.__setitem__(Ellipsis, src), reps=20)
    del src, dst
    cupy.get_default_memory_pool().free_all_blocks()
    return 2 * nbytes / (ms * 1e-3) / 1e9


def torch_norm(op, x, w, b, axis, eps, r=None):
    """The torch formulation users write: F.rms_norm / F.layer_norm over
    trailing axes, the formula for a strided axis; h = x + r first."""
    h = x if r is None else x + r
    first = axis if isinstance(axis, int) else axis[0]
    first %= x.ndim
    trailing = (axis == -1 or axis == x.ndim - 1) if isinstance(axis, int) else axis[-1] % x.ndim == x.ndim - 1
    if trailing:
        shape = tuple(x.shape[first:])
        if op == "rms_norm":
            y = torch.nn.functional.rms_norm(h, shape, w, eps=eps)
        else:
            y = torch.nn.functional.layer_norm(h, shape, w, b, eps=eps)
    else:
        if op == "rms_norm":
            y = h * torch.rsqrt(h.pow(2).mean(dim=first, keepdim=True) + eps)
        else:
            var, mean = torch.var_mean(h, dim=first, keepdim=True, unbiased=False)
            y = (h - mean) * torch.rsqrt(var + eps)
        view = (-1,) + (1,) * (x.ndim - first - 1)
        y = y if w is None else y * w.view(view)
        y = y if b is None else y + b.view(view)
    return y if r is None else (y, h)


# name, op, shape, dtype, axis, params ("w", "wb" or ""), residual, target floor%
CASES = [
    ("problem 36 rms axis=1 (112,64,512,512) fp32", "rms_norm", (112, 64, 512, 512), "float32", 1, "", False, 92),
    ("rms rows 32768x4096 bf16 +w", "rms_norm", (32768, 4096), "bfloat16", -1, "w", False, 90),
    ("rms rows 4096x32768 bf16 +w", "rms_norm", (4096, 32768), "bfloat16", -1, "w", False, 88),
    ("rms rows 65536x1024 fp32 +w", "rms_norm", (65536, 1024), "float32", -1, "w", False, 88),
    ("residual+rms rows 32768x4096 bf16 +w", "rms_norm", (32768, 4096), "bfloat16", -1, "w", True, 85),
    ("problem 40 ln axes 1-3 (16,64,256,256) fp32 +w+b", "layer_norm", (16, 64, 256, 256), "float32", (1, 2, 3),
     "wb", False, 70),
    ("ln rows 32768x4096 bf16 +w+b", "layer_norm", (32768, 4096), "bfloat16", -1, "wb", False, 88),
    ("ln rows 65536x1024 fp32 +w+b", "layer_norm", (65536, 1024), "float32", -1, "wb", False, 88),
    ("residual+ln rows 32768x4096 bf16 +w+b", "layer_norm", (32768, 4096), "bfloat16", -1, "wb", True, None),
    ("rms rows 1x4096 bf16 +w (decode)", "rms_norm", (1, 4096), "bfloat16", -1, "w", False, None),
    ("rms rows 16x4194304 fp32 (few long rows)", "rms_norm", (16, 4194304), "float32", -1, "", False, None),
    ("rms rows 200000x64 fp16 +w (short rows)", "rms_norm", (200000, 64), "float16", -1, "w", False, None),
]

# The channel norms: name, op, shape, dtype, groups, channel_axis, params, target floor%.
CHANNEL_CASES = [
    ("problem 35 group_norm(8) (112,64,512,512) fp32 +w+b", "group_norm", (112, 64, 512, 512), "float32", 8, 1,
     "wb", 75),
    ("problem 34 instance_norm (112,64,512,512) fp32", "instance_norm", (112, 64, 512, 512), "float32", None, 1, "",
     85),
    ("problem 33 batch_norm train (64,64,512,512) fp32 +w+b", "batch_norm", (64, 64, 512, 512), "float32", None, 1,
     "wb", 64),
    ("group_norm(32) channels-last (8,128,128,512) bf16 +w+b", "group_norm", (8, 128, 128, 512), "bfloat16", 32, -1,
     "wb", 80),
]

# The Lp family: name, op, shape, axis, target floor% (fp32, no parameters).
LP_CASES = [
    ("problem 39 l2 normalize axis=1 (32768,65535) fp32", "normalize", (32768, 65535), 1, 85),
    ("problem 38 mean-abs normalize axis=1 (32768,65535) fp32", "mean_abs_normalize", (32768, 65535), 1, 85),
    ("problem 37 frobenius (112,64,512,512) fp32", "frobenius_normalize", (112, 64, 512, 512), None, 64),
    ("l1 normalize rows 32768x4096 fp32", "normalize_l1", (32768, 4096), -1, None),
    ("linf normalize rows 32768x4096 fp32", "normalize_linf", (32768, 4096), -1, None),
    ("p=3 normalize rows 32768x4096 fp32", "normalize_p3", (32768, 4096), -1, None),
]
#: each Lp case's p (None: mean-abs)
LP_FORMS = {"normalize": 2.0, "normalize_l1": 1.0, "normalize_linf": float("inf"), "normalize_p3": 3.0,
            "mean_abs_normalize": None, "frobenius_normalize": 2.0}


def _lp_call(op, x, axis, out=None):
    if op == "mean_abs_normalize":
        return cunorm.mean_abs_normalize(x, axis=axis, out=out)
    if op == "frobenius_normalize":
        return cunorm.frobenius_normalize(x, axis=axis, out=out)
    return cunorm.normalize(x, LP_FORMS[op], axis=axis, out=out)


def torch_lp(op, x, axis):
    """What torch users write: F.normalize, the mean-abs formula, x / x.norm()."""
    if op == "mean_abs_normalize":
        return x / x.abs().mean(dim=axis, keepdim=True)
    if op == "frobenius_normalize":
        return x / torch.linalg.vector_norm(x)
    return torch.nn.functional.normalize(x, LP_FORMS[op], dim=axis)


def bench_lp_case(name, op, shape, axis, target, copy_bw, with_compile):
    x = cupy.random.standard_normal(shape, dtype=np.float32)
    y = cupy.empty_like(x)
    nbytes = fewest_bytes(x, None, None, False)
    row = {"case": name, "op": op, "shape": list(shape), "dtype": "float32", "axis": axis, "params": "",
           "residual": False, "bytes": nbytes, "target_floor_pct": target}
    ms, lo, hi = time_gpu(lambda: _lp_call(op, x, axis, out=y))
    first, last = (0, x.ndim - 1) if axis is None else _axes(axis, x.ndim)
    norm = "mean_abs" if LP_FORMS[op] is None else row_norms.lp_norm_name(LP_FORMS[op])
    plan, launch = row_norms.launch_on(norm, x, y, first=first, last=last, eps=1e-12)
    row.update(tier=launch.tier, kernel=launch.steps[0].kernel.expression, ms=ms, ms_min=lo, ms_max=hi)
    row["gbps"] = nbytes / (ms * 1e-3) / 1e9
    row["floor_pct"] = 100 * row["gbps"] / copy_bw
    # error against float64: the first rows, or (whole array) a float64 sum on the GPU
    if axis is None:
        total = sum(float(cupy.sum(cupy.square(x[i].astype(np.float64)))) for i in range(x.shape[0]))
        ref = cupy.asnumpy(x[:1]).astype(np.float64) / np.sqrt(total)
    else:
        ref_fn = cunorm.reference.mean_abs_normalize if op == "mean_abs_normalize" else (
            lambda a, **kw: cunorm.reference.normalize(a, LP_FORMS[op], **kw))
        ref = ref_fn(cupy.asnumpy(x[:2]), axis=axis, exact=True)
    got = cupy.asnumpy(y[: ref.shape[0]]).astype(np.float64)
    row["max_rel_err"] = float(np.max(np.abs(got - ref) / np.maximum(np.abs(ref), 1e-3 * np.max(np.abs(ref)))))
    if torch is not None:
        xt = torch.from_dlpack(x)
        t_ms, _, _ = time_gpu(lambda: torch_lp(op, xt, axis), reps=10)
        row["torch_ms"] = t_ms
        row["torch_floor_pct"] = 100 * nbytes / (t_ms * 1e-3) / 1e9 / copy_bw
        if with_compile:
            try:
                compiled = torch.compile(lambda a: torch_lp(op, a, axis))
                c_ms, _, _ = time_gpu(lambda: compiled(xt), reps=10, warmup=2)
                row["compile_ms"] = c_ms
                row["compile_floor_pct"] = 100 * nbytes / (c_ms * 1e-3) / 1e9 / copy_bw
            except Exception as err:  # report, keep going
                row["compile_error"] = repr(err)[:200]
        single_columns(row, nbytes, copy_bw, lambda: _lp_call(op, xt, axis), lambda: torch_lp(op, xt, axis),
                       (lambda: compiled(xt)) if "compile_ms" in row else None)
        del xt
    del x, y
    cupy.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.empty_cache()
    return row


TUNE = {
    "problem 36 rms axis=1 (112,64,512,512) fp32": [{"bx": 32, "by": 8}, {"bx": 16, "by": 16}, {"tier": "uncached"}],
    "rms rows 32768x4096 bf16 +w": [{"tier": "cached", "threads": t} for t in (64, 128, 256)],
    "ln rows 32768x4096 bf16 +w+b": [{"tier": "cached", "threads": t} for t in (64, 128, 256)],
    "residual+rms rows 32768x4096 bf16 +w": [{"tier": "cached", "threads": t} for t in (128, 256, 512)],
    "ln rows 65536x1024 fp32 +w+b": [{"tier": "cached", "threads": t} for t in (32, 64, 128)],
    "problem 40 ln axes 1-3 (16,64,256,256) fp32 +w+b": [{"tier": "resident"}]
    + [{"tier": "split", "chunks": c} for c in (33, 66)],
    "rms rows 4096x32768 bf16 +w": [{"tier": "cached", "threads": t} for t in (512, 1024)],
}


def release():
    """Return the memory pools' cached blocks (between cases, after an out-of-memory)."""
    cupy.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.empty_cache()


def liger_norm(op, x, w, b, axis, r):
    """Liger-Kernel's layer for a last-axis RMSNorm/LayerNorm with a weight
    and no residual, as a callable of x; None where it has no such layer or
    is not importable."""
    trailing = axis in (-1, x.ndim - 1)
    if torch is None or r is not None or w is None or not trailing:
        return None
    try:
        if op == "rms_norm":
            from liger_kernel.transformers import LigerRMSNorm

            layer = LigerRMSNorm(x.shape[-1], eps=1e-5)
        else:
            from liger_kernel.transformers import LigerLayerNorm

            layer = LigerLayerNorm(x.shape[-1], eps=1e-5)
    except Exception:  # not installed, or another API: no Liger column
        return None
    layer = layer.to(device=x.device, dtype=x.dtype)
    with torch.no_grad():
        layer.weight.copy_(w)
        if getattr(layer, "bias", None) is not None:
            layer.bias.copy_(b if b is not None else torch.zeros_like(layer.bias))
    return lambda a: layer(a)


def _axes(axis, ndim):
    if isinstance(axis, int):
        a = axis % ndim
        return a, a
    return axis[0] % ndim, axis[-1] % ndim


def make_inputs(op, shape, dtype, axis, params, residual):
    dt = np.dtype(getattr(dtypes, dtype))
    first, last = _axes(axis, len(shape))
    pshape = shape[first : last + 1]
    x = cupy.random.standard_normal(shape, dtype=np.float32).astype(dt)
    w = cupy.random.standard_normal(pshape, dtype=np.float32).astype(dt) if "w" in params else None
    b = cupy.random.standard_normal(pshape, dtype=np.float32).astype(dt) if "b" in params else None
    r = cupy.random.standard_normal(shape, dtype=np.float32).astype(dt) if residual else None
    return x, w, b, r


def _call(op, x, w, b, r, axis, out=None):
    kwargs = {"axis": axis, "out": out}
    if r is not None:
        kwargs["residual"] = r
    if op == "layer_norm":
        return cunorm.layer_norm(x, w, b, **kwargs)
    return cunorm.rms_norm(x, w, **kwargs)


def fewest_bytes(x, w, b, residual):
    """x (and r) read once, y (and h) written once, parameters once."""
    return (2 + 2 * bool(residual)) * x.nbytes + sum(a.nbytes for a in (w, b) if a is not None)


def bench_case(name, op, shape, dtype, axis, params, residual, target, copy_bw, with_compile):
    x, w, b, r = make_inputs(op, shape, dtype, axis, params, residual)
    y = cupy.empty_like(x)
    nbytes = fewest_bytes(x, w, b, residual)
    row = {"case": name, "op": op, "shape": list(shape), "dtype": dtype, "axis": axis, "params": params,
           "residual": residual, "bytes": nbytes, "target_floor_pct": target}
    ms, lo, hi = time_gpu(lambda: _call(op, x, w, b, r, axis, out=y))
    first, last = _axes(axis, x.ndim)
    norm = "ln" if op == "layer_norm" else "rms"
    h = cupy.empty_like(x) if residual else None
    plan, launch = row_norms.launch_on(norm, x, y, w=w, b=b, r=r, h=h, first=first, last=last, eps=1e-5)
    row.update(tier=launch.tier, kernel=launch.steps[0].kernel.expression, ms=ms, ms_min=lo, ms_max=hi)
    row["gbps"] = nbytes / (ms * 1e-3) / 1e9
    row["floor_pct"] = 100 * row["gbps"] / copy_bw
    # error against float64 on the first rows (groups along axis 0 are independent)
    k = min(x.shape[0], 2)
    ref_fn = getattr(cunorm.reference, op)
    kw = {"residual": None if r is None else cupy.asnumpy(r[:k])}
    if op == "layer_norm":
        kw["bias"] = None if b is None else cupy.asnumpy(b)
    ref = ref_fn(cupy.asnumpy(x[:k]), None if w is None else cupy.asnumpy(w), axis=axis, exact=True, **kw)
    ref = ref[0] if isinstance(ref, tuple) else ref
    got = cupy.asnumpy(y[:k]).astype(np.float64)
    row["max_rel_err"] = float(np.max(np.abs(got - ref) / np.maximum(np.abs(ref), 1e-3)))
    if torch is not None:
        xt, wt, bt, rt = (None if a is None else torch.from_dlpack(a) for a in (x, w, b, r))
        t_ms, _, _ = time_gpu(lambda: torch_norm(op, xt, wt, bt, axis, 1e-5, rt), reps=10)
        row["torch_ms"] = t_ms
        row["torch_floor_pct"] = 100 * nbytes / (t_ms * 1e-3) / 1e9 / copy_bw
        liger = liger_norm(op, xt, wt, bt, axis, rt)
        if liger is not None:
            with torch.no_grad():
                l_ms, _, _ = time_gpu(lambda: liger(xt), reps=10)
            row["liger_ms"] = l_ms
            row["liger_floor_pct"] = 100 * nbytes / (l_ms * 1e-3) / 1e9 / copy_bw
        if with_compile:
            try:
                compiled = torch.compile(lambda a, c, d, e: torch_norm(op, a, c, d, axis, 1e-5, e))
                c_ms, _, _ = time_gpu(lambda: compiled(xt, wt, bt, rt), reps=10, warmup=2)
                row["compile_ms"] = c_ms
                row["compile_floor_pct"] = 100 * nbytes / (c_ms * 1e-3) / 1e9 / copy_bw
            except Exception as err:  # report, keep going
                row["compile_error"] = repr(err)[:200]
        single_columns(row, nbytes, copy_bw, lambda: _call(op, xt, wt, bt, rt, axis),
                       lambda: torch_norm(op, xt, wt, bt, axis, 1e-5, rt),
                       (lambda: compiled(xt, wt, bt, rt)) if "compile_ms" in row else None)
        del xt, wt, bt, rt
    del x, w, b, r, y, h
    cupy.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.empty_cache()
    return row

# --- backward passes -----------------------------------------------------------------------------------------------
#: (name, op, shape, dtype, axis or groups, target floor%)
BACKWARD_CASES = [
    ("backward rms_norm bf16 32768x4096 +w", "rms", (32768, 4096), "bfloat16", -1, 80),
    ("backward layer_norm bf16 32768x4096 +w+b", "ln", (32768, 4096), "bfloat16", -1, 80),
    ("backward rms_norm fp32 65536x1024 +w", "rms", (65536, 1024), "float32", -1, None),
    # 64 KB of column sums a block: more than the default dynamic shared memory
    ("backward layer_norm bf16 4096x8192 +w+b", "ln", (4096, 8192), "bfloat16", -1, None),
    ("backward layer_norm bf16 4096x32768 +w+b (long rows)", "ln", (4096, 32768), "bfloat16", -1, None),
    # few long rows (LayerNorm over each sample's feature map): one row part
    ("backward layer_norm bf16 (8,64,128,128) axes 1-3 +w+b", "ln", (8, 64, 128, 128), "bfloat16", (1, 2, 3), None),
    ("backward problem 40 layer_norm (16,64,256,256) fp32 +w+b", "ln", (16, 64, 256, 256), "float32", (1, 2, 3), 60),
    ("backward problem 35 group_norm(8) (112,64,512,512) fp32 +w+b", "group", (112, 64, 512, 512), "float32", 8, 60),
    ("backward problem 36 rms_norm axis 1 (112,64,512,512) fp32 +w", "rms", (112, 64, 512, 512), "float32", 1, None),
    # real activations: BatchNorm in training on ResNet-50's
    ("backward batch_norm (64,256,56,56) fp32 +w+b", "batch", (64, 256, 56, 56), "float32", None, None),
    ("backward batch_norm (64,256,56,56) bf16 +w+b", "batch", (64, 256, 56, 56), "bfloat16", None, None),
    ("backward batch_norm (64,2048,7,7) bf16 +w+b", "batch", (64, 2048, 7, 7), "bfloat16", None, None),
    # ... and the channels channel_grad_onchip holds
    ("backward batch_norm (64,2048,7,7) fp32 +w+b", "batch", (64, 2048, 7, 7), "float32", None, None),
    ("backward batch_norm (64,1024,14,14) fp32 +w+b", "batch", (64, 1024, 14, 14), "float32", None, None),
    ("backward batch_norm (64,1024,14,14) bf16 +w+b", "batch", (64, 1024, 14, 14), "bfloat16", None, None),
    ("backward batch_norm (64,512,28,28) fp32 +w+b", "batch", (64, 512, 28, 28), "float32", None, None),
    ("backward batch_norm (32,256,56,56) fp32 +w+b", "batch", (32, 256, 56, 56), "float32", None, None),
]


def backward_call(op, shape, dtype, axis, rng):
    """Random x, dy and parameters, the forward's statistics, and the
    backward call on them: (x, dy, w, b, mean, rstd, run, nbytes), mean
    None for "rms". op: "rms",
    "ln" or "group" (axis: the group count). Bytes: x and dy read, dx
    written, the parameters and their gradients once."""
    dt = np.dtype(getattr(dtypes, dtype))
    x = rng.standard_normal(shape, dtype=np.float32).astype(dt)
    dy = rng.standard_normal(shape, dtype=np.float32).astype(dt)
    if op in ("group", "batch"):
        pshape = (shape[1],)
    elif isinstance(axis, tuple):
        pshape = tuple(shape[a] for a in axis)
    else:
        pshape = (shape[axis],)
    w = rng.standard_normal(pshape, dtype=np.float32).astype(dt)
    b = None if op == "rms" else rng.standard_normal(pshape, dtype=np.float32).astype(dt)
    if op == "rms":
        _, rstd = cunorm.rms_norm(x, w, axis=axis, return_stats=True)
        run = lambda: cunorm.rms_norm_backward(dy, x, rstd, w, axis=axis)  # noqa: E731
    elif op == "ln":
        _, mean, rstd = cunorm.layer_norm(x, w, b, axis=axis, return_stats=True)
        run = lambda: cunorm.layer_norm_backward(dy, x, mean, rstd, w, b, axis=axis)  # noqa: E731
    elif op == "batch":
        _, mean, rstd = cunorm.batch_norm(x, w, b, return_stats=True)
        run = lambda: cunorm.batch_norm_backward(dy, x, mean, rstd, w, b)  # noqa: E731
    else:
        _, mean, rstd = cunorm.group_norm(x, axis, w, b, return_stats=True)
        run = lambda: cunorm.group_norm_backward(dy, x, mean, rstd, axis, w, b)  # noqa: E731
    if op == "rms":
        mean = None
    return x, dy, w, b, mean, rstd, run, 3 * x.nbytes + w.nbytes * (2 if b is None else 3)


def bench_backward_case(name, op, shape, dtype, axis, target, copy_bw, with_compile):
    """dx (and dweight, dbias) from dy, x and the forward's statistics."""
    x, dy, w, b, mean, rstd, run, nbytes = backward_call(op, shape, dtype, axis, cupy.random.default_rng(0))
    row = {"case": name, "op": f"{op} backward", "shape": list(shape), "dtype": dtype, "axis": axis,
           "bytes": nbytes, "target_floor_pct": target}
    ms, lo, hi = time_gpu(run)
    row.update(ms=ms, ms_min=lo, ms_max=hi, gbps=nbytes / (ms * 1e-3) / 1e9)
    row["floor_pct"] = 100 * row["gbps"] / copy_bw
    row["tier"] = "channels" if op in ("group", "batch") else _backward_tier(op, x, axis)
    # dx against float64 on the first two rows / samples (each one's dx
    # depends on its own statistics and the parameters only; BatchNorm's on
    # the whole batch: all of it)
    dx = run()[0]
    k = shape[0] if op == "batch" else 2
    host = [None if a is None else cupy.asnumpy(a) for a in (dy[:k], x[:k], w, b)]
    if op == "rms":
        ref = cunorm.reference.rms_norm_backward(host[0], host[1], cupy.asnumpy(rstd[:k]), host[2], axis=axis,
                                                 exact=True)[0]
    elif op == "ln":
        ref = cunorm.reference.layer_norm_backward(host[0], host[1], cupy.asnumpy(mean[:k]),
                                                   cupy.asnumpy(rstd[:k]), host[2], host[3], axis=axis,
                                                   exact=True)[0]
    elif op == "batch":
        ref = cunorm.reference.batch_norm_backward(host[0], host[1], cupy.asnumpy(mean), cupy.asnumpy(rstd),
                                                   host[2], host[3], exact=True)[0]
    else:
        ref = cunorm.reference.group_norm_backward(host[0], host[1], cupy.asnumpy(mean[:k]),
                                                   cupy.asnumpy(rstd[:k]), axis, host[2], host[3],
                                                   exact=True)[0]
    got = cupy.asnumpy(dx[:k]).astype(np.float64)
    row["max_rel_err"] = float(np.max(np.abs(got - ref) / np.maximum(np.abs(ref), 1e-3 * np.max(np.abs(ref)))))
    del dx
    if torch is not None:
        xt = torch.from_dlpack(x).requires_grad_()
        wt = torch.from_dlpack(w).requires_grad_()
        bt = None if b is None else torch.from_dlpack(b).requires_grad_()
        dyt = torch.from_dlpack(dy)
        inputs = [t for t in (xt, wt, bt) if t is not None]

        def forward(a, c, d):
            if op == "group":
                return torch.nn.functional.group_norm(a, axis, c, d, 1e-5)
            if op == "batch":
                return torch.nn.functional.batch_norm(a, None, None, c, d, training=True, eps=1e-5)
            return torch_norm("rms_norm" if op == "rms" else "layer_norm", a, c, d, axis, 1e-5)

        # the timing loop reuses one graph (retain_graph), which a compiled
        # backward with donated buffers refuses
        importlib.import_module("torch._functorch.config").donated_buffer = False
        for key, fn in (("torch", forward), ("compile", torch.compile(forward) if with_compile else None)):
            if fn is None:
                continue
            try:
                y = fn(xt, wt, bt)
                t_ms, _, _ = time_gpu(lambda: torch.autograd.grad(y, inputs, dyt, retain_graph=True), reps=10,
                                      warmup=2)
                row[f"{key}_ms"] = t_ms
                row[f"{key}_floor_pct"] = 100 * nbytes / (t_ms * 1e-3) / 1e9 / copy_bw
                del y
            except Exception as err:  # report, keep going
                row[f"{key}_error"] = repr(err)[:200]
        del xt, wt, bt, dyt, inputs
    del x, dy, w, b
    cupy.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.empty_cache()
    return row


def _backward_tier(op, x, axis):
    from .._engine.row_norms import axis_span

    first, last = axis_span(axis, x.ndim)
    outer = int(np.prod(x.shape[:first]))
    reduced = int(np.prod(x.shape[first:last + 1]))
    inner = int(np.prod(x.shape[last + 1:]))
    from .._engine import dispatch_grad, launches
    from .._engine.plans import vector_width

    vec = vector_width(x.itemsize, reduced if inner == 1 else inner, [], [(x.data.ptr, x.itemsize)])
    return dispatch_grad.choose_rows_grad("rms" if op == "rms" else "ln", x.dtype, x.dtype, 1, outer, reduced, inner,
                                      vec, launches.device_info(x.data.device_id)).tier


#: channel cases: the chunks each channel's positions are cut into (the split walk's
#: wave quantization), against the default.
CHANNEL_TUNE = {
    "problem 35 group_norm(8) (112,64,512,512) fp32 +w+b": [{"chunks": c} for c in (1, 2, 4, 8)],
    "problem 34 instance_norm (112,64,512,512) fp32": [{"walk": "split", "chunks": c} for c in (1, 2, 4)],
    "problem 33 batch_norm train (64,64,512,512) fp32 +w+b": [{"chunks": c} for c in (1, 2, 4, 8)],
    "group_norm(32) channels-last (8,128,128,512) bf16 +w+b": [{"chunks": c} for c in (16, 33, 66, 264)],
}


def _channel_call(op, x, groups, w, b, channel_axis, running, out=None, training=True):
    kw = {"channel_axis": channel_axis, "out": out}
    if op == "group_norm":
        return cunorm.group_norm(x, groups, w, b, **kw)
    if op == "instance_norm":
        return cunorm.instance_norm(x, w, b, **kw)
    return cunorm.batch_norm(x, w, b, running_mean=running[0], running_var=running[1], training=training, **kw)


def torch_channel_norm(op, x, groups, w, b, channel_axis, running, training=True):
    """torch's functional form; channels-last input as torch holds it: an
    NCHW-shaped tensor in channels_last memory."""
    if channel_axis != 1:
        x = x.permute(0, x.ndim - 1, *range(1, x.ndim - 1))
    F = torch.nn.functional
    if op == "group_norm":
        return F.group_norm(x, groups, w, b, eps=1e-5)
    if op == "instance_norm":
        return F.instance_norm(x, weight=w, bias=b, eps=1e-5)
    return F.batch_norm(x, running[0], running[1], w, b, training=training, momentum=0.1, eps=1e-5)


def make_channel_inputs(op, shape, dtype, channel_axis, params):
    """x, weight, bias (or None), running buffers (BatchNorm) and an output."""
    dt = np.dtype(getattr(dtypes, dtype))
    c = shape[channel_axis]
    x = cupy.random.standard_normal(shape, dtype=np.float32).astype(dt)
    w = cupy.random.standard_normal(c, dtype=np.float32).astype(dt) if "w" in params else None
    b = cupy.random.standard_normal(c, dtype=np.float32).astype(dt) if "b" in params else None
    running = (cupy.zeros(c, np.float32), cupy.ones(c, np.float32)) if op == "batch_norm" else (None, None)
    y = cupy.empty_like(x)
    return x, w, b, running, y


def bench_channel_case(name, op, shape, dtype, groups, channel_axis, params, target, copy_bw, with_compile):
    x, w, b, running, y = make_channel_inputs(op, shape, dtype, channel_axis, params)
    training = "eval" not in params  # (BatchNorm: normalized by the running statistics)
    nbytes = fewest_bytes(x, w, b, False)
    row = {"case": name, "op": op, "shape": list(shape), "dtype": dtype, "axis": channel_axis, "params": params,
           "residual": False, "bytes": nbytes, "target_floor_pct": target}
    ms, lo, hi = time_gpu(lambda: _channel_call(op, x, groups, w, b, channel_axis, running, out=y, training=training))
    row.update(tier=_channel_tier(op, x, groups, w, b, channel_axis, running, y, training), ms=ms, ms_min=lo,
               ms_max=hi)
    row["gbps"] = nbytes / (ms * 1e-3) / 1e9
    row["floor_pct"] = 100 * row["gbps"] / copy_bw
    # error against float64 on the first two samples (BatchNorm: its channels over them)
    k = 2
    ref_kw = {"channel_axis": channel_axis, "exact": True}
    xs = cupy.asnumpy(x[:k])
    wn, bn = (None if a is None else cupy.asnumpy(a) for a in (w, b))
    if op == "group_norm":
        ref = cunorm.reference.group_norm(xs, groups, wn, bn, **ref_kw)
        got = cupy.asnumpy(y[:k])
    elif op == "instance_norm":
        ref = cunorm.reference.instance_norm(xs, wn, bn, **ref_kw)
        got = cupy.asnumpy(y[:k])
    elif not training:
        ref = cunorm.reference.batch_norm(xs, wn, bn, running_mean=cupy.asnumpy(running[0]),
                                          running_var=cupy.asnumpy(running[1]), training=False, **ref_kw)
        got = cupy.asnumpy(y[:k])
    else:
        ref = cunorm.reference.batch_norm(xs, wn, bn, **ref_kw)
        got = cupy.asnumpy(_channel_call(op, x[:k], groups, w, b, channel_axis, (None, None)))
    row["max_rel_err"] = float(np.max(np.abs(got.astype(np.float64) - ref) / np.maximum(np.abs(ref), 1e-3)))
    if torch is not None:
        xt, wt, bt = (None if a is None else torch.from_dlpack(a) for a in (x, w, b))
        rt = tuple(None if a is None else torch.from_dlpack(a) for a in running)
        t_ms, _, _ = time_gpu(lambda: torch_channel_norm(op, xt, groups, wt, bt, channel_axis, rt, training), reps=10)
        row["torch_ms"] = t_ms
        row["torch_floor_pct"] = 100 * nbytes / (t_ms * 1e-3) / 1e9 / copy_bw
        if with_compile:
            try:
                compiled = torch.compile(lambda a, d, e: torch_channel_norm(op, a, groups, d, e, channel_axis, rt,
                                                                            training))
                c_ms, _, _ = time_gpu(lambda: compiled(xt, wt, bt), reps=10, warmup=2)
                row["compile_ms"] = c_ms
                row["compile_floor_pct"] = 100 * nbytes / (c_ms * 1e-3) / 1e9 / copy_bw
            except Exception as err:  # report, keep going
                row["compile_error"] = repr(err)[:200]
        single_columns(row, nbytes, copy_bw,
                       lambda: _channel_call(op, xt, groups, wt, bt, channel_axis, rt, training=training),
                       lambda: torch_channel_norm(op, xt, groups, wt, bt, channel_axis, rt, training),
                       (lambda: compiled(xt, wt, bt)) if "compile_ms" in row else None)
        del xt, wt, bt, rt
    del x, w, b, y, running
    cupy.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.empty_cache()
    return row


def _channel_prepared(op, x, groups, w, b, channel_axis, running, y, training=True):
    from .._engine import channel_norms

    norm = op.split("_")[0]
    kw = {"num_groups": groups} if op == "group_norm" else {}
    if op == "batch_norm":
        kw.update(running_mean=running[0], running_var=running[1], training=training)
    call = channel_norms.ChannelCall(norm, x, weight=w, bias=b, eps=1e-5, channel_axis=channel_axis, out=y, **kw)
    return call, channel_norms.prepare(call)


def _channel_tier(op, x, groups, w, b, channel_axis, running, y, training=True):
    """The walk the dispatch picks for a channel case (for the table); runs
    the op once more."""
    from .._engine import channel_norms

    call, prepared = _channel_prepared(op, x, groups, w, b, channel_axis, running, y, training)
    return channel_norms.execute(call, *prepared)[0]


def tune_channel_case(name, op, shape, dtype, groups, channel_axis, params, copy_bw):
    from .._engine import channel_norms

    x, w, b, running, y = make_channel_inputs(op, shape, dtype, channel_axis, params)
    nbytes = fewest_bytes(x, w, b, False)
    call, prepared = _channel_prepared(op, x, groups, w, b, channel_axis, running, y)
    out = []
    for override in CHANNEL_TUNE.get(name, []):
        try:
            ms, _, _ = time_gpu(lambda: channel_norms.execute(call, *prepared, override=override))
            out.append({"case": name, "override": override, "ms": ms,
                        "floor_pct": 100 * nbytes / (ms * 1e-3) / 1e9 / copy_bw})
        except Exception as err:
            out.append({"case": name, "override": override, "error": repr(err)[:200]})
    del x, w, b, y, running, call, prepared
    cupy.get_default_memory_pool().free_all_blocks()
    return out


def tune_case(name, op, shape, dtype, axis, params, residual, copy_bw):
    x, w, b, r = make_inputs(op, shape, dtype, axis, params, residual)
    y = cupy.empty_like(x)
    h = cupy.empty_like(x) if residual else None
    nbytes = fewest_bytes(x, w, b, residual)
    first, last = _axes(axis, x.ndim)
    norm = "ln" if op == "layer_norm" else "rms"
    out = []
    for override in TUNE.get(name, []):
        try:
            ms, lo, hi = time_gpu(lambda: row_norms.launch_on(norm, x, y, w=w, b=b, r=r, h=h, first=first, last=last,
                                                         eps=1e-5, override=override))
            out.append({"case": name, "override": override, "ms": ms,
                        "floor_pct": 100 * nbytes / (ms * 1e-3) / 1e9 / copy_bw})
        except Exception as err:
            out.append({"case": name, "override": override, "error": repr(err)[:200]})
    del x, w, b, r, y, h
    cupy.get_default_memory_pool().free_all_blocks()
    return out


def _per_call_us(fn, n_calls: int, sync) -> float:
    """Wall-clock us per call of fn in a loop (after a warm-up), the GPU
    synchronized before and after: host-bound for decode-sized inputs. The
    least of five loops of n_calls / 5 (the H100 host's loops of the same
    call differ by up to 2x, one loop to the next)."""
    for _ in range(200):
        fn()
    per_loop = max(1, n_calls // 5)
    best = float("inf")
    for _ in range(5):
        sync()
        start = time.perf_counter()
        for _ in range(per_loop):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / per_loop * 1e6)
    return best


def host_rows(n_calls: int = 2000) -> list[dict]:
    """The host suite: wall clock per call, cunorm against torch's own op or
    layer on the same input in the same process. Each row: what was called,
    cunorm's us and torch's us (None where torch has no counterpart)."""
    rows = []
    x, w, _, _ = make_inputs("rms_norm", (1, 4096), "bfloat16", -1, "w", False)
    sync = cupy.cuda.runtime.deviceSynchronize
    y = cupy.empty_like(x)
    rows.append({"case": "rms_norm 1x4096 bf16 +w, CuPy arrays",
                 "us": _per_call_us(lambda: cunorm.rms_norm(x, w), n_calls, sync), "torch_us": None})
    rows.append({"case": "rms_norm 1x4096 bf16 +w, CuPy arrays, out= (the general path)",
                 "us": _per_call_us(lambda: cunorm.rms_norm(x, w, out=y), n_calls, sync), "torch_us": None})
    if torch is None:
        return rows
    from .. import torch as cunorm_torch

    sync = torch.cuda.synchronize
    F = torch.nn.functional
    dev = "cuda"
    bf16 = torch.bfloat16

    def pair(label, ours, theirs, grad=False, autocast=False):
        """Three rounds of cunorm then torch, the least of each: a host
        whose speed drifts over seconds favours neither."""
        context = contextlib.nullcontext() if grad else torch.no_grad()
        cast = torch.autocast("cuda", dtype=bf16) if autocast else contextlib.nullcontext()
        us = torch_us = float("inf")
        with context, cast:
            for _ in range(3):
                us = min(us, _per_call_us(ours, n_calls, sync))
                torch_us = min(torch_us, _per_call_us(theirs, n_calls, sync))
        rows.append({"case": label, "us": us, "torch_us": torch_us})

    xt = torch.randn(1, 4096, device=dev, dtype=bf16)
    wt = torch.randn(4096, device=dev, dtype=bf16)
    bt = torch.randn(4096, device=dev, dtype=bf16)
    pair("rms_norm 1x4096 bf16 +w, torch tensors (F.rms_norm)", lambda: cunorm.rms_norm(xt, wt),
         lambda: F.rms_norm(xt, (4096,), wt, eps=1e-5))
    pair("layer_norm 1x4096 bf16 +w+b, torch tensors (F.layer_norm)", lambda: cunorm.layer_norm(xt, wt, bt),
         lambda: F.layer_norm(xt, (4096,), wt, bt, eps=1e-5))
    theirs = torch.nn.RMSNorm(4096, eps=1e-5, device=dev, dtype=bf16)
    ours = cunorm_torch.replace_norms(torch.nn.RMSNorm(4096, eps=1e-5, device=dev, dtype=bf16))
    pair("RMSNorm(4096) layer, 1x4096 bf16, no_grad", lambda: ours(xt), lambda: theirs(xt))
    theirs32 = torch.nn.RMSNorm(4096, eps=1e-5, device=dev)
    ours32 = cunorm_torch.replace_norms(torch.nn.RMSNorm(4096, eps=1e-5, device=dev))
    pair("RMSNorm(4096) fp32 weight, bf16 1x4096 under autocast", lambda: ours32(xt), lambda: theirs32(xt),
         autocast=True)
    ln_theirs = torch.nn.LayerNorm(768, device=dev)
    ln_ours = cunorm_torch.replace_norms(torch.nn.LayerNorm(768, device=dev))
    act = torch.randn(4, 512, 768, device=dev)
    pair("LayerNorm(768) layer, (4,512,768) fp32, no_grad", lambda: ln_ours(act), lambda: ln_theirs(act))
    act16 = act.to(bf16)
    pair("LayerNorm(768) fp32 params, (4,512,768) bf16 under autocast", lambda: ln_ours(act16),
         lambda: ln_theirs(act16), autocast=True)
    bn_theirs = torch.nn.BatchNorm2d(64, device=dev).eval()
    bn_ours = cunorm_torch.replace_norms(torch.nn.BatchNorm2d(64, device=dev).eval())
    img = torch.randn(1, 64, 8, 8, device=dev)
    pair("BatchNorm2d(64) eval, (1,64,8,8) fp32, no_grad", lambda: bn_ours(img), lambda: bn_theirs(img))
    gn_theirs = torch.nn.GroupNorm(8, 64, device=dev)
    gn_ours = cunorm_torch.replace_norms(torch.nn.GroupNorm(8, 64, device=dev))
    pair("GroupNorm(8, 64), (1,64,8,8) fp32, no_grad", lambda: gn_ours(img), lambda: gn_theirs(img))
    xg = torch.randn(1, 4096, device=dev, dtype=bf16, requires_grad=True)
    dy = torch.randn_like(xg)

    def step(layer):
        def run():
            y = layer(xg)
            y.backward(dy)
        return run

    pair("RMSNorm(4096) training step (forward + backward), 1x4096 bf16", step(ours), step(theirs), grad=True)
    img_g = img.clone().requires_grad_()
    dimg = torch.randn_like(img)
    bn_train_theirs = torch.nn.BatchNorm2d(64, device=dev)
    bn_train_ours = cunorm_torch.replace_norms(torch.nn.BatchNorm2d(64, device=dev))

    def bn_step(layer):
        def run():
            layer(img_g).backward(dimg)
        return run

    pair("BatchNorm2d(64) training step, (1,64,8,8) fp32", bn_step(bn_train_ours), bn_step(bn_train_theirs),
         grad=True)
    for r in rows:
        if r.get("torch_us"):
            r["ratio"] = r["us"] / r["torch_us"]
    return rows


def host_overhead(n_calls=2000) -> dict:
    """The host suite as {case: us} (bench/bench.py's table)."""
    out = {}
    for r in host_rows(n_calls):
        out[r["case"]] = r["us"]
        if r.get("torch_us"):
            out[r["case"] + " [torch]"] = r["torch_us"]
    return out
