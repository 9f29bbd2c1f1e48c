"""Choosing the backward passes' kernels and launches (cunorm/kernels/
backward.cu and channel_grads.cu, run by gradients.py): pure functions of
the call's shape and the device, returning a frozen GradLaunch.

Contiguous rows of at most GRAD_CACHED_MAX_ELEMS elements (and
GRAD_CACHED_MAX_BYTES of x) a thread x 512 threads (16384 elements of
16-bit data, 8192 of 32-bit) run rows_grad_cached: threads = n_vec / vpt
with the fewest vectors a thread (vpt) that keeps the block within
tuning.grad_cached_target_threads, else within 512; as many blocks as are
resident, walking rows, their column sums in shared memory (so rows the
shared memory cannot hold stream), launched cooperatively where it has
parameters: the grid adds its blocks' partials itself behind a grid
barrier. On sm_90, rows up to GRAD_CACHED_MAX_CLUSTER blocks of
GRAD_CACHED_CLUSTER_THREADS hold run rows_grad_cluster (the same body on
thread-block clusters, a cluster a row, their partials added by
column_sum), where there are rows enough to fill the SMs. Longer contiguous rows (and the whole
array) run rows_grad_chunks + rows_grad_finalize_wide + rows_grad_apply, a
strided axis strided_grad_cached where a thread can hold its share of
each group's x and dy (one pass: x and dy read once), else rows_grad_sums +
rows_grad_finalize + rows_grad_apply, each pass chunked to about
tuning.grad_blocks_per_sm blocks an SM (the contiguous rows' passes to
tuning.grad_chunk_blocks_per_sm and tuning.grad_apply_blocks_per_sm).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import declarations as K
from . import dtypes, plans, tuning
from .dispatch_rows import (MAX_GRID_X, MAX_GRID_Y, RESIDENT_SHARED_RESERVE, Device, Step, _ceil_div, next_pow2,
                            norm_info, plane_rows_block)
from .dispatch_channels import first_holding
from .plans import ChannelPlan

#: elements a rows_grad_cached thread holds in registers (x, dy and its
#: columns' weights): 32 of 16-bit data, 16 of 32-bit, 8 doubles, at most
#: 128 registers and no spill on sm_80/sm_90 in the compile check
GRAD_CACHED_MAX_ELEMS = 32
GRAD_CACHED_MAX_BYTES = 64
GRAD_CACHED_MAX_THREADS = 512
#: rows longer than a block holds run rows_grad_cluster: a thread-block
#: cluster (sm_90) of at most GRAD_CACHED_MAX_CLUSTER blocks of at most
#: GRAD_CACHED_CLUSTER_THREADS threads (the fewest blocks that hold the
#: row), when its clusters fill the GPU's SMs (rows x cluster >= SMs;
#: fewer rows, and longer ones, stream). Two blocks of 512 ran RMSNorm bf16
#: 4096x32768 at 80.9% against 63% for 4 x 256 and 8 x 128 and 55% streamed;
#: 4 x 512 lost to streaming (H100; docs/notes/backward.md, "One-read
#: backward of long rows").
GRAD_CACHED_CLUSTER_THREADS = 512
GRAD_CACHED_MAX_CLUSTER = 2
GRAD_BLOCK_THREADS = 256  # mirrors kGradBlockThreads
GRAD_COEFF_WORDS = 5  # mirrors kCoeffWords (grads.cuh)
#: block of rows_grad_finalize_wide (at most; a block a row, over its chunks)
GRAD_FINALIZE_THREADS = 1024  # mirrors kGradFinalizeThreads
#: channel_grad_onchip's shapes (BatchNorm, channels-first: a channel held
#: on chip, x and dy read once), (threads, elements of x and as many of dy
#: a thread, cluster), in the order tried: the first whose capacity holds
#: a channel (grad_onchip_items: fewer for float64 and for narrow vectors
#: in 1024-thread blocks). H100, bench/tune/backward.py --only
#: onchip, GPU time (ms) against the four launches' (last), fp32:
#: (64,2048,7,7) (256, 16, 1) 0.044, (128, 32, 1) 0.047, (256, 32, 1) 0.056,
#: (512, 16, 1) 0.068, 0.084; (128,2048,7,7) (256, 32, 1) 0.087, (512, 16,
#: 1) 0.101, 0.151; (64,1024,14,14) (1024, 16, 1) 0.065, 0.108;
#: (32,512,28,28) (256, 16, 8) 0.082, (512, 16, 4) 0.104, 0.103;
#: (64,512,28,28) (256, 32, 8) 0.145, (1024, 16, 8) 0.266, 0.189;
#: (32,256,56,56) (1024, 16, 8) 0.167, 0.194. A 1024-thread cluster takes
#: an SM alone: past (1024, 16, 1), 256-thread blocks first.
GRAD_ONCHIP_SHAPES = ((256, 16, 1), (256, 32, 1), (1024, 16, 1), (256, 16, 8), (256, 32, 8), (1024, 16, 8))
#: ... and for 16-bit data, where 2-byte scalars want more a thread: bf16
#: (64,2048,7,7) (256, 32, 1) 0.053, (128, 32, 1) 0.052, (256, 16, 1)
#: 0.063, 0.078 (torch eager 0.054); (128,2048,7,7) (256, 32, 1) 0.098,
#: (1024, 16, 1) 0.125, 0.147; (64,1024,14,14) (1024, 16, 1) 0.057, 0.072.
GRAD_ONCHIP_SHAPES_16BIT = ((256, 32, 1), (1024, 16, 1), (256, 16, 8))


def grad_policy(norm: str, acc: str) -> str:
    """The gradient policy (grads.cuh) of a norm, for accumulation type acc."""
    if norm == "rms":
        return f"cunorm::RmsGrad<{acc}>"
    if norm in ("ln", "group", "instance", "batch"):
        return f"cunorm::LayerGrad<{acc}>"
    if norm == "linf":
        return f"cunorm::LinfGrad<{acc}>"
    forward = norm_info(norm).policy
    return f"cunorm::LpGrad<{forward}<{acc}>, {acc}>"


def grad_cached_bounds(threads: int, vpt: int, tune: tuning.Tuning) -> tuple[int, int]:
    """rows_grad_cached's launch bounds (most threads, fewest blocks an SM)
    for a block of ``threads``, ``vpt`` vectors a thread: the preferred
    block's, which caps the registers for more blocks an SM (4 and 8
    vectors a thread spilled at 3 blocks' 80 registers: 2 blocks, 128), or
    the largest block's."""
    if threads <= tune.grad_cached_target_threads:
        return tune.grad_cached_target_threads, tune.grad_cached_target_min_blocks if vpt <= 2 else 2
    return GRAD_CACHED_MAX_THREADS, 1


