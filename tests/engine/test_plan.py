"""Planning and dispatch: pure functions of shapes, strides and the device (CPU)."""
import numpy as np
import pytest

from cunorm._engine import (catalogue, dispatch_rows, dispatch_channels, dispatch_grad, dtypes, gated_grad, launches,
                            plans, tuning)
from cunorm._engine.plans import canonical_view, collapse, make_plan, normalize_axes, vector_width

H200 = dispatch_rows.Device(sm_count=132)
A100 = dispatch_rows.Device(sm_count=108, compute_capability=80, l2_bytes=40 * 1024 * 1024)


def c_strides(shape):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def plan_for(shape, axis, dtype=dtypes.float32, pdtype=None, strides=None, ptr=0, norm="rms", flags=None,
             residual=False):
    first, last = normalize_axes(axis, len(shape))
    strides = c_strides(shape) if strides is None else strides
    if flags is None:
        flags = 0 if pdtype is None else 1
    return make_plan(norm, np.dtype(dtype), pdtype, flags, residual, tuple(shape), strides, first, last, ptr, 0, 0,
                     0, 0, 0)


def test_normalize_axes():
    assert normalize_axes(-1, 3) == (2, 2)
    assert normalize_axes((2, 1), 4) == (1, 2)
    assert normalize_axes([-1, -2, -3], 3) == (0, 2)


def test_collapse():
    assert collapse((2, 3, 4), (12, 4, 1)) == (24, 1)
    assert collapse((2, 1, 4), (8, 99, 2)) == (8, 2)
    assert collapse((2, 4), (1, 2)) is None
    assert collapse((), ()) == (1, 0)


def test_canonical_rows_and_strided():
    assert canonical_view((8, 16), (16, 1), 1, 1) == (8, 16, 1, 16, 1)
    assert canonical_view((112, 64, 512, 512), c_strides((112, 64, 512, 512)), 1, 1) == (
        112, 64, 262144, 64 * 262144, 262144)
    # row slice: rows every other row
    assert canonical_view((4, 16), (32, 1), 1, 1) == (4, 16, 1, 32, 1)
    # transposed: the reduced axis is not unit-stride and inner is 1: copy
    assert canonical_view((16, 8), (1, 16), 1, 1) is None


def test_vector_width():
    assert vector_width(4, 1024, [1024], [(0, 4), (256, 4)]) == 4
    assert vector_width(2, 1024, [1024], [(0, 2), (0, 4)]) == 8
    assert vector_width(4, 65535, [65535], [(0, 4)]) == 1
    assert vector_width(4, 1024, [1024], [(4, 4)]) == 1  # pointer 4 bytes past alignment
    assert vector_width(2, 4100, [4100], [(0, 2)]) == 4
    assert vector_width(2, 1024, [1024], [(0, 2), (16, 4)]) == 4  # float32 weight aligned to 16 only


def test_short_rows_halve_the_vectors_a_thread_only_when_plain_or_gated_first():
    """Half the target vectors a thread (within 16 lanes) is for plain rows
    and the gate before the norm: a residual, a modulation or the gate
    after the norm keeps the target; LayerNorm's heavier target halves
    too."""
    bf16 = dtypes.bfloat16
    assert dispatch_rows.choose(plan_for((65536, 256), -1, bf16, residual=True), H200).threads_per_row == 8
    assert dispatch_rows.choose(plan_for((65536, 256), -1, bf16), H200).threads_per_row == 16
    assert dispatch_rows.choose(plan_for((65536, 256), -1, bf16, norm="ln"), H200).threads_per_row == 8
    weight = plans.FLAG_WEIGHT
    gated_first = plan_for((131072, 128), -1, bf16, bf16, flags=weight | plans.FLAG_GATE | plans.FLAG_GATE_INPUT)
    assert dispatch_rows.choose(gated_first, H200).threads_per_row == 8  # (4 at the target)
    gated = plan_for((131072, 128), -1, bf16, bf16, flags=weight | plans.FLAG_GATE)
    assert dispatch_rows.choose(gated, H200).threads_per_row == 4
    modulated = plan_for((131072, 128), -1, bf16, bf16, flags=weight | plans.FLAG_SCALE)
    assert dispatch_rows.choose(modulated, H200).threads_per_row == 4


def test_plan_problem_36():
    p = plan_for((112, 64, 512, 512), 1)
    assert (p.outer, p.reduced, p.inner, p.vec) == (112, 64, 262144, 4)
    launch = dispatch_rows.choose(p, H200)
    assert launch.tier == "strided_cached"
    (step,) = launch.steps
    assert step.block == (32, 8) and "strided_norm" in step.kernel.expression
    assert step.kernel.expression.endswith(", 4, 8>")


@pytest.mark.parametrize(
    "rows, n, dtype, tier, threads",
    [
        (32768, 4096, dtypes.bfloat16, "cached", 128),
        (4096, 32768, dtypes.bfloat16, "cached", 512),
        (4096, 16384, dtypes.float32, "cached", 512),
        (4096, 32768, dtypes.float32, "uncached", 0),
        (4096, 65536, dtypes.bfloat16, "uncached", 0),
        (4096, 65536, dtypes.float32, "uncached", 0),
        (65536, 1024, dtypes.float32, "cached", 64),
        (65536, 512, dtypes.float32, "cached", 32),
        # short plain rows: half the vectors a thread within 16 lanes
        (200000, 64, np.float16, "cached", 4),
        (65536, 256, dtypes.bfloat16, "cached", 16),
        (65536, 512, dtypes.bfloat16, "cached", 16),
        (1000, 1, dtypes.float32, "cached", 1),
        (100000, 3, dtypes.float32, "cached", 1),
        (1, 4096, dtypes.bfloat16, "cached", 128),
        (1, 16384, dtypes.bfloat16, "cached", 512),
        (1, 32768, dtypes.bfloat16, "split", 0),
        (1000, 262144, dtypes.float32, "uncached", 0),
        (16, 4 * 1024 * 1024, dtypes.float32, "split", 0),
        (1, 65536, dtypes.float32, "split", 0),
        (4, 64 * 1024 * 1024, dtypes.float32, "split", 0),
    ],
)
def test_rows_tiers(rows, n, dtype, tier, threads):
    launch = dispatch_rows.choose(plan_for((rows, n), -1, dtype), H200)
    assert launch.tier == tier
    if threads:
        assert launch.threads_per_row == threads


def test_resident_chunks_cover_the_row_and_fit():
    p = plan_for((16, 64, 256, 256), (1, 2, 3), norm="ln", flags=3, pdtype=dtypes.float32)
    launch = dispatch_rows.choose(p, H200, override={"tier": "resident"})
    assert launch.tier == "resident"
    (step,) = launch.steps
    assert step.kernel.cooperative and step.grid == (132,) and step.block == (512,)
    assert launch.chunk_vecs * 132 >= p.reduced // p.vec
    assert step.shared_bytes == launch.chunk_vecs * 16 <= H200.max_shared_per_block


def test_split_chunks_are_never_empty():
    """Chunks interleave a block's width of vectors at a time: no more chunks
    than block widths in the row, at least 8 blocks an SM otherwise."""
    p = plan_for((3, 100_000_003), -1)
    launch = dispatch_rows.choose(p, H200)
    assert launch.tier == "split"
    assert launch.chunks == dispatch_rows._ceil_div(8 * 132, 3)
    assert launch.workspace_words == 3 * launch.chunks + 3 * 3  # the partials, then (pivot, center, scale) a row
    short = dispatch_rows.choose(plan_for((4, 70_000), -1), H200)
    assert short.tier == "split" and (short.chunks - 1) * 256 < 70_000 // 4


def test_split_apply_paths():
    """On x of 256 MB or more (1.2 GB here) the split tier finalizes each
    row once, then writes y a tile a block, every row's tile; tiles as even
    as they come, of at least a vector a thread (float32 without
    parameters: split_apply_lean) or four (a residual). Below, or forced,
    the apply combines each row's partials itself over pass 1's chunks."""
    p = plan_for((3, 100_000_003), -1)
    launch = dispatch_rows.choose(p, H200)
    partial, finalize, apply = launch.steps
    assert [s.kernel.name for s in launch.steps] == ["rows_split_partial", "rows_split_finalize",
                                                     "rows_split_apply_tiles"]
    assert finalize.grid == (3,)
    tiles, size, vecs = launch.apply_chunks, launch.apply_chunk_vecs, p.reduced // p.vec
    assert dispatch_rows.split_apply_lean(p)
    assert 256 <= size < 512 and (tiles - 1) * size < vecs <= tiles * size
    assert apply.grid == (3 * tiles,) and apply.block == (256,)
    with_residual = plan_for((3, 100_000_000), -1, residual=True)
    heavy = dispatch_rows.choose(with_residual, H200)
    assert heavy.tier == "split" and not dispatch_rows.split_apply_lean(with_residual)
    assert 1024 <= heavy.apply_chunk_vecs < 2048
    for small, rows in ((dispatch_rows.choose(p, H200, override={"tiles": False}), 3),
                        (dispatch_rows.choose(plan_for((100, 70_000), -1), H200), 100)):
        assert [s.kernel.name for s in small.steps] == ["rows_split_partial", "rows_split_apply"]
        assert small.workspace_words == rows * small.chunks  # the partials alone


