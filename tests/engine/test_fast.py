"""The launch cache's bookkeeping on CPU (cunorm/_engine/launch_cache.py): the bound,
threads inserting at once, and which calls are keyed."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from cunorm._engine import launch_cache


def test_cache_is_bounded_oldest_out_first():
    cache = launch_cache.BoundedCache(4)
    for i in range(10):
        cache.put(i, str(i))
    assert len(cache) == 4
    assert cache.get(5) is None and cache.get(9) == "9" and cache.get(6) == "6"
    cache.put(6, "six")  # a key already in does not evict
    assert len(cache) == 4 and cache.get(6) == "six" and cache.get(7) == "7"


def test_cache_under_threads_stays_bounded():
    cache = launch_cache.BoundedCache(64)

    def fill(base):
        for i in range(2000):
            cache.put((base, i), i)

    threads = [threading.Thread(target=fill, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cache) == 64


class _FakeAdapter:
    """An adapter whose signature is its array's shape (NumPy stands in)."""

    def __init__(self, watched=False):
        self._watched = watched

    def signatures(self, x, arrays):
        if self._watched:
            return None
        try:
            return tuple(None if a is None else (a.dtype, a.shape, a.strides) for a in (x,) + arrays)
        except AttributeError:
            return None


def test_key_holds_every_array_and_scalar():
    ad = _FakeAdapter()
    x, w = np.zeros((4, 8), np.float32), np.zeros(8, np.float32)
    k = launch_cache.key(ad, x, w, None, scalars=("rms", -1, 1e-5))
    assert k == launch_cache.key(ad, x.copy(), w.copy(), None, scalars=("rms", -1, 1e-5))
    assert k != launch_cache.key(ad, x, None, None, scalars=("rms", -1, 1e-5))  # weight absent
    assert k != launch_cache.key(ad, x.astype(np.float16), w, None, scalars=("rms", -1, 1e-5))  # dtype
    assert k != launch_cache.key(ad, np.zeros((8, 8), np.float32)[:, ::2], w, None, scalars=("rms", -1, 1e-5))  # strides
    assert k != launch_cache.key(ad, x, w, None, scalars=("rms", -1, 1e-6))  # eps
    assert launch_cache.key(_FakeAdapter(watched=True), x, w, None) is None  # autograd or dynamo watching
    assert launch_cache.key(ad, x, object(), None) is None  # an array the signature cannot read


def test_only_exact_types_are_keyed():
    """Values that compare equal to the keyed ones but would fail (or
    validate differently) on the general path are never keyed."""
    x = np.zeros((2, 3), np.float32)  # NumPy has no fast half: never keyed
    assert launch_cache.rows_key("rms", x, None, None, None, -1, 1e-5, False) is None
    assert not launch_cache._int_axes(True) and not launch_cache._int_axes((1.0,)) and not launch_cache._int_axes([1])
    assert launch_cache._int_axes(-1) and launch_cache._int_axes((1, 2)) and launch_cache._int_axes(None)


def test_workspaces_are_one_allocation_with_zeroed_ranges_set_on_the_stream(monkeypatch):
    """A Program's workspaces: one allocation, each at a 256-byte boundary;
    the zeroed ones cleared by a memset on the call's stream (no second
    allocation, no fill kernel)."""
    from cunorm._engine import launches

    program = launches.Program([], [(10, False), (4, True), (300, True)], ("x",))
    assert program.offsets == (0, 256, 512) and program.workspace_bytes == 1024
    assert program.zeroed == ((256, 4), (512, 300))
    allocations, memsets = [], []
    monkeypatch.setattr(launches, "memset_async",
                        lambda ptr, value, nbytes, stream: memsets.append((ptr, nbytes, stream)))

    def alloc(nbytes):
        allocations.append(nbytes)
        return "owner", 4096

    assert program.run([1], 7, alloc) == "owner"
    assert allocations == [1024]
    assert memsets == [(4096 + 256, 4, 7), (4096 + 512, 300, 7)]


def _allocations_recorded(made, like, empty):
    """_NumpyAdapter noting each allocation in ``made``: ("like", *like(a))
    for empty_like(a), ("empty", *empty(shape, dtype)) for empty_beside."""

    class Adapter(_NumpyAdapter):
        @staticmethod
        def empty_beside(a, shape, dtype, perm=None):
            made.append(("empty", *empty(tuple(shape), np.dtype(dtype))))
            return np.empty(shape, dtype)

        @staticmethod
        def empty_like(a):
            made.append(("like", *like(a)))
            return np.empty_like(a)

    return Adapter


