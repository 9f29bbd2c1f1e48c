"""Choosing the walk and launches of a channel norm (GroupNorm,
InstanceNorm, BatchNorm; a ChannelPlan) over cunorm/kernels/channels.cu: a
pure function of the plan and the device, as cunorm/_engine/dispatch_rows.py is for the
row family.

Channel norms (GroupNorm, InstanceNorm, BatchNorm; a ChannelPlan): groups
of whole channels without parameters on channels-first memory are rows and
go to the rows tiers as LayerNorm (channel_rows_fast); the rest run the
channel family's three launches, or two where the apply finalizes each
group itself (choose_channels, apply_finalizes), chunked so each pass has at least
tuning.channel_blocks_per_sm blocks an SM (channels-first, chunks of at most
tuning.channel_max_chunk_bytes) or tuning.channel_last_blocks_per_sm (channels-last).

Measurements: docs/notes/channel-norms.md.
"""
from __future__ import annotations

from . import declarations as K
from . import tuning
from .dispatch_rows import (MAX_GRID_X, MAX_GRID_Y, NORMS, Device, Launch, Step, StreamShape, _ceil_div,
                            balanced_tiles, next_pow2, plane_rows_block)
from .plans import PARAM_FLAGS, ChannelPlan, kernel_types, output_type

CHANNEL_BLOCK_THREADS = 256  # mirrors kChannelBlockThreads in channels.cu
#: the three launches' LAYOUT template argument (channels.cu's header)
CHANNELS_FIRST, CHANNELS_LAST, CHANNELS_LAST_GROUPED, CHANNELS_LAST_PAIRED = 0, 1, 2, 3
STREAM_BLOCK_THREADS = 256
#: channel_onchip's shapes, (threads, elements a thread, cluster), in the
#: order tried: the first whose capacity (their product) holds a group
#: (float64: half the elements). H100, bench/tune/channels.py, GPU
#: time against the three launches (ms): 4096-element groups: BatchNorm fp32
#: (64,2048,7,7) (256, 16, 1) 0.0433 against (256, 32, 1) 0.0680 and split
#: 0.0827; 16384: InstanceNorm (4,64,128,128) fp32 (512, 32, 1) 0.0172
#: against (256, 32, 2) 0.0200 and split 0.0315; 32768: GroupNorm(32)
#: (8,640,32,32) bf16 (1024, 32, 1) 0.0177 against (256, 32, 4) 0.0260 and
#: split 0.0258; 65536: InstanceNorm (16,64,256,256) fp32 (256, 32, 8) 82.9%
#: of copy against (512, 32, 4) 77.9%, (1024, 32, 2) 71.8% and split 58.4%;
#: 262144: problem 34 (1024, 32, 8) 77.7% against the three launches' 64.4%
#: (the rows walk: 68.0%, first pass).
#: Blocks of a cluster share an SM's registers with other clusters' blocks
#: only when small: 1024-thread blocks take a whole SM (docs/notes/channel-norms.md).
ONCHIP_SHAPES = ((256, 16, 1), (512, 32, 1), (1024, 32, 1), (256, 32, 8), (1024, 32, 8))
#: 16-bit data goes on chip only for groups of at most this many bytes:
#: GroupNorm(32) bf16 (8,640,32,32) (40 KB groups) 0.0177 against split's
#: 0.0258 ms, but (8,320,64,64) (80 KB) 0.0413 against 0.0385, (8,512,128,128)
#: (512 KB) 41.3% against 52.8%; BatchNorm bf16 (64,512,28,28) (98 KB) 0.0857
#: against 0.0890 (a tie). float32 won or tied at every size.
ONCHIP_MAX_GROUP_BYTES_16BIT = 64 * 1024
#: the channel family's statistic: mean and variance (Chan's pairwise update)
CHANNEL_NORM = "cunorm::LayerNorm"