def test_uncached_stash_and_peeled_rows():
    """Problem 38/39's rows of 65535 floats start off alignment: x and y
    share it, so the uncached tier walks them in 16-byte vectors after a
    peeled head, keeping as much of each row in shared memory as fits."""
    p = plan_for((32768, 65535), -1, norm="l2")
    assert p.vec == 1 and p.peel_vec == 4
    launch = dispatch_rows.choose(p, H200)
    (step,) = launch.steps
    assert launch.tier == "uncached" and step.kernel.expression.endswith(", 4>") and step.kernel.persistent
    assert step.grid == (132,)
    assert step.shared_bytes == launch.stash_vecs * 16 <= H200.max_shared_per_block - 1024
    # a row of x at another offset than y's (a strided view): no peeling
    q = make_plan("l2", np.dtype(np.float32), None, 0, False, (100, 65535), (65536, 1), 1, 1, 0, 0, 0, 0, 0, 0)
    assert q.peel_vec == 1
    # parameters or a residual: aligned rows only
    assert plan_for((32768, 65535), -1, pdtype=dtypes.float32).peel_vec == 1
    assert plan_for((32768, 65535), -1, residual=True).peel_vec == 1


@pytest.mark.parametrize("shape, axis", [((2, 3, 5), 1), ((4, 100000, 2), 1), ((8, 64, 7, 7), 1), ((5, 2, 1024), (0, 1))])
def test_strided_blocks_within_limits(shape, axis):
    launch = dispatch_rows.choose(plan_for(shape, axis), H200)
    (step,) = launch.steps
    bx, by = step.block
    assert bx * by <= 256 and bx & (bx - 1) == 0
    assert step.grid[0] <= dispatch_rows.MAX_GRID_X and step.grid[1] <= dispatch_rows.MAX_GRID_Y


def test_every_choice_is_compiled():
    """Whatever the dispatch picks over a sweep of shapes is in all_kernels()."""
    compiled = {k.expression for k in catalogue.all_kernels()}
    for norm, info in dispatch_rows.NORMS.items():
        for dtype in dtypes.SUPPORTED:
            acc = dtypes.accumulation(dtype)
            for flags in info.flags:
                for pdtype in ((None,) if not flags else (dtype, acc)):
                    for residual in (False, True) if info.residual else (False,):
                        for n in (1, 3, 8, 760, 1024, 4097, 8192, 32768, 65535, 65536, 300000):
                            for rows in (1, 200, 5000):
                                for shape, axis in (((rows, n), -1), ((rows, n, 5), 1), ((2, n, 64), 1)):
                                    if residual and axis == 1:
                                        continue  # strided residual: h formed first, then no residual
                                    for ptr in (0, 4, 8):
                                        p = plan_for(shape, axis, dtype, pdtype, ptr=ptr * dtype.itemsize // 2,
                                                     norm=norm, flags=flags, residual=residual)
                                        for step in dispatch_rows.choose(p, H200).steps:
                                            assert step.kernel.expression in compiled, step.kernel.expression


def test_random_row_choices_are_compiled():
    """What the row forward's dispatch picks over random row lengths, row
    counts, alignments (vector widths), parameters, residuals and both GPUs
    is in all_kernels(): the catalogue lists rows_cached only for the
    (vectors a thread, block per row) dispatch_rows.row_threads reaches
    (catalogue.cached_reach)."""
    import math
    import random

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    compiled = {k.expression for k in catalogue.all_kernels()}
    tiers = set()
    for _ in range(4000):
        norm = rng.choice(list(dispatch_rows.NORMS))
        info = dispatch_rows.norm_info(norm)
        dtype = np.dtype(rng.choice(list(dtypes.SUPPORTED)))
        flags = rng.choice(list(info.flags))
        pdtype = rng.choice((dtype, np.dtype(dtypes.accumulation(dtype)))) if flags else None
        residual = info.residual and rng.random() < 0.5
        n = max(1, int(math.exp(rng.uniform(0, math.log(70000)))))
        rows = int(math.exp(rng.uniform(0, 12)))
        ptr = rng.choice((0, 2, 4, 8, 16)) * dtype.itemsize // 2
        p = plan_for((rows, n), -1, dtype, pdtype, ptr=ptr, norm=norm, flags=flags, residual=residual)
        launch = dispatch_rows.choose(p, rng.choice((H200, A100)))
        tiers.add(launch.tier)
        for step in launch.steps:
            assert step.kernel.expression in compiled, (seed, step.kernel.expression)
    assert {"cached", "uncached", "split"} <= tiers, (seed, tiers)


def test_float32_output_of_16_bit_layer_norm():
    """LayerNorm of 16-bit rows with a float32 y (autocast's result): the
    plan carries y's dtype, its vector counts y's alignment (16-byte x
    vectors, 32-byte y vectors), rows_cached writes it, and every such choice
    is in all_kernels(); the tiers that cannot write it (and the strided
    axis, a residual) return None, for the caller to cast x first. y's dtype
    equal to x's is the plain plan."""
    compiled = {k.expression for k in catalogue.all_kernels()}
    f32 = np.dtype(np.float32)
    for dtype in (dtypes.bfloat16, dtypes.float16):
        for flags, pdtype in ((0, None), (1, f32), (3, f32), (3, dtype)):
            for n in (8, 96, 384, 760, 768, 4096, 32768):
                for y_ptr in (0, 16):
                    first, last = normalize_axes(-1, 2)
                    p = make_plan("ln", dtype, pdtype, flags, False, (4096, n), (n, 1), first, last, 0, y_ptr, 0, 0,
                                  0, 0, f32)
                    assert p.out_dtype == f32
                    assert p.vec * 4 <= 32 and (y_ptr % (p.vec * 4) == 0)
                    launch = dispatch_rows.choose(p, H200)
                    if launch is None:  # y off 32-byte alignment: narrower vectors, over the register budget
                        assert y_ptr and n == 32768
                        continue
                    assert launch.tier == "cached", (dtype, n)
                    (step,) = launch.steps
                    assert step.kernel.template_args[2].args[-1] == "float", step.kernel.expression
                    assert step.kernel.expression in compiled, step.kernel.expression
        long_rows = make_plan("ln", dtype, None, 0, False, (4, 1 << 20), (1 << 20, 1), 1, 1, 0, 0, 0, 0, 0, 0, f32)
        assert dispatch_rows.choose(long_rows, H200) is None
        strided = make_plan("ln", dtype, None, 0, False, (4, 64, 9), (576, 9, 1), 1, 1, 0, 0, 0, 0, 0, 0, f32)
        assert dispatch_rows.choose(strided, H200) is None
        residual = make_plan("ln", dtype, None, 0, True, (4, 768), (768, 1), 1, 1, 0, 0, 0, 0, 0, 0, f32)
        assert dispatch_rows.choose(residual, H200) is None
    same = make_plan("ln", f32, None, 0, False, (4, 768), (768, 1), 1, 1, 0, 0, 0, 0, 0, 0, f32)
    assert same.out_dtype is None and same == plan_for((4, 768), -1, norm="ln")


def test_residual_and_layernorm_cost_registers():
    """x and r are both live while h is formed, and LayerNorm carries three
    words of statistic: the register budget admits shorter cached rows."""
    def tier(n, **kw):
        launch = dispatch_rows.choose(plan_for((4096, n), -1, dtypes.bfloat16, **kw), H200)
        return launch.tier, launch.steps[0].block

    assert tier(32768) == ("cached", (512,))
    assert tier(32768, norm="ln") == ("cached", (512,))
    assert tier(32768, residual=True)[0] == "uncached"
    assert tier(4096, residual=True) == ("cached", (128,))
    assert tier(4096, norm="ln", residual=True, flags=3, pdtype=dtypes.bfloat16) == ("cached", (256,))
    assert tier(16384, residual=True) == ("cached", (512,))


def test_strided_extent_limit():
    p = plan_for((2, 2**31, 4), 1)
    with pytest.raises(ValueError, match="2\\*\\*31 - 1 limit"):
        dispatch_rows.choose(p, H200)


# --- the channel family ---------------------------------------------------------
from cunorm._engine.plans import channel_layout, channel_orders, dense_order, make_channel_plan  # noqa: E402


def test_channel_layouts():
    shape = (2, 8, 5, 3)
    assert channel_layout(shape, c_strides(shape), 1, True) is False  # NCHW
    nhwc_memory = (120, 1, 24, 8)  # torch channels_last strides of an NCHW shape
    assert channel_layout(shape, nhwc_memory, 1, True) is True
    assert channel_layout((2, 5, 3, 8), c_strides((2, 5, 3, 8)), 3, True) is True
    assert channel_layout(shape, (240, 15, 3, 1), 1, True) is None  # a slice: not dense
    # no spatial extent: both layouts hold; per-sample groups prefer channels-first
    assert channel_layout((4, 6), (6, 1), 1, True) is False
    assert channel_layout((4, 6), (6, 1), 1, False) is True
    assert channel_orders(4, 1) == {False: (0, 1, 2, 3), True: (0, 2, 3, 1)}
    assert dense_order((2, 1, 3), (3, 99, 1), (0, 1, 2))


