"""Launching: a call's kernels as a Program of prepared launches.

A Program is built once per launch signature (cunorm/_engine/row_norms.py,
channel_norms.py and gradients.py build them from the dispatch's Steps and cache
them): each step's kernel is loaded, opted in to its dynamic shared memory,
its persistent grid capped at the resident blocks, and its arguments
packed into a buffer once, in the order and C kinds of the kernel's
declaration (cunorm/_engine/declarations.py). Running a Program writes the call's
pointers (its slots) into those buffers and launches each step through the
driver (cuLaunchKernel, or cuLaunchCooperativeKernel) on the caller's
stream: no CuPy array, argument conversion or per-launch lookup. On sm_90
and later each step after a Program's first is launched with programmatic
stream serialization (cuLaunchKernelEx through ctypes: CuPy has no binding
of it), so its blocks are placed while the step before it finishes instead
of after; every kernel opens by waiting for the grid before it
(grid_dependency_sync, cunorm/kernels/common.cuh), so the order of their
memory accesses is the stream's.

A Program's buffers are shared by every call with its signature; a lock per
Program makes filling and launching one unit, so threads calling the same
signature at once each launch their own pointers (the driver copies the
arguments at launch).
"""
from __future__ import annotations

import ctypes
import functools
import math
import threading

import numpy as np
from cupy_backends.cuda.api import driver, runtime

from . import dispatch_rows, loader, targets
from .declarations import POINTER_KINDS

#: called as hook(step, launch) around each launch when set (the tuning
#: scripts time each step through it); None on the normal path
step_hook = None


class Slot:
    """A pointer the call supplies at run time (``offset`` bytes into it)."""

    __slots__ = ("index", "offset")

    def __init__(self, index: int, offset: int = 0):
        self.index, self.offset = index, offset

    def __add__(self, offset: int) -> "Slot":
        return Slot(self.index, self.offset + offset)


INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT
_WORKSPACE_ALIGN = 256


class PreparedStep:
    """One launch: ``launcher(*head, stream, params_ptr[, 0])`` with
    ``head`` = (function, grid x/y/z, block x/y/z, shared bytes)."""

    __slots__ = ("step", "device", "fn", "grid", "block", "shared", "cooperative", "dependent", "buf", "words",
                 "params", "params_ptr", "fills", "head")

    def launch(self, stream: int) -> None:
        if self.cooperative:
            launch_cooperative_kernel(*self.head, stream, self.params_ptr)
        elif self.dependent is not None:
            launch_dependent_kernel(self.dependent, stream, self.params_ptr)
        else:
            launch_kernel(*self.head, stream, self.params_ptr, 0)


def make_current(device: int) -> None:
    """A thread that has not touched CUDA through the runtime yet (a new
    Python thread, autograd's device thread) has no current context for the
    driver's launch: make the device's primary context current, as the
    runtime would."""
    runtime.setDevice(device)


# --- programmatic dependent launch --------------------------------------------

#: whether Programs built from now on launch their later steps as dependent
#: launches where the GPU and driver allow it (bench/tools/dependent_launch.py
#: times the two)
dependent_launch = True

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union
    whose first int is programmaticStreamSerializationAllowed."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_rest", ctypes.c_char * 60)]


class DependentLaunch(ctypes.Structure):
    """CUlaunchConfig of one step (its grid, block, shared memory and the
    programmatic serialization attribute), with the step's function; the
    stream is written at each launch, under the Program's lock."""
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]

    def __init__(self, fn: int, grid, block, shared: int):
        self.attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        super().__init__(*grid, *block, shared, None, ctypes.pointer(self.attribute), 1)
        self.fn = fn
        self.address = ctypes.addressof(self)
        self.call = driver_launch_kernel_ex()


#: the first driver whose CUDA graphs hold programmatic dependencies (stream
#: capture of a dependent launch, as torch.cuda.graph captures cunorm's calls)
_DEPENDENT_LAUNCH_DRIVER = 12030


@functools.lru_cache(maxsize=1)
def driver_launch_kernel_ex():
    """cuLaunchKernelEx from the driver CuPy has loaded (looked up once), or
    None where the driver is older than CUDA 12.3 or is not libcuda.so.1."""
    if runtime.driverGetVersion() < _DEPENDENT_LAUNCH_DRIVER:
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    fn = getattr(lib, "cuLaunchKernelEx", None)
    if fn is not None:
        fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
        fn.restype = ctypes.c_int
    return fn


def dependent_launch_on(device: int) -> bool:
    """Whether steps after a Program's first launch as dependent launches
    on ``device``: compute capability 9.0 or newer (griddepcontrol) and
    driver_launch_kernel_ex; never on a target planned ahead of time."""
    return (dependent_launch and device >= 0 and device_info(device).compute_capability >= 90
            and driver_launch_kernel_ex() is not None)