def test_entry_allocates_like_a_contiguous_input_of_the_same_shape_and_dtype(monkeypatch):
    """y like x where x is C-contiguous and y has its shape and dtype; the
    statistics, and y beside a strided x, from their shape."""
    made = []
    Adapter = _allocations_recorded(made, lambda a: (a.shape, a.dtype), lambda shape, dtype: (shape, dtype))
    _, program = _recording(monkeypatch)
    x = np.zeros((4, 8), np.float32)
    outputs = {"y": (x.shape, x.dtype, None), "rstd": ((4,), np.dtype(np.float32), None)}
    entry = launch_cache.entry(Adapter, 0, program, ("x", "w"), outputs, {"x": "x", "w": "w", "y": "y", "rstd": "rstd"}, ("y", "rstd"),
                               arrays={"x": x})
    y, rstd = entry(x, None)
    assert made == [("like", (4, 8), np.float32), ("empty", (4,), np.float32)]
    made.clear()
    strided = np.zeros((4, 16), np.float32)[:, ::2]
    entry = launch_cache.entry(Adapter, 0, program, ("x", "w"), outputs, {"x": "x", "w": "w", "y": "y", "rstd": "rstd"}, ("y", "rstd"),
                               arrays={"x": strided})
    entry(strided, None)
    assert made == [("empty", (4, 8), np.float32), ("empty", (4,), np.float32)]

def test_entry_allocates_from_the_adapters_template(monkeypatch):
    """An output like no input, where the adapter offers a template (torch:
    one element seen as the shape), is empty_like of the template, in the
    Entry and its generated launcher alike; where the template is refused
    (None), from its shape."""
    made = []

    class Adapter(_allocations_recorded(made, lambda a: (a.shape, a.strides), lambda shape, dtype: (shape,))):
        @staticmethod
        def template(device, shape, dtype):
            assert device == 0
            return None if shape == (4, 16) else np.broadcast_to(np.empty((), dtype), shape)

    _, program = _recording(monkeypatch)
    x = np.zeros((4, 8), np.float32)
    slots = {"x": "x", "w": "w", "y": "y", "rstd": "rstd"}
    for shape in ((4, 8), (4, 16)):
        outputs = {"y": (shape, np.dtype(np.float16), None), "rstd": ((4,), np.dtype(np.float32), None)}
        entry = launch_cache.entry(Adapter, 0, program, ("x", "w"), outputs, slots, ("y", "rstd"), arrays={"x": x})
        for run in (entry.entry, entry):
            made.clear()
            y, rstd = run(x, None)
            assert y.shape == shape and y.dtype == np.float16 and y.flags.c_contiguous and rstd.shape == (4,)
            first = ("like", shape, (0, 0)) if shape == (4, 8) else ("empty", shape)
            assert made == [first, ("like", (4,), (0,))]


def _program_of_three_steps():
    """A Program of a plain step, a cooperative one and a dependent one
    over slots (x, w, y, rstd) and two workspaces (the second zeroed),
    built by hand: fake kernels, real argument buffers."""
    from cunorm._engine import launches

    steps = []
    for j, (kind, fills) in enumerate((("plain", ((0, 0, 0), (1, 2, 0), (2, 1, 0), (3, 4, 16))),
                                       ("cooperative", ((1, 3, 0), (2, 5, 0), (3, 0, 8))),
                                       ("dependent", ((0, 2, 0), (2, 0, 0))))):
        s = launches.PreparedStep()
        s.step, s.device, s.cooperative, s.fills = f"step {j}", 0, kind == "cooperative", fills
        s.dependent = f"config {j}" if kind == "dependent" else None  # what the driver call is handed
        s.buf = np.full(5, 99, dtype=np.uint64)
        s.words = memoryview(s.buf).cast("B").cast("Q")
        s.params_ptr = 1000 + j
        s.head = (77 + j, 3, 1, 1, 128, 1, 1, 64 * j)
        steps.append(s)
    return launches.Program(steps, [(100, False), (8, True)], ("x", "w", "y", "rstd"))


