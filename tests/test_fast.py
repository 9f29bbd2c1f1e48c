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
