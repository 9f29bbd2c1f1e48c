"""Choosing the backward passes' kernels and launches (cunorm/kernels/
backward.cu and channel_grads.cu, run by gradients.py): pure functions of
the call's shape and the device, returning a frozen GradLaunch.

Contiguous rows of at most GRAD_CACHED_MAX_ELEMS elements (and
GRAD_CACHED_MAX_BYTES of x) a thread x 512 threads (16384 elements of
16-bit data, 8192 of 32-bit) run rows_grad_cached: threads = n_vec / vpt
with the fewest vectors a thread (vpt) that keeps the block within
GRAD_CACHED_TARGET_THREADS, else within 512; as many blocks as are
resident, walking rows, their column sums in shared memory (so rows the
shared memory cannot hold stream), launched cooperatively where it has
parameters: the grid adds its blocks' partials itself behind a grid
barrier. On sm_90, rows up to GRAD_CACHED_MAX_CLUSTER blocks of
GRAD_CACHED_CLUSTER_THREADS hold run rows_grad_cluster (the same body on
thread-block clusters, a cluster a row, their partials added by
column_sum), where there are rows enough to fill the SMs. Longer contiguous rows (and the whole
array) run rows_grad_chunks + rows_grad_finalize_wide + rows_grad_apply, a
strided axis rows_grad_sums + rows_grad_finalize + rows_grad_apply, each
pass chunked to about GRAD_BLOCKS_PER_SM blocks an SM (the contiguous
rows' passes to GRAD_CHUNK_BLOCKS_PER_SM and GRAD_APPLY_BLOCKS_PER_SM).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import declarations as K
from .dispatch_rows import MAX_GRID_X, MAX_GRID_Y, RESIDENT_SHARED_RESERVE, Device, Step, _ceil_div, next_pow2, norm_info, plane_rows_block
from .dispatch_channels import CHANNEL_PLANE_ROWS_MAX_VECS, first_holding
from .plans import ChannelPlan

#: elements a rows_grad_cached thread holds in registers (x, dy and its
#: columns' weights): 32 of 16-bit data, 16 of 32-bit, 8 doubles, at most
#: 128 registers and no spill on sm_80/sm_90 in the compile check
GRAD_CACHED_MAX_ELEMS = 32
GRAD_CACHED_MAX_BYTES = 64
#: block of rows_grad_cached when the row allows (more blocks an SM): bf16
#: 32768x4096 backward, 128 threads x 4 vectors (4 blocks an SM) against
#: 256 x 2 (2-3 blocks) and 512 x 1: RMSNorm 88.7% / 69.8% / 45.0%,
#: LayerNorm 65.8% / 65.7% / 58.7% (H200, bench/tune/backward.py).
#: Loading the next row during the reduction (tried the same day) needed
#: 108 registers for LayerNorm's 256 x 2 and read less: 61.9% / 79.0%.
GRAD_CACHED_TARGET_THREADS = 256
#: blocks of the preferred size an SM that its launch bounds ask for (the
#: registers then fit that many)
GRAD_CACHED_TARGET_MIN_BLOCKS = 3
#: a rows_grad_cached block fetches its next row (row + grid) into L2
#: while it works on the current one: LayerNorm / RMSNorm bf16 32768x4096
#: 81.6 / 90.6% with, 76.4 / 87.2% without (H200, one run; two
#: rows ahead read less, 61-68%)
GRAD_CACHED_PREFETCH_NEXT = True
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
GRAD_BLOCKS_PER_SM = 8
#: pass 2 of streamed rows splits the rows into as few chunks (parameter
#: partials, added by column_sum) as give it about this many column-tile
#: blocks an SM: one wave of resident blocks. Floor% with 8 / 4 / 3 / 2
#: (H200, bench/tune/backward.py --only apply): LayerNorm bf16
#: 16x2M 30.2 / 46.0 / 45.5 / 45.8, bf16 8x1M 12.4 / 17.1 / 33.4 / 33.7,
#: fp32 4x1M 25.6 / 38.7 / 39.5 / 39.8, fp32 64x100000 28.4 / 33.2 / 33.0 /
#: 35.1, bf16 4096x32768 49.9 / 51.4 / 49.0 / 43.0, bf16 1024x65536 40.6 /
#: 41.4 / 44.4 / 40.4; RMSNorm bf16 256x262144 46.0 / 47.9 / 48.8 / 48.3.
#: At 8, few long rows were cut in two or three for 1056 blocks where
#: their 512-1024 tiles already filled the GPU, and the partials of every
#: part cost a write and a read of n floats.
GRAD_APPLY_BLOCKS_PER_SM = 3
#: rows_grad_chunks' blocks an SM (pass 1 of streamed rows; it runs 3 at
#: a time an SM): problem 40 backward with 3 / 6 / 8 / 12 / 24, 55.7 /
#: 58.0 / 58.3 / 58.9 / 58.7%; LayerNorm bf16 4096x32768 49.2-49.3% for
#: all (H200, bench/tune/backward.py)
GRAD_CHUNK_BLOCKS_PER_SM = 12
#: channels-first chunks of the channel backward's passes hold at most
#: this many bytes of x (None: a pass aims at GRAD_BLOCKS_PER_SM blocks an
#: SM alone, which leaves problem 35's 1 MB channels whole, 7168 blocks).
#: Problem 35 backward, chunks of 1 MB (None) / 256 / 128 / 64 / 32 / 16
#: KB: 59.7 / 60.4 / 61.2 / 61.6 / 62.2 / 62.6% (H200, twice
#: each, the same to 0.1; bench/tune/backward.py). 16 KB is also the least
#: chunk, GRAD_MIN_CHUNK_PER_THREAD vectors a thread: the blocks resident
#: together then cover one contiguous front of memory, as in a copy.
GRAD_CHANNEL_MAX_CHUNK_BYTES = 16 << 10
#: block of rows_grad_finalize_wide (at most; a block a row, over its chunks)
GRAD_FINALIZE_THREADS = 1024  # mirrors kGradFinalizeThreads
#: a pass-1 chunk is at least this many vectors a thread (for_each_batched's batch)
GRAD_MIN_CHUNK_PER_THREAD = 4
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
#: BatchNorm's backward goes on chip for channels of at most this many
#: elements (0: never): 32-bit and 64-bit data (the ladder's largest holds
#: (32,256,56,56) fp32's 100352) ...
GRAD_ONCHIP_MAX_ELEMENTS = 131072
#: ... and 16-bit data: bf16 (64,1024,14,14) (12544 elements) 0.058 ms
#: against the four launches' 0.072, but (32,512,28,28) (25088) 0.073
#: against 0.062 and (64,512,28,28) 0.136 against 0.110.
GRAD_ONCHIP_MAX_ELEMENTS_16BIT = 16384


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


def grad_cached_bounds(threads: int, vpt: int) -> tuple[int, int]:
    """rows_grad_cached's launch bounds (most threads, fewest blocks an SM)
    for a block of ``threads``, ``vpt`` vectors a thread: the preferred
    block's, which caps the registers for more blocks an SM (4 and 8
    vectors a thread spilled at 3 blocks' 80 registers: 2 blocks, 128), or
    the largest block's."""
    if threads <= GRAD_CACHED_TARGET_THREADS:
        return GRAD_CACHED_TARGET_THREADS, GRAD_CACHED_TARGET_MIN_BLOCKS if vpt <= 2 else 2
    return GRAD_CACHED_MAX_THREADS, 1