class _NumpyAdapter:
    """The fast half of an adapter over NumPy arrays (pointers are the
    arrays' addresses)."""
    native_dtype = staticmethod(lambda dtype: dtype)
    current_device = staticmethod(lambda: 0)
    pointer = staticmethod(lambda a: a.ctypes.data)
    stream = staticmethod(lambda device: 5)
    empty_like = staticmethod(np.empty_like)

    @staticmethod
    def empty_beside(a, shape, dtype, perm=None):
        return np.empty(shape, dtype)

    @staticmethod
    def workspace_allocator(device):
        def alloc(nbytes):
            a = np.empty(nbytes, np.uint8)
            return a, a.ctypes.data

        return alloc


def _recording(monkeypatch):
    """Replaces the driver calls with recorders of (kind, head, stream,
    params, the argument words at launch); returns the record and a
    Program of two steps over them."""
    from cunorm._engine import launches

    calls = []
    program_words = {}

    def record(kind):
        def launch(*args):
            head, stream, params = args[:8], args[8], args[9]
            calls.append((kind, head, stream, params, list(program_words[params])))
        return launch

    monkeypatch.setattr(launches, "launch_kernel", record("plain"))
    monkeypatch.setattr(launches, "launch_cooperative_kernel", record("cooperative"))
    monkeypatch.setattr(launches, "launch_dependent_kernel", lambda config, stream, params: calls.append(
        ("dependent", config, stream, params, list(program_words[params]))))
    monkeypatch.setattr(launches, "memset_async", lambda ptr, value, nbytes, stream: calls.append(
        ("memset", value, nbytes, stream)))
    program = _program_of_three_steps()
    for s in program.steps:
        program_words[s.params_ptr] = s.words
    return calls, program


_OUTPUTS = {"y": ((4, 8), np.dtype(np.float32), None), "rstd": ((4,), np.dtype(np.float32), None)}


def test_generated_launcher_runs_what_the_entry_runs(monkeypatch):
    """The launcher generated for an Entry allocates, writes the same
    pointers (inputs, outputs, workspaces at their offsets, 0 for an
    absent input) and launches the same steps on the same stream as the
    Entry's own run; it returns the same kinds of results."""
    calls, program = _recording(monkeypatch)
    x = np.ones((4, 8), np.float32)
    outputs = _OUTPUTS
    fn = launch_cache.entry(_NumpyAdapter, 0, program, ("x", "w"), outputs, {"x": "x", "w": "w", "y": "y", "rstd": "rstd"}, ("y", None, "rstd"),
                            arrays={"x": x})
    assert callable(fn) and isinstance(fn.entry, launch_cache.Entry)
    y, none, rstd = fn(x, None)
    assert none is None and y.shape == x.shape and rstd.shape == (4,) and rstd.dtype == np.float32
    generated = list(calls)
    calls.clear()
    y2, _, rstd2 = fn.entry(x, None)
    generic = list(calls)
    # the two runs differ only in the addresses of their new arrays
    assert [c[0] for c in generated] == [c[0] for c in generic] == ["memset", "plain", "cooperative", "dependent"]
    assert generated[0][1:] == generic[0][1:] == (0, 8, 5)
    plain, cooperative = generated[1], generated[2]
    assert plain[1] == (77, 3, 1, 1, 128, 1, 1, 0) and plain[2] == 5 and plain[3] == 1000
    assert plain[4][0] == x.ctypes.data and plain[4][1] == y.ctypes.data and plain[4][2] == 0
    assert plain[4][4] == 99  # an argument no slot fills is left as packed
    assert cooperative[4][1] == rstd.ctypes.data and cooperative[4][3] == x.ctypes.data + 8
    # the workspaces: one allocation, the second 256 bytes in (16 bytes past the first's start in step 0)
    assert cooperative[4][2] - plain[4][3] == 256 - 16
    assert generic[2][4][1] == rstd2.ctypes.data and generic[1][4][1] == y2.ctypes.data
    # the dependent step: its own launch configuration, the stream, its words
    for run, out in ((generated, y), (generic, y2)):
        assert run[3][1:4] == ("config 2", 5, 1002)
        assert run[3][4][0] == out.ctypes.data and run[3][4][2] == x.ctypes.data and run[3][4][1] == 99
    assert "for " not in fn.source and "a0" in fn.source  # straight-line code


