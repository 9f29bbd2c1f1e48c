"""The benchmark's timers: GPU time under a busy fill, a single call on an
idle GPU, host time per call, and the copy bandwidth every floor% is
measured against (cunorm/bench/_cases.py, _channel_cases.py, _host.py)."""
from __future__ import annotations

import statistics
import time

import cupy
import numpy as np

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


def compile_static(fn):
    """torch.compile of fn as a model's norm gets it: shapes static, dynamo's
    caches emptied first. The benchmarks compile one function over many
    cases, and dynamo keeps its graphs on the function's code: a second
    shape would recompile with the changed sizes dynamic (automatic dynamic
    shapes; LayerNorm bf16 131072x256 then ran 122 us against 37 static,
    H200), and past the recompile limit the rest would run eagerly."""
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


def copy_bandwidth(nbytes=4 << 30):
    src = cupy.ones(nbytes // 4, dtype=np.float32)
    dst = cupy.empty_like(src)
    ms, _, _ = time_gpu(lambda: dst.__setitem__(Ellipsis, src), reps=20)
    del src, dst
    cupy.get_default_memory_pool().free_all_blocks()
    return 2 * nbytes / (ms * 1e-3) / 1e9


def release():
    """Return the memory pools' cached blocks (between cases, after an out-of-memory)."""
    cupy.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.empty_cache()


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
