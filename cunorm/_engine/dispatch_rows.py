"""Choosing a forward kernel and its launch for a plan: a pure function of
the plan and the device, returning a frozen Launch (the backward passes'
choice is cunorm/_engine/dispatch_grad.py, the catalogue of every instantiation
cunorm/_engine/catalogue.py, the kernels' declarations cunorm/_engine/declarations.py).

The heuristic; its tuned thresholds are the Tuning of the device's
architecture (tuning.py). Measurements: NVIDIA H200, copy bandwidth 4282 GB/s,
floor% = effective bandwidth over copy (bench/bench.py --tune;
docs/notes/rows.md has the runs).

Contiguous rows (inner == 1), by the number of vectors in a row, n_vec:
  1. threads = next_pow2(n_vec / tuning.target_vecs_per_thread), capped at
     tuning.preferred_max_row_threads; each thread then holds vpt = n_vec / threads
     vectors (a power of two). If that exceeds MAX_VECS_PER_THREAD, a
     1024-thread block per row. While a thread's cache is over the register
     budget (cached_cost: a residual and LayerNorm's statistic cost more),
     the row is spread over twice the threads.
  2. threads <= 32: rows_cached, a group of `threads` lanes per row, several
     rows per 256-thread block, butterfly shuffles only.
  3. up to 1024: rows_cached, one block of `threads` (>= 64) per row.
  4. rows longer than the register cache of one block (128 KB of row):
     rows_uncached (a block an SM walks rows, keeping what fits of each on
     chip, up to 258 KB of fp32 row, and reading the rest twice). Rows
     that start off vector alignment (65535 floats) are walked with their
     aligned body's vector (plan.peel_vec).
  5. few long rows (fewer than SMs, each >= tuning.split_min_row_bytes): the split
     tier, so the whole GPU works on each row (two launches, x read twice).
     Only here does the number of rows choose the tier: shorter rows get
     the same kernel and layout at every batch size (batch invariance).
     rows_resident (one cooperative block per SM keeps its chunk of the row
     in shared memory across a per-row arrival barrier: one read of x) is
     available by override only: on problem 40 (LayerNorm, weight and bias)
     it measured 32.8% of copy bandwidth against the split tier's 58.5%;
     on RMSNorm 16x4194304 fp32 without weight, 62.9% against 58.3% (H200).
     ncu on problem 40: 605 MB read from DRAM for 268 MB of x
     (weight and bias re-read for every row despite evict-last hints), and
     each row's load, barrier and write run one after another; not picked
     (docs/notes/rows.md, "Problem 40", has what was tried since).

Channel norms (GroupNorm, InstanceNorm, BatchNorm): cunorm/_engine/dispatch_channels.py.

Strided axis (inner > 1): strided_norm with threadIdx.x along inner (up to
32 vectors: a warp reads 512 contiguous bytes of one channel) and
threadIdx.y along the reduced axis (256-thread blocks), channels held in
registers when reduced / blockDim.y fits the register cache, else two sweeps.
"""
from __future__ import annotations

import math
import re

from dataclasses import dataclass, replace

from . import declarations as K
from . import plans, quantize, tuning
from .declarations import Kernel  # noqa: F401  (re-exported: the dispatch's Steps hold them)
from .plans import Plan, kernel_types, output_type

