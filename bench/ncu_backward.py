"""One backward case run three times, for Nsight Compute to profile its third
launch of a kernel (bench/device_run's profiling step; the cases of
bench/tune_backward.py). PYTHONPATH=. python bench/ncu_backward.py CASE
CASE: ln_cached, rms_cached, p40, p35."""
import sys

sys.path.insert(0, ".")
from tune_backward import case  # noqa: E402  (this script's folder is on sys.path)

CASES = {
    "ln_cached": ("ln", (32768, 4096), "bfloat16", -1),
    "rms_cached": ("rms", (32768, 4096), "bfloat16", -1),
    "p40": ("ln", (16, 64, 256, 256), "float32", (1, 2, 3)),
    "p35": ("group", (112, 64, 512, 512), "float32", 8),
}

if __name__ == "__main__":
    run, _ = case(*CASES[sys.argv[1]])
    for _ in range(3):
        run()
    import cupy

    cupy.cuda.runtime.deviceSynchronize()
