"""Where a call's launches go: the GPU its arrays live on.

Every kernel, allocation and copy of a call runs inside one scope, entered
after validation and left after the results are wrapped. The base scope makes the arrays' device current for the call when
it is not already (kernels are loaded per device, and CuPy allocates and
launches on the current one); the torch adapter's scope adds torch's current
stream and torch's allocator.
"""
from __future__ import annotations

import contextlib

from cupy.cuda import runtime

_NOTHING = contextlib.nullcontext()


class DeviceScope:
    """Makes ``device`` the current CUDA device inside ``with`` (restoring
    the previous one after) when it is not already: a single getDevice call
    in the common one-GPU case."""

    __slots__ = ("device", "previous")

    def __init__(self, device: int):
        self.device = device
        self.previous = None

    def __enter__(self):
        current = runtime.getDevice()
        if current != self.device:
            runtime.setDevice(self.device)
            self.previous = current
        return self

    def __exit__(self, *exc):
        if self.previous is not None:
            runtime.setDevice(self.previous)
            self.previous = None
        return False


def device_scope(device: int):
    """The scope of the CuPy, JAX and DLPack adapters: nothing to do (a
    shared no-op) when ``device`` is current, else a DeviceScope."""
    from cupy.cuda import runtime

    return _NOTHING if runtime.getDevice() == device else DeviceScope(device)
