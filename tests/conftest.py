import glob
import os
import sys

import numpy as np
import pytest


def _nvidia_gpu_present() -> bool:
    """Whether the machine has an NVIDIA GPU, asked of the driver's device
    files, not of CuPy."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or bool(glob.glob("/proc/driver/nvidia/gpus/*"))


def _gpu_available() -> bool:
    """Whether the GPU tests run. No driver and no NVIDIA device: they skip.
    An NVIDIA device that CuPy cannot use (a broken driver or CuPy install)
    stops the run, rather than skipping the whole GPU suite unseen;
    CUNORM_TEST_CPU_ONLY=1 runs only the CPU tests on such a machine."""
    if os.environ.get("CUNORM_TEST_CPU_ONLY") == "1":
        return False
    import cupy  # a dependency: an import error is a broken install, reported as it is

    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as err:
        if _nvidia_gpu_present():
            raise pytest.UsageError(
                f"an NVIDIA GPU is present but CuPy cannot use it ({err}); fix the driver or the CuPy install, "
                "or set CUNORM_TEST_CPU_ONLY=1 to run only the CPU tests") from err
        return False
    return count > 0


HAS_GPU = _gpu_available()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_HELD_LIMIT = 2 << 30


@pytest.fixture(autouse=True)
def _release_cached_memory():
    """After each GPU test, the memory CuPy's pool and torch's caching
    allocator hold for reuse goes back to the driver once it passes 2 GiB:
    several test processes share one GPU, and one that keeps a large test's
    blocks starves the others."""
    yield
    if not HAS_GPU:
        return
    import cupy

    pool = cupy.get_default_memory_pool()
    if pool.total_bytes() - pool.used_bytes() > _HELD_LIMIT:
        pool.free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized() and torch.cuda.memory_reserved() > _HELD_LIMIT:
        torch.cuda.empty_cache()


@pytest.fixture(params=[pytest.param("numpy", id="numpy"), pytest.param("cupy", id="cupy", marks=pytest.mark.gpu)])
def xp(request):
    """The array module a validation test body runs against: NumPy (CPU, in
    CI) and CuPy (GPU)."""
    if request.param == "numpy":
        return np
    import cupy

    return cupy


@pytest.fixture
def rng():
    """Fresh random data every run; the seed is printed on failure."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed {seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def poisoned():
    """Every CuPy allocation during the test starts as all-ones bytes (NaN in
    every float dtype), so an element a kernel forgets to write fails."""
    import cupy

    pool = cupy.cuda.MemoryPool()

    def allocate(size):
        mem = pool.malloc(size)
        cupy.cuda.runtime.memsetAsync(mem.ptr, 0xFF, size, cupy.cuda.get_current_stream().ptr)
        return mem

    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(allocate)
    try:
        yield
    finally:
        cupy.cuda.set_allocator(previous)
