"""Wall-clock timing shared by the diagnosis scripts of bench/."""
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
