"""The dispatch's tuned thresholds: one frozen Tuning per GPU architecture.

Each field is a choice the dispatch makes by measurement rather than by
what the hardware or the compiler allows (those are facts beside the code
that uses them: block shapes a kernel declares, register budgets set by
ptxas's spill reports). The numbers behind each value, and the runs that
set it, are in docs/notes/tuning.md. The values were measured on sm_90
(H100, H200); sm_80, sm_86 and sm_89 take them unchanged until measured
there.

The dispatch reads the Tuning of the device it plans for (``of(device)``);
the catalogue, which enumerates instantiations without a device, the one
of the architecture it compiles for (``for_arch``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Tuning:
    """The tuned thresholds of one architecture (docs/notes/tuning.md)."""

    name: str
    # --- rows (dispatch_rows.py) ---
    #: vectors a rows_cached thread aims to hold ...
    target_vecs_per_thread: int = 4
    #: ... and for heavy statistics (LayerNorm, float64), whose speed
    #: follows the bytes each SM has in flight
    target_vecs_per_thread_heavy: int = 8
    #: ... and for rows held in float32 under 16-bit x (the gate before the
    #: norm: x * silu(z); the float32 residual stream: x + r), twice x's
    #: registers, on rows of at least formed_min_vecs vectors: with the gate
    #: at 4, 91-112 registers a thread kept one block an SM; at 2, rows of
    #: 512 and 1024 bf16 ran 1.04x and 1.3x faster, rows of 144 and 384
    #: 1.06-1.12x slower (docs/notes/conditioned.md)
    target_vecs_per_thread_formed: int = 2
    formed_min_vecs: int = 64
    #: rows_cached's block before a thread takes more vectors
    preferred_max_row_threads: int = 512
    #: rows of more than one lane (no residual, quantized y or per-row
    #: operand but the gate before the norm) that a group of at most this
    #: many lanes holds at half the target vectors a thread take it: RMSNorm
    #: fp16 200000x64 55.0 -> 63.5%, bf16 262144x128 79.0 -> 81.7%,
    #: LayerNorm bf16 131072x256 64.9 -> 69.6%, 262144x128 61.2 -> 71.3%;
    #: at 32 lanes RMSNorm bf16 65536x512 lost, 81.3 -> 79.9% (H200,
    #: docs/notes/rows.md "Short rows"). The gate after the norm keeps the
    #: target: over heads of 128 at 4 lanes against 8, 32768 tokens 4-9%
    #: faster, 4096 tokens within 2% but hidden 1152 (7% slower) (H200;
    #: 8 lanes had been 2-4% faster on an H100, docs/notes/conditioned.md
    #: "Heads of 128 at four lanes")
    short_row_max_lanes: int = 16
    #: the split tier takes rows of at least this many bytes ...
    split_min_row_bytes: int = 64 * 1024
    #: ... when there are fewer rows than this many an SM ...
    split_max_rows_per_sm: int = 1
    #: ... with this many blocks an SM in each pass
    split_blocks_per_sm: int = 8
    #: ... its apply in tiles (rows_split_finalize, then
    #: rows_split_apply_tiles: in blocks' order, tiles sweep memory as a
    #: copy kernel does) of at least this many vectors a block (four a
    #: thread) where it cannot run a vector a thread
    #: (dispatch_rows.split_apply_lean); 512 and 2048-4096 ran slower ...
    split_apply_tile_vecs: int = 1024
    #: ... on x of at least this many bytes; below, two launches, the apply
    #: combining each row's partials itself (rows_split_finalize's launch
    #: cost 1.4-3 us on x of 64 KB to 28 MB; the tiles won on 268 MB and
    #: 7.5 GB; between, not measured)
    split_tiles_min_bytes: int = 256 << 20
    #: rows_uncached's persistent grid: blocks an SM (0: a block a row) ...
    uncached_blocks_per_sm: int = 1
    #: ... and the bytes of a row it stashes in shared memory (capped by what fits)
    uncached_stash_bytes: int = 1 << 30
    #: the unfused residual add (a strided axis): blocks an SM
    residual_add_blocks_per_sm: int = 8
    # --- channel norms (dispatch_channels.py) ---
    #: the three launches: blocks a pass aims for, an SM ...
    channel_blocks_per_sm: int = 8
    #: ... channels-first chunks of at most this many bytes ...
    channel_max_chunk_bytes: int = 256 * 1024
    #: ... the apply in its own tiles of at least this many vectors a
    #: block (fewer than twice as many): in blocks' order, tiles sweep
    #: memory as a copy kernel does, where the partial's chunks, a stream a
    #: block, kept it at 91-93% of copy bandwidth ...
    channel_apply_tile_vecs: int = 1024
    #: ... channels-last passes of a statistic a channel (and the paired
    #: partial) aiming for this many blocks an SM (those resident: one
    #: wave) ...
    channel_last_blocks_per_sm: int = 2
    #: ... those of a statistic a thread (grouped) for threads whose
    #: vectors come to this many bytes an SM ...
    channel_last_grouped_bytes_per_sm: int = 8192
    #: ... and a channels-last chunk at least this many positions a row of
    #: threads
    channel_last_min_chunk_rows: int = 8
    #: channels-last groups go grouped (a statistic a thread) with vectors
    #: of at least this many bytes
    grouped_min_vec_bytes: int = 8
    #: the paired layout's apply (its own chunks): vectors of this many
    #: bytes, at this many blocks an SM (one wave at its 72 registers)
    paired_apply_vec_bytes: int = 8
    paired_apply_blocks_per_sm: int = 3
    #: channels-first planes of at most this many vectors run as plane rows
    channel_plane_rows_max_vecs: int = 1024
    #: statistic groups of at most this many partials finalize as rows
    channel_finalize_rows_max_members: int = 256
    #: channels-first per-sample groups in plane rows of at most this many
    #: partials are finalized by channel_apply's rows, the finalize launch
    #: skipped
    channel_apply_finalize_max_members: int = 128
    #: channel_apply re-reads x with last-use hints for x up to this many
    #: times L2's size (from L2's size on)
    channel_apply_hints_max_x_l2_share: int = 8
    #: channel_stream: tiles of this many bytes ...
    stream_tile_bytes: int = 32 * 1024
    #: ... slabs of whole groups of about this share of L2 ...
    stream_slab_l2_share: float = 0.25
    #: ... a ticket a resident block, this many blocks an SM ...
    stream_blocks_per_sm: int = 4
    #: ... at most this share of L2 between a group's two reads (else tiles
    #: of half the size) ...
    stream_max_reread_l2_share: float = 1 / 3
    #: ... its L2 hints (as channel_apply's) ...
    stream_hints: int = 3
    #: ... and groups of at most this share of L2
    stream_max_group_l2_share: float = 0.25
    #: BatchNorm goes on chip for channels of at most this many elements
    onchip_max_batch_group_elements: int = 65536
    #: a row norm in disguise stays in the row family up to this many bytes a group
    rows_max_group_bytes: int = 128 * 1024
    # --- backward passes (dispatch_grad.py) ---
    #: rows_grad_cached's preferred block ...
    grad_cached_target_threads: int = 256
    #: ... the blocks an SM its launch bounds ask for ...
    grad_cached_target_min_blocks: int = 3
    #: ... whether a block fetches its next row into L2 meanwhile ...
    grad_cached_prefetch_next: bool = True
    #: ... and rows of at most grad_cached_multi_row_max_row_threads
    #: threads share blocks of grad_cached_multi_row_threads, a row a part,
    #: at grad_cached_multi_row_min_blocks blocks an SM (64 registers): rows
    #: of 64-256 bf16 elements 2.5-4x faster; rows of 128 threads lost
    #: (RMSNorm bf16 65536x1024 80.6 -> 74.9%, H200)
    grad_cached_multi_row_threads: int = 256
    grad_cached_multi_row_max_row_threads: int = 64
    grad_cached_multi_row_min_blocks: int = 4
    #: the streaming passes: blocks a pass aims for, an SM
    grad_blocks_per_sm: int = 8
    #: pass 2 of streamed rows: column-tile blocks an SM (one wave)
    grad_apply_blocks_per_sm: int = 3
    #: pass 1 of streamed rows (rows_grad_chunks): blocks an SM
    grad_chunk_blocks_per_sm: int = 12
    #: the channel backward's channels-first chunks hold at most this many
    #: bytes of x (None: a pass aims at grad_blocks_per_sm alone)
    grad_channel_max_chunk_bytes: int | None = 16 << 10
    #: a pass-1 chunk is at least this many vectors a thread
    grad_min_chunk_per_thread: int = 4
    #: BatchNorm's backward goes on chip for channels of at most this many
    #: elements, 32- and 64-bit data ...
    grad_onchip_max_elements: int = 131072
    #: ... and 16-bit data
    grad_onchip_max_elements_16bit: int = 16384


#: sm_90 (H100, H200): where every value was measured
SM90 = Tuning("sm_90")
#: sm_80, sm_86, sm_89: sm_90's values, not measured there
SM80 = replace(SM90, name="sm_80")
SM86 = replace(SM90, name="sm_86")
SM89 = replace(SM90, name="sm_89")

#: the Tuning of each compute capability cunorm plans for
BY_ARCH = {80: SM80, 86: SM86, 89: SM89, 90: SM90}


def for_arch(arch: int) -> Tuning:
    """The Tuning of compute capability ``arch`` (80, 86, 89, 90): that of
    the newest architecture in BY_ARCH at or below it."""
    known = [a for a in BY_ARCH if a <= arch]
    if not known:
        raise ValueError(f"cunorm plans for compute capability 8.0 or newer, got {arch / 10:.1f}")
    return BY_ARCH[max(known)]


def of(device) -> Tuning:
    """The Tuning of the device the dispatch plans for (a dispatch Device)."""
    return for_arch(device.compute_capability)
