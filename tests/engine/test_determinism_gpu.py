"""Determinism at the byte level, under threads and streams (GPU): every
kernel family's forward and backward gives the same bytes when the same call
runs again, from several threads at once, each on its own non-blocking
stream (the launch cache, the loaded-kernel cache and the workspaces shared
between them). Partials are combined in a fixed order, never by float
atomics, so any difference is a bug."""
import threading

import numpy as np
import pytest

import cunorm
from cunorm._engine import dtypes
from helpers import random

pytestmark = pytest.mark.gpu

THREADS = 4
ROUNDS = 3


def _calls(rng):
    """name -> call returning a tuple of CuPy arrays; the inputs are made
    once, on the null stream, before any thread starts."""
    import cupy

    def arr(shape, dtype=np.float32):
        return cupy.asarray(random(rng, shape, dtype))

    rows, wide, nchw = arr((4096, 1024)), arr((8, 300000)), arr((8, 64, 28, 28))
    w1024, w64 = arr((1024,)), arr((64,))
    nhwc = cupy.ascontiguousarray(nchw.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    bf16 = arr((2048, 4096), dtypes.bfloat16)
    dy_rows, dy_nchw = arr((4096, 1024)), arr((8, 64, 28, 28))
    _, mean, rstd = cunorm.layer_norm(rows, w1024, w1024, return_stats=True)
    _, gmean, grstd = cunorm.group_norm(nchw, 8, w64, w64, return_stats=True)
    _, bmean, brstd = cunorm.batch_norm(nhwc, w64, w64, return_stats=True)
    cupy.cuda.Device().synchronize()
    return {
        "rms rows bf16": lambda: (cunorm.rms_norm(bf16),),
        "layer_norm split rows": lambda: cunorm.layer_norm(wide, return_stats=True),
        "rms strided (axis 1)": lambda: (cunorm.rms_norm(nchw, axis=1),),
        "frobenius whole array": lambda: (cunorm.frobenius_normalize(wide),),
        "group_norm": lambda: cunorm.group_norm(nchw, 8, w64, w64, return_stats=True),
        "batch_norm channels-last": lambda: cunorm.batch_norm(nhwc, w64, w64, return_stats=True),
        "layer_norm backward": lambda: cunorm.layer_norm_backward(dy_rows, rows, mean, rstd, w1024, w1024),
        "group_norm backward": lambda: cunorm.group_norm_backward(dy_nchw, nchw, gmean, grstd, 8, w64, w64),
        "batch_norm backward": lambda: cunorm.batch_norm_backward(dy_nchw, nhwc, bmean, brstd, w64, w64),
    }


def _bytes(results):
    import cupy

    return [cupy.asnumpy(a).tobytes() for a in results if a is not None]


def test_same_bytes_from_threads_on_their_own_streams(rng):
    import cupy

    calls = _calls(rng)
    want = {name: _bytes(call()) for name, call in calls.items()}
    got, errors = [], []

    def work(seed):
        try:
            with cupy.cuda.Stream(non_blocking=True) as stream:
                order = list(calls)
                np.random.default_rng(seed).shuffle(order)  # threads meet different kernels at once
                for _ in range(ROUNDS):
                    for name in order:
                        results = calls[name]()
                        stream.synchronize()
                        got.append((name, _bytes(results)))
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(got) == THREADS * ROUNDS * len(calls)
    different = sorted({name for name, b in got if b != want[name]})
    assert not different, f"bytes differ from the first run under threads and streams: {different}"
