"""Any other array on a CUDA device that speaks DLPack: in through
cupy.from_dlpack, out as a CuPy array (there is no generic way back)."""
from __future__ import annotations

from ._scope import device_scope

scope = device_scope  # the launch scope: the array's device

name = "dlpack"
_CUDA = 2  # kDLCUDA
_CUDA_MANAGED = 13  # kDLCUDAManaged


def owns(x) -> bool:
    if not hasattr(x, "__dlpack__") or not hasattr(x, "__dlpack_device__"):
        return False
    try:
        device_type, _ = x.__dlpack_device__()
    except Exception:
        return False
    return int(device_type) in (_CUDA, _CUDA_MANAGED)


def to_cupy(x, arg: str = "x"):
    import cupy

    _, device = x.__dlpack_device__()
    with cupy.cuda.Device(int(device)):  # the producer orders its work before this device's current stream
        array = cupy.from_dlpack(x)
    from .cupy import canonical, check_whole_elements

    check_whole_elements(array, arg)  # (a DLPack byte_offset need not be whole elements)
    return canonical(array)


def from_cupy(y):
    return y


def view_bits(y, format_name: str):
    """A quantized y, as a CuPy array (uint8 raw bits for FP8, int8)."""
    return y