def _vpt_choices(vec: int, itemsize: int) -> list[int]:
    # at most 8 vectors, GRAD_CACHED_MAX_ELEMS elements and 64 bytes of x a
    # thread (16 doubles, or 16 scalar LayerNorm elements with weight and
    # bias, spilled at 128 registers on sm_80 when the column sums were
    # registers too)
    return [v for v in (1, 2, 4, 8)
            if v * vec <= GRAD_CACHED_MAX_ELEMS and v * vec * itemsize <= GRAD_CACHED_MAX_BYTES]


def grad_cached_shape(n_vec: int, vec: int, itemsize: int, tune: tuning.Tuning,
                      max_cluster: int = 1, max_vpt: int = 8) -> tuple[int, int, int] | None:
    """(threads, vectors a thread, cluster) of rows_grad_cached for rows of
    n_vec vectors: one block where it holds the row, else (clusters of at
    most ``max_cluster`` blocks) the fewest blocks of at most
    GRAD_CACHED_CLUSTER_THREADS that hold it; None when none does.
    ``max_vpt``: vectors a thread at most (one block)."""
    for cap in (tune.grad_cached_target_threads, GRAD_CACHED_MAX_THREADS):
        for vpt in [v for v in _vpt_choices(vec, itemsize) if v <= max_vpt]:
            threads = _ceil_div(_ceil_div(n_vec, vpt), 32) * 32
            if threads <= cap:
                return threads, vpt, 1
    for cluster in _cluster_sizes(min(max_cluster, GRAD_CACHED_MAX_CLUSTER)):
        for vpt in _vpt_choices(vec, itemsize):
            threads = _ceil_div(_ceil_div(n_vec, cluster * vpt), 32) * 32
            if threads <= GRAD_CACHED_CLUSTER_THREADS:
                return threads, vpt, cluster
    return None


def grad_cached_rows_a_block(n_vec: int, threads: int, vpt: int, tune: tuning.Tuning) -> tuple[int, int]:
    """(threads a row, rows a block) of rows_grad_cached for rows of n_vec
    vectors that grad_cached_shape gives ``threads`` of one block: a row of
    at most tune.grad_cached_multi_row_max_row_threads threads shares a
    block of tune.grad_cached_multi_row_threads with other rows, where its
    threads divide it (a row of under 32 vectors a thread takes the power
    of two at or above, a part of a warp), so that its barriers and its
    block's partial row serve several rows (docs/notes/backward.md, "Short
    rows"); else (threads, 1)."""
    block = tune.grad_cached_multi_row_threads
    width = _ceil_div(n_vec, vpt)
    row_threads = next_pow2(width) if width < 32 else threads
    if row_threads > tune.grad_cached_multi_row_max_row_threads or row_threads >= block or block % row_threads:
        return threads, 1
    return row_threads, block // row_threads


