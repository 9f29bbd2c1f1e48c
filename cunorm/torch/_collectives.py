"""SyncBatchNorm's all-gather: NCCL's, called on torch's current stream
through CuPy's binding over a communicator of the process group's ranks,
where the group is NCCL's and CuPy loads NCCL (torch's own wheels bring
it); otherwise torch.distributed's ``all_gather_into_tensor``.

Why its own communicator: torch.distributed's call costs about 50 us of
host time a collective in a loop and 160-200 us inside a training step
under torch.profiler (event records, its NCCL stream's joins,
bookkeeping), NCCL's own call about 18 us in the loop
(docs/notes/sync-batchnorm.md). A step of SyncBatchNorm makes
two, and its time is the host's. The communicator is made once per
(group, device), collectively, by the group's first synchronized forward:
every rank first agrees that it can (one all-reduce), then rank 0's NCCL
id is broadcast. It lives as long as the group object does. Several
communicators over one set of GPUs is what torch's own process groups do;
NCCL connects its buffers lazily, for the few small collectives this one
makes; it still takes GPU memory of its own (docs/torch.md), which a
layer declines with ``own_communicator = False``.
"""
from __future__ import annotations

import threading
import warnings
import weakref

import torch
import torch.distributed as dist
from torch import Tensor

from .._interop import torch as interop

#: at most this many groups at once get a communicator (the rest use
#: torch.distributed's collective); entries go with their group
_MOST = 64
_lock = threading.Lock()
_communicators = weakref.WeakKeyDictionary()  # group -> {device: communicator or None}
_module = []  # CuPy's NCCL binding once loaded (or None)


def _nccl():
    """CuPy's NCCL binding, or None where it cannot load NCCL."""
    if not _module:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (CuPy warns, once, when it cannot load the library)
                from cupy.cuda import nccl
        except ImportError:
            nccl = None
        _module.append(nccl if nccl is not None and nccl.available else None)
    return _module[0]


def _make(group, device: int, room: bool):
    """A communicator of ``group``'s ranks on ``device``, made collectively,
    or None on every rank where any rank cannot use NCCL directly or has
    no room for another."""
    if dist.get_backend(group) != "nccl":  # (the same on every rank: no agreement needed)
        return None
    nccl = _nccl()
    where = torch.device("cuda", device)
    able = torch.tensor([1 if nccl is not None and room else 0], dtype=torch.int32, device=where)
    dist.all_reduce(able, op=dist.ReduceOp.MIN, group=group)
    if not int(able):
        return None
    rank = dist.get_rank(group)
    uid = [nccl.get_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(uid, src=dist.get_global_rank(group, 0), group=group, device=where)
    with interop.scope(device):
        comm = nccl.NcclCommunicator(dist.get_world_size(group), uid[0], rank)
    # destroyed when the group object goes; not at exit, where CUDA may be gone first
    weakref.finalize(group, comm.destroy).atexit = False
    return comm


def communicator(group, device: int):
    """The (group, device) communicator, made on first use (collectively:
    every rank of the group calls this at the same point), or None where
    torch.distributed's collective serves."""
    with _lock:
        held = _communicators.get(group)
        if held is not None and device in held:
            return held[device]
        room = held is not None or len(_communicators) < _MOST
    comm = _make(group, device, room)
    with _lock:
        _communicators.setdefault(group, {})[device] = comm
    return comm


#: NCCL's element types by torch dtype (the statistics' dtypes)
_TYPES = {torch.float32: "NCCL_FLOAT32", torch.float64: "NCCL_FLOAT64"}


def all_gather(block: Tensor, source: int, target: int, count: int, group, world: int, own: bool = True) -> None:
    """Every rank's ``count`` elements at element ``source`` of the 1-D
    ``block`` into element ``target`` onward, rank r's at target + r *
    count; on torch's current stream. ``own``: through the group's own
    communicator where it can, else (and where False) torch.distributed's."""
    device = block.get_device()
    comm = communicator(group, device) if own else None
    if comm is None:
        dist.all_gather_into_tensor(block[target:target + world * count], block[source:source + count],
                                    group=group)
        return
    size = block.element_size()
    base = block.data_ptr()
    comm.allGather(base + source * size, base + target * size, count, getattr(_module[0], _TYPES[block.dtype]),
                   interop.stream(device))