# --- what the kernels and the compiler allow (the measured choices: tuning.py) ---
#: register cost of a rows_cached thread's cache (cached_cost below): set by
#: ptxas's spill reports over every instantiation for sm_80 and sm_90.
CACHE_COST_GROUP = 256  # 256-thread blocks, two resident: 128 registers
CACHE_COST_BLOCK_1024 = 64  # 64 registers (128 spilled on sm_80)
CACHE_COST_BLOCK_512 = 256  # 128 registers
#: strided_norm: at most this many cached bytes a thread (128 registers,
#: two 256-thread blocks per SM; past it ptxas spills). Problem 36 (fp32,
#: 64 channels): block (32, 8) with 8 channels a thread 94.6%; (16, 16)
#: 86.3%; (32, 4) 70.5%; two sweeps 86.5%.
CACHE_BYTES_STRIDED = 128
SPLIT_BLOCK_THREADS = 256
#: rows_uncached: 512-thread blocks (its launch bounds), one an SM in a
#: persistent grid, each keeping as much of its row on chip as fits: the
#: stash in shared memory plus 4 vectors a thread in registers. Problem 39
#: (L2 normalize, 32768x65535 fp32), one run: stash + registers 86.0%,
#: the same without the stash (the row read twice) 67.5%, 256-thread blocks
#: 82.3%. An earlier run, before the registers: stash only 82.5%, two
#: 256-thread blocks an SM (half the stash each) 61.6%. Problem 34
#: (LayerNorm rows of 1 MB): 62.2% against 62.1% a block a row without a
#: stash (H200).
UNCACHED_BLOCK_THREADS = 512
UNCACHED_SHARED_RESERVE = 1024
#: resident tier (override only, see above): one 512-thread block per SM, its chunk of every row in
#: shared memory; this much of the opt-in shared memory stays free for the
#: kernel's static scratch.
RESIDENT_BLOCK_THREADS = 512
RESIDENT_SHARED_RESERVE = 1024
GROUP_BLOCK_THREADS = 128  # mirrors kGroupBlockThreads in row_bounds.cuh
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
    #: opt-in shared memory a block may have (227 KB on H100/H200)
    max_shared_per_block: int = 232448
    #: L2 cache bytes (50 MB on H100 and H200)
    l2_bytes: int = 50 * 1024 * 1024


@dataclass(frozen=True)
class Step:
    """One kernel launch."""

    kernel: Kernel
    grid: tuple[int, ...]
    block: tuple[int, ...]
    shared_bytes: int = 0
    #: threads launched where more than the block's product: whole warps
    #: past a 2-D layout's rows, which the kernel leaves idle (channels.cu)
    padded_threads: int = 0

    @property
    def threads(self) -> int:
        """The threads of a launched block."""
        return self.padded_threads or math.prod(self.block)


@dataclass(frozen=True)
class Launch:
    """The strategy for a plan: which tier, its launches and its parameters."""

    tier: str
    steps: tuple[Step, ...]
    threads_per_row: int = 0
    chunks: int = 0
    chunk_vecs: int = 0  # resident: vectors a chunk
    #: the pass that writes y, where it walks its own tiles (the split
    #: tier; the channels-first chunked walks): their count and vectors
    #: (0: the partial pass's chunks and chunk_vecs)
    apply_chunks: int = 0
    apply_chunk_vecs: int = 0
    stash_vecs: int = 0  # uncached: vectors of each row kept in shared memory
    workspace_words: int = 0  # accumulation-type words of workspace
    #: L2 hints of the pass that writes y (split tiers, channel_stream):
    #: 1, y stored streaming (st.global.cs); 2, x's last read as a last use
    hints: int = 0
    stream: "StreamShape | None" = None  # channel_stream's schedule


@dataclass(frozen=True)
class StreamShape:
    """channel_stream's slabs (choose_channel_stream; its tiles are the
    Launch's chunk_vecs vectors, chunks of them a group)."""

    slab_tiles: int
    lag: int


@dataclass(frozen=True)
class NormInfo:
    """A norm policy of cunorm/kernels/norms.cuh as the dispatch sees it."""

    policy: str  # the C++ template name
    stat_words: int  # its kStatWords
    flags: tuple[int, ...]  # the affine parameters the op takes (FLAGS values)
    residual: bool  # whether the op takes a fused residual


NORMS = {
    "rms": NormInfo("cunorm::RmsNorm", 1, (0, 1), True),
    "ln": NormInfo("cunorm::LayerNorm", 3, (0, 1, 2, 3), True),
    "l1": NormInfo("cunorm::L1Norm", 1, (0,), False),
    "l2": NormInfo("cunorm::L2Norm", 1, (0,), False),
    "linf": NormInfo("cunorm::LinfNorm", 1, (0,), False),
    "mean_abs": NormInfo("cunorm::MeanAbsNorm", 1, (0,), False),
}
#: general p: "lp:" + the 16 hex digits of the double p (power_norm_name)
POWER_NORM_PREFIX = "lp:"