def channel_rows_fast(plan: ChannelPlan) -> bool:
    """Whether a channel norm is a row norm in disguise: per-sample groups of
    a channels-first x are contiguous rows of channels_per_group * spatial
    elements, and without per-channel parameters the row family's tiers
    (one read for groups that fit on chip) normalize them as LayerNorm."""
    return plan.per_sample and not plan.channels_last and not plan.flags & PARAM_FLAGS


def choose_channel_walk(plan: ChannelPlan, device: Device) -> str:
    """The walk of a channel norm in training mode:
      "rows"    the row family, for a row norm in disguise (GroupNorm and
                InstanceNorm without parameters, channels-first) whose
                groups the row family keeps on chip (tune.rows_max_group_bytes);
      "onchip"  channel_onchip, x read once, where onchip_pays;
      "rows"    again for the other row norms in disguise;
      "stream"  channel_stream, x read from DRAM once, for x larger than L2
                (stream_fits);
      "split"   three launches, x read twice."""
    tune = tuning.of(device)
    group_bytes = onchip_group_vecs(plan) * plan.vec * plan.dtype.itemsize
    if channel_rows_fast(plan) and group_bytes <= tune.rows_max_group_bytes:
        return "rows"
    if onchip_pays(plan, device):
        return "onchip"
    if channel_rows_fast(plan):
        return "rows"
    if plan.nbytes > device.l2_bytes and stream_fits(plan, device):
        return "stream"
    return "split"


def channel_apply_hints(plan: ChannelPlan, device: Device) -> int:
    """channel_apply's L2 hints (tune.channel_apply_hints_max_x_l2_share)."""
    tune = tuning.of(device)
    return 3 if device.l2_bytes < plan.nbytes <= tune.channel_apply_hints_max_x_l2_share * device.l2_bytes else 1


def stream_fits(plan: ChannelPlan, device: Device) -> bool:
    """Whether channel_stream can run ``plan``: per-sample groups of a
    channels-first x in 16-byte vectors, a group under 2**31 vectors and
    no larger than tune.stream_max_group_l2_share of L2 (a bigger group is not
    resident when it is re-read)."""
    tune = tuning.of(device)
    itemsize = plan.dtype.itemsize
    group_bytes = plan.channels_per_group * plan.spatial * itemsize
    return (plan.per_sample and not plan.channels_last and plan.vec * itemsize == 16
            and plan.channels_per_group * plan.spatial // plan.vec < 2**31
            and group_bytes <= tune.stream_max_group_l2_share * device.l2_bytes)


