"""The launch cache's bookkeeping on CPU (cunorm/_fast.py): the bound,
threads inserting at once, and which calls are keyed."""
from __future__ import annotations

import threading

import numpy as np

from cunorm import _fast


def test_cache_is_bounded_oldest_out_first():
    cache = _fast.BoundedCache(4)
    for i in range(10):
        cache.put(i, str(i))
    assert len(cache) == 4
    assert cache.get(5) is None and cache.get(9) == "9" and cache.get(6) == "6"
    cache.put(6, "six")  # a key already in does not evict
    assert len(cache) == 4 and cache.get(6) == "six" and cache.get(7) == "7"


def test_cache_under_threads_stays_bounded():
    cache = _fast.BoundedCache(64)

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
    k = _fast.key(ad, x, w, None, scalars=("rms", -1, 1e-5))
    assert k == _fast.key(ad, x.copy(), w.copy(), None, scalars=("rms", -1, 1e-5))
    assert k != _fast.key(ad, x, None, None, scalars=("rms", -1, 1e-5))  # weight absent
    assert k != _fast.key(ad, x.astype(np.float16), w, None, scalars=("rms", -1, 1e-5))  # dtype
    assert k != _fast.key(ad, np.zeros((8, 8), np.float32)[:, ::2], w, None, scalars=("rms", -1, 1e-5))  # strides
    assert k != _fast.key(ad, x, w, None, scalars=("rms", -1, 1e-6))  # eps
    assert _fast.key(_FakeAdapter(watched=True), x, w, None) is None  # autograd or dynamo watching
    assert _fast.key(ad, x, object(), None) is None  # an array the signature cannot read


def test_only_exact_types_are_keyed():
    """Values that compare equal to the keyed ones but would fail (or
    validate differently) on the general path are never keyed."""
    x = np.zeros((2, 3), np.float32)  # NumPy has no fast half: never keyed
    assert _fast.rows_key("rms", x, None, None, None, -1, 1e-5, False) is None
    assert not _fast._int_axes(True) and not _fast._int_axes((1.0,)) and not _fast._int_axes([1])
    assert _fast._int_axes(-1) and _fast._int_axes((1, 2)) and _fast._int_axes(None)


def test_workspaces_are_one_allocation_with_zeroed_ranges_set_on_the_stream(monkeypatch):
    """A Program's workspaces: one allocation, each at a 256-byte boundary;
    the zeroed ones cleared by a memset on the call's stream (no second
    allocation, no fill kernel)."""
    from cunorm import _launch

    program = _launch.Program([], [(10, False), (4, True), (300, True)], ("x",))
    assert program.offsets == (0, 256, 512) and program.workspace_bytes == 1024
    assert program.zeroed == ((256, 4), (512, 300))
    allocations, memsets = [], []
    monkeypatch.setattr(_launch, "_memset_async", lambda ptr, nbytes, stream: memsets.append((ptr, nbytes, stream)))

    def alloc(nbytes):
        allocations.append(nbytes)
        return "owner", 4096

    assert program.run([1], 7, alloc) == "owner"
    assert allocations == [1024]
    assert memsets == [(4096 + 256, 4, 7), (4096 + 512, 300, 7)]


def test_entry_allocates_like_a_contiguous_input_of_the_same_shape_and_dtype():
    """y like x where x is C-contiguous and y has its shape and dtype; the
    statistics, and y beside a strided x, from their shape."""
    made = []

    class Adapter:
        native_dtype = staticmethod(lambda dtype: dtype)
        workspace_allocator = staticmethod(lambda device: None)
        current_device = staticmethod(lambda: 0)
        pointer = staticmethod(lambda a: 0)
        stream = staticmethod(lambda device: 0)

        @staticmethod
        def empty_beside(a, shape, dtype, perm=None):
            made.append(("empty", tuple(shape), np.dtype(dtype)))
            return np.empty(shape, dtype)

        @staticmethod
        def empty_like(a):
            made.append(("like", a.shape, a.dtype))
            return np.empty_like(a)

    class Program:
        def run(self, pointers, stream, alloc):
            return None

    x = np.zeros((4, 8), np.float32)
    outputs = {"y": (x.shape, x.dtype, None), "rstd": ((4,), np.dtype(np.float32), None)}
    entry = _fast.entry(Adapter, 0, Program(), ("x", "w"), outputs, ("x", "y", "rstd"), ("y", "rstd"),
                        arrays={"x": x})
    y, rstd = entry(x, None)
    assert made == [("like", (4, 8), np.float32), ("empty", (4,), np.float32)]
    made.clear()
    strided = np.zeros((4, 16), np.float32)[:, ::2]
    entry = _fast.entry(Adapter, 0, Program(), ("x", "w"), outputs, ("x", "y", "rstd"), ("y", "rstd"),
                        arrays={"x": strided})
    entry(strided, None)
    assert made == [("empty", (4, 8), np.float32), ("empty", (4,), np.float32)]
