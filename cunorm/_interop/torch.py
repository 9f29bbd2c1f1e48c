"""torch tensors: zero-copy in and out, on torch's current stream, in memory
torch allocated.

In: a CUDA tensor becomes a CuPy view of its own memory (same pointer, same
strides), built from the tensor's pointer, shape and strides. That is what
DLPack would hand over, without the capsule and the stream hand-shake:
cunorm launches on torch's current stream, where the tensor's producer ran,
so there is nothing to order. The view keeps the tensor alive.

Out and workspaces: inside a call's scope CuPy allocates through torch's
caching allocator (``_allocate``), so every output, workspace and copy of
the call is torch memory on torch's current stream. A ``torch.cuda.graph``
capture therefore records cunorm's launches and allocations like any torch
op's (a CuPy pool allocation would invalidate the capture). Results go back
as tensors over that same storage, not views of a byte buffer.
"""
from __future__ import annotations

import functools

import cupy
import numpy as np
import torch

from .._engine import dtypes, quantize
from .._engine.caches import BoundedCache
from .._engine.plans import canonical_strides
from ._scope import DeviceScope

name = "torch"

NUMPY_DTYPE = {torch.float16: dtypes.float16, torch.bfloat16: dtypes.bfloat16, torch.float32: dtypes.float32,
               torch.float64: dtypes.float64}
TORCH_DTYPE = {v: k for k, v in NUMPY_DTYPE.items()}
#: each dtype's statistics (accumulation) dtype: float32, float64 for float64
ACCUMULATION = {t: TORCH_DTYPE[dtypes.accumulation(n)] for t, n in NUMPY_DTYPE.items()}


def owns(x) -> bool:
    return isinstance(x, torch.Tensor)


def to_cupy(x, arg: str = "x") -> cupy.ndarray:
    if x.device.type != "cuda":
        if arg == "x":
            fix = "move it with x.cuda(), or pass x.numpy() (and NumPy parameters) to run the NumPy reference"
        else:
            fix = f"move it to x's device with {arg}.to(x.device)"
        raise TypeError(f"{arg} is a torch tensor on {x.device}; cunorm runs on CUDA tensors: {fix}")
    if x.layout != torch.strided:
        raise TypeError(f"{arg} is a {x.layout} torch tensor; cunorm takes dense (strided) tensors: "
                        f"pass {arg}.to_dense()")
    dtype = NUMPY_DTYPE.get(x.dtype)
    if dtype is None:
        raise TypeError(f"{arg} must have dtype {dtypes.SUPPORTED_NAMES}, got {x.dtype}: cast it first, "
                        f"e.g. {arg}.float()")
    itemsize = dtype.itemsize
    shape = tuple(x.shape)
    strides = canonical_strides(shape, tuple(s * itemsize for s in x.stride()), itemsize)
    device = x.device.index
    if x.numel() == 0:
        memory = cupy.cuda.UnownedMemory(0, 0, x, device)
    else:
        span = sum((n - 1) * s for n, s in zip(shape, strides)) + itemsize
        memory = cupy.cuda.UnownedMemory(x.data_ptr(), span, x, device)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0), strides)


def unwritable(t) -> str | None:
    """Why cunorm may not write into tensor t (None: it may): torch allows
    no in-place update of an inference tensor outside inference mode."""
    if t.is_inference() and not torch.is_inference_mode_enabled():
        return "is an inference tensor (made under torch.inference_mode()), which torch updates in place only " \
               "inside inference mode"
    return None


#: the one-byte results of quantize= (raw bits until view_bits)
_BYTE_DTYPE = {np.dtype(np.uint8): torch.uint8, np.dtype(np.int8): torch.int8}