def grad_cached_multi_row_bounds(tune: tuning.Tuning) -> tuple[int, int]:
    """rows_grad_cached's launch bounds for blocks shared by several rows."""
    return tune.grad_cached_multi_row_threads, tune.grad_cached_multi_row_min_blocks


def _cluster_sizes(most: int) -> list[int]:
    """The cluster sizes tried, in order: powers of two from 2 to ``most``."""
    return [c for c in (2, 4, 8, 16) if c <= most]


def grad_cached_cluster_shapes(vec: int, itemsize: int, tune: tuning.Tuning) -> set[tuple[int, int, int]]:
    """The (vectors a thread, cluster, threads) grad_cached_shape can pick
    for a cluster, over every row length (what the catalogue compiles). A
    shape it picks for some row it picks for the longest row it holds, so
    those lengths are the ones tried."""
    lengths = {cluster * vpt * threads for cluster in _cluster_sizes(GRAD_CACHED_MAX_CLUSTER)
               for vpt in _vpt_choices(vec, itemsize) for threads in range(32, GRAD_CACHED_CLUSTER_THREADS + 1, 32)}
    shapes = (grad_cached_shape(n_vec, vec, itemsize, tune, GRAD_CACHED_MAX_CLUSTER) for n_vec in lengths)
    return {(vpt, cluster, threads) for threads, vpt, cluster in filter(None, shapes) if cluster > 1}


def grad_cached_shared_bytes(flags: int, vec: int, threads: int, vpt: int, acc_itemsize: int) -> int:
    """rows_grad_cached's dynamic shared memory: a column sum a thread's
    element for dweight and for dbias, each where flags ask for it."""
    sums = (flags & plans.FLAG_WEIGHT != 0) + (flags & plans.FLAG_BIAS != 0)  # (no bin(): dynamo traces this)
    return sums * vpt * vec * threads * acc_itemsize


@dataclass(frozen=True)
class GradLaunch:
    """The backward strategy of a plan: cached (one launch, the grid capped
    at the resident blocks when launched, which adds its own parameter
    partials), streamed (contiguous rows: chunks, finalize, apply),
    strided_cached (a strided axis in one launch, the grid the resident
    blocks) or strided (sums, finalize, apply); their parameter partials
    are then added by column_sum, except for streamed rows of one part."""

    tier: str  # "cached", "streamed", "strided_cached" or "strided"; the channel norms' "channels" or "channel_onchip"
    steps: tuple[Step, ...]
    chunks: int = 0  # pass-1 chunks a group
    chunk_len: int = 0  # vectors (streamed) or reduced indices (strided) a chunk
    apply_chunks: int = 0  # pass-2 chunks (of rows, or of outer indices)
    apply_chunk_len: int = 0
    parts: int = 0  # rows of parameter partials (cached: set at launch; streamed: 1 = written directly)
    stat_words: int = 2  # words of the gradient statistic (LinfGrad: 3)
    prefetch_next: bool = False  # cached: the next row fetched into L2 ahead
    row_threads: int = 0  # cached: threads a row (the block's, or a part of it shared by several rows)


