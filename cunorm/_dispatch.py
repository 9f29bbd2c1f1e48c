"""Choosing a kernel and its launch for a plan: a pure function of the plan
and the device, returning a frozen Launch.

The heuristic. Measurements: NVIDIA H200, 2026-11-21, copy bandwidth
4282 GB/s, floor% = effective bandwidth over copy (bench/bench.py --tune;
docs/performance.md has the full run).

Contiguous rows (inner == 1), by the number of vectors in a row, n_vec:
  1. threads = next_pow2(n_vec / TARGET_VECS_PER_THREAD), capped at
     PREFERRED_MAX_ROW_THREADS; each thread then holds vpt = n_vec / threads
     vectors (a power of two). If that exceeds MAX_VECS_PER_THREAD, a
     1024-thread block per row.
  2. threads <= 32: rows_cached, a group of `threads` lanes per row, several
     rows per 256-thread block, butterfly shuffles only.
  3. up to 1024: rows_cached, one block of `threads` (>= 64) per row.
  4. rows longer than the register cache of one block (128 KB of row):
     rows_uncached (block per row, two sweeps) if the rows fill every SM,
     else the split tier.
  5. few long rows (fewer than SMs, each >= SPLIT_MIN_ROW_BYTES): the split
     tier, so the whole GPU works on them.

Strided axis (inner > 1): strided_norm with threadIdx.x along inner (up to
32 vectors: a warp reads 512 contiguous bytes of one channel) and
threadIdx.y along the reduced axis (256-thread blocks), channels held in
registers when reduced / blockDim.y fits the register cache, else two sweeps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ._plan import Plan, kernel_types

# --- thresholds --------------------------------------------------------------
#: vector loads per thread in rows_cached. 4 beat 8 and 2: fp32 65536x1024,
#: 64 threads x 4 vectors 95.6% vs 32 x 8 93.5%; bf16 32768x4096, 128 x 4
#: 93.3% vs 64 x 8 84.5%.
TARGET_VECS_PER_THREAD = 4
#: rows_cached block size preferred before going to more vectors per thread:
#: bf16 4096x32768, 512 threads x 8 vectors 91.7% vs 1024 x 4 80.6%.
PREFERRED_MAX_ROW_THREADS = 512
#: register cache of a thread, bytes: rows_cached group-per-row blocks (256
#: threads, 128 registers a thread) may hold 256; a 1024-thread block 128.
CACHE_BYTES_GROUP = 256
CACHE_BYTES_BLOCK_1024 = 128
CACHE_BYTES_BLOCK_512 = 256
#: strided_norm: at most this many cached bytes a thread (128 registers,
#: two 256-thread blocks per SM; past it ptxas spills). Problem 36 (fp32,
#: 64 channels): block (32, 8) with 8 channels a thread 94.6%; (16, 16)
#: 86.3%; (32, 4) 70.5%; two sweeps 86.5%.
CACHE_BYTES_STRIDED = 128
#: split tier: only for rows of at least this many bytes (an estimate, not
#: yet measured: below it a block per row finishes in a few microseconds) ...
SPLIT_MIN_ROW_BYTES = 64 * 1024
#: ... when there are fewer rows than this many per SM.
SPLIT_MAX_ROWS_PER_SM = 1
#: split tier: blocks per SM in each pass. fp32 16x4194304: 66 chunks a row
#: (8 per SM) 59.5%, 33 chunks 57.8%, 16 chunks 49.2% (two reads + one write
#: from DRAM bound it at 66.7%).
SPLIT_BLOCKS_PER_SM = 8
SPLIT_BLOCK_THREADS = 256
#: bf16 4096x32768 forced through rows_uncached: 67.0% (cached: 91.7%).
UNCACHED_BLOCK_THREADS = 512
GROUP_BLOCK_THREADS = 256  # mirrors kGroupBlockThreads in rows.cu
STRIDED_BLOCK_THREADS = 256

MAX_GRID_X = 2**31 - 1
MAX_GRID_Y = 65535
#: past 8, the 64-bit address of every cached vector costs more registers than
#: the data (ptxas spilled at 16 with 4-byte vectors).
VECS_PER_THREAD_CHOICES = (1, 2, 4, 8)
MAX_VECS_PER_THREAD = VECS_PER_THREAD_CHOICES[-1]


@dataclass(frozen=True)
class Device:
    """What the dispatch needs to know about a GPU."""

    sm_count: int
    compute_capability: int = 90


@dataclass(frozen=True)
class Kernel:
    family: str  # source file stem in cunorm/kernels/
    expression: str  # the template instantiation, e.g. cunorm::rows_cached<...>


@dataclass(frozen=True)
class Step:
    """One kernel launch."""

    kernel: Kernel
    grid: tuple[int, ...]
    block: tuple[int, ...]
    shared_bytes: int = 0


@dataclass(frozen=True)
class Launch:
    """The strategy for a plan: which tier, its launches and its parameters."""

    tier: str
    steps: tuple[Step, ...]
    threads_per_row: int = 0
    chunks: int = 0
    chunk_vecs: int = 0
    workspace_words: int = 0  # accumulation-type words of workspace


STAT_WORDS = {"rms": 1}
NORM_POLICY = {"rms": "cunorm::RmsNorm"}


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def block_cache_limit(vecs_per_thread: int, vec_bytes: int) -> int:
    """Largest block of rows_cached (BLOCK_PER_ROW) for a cache of this size;
    mirrors RowsCachedBounds in rows.cu."""
    return 512 if vecs_per_thread * vec_bytes > CACHE_BYTES_BLOCK_1024 else 1024


# The template instantiations, named once for the dispatch and all_kernels().
def rows_cached_expr(policy, t, w, vec, vecs_per_thread, block_per_row) -> str:
    bpr = "true" if block_per_row else "false"
    return f"cunorm::rows_cached<{policy}, {t}, {w}, {vec}, {vecs_per_thread}, {bpr}>"


def rows_uncached_expr(policy, t, w, vec) -> str:
    return f"cunorm::rows_uncached<{policy}, {t}, {w}, {vec}>"


def split_partial_expr(policy, t, vec) -> str:
    return f"cunorm::rows_split_partial<{policy}, {t}, {vec}>"


def split_apply_expr(policy, t, w, vec) -> str:
    return f"cunorm::rows_split_apply<{policy}, {t}, {w}, {vec}>"


def strided_expr(policy, t, w, vec, channels_per_thread) -> str:
    return f"cunorm::strided_norm<{policy}, {t}, {w}, {vec}, {channels_per_thread}>"


def choose(plan: Plan, device: Device, *, override: dict | None = None) -> Launch:
    """The launch for ``plan`` on ``device``.

    ``override`` forces a tier or its parameters (tests and the tuning script
    use it); every forced choice is still checked against the kernels' limits.
    """
    override = override or {}
    if plan.contiguous_rows:
        return _choose_rows(plan, device, override)
    return _choose_strided(plan, device, override)


def _choose_rows(plan: Plan, device: Device, override: dict) -> Launch:
    vec_bytes = plan.vec * plan.dtype.itemsize
    n_vec = plan.reduced // plan.vec
    rows = plan.outer
    row_bytes = plan.reduced * plan.dtype.itemsize
    threads = override.get("threads")
    if threads is None:
        threads = min(next_pow2(_ceil_div(n_vec, TARGET_VECS_PER_THREAD)), PREFERRED_MAX_ROW_THREADS)
        if _ceil_div(n_vec, threads) > MAX_VECS_PER_THREAD:
            threads = 1024
    if threads > 32:
        threads = max(threads, 64)  # a block per row: at least two warps
    vpt = next_pow2(_ceil_div(n_vec, threads))
    tier = override.get("tier")
    if tier is None:
        cacheable = vpt <= MAX_VECS_PER_THREAD and (
            (threads <= 32 and vpt * vec_bytes <= CACHE_BYTES_GROUP)
            or (threads > 32 and vpt * vec_bytes <= CACHE_BYTES_BLOCK_512
                and threads <= block_cache_limit(vpt, vec_bytes))
        )
        few_rows = rows < SPLIT_MAX_ROWS_PER_SM * device.sm_count
        if few_rows and row_bytes >= SPLIT_MIN_ROW_BYTES:
            tier = "split"
        elif cacheable:
            tier = "cached"
        else:
            tier = "split" if few_rows else "uncached"

    t, w = kernel_types(plan)
    policy = NORM_POLICY[plan.norm]
    if tier == "cached":
        if threads <= 32:
            block = GROUP_BLOCK_THREADS
            rows_per_block = block // threads
            expr = rows_cached_expr(policy, t, w, plan.vec, vpt, False)
            grid = min(_ceil_div(rows, rows_per_block), MAX_GRID_X)
        else:
            if threads > block_cache_limit(vpt, vec_bytes):
                raise ValueError(f"rows_cached: {threads} threads exceed the block limit for {vpt} vectors")
            block = threads
            expr = rows_cached_expr(policy, t, w, plan.vec, vpt, True)
            grid = min(rows, MAX_GRID_X)
        if vpt not in VECS_PER_THREAD_CHOICES:
            raise ValueError(f"rows_cached: {vpt} vectors per thread is not compiled")
        step = Step(Kernel("rows", expr), (grid,), (block,))
        return Launch("cached", (step,), threads_per_row=threads)
    if tier == "uncached":
        block = override.get("block", UNCACHED_BLOCK_THREADS)
        expr = rows_uncached_expr(policy, t, w, plan.vec)
        step = Step(Kernel("rows", expr), (min(rows, MAX_GRID_X),), (block,))
        return Launch("uncached", (step,))
    if tier == "split":
        block = SPLIT_BLOCK_THREADS
        want_chunks = max(1, _ceil_div(SPLIT_BLOCKS_PER_SM * device.sm_count, rows))
        chunk_vecs = _ceil_div(_ceil_div(n_vec, want_chunks), block) * block
        chunks = override.get("chunks", _ceil_div(n_vec, chunk_vecs))
        chunk_vecs = _ceil_div(n_vec, chunks)
        grid = (min(chunks, MAX_GRID_X), min(rows, MAX_GRID_Y))
        partial = Kernel("rows", split_partial_expr(policy, t, plan.vec))
        apply = Kernel("rows", split_apply_expr(policy, t, w, plan.vec))
        return Launch(
            "split",
            (Step(partial, grid, (block,)), Step(apply, grid, (block,))),
            chunks=chunks,
            chunk_vecs=chunk_vecs,
            workspace_words=rows * chunks * STAT_WORDS[plan.norm],
        )
    raise ValueError(f"unknown rows tier {tier!r}")


def _choose_strided(plan: Plan, device: Device, override: dict) -> Launch:
    if plan.reduced >= 2**31:  # strided_norm indexes channels with int
        raise ValueError(f"a strided normalized extent of {plan.reduced} elements is over the 2**31 - 1 limit")
    vec_bytes = plan.vec * plan.dtype.itemsize
    inner_vecs = plan.inner // plan.vec
    bx = override.get("bx", min(32, next_pow2(inner_vecs)))
    by = override.get("by", min(STRIDED_BLOCK_THREADS // bx, next_pow2(plan.reduced)))
    cpt = next_pow2(_ceil_div(plan.reduced, by))
    if cpt * vec_bytes > CACHE_BYTES_STRIDED or cpt > VECS_PER_THREAD_CHOICES[-1] or override.get("tier") == "uncached":
        cpt = 0
        by = override.get("by", min(STRIDED_BLOCK_THREADS // bx, next_pow2(plan.reduced)))
    if bx * by > STRIDED_BLOCK_THREADS or bx & (bx - 1):
        raise ValueError(f"strided_norm: block ({bx}, {by}) is not allowed")
    t, w = kernel_types(plan)
    expr = strided_expr(NORM_POLICY[plan.norm], t, w, plan.vec, cpt)
    tiles = _ceil_div(inner_vecs, bx)
    acc_bytes = 8 if plan.dtype.itemsize == 8 else 4
    shared = by * bx * plan.vec * STAT_WORDS[plan.norm] * acc_bytes
    step = Step(Kernel("strided", expr), (min(tiles, MAX_GRID_X), min(plan.outer, MAX_GRID_Y)), (bx, by), shared)
    return Launch("strided_cached" if cpt else "strided_uncached", (step,))


# --- every instantiation the dispatch can pick --------------------------------


def all_kernels(norms=("rms",)) -> list[Kernel]:
    """Every template instantiation that ``choose`` can return, for the
    precompile step and CI's compile check."""
    from . import _dtypes

    out = []
    for norm in norms:
        policy = NORM_POLICY[norm]
        for dtype in _dtypes.SUPPORTED:
            t = _dtypes.KERNEL_TYPE[dtype]
            acc = _dtypes.accumulation(dtype)
            weights = [_dtypes.NO_WEIGHT] + sorted({_dtypes.KERNEL_TYPE[dtype], _dtypes.KERNEL_TYPE[acc]})
            vecs = [v for v in (1, 2, 4, 8) if v * dtype.itemsize <= 16]
            for vec in vecs:
                vec_bytes = vec * dtype.itemsize
                out.append(Kernel("rows", split_partial_expr(policy, t, vec)))
                for w in weights:
                    for vpt in VECS_PER_THREAD_CHOICES:
                        if vpt * vec_bytes <= CACHE_BYTES_GROUP:
                            out.append(Kernel("rows", rows_cached_expr(policy, t, w, vec, vpt, False)))
                        if vpt * vec_bytes <= CACHE_BYTES_BLOCK_512:
                            out.append(Kernel("rows", rows_cached_expr(policy, t, w, vec, vpt, True)))
                    out.append(Kernel("rows", rows_uncached_expr(policy, t, w, vec)))
                    out.append(Kernel("rows", split_apply_expr(policy, t, w, vec)))
                    for cpt in (0,) + VECS_PER_THREAD_CHOICES:
                        if cpt * vec_bytes <= CACHE_BYTES_STRIDED:
                            out.append(Kernel("strided", strided_expr(policy, t, w, vec, cpt)))
    return out
