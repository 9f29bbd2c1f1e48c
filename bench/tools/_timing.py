"""Wall-clock timing and profiling shared by the diagnosis scripts of bench/."""
import cProfile
import pstats
import time

import torch


def per_call(fn, n=2000, warmup=100) -> float:
    """Microseconds a call of ``fn`` in a loop of ``n``, after ``warmup``
    calls, the GPU drained before and after (host-bound for small inputs)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def print_profile(fn, n, title, top=18, warmup=50) -> None:
    """cProfile of ``n`` calls of ``fn`` (after ``warmup``), the GPU drained
    at the end, the ``top`` functions by own time (cProfile inflates short
    calls: read it for where the time goes, not for how much)."""
    for _ in range(warmup):
        fn()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    profiler.disable()
    print(f"== {title}: {n} calls, by own time")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)
