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
