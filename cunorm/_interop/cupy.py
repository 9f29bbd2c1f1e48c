"""CuPy arrays: used as they are, on CuPy's current stream of the array's
device."""
from __future__ import annotations

import operator

import cupy

from .._engine import quantize
from .._engine.plans import canonical_strides
from ._scope import device_scope

scope = device_scope  # the launch scope: the array's device

name = "cupy"


def owns(x) -> bool:
    return isinstance(x, cupy.ndarray)


def to_cupy(x, arg: str = "x") -> cupy.ndarray:
    check_whole_elements(x, arg)
    return canonical(x)


def canonical(a: cupy.ndarray) -> cupy.ndarray:
    """``a`` with the strides of its size-1 axes canonical
    (plans.canonical_strides): a view of the same memory where they were
    not, so that layouts compare and derive alike on every path."""
    shape = a.shape
    if 1 not in shape:
        return a
    strides = a.strides
    canon = canonical_strides(shape, strides, a.itemsize)
    return a if canon == strides else cupy.ndarray(shape, a.dtype, a.data, canon)


def check_whole_elements(x, arg: str) -> None:
    """Refuse a view whose address or strides are not whole elements (CuPy
    makes them from a byte offset or byte strides): the kernels address
    elements, and would round them down."""
    itemsize = x.itemsize
    if itemsize > 1 and (x.data.ptr % itemsize or any(s % itemsize for s, n in zip(x.strides, x.shape) if n > 1)):
        raise ValueError(f"{arg} is a view whose address or strides are not whole {itemsize}-byte elements "
                         f"(address {x.data.ptr % itemsize} bytes past an element boundary, strides "
                         f"{x.strides} bytes): pass a copy ({arg}.copy())")


def from_cupy(y: cupy.ndarray):
    return y


# --- the launch cache's half (cunorm/_engine/launch_cache.py) ------------------------------------


def signatures(x, arrays):
    """What a prepared launch depends on, for x and each of ``arrays`` (None
    for an absent one): dtype, shape, strides, GPU and the pointer's
    alignment. None where an array is not a CuPy array."""
    try:
        data = x.data
        parts = [(x.dtype, x.shape, x.strides, data.device_id, data.ptr & 15)]
        for a in arrays:
            if a is None:
                parts.append(None)
                continue
            data = a.data
            parts.append((a.dtype, a.shape, a.strides, data.device_id, data.ptr & 15))
    except AttributeError:
        return None
    return tuple(parts)


current_device = cupy.cuda.runtime.getDevice


def native_dtype(dtype):
    return _RAW_BITS.get(dtype, dtype)


#: quantize='s FP8 formats, which CuPy holds as their raw bits
_RAW_BITS = {f.numpy: f.device for f in quantize.FORMATS.values()}


def empty_beside(a, shape, dtype, perm=None):
    """A new array on the current device (the cached path checked that it
    is a's)."""
    y = cupy.ndarray(shape, dtype)  # what cupy.empty calls, without its Python frame
    return y if perm is None else y.transpose(perm)


def empty_strided(a, shape, dtype, strides, held):
    """A new array of ``held`` elements seen as ``shape`` through
    ``strides`` (elements): column-major quantization scales."""
    storage = cupy.ndarray((held,), dtype)
    itemsize = storage.itemsize
    return cupy.ndarray(shape, dtype, storage.data, tuple(s * itemsize for s in strides))


pointer = operator.attrgetter("data.ptr")  # a's pointer, without a Python frame


def stream(device: int) -> int:
    return cupy.cuda.get_current_stream().ptr


def workspace_allocator(device: int):
    def alloc(nbytes: int):
        a = cupy.empty(nbytes, dtype=cupy.uint8)
        return a, a.data.ptr

    return alloc


def view_bits(y, format_name: str):
    """A quantized y as CuPy holds it: uint8 raw bits for the FP8 formats
    (CuPy has no FP8 dtype), int8 for int8."""
    return y