def choose_channel_stream(plan: ChannelPlan, device: Device, override: dict | None = None) -> Launch:
    """channel_stream's launch for ``plan`` (stream_fits): tiles of
    tune.stream_tile_bytes, slabs of whole groups of tune.stream_slab_l2_share of L2,
    a persistent grid. ``override`` may set "tile_vecs", "slab_bytes",
    "lag" and "hints" (the tuning script)."""
    tune = tuning.of(device)
    override = override or {}
    t, p = kernel_types(plan)
    vec_bytes = plan.vec * plan.dtype.itemsize
    group_vecs = plan.channels_per_group * plan.spatial // plan.vec
    groups = plan.statistic_groups
    slab_bytes = override.get("slab_bytes", int(tune.stream_slab_l2_share * device.l2_bytes))
    slab_groups = min(max(1, slab_bytes // (group_vecs * vec_bytes)), groups)
    in_flight = tune.stream_blocks_per_sm * device.sm_count

    def schedule(tile_vecs):  # (row_tiles, slab_tiles, lag) of tiles of tile_vecs
        row_tiles = _ceil_div(group_vecs, tile_vecs)
        slab_tiles = slab_groups * row_tiles
        return row_tiles, slab_tiles, max(1, _ceil_div(in_flight // 2 + row_tiles, slab_tiles))

    tile_vecs = tune.stream_tile_bytes // vec_bytes
    row_tiles, slab_tiles, lag = schedule(tile_vecs)
    reread_limit = tune.stream_max_reread_l2_share * device.l2_bytes
    while lag * slab_tiles * tile_vecs * vec_bytes > reread_limit and tile_vecs > 256:
        tile_vecs //= 2
        row_tiles, slab_tiles, lag = schedule(tile_vecs)
    if "tile_vecs" in override:  # (the lag stays the default tiles' unless forced too)
        tile_vecs = override["tile_vecs"]
        row_tiles, slab_tiles, _ = schedule(tile_vecs)
    lag = override.get("lag", lag)
    if 2 * _ceil_div(groups * row_tiles, slab_tiles) * slab_tiles >= 2**31:
        raise ValueError(f"{plan.norm}_norm: {groups * row_tiles} tiles is over channel_stream's ticket limit")
    kernel = K.CHANNEL_STREAM(CHANNEL_NORM, t, K.affine_store(p, plan.flags, output_type(plan)), plan.vec,
                              persistent=True)
    acc_words = groups * row_tiles * NORMS["ln"].stat_words + 3 * groups
    step = Step(kernel, (device.sm_count * 8,), (STREAM_BLOCK_THREADS,))
    return Launch("channel_stream", (step,), chunks=row_tiles, chunk_vecs=tile_vecs, workspace_words=acc_words,
                  hints=override.get("hints", tune.stream_hints),
                  stream=StreamShape(slab_tiles=slab_tiles, lag=lag))


def onchip_group_vecs(plan: ChannelPlan) -> int:
    """The vectors of one statistic group."""
    return plan.channels_per_group * plan.spatial * (1 if plan.per_sample else plan.batch) // plan.vec


def onchip_items(itemsize: int, vec: int, threads: int, elements: int, cluster: int) -> int:
    """Vectors a thread holds for a shape of ONCHIP_SHAPES: its elements
    (at least one vector), halved for float64 and for scalars in clustered
    1024-thread blocks (64 registers a thread: ptxas spilled both at the
    full count, in the compile check)."""
    if itemsize == 8 or (vec == 1 and threads == 1024 and cluster > 1):
        elements //= 2
    return max(1, elements // vec)


def onchip_shape(plan: ChannelPlan, device: Device, override: dict | None = None) -> tuple[int, int, int] | None:
    """(threads, items, cluster) of channel_onchip for ``plan``: the first
    of ONCHIP_SHAPES whose capacity holds a group (clusters on sm_90 and
    later only), or None where none does or the layout is not one it walks
    (channels-last BatchNorm; channels-last groups not whole vectors).
    ``override`` may set "threads", "elements" (per thread) and "cluster"."""
    override = override or {}
    if plan.channels_last and (not plan.per_sample or plan.channels_per_group % plan.vec):
        return None
    shapes = [(t, onchip_items(plan.dtype.itemsize, plan.vec, t, e, k), k) for t, e, k in ONCHIP_SHAPES]
    return first_holding(shapes, onchip_group_vecs(plan), plan.vec, device, override, 32)


def first_holding(shapes, vecs: int, vec: int, device: Device, override: dict, elements: int):
    """The first (threads, items, cluster) of ``shapes`` that holds ``vecs``
    vectors (clusters on sm_90 and later only), or None; ``override``'s
    "threads", "elements" (default ``elements``) and "cluster", where set,
    are the only shape tried."""
    if "threads" in override:
        shapes = [(override["threads"], max(1, override.get("elements", elements) // vec), override.get("cluster", 1))]
    for threads, items, cluster in shapes:
        if cluster > 1 and device.compute_capability < 90:
            continue
        if vecs <= threads * items * cluster:
            return threads, items, cluster
    return None


def onchip_pays(plan: ChannelPlan, device: Device) -> bool:
    """Whether channel_onchip takes a training-mode call: a group fits
    (onchip_shape), a BatchNorm channel has at most
    tune.onchip_max_batch_group_elements elements, and for 16-bit data a group
    is at most ONCHIP_MAX_GROUP_BYTES_16BIT."""
    tune = tuning.of(device)
    if onchip_shape(plan, device) is None:
        return False
    elements = onchip_group_vecs(plan) * plan.vec
    if not plan.per_sample and elements > tune.onchip_max_batch_group_elements:
        return False
    return plan.dtype.itemsize >= 4 or elements * 2 <= ONCHIP_MAX_GROUP_BYTES_16BIT


def choose_channel_onchip(plan: ChannelPlan, device: Device, override: dict | None = None) -> Launch:
    """channel_onchip's launch (onchip_shape): a cluster of blocks per
    statistic group."""
    t, p = kernel_types(plan)
    threads, items, cluster = onchip_shape(plan, device, override)
    kernel = K.CHANNEL_ONCHIP(t, K.affine_store(p, plan.flags, output_type(plan)), plan.vec, plan.channels_last,
                              threads, items, cluster)
    return Launch("channel_onchip", (Step(kernel, (plan.statistic_groups * cluster,), (threads,)),))


def channels_last_tiling(channels: int, vec: int, exact: bool = True) -> tuple[int, int]:
    """(tile_vecs, tiles) of a channels-last pass: a row of threads along a
    position's vectors, tiles of them across the channels."""
    vecs = channels // vec
    # Exactly the position's vectors, not the next power of two: 6 rows
    # of 40 threads (launched as 256), not 4 of 64 with 24 idle in each.
    # GroupNorm(32) bf16 +w+b (8,64,64,320): 0.0545 -> 0.0489 ms (apply
    # 23.4 -> 19.1 us); 4 rows of 40 unpadded 0.0543; 64 and 160 vectors
    # the same (docs/notes/channel-norms.md).
    if vecs <= CHANNEL_BLOCK_THREADS and exact:
        return vecs, 1
    bx = min(CHANNEL_BLOCK_THREADS, next_pow2(vecs))
    return bx, _ceil_div(vecs, bx)


def channels_last_grid(plan: ChannelPlan, bx: int, tiles: int, blocks: int, tune: tuning.Tuning,
                       chunks: int | None = None):
    """(block, padded_threads, chunk_len, chunks, grid) of a channels-last
    pass of rows of bx threads aiming for ``blocks`` blocks (``chunks``
    forces the chunks a sample's positions are cut into). The block is
    launched as whole warps (XLA's launches, the jit path, count threads in
    warps): the threads past its rows idle."""
    by = CHANNEL_BLOCK_THREADS // bx
    padded = -(-bx * by // 32) * 32
    padded = 0 if padded == bx * by else padded
    want_chunks = max(1, blocks // (plan.batch * tiles))
    chunk_len = max(tune.channel_last_min_chunk_rows * by, _ceil_div(plan.spatial, want_chunks))
    if chunks:
        chunk_len = _ceil_div(plan.spatial, chunks)
    chunks = _ceil_div(plan.spatial, chunk_len)
    grid = (min(chunks, MAX_GRID_X), min(tiles, MAX_GRID_Y), min(plan.batch, MAX_GRID_Y))
    return (bx, by), padded, chunk_len, chunks, grid


def channels_last_walk(plan: ChannelPlan, override: dict, tune: tuning.Tuning) -> tuple[int, int, int, int]:
    """(vec, layout, tile_vecs, tiles) of the three launches on channels-last
    x: a row of up to 256 threads along a position's vectors (tile_vecs of
    them), tiles of them across the channels. Grouped (CHANNELS_LAST_GROUPED,
    a thread keeps one statistic) where the statistics are per sample, a
    vector of at least tune.grouped_min_vec_bytes divides the groups (the widest
    such, up to the plan's) and each group's vectors lie in one tile; else,
    per sample, paired (CHANNELS_LAST_PAIRED, a thread keeps the statistics
    of the two groups its vector may straddle) where the groups are at least
    the plan's vector wide and a position's vectors make one tile; else a
    statistic per channel, vectors of the plan's width. A tile is a
    position's vectors where they are at most CHANNEL_BLOCK_THREADS, else
    256 of them; the block is CHANNEL_BLOCK_THREADS // tile rows of a tile,
    launched as whole warps (the threads past the rows idle).
    ``override`` {"grouped": False} forbids the grouped layout,
    {"paired": False} the paired one, {"exact_tile": False} tiles of a power
    of two, {"vec": v} a statistic per channel at vectors of v (paired with
    {"paired": True} too) (the tuning script)."""
    def tiling(vec):
        return channels_last_tiling(plan.channels, vec, override.get("exact_tile", True))

    if "vec" in override:
        if plan.vec % override["vec"]:
            raise ValueError(f"vectors of {override['vec']} do not divide the plan's {plan.vec}")
        vec = override["vec"]
        bx, tiles = tiling(vec)
        if override.get("paired") and plan.per_sample and 1 < vec <= plan.channels_per_group and tiles == 1:
            return vec, CHANNELS_LAST_PAIRED, bx, tiles
        return vec, CHANNELS_LAST, bx, tiles
    vec = plan.vec
    while plan.channels_per_group % vec:
        vec //= 2
    if plan.per_sample and override.get("grouped", True) and vec * plan.dtype.itemsize >= tune.grouped_min_vec_bytes:
        bx, tiles = tiling(vec)
        if tiles == 1 or bx % (plan.channels_per_group // vec) == 0:
            return vec, CHANNELS_LAST_GROUPED, bx, tiles
    bx, tiles = tiling(plan.vec)
    if (plan.per_sample and override.get("paired", True) and plan.vec > 1
            and plan.channels_per_group >= plan.vec and tiles == 1):
        return plan.vec, CHANNELS_LAST_PAIRED, bx, tiles
    return plan.vec, CHANNELS_LAST, bx, tiles


def apply_finalizes(plan: ChannelPlan, layout: int, block: tuple, group_partials: int, device: Device,
                    override: dict) -> bool:
    """Whether channel_apply combines each group's partials itself, the
    finalize launch skipped ("channel_folded"): channels-first per-sample
    groups in plane rows (``block`` 2-D) of at most
    tune.channel_apply_finalize_max_members partials. Each row of the
    apply combines its group's, by shuffles; a 256-thread block's combine
    (barriers) at the start of every chunk cost more than the launch it
    saves, and BatchNorm's running estimates need the one finalize.
    ``override``'s "fold" (True or False) decides instead where the layout
    allows it."""
    if layout != CHANNELS_FIRST or not plan.per_sample:
        return False
    if "fold" in override:
        return bool(override["fold"])
    return len(block) == 2 and group_partials <= tuning.of(device).channel_apply_finalize_max_members


def channels_last_blocks(layout: int, threads: int, vec_bytes: int, device: Device, override: dict) -> int:
    """The blocks a channels-last pass of the three launches aims for: at
    most those resident at once, a whole wave (blocks past a wave run as a
    second, whose tail doubled a pass). A statistic a channel
    (CHANNELS_LAST, 108-127 registers a thread in 16-bit) and the paired
    partial (95-127) keep tune.channel_last_blocks_per_sm blocks an SM; a
    statistic a thread
    (grouped) threads whose vectors come to
    tune.channel_last_grouped_bytes_per_sm (more blocks of narrower vectors).
    Measurements: docs/notes/channel-norms.md."""
    tune = tuning.of(device)
    if "blocks_per_sm" in override:
        per_sm = override["blocks_per_sm"]
    elif layout == CHANNELS_LAST_GROUPED:
        # (grouped vectors are at least 8 bytes: at most 1024 threads an SM)
        per_sm = max(1, tune.channel_last_grouped_bytes_per_sm // (threads * vec_bytes))
    else:
        per_sm = tune.channel_last_blocks_per_sm
    return per_sm * device.sm_count


def choose_channels(plan: ChannelPlan, device: Device, *, from_running: bool = False, returns_stats: bool = True,
                    override: dict | None = None) -> Launch:
    """The three-launch walk of cunorm/kernels/channels.cu for ``plan``:
    partial statistics over chunks of the positions, a block per statistic
    group to combine them, then the elementwise epilogue (x read twice);
    the middle launch skipped where apply_finalizes ("channel_folded").
    BatchNorm in eval mode (from_running) needs only the epilogue: one
    launch that reads the running buffers itself, or, where the call
    returns its statistics, channel_from_running first (it writes them).
    ``override`` {"chunks": n} forces the chunks a channel's positions are
    cut into, {"blocks_per_sm": k} the blocks a channels-last pass aims for,
    {"apply_vec": v, "apply_blocks_per_sm": k} the paired apply's vectors
    and blocks an SM, {"fold": bool} whether the apply finalizes (the
    tuning script)."""
    tune = tuning.of(device)
    from .dtypes import KERNEL_TYPE, accumulation

    override = override or {}
    t, p = kernel_types(plan)
    padded = 0  # (Step.padded_threads)
    apply_grid, apply_chunks, apply_chunk_len = None, 0, 0  # (the apply's own tiles: channels-first chunks)
    apply_geometry = None  # (the apply's own (vec, grid, block, padded): channels-last paired)
    if plan.channels_last:
        # A row of threads covers a position's channels (up to 256 vectors),
        # so a block reads whole positions, contiguous: group_norm(32) bf16
        # (8,128,128,512) channels-last, 64-vector rows: bx 32 (half a
        # position a row) ran the two passes at 16.9% of copy bandwidth.
        vec, layout, bx, tiles = channels_last_walk(plan, override, tune)
        blocks = channels_last_blocks(layout, bx * (CHANNEL_BLOCK_THREADS // bx), vec * plan.dtype.itemsize, device,
                                      override)
        block, padded, chunk_len, chunks, grid = channels_last_grid(plan, bx, tiles, blocks, tune,
                                                                    override.get("chunks"))
        by = block[1]
        if layout == CHANNELS_LAST_PAIRED:
            # The apply in its own chunks, of narrower vectors and more
            # blocks an SM (it reads no partial: any vector and grid will
            # do): GroupNorm(32)+SiLU bf16 (16,64,64,320) channels-last,
            # its apply 40.0 -> 33.5 us (docs/notes/channel-norms.md).
            apply_vec = override.get("apply_vec", max(2, min(vec, tune.paired_apply_vec_bytes // plan.dtype.itemsize)))
            if vec % apply_vec:
                raise ValueError(f"vectors of {apply_vec} do not divide the plan's {vec}")
            abx, atiles = channels_last_tiling(plan.channels, apply_vec, override.get("exact_tile", True))
            per_sm = (tune.paired_apply_blocks_per_sm if apply_vec * plan.dtype.itemsize <= tune.paired_apply_vec_bytes
                      else tune.channel_last_blocks_per_sm)  # (channel_apply's launch bounds)
            ablocks = override.get("apply_blocks_per_sm", per_sm) * device.sm_count
            apply_pass = channels_last_grid(plan, abx, atiles, ablocks, tune)
            ablock, apadded, apply_chunk_len, apply_chunks, agrid = apply_pass
            apply_geometry = (apply_vec, agrid, ablock, apadded)
        acc_bytes = accumulation(plan.dtype).itemsize
        kept = {CHANNELS_LAST_GROUPED: 1, CHANNELS_LAST_PAIRED: 2}.get(layout, vec)  # statistics a thread keeps
        partial_shared = by * bx * kept * NORMS["ln"].stat_words * acc_bytes
    elif plan.spatial // plan.vec <= tune.channel_plane_rows_max_vecs:
        vec, layout = plan.vec, CHANNELS_FIRST
        vecs = plan.spatial // plan.vec
        block = plane_rows_block(vecs, CHANNEL_BLOCK_THREADS)
        chunks, chunk_len = 1, vecs
        grid = (1, min(_ceil_div(plan.channels, block[1]), MAX_GRID_Y), min(plan.batch, MAX_GRID_Y))
        partial_shared = 0
    else:
        vec, layout = plan.vec, CHANNELS_FIRST
        vecs = plan.spatial // plan.vec
        block = (CHANNEL_BLOCK_THREADS,)
        rows = plan.batch * plan.channels
        want_chunks = max(1, _ceil_div(tune.channel_blocks_per_sm * device.sm_count, rows))
        most = tune.channel_max_chunk_bytes // (plan.vec * plan.dtype.itemsize)
        chunk_len = max(4 * CHANNEL_BLOCK_THREADS, min(_ceil_div(vecs, want_chunks), most))
        if "chunks" in override:
            chunk_len = _ceil_div(vecs, override["chunks"])
        chunks = _ceil_div(vecs, chunk_len)
        grid = (min(chunks, MAX_GRID_X), min(plan.channels, MAX_GRID_Y), min(plan.batch, MAX_GRID_Y))
        # the apply's own chunks: tiles of about tune.channel_apply_tile_vecs
        apply_chunks, apply_chunk_len = balanced_tiles(vecs, override.get("apply_tile", tune.channel_apply_tile_vecs))
        apply_grid = (min(apply_chunks, MAX_GRID_X), grid[1], grid[2])
        partial_shared = 0
    groups = plan.statistic_groups
    if groups >= 2**31 or plan.channels_per_group * chunks >= 2**31 or plan.channels >= 2**31:
        raise ValueError(f"{plan.norm}_norm: {groups} statistic groups of {plan.channels_per_group} channels "
                         f"is over the kernels' 2**31 - 1 index limit")
    group_partials = (1 if plan.per_sample else plan.batch) * chunks
    if layout not in (CHANNELS_LAST_GROUPED, CHANNELS_LAST_PAIRED):
        group_partials *= plan.channels_per_group
    folded = not from_running and apply_finalizes(plan, layout, block, group_partials, device, override)
    if folded:  # channel_apply, which reads the partials of its own chunks
        apply_grid, apply_chunks, apply_chunk_len = None, 0, 0
    store = K.affine_store(p, plan.flags, output_type(plan))
    if apply_geometry:
        apply_vec, agrid, ablock, apadded = apply_geometry
        apply = Step(K.CHANNEL_APPLY(t, store, apply_vec, layout), agrid, ablock, 0, apadded)
    else:
        apply = Step(K.CHANNEL_APPLY(t, store, vec, layout), apply_grid or grid, block, 0, padded)
    tiles = {"apply_chunks": apply_chunks, "apply_chunk_vecs": apply_chunk_len}
    hints = override.get("hints", channel_apply_hints(plan, device))
    if from_running and not returns_stats:
        return Launch("channel_eval", (apply,), chunks=chunks, chunk_vecs=chunk_len, hints=hints, **tiles)
    if from_running:
        a = KERNEL_TYPE[accumulation(plan.dtype)]
        stats = Step(K.CHANNEL_FROM_RUNNING(a),
                     (_ceil_div(plan.channels, CHANNEL_BLOCK_THREADS),), (CHANNEL_BLOCK_THREADS,))
        return Launch("channel_running", (stats, apply), chunks=chunks, chunk_vecs=chunk_len,
                      workspace_words=3 * groups, hints=hints, **tiles)
    partial = Step(K.CHANNEL_PARTIAL(CHANNEL_NORM, t, vec, layout), grid, block,
                   partial_shared, padded)
    members = plan.batch * plan.channels * chunks
    if folded:
        return Launch("channel_folded", (partial, apply), chunks=chunks, chunk_vecs=chunk_len,
                      workspace_words=3 * members, hints=hints)
    finalize_block, groups_a_block = (CHANNEL_BLOCK_THREADS,), 1
    if group_partials <= tune.channel_finalize_rows_max_members:
        finalize_block = plane_rows_block(group_partials, CHANNEL_BLOCK_THREADS)
        groups_a_block = finalize_block[1]
    # (paired partials are laid out as grouped ones: the grouped finalize)
    finalize = Step(K.CHANNEL_FINALIZE(CHANNEL_NORM, t, CHANNELS_LAST_GROUPED if layout == CHANNELS_LAST_PAIRED
                                       else layout),
                    (min(_ceil_div(groups, groups_a_block), MAX_GRID_X),), finalize_block)
    return Launch("channel_split", (partial, finalize, apply), chunks=chunks, chunk_vecs=chunk_len,
                  workspace_words=3 * (members + groups), hints=hints, **tiles)