def launch_dependent_kernel(config: DependentLaunch, stream: int, params_ptr: int) -> None:
    config.stream = stream
    status = config.call(config.address, config.fn, params_ptr, None)
    if status:
        raise CUDADriverError(status)


# The driver calls a run makes, by name (launch_dependent_kernel above too):
# the launch cache's generated launchers (cunorm/_engine/launch_cache.py) bind
# them when they are built, and the CPU tests replace them.
launch_kernel = driver.launchKernel
launch_cooperative_kernel = driver.launchCooperativeKernel
memset_async = runtime.memsetAsync
CUDADriverError = driver.CUDADriverError


class Program:
    """The prepared launches of one call signature: run(pointers, stream, alloc)."""

    __slots__ = ("steps", "workspaces", "slots", "lock", "workspace_bytes", "offsets", "zeroed")

    def __init__(self, steps, workspaces, slots):
        self.steps = tuple(steps)
        self.workspaces = tuple(workspaces)  # (bytes, zeroed) of each workspace slot, after the call's slots
        self.slots = slots
        self.lock = threading.Lock()
        # every workspace in one allocation, each at a 256-byte boundary;
        # the zeroed ones set by a memset on the stream (not an allocation
        # and a fill kernel each)
        offsets, zeroed, total = [], [], 0
        for nbytes, zero in self.workspaces:
            offsets.append(total)
            if zero:
                zeroed.append((total, nbytes))
            total += -(-nbytes // _WORKSPACE_ALIGN) * _WORKSPACE_ALIGN
        self.workspace_bytes, self.offsets, self.zeroed = total, tuple(offsets), tuple(zeroed)

    def run_named(self, arrays: dict, stream: int, alloc=None):
        """run with the call's arrays by slot name (a slot not named, or
        named None, gets a null pointer)."""
        return self.run(tuple(ptr(arrays.get(slot)) for slot in self.slots), stream, alloc)

    def run(self, pointers, stream: int, alloc=None):
        """Launch every step on ``stream`` with the call's ``pointers`` (one
        int per slot, in the slots' order). ``alloc(nbytes)`` returns
        (owner, pointer) of the workspaces' memory, in the caller's
        allocator on the stream (freed in the stream's order once the owner
        is dropped). Returns the owner (None without workspaces). The
        general path's run; a cached call runs the launcher generated for
        it (cunorm/_engine/launch_cache.py)."""
        owner = None
        if self.workspaces:
            owner, base = alloc(self.workspace_bytes)
            pointers = list(pointers)
            pointers.extend(base + offset for offset in self.offsets)
            for offset, nbytes in self.zeroed:
                memset_async(base + offset, 0, nbytes, stream)
        with self.lock:
            try:
                self._launch_all(pointers, stream)
            except CUDADriverError as err:
                # no context: the first launch failed, nothing ran yet
                if err.status != INVALID_CONTEXT:
                    raise
                make_current(self.steps[0].device)
                self._launch_all(pointers, stream)
        return owner

    def _launch_all(self, pointers, stream: int) -> None:
        for s in self.steps:
            words = s.words
            for arg, slot, offset in s.fills:
                words[arg] = pointers[slot] + offset
            if step_hook is None:
                s.launch(stream)
            else:
                step_hook(s.step, functools.partial(s.launch, stream))


_PACK = {"i32": (np.int32, 2), "i64": (np.int64, 1), "f32": (np.float32, 2), "f64": (np.float64, 1)}


class ProgramBuilder:
    """Builds a Program over named slots on ``device``: ``b["x"]`` is the
    slot of the call's x, ``b.workspace(nbytes)`` a scratch buffer the run
    allocates, ``b.launch(step, name=value, ...)`` a launch whose arguments
    are named as the kernel declares them."""

    def __init__(self, slots: tuple[str, ...], device: int):
        self.slots = tuple(slots)
        self.device = device
        self.steps: list[PreparedStep] = []
        self.workspaces: list[tuple[int, bool]] = []

    def __getitem__(self, name: str) -> Slot:
        return Slot(self.slots.index(name))

    def workspace(self, nbytes: int, zeroed: bool = False) -> Slot:
        self.workspaces.append((max(int(nbytes), 1), zeroed))
        return Slot(len(self.slots) + len(self.workspaces) - 1)

    def persistent_grid(self, step: dispatch_rows.Step) -> tuple[int, ...]:
        return persistent_grid(step, self.device)

    def launch(self, step: dispatch_rows.Step, **args) -> None:
        kernel = step.kernel
        fn = step_function(step, self.device)
        grid = step.grid
        if kernel.cooperative:
            resident = resident_blocks(fn, step.threads, step.shared_bytes, self.device)
            if resident < math.prod(grid):
                raise RuntimeError(f"{kernel.expression}: {math.prod(grid)} blocks cannot all be resident "
                                   f"({resident} fit on the GPU)")
        elif kernel.persistent:
            grid = persistent_grid(step, self.device)
        names, args = launch_arguments(step, args)
        s = PreparedStep()
        s.step = step
        s.device = self.device
        s.fn = fn.kernel.ptr
        s.grid = tuple(grid) + (1,) * (3 - len(grid))
        s.block = (step.threads, 1, 1)
        s.shared = step.shared_bytes
        s.cooperative = kernel.cooperative
        # a step after the first may start while the one before it finishes
        # (its kernel waits for that grid first); a cooperative launch takes
        # no launch attribute here
        s.dependent = (DependentLaunch(s.fn, s.grid, s.block, s.shared)
                       if self.steps and not kernel.cooperative and dependent_launch_on(self.device) else None)
        s.buf = np.zeros(len(names), dtype=np.uint64)
        fills = []
        for i, (name, kind) in enumerate(kernel.signature):
            value = args[name]
            if kind in POINTER_KINDS:
                if isinstance(value, Slot):
                    fills.append((i, value.index, value.offset))
                elif value is not None:
                    raise TypeError(f"{kernel.expression}: pointer argument {name} must be a slot or None")
            else:
                dtype, stride = _PACK[kind]
                if isinstance(value, (Slot, bool)) or value is None:
                    raise TypeError(f"{kernel.expression}: argument {name} must be a number, got {value!r}")
                packed = dtype(value)
                if kind in ("i32", "i64") and int(packed) != value:
                    raise OverflowError(f"{kernel.expression}: argument {name} = {value} does not fit {kind}")
                s.buf.view(dtype)[i * stride] = packed
        s.fills = tuple(fills)
        s.params = np.arange(len(names), dtype=np.uint64) * np.uint64(8) + np.uint64(s.buf.ctypes.data)
        s.params_ptr = s.params.ctypes.data
        # the argument words as a memoryview: an item written through it
        # costs a fraction of a NumPy item assignment
        s.words = memoryview(s.buf).cast("B").cast("Q")
        s.head = (s.fn,) + s.grid + s.block + (s.shared,)
        self.steps.append(s)

    def build(self) -> Program:
        return Program(self.steps, self.workspaces, self.slots)


def launch_arguments(step: dispatch_rows.Step, args: dict) -> tuple[list[str], dict]:
    """The kernel's argument names and the call's arguments checked against
    them, block_x added where the kernel takes it."""
    kernel = step.kernel
    if not kernel.signature:
        raise RuntimeError(f"{kernel.expression} has no declared signature")
    names = [n for n, _ in kernel.signature]
    if "block_x" in names:  # a 2-D layout over the 1-D block (cunorm/_engine/declarations.py)
        args = {**args, "block_x": step.block[0]}
    elif any(extent != 1 for extent in step.block[1:]):
        raise RuntimeError(f"{kernel.expression} has a 1-D layout, its step a block of {step.block}")
    if set(args) != set(names):
        raise TypeError(f"{kernel.expression}: arguments {sorted(args)} do not match its declaration {names}")
    return names, args


class RecordedLaunch:
    """A launch as LaunchRecorder keeps it: the 1-D block's threads, the
    grid (a persistent one capped), the arguments by name."""

    __slots__ = ("kernel", "grid", "threads", "shared", "args")

    def __init__(self, kernel, grid, threads, shared, args):
        self.kernel, self.grid, self.threads, self.shared, self.args = kernel, grid, threads, shared, args


class LaunchRecorder:
    """ProgramBuilder's interface, recording the launches instead of
    preparing them (what cunorm/jax/_jit.py lowers into XLA custom calls).
    ``persistent_grid(step)`` caps a persistent grid; by default the
    device's occupancy, asked through CuPy."""

    def __init__(self, slots: tuple[str, ...], device: int, persistent_grid=None):
        self.slots = tuple(slots)
        self.device = device
        self.launches: list[RecordedLaunch] = []
        self.workspaces: list[tuple[int, bool]] = []
        self._persistent = persistent_grid or (lambda step: _persistent_grid(step, device))

    __getitem__ = ProgramBuilder.__getitem__
    workspace = ProgramBuilder.workspace

    def persistent_grid(self, step: dispatch_rows.Step) -> tuple[int, ...]:
        return self._persistent(step)

    def launch(self, step: dispatch_rows.Step, **args) -> None:
        if step.kernel.cooperative:
            raise RuntimeError(f"{step.kernel.expression} is launched cooperatively, which the recorded launches "
                               f"cannot be")
        grid = self.persistent_grid(step) if step.kernel.persistent else step.grid
        _, args = launch_arguments(step, args)
        self.launches.append(RecordedLaunch(step.kernel, tuple(grid) + (1,) * (3 - len(grid)), step.threads,
                                            step.shared_bytes, args))

    def build(self) -> "LaunchRecorder":
        return self


# --- kernels on a device ---------------------------------------------------------


@functools.lru_cache(maxsize=16)
def device_info(device_id: int) -> dispatch_rows.Device:
    """What the dispatch needs to know about GPU ``device_id``; a negative
    id names an architecture planned for ahead of time (cunorm/_engine/targets.py),
    which asks nothing of the driver."""
    if device_id < 0:
        return targets.by_id(device_id).device
    import cupy

    dev = cupy.cuda.Device(device_id)
    cc = int(dev.compute_capability)
    if cc < 80:
        raise RuntimeError(f"cunorm needs a GPU of compute capability 8.0 or newer; GPU {device_id} is {cc / 10:.1f}")
    attrs = dev.attributes
    return dispatch_rows.Device(sm_count=attrs["MultiProcessorCount"], compute_capability=cc,
                                max_shared_per_block=attrs["MaxSharedMemoryPerBlockOptin"],
                                l2_bytes=runtime.deviceGetAttribute(runtime.cudaDevAttrL2CacheSize, device_id))


def step_function(step, device: int):
    """A step's kernel, opted in to the step's dynamic shared memory where
    that is more than the default allows (48 KB less the static): before
    any launch, and before any occupancy query, which otherwise counts no
    block at all of a kernel that asks for more."""
    fn = loader.get_function(step.kernel.family, step.kernel.expression, device, step.kernel.cooperative)
    if step.shared_bytes > 0 and fn.max_dynamic_shared_size_bytes < step.shared_bytes:
        fn.max_dynamic_shared_size_bytes = step.shared_bytes
    return fn


def persistent_grid(step, device: int) -> tuple[int, ...]:
    """A persistent step's grid, its x extent capped at the blocks resident
    at once (so no block starts its share late), whole clusters of a
    kernel with clusters."""
    cluster = step.kernel.cluster
    if device < 0:  # a target named ahead of time: its occupancy from the compiler's resource report
        target = targets.by_id(device)
        registers, static_shared = loader.kernel_resources(step.kernel.family, step.kernel.expression, target.arch)
        per_sm = target.resident_per_sm(registers, static_shared, step.threads, step.shared_bytes)
        resident = per_sm * target.device.sm_count // cluster * cluster
    else:
        fn = step_function(step, device)
        resident = resident_blocks(fn, step.threads, step.shared_bytes, device) // cluster * cluster
    if resident < 1:
        raise RuntimeError(f"{step.kernel.expression}: no block of {step.threads} threads and "
                           f"{step.shared_bytes} B of shared memory fits an SM")
    return (min(step.grid[0], resident),) + tuple(step.grid[1:])


def resident_blocks(fn, threads: int, shared_bytes: int, device: int) -> int:
    """How many blocks of ``threads`` and ``shared_bytes`` of a kernel fit on
    the GPU at once (a cooperative grid must; a persistent grid is capped
    at it). Asked when a Program is built, not per launch."""
    per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, threads, shared_bytes)
    return per_sm * device_info(device).sm_count