def _cached_launch(decl, leading: tuple, dtype, flags: int, outer: int, n_vec: int, vec: int, device: Device,
                   cooperative: bool, max_cluster: int, max_vpt: int = 8, heads: int = 1) -> GradLaunch | None:
    """rows_grad_cached's launch (``decl`` rows_grad_cached or
    rows_grad_gated, ``leading`` its template arguments before VEC) for
    ``outer`` rows of n_vec vectors, or rows_grad_cluster's where clusters
    of up to ``max_cluster`` blocks hold the row and fill the SMs; None
    where neither holds it. ``heads`` > 1 (parameters per head): a block a
    row, no cluster (a block's rows are then of one head)."""
    tune, acc_bytes = tuning.of(device), dtypes.accumulation(dtype).itemsize
    shape = grad_cached_shape(n_vec, vec, dtype.itemsize, tune, max_cluster, max_vpt)
    if shape is None:
        return None
    threads, vpt, cluster = shape
    shared = grad_cached_shared_bytes(flags, vec, threads, vpt, acc_bytes)
    if (cluster > 1 and (heads > 1 or outer * cluster < device.sm_count)) or \
            shared > device.max_shared_per_block - RESIDENT_SHARED_RESERVE:
        return None
    row_threads, rows_a_block = (grad_cached_rows_a_block(n_vec, threads, vpt, tune) if cluster == 1 and heads == 1
                                 else (threads, 1))
    if rows_a_block > 1:
        threads = row_threads * rows_a_block
        shared = grad_cached_shared_bytes(flags, vec, threads, vpt, acc_bytes)
    bounds = grad_cached_multi_row_bounds(tune) if rows_a_block > 1 else grad_cached_bounds(threads, vpt, tune)
    if cluster == 1:
        kernel = decl(*leading, vec, vpt, *bounds, int(rows_a_block > 1), cooperative=flags != 0 and cooperative,
                      persistent=True)
    else:  # (its partials go to column_sum: no cooperative launch)
        kernel = K.ROWS_GRAD_CLUSTER(*leading, vec, vpt, *bounds, cluster, persistent=True)
    blocks = min(_ceil_div(outer, rows_a_block), MAX_GRID_X // cluster) * cluster
    return GradLaunch("cached", (Step(kernel, (blocks,), (threads,), shared),),
                      prefetch_next=tune.grad_cached_prefetch_next, row_threads=row_threads)


#: where the gated RMSNorm's silu(z) multiplies (rows_grad_gated's GATE, grads.cuh's GradGate)
GATE_OUTPUT, GATE_INPUT = 1, 2
#: rows_grad_gated holds at most this many elements a thread in vectors
#: narrower than 16 bytes: 16-bit rows in 8-byte vectors, 8 of them a
#: thread (32 elements), spilled 8 bytes at 128 registers with a weight
#: (sm_90), where 16-byte vectors, 4 a thread, do not
GATED_NARROW_MAX_ELEMS = 16


def gated_max_vpt(vec: int, itemsize: int) -> int:
    """The most vectors a rows_grad_gated thread takes (GATED_NARROW_MAX_ELEMS)."""
    return 8 if vec * itemsize == 16 else max(1, GATED_NARROW_MAX_ELEMS // vec)


def choose_rows_grad_gated(dtype, pdtype, flags: int, rows: int, n: int, vec: int, gate: int, device: Device,
                           cooperative: bool = True, heads: int = 1) -> GradLaunch | None:
    """The gated RMSNorm's backward (rows_grad_gated, ``gate`` GATE_OUTPUT or
    GATE_INPUT) over ``rows`` C-contiguous rows of n elements (``heads``
    weight rows): rows_grad_cached's shape within gated_max_vpt vectors a
    thread; None where one block does not hold a row."""
    from .dtypes import KERNEL_TYPE, NO_PARAMS, accumulation

    a = KERNEL_TYPE[accumulation(dtype)]
    p = NO_PARAMS if not flags else KERNEL_TYPE[pdtype]
    return _cached_launch(K.ROWS_GRAD_GATED, (grad_policy("rms", a), KERNEL_TYPE[dtype], p, flags, gate), dtype, flags,
                          rows, n // vec, vec, device, cooperative, 1, gated_max_vpt(vec, dtype.itemsize), heads)


def choose_rows_grad(norm: str, dtype, pdtype, flags: int, outer: int, reduced: int, inner: int, vec: int,
                     device: Device, cooperative: bool = True, heads: int = 1) -> GradLaunch | None:
    """The backward launch of a row norm over C-contiguous (outer, reduced,
    inner) arrays, vec elements a vector along the contiguous axis.
    ``cooperative`` False (the jit path, whose launches cannot be): the
    cached tier leaves dweight and dbias to a column_sum launch. ``heads``
    > 1 (parameters per head): the cached tier a block a row, or None."""
    tune = tuning.of(device)
    from .dtypes import KERNEL_TYPE, NO_PARAMS, accumulation

    a = KERNEL_TYPE[accumulation(dtype)]
    t = KERNEL_TYPE[dtype]
    p = NO_PARAMS if not flags else KERNEL_TYPE[pdtype]
    grad = grad_policy(norm, a)
    sm = device.sm_count
    stat_words = 3 if norm == "linf" else 2
    if inner == 1:
        n_vec = reduced // vec
        # clusters on sm_90 and later, where they fill the SMs
        max_cluster = GRAD_CACHED_MAX_CLUSTER if device.compute_capability >= 90 else 1
        cached = _cached_launch(K.ROWS_GRAD_CACHED, (grad, t, p, flags), dtype, flags, outer, n_vec, vec, device,
                                cooperative, max_cluster, heads=heads)
        if cached is not None or heads > 1:
            return cached
        # pass 1: chunks of each row, about tuning.grad_chunk_blocks_per_sm blocks an
        # SM; pass 2: column tiles down row chunks, tuning.grad_apply_blocks_per_sm
        want = max(1, _ceil_div(tune.grad_chunk_blocks_per_sm * sm, outer))
        chunk_len = max(tune.grad_min_chunk_per_thread * GRAD_BLOCK_THREADS, _ceil_div(n_vec, want))
        chunks = _ceil_div(n_vec, chunk_len)
        apply_tiles = _ceil_div(n_vec, GRAD_BLOCK_THREADS)
        apply_chunk_len = max(1, _ceil_div(outer, max(1, _ceil_div(tune.grad_apply_blocks_per_sm * sm, apply_tiles))))
        apply_chunks = _ceil_div(outer, apply_chunk_len)
        steps = (
            Step(K.ROWS_GRAD_CHUNKS(grad, t, p, flags, vec), (outer * chunks,),
                 (GRAD_BLOCK_THREADS,)),
            Step(K.ROWS_GRAD_FINALIZE_WIDE(grad, a), (outer,),
                 (min(GRAD_FINALIZE_THREADS, max(32, next_pow2(chunks))),)),
            Step(K.ROWS_GRAD_APPLY(grad, t, p, flags, vec, False), (apply_tiles, apply_chunks),
                 (GRAD_BLOCK_THREADS,)),
        )
        return GradLaunch("streamed", steps, chunks=chunks, chunk_len=chunk_len, apply_chunks=apply_chunks,
                          apply_chunk_len=apply_chunk_len, parts=apply_chunks, stat_words=stat_words)
    cached = _strided_cached(grad, t, p, flags, dtype, accumulation(dtype).itemsize, outer, reduced, inner, vec, sm,
                             stat_words)
    if cached is not None:
        return cached
    inner_vec = inner // vec
    tiles = _ceil_div(inner_vec, GRAD_BLOCK_THREADS)
    want = max(1, _ceil_div(tune.grad_blocks_per_sm * sm, outer * tiles))
    chunk_len = max(tune.grad_min_chunk_per_thread, _ceil_div(reduced, want))
    chunks = _ceil_div(reduced, chunk_len)
    want = max(1, _ceil_div(tune.grad_blocks_per_sm * sm, reduced * tiles))
    apply_chunk_len = max(tune.grad_min_chunk_per_thread, _ceil_div(outer, want))
    apply_chunks = _ceil_div(outer, apply_chunk_len)
    groups = outer * inner
    steps = (
        Step(K.ROWS_GRAD_SUMS(grad, t, p, flags, vec), (outer * chunks * tiles,),
             (GRAD_BLOCK_THREADS,)),
        Step(K.ROWS_GRAD_FINALIZE(grad, a), (_ceil_div(groups, GRAD_BLOCK_THREADS),),
             (GRAD_BLOCK_THREADS,)),
        Step(K.ROWS_GRAD_APPLY(grad, t, p, flags, vec, True), (reduced * apply_chunks * tiles,),
             (GRAD_BLOCK_THREADS,)),
    )
    return GradLaunch("strided", steps, chunks=chunks, chunk_len=chunk_len, apply_chunks=apply_chunks,
                      apply_chunk_len=apply_chunk_len, parts=apply_chunks * tiles, stat_words=stat_words)


#: strided_grad_cached: at most this many bytes of x and dy a thread holds
#: (64 registers), so that two 256-thread blocks fit an SM (its launch
#: bounds: 128 registers a thread); the vector is narrowed to fit first.
#: Half of it for float64, whose accumulators take two registers each
#: (LayerNorm's float64 kernel with weight and bias spilled at 128 bytes on
#: sm_80). Problem 36's backward (fp32, 64 channels): docs/notes/backward.md.
GRAD_STRIDED_CACHE_BYTES = 128
GRAD_STRIDED_THREADS = 256
GRAD_STRIDED_BLOCKS_PER_SM = 2  # mirrors strided_grad_cached's launch bounds
GRAD_STRIDED_MAX_CPT = 8


def strided_grad_cache_bytes(itemsize: int) -> int:
    """The bytes of x and dy a strided_grad_cached thread may hold."""
    return GRAD_STRIDED_CACHE_BYTES // 2 if itemsize == 8 else GRAD_STRIDED_CACHE_BYTES


def strided_grad_shape(reduced: int, inner: int, vec: int, itemsize: int) -> tuple[int, int, int, int] | None:
    """(vec, bx, by, reduced indices a thread) of strided_grad_cached: of
    the shapes whose held x and dy fit strided_grad_cache_bytes, the one
    whose warps read the longest contiguous runs (bx * vec elements of a
    reduced index, at least a 32-byte sector unless they span inner, where
    consecutive indices are adjacent), then the fewest threads along the
    reduced axis (by partials a position to combine through shared memory;
    problem 36's shapes measured in docs/notes/backward.md). None where
    none fits."""
    best, best_key = None, None
    v = vec
    while v >= 1:
        bx = min(32, next_pow2(inner // v))
        while bx >= 1:
            by = min(GRAD_STRIDED_THREADS // bx, next_pow2(reduced))
            cpt = next_pow2(_ceil_div(reduced, by))
            run = min(bx * v, inner)
            if cpt <= GRAD_STRIDED_MAX_CPT and 2 * cpt * v * itemsize <= strided_grad_cache_bytes(itemsize) and \
                    (run == inner or run * itemsize >= 32) and (best_key is None or (run, -by) > best_key):
                best, best_key = (v, bx, by, cpt), (run, -by)
            bx //= 2
        v //= 2
    return best


def _strided_cached(grad, t, p, flags, dtype, acc_bytes, outer, reduced, inner, vec, sm,
                    stat_words) -> GradLaunch | None:
    shape = strided_grad_shape(reduced, inner, vec, dtype.itemsize)
    if shape is None:
        return None
    v, bx, by, cpt = shape
    tiles = _ceil_div(inner // v, bx)
    # at most the resident blocks: each keeps its dweight/dbias sums across
    # its positions and writes one partial row
    resident = GRAD_STRIDED_BLOCKS_PER_SM * sm
    gy = min(outer, resident, MAX_GRID_Y)
    gx = min(tiles, max(1, resident // gy))
    shared = max(by * v * bx * stat_words + v * bx * GRAD_COEFF_WORDS, 2 * cpt * by * bx) * acc_bytes
    step = Step(K.STRIDED_GRAD_CACHED(grad, t, p, flags, v, cpt), (gx, gy), (bx, by), shared)
    return GradLaunch("strided_cached", (step,), parts=gx * gy, stat_words=stat_words)


def column_sum_step(a: str, p: str, parts: int, n: int, outputs: int) -> Step:
    """column_sum of dweight (outputs 1) or dweight and dbias (2): a thread
    adds 16 bytes of columns where n is a multiple of that many."""
    by = min(32, next_pow2(parts))
    bx = GRAD_BLOCK_THREADS // by
    columns = column_sum_width(a, n)
    return Step(K.COLUMN_SUM(a, p, columns), (_ceil_div(n, bx * columns), outputs), (bx, by))


def column_sum_width(a: str, n: int) -> int:
    """Columns a column_sum thread adds (one 16-byte load a part, where n allows)."""
    columns = 16 // (8 if a == "double" else 4)
    return columns if n % columns == 0 else 1


def grad_onchip_items(itemsize: int, vec: int, threads: int, elements: int) -> int:
    """Vectors of x (and as many of dy) a channel_grad_onchip thread holds
    for a shape of GRAD_ONCHIP_SHAPES: its elements (at least one vector),
    halved for float64 and for vectors of under 8 bytes in 1024-thread
    blocks (64 registers a thread: ptxas spilled both at the full count, in
    the compile check)."""
    if itemsize == 8 or (vec * itemsize < 8 and threads == 1024):
        elements //= 2
    return max(1, elements // vec)


def grad_onchip_shapes(itemsize: int) -> tuple:
    """GRAD_ONCHIP_SHAPES, or GRAD_ONCHIP_SHAPES_16BIT for 16-bit data."""
    return GRAD_ONCHIP_SHAPES_16BIT if itemsize == 2 else GRAD_ONCHIP_SHAPES


def grad_onchip_max_elements(itemsize: int, tune: tuning.Tuning) -> int:
    """The largest channel BatchNorm's backward takes on chip."""
    return tune.grad_onchip_max_elements_16bit if itemsize == 2 else tune.grad_onchip_max_elements


def grad_onchip_shape(plan: ChannelPlan, device: Device, override: dict | None = None) -> tuple[int, int, int] | None:
    """(threads, vectors of x a thread, cluster) of channel_grad_onchip for
    ``plan``: BatchNorm on channels-first x whose channels have at most
    grad_onchip_max_elements, the first of grad_onchip_shapes that
    holds a channel (clusters on sm_90 and later only); else None.
    ``override``: as for choose_channel_grad."""
    override = override or {}
    if plan.per_sample or plan.channels_last or override.get("walk") == "split":
        return None
    vecs = plan.batch * plan.spatial // plan.vec
    if vecs >= 2**31 or (vecs * plan.vec > grad_onchip_max_elements(plan.dtype.itemsize, tuning.of(device))
                         and override.get("walk") != "onchip"):
        return None
    shapes = [(t, grad_onchip_items(plan.dtype.itemsize, plan.vec, t, e), k)
              for t, e, k in grad_onchip_shapes(plan.dtype.itemsize)]
    return first_holding(shapes, vecs, plan.vec, device, override, 16)


def choose_channel_grad(plan: ChannelPlan, training: bool, device: Device, override: dict | None = None) -> GradLaunch:
    """The backward launch of a channel norm: channel_grad_onchip where
    grad_onchip_shape has a shape (one launch), else sums, combine,
    finalize, apply. ``override`` (tests and tuning) may set "walk"
    ("onchip" or "split") and channel_grad_onchip's "threads", "elements"
    (of x a thread) and "cluster"."""
    tune = tuning.of(device)
    from .dtypes import KERNEL_TYPE, NO_PARAMS, accumulation

    acc = accumulation(plan.dtype)
    a, t = KERNEL_TYPE[acc], KERNEL_TYPE[plan.dtype]
    p = NO_PARAMS if not plan.flags else KERNEL_TYPE[plan.param_dtype]
    sm = device.sm_count
    shape = grad_onchip_shape(plan, device, override)
    if override and override.get("walk") == "onchip" and shape is None:
        raise ValueError(f"channel_grad_onchip does not take {plan.norm}_norm's backward of this layout and size")
    if shape is not None:
        threads, items, cluster = shape
        kernel = K.CHANNEL_GRAD_ONCHIP(t, p, plan.flags, plan.vec, training, threads, items, cluster)
        return GradLaunch("channel_onchip", (Step(kernel, (plan.channels * cluster,), (threads,)),))
    if plan.channels_last:
        vecs = plan.channels // plan.vec
        bx = min(GRAD_BLOCK_THREADS, next_pow2(vecs))
        by = GRAD_BLOCK_THREADS // bx
        block = (bx, by)
        tiles = _ceil_div(vecs, bx)
        want = max(1, _ceil_div(tune.grad_blocks_per_sm * sm, plan.batch * tiles))
        chunk_len = max(tune.grad_min_chunk_per_thread * by, _ceil_div(plan.spatial, want))
        chunks = _ceil_div(plan.spatial, chunk_len)
        grid = (chunks, min(tiles, MAX_GRID_Y), min(plan.batch, MAX_GRID_Y))
        shared = bx * by * plan.vec * 2 * acc.itemsize
    elif plan.spatial // plan.vec <= tune.channel_plane_rows_max_vecs:
        vecs = plan.spatial // plan.vec  # (the forward's plane rows)
        block = plane_rows_block(vecs, GRAD_BLOCK_THREADS)
        chunks, chunk_len = 1, vecs
        grid = (1, min(_ceil_div(plan.channels, block[1]), MAX_GRID_Y), min(plan.batch, MAX_GRID_Y))
        shared = 0
    else:
        vecs = plan.spatial // plan.vec
        block = (GRAD_BLOCK_THREADS,)
        want = max(1, _ceil_div(tune.grad_blocks_per_sm * sm, plan.batch * plan.channels))
        chunk_len = _ceil_div(vecs, want)
        if tune.grad_channel_max_chunk_bytes is not None:
            chunk_len = min(chunk_len, tune.grad_channel_max_chunk_bytes // (plan.vec * plan.dtype.itemsize))
        chunk_len = max(tune.grad_min_chunk_per_thread * GRAD_BLOCK_THREADS, chunk_len)
        chunks = _ceil_div(vecs, chunk_len)
        grid = (chunks, min(plan.channels, MAX_GRID_Y), min(plan.batch, MAX_GRID_Y))
        shared = 0
    # (the kernels walk channel tiles and samples past the grid's y and z
    # limits by grid stride, as the forward's)
    members = plan.batch * plan.channels
    per_member = (_ceil_div(members * 32, GRAD_BLOCK_THREADS),)  # (channel_grad_combine: a warp a member)
    # BatchNorm in training: channel_grad_finalize takes a warp a channel
    finalize_threads = max(members, 32 * plan.channels) if training and not plan.per_sample else members
    steps = (
        Step(K.CHANNEL_GRAD_SUMS(t, plan.vec, plan.channels_last), grid, block, shared),
        Step(K.CHANNEL_GRAD_COMBINE(a), per_member, (GRAD_BLOCK_THREADS,)),
        Step(K.CHANNEL_GRAD_FINALIZE(a, p, plan.flags, training), (_ceil_div(finalize_threads, GRAD_BLOCK_THREADS),),
             (GRAD_BLOCK_THREADS,)),
        Step(K.CHANNEL_GRAD_APPLY(t, plan.vec, plan.channels_last), grid, block),
    )
    return GradLaunch("channels", steps, chunks=chunks, chunk_len=chunk_len)


GRAD_NORMS = ("rms", "ln", "l1", "l2", "linf", "mean_abs")


# --- the fused modulated backward (modulated_grad.py, modulated_grads.cu) -----------------

#: rows_grad_modulated's P, Q and G sums (VPT x VEC words a thread each)
#: at most: within the 99 KB a block of sm_86 and sm_89, so that a plan
#: holds on every architecture (fusable() asks before the device is known)
MODULATED_MAX_SHARED = 96 * 1024
#: ... and vectors a thread at most: more serve only rows of narrow
#: vectors (odd lengths), whose instantiations would double the catalogue
MODULATED_MAX_VECTORS = 4
#: with the gate (x and dh read together after the reduction, dres
#: written, the G sums) at most 2 vectors a thread and 2 blocks an SM
#: (128 registers): 4 vectors spilled 240-312 bytes, 2 under 3 blocks' 85
#: registers 116-124 (adaLN bf16 32768x3072: 434 against 389 us, H200;
#: docs/notes/conditioned.md)
MODULATED_GATE_MAX_VECTORS = 2
MODULATED_GATE_MIN_BLOCKS = 2
#: a unit's rows at least: each unit writes 2-3 float32 partial words a
#: column against its rows' 3-6 reads and writes a column, so 16 rows keep
#: the partials within about 15% of the traffic
UNIT_MIN_ROWS = 16
#: the units a run is cut into at most: two a resident block (2 x SMs),
#: so that one run (one sample) fills the GPU
UNITS_PER_SM = 2
#: ... and no more than one an SM where units of UNIT_ROWS rows would not
#: need more: each unit writes its partial sums, so shorter units cost
#: traffic (runs of 4096 rows, batch 8: 7-11% faster in 32-row units than
#: in 16-row ones, H200; docs/notes/conditioned.md)
UNIT_ROWS = 32
#: rows_grad_modulated's MODF and modulated_grad_sums' OUTS bits (the .cu's)
MOD_SCALE, MOD_GATE = 1, 2
OUT_SHIFT, OUT_SCALE, OUT_GATE = 1, 2, 4


@dataclass(frozen=True)
class ModulatedPlan:
    """The launch parameters of one call: rows of n elements in runs of
    mod_div rows, run r reading modulation row r % mod_count; each run cut
    into units_per_run units of unit_rows rows; blocks of ``threads``,
    ``vpt`` vectors a thread, launch bounds (max_threads, min_blocks)."""

    vec: int
    vpt: int
    threads: int
    units_per_run: int
    unit_rows: int
    mod_div: int
    mod_count: int
    max_threads: int
    min_blocks: int

    def sums_shared_bytes(self, acc_itemsize: int, gate: bool) -> int:
        """rows_grad_modulated's dynamic shared memory: P and Q (and G)."""
        return (3 if gate else 2) * self.vpt * self.vec * self.threads * acc_itemsize


def modulated_plan(rows: int, n: int, vec: int, itemsize: int, mod_div: int, mod_count: int, sm_count: int,
                   gate: bool = False, min_run: int = UNIT_MIN_ROWS, tune: tuning.Tuning = tuning.SM90):
    """The ModulatedPlan of rows x n elements (``vec``: the widest vector
    every pointer allows) whose modulation row is r // mod_div % mod_count
    (``gate``: with residual_gate), or None where the fused kernels do not
    take it. Runs shorter than ``min_run`` rows are refused (their partial
    sums would outweigh the rows: per-token modulation composes); a shard
    of a partitioned call, whose runs may be a part of the whole call's,
    passes 1. The block is rows_grad_cached's (grad_cached_shape, one block
    a row, its launch bounds), refused where its sums pass
    MODULATED_MAX_SHARED; the unit cutting depends on mod_div and the GPU
    alone (batch invariance)."""
    if mod_count == 1:
        mod_div = rows  # one modulation row for all: one run
    if rows == 0 or mod_div < min_run or n % vec or mod_count > MAX_GRID_Y:
        return None
    shape = grad_cached_shape(n // vec, vec, itemsize, tune,
                              max_vpt=MODULATED_GATE_MAX_VECTORS if gate else MODULATED_MAX_VECTORS)
    if shape is None:
        return None
    threads, vpt, _ = shape
    bounds = grad_cached_bounds(threads, vpt, tune)
    if gate:
        bounds = (bounds[0], min(bounds[1], MODULATED_GATE_MIN_BLOCKS))
    units_per_run = max(1, min(mod_div // UNIT_MIN_ROWS, UNITS_PER_SM * sm_count, max(sm_count, mod_div // UNIT_ROWS)))
    unit_rows = _ceil_div(mod_div, units_per_run)
    units_per_run = _ceil_div(mod_div, unit_rows)
    p = ModulatedPlan(vec, vpt, threads, units_per_run, unit_rows, mod_div, mod_count, *bounds)
    if p.sums_shared_bytes(8 if itemsize == 8 else 4, gate) > MODULATED_MAX_SHARED:
        return None
    return p


def modulated_shapes(vec: int, itemsize: int, gate: bool, tune: tuning.Tuning) -> set[tuple[int, int, int]]:
    """The (vectors a thread, max_threads, min_blocks) modulated_plan can
    pick over every row length (what the catalogue compiles): a block's
    shape and shared memory follow from its threads and vectors a thread,
    so the longest row of each is the one tried."""
    lengths = {vpt * threads for vpt in _vpt_choices(vec, itemsize) if vpt <= MODULATED_MAX_VECTORS
               for threads in range(32, GRAD_CACHED_MAX_THREADS + 1, 32)}
    plans_ = (modulated_plan(UNIT_MIN_ROWS, n_vec * vec, vec, itemsize, UNIT_MIN_ROWS, 1, 1, gate, tune=tune)
              for n_vec in lengths)
    return {(p.vpt, p.max_threads, p.min_blocks) for p in plans_ if p is not None}
