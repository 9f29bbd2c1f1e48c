"""Arrays a call writes: whether they may be written (not a JAX array, a
read-only NumPy array or an inference tensor) and whether their memory
overlaps what the call reads, checked with every other argument before
anything is launched or written."""
from __future__ import annotations

import numpy as np

from . import plans
from .. import _interop


def refuse_jax(a, name: str):
    """Refuse a JAX array where cunorm takes an array it may write (out=,
    BatchNorm's running buffers); returns a's adapter."""
    adapter = _interop.adapter_for(a, name)
    if getattr(adapter, "name", None) == "jax":
        raise TypeError(f"{name} is a JAX array, which cunorm must not write into (JAX arrays are immutable); "
                        f"leave {name} out and use the returned array")
    return adapter


def check_writable(a, name: str) -> None:
    """Refuse an array cunorm would write into but may not: a JAX array
    (immutable), a read-only NumPy array, a torch inference tensor outside
    inference mode. Checked with every other argument, before anything is
    launched or written."""
    adapter = refuse_jax(a, name)
    if adapter is _interop.NUMPY:
        if not a.flags.writeable:
            raise ValueError(f"{name} is a read-only NumPy array, which this call writes into: pass a writable "
                             f"array (e.g. {name}.copy())")
        return
    unwritable = getattr(adapter, "unwritable", None)
    reason = None if unwritable is None else unwritable(a)
    if reason is not None:
        raise ValueError(f"{name} {reason}, which this call writes into")


def _pointer(a) -> int:
    return a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data.ptr


def _span(a):
    lo = hi = _pointer(a)
    for n, s in zip(a.shape, a.strides):
        if n > 1:
            if s > 0:
                hi += (n - 1) * s
            else:
                lo += (n - 1) * s
    return lo, hi + a.itemsize


def _overlaps(a, b) -> bool:
    if a.size == 0 or b.size == 0:
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def first_overlap(written, *others) -> str | None:
    """The name of the first of ``others`` ((array or None, name) pairs)
    whose memory overlaps ``written``'s, or None; written's span taken once."""
    if written.size == 0:
        return None
    lo, hi = _span(written)
    for a, name in others:
        if a is not None and a.size:
            a_lo, a_hi = _span(a)
            if lo < a_hi and a_lo < hi:
                return name
    return None


def _same_view(a, b) -> bool:
    return _pointer(a) == _pointer(b) and a.shape == b.shape and plans.same_layout(a.shape, a.strides, b.strides)
