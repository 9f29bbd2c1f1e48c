"""Benchmark cunorm against torch eager and torch.compile on the current GPU.

Reports, per case: median ms, effective GB/s (x read once + y written once +
parameters once) and floor% = effective GB/s over the device-to-device copy
bandwidth measured at the start of the same run (bytes read + written).
Writes bench.json and bench.md to --out. Also: host overhead per call on a
1x4096 input, and (--tune) a sweep of launch overrides for the main cases.

    PYTHONPATH=. python bench/bench.py --out results/
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cunorm  # noqa: E402
from cunorm import _dtypes, _ops  # noqa: E402

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


def copy_bandwidth(nbytes=4 << 30):
    src = cupy.ones(nbytes // 4, dtype=np.float32)
    dst = cupy.empty_like(src)
    ms, _, _ = time_gpu(lambda: dst.__setitem__(Ellipsis, src), reps=20)
    del src, dst
    cupy.get_default_memory_pool().free_all_blocks()
    return 2 * nbytes / (ms * 1e-3) / 1e9


def torch_rms(x, w, axis, eps):
    if axis == -1 or axis == x.ndim - 1:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps=eps)
    y = x * torch.rsqrt(x.pow(2).mean(dim=axis, keepdim=True) + eps)
    return y if w is None else y * w.view(-1, *([1] * (x.ndim - axis - 1)))


CASES = [
    # name, shape, dtype, axis, weight, target floor%
    ("problem 36 rms axis=1 (112,64,512,512) fp32", (112, 64, 512, 512), "float32", 1, False, 92),
    ("rms rows 32768x4096 bf16 +w", (32768, 4096), "bfloat16", -1, True, 90),
    ("rms rows 4096x32768 bf16 +w", (4096, 32768), "bfloat16", -1, True, 88),
    ("rms rows 65536x1024 fp32 +w", (65536, 1024), "float32", -1, True, 88),
    ("rms rows 1x4096 bf16 +w (decode)", (1, 4096), "bfloat16", -1, True, None),
    ("rms rows 16x4194304 fp32 (few long rows)", (16, 4194304), "float32", -1, False, None),
    ("rms rows 200000x64 fp16 (short rows)", (200000, 64), "float16", -1, True, None),
]

TUNE = {
    "problem 36 rms axis=1 (112,64,512,512) fp32": [{"bx": 32, "by": 8}, {"bx": 16, "by": 16}, {"bx": 32, "by": 4},
                                                     {"bx": 64, "by": 4}, {"bx": 8, "by": 32}, {"tier": "uncached"}],
    "rms rows 32768x4096 bf16 +w": [{"tier": "cached", "threads": t} for t in (32, 64, 128, 256, 512)],
    "rms rows 4096x32768 bf16 +w": [{"tier": "cached", "threads": t} for t in (512, 1024)] + [{"tier": "uncached"}],
    "rms rows 65536x1024 fp32 +w": [{"tier": "cached", "threads": t} for t in (8, 16, 32, 64, 128, 256)],
    "rms rows 16x4194304 fp32 (few long rows)": [{"tier": "split", "chunks": c} for c in (8, 16, 33, 66, 132)],
}


def make_inputs(shape, dtype, axis, weight):
    dt = np.dtype(getattr(_dtypes, dtype))
    x = cupy.random.standard_normal(shape, dtype=np.float32).astype(dt)
    w = cupy.random.standard_normal(shape[axis], dtype=np.float32).astype(dt) if weight else None
    return x, w


def bench_case(name, shape, dtype, axis, weight, target, copy_bw, with_compile):
    x, w = make_inputs(shape, dtype, axis, weight)
    y = cupy.empty_like(x)
    nbytes = 2 * x.nbytes + (w.nbytes if w is not None else 0)
    row = {"case": name, "shape": list(shape), "dtype": dtype, "axis": axis, "weight": weight,
           "bytes": nbytes, "target_floor_pct": target}
    ms, lo, hi = time_gpu(lambda: cunorm.rms_norm(x, w, axis=axis, out=y))
    plan, launch = _ops.launch_on("rms", x, y, w, *(_axes(axis, x.ndim)), 1e-5)
    row.update(tier=launch.tier, kernel=launch.steps[0].kernel.expression, ms=ms, ms_min=lo, ms_max=hi)
    row["gbps"] = nbytes / (ms * 1e-3) / 1e9
    row["floor_pct"] = 100 * row["gbps"] / copy_bw
    if torch is not None:
        xt = torch.from_dlpack(x)
        wt = None if w is None else torch.from_dlpack(w)
        t_ms, _, _ = time_gpu(lambda: torch_rms(xt, wt, axis, 1e-5), reps=10)
        row["torch_ms"] = t_ms
        row["torch_floor_pct"] = 100 * nbytes / (t_ms * 1e-3) / 1e9 / copy_bw
        if with_compile:
            try:
                compiled = torch.compile(lambda a, b: torch_rms(a, b, axis, 1e-5))
                c_ms, _, _ = time_gpu(lambda: compiled(xt, wt), reps=10, warmup=2)
                row["compile_ms"] = c_ms
                row["compile_floor_pct"] = 100 * nbytes / (c_ms * 1e-3) / 1e9 / copy_bw
            except Exception as err:  # report, keep going
                row["compile_error"] = repr(err)[:200]
        # error against float64 on a slice
        ref_rows = min(x.shape[0], 4)
        xs = x[:ref_rows]
        ref = cunorm.reference.rms_norm(cupy.asnumpy(xs), None if w is None else cupy.asnumpy(w), axis=axis,
                                        exact=True)
        got = cupy.asnumpy(y[:ref_rows]).astype(np.float64)
        row["max_rel_err"] = float(np.max(np.abs(got - ref) / np.maximum(np.abs(ref), 1e-3)))
        del xt, wt
    del x, w, y
    cupy.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.empty_cache()
    return row


def _axes(axis, ndim):
    a = axis % ndim
    return a, a


def tune_case(name, shape, dtype, axis, weight, copy_bw):
    x, w = make_inputs(shape, dtype, axis, weight)
    y = cupy.empty_like(x)
    nbytes = 2 * x.nbytes + (w.nbytes if w is not None else 0)
    first, last = _axes(axis, x.ndim)
    out = []
    for override in TUNE.get(name, []):
        try:
            ms, lo, hi = time_gpu(lambda: _ops.launch_on("rms", x, y, w, first, last, 1e-5, override=override))
            out.append({"case": name, "override": override, "ms": ms,
                        "floor_pct": 100 * nbytes / (ms * 1e-3) / 1e9 / copy_bw})
        except Exception as err:
            out.append({"case": name, "override": override, "error": repr(err)[:200]})
    del x, w, y
    cupy.get_default_memory_pool().free_all_blocks()
    return out


def host_overhead(n_calls=3000):
    """Wall-clock per call of rms_norm on a 1x4096 bf16 input with weight,
    enqueue-bound (the GPU work is ~2 us)."""
    x, w = make_inputs((1, 4096), "bfloat16", -1, True)
    out = {}
    for label, fn in [("cunorm (CuPy in, new output)", lambda: cunorm.rms_norm(x, w)),
                      ("cunorm (CuPy in, out=)", lambda: cunorm.rms_norm(x, w, out=y))]:
        y = cupy.empty_like(x)
        for _ in range(200):
            fn()
        cupy.cuda.runtime.deviceSynchronize()
        t = time.perf_counter()
        for _ in range(n_calls):
            fn()
        cupy.cuda.runtime.deviceSynchronize()
        out[label] = (time.perf_counter() - t) / n_calls * 1e6
    if torch is not None:
        xt, wt = torch.from_dlpack(x), torch.from_dlpack(w)
        fns = [("cunorm (torch in, torch out)", lambda: cunorm.rms_norm(xt, wt)),
               ("torch eager F.rms_norm", lambda: torch.nn.functional.rms_norm(xt, (4096,), wt, eps=1e-5))]
        for label, fn in fns:
            for _ in range(200):
                fn()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(n_calls):
                fn()
            torch.cuda.synchronize()
            out[label] = (time.perf_counter() - t) / n_calls * 1e6
    return out


def fmt(v, spec=".1f"):
    return "" if v is None else format(v, spec)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--tune", action="store_true", help="also sweep launch overrides")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    props = cupy.cuda.runtime.getDeviceProperties(0)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    commit = os.environ.get("CUNORM_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"gpu": gpu, "date": datetime.date.today().isoformat(), "cupy": cupy.__version__,
            "torch": None if torch is None else torch.__version__, "cunorm": cunorm.__version__,
            "commit": commit or None, "driver": cupy.cuda.runtime.driverGetVersion()}
    copy_bw = copy_bandwidth()
    meta["copy_gbps"] = copy_bw
    print(f"{gpu}, {meta['date']}: copy bandwidth {copy_bw:.0f} GB/s (read + write)", flush=True)

    rows = []
    for case in CASES:
        row = bench_case(*case, copy_bw, with_compile=not args.no_compile)
        rows.append(row)
        print(json.dumps(row), flush=True)
    tuning = []
    if args.tune:
        for case in CASES:
            if case[0] in TUNE:
                for r in tune_case(*case[:5], copy_bw):
                    tuning.append(r)
                    print("tune", json.dumps(r), flush=True)
    overhead = host_overhead()
    result = {"meta": meta, "cases": rows, "tuning": tuning, "host_overhead_us": overhead}
    (out_dir / "bench.json").write_text(json.dumps(result, indent=1))

    lines = [f"GPU: {gpu}; date {meta['date']}; copy bandwidth {copy_bw:.0f} GB/s (read + write); "
             f"CuPy {cupy.__version__}; torch {meta['torch']}; commit {meta['commit']}", "",
             "| case | tier | cunorm ms | GB/s | floor% | target | torch eager ms | floor% | torch.compile ms | floor% | max rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['tier']} | {r['ms']:.3f} | {r['gbps']:.0f} | {r['floor_pct']:.1f} | "
                     f"{fmt(r['target_floor_pct'], 'd') if r['target_floor_pct'] else ''} | {fmt(r.get('torch_ms'), '.3f')} | "
                     f"{fmt(r.get('torch_floor_pct'))} | {fmt(r.get('compile_ms'), '.3f')} | "
                     f"{fmt(r.get('compile_floor_pct'))} | {fmt(r.get('max_rel_err'), '.1e')} |")
    lines += ["", "Host overhead per call, 1x4096 bf16 with weight (wall clock, enqueue-bound):", ""]
    lines += [f"- {k}: {v:.1f} us" for k, v in overhead.items()]
    if tuning:
        lines += ["", "| tuning case | override | ms | floor% |", "|---|---|---|---|"]
        lines += [f"| {t['case']} | {t['override']} | {fmt(t.get('ms'), '.3f')} | {fmt(t.get('floor_pct'))} |"
                  for t in tuning]
    (out_dir / "bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
