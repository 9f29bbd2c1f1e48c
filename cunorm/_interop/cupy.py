"""CuPy arrays: used as they are, on CuPy's current stream of the array's
device."""
from __future__ import annotations

import cupy

from ._scope import device_scope

scope = device_scope  # the launch scope: the array's device

name = "cupy"


def owns(x) -> bool:
    return isinstance(x, cupy.ndarray)


def to_cupy(x, arg: str = "x") -> cupy.ndarray:
    return x


def from_cupy(y: cupy.ndarray):
    return y


# --- the launch cache's half (cunorm/_fast.py) ------------------------------------


def signature(a):
    """What a prepared launch depends on: dtype, shape, strides, GPU and
    the pointer's alignment (AttributeError for anything but a CuPy array)."""
    data = a.data
    return a.dtype, a.shape, a.strides, data.device_id, data.ptr & 15


def watched(*arrays) -> bool:
    return False


current_device = cupy.cuda.runtime.getDevice


def native_dtype(dtype):
    return dtype


def empty(shape, dtype, device: int, perm=None):
    y = cupy.empty(shape, dtype=dtype)
    return y if perm is None else y.transpose(perm)


def pointer(a) -> int:
    return a.data.ptr


def stream(device: int) -> int:
    return cupy.cuda.get_current_stream().ptr


def workspace_allocator(device: int):
    def alloc(nbytes: int, zeroed: bool):
        a = (cupy.zeros if zeroed else cupy.empty)(nbytes, dtype=cupy.uint8)
        return a, a.data.ptr

    return alloc
