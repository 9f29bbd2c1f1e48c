"""One backward case run three times, for Nsight Compute to profile its third
launch of a kernel:
ncu --clock-control none -k regex:rows_grad_cached --launch-skip 2 --launch-count 1 \
    python3 bench/tools/ncu_backward.py ln_cached
(PYTHONPATH=. where cunorm is not installed). CASE: ln_cached, rms_cached, ln_short, rms_short, p40, p35."""
import sys

import cupy

from cunorm.bench._cases import backward_call


def case(op, shape, dtype, axis):
    *_, run, nbytes = backward_call(op, shape, dtype, axis, cupy.random.default_rng())
    return run, nbytes


CASES = {
    "ln_cached": ("ln", (32768, 4096), "bfloat16", -1),
    "rms_cached": ("rms", (32768, 4096), "bfloat16", -1),
    "ln_short": ("ln", (65536, 1024), "bfloat16", -1),
    "rms_short": ("rms", (65536, 1024), "bfloat16", -1),
    "p40": ("ln", (16, 64, 256, 256), "float32", (1, 2, 3)),
    "p35": ("group", (112, 64, 512, 512), "float32", 8),
}

if __name__ == "__main__":
    run, _ = case(*CASES[sys.argv[1]])
    for _ in range(3):
        run()
    cupy.cuda.runtime.deviceSynchronize()