def channel_plan(norm="group", dtype=dtypes.float32, flags=0, last=False, batch=2, channels=8, spatial=64,
                 cpg=2, ptr=0):
    pdtype = None if not flags else dtype
    return make_channel_plan(norm, np.dtype(dtype), pdtype, flags, last, batch, channels, spatial, cpg,
                             norm != "batch", ptr, 0)


def test_channel_plan_vectors_and_batch_fold():
    assert channel_plan(spatial=49).vec == 1 and channel_plan(spatial=64).vec == 4
    assert channel_plan(last=True, channels=6).vec == 2 and channel_plan(last=True, ptr=4).vec == 1
    p = channel_plan("batch", last=True, batch=3, spatial=10, cpg=1)
    assert (p.batch, p.spatial) == (1, 30)  # BatchNorm channels-last: batch folded into positions
    assert channel_plan().statistic_groups == 8 and channel_plan("batch", cpg=1).statistic_groups == 8


@pytest.mark.parametrize("last", [False, True])
@pytest.mark.parametrize("batch,channels,spatial", [(1, 1, 1), (112, 64, 512 * 512), (8, 512, 128 * 128),
                                                    (3, 70000, 5), (100000, 3, 7)])
def test_channel_launches_cover_and_fit(last, batch, channels, spatial):
    compiled = {k.expression for k in catalogue.all_kernels()}
    for norm, cpg in (("group", 1), ("batch", 1)):
        for flags in (0, 3):
            p = channel_plan(norm, flags=flags, last=last, batch=batch, channels=channels, spatial=spatial, cpg=cpg)
            for from_running, stats in (((False, True), (True, True), (True, False)) if norm == "batch"
                                        else ((False, True),)):
                launch = dispatch_channels.choose_channels(p, H200, from_running=from_running, returns_stats=stats)
                extent = (p.channels if last else p.spatial) // p.vec
                assert launch.chunks * launch.chunk_vecs >= (p.spatial if last else extent)
                for step in launch.steps:
                    assert step.kernel.expression in compiled, step.kernel.expression
                    assert step.grid[0] <= dispatch_rows.MAX_GRID_X and all(g <= dispatch_rows.MAX_GRID_Y for g in step.grid[1:])
                    assert np.prod(step.block) <= 1024 and step.shared_bytes <= 48 * 1024


