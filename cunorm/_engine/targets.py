"""GPU architectures named ahead of time: what planning a launch for a GPU
that is not in this process needs (``cunorm.jax.set_lowering_target``:
lowering and ``jax.export`` on a host without the GPU).

Each Target holds the dispatch's Device (multiprocessors, opt-in shared
memory a block, L2) of the architecture's reference part, and the per-SM
limits the occupancy of a kernel follows from (CUDA's occupancy rules:
registers allocated a warp at a time in 256-register units, each of the
four sub-partitions holding a quarter of the register file; shared memory
a block rounded up to 128 bytes plus the 1 KB the system reserves; warps
and blocks an SM). The figures are NVIDIA's published ones for each
compute capability (CUDA C++ Programming Guide, "Technical
Specifications per Compute Capability") and the parts' datasheets.

A device id below zero names a Target in the planning functions
(launches.device_info and persistent_grid): nothing then asks the CUDA
driver.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace

from .dispatch_rows import Device


@dataclass(frozen=True)
class Target:
    """An architecture as the dispatch and the occupancy rules see it."""

    name: str
    device: Device
    max_threads_per_sm: int
    max_blocks_per_sm: int
    shared_per_sm: int
    registers_per_sm: int = 65536
    reserved_shared_per_block: int = 1024

    @property
    def arch(self) -> int:
        return self.device.compute_capability

    def resident_per_sm(self, registers: int, static_shared: int, threads: int, dynamic_shared: int) -> int:
        """Blocks of a kernel resident on one SM at once (0: none fits), by
        the occupancy rules (see the module's docstring)."""
        warps = -(-threads // 32)
        per_warp = -(-registers * 32 // 256) * 256
        sub_partitions = 4
        if per_warp * -(-warps // sub_partitions) * sub_partitions > self.registers_per_sm:
            return 0
        by_registers = (self.registers_per_sm // sub_partitions // per_warp) * sub_partitions // warps if per_warp \
            else self.max_blocks_per_sm
        shared = -(-(static_shared + dynamic_shared + self.reserved_shared_per_block) // 128) * 128
        by_shared = self.shared_per_sm // shared
        by_threads = (self.max_threads_per_sm // 32) // warps
        return max(0, min(by_registers, by_shared, by_threads, self.max_blocks_per_sm))


#: the architectures cunorm plans for by name, each by its reference part
TARGETS = {
    "sm_80": Target("sm_80 (A100 SXM)", Device(sm_count=108, compute_capability=80, max_shared_per_block=166912,
                                               l2_bytes=40 << 20),
                    max_threads_per_sm=2048, max_blocks_per_sm=32, shared_per_sm=167936),
    "sm_86": Target("sm_86 (A40)", Device(sm_count=84, compute_capability=86, max_shared_per_block=101376,
                                          l2_bytes=6 << 20),
                    max_threads_per_sm=1536, max_blocks_per_sm=16, shared_per_sm=102400),
    "sm_89": Target("sm_89 (L40S)", Device(sm_count=142, compute_capability=89, max_shared_per_block=101376,
                                           l2_bytes=96 << 20),
                    max_threads_per_sm=1536, max_blocks_per_sm=24, shared_per_sm=102400),
    "sm_90": Target("sm_90 (H100 / H200 SXM)", Device(sm_count=132, compute_capability=90,
                                                      max_shared_per_block=232448, l2_bytes=50 << 20),
                    max_threads_per_sm=2048, max_blocks_per_sm=32, shared_per_sm=233472),
}


def named(arch, *, sm_count: int | None = None, l2_bytes: int | None = None) -> Target:
    """The Target of ``arch`` ("sm_90", or the compute capability 90), with
    the part's multiprocessor count and L2 size where given (an H100 PCIe:
    ``named("sm_90", sm_count=114)``). ValueError for another architecture."""
    key = f"sm_{arch}" if isinstance(arch, int) and not isinstance(arch, bool) else arch
    target = TARGETS.get(key) if isinstance(key, str) else None
    if target is None:
        raise ValueError(f"unknown target {arch!r}: expected one of {sorted(TARGETS)} (or the compute capability "
                         f"as an int, e.g. 90)")
    changes = {}
    for field, value in (("sm_count", sm_count), ("l2_bytes", l2_bytes)):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be a positive int, got {value!r}")
            changes[field] = value
    if changes:
        target = replace(target, name=f"{key} ({', '.join(f'{k} {v}' for k, v in changes.items())})",
                         device=replace(target.device, **changes))
    return target


_ids: dict[Target, int] = {}
_targets_by_id: dict[int, Target] = {}
_lock = threading.Lock()


def device_id(target: Target) -> int:
    """The (negative) device id that names ``target`` in the planning
    functions, the same for equal targets."""
    with _lock:
        found = _ids.get(target)
        if found is None:
            found = _ids[target] = -1 - len(_ids)
            _targets_by_id[found] = target
        return found


def by_id(device: int) -> Target:
    return _targets_by_id[device]