def power_norm_name(p: float) -> str:
    """The norm name of the Lp norm for a general p (not 1, 2 or inf)."""
    import struct

    return POWER_NORM_PREFIX + format(struct.unpack("<Q", struct.pack("<d", float(p)))[0], "016x")


_POWER_NORM = re.compile(re.escape(POWER_NORM_PREFIX) + "[0-9a-f]{16}")


def lp_power(norm: str) -> tuple[float, bool]:
    """(p, mean) of an Lp-family norm name: its p, and whether it divides
    by the mean (mean_abs) rather than the norm."""
    import struct

    fixed = {"l1": (1.0, False), "l2": (2.0, False), "linf": (float("inf"), False), "mean_abs": (1.0, True)}
    if norm in fixed:
        return fixed[norm]
    norm_info(norm)
    return struct.unpack("<d", struct.pack("<Q", int(norm[len(POWER_NORM_PREFIX):], 16)))[0], False


def norm_info(norm: str) -> NormInfo:
    """The norm's policy. Nothing of ``norm`` reaches a kernel name but a
    number cunorm formats itself: a general p's 16 hex digits are parsed
    and formatted again (a name that is not exactly a NORMS key or
    power_norm_name's form is refused)."""
    info = NORMS.get(norm)
    if info is not None:
        return info
    if type(norm) is str and _POWER_NORM.fullmatch(norm):
        bits = int(norm[len(POWER_NORM_PREFIX):], 16)
        return NormInfo(f"cunorm::PowerNorm<0x{bits:016x}ull>::Policy", 1, (0,), False)
    raise ValueError(f"unknown norm {norm!r}: expected one of {sorted(NORMS)} or {POWER_NORM_PREFIX!r} and the 16 "
                     "hex digits of a float64 p")


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def split_apply_lean(plan: Plan) -> bool:
    """Whether rows_split_apply_tiles runs a vector a thread at eight blocks an SM
    (rows_streamed.cu's split_apply_lean: no residual, data of at most 4
    bytes, parameters of at most 32 bytes a vector), its tiles then a
    block's width of vectors."""
    params = bin(plan.flags & plans.PARAM_FLAGS).count("1")
    param_bytes = params * plan.param_dtype.itemsize if params else 0
    return not plan.residual and plan.dtype.itemsize <= 4 and plan.vec * param_bytes <= 32