def test_channels_last_grouped_walk():
    """Channels-last GroupNorm and InstanceNorm take the three launches
    grouped (a statistic a thread: channel_partial's, channel_finalize's and
    channel_apply's LAYOUT 2) where a vector of at least
    grouped_min_vec_bytes divides the groups and a group's vectors lie in one
    tile, with the widest such vector; else paired (LAYOUT 3, a thread keeps
    the statistics of the two groups its vector may straddle; the grouped
    finalize) where the groups are at least the plan's vector wide and a
    position's vectors make one tile; else a statistic per channel (LAYOUT
    1) at the plan's vector. BatchNorm, channels-first x and the overrides
    {"grouped": False, "paired": False} never group. A tile is a position's
    vectors exactly (up to 256), its rows launched as whole warps. The cases
    are tests/engine/test_channel_split_gpu.py's."""
    compiled = {k.expression for k in catalogue.all_kernels()}
    bf16, f32, f64 = (np.dtype(d) for d in (dtypes.bfloat16, np.float32, np.float64))
    cases = {  # (channels, groups) -> (vec, layout) for bf16, float32, float64
        (64, 4): ((8, 2), (4, 2), (2, 2)), (40, 2): ((4, 2), (4, 2), (2, 2)),
        (4096, 16): ((8, 2), (4, 2), (2, 2)), (24, 8): ((8, 1), (4, 1), (1, 2)),
        (6144, 2): ((8, 1), (4, 1), (2, 1)), (32, 32): ((8, 1), (4, 1), (1, 2)), (320, 32): ((8, 3), (2, 2), (2, 2)),
        (1020, 4): ((4, 3), (4, 3), (2, 1)), (72, 8): ((8, 3), (4, 3), (1, 2)), (960, 32): ((8, 3), (4, 3), (2, 1))}
    for (channels, groups), wants in cases.items():
        for dtype, (vec, layout) in zip((bf16, f32, f64), wants):
            p = make_channel_plan("group", dtype, dtype, 3, True, 2, channels, 35, channels // groups, True, 0, 0)
            got = dispatch_channels.channels_last_walk(p, {}, tuning.SM90)
            assert got[:2] == (vec, layout), (channels, groups, dtype, got)
            vecs = channels // vec
            # a tile of exactly a position's vectors (up to 256); on request a power of two
            pow2 = dispatch_channels.channels_last_walk(p, {"exact_tile": False}, tuning.SM90)
            assert pow2[:2] == got[:2] and pow2[2] == min(256, dispatch_rows.next_pow2(vecs))
            assert got[2] == min(vecs, 256) and got[3] == -(-vecs // got[2])
            launch = dispatch_channels.choose_channels(p, H200)
            # launched as whole warps (XLA's launches, the jit path, count
            # threads in warps), the rows padded where a tile's rows are not
            for s in launch.steps:
                assert s.threads % 32 == 0 and np.prod(s.block) <= s.threads <= max(256, np.prod(s.block))
                assert s.threads - np.prod(s.block) < 32 and (s.padded_threads == 0) == (np.prod(s.block) % 32 == 0)
            layouts = [s.kernel.template_args[-1] for s in launch.steps]
            assert layouts == [layout, 2 if layout == 3 else layout, layout]  # (paired partials: grouped finalize)
            assert all(s.kernel.expression in compiled for s in launch.steps)
            partial = launch.steps[0]
            kept = {2: 1, 3: 2}.get(layout, vec)
            assert partial.kernel.template_args[2] == vec
            assert partial.shared_bytes == np.prod(partial.block) * kept * 3 * dtypes.accumulation(dtype).itemsize
            forced = dispatch_channels.choose_channels(p, H200, override={"grouped": False, "paired": False})
            assert forced.steps[0].kernel.template_args[2:] == (p.vec, 1)
            unpaired = dispatch_channels.choose_channels(p, H200, override={"grouped": False})
            pairs = p.vec > 1 and p.channels_per_group >= p.vec and p.channels // p.vec <= 256
            assert unpaired.steps[0].kernel.template_args[2:] == (p.vec, 3 if pairs else 1)
    batch = make_channel_plan("batch", f64, None, 0, True, 4, 16, 35, 1, False, 0, 0)
    assert dispatch_channels.channels_last_walk(batch, {}, tuning.SM90)[:2] == (2, 1)
    first = dispatch_channels.choose_channels(channel_plan(flags=3), H200)
    assert {s.kernel.template_args[-1] for s in first.steps} == {0}


@pytest.mark.parametrize("last", [False, True])
def test_group_norm_float32_output_of_16_bit_x(last):
    """GroupNorm of 16-bit x with a float32 y (autocast's result): the apply
    writes float32 (its vector counting y's 4-byte elements for alignment),
    the statistics passes read x as before, every choice is compiled."""
    compiled = {k.expression for k in catalogue.all_kernels()}
    f32 = np.dtype(np.float32)
    for dtype in (dtypes.bfloat16, dtypes.float16):
        for flags in (0, 1, 3):
            for channels, spatial in ((320, 64 * 64), (640, 32 * 32), (24, 63), (1280, 16 * 16)):
                for y_ptr in (0, 16):
                    p = make_channel_plan("group", dtype, None if not flags else f32, flags, last, 8, channels,
                                          spatial, channels // 8 if channels % 8 == 0 else 1, True, 0, y_ptr, f32)
                    assert p.out_dtype == f32 and y_ptr % (p.vec * 4) == 0
                    launch = dispatch_channels.choose_channels(p, H200)
                    apply = launch.steps[-1].kernel.expression
                    store = launch.steps[-1].kernel.template_args[1]
                    assert "channel_apply" in apply and store.args[-1] == "float", apply
                    for step in launch.steps:
                        assert step.kernel.expression in compiled, step.kernel.expression
    same = make_channel_plan("group", f32, None, 0, last, 2, 8, 64, 2, True, 0, 0, f32)
    assert same.out_dtype is None and same == channel_plan(last=last)


def test_batch_norm_eval_is_one_launch_without_statistics():
    """Eval-mode BatchNorm that returns no statistics: the epilogue alone,
    reading the running buffers (no workspace); returning them, the
    statistics kernel first."""
    p = channel_plan("batch", flags=3, batch=8, channels=64, spatial=56 * 56, cpg=1)
    fused = dispatch_channels.choose_channels(p, H200, from_running=True, returns_stats=False)
    assert fused.tier == "channel_eval" and fused.workspace_words == 0
    names = lambda launch: [s.kernel.expression.split("<")[0] for s in launch.steps]  # noqa: E731
    assert names(fused) == ["cunorm::channel_apply"]
    two = dispatch_channels.choose_channels(p, H200, from_running=True, returns_stats=True)
    assert names(two) == ["cunorm::channel_from_running", "cunorm::channel_apply"]
    assert two.steps[-1] == fused.steps[0]  # the same epilogue launch


def test_channel_rows_fast_path():
    assert dispatch_channels.channel_rows_fast(channel_plan())
    assert not dispatch_channels.channel_rows_fast(channel_plan(flags=1))
    assert not dispatch_channels.channel_rows_fast(channel_plan(last=True))
    assert not dispatch_channels.channel_rows_fast(channel_plan("batch", cpg=1))


def test_small_channels_first_planes_run_as_plane_rows():
    """ResNet-50's late activations, 7x7 and 14x14 fp32 (49 scalars, 49
    vectors a plane): a row of 16 threads a plane (up to 4 items a thread),
    16 planes a block, one chunk, forward and backward alike, and the
    finalize a row of 8 threads for each channel's 32 partials; 28x28 and
    56x56 (196 and 784 vectors) rows of 32; a plane of 3 rows of 1; 64x64
    (1024 vectors) the last plane rows, 72x72 a block a plane."""
    cases = ((49, (16, 16)), (196, (16, 16)), (784, (32, 8)), (3, (1, 256)), (56 * 56, (32, 8)), (64 * 64, (32, 8)),
             (72 * 72, (256,)))
    for spatial, block in cases:
        p = channel_plan("batch", flags=3, batch=32, channels=2048, spatial=spatial, cpg=1)
        fwd = dispatch_channels.choose_channels(p, H200)
        bwd = dispatch_grad.choose_channel_grad(p, True, H200, {"walk": "split"})
        for step in (fwd.steps[0], fwd.steps[2], bwd.steps[0], bwd.steps[-1]):
            assert step.block == block, (spatial, step)
            if len(block) == 2:
                assert step.grid == (1, 2048 // block[1], 32), (spatial, step)
        if len(block) == 2:
            assert fwd.chunks == bwd.chunks == 1
            assert (fwd.steps[1].block, fwd.steps[1].grid) == ((8, 32), (2048 // 32,))


def test_channel_backward_chunks_cap_their_bytes():
    """Problem 35's 1 MB channels (fp32, channels-first) go in chunks of at
    most grad_channel_max_chunk_bytes, both passes on the same grid."""
    plan = channel_plan("group", flags=3, batch=112, channels=64, spatial=512 * 512, cpg=8)
    launch = dispatch_grad.choose_channel_grad(plan, True, H200)
    sums, apply = launch.steps[0], launch.steps[-1]
    assert launch.chunk_len * plan.vec * 4 <= tuning.SM90.grad_channel_max_chunk_bytes
    assert launch.chunks == 512 * 512 * 4 // tuning.SM90.grad_channel_max_chunk_bytes
    assert sums.grid == apply.grid == (launch.chunks, 64, 112)


def test_streamed_backward_parts():
    """Streamed rows cut into parts only where their column tiles make less
    than a wave: 40x40000 fp32 (40 tiles) is cut, its partials added 16
    bytes of columns a thread; problem 40 (4096 tiles) and 8x1M bf16 (512)
    are not."""
    f32, bf16 = np.dtype(np.float32), np.dtype(dtypes.bfloat16)
    launch = dispatch_grad.choose_rows_grad("ln", f32, f32, 3, 40, 40000, 1, 4, H200)
    assert launch.tier == "streamed" and launch.parts > 1
    assert dispatch_grad.column_sum_step("float", "float", launch.parts, 40000, 2).kernel.expression.endswith(", 4>")
    for dtype, rows, n, vec in ((f32, 16, 64 * 256 * 256, 4), (bf16, 8, 1 << 20, 8)):
        launch = dispatch_grad.choose_rows_grad("ln", dtype, dtype, 3, rows, n, 1, vec, H200)
        assert launch.tier == "streamed" and launch.parts == 1


def test_channel_backward_grids_stay_within_the_launch_limits():
    """A channel backward over more than 65535 samples or channels (or
    channel tiles) caps its grid's y and z at 65535, as the forward does
    (the kernels walk the rest by grid stride), every layout and tier;
    the grid is the same for both passes (the four launches forced where
    channel_grad_onchip would take the call)."""
    cases = [dict(batch=70000, channels=4, spatial=3), dict(batch=3, channels=70000, spatial=3),
             dict(batch=70000, channels=4, spatial=3, last=True), dict(batch=2, channels=70000 * 8, spatial=3,
                                                                       last=True),
             dict(batch=70000, channels=2, spatial=64 * 64 * 4), dict(batch=2, channels=70000, spatial=64 * 64 * 4)]
    for case in cases:
        plan = channel_plan("batch", flags=3, cpg=1, **case)
        launch = dispatch_grad.choose_channel_grad(plan, True, H200, {"walk": "split"})
        sums, apply = launch.steps[0], launch.steps[-1]
        assert sums.grid == apply.grid, case
        for step in launch.steps:
            assert all(0 < g <= dispatch_rows.MAX_GRID_Y for g in step.grid[1:]), (case, step.grid)
            launches.check_limits(step)


@pytest.mark.parametrize("name", ["lp:0x1;}", "lp:4008000000000000ull>::Policy; struct X {", "lp:ABCDEF0123456789",
                                  "lp:400800000000000", "lp:40080000000000000", "lp: 4008000000000000", "rms ", "",
                                  "lp:4008000000000000\n"])
def test_norm_names_reach_kernel_names_only_as_cunorms_numbers(name):
    """A norm name that is not a known norm or exactly power_norm_name's
    form is refused; a general p's digits are parsed and formatted again,
    so nothing a caller passes becomes part of a kernel name."""
    with pytest.raises(ValueError, match="unknown norm"):
        dispatch_rows.norm_info(name)
    p3 = dispatch_rows.norm_info(dispatch_rows.power_norm_name(3.0))
    assert p3.policy == "cunorm::PowerNorm<0x4008000000000000ull>::Policy"


def test_channel_walks():
    """Groups channel_onchip holds go on chip (16-bit data only up to
    ONCHIP_MAX_GROUP_BYTES_16BIT), except row norms in disguise (GroupNorm
    and InstanceNorm without parameters, channels-first) of groups the row
    family keeps on chip; bigger row norms are rows; with parameters,
    channel_stream for x larger than L2 that it takes, the three launches
    otherwise (channels-last, BatchNorm, x within L2)."""
    big = dict(batch=112, channels=64, spatial=512 * 512)  # problem 35: 7.5 GB
    walk = dispatch_channels.choose_channel_walk
    assert walk(channel_plan(cpg=8, **big), H200) == "rows"
    assert walk(channel_plan(flags=3, cpg=8, **big), H200) == "stream"
    assert walk(channel_plan(flags=3, cpg=8, last=True, **big), H200) == "split"
    assert walk(channel_plan("batch", flags=3, cpg=1, **big), H200) == "split"
    assert walk(channel_plan("instance", cpg=1, **big), H200) == "onchip"  # problem 34: 1 MB groups
    assert walk(channel_plan("instance", cpg=1, **big), A100) == "rows"  # (no clusters before sm_90)
    assert walk(channel_plan("instance", cpg=1, batch=4, channels=64, spatial=128 * 128), H200) == "rows"  # 64 KB
    assert walk(channel_plan("instance", flags=3, cpg=1, batch=4, channels=64, spatial=128 * 128), H200) == "onchip"
    assert walk(channel_plan("batch", flags=3, cpg=1, batch=64, channels=2048, spatial=49), H200) == "onchip"
    assert walk(channel_plan("batch", flags=3, cpg=1, batch=64, channels=256, spatial=56 * 56), H200) == "split"
    small = dict(flags=3, batch=8, channels=320, spatial=64 * 64, cpg=10)  # 160 KB fp32 groups, 42 MB
    assert walk(channel_plan(**small), H200) == "onchip"
    assert walk(channel_plan(dtype=dtypes.bfloat16, **small), H200) == "split"  # 80 KB of 16-bit data
    assert walk(channel_plan(dtype=dtypes.bfloat16, **dict(small, channels=640, spatial=32 * 32)), H200) == "onchip"
    odd = channel_plan(flags=3, cpg=8, batch=112, channels=64, spatial=511 * 511)  # no 16-byte vectors
    assert not dispatch_channels.stream_fits(odd, H200) and walk(odd, H200) == "split"
    huge_groups = channel_plan(flags=3, cpg=64, **big)  # 64 MB groups: not resident when re-read
    assert not dispatch_channels.stream_fits(huge_groups, H200)


def test_channel_onchip_shapes():
    """The first of ONCHIP_SHAPES that holds a group; clusters only from
    sm_90; float64 at half the elements a thread; channels-last only for
    per-sample groups of whole vectors; the overrides checked against the
    group."""
    shape = dispatch_channels.onchip_shape
    bn = dict(flags=3, cpg=1, batch=64)
    assert shape(channel_plan("batch", channels=2048, spatial=49, **bn), H200) == (256, 16, 1)  # 3136 scalars
    assert shape(channel_plan("batch", channels=512, spatial=28 * 28, **bn), H200) == (256, 8, 8)  # 50176: vec 4
    assert shape(channel_plan("batch", channels=256, spatial=56 * 56, **bn), H200) == (1024, 8, 8)
    assert shape(channel_plan("batch", channels=256, spatial=56 * 56, **bn), A100) is None
    assert shape(channel_plan("batch", channels=64, spatial=512 * 512, **bn), H200) is None  # problem 33
    assert shape(channel_plan("batch", dtype=dtypes.float64, channels=2048, spatial=49, **bn), H200) == (512, 16, 1)
    assert shape(channel_plan("instance", cpg=1, batch=2, channels=4, spatial=512 * 512), H200) == (1024, 8, 8)
    assert shape(channel_plan(last=True, cpg=16, batch=8, channels=512, spatial=64 * 64), H200) == (256, 8, 8)
    assert shape(channel_plan(last=True, cpg=2, batch=8, channels=512, spatial=64 * 64), H200) is None  # vec 4
    assert shape(channel_plan("batch", last=True, cpg=1, batch=8, channels=512, spatial=64), H200) is None
    plan = channel_plan(batch=2, channels=8, spatial=64, cpg=2)  # 128 floats a group
    assert shape(plan, H200, {"threads": 32, "elements": 4, "cluster": 1}) == (32, 1, 1)
    assert shape(plan, H200, {"threads": 16, "elements": 4, "cluster": 1}) is None  # 64 < 128
    assert shape(plan, H200, {"threads": 32, "elements": 2, "cluster": 1}) == (32, 1, 1)  # (a vector at least)
    assert shape(plan, H200, {"threads": 32, "elements": 4, "cluster": 2}) == (32, 1, 2)
    launch = dispatch_channels.choose_channel_onchip(plan, H200)
    assert launch.tier == "channel_onchip" and launch.steps[0].grid == (8,) and launch.steps[0].block == (256,)


def test_channel_onchip_picks_are_catalogued():
    """Every channel_onchip instantiation the walk takes, over dtypes,
    parameter and output dtypes, layouts and group sizes, is in
    all_kernels(); on sm_80 none is clustered."""
    compiled = {k.expression: k for k in catalogue.all_kernels()}
    f32 = np.dtype(np.float32)
    taken = 0
    for dtype in (dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64):
        mixed = ((1, f32, None), (3, f32, f32)) if np.dtype(dtype).itemsize == 2 else ()  # (autocast's)
        for flags, pdtype, out in ((0, None, None), (3, dtype, None), (1, dtype, None)) + mixed:
            for norm, last, batch, channels, spatial, cpg in (
                    ("batch", False, 64, 2048, 49, 1), ("batch", False, 64, 512, 28 * 28, 1),
                    ("batch", False, 64, 64, 1024, 1),
                    ("group", False, 8, 1280, 16 * 16, 40), ("group", False, 8, 320, 64 * 64, 10),
                    ("group", True, 8, 1280, 16 * 16, 40), ("group", True, 4, 512, 64 * 64, 16),
                    ("instance", False, 2, 8, 512 * 512, 1), ("instance", False, 4, 8, 33 * 33, 1)):
                p = make_channel_plan(norm, np.dtype(dtype), pdtype, flags, last, batch, channels, spatial, cpg,
                                      norm != "batch", 0, 0, out)
                for device in (H200, A100):
                    if dispatch_channels.choose_channel_walk(p, device) != "onchip":
                        continue
                    kernel = dispatch_channels.choose_channel_onchip(p, device).steps[0].kernel
                    assert kernel.expression in compiled, kernel.expression
                    assert compiled[kernel.expression].min_arch <= device.compute_capability
                    taken += 1
    assert taken > 100


def test_channel_grad_onchip_walk():
    """BatchNorm's backward on channels-first x goes on chip for channels of
    up to grad_onchip_max_elements, the first shape of grad_onchip_shapes
    that holds a channel (clusters on sm_90 only, one launch, a cluster a
    channel); GroupNorm, InstanceNorm, channels-last and larger channels
    keep the four launches; every instantiation taken is catalogued."""
    compiled = {k.expression: k for k in catalogue.all_kernels()}
    f32 = np.dtype(np.float32)
    cases = {  # (batch, spatial) -> (threads, vectors a thread, cluster) on H200 for float32
        (64, 49): (256, 16, 1), (128, 49): (256, 32, 1), (64, 196): (1024, 4, 1), (32, 784): (256, 4, 8),
        (64, 784): (256, 8, 8), (32, 56 * 56): (1024, 4, 8), (64, 56 * 56): None}
    want_16bit = {(64, 49): (256, 32, 1), (128, 49): (256, 32, 1), (64, 196): (1024, 4, 1)}  # bf16: to 16384
    taken = 0
    for (batch, spatial), want in cases.items():
        for dtype in (dtypes.bfloat16, dtypes.float32, dtypes.float64):
            for flags, pdtype in ((0, None), (3, dtype), (1, f32 if dtype != np.float64 else dtype)):
                p = make_channel_plan("batch", np.dtype(dtype), pdtype, flags, False, batch, 64, spatial, 1, False, 0,
                                      0)
                for device in (H200, A100):
                    for training in (True, False):
                        launch = dispatch_grad.choose_channel_grad(p, training, device)
                        shape = dispatch_grad.grad_onchip_shape(p, device)
                        if dtype == np.float32 and device is H200:
                            assert shape == want, (batch, spatial)
                        if dtype == dtypes.bfloat16 and device is H200:
                            assert shape == want_16bit.get((batch, spatial)), (batch, spatial)
                        if shape is None:
                            assert launch.tier == "channels" and len(launch.steps) == 4
                            continue
                        threads, items, cluster = shape
                        assert device.compute_capability >= 90 or cluster == 1
                        assert threads * items * cluster * p.vec >= batch * spatial
                        (step,) = launch.steps
                        assert launch.tier == "channel_onchip"
                        assert step.grid == (64 * cluster,) and step.block == (threads,)
                        assert step.kernel.expression in compiled, step.kernel.expression
                        assert compiled[step.kernel.expression].min_arch <= device.compute_capability
                        taken += 1
    assert taken > 50
    for plan in (channel_plan("group", flags=3, cpg=2, batch=2, channels=8, spatial=49),
                 channel_plan("instance", flags=3, cpg=1, batch=2, channels=8, spatial=49),
                 channel_plan("batch", flags=3, cpg=1, batch=2, channels=8, spatial=49, last=True)):
        assert dispatch_grad.choose_channel_grad(plan, True, H200).tier == "channels"
        with pytest.raises(ValueError, match="channel_grad_onchip does not take"):
            dispatch_grad.choose_channel_grad(plan, True, H200, {"walk": "onchip"})


def test_channel_stream_schedule():
    """Problem 35's 8 MB groups: one a slab; 32 KB tiles would need a lag of
    3 slabs (24 MB between the reads, over a third of L2), so 16 KB tiles
    and a lag of 2. Instance norm (4,128,512,512): 12 groups of 1 MB a slab,
    32 KB tiles, lag 1."""
    p35 = dispatch_channels.choose_channel_stream(channel_plan(flags=3, cpg=8, batch=112, channels=64, spatial=512 * 512),
                                                  H200)
    s = p35.stream
    assert (p35.chunk_vecs, p35.chunks, s.slab_tiles, s.lag) == (1024, 512, 512, 2)
    assert p35.hints == tuning.SM90.stream_hints and p35.steps[0].kernel.persistent
    assert p35.workspace_words == 112 * 8 * 512 * 3 + 3 * 112 * 8
    inst = dispatch_channels.choose_channel_stream(channel_plan("instance", flags=3, cpg=1, batch=4, channels=128,
                                                                spatial=512 * 512), H200)
    s = inst.stream
    assert (inst.chunk_vecs, inst.chunks, s.slab_tiles, s.lag) == (2048, 32, 12 * 32, 1)
    forced = dispatch_channels.choose_channel_stream(channel_plan(flags=3, cpg=8, batch=2, channels=16, spatial=64),
                                                     H200, {"tile_vecs": 3, "slab_bytes": 1, "lag": 5, "hints": 0})
    s = forced.stream
    assert (forced.chunk_vecs, forced.chunks, s.slab_tiles, s.lag, forced.hints) == (3, 43, 43, 5, 0)


def test_channels_last_passes_are_one_wave():
    """The three launches on channels-last x cut a sample's positions into
    chunks whose blocks fill one wave at most: two blocks an SM for a
    statistic a channel or two (paired), and for a statistic a thread as
    many as bring the block's vectors to channel_last_grouped_bytes_per_sm
    (a block of 160 threads of 8-byte vectors: six); chunks of at least
    channel_last_min_chunk_rows positions a row of threads. The paired
    layout's apply takes its own chunks: vectors of paired_apply_vec_bytes
    at paired_apply_blocks_per_sm."""
    tune = tuning.SM90
    bf16 = dtypes.bfloat16
    cases = {  # (batch, spatial, channels) -> (grid, chunk positions, the apply's grid and chunk or None)
        # 10 channels a group: paired, 40 x 6 threads; the apply 80 x 3 of 8-byte vectors, 3 blocks an SM
        (16, 64 * 64, 320): ((16, 1, 16), 256, ((24, 1, 16), 171)),
        (8, 64 * 64, 320): ((33, 1, 8), 125, ((49, 1, 8), 84)),
        (2, 64 * 64, 320): ((86, 1, 2), 48, ((171, 1, 2), 24)),  # (not 132 chunks: at least 8 positions a row of 6)
        (2, 64 * 64, 960): ((128, 1, 2), 32, ((196, 1, 2), 21)),  # 30 a group: 120 x 2 threads, the apply 240 x 1
        (8, 64 * 64, 640): ((98, 1, 8), 42, None),  # grouped: 8-byte vectors, 160 x 1 threads: 6 blocks an SM
        (8, 128 * 128, 512): ((33, 1, 8), 497, None),  # 16-byte vectors, 64 x 4 threads: 2 blocks an SM
        (2, 32 * 32, 1280): ((128, 1, 2), 8, None)}  # 16-byte vectors, 160 threads: 3 an SM, chunks of 8 positions
    for (batch, spatial, channels), (grid, chunk, apply) in cases.items():
        p = channel_plan(dtype=bf16, flags=3, last=True, batch=batch, channels=channels, spatial=spatial,
                         cpg=channels // 32)
        launch = dispatch_channels.choose_channels(p, H200)
        assert (launch.steps[0].grid, launch.chunk_vecs) == (grid, chunk), (batch, spatial, channels)
        for step, per_sm in ((launch.steps[0], 2048), (launch.steps[-1], 768 if apply else 2048)):
            assert np.prod(step.grid) * step.threads <= per_sm * 132
        assert launch.chunk_vecs >= tune.channel_last_min_chunk_rows * launch.steps[0].block[1]
        if apply is None:
            assert launch.steps[-1].grid == grid and launch.apply_chunks == 0
        else:
            assert (launch.steps[-1].grid, launch.apply_chunk_vecs) == apply and launch.apply_chunks == apply[0][0]
            assert launch.steps[-1].kernel.template_args[2:] == (4, 3) and launch.steps[0].kernel.template_args[2:] == (8, 3)
            assert launch.apply_chunk_vecs >= tune.channel_last_min_chunk_rows * launch.steps[-1].block[1]
    forced = dispatch_channels.choose_channels(
        channel_plan(dtype=bf16, flags=3, last=True, batch=8, channels=640, spatial=64 * 64, cpg=20), H200,
        override={"blocks_per_sm": 2, "vec": 4})
    assert forced.steps[0].grid == (33, 1, 8) and forced.steps[0].kernel.template_args[2:] == (4, 1)
    for bad in ({"vec": 3}, {"apply_vec": 16}):
        with pytest.raises(ValueError, match="do not divide"):
            dispatch_channels.choose_channels(channel_plan(dtype=bf16, flags=3, last=True, channels=320, cpg=10),
                                              H200, override=bad)


def test_channels_first_apply_finalizes_plane_rows():
    """Channels-first per-sample groups in plane rows of at most
    channel_apply_finalize_max_members partials skip the finalize launch
    (two launches, no affine workspace); 256-thread chunks, larger groups
    and BatchNorm keep it; "fold" forces either way."""
    bf16 = dtypes.bfloat16

    def launch(norm="group", batch=16, channels=320, spatial=64 * 64, cpg=10, **override):
        p = channel_plan(norm, dtype=bf16, flags=3, batch=batch, channels=channels, spatial=spatial, cpg=cpg)
        return dispatch_channels.choose_channels(p, H200, override=override)

    folded = launch()
    assert folded.tier == "channel_folded" and len(folded.steps) == 2
    assert folded.steps[1].block == (32, 8) and folded.workspace_words == 3 * 16 * 320
    assert launch(channels=1280, spatial=32 * 32, cpg=40, batch=2).tier == "channel_folded"  # 40 partials
    assert launch(cpg=320).tier == "channel_split"  # 320 partials a group
    assert launch(spatial=128 * 128).steps[0].block == (256,)  # 256-thread chunks
    assert launch(spatial=128 * 128).tier == "channel_split"
    assert launch(spatial=128 * 128, fold=True).tier == "channel_folded"
    assert launch(fold=False).tier == "channel_split"
    assert launch("batch", cpg=1, fold=True).tier == "channel_split"  # running estimates: one finalize
    assert dispatch_channels.choose_channels(
        channel_plan(dtype=bf16, flags=3, last=True, batch=16, channels=320, spatial=64 * 64, cpg=10), H200,
        override={"fold": True}).tier == "channel_split"


def test_channels_first_apply_tiles():
    """Past plane rows the apply walks its own tiles of 1024-2047 vectors
    (the partial keeps chunks of up to channel_max_chunk_bytes); a folded
    apply keeps the partial's chunks, whose partials it reads."""
    p33 = channel_plan("batch", flags=3, batch=64, channels=64, spatial=512 * 512, cpg=1)
    launch = dispatch_channels.choose_channels(p33, H200)
    partial, _, apply = launch.steps
    assert launch.chunk_vecs * 16 == tuning.SM90.channel_max_chunk_bytes and partial.grid == (4, 64, 64)
    assert (launch.apply_chunks, launch.apply_chunk_vecs) == (64, 1024) and apply.grid == (64, 64, 64)
    # a plane of 1568 vectors: one tile (a second of 544 vectors idled most of its block)
    resnet = channel_plan("batch", dtype=dtypes.bfloat16, flags=3, batch=32, channels=64, spatial=112 * 112, cpg=1)
    launch = dispatch_channels.choose_channels(resnet, H200)
    assert (launch.apply_chunks, launch.apply_chunk_vecs) == (1, 1568) and launch.steps[-1].grid == (1, 64, 32)
    eval_mode = dispatch_channels.choose_channels(p33, H200, from_running=True, returns_stats=False)
    assert eval_mode.tier == "channel_eval" and eval_mode.steps[0].grid == (64, 64, 64)
    gn = channel_plan("group", dtype=dtypes.bfloat16, flags=3, batch=8, channels=512, spatial=128 * 128, cpg=16)
    folded = dispatch_channels.choose_channels(gn, H200, override={"fold": True, "chunks": 2})
    assert folded.tier == "channel_folded" and folded.apply_chunks == 0
    assert folded.steps[1].grid == folded.steps[0].grid == (2, 512, 8)
    assert dispatch_channels.choose_channels(gn, H200, override={"apply_tile": 300}).apply_chunk_vecs == 342


def test_channel_apply_hints():
    """Streaming stores always; last-use re-reads for x of L2's size to 8x."""
    def hints(batch):
        p = channel_plan("batch", flags=3, batch=batch, channels=256, spatial=56 * 56, cpg=1)
        return dispatch_channels.choose_channels(p, H200).hints
    assert hints(1) == 1  # 3 MB
    assert hints(64) == 3  # 205 MB (ResNet-50's (64,256,56,56))
    assert hints(1024) == 1  # 3.3 GB


def test_long_rows_backward_on_clusters():
    """Rows longer than a block holds take rows_grad_cached on clusters on
    sm_90 (the fewest blocks of GRAD_CACHED_CLUSTER_THREADS that hold a
    row, a cluster a row, never cooperative: column_sum adds the partials)
    when their clusters fill the SMs; on sm_80, or with few rows, they
    stream. Rows a block holds keep one block, cooperative."""
    bf16, f32 = np.dtype(dtypes.bfloat16), np.dtype(np.float32)
    threads = dispatch_grad.GRAD_CACHED_CLUSTER_THREADS
    for dtype, n, vec in ((bf16, 32768, 8), (f32, 16384, 4), (bf16, 20000, 8)):
        launch = dispatch_grad.choose_rows_grad("rms", dtype, dtype, 1, 4096, n, 1, vec, H200)
        (step,) = launch.steps
        kernel = step.kernel
        assert launch.tier == "cached" and kernel.cluster > 1 and not kernel.cooperative and kernel.min_arch == 90
        assert step.block[0] <= threads and step.grid == (4096 * kernel.cluster,)
        vpt = kernel.template_args[5]
        assert kernel.cluster * step.block[0] * vpt * vec >= n  # the cluster holds the row ...
        assert (kernel.cluster // 2) * threads * vpt * vec < n  # ... and half of it would not
        assert dispatch_grad.choose_rows_grad("rms", dtype, dtype, 1, 4096, n, 1, vec, A100).tier == "streamed"
        few = 132 // kernel.cluster - 1
        assert dispatch_grad.choose_rows_grad("rms", dtype, dtype, 1, few, n, 1, vec, H200).tier == "streamed"
    launch = dispatch_grad.choose_rows_grad("ln", bf16, bf16, 3, 4096, 4096, 1, 8, H200)
    assert launch.steps[0].kernel.cluster == 1 and launch.steps[0].kernel.cooperative
    assert dispatch_grad.choose_rows_grad("ln", bf16, bf16, 3, 4096, 1 << 20, 1, 8, H200).tier == "streamed"


def test_short_rows_backward_share_blocks():
    """Rows of at most 64 threads share 256-thread blocks of rows_grad_cached
    (a row a slot: a part of a warp below 32 vectors, the power of two at or
    above), launched at its own bounds, the grid a block per 256 // slot rows;
    longer rows, and rows whose threads do not divide the block, keep a
    block each."""
    bf16, f32 = np.dtype(dtypes.bfloat16), np.dtype(np.float32)
    tune = tuning.of(H200)
    share = dispatch_grad.grad_cached_rows_a_block
    assert share(16, 32, 1, tune) == (16, 16)
    assert share(5, 32, 1, tune) == (8, 32)
    assert share(1, 32, 1, tune) == (1, 256)
    assert share(32, 32, 1, tune) == (32, 8)
    assert share(64, 64, 1, tune) == (64, 4)
    assert share(96, 96, 1, tune) == (96, 1)  # (more than 64 threads)
    assert share(128, 128, 1, tune) == (128, 1)
    for dtype, n, vec, row_threads in ((bf16, 128, 8, 16), (bf16, 256, 8, 32), (bf16, 512, 8, 64), (f32, 40, 4, 16)):
        launch = dispatch_grad.choose_rows_grad("ln", dtype, dtype, 3, 1001, n, 1, vec, H200)
        (step,) = launch.steps
        assert launch.tier == "cached" and launch.row_threads == row_threads and step.block == (256,)
        assert step.kernel.template_args[-3:] == (*dispatch_grad.grad_cached_multi_row_bounds(tune), 1)
        assert step.grid == (-(-1001 // (256 // row_threads)),) and step.kernel.cooperative
        assert step.shared_bytes == dispatch_grad.grad_cached_shared_bytes(3, vec, 256, 1, 4)
    launch = dispatch_grad.choose_rows_grad("ln", bf16, bf16, 3, 1001, 1024, 1, 8, H200)
    assert launch.row_threads == 128 and launch.steps[0].block == (128,)
    assert launch.steps[0].kernel.template_args[-1] == 0 and launch.steps[0].grid == (1001,)


def test_every_backward_choice_is_compiled():
    """Whatever the row backward's dispatch picks over a sweep of norms,
    dtypes, parameters, vector widths and row lengths (clusters included)
    is in all_kernels()."""
    compiled = {k.expression for k in catalogue.all_kernels()}
    clustered = 0
    for norm in dispatch_grad.GRAD_NORMS:
        for dtype in dtypes.SUPPORTED:
            dtype = np.dtype(dtype)
            for flags in dispatch_rows.norm_info(norm).flags:
                pdtype = dtype if flags else None
                for vec in (1, 2, 16 // dtype.itemsize):
                    for n in (vec, vec * 8, 512, 4096, 8192 + vec, 16384, 32768, 40000 * vec, 65536):
                        n -= n % vec
                        for device in (H200, A100):
                            launch = dispatch_grad.choose_rows_grad(norm, dtype, pdtype, flags, 4096, n, 1, vec,
                                                                    device)
                            for step in launch.steps:
                                assert step.kernel.expression in compiled, step.kernel.expression
                                clustered += step.kernel.cluster > 1
    assert clustered > 50


def test_random_row_backward_choices_are_compiled():
    """What the row backward's dispatch picks (rows_grad_cached, the gated
    and the float32 stream's) over random row lengths, row counts, vector
    widths, parameter counts and both GPUs is in all_kernels(): the
    catalogue lists the largest block's bounds only for the vectors a
    thread that block can take."""
    import math
    import random

    from cunorm._engine import wide_grad

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    compiled = {k.expression for k in catalogue.all_kernels()}
    for _ in range(4000):
        dtype = np.dtype(rng.choice(list(dtypes.SUPPORTED)))
        vec = rng.choice([v for v in (1, 2, 4, 8) if v * dtype.itemsize <= 16])
        n = max(vec, int(math.exp(rng.uniform(0, math.log(70000)))) // vec * vec)
        rows, cooperative, heads = int(math.exp(rng.uniform(0, 12))), rng.random() < 0.7, rng.choice((1, 1, 2, 8))
        device = rng.choice((H200, A100))
        kind = rng.choice(("plain", "gated", "wide"))
        if kind == "plain":
            norm = rng.choice(list(dispatch_grad.GRAD_NORMS))
            flags = rng.choice(list(dispatch_rows.norm_info(norm).flags))
            pdtype = rng.choice((dtype, np.dtype(dtypes.accumulation(dtype)))) if flags else None
            launch = dispatch_grad.choose_rows_grad(norm, dtype, pdtype, flags, rows, n, 1, vec, device, cooperative,
                                                    heads)
        elif kind == "gated":
            flags = rng.choice((0, plans.FLAG_WEIGHT))
            pdtype = rng.choice((dtype, np.dtype(dtypes.accumulation(dtype)))) if flags else None
            gate = rng.choice((dispatch_grad.GATE_OUTPUT, dispatch_grad.GATE_INPUT))
            launch = dispatch_grad.choose_rows_grad_gated(dtype, pdtype, flags, rows, n, vec, gate, device,
                                                          cooperative, heads)
        else:
            if dtype.itemsize != 2:
                continue
            norm = rng.choice(("rms", "ln"))
            flags = rng.choice(list(dispatch_rows.norm_info(norm).flags))
            pdtype = rng.choice((dtype, np.dtype(np.float32))) if flags else None
            try:
                launch = wide_grad.choose(norm, dtype, pdtype, flags, rows, n, vec, device, cooperative, heads)
            except ValueError:  # (a row over the stream's limit)
                continue
        for step in (launch.steps if launch is not None else ()):
            assert step.kernel.expression in compiled, (seed, step.kernel.expression)


def test_strided_backward_tiers():
    """A strided axis whose groups a thread can hold runs the one-pass
    strided_grad_cached, its vector narrowed to fit, its shape the same at
    every outer extent (dx's bits follow the group alone), its grid at most
    the resident blocks; longer reduced extents run the three passes."""
    f32, bf16 = np.dtype(np.float32), np.dtype(dtypes.bfloat16)
    compiled = {k.expression for k in catalogue.all_kernels()}
    # problem 36's backward: 64 channels of 512 x 512 planes
    launch = dispatch_grad.choose_rows_grad("rms", f32, f32, 1, 56, 64, 262144, 4, H200)
    assert launch.tier == "strided_cached"
    (step,) = launch.steps
    assert step.block == (32, 8) and step.kernel.expression.endswith(", 1, 2, 8>")
    assert launch.parts == step.grid[0] * step.grid[1] <= 2 * H200.sm_count
    step = dispatch_grad.choose_rows_grad("ln", bf16, f32, 3, 56, 64, 262144, 8, H200).steps[0]
    assert step.block == (32, 8) and step.kernel.expression.endswith(", 3, 4, 8>")
    for dtype, vec in ((f32, 4), (bf16, 8), (np.dtype(np.float64), 2)):
        for reduced, inner in ((3, 760), (24, 40), (64, 4096), (200, 48), (256, 64)):
            shapes = set()
            for outer in (1, 2, 7, 300, 5000):
                launch = dispatch_grad.choose_rows_grad("ln", dtype, dtype, 3, outer, reduced, inner, vec, H200)
                assert launch.tier == "strided_cached", (dtype, reduced, inner)
                (step,) = launch.steps
                assert step.kernel.expression in compiled
                assert step.grid[1] <= outer and step.grid[0] * step.grid[1] <= 2 * H200.sm_count
                shapes.add((step.kernel.expression, step.block, step.shared_bytes))
            assert len(shapes) == 1, shapes
        assert dispatch_grad.choose_rows_grad("rms", dtype, dtype, 1, 8, 3000, vec, vec, H200).tier == "strided"


def test_canonical_strides_free_the_size_1_axes():
    """A size-1 axis's stride is free: canonical_strides gives it the C
    value, so a C-contiguous view compares equal to a fresh array of its
    shape whatever it carried there (x[:, -1:, :] of a (1, 37, 4096))."""
    from cunorm._engine.plans import canonical_strides, same_layout

    assert canonical_strides((1, 1, 4096), (151552, 4096, 1)) == (4096, 4096, 1)
    assert canonical_strides((1, 1, 4096), (303104, 8192, 2), 2) == (8192, 8192, 2)
    assert canonical_strides((4, 1, 3), (3, 999, 1)) == (3, 3, 1)
    assert canonical_strides((4, 3), (6, 2)) == (6, 2)  # nothing to free: as given
    assert canonical_strides((2, 1), (16, 7), 4) == (16, 4)  # the last axis: the item size
    assert canonical_strides((1,), (-8,), 8) == (8,)
    for shape in [(1,), (1, 1), (3, 1, 5, 1), (1, 7, 1, 1, 2)]:
        c = np.empty(shape, np.float32)
        weird = np.lib.stride_tricks.as_strided(c, shape, [s if n > 1 else 12345 * 4 for s, n in
                                                           zip(c.strides, shape)])
        assert canonical_strides(shape, weird.strides, 4) == c.strides
        assert same_layout(shape, weird.strides, c.strides)
    assert not same_layout((2, 3), (12, 4), (24, 8))


def test_modulated_backward_plan():
    """The fused modulated backward's plan: units of at least UNIT_MIN_ROWS
    rows that cover each run, cut by the run length and the GPU alone (the
    same for any number of runs: batch invariance); None for runs of
    under UNIT_MIN_ROWS rows (per token; taken with min_run=1, as a shard
    of a partitioned call) and rows whose sums pass the shared memory
    allowed."""
    plan = dispatch_grad.modulated_plan
    for run_rows in (16, 17, 512, 4096, 32768):
        cuts = {plan(run_rows * batch, 3072, 8, 2, run_rows, batch, 132) for batch in (1, 2, 8)}
        assert len({(p.units_per_run, p.unit_rows) for p in cuts}) == 1
        p = cuts.pop()
        assert p.units_per_run * p.unit_rows >= run_rows > (p.units_per_run - 1) * p.unit_rows
        assert p.unit_rows >= dispatch_grad.UNIT_MIN_ROWS and p.units_per_run <= 2 * 132
    # units of about UNIT_ROWS rows where that still gives every SM one (runs of 4096 on 132 SMs), of 16
    # where the run is shorter, at most 2 x SMs of them where it is longer
    cut = {run: (p.units_per_run, p.unit_rows) for run in (512, 4096, 32768)
           for p in [plan(run * 8, 3072, 8, 2, run, 8, 132)]}
    assert cut == {512: (32, 16), 4096: (128, 32), 32768: (263, 125)}
    one = plan(300, 1024, 8, 2, 1, 1, 132)  # one modulation row for all: one run
    assert one.mod_div == 300
    assert plan(4096, 1024, 8, 2, 1, 4096, 132) is None  # per token
    shard = plan(64, 1024, 8, 2, 8, 8, 132, min_run=1)  # a shard's runs of 8 rows (jit's partitioned lowering)
    assert shard is not None and shard.unit_rows * shard.units_per_run >= 8
    # rows_grad_cached's blocks: 256 threads of up to 4 vectors, then 512 of 4 within MODULATED_MAX_SHARED
    shapes = {n: (p.threads, p.vpt, p.max_threads, p.min_blocks)
              for n in (1152, 3072, 4096, 8192) for p in [plan(64, n, 8, 2, 64, 1, 132)]}
    assert shapes == {1152: (160, 1, 256, 3), 3072: (192, 2, 256, 3), 4096: (256, 2, 256, 3), 8192: (256, 4, 256, 2)}
    assert plan(64, 16384, 8, 2, 64, 1, 132) is None  # P and Q would take 128 KB
    gated = plan(64, 8192, 8, 2, 64, 1, 132, gate=True)  # (2 vectors a thread, 128 registers; P, Q and G: 96 KB)
    assert (gated.threads, gated.vpt, gated.max_threads, gated.min_blocks) == (512, 2, 512, 1)
    gated = plan(64, 3072, 8, 2, 64, 1, 132, gate=True)
    assert (gated.threads, gated.vpt, gated.max_threads, gated.min_blocks) == (192, 2, 256, 2)
    assert plan(64, 8192, 2, 8, 64, 1, 132) is None and plan(64, 4096, 2, 8, 64, 1, 132).threads == 512
    for gate in (False, True):
        for n in range(8, 16385, 8):
            p = plan(64, n, 8, 2, 64, 1, 132, gate=gate)
            assert p is None or p.sums_shared_bytes(4, gate) <= dispatch_grad.MODULATED_MAX_SHARED


def test_every_modulated_backward_choice_is_compiled():
    """Whatever the fused modulated backward launches over norms, dtypes,
    parameter sets and dtypes, modulations (shift alone, scale, the gate,
    both), the gradients asked for and row lengths is in all_kernels()
    (cunorm.precompile builds it ahead)."""
    from cunorm._engine import modulated_grad

    compiled = {k.expression for k in catalogue.all_kernels()}
    D = dispatch_grad
    for norm, norm_flags in (("rms", (0, 1)), ("ln", (0, 1, 2, 3))):
        for dtype in dtypes.SUPPORTED:
            dtype = np.dtype(dtype)
            for pdtype in {dtype, np.dtype(dtypes.accumulation(dtype))}:
                for flags in norm_flags:
                    for modf in (0, D.MOD_SCALE, D.MOD_GATE, D.MOD_SCALE | D.MOD_GATE):
                        given = (D.OUT_SCALE if modf & D.MOD_SCALE else 0) | (D.OUT_GATE if modf & D.MOD_GATE else 0)
                        for outs in {given | D.OUT_SHIFT} | ({given} if given else set()):
                            for n, vec in ((1152, 16 // dtype.itemsize), (3072, 1), (8192 // dtype.itemsize, 2)):
                                p = D.modulated_plan(8 * 512, n, vec, dtype.itemsize, 512, 8, 132,
                                                     bool(modf & D.MOD_GATE))
                                if p is None:
                                    continue
                                for step in modulated_grad.steps(p, norm, dtype, pdtype, flags, modf, outs, 8 * 512, n):
                                    assert step.kernel.expression in compiled, step.kernel.expression


def step_vpt(launch) -> int:
    """The vectors a thread of a cached launch's kernel (its VPT)."""
    kernel = launch.steps[0].kernel
    decl = {d.name: d for d in (dispatch_grad.K.ROWS_GRAD_CACHED, dispatch_grad.K.ROWS_GRAD_GATED)}[kernel.name]
    return kernel.template_args[decl.template.index("VPT")]


def test_the_gated_backward_takes_the_plain_rows_shape_and_is_catalogued():
    """rows_grad_gated takes rows_grad_cached's block for the same rows (a
    block a row, or several short rows a block) where that holds at most
    gated_max_vpt vectors a thread, never a cluster: None past what one
    block holds. Every pick is in all_kernels()."""
    compiled = {k.expression for k in catalogue.all_kernels()}
    for device in (H200, A100):
        for dtype in (np.dtype(dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)):
            for weighted in (False, True):
                pdtype, flags = (np.dtype(np.float32) if dtype.itemsize < 8 else dtype, 1) if weighted else (None, 0)
                for n in (64, 100, 128, 1000, 1152, 4096, 8188, 8192, 8196, 16380, 16384, 32768):
                    vec = plans.vector_width(dtype.itemsize, n, [], [])
                    for rows in (1, 4096):
                        plain = dispatch_grad.choose_rows_grad("rms", dtype, pdtype, flags, rows, n, 1, vec, device)
                        capped = dispatch_grad.gated_max_vpt(vec, dtype.itemsize)
                        for gate in (dispatch_grad.GATE_OUTPUT, dispatch_grad.GATE_INPUT):
                            got = dispatch_grad.choose_rows_grad_gated(dtype, pdtype, flags, rows, n, vec, gate,
                                                                       device)
                            fits = dispatch_grad.grad_cached_shape(n // vec, vec, dtype.itemsize,
                                                                   tuning.of(device), max_vpt=capped)
                            assert (got is not None) == (fits is not None), (dtype, n, rows)
                            if got is None:
                                continue
                            assert step_vpt(got) <= capped and step_vpt(got) == fits[1], (dtype, n)
                            assert got.steps[0].kernel.expression in compiled, got.steps[0].kernel.expression
                            if plain.tier != "cached" or plain.steps[0].kernel.cluster > 1 or step_vpt(plain) > capped:
                                continue  # (the plain backward streams, clusters or holds more a thread)
                            (step,), (ref,) = got.steps, plain.steps
                            assert (step.grid, step.block, step.shared_bytes, got.row_threads) == \
                                (ref.grid, ref.block, ref.shared_bytes, plain.row_threads)
                            assert step.kernel.name == "rows_grad_gated" and step.kernel.template_args[4] == gate
                            assert step.kernel.template_args[5:] == ref.kernel.template_args[4:]
                            assert step.kernel.cooperative == ref.kernel.cooperative
    assert gated_grad.fits(16384, 2) and not gated_grad.fits(16385, 2) and not gated_grad.fits(32768, 2)
    assert gated_grad.fits(8188, 2) and not gated_grad.fits(16380, 2)  # (8-byte vectors: 16 elements a thread)
    assert gated_grad.fusable((4, 7, 1152), 2, 2, 2) and not gated_grad.fusable((4, 7, 1152), 2, 1, 1)
    # (the whole normalized span: 64 x 512 elements do not fit one block)
    assert gated_grad.fusable((4, 64, 128), 2, 1, 2) and not gated_grad.fusable((4, 64, 512), 2, 1, 2)


def test_parameters_per_head_take_a_block_a_row():
    """heads > 1 (a weight per head or group): rows_grad_cached's (and
    rows_grad_gated's) block a row, never several rows a block or a cluster
    (a block's rows must be of one head), the same kernel otherwise; None
    where no block holds a row. Every pick is in all_kernels()."""
    compiled = {k.expression for k in catalogue.all_kernels()}
    bf16, f32 = np.dtype(dtypes.bfloat16), np.dtype(np.float32)
    for device in (H200, A100):
        for n in (64, 128, 512, 1024, 4096, 16384, 32768):
            vec = plans.vector_width(2, n, [], [])
            for heads in (2, 8, 1000):
                got = dispatch_grad.choose_rows_grad("rms", bf16, f32, 1, 4096 * heads, n, 1, vec, device,
                                                     heads=heads)
                gated = dispatch_grad.choose_rows_grad_gated(bf16, f32, 1, 4096 * heads, n, vec,
                                                             dispatch_grad.GATE_OUTPUT, device, heads=heads)
                plain = dispatch_grad.choose_rows_grad("rms", bf16, f32, 1, 4096 * heads, n, 1, vec, device)
                for launch in (got, gated):
                    if launch is None:
                        continue
                    (step,) = launch.steps
                    assert launch.tier == "cached" and step.kernel.cluster == 1, n
                    assert step.kernel.template_args[-1] == 0 and launch.row_threads == step.block[0], n
                    assert step.kernel.expression in compiled, step.kernel.expression
                assert (got is None) == (plain.tier != "cached" or plain.steps[0].kernel.cluster > 1), n
                assert (gated is None) == (n > 16384), n