def _vpt_choices(vec: int, itemsize: int) -> list[int]:
    # at most 8 vectors, GRAD_CACHED_MAX_ELEMS elements and 64 bytes of x a
    # thread (16 doubles, or 16 scalar LayerNorm elements with weight and
    # bias, spilled at 128 registers on sm_80 when the column sums were
    # registers too)
    return [v for v in (1, 2, 4, 8)
            if v * vec <= GRAD_CACHED_MAX_ELEMS and v * vec * itemsize <= GRAD_CACHED_MAX_BYTES]


def grad_cached_shape(n_vec: int, vec: int, itemsize: int, max_cluster: int = 1) -> tuple[int, int, int] | None:
    """(threads, vectors a thread, cluster) of rows_grad_cached for rows of
    n_vec vectors: one block where it holds the row, else (clusters of at
    most ``max_cluster`` blocks) the fewest blocks of at most
    GRAD_CACHED_CLUSTER_THREADS that hold it; None when none does."""
    for cap in (GRAD_CACHED_TARGET_THREADS, GRAD_CACHED_MAX_THREADS):
        for vpt in _vpt_choices(vec, itemsize):
            threads = _ceil_div(_ceil_div(n_vec, vpt), 32) * 32
            if threads <= cap:
                return threads, vpt, 1
    for cluster in _cluster_sizes(min(max_cluster, GRAD_CACHED_MAX_CLUSTER)):
        for vpt in _vpt_choices(vec, itemsize):
            threads = _ceil_div(_ceil_div(n_vec, cluster * vpt), 32) * 32
            if threads <= GRAD_CACHED_CLUSTER_THREADS:
                return threads, vpt, cluster
    return None