def balanced_tiles(vecs: int, least: int) -> tuple[int, int]:
    """(tiles, vectors a tile): ``vecs`` cut into tiles of at least
    ``least`` vectors (fewer than twice that; one tile where ``vecs`` is
    less), of sizes as even as whole tiles allow."""
    tiles = max(1, vecs // least)
    size = _ceil_div(vecs, tiles)
    return _ceil_div(vecs, size), size


def cached_cost(vecs_per_thread: int, vec_bytes: int, residual: bool, heavy: bool) -> int:
    """The register cost of a rows_cached thread's cache: the cached bytes,
    x4 with a residual, x2 for a heavy statistic (LayerNorm) or float64.
    Mirrors RowsCachedBounds in row_bounds.cuh."""
    return vecs_per_thread * vec_bytes * (4 if residual else 1) * (2 if heavy else 1)


def cached_loads(vecs_per_thread: int, residual: bool) -> int:
    return vecs_per_thread * (2 if residual else 1)


def block_cache_limit(cost: int, loads: int, heavy: bool = False) -> int:
    """Largest rows_cached block (BLOCK_PER_ROW) for a thread cache of this
    cost, 0 if none; mirrors RowsCachedBounds in row_bounds.cuh (heavy statistics
    keep 128 registers: no 1024-thread blocks)."""
    if cost <= CACHE_COST_BLOCK_1024 and loads <= 8 and not heavy:
        return 1024
    if cost <= CACHE_COST_BLOCK_512 and loads <= 16:
        return 512
    return 0


def group_fits(cost: int) -> bool:
    """Whether a group-per-row rows_cached thread (128 registers) holds it."""
    return cost <= CACHE_COST_GROUP


def is_heavy(norm: str, dtype) -> bool:
    return norm_info(norm).stat_words > 1 or dtype.itemsize == 8


RESIDUAL_ADD_BLOCK = 256


def residual_add_step(dtype, n_vec: int, vec: int, device: Device) -> Step:
    """h = x + r over contiguous arrays (the unfused residual of a strided axis)."""
    tune = tuning.of(device)
    from .dtypes import KERNEL_TYPE

    grid = max(1, min(_ceil_div(n_vec, RESIDUAL_ADD_BLOCK), tune.residual_add_blocks_per_sm * device.sm_count))
    return Step(K.RESIDUAL_ADD(KERNEL_TYPE[dtype], vec), (grid,), (RESIDUAL_ADD_BLOCK,))


def statistics_only(launch: Launch) -> Launch:
    """The cached tier's launch with its y stores compiled out (rows_cached
    with NoStore): the statistics alone, for a jit program that never reads
    y. The other tiers always write y."""
    if launch.tier != "cached":
        raise ValueError(f"the {launch.tier} tier always writes y")
    (step,) = launch.steps
    args = step.kernel.template_args
    kernel = K.ROWS_CACHED(*args[:2], K.NO_STORE, *args[3:])
    return replace(launch, steps=(replace(step, kernel=kernel),))


def choose(plan: Plan, device: Device, *, override: dict | None = None) -> Launch | None:
    """The launch for ``plan`` on ``device``; None for a plan whose y dtype
    is not x's (``plan.out_dtype``) where the tier picked is not
    rows_cached, the only kernel that writes another dtype (the caller
    casts x first).

    ``override`` forces a tier or its parameters (tests and the tuning script
    use it); every forced choice is still checked against the kernels' limits.
    """
    override = override or {}
    if plan.out_dtype is not None and (plan.residual or not plan.contiguous_rows):
        return None
    if plan.flags & plans.CONDITIONED_FLAGS:
        # per-row operands: rows_cached alone takes them (row_norms refuses
        # the rows it cannot hold)
        if not plan.contiguous_rows or plan.quant is not None or plan.out_dtype is not None:
            return None
        launch = _choose_rows(plan, device, override)
        return launch if launch.tier == "cached" else None
    if plan.contiguous_rows:
        launch = _choose_rows(plan, device, override)
        return None if plan.out_dtype is not None and launch.tier != "cached" else launch
    return _choose_strided(plan, device, override)


def group_lanes(plan: Plan, group: int) -> int:
    """Adjacent lanes of a row that hold one group of ``group`` elements
    (rows_cached combines their max |value| by shuffles within a warp):
    at most 32, so the vector is at least group / 32 elements (the engine
    copies x where its alignment allows less: row_norms)."""
    lanes = group // plan.vec
    if lanes > 32:
        raise ValueError(f"a {group}-element group over {plan.vec}-element vectors spans {lanes} lanes, over a "
                         "warp")
    return lanes


@dataclass(frozen=True)
class RowShape:
    """What rows_cached's thread count follows besides the row's length:
    the vector's bytes, whether a second operand is held beside x (a
    residual, the gate z), a heavy statistic (LayerNorm, float64), per-row
    operands (they keep 128 registers, as heavy statistics:
    RowsCachedBounds), whether short rows may take half the target
    (`lean`), rows formed in float32 under 16-bit x (`formed`) and the
    lanes a quantization group needs (0: none)."""
    vec_bytes: int
    held: bool
    heavy: bool
    per_row_operands: bool = False
    lean: bool = True
    formed: bool = False
    group_lanes: int = 0


def row_shape(plan: Plan) -> RowShape:
    halving = plans.GATE_FLAGS if plan.flags & plans.FLAG_GATE_INPUT else 0
    group = quantize.by_key(plan.quant).group if plan.quant is not None else 0
    return RowShape(plan.vec * plan.dtype.itemsize, plan.residual or bool(plan.flags & plans.FLAG_GATE),
                    is_heavy(plan.norm, plan.dtype), bool(plan.flags & plans.CONDITIONED_FLAGS),
                    not plan.residual and plan.quant is None and not plan.flags & plans.CONDITIONED_FLAGS & ~halving,
                    bool(plan.flags & (plans.FLAG_GATE_INPUT | plans.FLAG_WIDE_RESIDUAL)), group // plan.vec)


def cache_fits(shape: RowShape, n_vec: int, threads: int) -> bool:
    """Whether rows_cached with ``threads`` per row holds a row of n_vec
    vectors within the register budget."""
    vpt = next_pow2(_ceil_div(n_vec, threads))
    if vpt > MAX_VECS_PER_THREAD:
        return False
    cost = cached_cost(vpt, shape.vec_bytes, shape.held, shape.heavy)
    limit = block_cache_limit(cost, cached_loads(vpt, shape.held), shape.heavy or shape.per_row_operands)
    return group_fits(cost) if threads <= 32 else threads <= limit


def rows_cache_fits(plan: Plan, threads: int) -> bool:
    """Whether rows_cached with ``threads`` per row holds the row within
    the register budget (what a forced cached tier is checked against)."""
    return cache_fits(row_shape(plan), plan.reduced // plan.vec, threads)


def row_threads(shape: RowShape, n_vec: int, tune: tuning.Tuning) -> int:
    """rows_cached's threads a row of n_vec vectors (the dispatch's choice;
    a pure function of the row, so the catalogue can list what it picks)."""
    target = tune.target_vecs_per_thread_heavy if shape.heavy else tune.target_vecs_per_thread
    if shape.formed and n_vec >= tune.formed_min_vecs:
        target = tune.target_vecs_per_thread_formed
    threads = min(next_pow2(_ceil_div(n_vec, target)), tune.preferred_max_row_threads)
    # Plain rows and the gate before the norm (x * silu(z)) may take
    # half the target below; the gate after the norm keeps it, as a
    # residual and the other per-row operands do
    # (tuning.short_row_max_lanes).
    if shape.lean and 1 < threads and next_pow2(_ceil_div(n_vec, target // 2)) <= tune.short_row_max_lanes:
        # short rows: half the vectors a thread where a group of at
        # most short_row_max_lanes lanes still holds the row (rows of
        # one lane keep it: not measured)
        threads = next_pow2(_ceil_div(n_vec, target // 2))
    if shape.heavy and n_vec >= 64 * tune.target_vecs_per_thread:
        threads = max(threads, 64)
    if _ceil_div(n_vec, threads) > MAX_VECS_PER_THREAD:
        threads = 1024
    threads = max(threads, shape.group_lanes)  # a group's lanes in one row's threads
    if threads > 32:
        threads = max(threads, 64)  # a block per row: at least two warps
    # Spread the row over more threads while a thread's cache is over
    # the register budget (residual, LayerNorm, float64 cost more).
    while not cache_fits(shape, n_vec, threads) and threads < 1024:
        threads = 64 if threads == 32 else threads * 2
    return threads


def _quant_store(plan: Plan, params: str):
    quant = quantize.by_key(plan.quant)
    return K.quant_store(params, plan.flags, quant.format.kernel_type, quant.scaling, quant.group)


def _choose_rows(plan: Plan, device: Device, override: dict) -> Launch:
    tune = tuning.of(device)
    vec_bytes = plan.vec * plan.dtype.itemsize
    n_vec = plan.reduced // plan.vec
    rows = plan.outer
    row_bytes = plan.reduced * plan.dtype.itemsize
    group = quantize.by_key(plan.quant).group if plan.quant is not None else 0
    shape = row_shape(plan)
    if "threads" in override:
        threads = override["threads"]
        if threads > 32:
            threads = max(threads, 64)  # a block per row: at least two warps
    else:
        if group:
            group_lanes(plan, group)  # (raises for a group over a warp's lanes)
        threads = row_threads(shape, n_vec, tune)
    vpt = next_pow2(_ceil_div(n_vec, threads))
    tier = override.get("tier")
    if tier is None and plan.quant is not None:
        # A quantized y: a row's scale is formed before any of it is stored,
        # in registers (rows_cached) or, for rows over their budget, by
        # sweeps re-reading the row from L2 (rows_uncached); never split
        # across blocks, so the tier follows the row alone.
        tier = "cached" if cache_fits(shape, n_vec, threads) else "uncached"
    if plan.quant is not None and tier not in ("cached", "uncached"):
        raise ValueError(f"quantize= runs in the cached or uncached tier, not {tier!r}")
    if tier is None and plan.flags & plans.CONDITIONED_FLAGS:
        # per-row operands: rows_cached whatever the rows (choose() returns
        # None for the rest), so the tier follows the row alone
        tier = "cached" if cache_fits(shape, n_vec, threads) else "uncached"
    if group and tier == "cached" and threads < group_lanes(plan, group):  # (only a forced thread count gets here)
        raise ValueError(f"rows_cached: {threads} threads a row are fewer than a {group}-element group's lanes")
    if tier is None:
        # Below tuning.split_min_row_bytes the tier (and every choice inside it)
        # follows the row alone, never the number of rows: a row's results
        # are then bitwise the same whatever the batch (docs/ops.md, "Batch
        # invariance").
        few_rows = rows < tune.split_max_rows_per_sm * device.sm_count
        if few_rows and row_bytes >= tune.split_min_row_bytes:
            tier = "split"
        elif cache_fits(shape, n_vec, threads):
            tier = "cached"
        else:
            tier = "uncached"

    t, p = kernel_types(plan)
    policy = norm_info(plan.norm).policy
    load = K.row_load(t, plan.residual, p if plan.flags & plans.FLAG_RESIDUAL_GATE else None,
                      "float" if plan.flags & plans.FLAG_WIDE_RESIDUAL else None)
    store_flags = plan.flags & plans.STORE_FLAGS
    common = (policy, t, K.affine_store(p, store_flags, t), load, plan.vec)
    if tier == "cached":
        if not cache_fits(shape, n_vec, threads):  # only a forced tier or thread count gets here
            raise ValueError(f"rows_cached: {threads} threads of {vpt} vectors are over the register budget")
        store = K.affine_store(p, store_flags, output_type(plan)) if plan.quant is None else _quant_store(plan, p)
        cached = (policy, t, store, load, plan.vec, vpt)
        if threads <= 32:
            block = GROUP_BLOCK_THREADS
            kernel = K.ROWS_CACHED(*cached, False)
            grid = min(_ceil_div(rows, block // threads), MAX_GRID_X)
        else:
            block = threads
            kernel = K.ROWS_CACHED(*cached, True)
            grid = min(rows, MAX_GRID_X)
        step = Step(kernel, (grid,), (block,))
        return Launch("cached", (step,), threads_per_row=threads)
    if tier == "uncached":
        # rows that may start misaligned are walked with the vector of their aligned body
        vec = plan.peel_vec if plan.quant is None else plan.vec  # (a quantized row's sweeps take no odd elements)
        vec_bytes = vec * plan.dtype.itemsize
        per_sm = override.get("blocks_per_sm", tune.uncached_blocks_per_sm)
        grid = min(rows, per_sm * device.sm_count if per_sm else rows, MAX_GRID_X)
        stash_bytes = 0
        if not plan.residual and plan.quant is None and vec_bytes >= 4:  # the stash's cp.async copies 4 to 16 bytes
            room = (device.max_shared_per_block - UNCACHED_SHARED_RESERVE) // max(per_sm, 1)
            stash_bytes = min(override.get("stash_bytes", tune.uncached_stash_bytes), room, row_bytes)
        stash_vecs = stash_bytes // vec_bytes
        store = common[2] if plan.quant is None else _quant_store(plan, p)
        kernel = K.ROWS_UNCACHED(*common[:2], store, common[3], vec, persistent=bool(per_sm))
        block = override.get("threads", UNCACHED_BLOCK_THREADS)
        if block > UNCACHED_BLOCK_THREADS or block % 32:
            raise ValueError(f"rows_uncached: {block} threads is over its 512-thread bounds or not whole warps")
        step = Step(kernel, (grid,), (block,), stash_vecs * vec_bytes)
        return Launch("uncached", (step,), stash_vecs=stash_vecs)
    if tier == "resident":
        grid = device.sm_count
        chunk_vecs = _ceil_div(n_vec, grid)
        shared = chunk_vecs * vec_bytes
        if shared > device.max_shared_per_block - RESIDENT_SHARED_RESERVE:
            raise ValueError(f"rows_resident: a {shared}-byte chunk is over the shared memory of a block")
        kernel = K.ROWS_RESIDENT(*common, cooperative=True)
        return Launch("resident", (Step(kernel, (grid,), (RESIDENT_BLOCK_THREADS,), shared),),
                      chunks=grid, chunk_vecs=chunk_vecs, workspace_words=rows * grid * norm_info(plan.norm).stat_words)
    if tier == "split":
        block = SPLIT_BLOCK_THREADS
        # chunks interleave (rows_streamed.cu): at most one a block's width of vectors
        want_chunks = max(1, _ceil_div(tune.split_blocks_per_sm * device.sm_count, rows))
        chunks = override.get("chunks", min(want_chunks, _ceil_div(n_vec, block)))
        grid = (min(rows, MAX_GRID_X), min(chunks, MAX_GRID_Y))
        partial = K.ROWS_SPLIT_PARTIAL(policy, t, load, plan.vec)
        partial_words = rows * chunks * norm_info(plan.norm).stat_words
        x_bytes = rows * plan.reduced * plan.dtype.itemsize
        if not override.get("tiles", x_bytes >= tune.split_tiles_min_bytes):
            # the apply combines each row's partials itself, grid-strided over pass 1's chunks
            apply = Step(K.ROWS_SPLIT_APPLY(*common), grid, (block,))
            return Launch("split", (Step(partial, grid, (block,)), apply), chunks=chunks,
                          workspace_words=partial_words)
        least = SPLIT_BLOCK_THREADS if split_apply_lean(plan) else tune.split_apply_tile_vecs
        tiles, tile_vecs = balanced_tiles(n_vec, override.get("apply_tile", least))
        steps = (Step(partial, grid, (block,)),
                 Step(K.ROWS_SPLIT_FINALIZE(policy, t, load), (min(rows, MAX_GRID_X),), (block,)),
                 Step(K.ROWS_SPLIT_APPLY_TILES(*common[1:]), (min(rows * tiles, MAX_GRID_X),), (block,)))
        return Launch("split", steps, chunks=chunks, apply_chunks=tiles, apply_chunk_vecs=tile_vecs,
                      workspace_words=partial_words + 3 * rows)
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
    if plan.residual:
        raise ValueError("strided_norm has no residual: form h first (cunorm/_engine/row_norms.py does)")
    t, p = kernel_types(plan)
    kernel = K.STRIDED_NORM(norm_info(plan.norm).policy, t, K.affine_store(p, plan.flags, t), plan.vec, cpt)
    tiles = _ceil_div(inner_vecs, bx)
    acc_bytes = 8 if plan.dtype.itemsize == 8 else 4
    shared = by * bx * plan.vec * norm_info(plan.norm).stat_words * acc_bytes
    step = Step(kernel, (min(tiles, MAX_GRID_X), min(plan.outer, MAX_GRID_Y)), (bx, by), shared)
    return Launch("strided_cached" if cpt else "strided_uncached", (step,))


# --- the channel family ---------------------------------------------------------


def plane_rows_block(vecs: int, threads: int) -> tuple[int, int]:
    """The (bx, by) block of the plane-rows layout for planes (or groups of
    partials) of ``vecs`` items: bx threads a plane, enough for 4 items a
    thread, a power of two up to a warp (its partials combine by shuffles);
    by = threads / bx planes."""
    bx = min(32, next_pow2(_ceil_div(max(vecs, 1), 4)))
    return bx, threads // bx
