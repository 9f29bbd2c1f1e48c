"""The array boundary: what kind of array came in, a zero-copy CuPy view of
it, and the result handed back as the caller's own type.

Each framework has one module here (cupy, torch, jax); anything else that
speaks DLPack from a CUDA device goes through the generic path. NumPy arrays
are not converted: they run the float64 reference (cunorm.reference).
"""
from __future__ import annotations

import sys

import numpy as np

NUMPY = "numpy"


def _adapters():
    from . import cupy as cupy_adapter

    adapters = [cupy_adapter]
    # Only look for torch / JAX types if the caller has imported them already.
    if "torch" in sys.modules:
        from . import torch as torch_adapter

        adapters.append(torch_adapter)
    if "jax" in sys.modules:
        from . import jax as jax_adapter

        adapters.append(jax_adapter)
    return adapters


_by_type: dict[type, object] = {}


def adapter_for(x, name: str = "x"):
    """The adapter module that owns ``x``, or NUMPY for NumPy arrays.

    Raises TypeError for anything that is not an array cunorm accepts.
    Memoized by type: the common case is one dictionary lookup.
    """
    kind = type(x)
    adapter = _by_type.get(kind)
    if adapter is not None:
        return adapter
    if isinstance(x, np.ma.MaskedArray):  # (its mask would be ignored: its values are not what it means)
        raise TypeError(f"{name} is a NumPy masked array, whose mask cunorm would ignore: pass "
                        f"{name}.filled(value) or the data of the unmasked elements")
    if isinstance(x, np.ndarray):
        adapter = NUMPY
    else:
        adapter = next((a for a in _adapters() if a.owns(x)), None)
        from . import _generic  # CuPy is imported with the first GPU array, not with cunorm

        if adapter is None and _generic.owns(x):
            return _generic  # not memoized: owns() looks at the device
    if adapter is None:
        raise TypeError(
            f"{name} must be a CuPy, NumPy, torch or JAX array (or a CUDA array that supports DLPack), "
            f"got {kind.__module__}.{kind.__qualname__}"
        )
    _by_type[kind] = adapter
    return adapter


_torch_adapter = None


def _load_torch_adapter():
    global _torch_adapter
    from . import torch as adapter

    _torch_adapter = adapter
    return adapter


def torch_route(x, *arrays, out=None) -> bool:
    """Whether a public op called on torch tensors must run as its registered
    torch operator (cunorm.torch): under dynamo's tracing (torch.compile),
    or when autograd must see the op (grad mode on and a tensor requiring
    grad), so that a backward through it raises instead of silently giving
    no gradient. False without torch, or for other arrays."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor):
        return False
    adapter = _torch_adapter or _load_torch_adapter()
    if not adapter.wants_autograd(x, *arrays):
        return False
    if out is not None:
        if torch.compiler.is_compiling():
            return False  # the operators have no out=: the direct path
        raise RuntimeError("out= is not differentiable, and a tensor passed requires grad: leave out= off, "
                           "or call under torch.no_grad()")
    return True
