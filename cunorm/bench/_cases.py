"""The benchmark's row-norm cases (RMSNorm, LayerNorm, the Lp family, the
backward passes) and their runners: cunorm against torch eager,
torch.compile and Liger (when importable) on the current GPU, each
returning one result row (the channel norms: _channel_cases.py).

Per case: median ms and its spread (min, max), effective GB/s (the fewest
bytes: x read once, y written once, parameters once) and floor% = effective
GB/s over the device-to-device copy bandwidth measured at the start of the
same run (bytes read + written), and the max relative error against the
float64 reference on the first groups. Used by ``python -m cunorm bench``
(cunorm/bench/__init__.py) and by the repository's bench/bench.py.
"""
from __future__ import annotations

import importlib

import cupy
import numpy as np

import cunorm
from .._engine import dtypes, row_norms
from ._timing import compile_static, single_columns, time_gpu, torch


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
                compiled = compile_static(lambda a: torch_lp(op, a, axis))
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
                compiled = compile_static(lambda a, c, d, e: torch_norm(op, a, c, d, axis, 1e-5, e))
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
    # short rows: 1024 bf16 (a block a row), 256 and 128 (QK-norm's heads: several rows a block)
    ("backward rms_norm bf16 65536x1024 +w (short rows)", "rms", (65536, 1024), "bfloat16", -1, 80),
    ("backward layer_norm bf16 65536x1024 +w+b (short rows)", "ln", (65536, 1024), "bfloat16", -1, 80),
    ("backward layer_norm bf16 131072x256 +w+b (short rows)", "ln", (131072, 256), "bfloat16", -1, None),
    ("backward rms_norm bf16 262144x128 +w (short rows)", "rms", (262144, 128), "bfloat16", -1, None),
    # 64 KB of column sums a block: more than the default dynamic shared memory
    ("backward layer_norm bf16 4096x8192 +w+b", "ln", (4096, 8192), "bfloat16", -1, None),
    ("backward layer_norm bf16 4096x32768 +w+b (long rows)", "ln", (4096, 32768), "bfloat16", -1, None),
    # few long rows (LayerNorm over each sample's feature map): one row part
    ("backward layer_norm bf16 (8,64,128,128) axes 1-3 +w+b", "ln", (8, 64, 128, 128), "bfloat16", (1, 2, 3), None),
    ("backward problem 40 layer_norm (16,64,256,256) fp32 +w+b", "ln", (16, 64, 256, 256), "float32", (1, 2, 3), 60),
    ("backward problem 35 group_norm(8) (112,64,512,512) fp32 +w+b", "group", (112, 64, 512, 512), "float32", 8, 60),
    ("backward problem 36 rms_norm axis 1 (112,64,512,512) fp32 +w", "rms", (112, 64, 512, 512), "float32", 1, 85),
    # the strided axis in both dtypes and norms, and a ConvNeXt-like channel LayerNorm (256 channels of 56 x 56)
    ("backward rms_norm axis 1 (56,64,512,512) bf16 +w", "rms", (56, 64, 512, 512), "bfloat16", 1, 85),
    ("backward layer_norm axis 1 (56,64,512,512) fp32 +w+b", "ln", (56, 64, 512, 512), "float32", 1, 85),
    ("backward layer_norm axis 1 (56,64,512,512) bf16 +w+b", "ln", (56, 64, 512, 512), "bfloat16", 1, 85),
    ("backward layer_norm axis 1 (32,256,56,56) fp32 +w+b", "ln", (32, 256, 56, 56), "float32", 1, None),
    ("backward layer_norm axis 1 (32,256,56,56) bf16 +w+b", "ln", (32, 256, 56, 56), "bfloat16", 1, None),
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
    single_columns(row, nbytes, copy_bw, run)  # (cunorm's backward function on CuPy arrays)
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
        for key, fn in (("torch", forward), ("compile", compile_static(forward) if with_compile else None)):
            if fn is None:
                continue
            try:
                y = fn(xt, wt, bt)

                def grads():
                    return torch.autograd.grad(y, inputs, dyt, retain_graph=True)

                t_ms, _, _ = time_gpu(grads, reps=10, warmup=2)
                row[f"{key}_ms"] = t_ms
                row[f"{key}_floor_pct"] = 100 * nbytes / (t_ms * 1e-3) / 1e9 / copy_bw
                single_columns(row, nbytes, copy_bw, None, **{"eager" if key == "torch" else "compiled": grads})
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
