"""torch tensors: zero-copy through DLPack in and out."""
from __future__ import annotations

import cupy
import torch

name = "torch"


def owns(x) -> bool:
    return isinstance(x, torch.Tensor)


def to_cupy(x, arg: str = "x") -> cupy.ndarray:
    if x.device.type != "cuda":
        raise TypeError(
            f"{arg} is a torch tensor on {x.device}; cunorm runs on CUDA tensors: move it with "
            f"{arg}.cuda(), or pass {arg}.numpy() to run the NumPy reference"
        )
    if x.requires_grad:  # DLPack refuses tensors that require grad; cunorm only reads x
        x = x.detach()
    return cupy.from_dlpack(x)


def from_cupy(y: cupy.ndarray, like):
    return torch.from_dlpack(y)