def _cluster_sizes(most: int) -> list[int]:
    """The cluster sizes tried, in order: powers of two from 2 to ``most``."""
    return [c for c in (2, 4, 8, 16) if c <= most]


def grad_cached_cluster_shapes(vec: int, itemsize: int) -> set[tuple[int, int, int]]:
    """The (vectors a thread, cluster, threads) grad_cached_shape can pick
    for a cluster, over every row length (what the catalogue compiles). A
    shape it picks for some row it picks for the longest row it holds, so
    those lengths are the ones tried."""
    lengths = {cluster * vpt * threads for cluster in _cluster_sizes(GRAD_CACHED_MAX_CLUSTER)
               for vpt in _vpt_choices(vec, itemsize) for threads in range(32, GRAD_CACHED_CLUSTER_THREADS + 1, 32)}
    shapes = (grad_cached_shape(n_vec, vec, itemsize, GRAD_CACHED_MAX_CLUSTER) for n_vec in lengths)
    return {(vpt, cluster, threads) for threads, vpt, cluster in filter(None, shapes) if cluster > 1}


def grad_cached_shared_bytes(flags: int, vec: int, threads: int, vpt: int, acc_itemsize: int) -> int:
    """rows_grad_cached's dynamic shared memory: a column sum a thread's
    element for dweight and for dbias, each where flags ask for it."""
    return bin(flags & 3).count("1") * vpt * vec * threads * acc_itemsize


@dataclass(frozen=True)
class GradLaunch:
    """The backward strategy of a plan: cached (one launch, the grid capped
    at the resident blocks when launched, which adds its own parameter
    partials), streamed (contiguous rows: chunks, finalize, apply) or
    strided (sums, finalize, apply); their parameter partials are then
    added by column_sum, except for streamed rows of one part."""

    tier: str  # "cached", "streamed" or "strided"; the channel norms' "channels" or "channel_onchip"
    steps: tuple[Step, ...]
    chunks: int = 0  # pass-1 chunks a group
    chunk_len: int = 0  # vectors (streamed) or reduced indices (strided) a chunk
    apply_chunks: int = 0  # pass-2 chunks (of rows, or of outer indices)
    apply_chunk_len: int = 0
    parts: int = 0  # rows of parameter partials (cached: set at launch; streamed: 1 = written directly)
    stat_words: int = 2  # words of the gradient statistic (LinfGrad: 3)
    prefetch_next: bool = False  # cached: the next row fetched into L2 ahead


