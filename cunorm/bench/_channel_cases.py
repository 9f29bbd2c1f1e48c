"""The benchmark's channel-norm cases (GroupNorm, InstanceNorm, BatchNorm)
and their runner: cunorm against torch eager and torch.compile, as
cunorm/bench/_cases.py's row cases."""
from __future__ import annotations

import cupy
import numpy as np

import cunorm
from .._engine import dtypes
from ._cases import fewest_bytes
from ._timing import compile_static, single_columns, time_gpu, torch


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
                compiled = compile_static(lambda a, d, e: torch_channel_norm(op, a, groups, d, e, channel_axis, rt,
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
