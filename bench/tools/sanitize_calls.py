"""One call of every kernel, forward and backward, on small shapes: the
program compute-sanitizer runs (bench/tools/sanitize.sh, each of memcheck,
racecheck, initcheck and synccheck).

CuPy's memory pool is off, so each array is its own cudaMalloc and memcheck
sees an access past any of them. Every kernel declaration of
cunorm/_engine/declarations.py must have been loaded by the end (the script fails
naming any that was not), so a new kernel cannot go unsanitized. Exit
status 0 when every call ran and every declaration was reached.
"""
from __future__ import annotations

import sys

import cupy
import numpy as np

import cunorm
from cunorm import backward
from cunorm._engine import channel_norms, dtypes, gradients, declarations, launches, loader, row_norms, sync_batch

reached: set[str] = set()
_load = loader.get_function


def _recording(family, expression, device=None, cooperative=False):
    reached.add(expression.split("<", 1)[0].removeprefix("cunorm::"))
    return _load(family, expression, device, cooperative)


def main() -> int:
    loader.get_function = _recording
    cupy.cuda.set_allocator(None)  # no pool: an array is its own allocation
    rng = np.random.default_rng(0)

    def arr(*shape, dtype=np.float32):
        return cupy.asarray(rng.standard_normal(shape).astype(dtype))

    bf16 = dtypes.bfloat16
    x, w, b, r = arr(64, 1024), arr(1024), arr(1024), arr(64, 1024)
    long_rows = arr(2, 1 << 17)
    nchw, c8 = arr(2, 8, 5, 7), arr(8)
    nhwc = cupy.ascontiguousarray(nchw.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)

    # the row tiers: the dispatch's own choice, then each forced (the split tier both ways)
    y, h, mean, rstd = cunorm.layer_norm(x, w, b, residual=r, return_stats=True)
    cunorm.rms_norm(arr(64, 1000, dtype=bf16), arr(1000, dtype=bf16))
    xs, ws, rs = arr(64, 256), arr(256), arr(64, 256)
    for override in ({"tier": "cached", "threads": 32}, {"tier": "cached", "threads": 256}, {"tier": "uncached"},
                     {"tier": "split"}, {"tier": "split", "tiles": True}, {"tier": "resident"}):
        row_norms.launch_on("ln", xs, cupy.empty_like(xs), w=ws, b=ws, r=rs, h=cupy.empty_like(xs), first=1, last=1,
                            eps=1e-5, override=override)
    # strided axes: registers, then two sweeps; the residual added unfused there
    cunorm.rms_norm(arr(2, 64, 33), axis=1)
    cunorm.rms_norm(arr(2, 600, 40), arr(600), axis=1, residual=arr(2, 600, 40))
    row_norms.launch_on("rms", arr(3, 300, 40), cupy.empty((3, 300, 40), np.float32), first=1, last=1, eps=1e-5,
                        override={"tier": "uncached"})
    for p in (1, 2, 3.0, np.inf):
        cunorm.normalize(x, p)
    cunorm.mean_abs_normalize(x)
    cunorm.frobenius_normalize(long_rows)
    # the channel norms, both layouts, training and eval
    cunorm.group_norm(nchw, 4, c8, c8, return_stats=True)
    cunorm.instance_norm(nhwc, c8, c8)
    # channel_stream, forced small: many tiles a group, slabs of one group, lag 2
    stream_x = arr(3, 8, 5, 8)
    call = channel_norms.ChannelCall("group", stream_x, num_groups=4, weight=c8, bias=c8, eps=1e-5, channel_axis=1,
                                     return_stats=True)
    channel_norms.execute(call, *channel_norms.prepare(call),
                          override={"walk": "stream", "tile_vecs": 3, "slab_bytes": 1, "lag": 2})
    # channel_onchip (the default for these small groups) and, forced, the three launches and the two whose
    # apply finalizes (plane rows); clusters of 4 blocks of 32 threads, three of them empty
    for override in ({"walk": "split", "fold": False}, {"walk": "split", "fold": True},
                     {"walk": "onchip", "threads": 32, "elements": 4, "cluster": 4}):
        call = channel_norms.ChannelCall("group", stream_x, num_groups=4, weight=c8, bias=c8, eps=1e-5, channel_axis=1,
                                         return_stats=True)
        channel_norms.execute(call, *channel_norms.prepare(call), override=override)
    # the apply finalizing in 256-thread chunks (block_reduce's barriers), forced
    call = channel_norms.ChannelCall("group", arr(1, 4, 64, 80), num_groups=2, weight=arr(4), bias=arr(4), eps=1e-5,
                                     channel_axis=1, return_stats=True)
    channel_norms.execute(call, *channel_norms.prepare(call), override={"walk": "split", "fold": True, "chunks": 3})
    # the three launches on channels-last x: grouped (a statistic a thread), paired and per channel, positions in
    # 3 chunks
    unpaired = {"walk": "split", "chunks": 3, "grouped": False, "paired": False}
    for override in ({"walk": "split", "chunks": 3}, {"walk": "split", "chunks": 3, "grouped": False}, unpaired):
        call = channel_norms.ChannelCall("group", nhwc, num_groups=2, weight=c8, bias=c8, eps=1e-5, channel_axis=1,
                                         return_stats=True)
        channel_norms.execute(call, *channel_norms.prepare(call), override=override)
    # ... blocks padded to whole warps: 12 rows of 20 vectors (grouped; the paired apply) and 25 rows of 10
    # (paired, vectors straddling groups of 10; per channel), of 256
    wide_nhwc, c40 = arr(2, 5, 7, 40), arr(40)
    for override in ({"walk": "split", "chunks": 3}, {"walk": "split", "chunks": 3, "grouped": False}, unpaired):
        call = channel_norms.ChannelCall("group", wide_nhwc, num_groups=4, weight=c40, bias=c40, eps=1e-5,
                                         channel_axis=-1, return_stats=True)
        channel_norms.execute(call, *channel_norms.prepare(call), override=override)
    cunorm.batch_norm(nchw, c8, c8, running_mean=cupy.zeros(8, np.float32), running_var=cupy.ones(8, np.float32))
    cunorm.batch_norm(nhwc, c8, c8, running_mean=cupy.zeros(8, np.float32), running_var=cupy.ones(8, np.float32))
    for stats in (False, True):  # eval: one launch, or the running buffers' statistics first
        cunorm.batch_norm(nchw, c8, c8, running_mean=cupy.zeros(8, np.float32), running_var=cupy.ones(8, np.float32),
                          training=False, return_stats=stats)

    # backward: cached rows, streamed long rows, a strided axis, the channel norms
    cunorm.layer_norm_backward(arr(64, 1024), h, mean, rstd, w, b)
    _, long_rstd = cunorm.rms_norm(long_rows, arr(1 << 17), return_stats=True)
    cunorm.rms_norm_backward(arr(2, 1 << 17), long_rows, long_rstd, arr(1 << 17))
    # rows a block cannot hold, on clusters of two blocks (sm_90): more rows than resident clusters, so a
    # cluster walks two rows (both statistic slots); the last block's slice short
    if int(cupy.cuda.Device().compute_capability) >= 90:
        wide = arr(140, 20000, dtype=bf16)
        _, w_mean, w_rstd = cunorm.layer_norm(wide, arr(20000, dtype=bf16), arr(20000, dtype=bf16), return_stats=True)
        cunorm.layer_norm_backward(arr(140, 20000, dtype=bf16), wide, w_mean, w_rstd, arr(20000, dtype=bf16),
                                   arr(20000, dtype=bf16))
    strided = arr(4, 64, 48)
    _, s_mean, s_rstd = cunorm.layer_norm(strided, arr(64), arr(64), axis=1, return_stats=True)
    cunorm.layer_norm_backward(arr(4, 64, 48), strided, s_mean, s_rstd, arr(64), arr(64), axis=1)
    cunorm.normalize_backward(arr(64, 1024), x, np.inf)
    for norm, layout in (("group", nchw), ("batch", nhwc)):
        extra = (4,) if norm == "group" else ()
        _, m, s = getattr(cunorm, f"{norm}_norm")(layout, *extra, c8, c8, return_stats=True)
        getattr(cunorm, f"{norm}_norm_backward")(arr(2, 8, 5, 7), layout, m, s, *extra, c8, c8)
    cunorm.batch_norm_backward(arr(2, 8, 5, 7), nchw, cupy.zeros(8, np.float32), cupy.ones(8, np.float32), c8, c8,
                               training=False)
    # BatchNorm's backward on channels-first x: channel_grad_onchip (the default for these small channels) forced
    # to clusters of 4 blocks of 32 threads (the last empty), and the four launches forced
    _, m, s = cunorm.batch_norm(nchw, c8, c8, return_stats=True)
    for override in ({"walk": "split"}, {"walk": "onchip", "threads": 32, "elements": 1, "cluster": 4}):
        g = gradients.ChannelGradCall("batch", arr(2, 8, 5, 7), nchw, m, s, weight=c8, bias=c8, channel_axis=1)
        gradients.run_channels(g, None, override=override)
    # ... and in 256-thread chunks (planes over 1024 vectors), its partial sums combined a warp a channel
    planes = arr(2, 8, 64, 80)
    _, m, s = cunorm.batch_norm(planes, c8, c8, return_stats=True)
    g = gradients.ChannelGradCall("batch", arr(2, 8, 64, 80), planes, m, s, weight=c8, bias=c8, channel_axis=1)
    gradients.run_channels(g, None, override={"walk": "split"})
    # a strided axis too long for a thread's share: sums, finalize, apply
    tall = arr(2, 100000, 4)
    _, t_mean, t_rstd = cunorm.layer_norm(tall, arr(100000), arr(100000), axis=1, return_stats=True)
    cunorm.layer_norm_backward(arr(2, 100000, 4), tall, t_mean, t_rstd, arr(100000), arr(100000), axis=1)
    # the conditioned backwards: gated (the gate after and before the norm), modulated (shift, scale and the
    # gated residual), the float32 residual stream
    gx, gz, gw = arr(64, 256, dtype=bf16), arr(64, 256, dtype=bf16), arr(256, dtype=bf16)
    for before in (True, False):
        _, g_rstd = cunorm.rms_norm(gx, gw, gate=gz, norm_before_gate=before, return_stats=True)
        backward.rms_norm_gated_backward(arr(64, 256, dtype=bf16), gx, g_rstd, gw, gate=gz, norm_before_gate=before)
    mx, mr = arr(2, 40, 384), arr(2, 40, 384)
    mod = {k: arr(2, 1, 384) for k in ("shift", "scale", "residual_gate")}
    _, mh, m_mean, m_rstd = cunorm.layer_norm(mx, arr(384), arr(384), residual=mr, **mod, return_stats=True)
    backward.layer_norm_modulated_backward(arr(2, 40, 384), mh, m_mean, m_rstd, arr(384), arr(384), **mod, x=mx,
                                           dh=arr(2, 40, 384))
    wx, wr = arr(64, 512, dtype=bf16), arr(64, 512)
    _, wh, w_rstd = cunorm.rms_norm(wx, arr(512, dtype=bf16), residual=wr, return_stats=True)
    backward.rms_norm_float32_residual_backward(arr(64, 512, dtype=bf16), wh, w_rstd, arr(512, dtype=bf16),
                                                dh=arr(64, 512))
    # SyncBatchNorm's programs over one rank: the count and statistics block, then the combine and the apply
    device = cupy.cuda.runtime.getDevice()
    stream, alloc = launches.cupy_stream(), launches.cupy_alloc
    block = cupy.zeros(10 * 8, np.float32)  # (3, C) this rank's, (1, 3, C) gathered, (4, C) global
    stats = sync_batch.statistics_program(nchw.dtype, False, nchw.shape, nchw.data.ptr % 32, device)
    stats.run_named({"x": nchw, "count_row": block[:8], "mean": block[8:16], "rstd": block[16:24]}, stream, alloc)
    block[24:48] = block[:24]
    sync_y = cupy.empty_like(nchw)
    apply = sync_batch.apply_program(nchw.dtype, nchw.dtype, 3, False, nchw.shape, nchw.data.ptr % 32,
                                     sync_y.data.ptr % 32, 1, 1e-5, 0.1, True, device)
    apply.run_named({"x": nchw, "y": sync_y, "w": c8, "b": c8, "gathered": block[24:48],
                     "buffer_mean": cupy.zeros(8, np.float32), "buffer_var": cupy.ones(8, np.float32),
                     "running_mean": block[48:56], "running_var": block[56:64], "global_rstd": block[64:72],
                     "count": block[72:80]}, stream, alloc)
    cupy.cuda.Device().synchronize()

    missing = sorted({d.name for d in declarations.DECLARATIONS} - reached)
    print(f"{len(reached)} kernels reached: {', '.join(sorted(reached))}")
    if missing:
        print(f"not reached (add a call): {', '.join(missing)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
