"""Launch overrides swept by the benchmark of record's --tune (bench/bench.py):
the row tiers' block shapes and walks, and the channel walks' chunking, each
against the dispatch's own choice, as floor% of copy bandwidth."""
from __future__ import annotations

import cupy

from cunorm._engine import row_norms
from cunorm.bench._cases import _axes, fewest_bytes, make_inputs
from cunorm.bench._channel_cases import _channel_prepared, make_channel_inputs
from cunorm.bench._timing import time_gpu


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


#: channel cases: the chunks each channel's positions are cut into (the split walk's
#: wave quantization), against the default.
CHANNEL_TUNE = {
    "problem 35 group_norm(8) (112,64,512,512) fp32 +w+b": [{"chunks": c} for c in (1, 2, 4, 8)],
    "problem 34 instance_norm (112,64,512,512) fp32": [{"walk": "split", "chunks": c} for c in (1, 2, 4)],
    "problem 33 batch_norm train (64,64,512,512) fp32 +w+b": [{"chunks": c} for c in (1, 2, 4, 8)],
    "group_norm(32) channels-last (8,128,128,512) bf16 +w+b": [{"chunks": c} for c in (16, 33, 66, 264)],
}


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