def from_cupy(y: cupy.ndarray):
    """y as a tensor over the same memory (y was allocated inside a torch
    scope, so its memory is a torch tensor's)."""
    dtype = TORCH_DTYPE.get(y.dtype) or _BYTE_DTYPE[y.dtype]
    if y.size == 0:  # nothing was allocated
        return torch.empty(y.shape, dtype=dtype, device=torch.device("cuda", y.data.device_id))
    owner = y.data.mem._owner  # the uint8 tensor _allocate made
    itemsize = y.itemsize
    tensor = torch.empty(0, dtype=dtype, device=owner.device)
    tensor.set_(owner.untyped_storage(), (y.data.ptr - owner.data_ptr()) // itemsize, y.shape,
                [s // itemsize for s in y.strides])
    return tensor


def _allocate(nbytes: int, device: int):
    """CuPy memory from torch's caching allocator, on torch's current stream
    of ``device`` (tests replace this to poison every allocation)."""
    block = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", device))
    return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(block.data_ptr(), nbytes, block, device), 0)


@functools.lru_cache(maxsize=None)
def _allocator(device: int):
    return lambda nbytes: _allocate(nbytes, device)


#: torch's streams wrapped as CuPy streams, by (device, handle): bounded
#: (a program making streams without end would otherwise grow it), oldest out
_streams = BoundedCache(256)


def _cupy_stream(device: int):
    """torch's current stream of ``device`` as a CuPy stream (cached by
    handle: wrapping a handle costs more than the launch)."""
    handle = stream(device)
    wrapped = _streams.get((device, handle))
    if wrapped is None:
        wrapped = cupy.cuda.Stream.null if handle == 0 else _wrap(handle, device)
        _streams.put((device, handle), wrapped)
    return wrapped


def _wrap(handle: int, device: int):
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is None:  # CuPy 13: the older spelling
        return cupy.cuda.ExternalStream(handle, device)
    return from_external(_Handle(handle))


class _Handle:
    """A raw stream handle in the CUDA stream protocol's clothes."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


class Scope(DeviceScope):
    """The device, torch's current stream on it, and torch's allocator."""

    __slots__ = ("stream", "allocation")

    def __enter__(self):
        super().__enter__()
        self.stream = _cupy_stream(self.device)
        self.stream.__enter__()
        self.allocation = cupy.cuda.using_allocator(_allocator(self.device))
        self.allocation.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            self.allocation.__exit__(*exc)
            self.stream.__exit__(*exc)
        finally:
            super().__exit__(*exc)
        return False


def scope(device: int) -> Scope:
    return Scope(device)


def wants_autograd(*arrays) -> bool:
    """Whether a call on these tensors must go through autograd (grad mode on
    and a tensor requiring grad), or through dynamo's tracing: the public ops
    then run as the registered torch op (cunorm.torch)."""
    if torch.compiler.is_compiling():
        return True
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in arrays)


# --- the launch cache's half (cunorm/_engine/launch_cache.py) ------------------------------------
# Raw: pointers from data_ptr(), outputs and workspaces from torch.empty on
# the tensors' device, launches on torch's current raw stream. No CuPy
# array, UnownedMemory or DLPack capsule is built.


_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled


def signatures(x, arrays):
    """What a prepared launch depends on, for x and each of ``arrays`` (None
    for an absent one): dtype, shape, strides, GPU and the pointer's
    alignment. None where the call cannot be keyed: dynamo traces it,
    autograd records it (grad mode on and a tensor requiring grad), or an
    array is not a strided tensor (AttributeError for CuPy and NumPy arrays,
    RuntimeError for a tensor without strides)."""
    if _is_compiling():
        return None
    grad = _grad_enabled()
    try:
        if grad and x.requires_grad:
            return None
        parts = [(x.dtype, x.shape, x.stride(), x.get_device(), x.data_ptr() & 15)]
        for a in arrays:
            if a is None:
                parts.append(None)
                continue
            if grad and a.requires_grad:
                return None
            parts.append((a.dtype, a.shape, a.stride(), a.get_device(), a.data_ptr() & 15))
    except (AttributeError, RuntimeError, TypeError):
        return None
    return tuple(parts)


# (a torch built without CUDA lacks the raw getter; its tensors never reach
# the cached path, but this module must import there: it is what refuses
# them)
current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def native_dtype(dtype):
    found = TORCH_DTYPE.get(dtype)
    return found if found is not None else _QUANTIZED[dtype]


#: quantize='s formats as torch's dtypes of their names
_QUANTIZED = {f.numpy: getattr(torch, f.name) for f in quantize.FORMATS.values()}


#: an output shaped, typed and laid out as a C-contiguous input (cheaper
#: than empty: no shape, dtype or device to parse)
empty_like = torch.empty_like


def template(device: int, shape, dtype):
    """One element seen as ``shape`` (all strides 0): ``empty_like`` of it is
    a new C-contiguous tensor of that shape and dtype on ``device``, at
    empty_like's cost (1.8 us against new_empty's 2.8 us on an H100 host:
    nothing to parse). None where empty_like would lay it out otherwise
    (or the probe that tells does not fit in memory)."""
    t = torch.empty((), dtype=dtype, device=torch.device("cuda", device)).expand(shape)
    try:
        probe = torch.empty_like(t)
    except RuntimeError:  # (torch.OutOfMemoryError)
        return None
    return t if probe.is_contiguous() and probe.shape == t.shape else None


def empty_beside(a, shape, dtype, perm=None):
    """A new tensor on a's device (new_empty parses no device: 3.2 us
    against torch.empty's 5.8 us for a (1,) float32 on an H100 host)."""
    y = a.new_empty(shape, dtype=dtype)
    return y if perm is None else y.permute(perm)


def empty_strided(a, shape, dtype, strides, held):
    """A new tensor of ``held`` elements on a's device seen as ``shape``
    through ``strides`` (the whole storage allocated: a TMA read of the
    padding stays inside it)."""
    return a.new_empty((held,), dtype=dtype).as_strided(shape, strides)


pointer = torch.Tensor.data_ptr  # a's pointer: a C method, no Python frame


try:
    stream = torch._C._cuda_getCurrentRawStream  # what inductor's generated code calls
except AttributeError:  # pragma: no cover - an older torch, or one built without CUDA
    def stream(device: int) -> int:
        return torch.cuda.current_stream(device).cuda_stream


def workspace_allocator(device: int):
    where = torch.device("cuda", device)

    def alloc(nbytes: int):
        a = torch.empty(nbytes, dtype=torch.uint8, device=where)
        return a, a.data_ptr()

    return alloc


def view_bits(t, format_name: str):
    """A quantized y (raw bytes) as torch's dtype of its format."""
    return t.view(getattr(torch, format_name))
