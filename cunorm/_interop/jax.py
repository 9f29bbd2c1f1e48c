"""JAX arrays: zero-copy through DLPack in and out. cunorm never writes into a
JAX buffer (JAX assumes its arrays are immutable)."""
from __future__ import annotations

import cupy
import jax
import jax.numpy

name = "jax"


def owns(x) -> bool:
    return isinstance(x, jax.Array)


def to_cupy(x, arg: str = "x") -> cupy.ndarray:
    try:
        devices = x.devices()
    except Exception:  # a tracer: no concrete buffer to hand to a kernel
        raise TypeError(
            f"{arg} is a traced JAX value: cunorm takes eager JAX arrays only (call it outside jax.jit)"
        ) from None
    platform = next(iter(devices)).platform
    if platform != "gpu":
        raise TypeError(f"{arg} is a JAX array on {platform}; cunorm runs on GPU arrays (jax.device_put it to a GPU)")
    return cupy.from_dlpack(x)


def from_cupy(y: cupy.ndarray, like):
    return jax.numpy.from_dlpack(y)