def choose_rows_grad(norm: str, dtype, pdtype, flags: int, outer: int, reduced: int, inner: int, vec: int,
                     device: Device, cooperative: bool = True) -> GradLaunch:
    """The backward launch of a row norm over C-contiguous (outer, reduced,
    inner) arrays, vec elements a vector along the contiguous axis.
    ``cooperative`` False (the jit path, whose launches cannot be): the
    cached tier leaves dweight and dbias to a column_sum launch."""
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
        shape = grad_cached_shape(n_vec, vec, dtype.itemsize, max_cluster)
        shared = 0 if shape is None else grad_cached_shared_bytes(flags, vec, *shape[:2], accumulation(dtype).itemsize)
        if shape is not None and (shape[2] == 1 or outer * shape[2] >= sm) and \
                shared <= device.max_shared_per_block - RESIDENT_SHARED_RESERVE:
            threads, vpt, cluster = shape
            bounds = grad_cached_bounds(threads, vpt)
            if cluster == 1:
                kernel = K.ROWS_GRAD_CACHED(grad, t, p, flags, vec, vpt, *bounds, cooperative=flags != 0 and cooperative,
                                            persistent=True)
            else:  # (its partials go to column_sum: no cooperative launch)
                kernel = K.ROWS_GRAD_CLUSTER(grad, t, p, flags, vec, vpt, *bounds, cluster, persistent=True)
            step = Step(kernel, (min(outer, MAX_GRID_X // cluster) * cluster,), (threads,), shared)
            return GradLaunch("cached", (step,), prefetch_next=GRAD_CACHED_PREFETCH_NEXT)
        # pass 1: chunks of each row, about GRAD_CHUNK_BLOCKS_PER_SM blocks an
        # SM; pass 2: column tiles down row chunks, GRAD_APPLY_BLOCKS_PER_SM
        want = max(1, _ceil_div(GRAD_CHUNK_BLOCKS_PER_SM * sm, outer))
        chunk_len = max(GRAD_MIN_CHUNK_PER_THREAD * GRAD_BLOCK_THREADS, _ceil_div(n_vec, want))
        chunks = _ceil_div(n_vec, chunk_len)
        apply_tiles = _ceil_div(n_vec, GRAD_BLOCK_THREADS)
        apply_chunk_len = max(1, _ceil_div(outer, max(1, _ceil_div(GRAD_APPLY_BLOCKS_PER_SM * sm, apply_tiles))))
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
    inner_vec = inner // vec
    tiles = _ceil_div(inner_vec, GRAD_BLOCK_THREADS)
    want = max(1, _ceil_div(GRAD_BLOCKS_PER_SM * sm, outer * tiles))
    chunk_len = max(GRAD_MIN_CHUNK_PER_THREAD, _ceil_div(reduced, want))
    chunks = _ceil_div(reduced, chunk_len)
    want = max(1, _ceil_div(GRAD_BLOCKS_PER_SM * sm, reduced * tiles))
    apply_chunk_len = max(GRAD_MIN_CHUNK_PER_THREAD, _ceil_div(outer, want))
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


def grad_onchip_max_elements(itemsize: int) -> int:
    """The largest channel BatchNorm's backward takes on chip."""
    return GRAD_ONCHIP_MAX_ELEMENTS_16BIT if itemsize == 2 else GRAD_ONCHIP_MAX_ELEMENTS


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
    if vecs >= 2**31 or (vecs * plan.vec > grad_onchip_max_elements(plan.dtype.itemsize)
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
        want = max(1, _ceil_div(GRAD_BLOCKS_PER_SM * sm, plan.batch * tiles))
        chunk_len = max(GRAD_MIN_CHUNK_PER_THREAD * by, _ceil_div(plan.spatial, want))
        chunks = _ceil_div(plan.spatial, chunk_len)
        grid = (chunks, min(tiles, MAX_GRID_Y), min(plan.batch, MAX_GRID_Y))
        shared = bx * by * plan.vec * 2 * acc.itemsize
    elif plan.spatial // plan.vec <= CHANNEL_PLANE_ROWS_MAX_VECS:
        vecs = plan.spatial // plan.vec  # (the forward's plane rows)
        block = plane_rows_block(vecs, GRAD_BLOCK_THREADS)
        chunks, chunk_len = 1, vecs
        grid = (1, min(_ceil_div(plan.channels, block[1]), MAX_GRID_Y), min(plan.batch, MAX_GRID_Y))
        shared = 0
    else:
        vecs = plan.spatial // plan.vec
        block = (GRAD_BLOCK_THREADS,)
        want = max(1, _ceil_div(GRAD_BLOCKS_PER_SM * sm, plan.batch * plan.channels))
        chunk_len = _ceil_div(vecs, want)
        if GRAD_CHANNEL_MAX_CHUNK_BYTES is not None:
            chunk_len = min(chunk_len, GRAD_CHANNEL_MAX_CHUNK_BYTES // (plan.vec * plan.dtype.itemsize))
        chunk_len = max(GRAD_MIN_CHUNK_PER_THREAD * GRAD_BLOCK_THREADS, chunk_len)
        chunks = _ceil_div(vecs, chunk_len)
        grid = (chunks, min(plan.channels, MAX_GRID_Y), min(plan.batch, MAX_GRID_Y))
        shared = 0
    # (the kernels walk channel tiles and samples past the grid's y and z
    # limits by grid stride, as the forward's)
    members = plan.batch * plan.channels
    per_member = (_ceil_div(members, GRAD_BLOCK_THREADS),)
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
