"""JAX arrays: zero-copy through DLPack in and out, eager arrays only.

cunorm never writes into a JAX buffer (JAX assumes its arrays are
immutable): JAX arrays are refused as ``out`` and as BatchNorm's running
buffers. Inside ``jax.jit`` a value is a tracer with no buffer behind it:
the array-level ops (``cunorm.rms_norm``...) refuse it with an error that
points to ``cunorm.jax``, whose functions lower to XLA custom calls there.
"""
from __future__ import annotations

import cupy
import jax
import jax.numpy

from ._scope import device_scope
from .cupy import canonical

scope = device_scope  # the launch scope: the array's device

name = "jax"

def owns(x) -> bool:
    return isinstance(x, jax.Array)


def to_cupy(x, arg: str = "x") -> cupy.ndarray:
    try:
        devices = x.devices()
    except Exception:  # a tracer: no concrete buffer to hand to a kernel
        raise TypeError(
            f"{arg} is a traced JAX value (inside jax.jit, vmap or grad): the array-level cunorm ops take eager "
            f"JAX arrays only; inside a transformation call cunorm.jax's function of the same name"
        ) from None
    if len(devices) != 1:
        raise TypeError(f"{arg} is a JAX array sharded over {len(devices)} devices; cunorm takes arrays on one GPU")
    device = next(iter(devices))
    if device.platform != "gpu":
        raise TypeError(f"{arg} is a JAX array on {device.platform}; cunorm runs on GPU arrays "
                        f"(jax.device_put it to a GPU)")
    ordinal = getattr(device, "local_hardware_id", None)
    with cupy.cuda.Device(device.id if ordinal is None else ordinal):
        return canonical(cupy.from_dlpack(x))


def from_cupy(y: cupy.ndarray):
    return jax.numpy.from_dlpack(y)


def view_bits(y, format_name: str):
    """A quantized y (raw bytes) as JAX's dtype of its format."""
    if format_name == "int8":
        return y
    return jax.lax.bitcast_convert_type(y, getattr(jax.numpy, format_name))