def test_generated_launcher_declines_another_device_and_defers_to_hooks(monkeypatch):
    from cunorm._engine import launches

    calls, program = _recording(monkeypatch)
    x = np.ones((4, 8), np.float32)
    outputs = _OUTPUTS
    fn = launch_cache.entry(_NumpyAdapter, 1, program, ("x", "w"), outputs, {"x": "x", "w": "w", "y": "y", "rstd": "rstd"}, ("y",))
    assert fn(x, None) is None and calls == []  # device 1 is not current
    fn = launch_cache.entry(_NumpyAdapter, 0, program, ("x", "w"), outputs, {"x": "x", "w": "w", "y": "y", "rstd": "rstd"}, ("y",))
    hooked = []
    monkeypatch.setattr(launches, "step_hook", lambda step, launch: (hooked.append(step), launch()))
    y = fn(x, None)
    assert y.shape == x.shape and len(hooked) == 3


def test_generated_launcher_makes_a_context_current_and_retries(monkeypatch):
    """A launch from a thread without a current context (CUDA's invalid
    context) makes the device's context current and runs the call again;
    other driver errors propagate."""
    from cunorm._engine import launches

    class DriverError(Exception):
        def __init__(self, status):
            self.status = status

    calls, program = _recording(monkeypatch)
    failures = [launches.INVALID_CONTEXT]
    recorded_plain = launches.launch_kernel

    def plain(*args):
        if failures:
            raise DriverError(failures.pop())
        recorded_plain(*args)

    made_current = []
    monkeypatch.setattr(launches, "CUDADriverError", DriverError)
    monkeypatch.setattr(launches, "launch_kernel", plain)
    monkeypatch.setattr(launches, "make_current", made_current.append)
    x = np.ones((4, 8), np.float32)
    fn = launch_cache.entry(_NumpyAdapter, 0, program, ("x", "w"), _OUTPUTS, {"x": "x", "w": "w", "y": "y", "rstd": "rstd"}, ("y",))
    assert fn(x, None).shape == x.shape
    assert made_current == [0] and [c[0] for c in calls].count("plain") == 1
    failures.append(700)  # an illegal address: not the launcher's to handle
    with pytest.raises(DriverError):
        fn(x, None)


def test_dependent_launch_configuration_has_the_drivers_layout(monkeypatch):
    """DependentLaunch is CUlaunchConfig as cuda.h lays it out on 64-bit
    hosts (hStream at 32, attrs at 40, numAttrs at 48; CUlaunchAttribute of
    72 bytes, its value at 8), holding the programmatic serialization
    attribute; dependent launches are chosen for sm_90 and later only,
    never for a target planned ahead of time."""
    import ctypes

    from cunorm._engine import dispatch_rows, launches

    looked_up = launches.driver_launch_kernel_ex
    monkeypatch.setattr(launches, "driver_launch_kernel_ex", lambda: "cuLaunchKernelEx")
    config = launches.DependentLaunch(77, (3, 2, 1), (128, 1, 1), 4096)
    assert ctypes.sizeof(launches._LaunchAttribute) == 72 and launches._LaunchAttribute.value.offset == 8
    assert (launches.DependentLaunch.stream.offset, launches.DependentLaunch.attrs.offset,
            launches.DependentLaunch.num_attrs.offset, ctypes.sizeof(launches.DependentLaunch)) == (32, 40, 48, 56)
    assert (config.grid_x, config.grid_y, config.grid_z, config.block_x, config.shared) == (3, 2, 1, 128, 4096)
    assert config.num_attrs == 1 and config.attrs[0].id == 6 and config.attrs[0].value == 1
    assert config.fn == 77 and config.address == ctypes.addressof(config)
    for cc, expected in ((80, False), (89, False), (90, True), (100, True)):
        device = dispatch_rows.Device(sm_count=132, compute_capability=cc, max_shared_per_block=227 * 1024,
                                      l2_bytes=50 << 20)
        monkeypatch.setattr(launches, "device_info", lambda _, device=device: device)
        assert launches.dependent_launch_on(0) is expected
    assert launches.dependent_launch_on(-1) is False
    monkeypatch.setattr(launches, "dependent_launch", False)
    assert launches.dependent_launch_on(0) is False
    monkeypatch.setattr(launches, "dependent_launch", True)
    monkeypatch.setattr(launches, "driver_launch_kernel_ex", lambda: None)
    assert launches.dependent_launch_on(0) is False
    # a driver before CUDA 12.3 (no programmatic edges in captured graphs): none
    monkeypatch.setattr(launches.runtime, "driverGetVersion", lambda: 12020)
    assert looked_up.__wrapped__() is None