def check_limits(step, device=None):
    grid, block = step.grid, step.block
    if not (0 < grid[0] <= dispatch_rows.MAX_GRID_X and all(0 < g <= dispatch_rows.MAX_GRID_Y for g in grid[1:])):
        raise RuntimeError(f"grid {grid} for {step.kernel.expression} is outside the launch limits")
    shared_limit = 48 * 1024 if device is None else max(48 * 1024, device.max_shared_per_block)
    if not (0 < math.prod(block) <= step.threads <= 1024) or step.shared_bytes > shared_limit:
        raise RuntimeError(f"block {block} / {step.shared_bytes} B shared for {step.kernel.expression} is out of limits")


# --- the CuPy side of a run ---------------------------------------------------------


def cupy_alloc(nbytes: int):
    """Workspace memory from CuPy's current allocator (torch's, inside a torch scope)."""
    import cupy

    a = cupy.empty(nbytes, dtype=np.uint8)
    return a, a.data.ptr


def cupy_stream() -> int:
    import cupy

    return cupy.cuda.get_current_stream().ptr


def ptr(a) -> int:
    """A CuPy array's pointer, 0 for None."""
    return 0 if a is None else a.data.ptr


_persistent_grid = persistent_grid  # (LaunchRecorder's default, beside its method of the same name)
