"""Tuning sweep of the backward passes' knobs, floor% against the copy
bandwidth of the same run, plus the time of each launch of one call (a
1 GB fill before it, as in the benchmark):

- rows_grad_cached on bf16 32768x4096 (RMSNorm, LayerNorm): the preferred
  block (tuning.grad_cached_target_threads) and the blocks an SM its launch bounds
  ask for (tuning.grad_cached_target_min_blocks) x the next row fetched into L2
  ahead or not (tuning.grad_cached_prefetch_next);
- rows_grad_cluster (rows a block cannot hold) against the streamed rows:
  the most blocks a cluster and threads a block (GRAD_CACHED_MAX_CLUSTER,
  GRAD_CACHED_CLUSTER_THREADS; a shape that cannot hold the row streams)
  x the next row fetched ahead or not;
- the streamed rows (problem 40, LayerNorm bf16 4096x32768): the blocks an
  SM of pass 1 (tuning.grad_chunk_blocks_per_sm), and their launches;
- the streamed rows' pass 2 on few long rows to many (LayerNorm bf16 16x2M
  .. 4096x32768): the column-tile blocks an SM it aims at before it cuts
  the rows into parts (tuning.grad_apply_blocks_per_sm);
- the channel backward (problem 35): the most bytes of x a channels-first
  chunk holds (tuning.grad_channel_max_chunk_bytes), and its launches;
- BatchNorm's backward on ResNet-50's activations (onchip): the four
  launches against channel_grad_onchip's shapes.

PYTHONPATH=. python bench/tune/backward.py [--only TEXT]"""
import argparse
import contextlib
import dataclasses

import cupy
import numpy as np

from cunorm._engine import dispatch_grad, dtypes, gradients, launch_cache, launches, tuning
from cunorm.bench._cases import backward_call
from cunorm.bench._timing import copy_bandwidth, time_gpu


def launch_times(run, before=None, verbose=True):
    """ms of each launch of one run() (after a fill that evicts L2);
    before(step), where given, is called ahead of each launch (untimed)."""
    records = []

    def timed(step, launch):
        fn = launches.step_function(step, cupy.cuda.runtime.getDevice())
        if verbose:
            print(f"    {step.kernel.expression}: {fn.num_regs} registers, {fn.local_size_bytes} B local, "
                  f"grid {step.grid} x {step.block}, {step.shared_bytes} B shared")
        if before is not None:
            before(step)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        launch()
        stop.record()
        records.append((step.kernel.expression.split("<")[0].replace("cunorm::", ""), start, stop))

    run()
    cupy.cuda.runtime.deviceSynchronize()
    cupy.empty(256 << 20, dtype=np.float32).fill(0)
    launches.step_hook = timed
    try:
        run()
    finally:
        launches.step_hook = None
    cupy.cuda.runtime.deviceSynchronize()
    return [(name, cupy.cuda.get_elapsed_time(a, b)) for name, a, b in records]


def case(op, shape, dtype, axis):
    *_, run, nbytes = backward_call(op, shape, dtype, axis, cupy.random.default_rng())
    return run, nbytes


def report(label, run, nbytes, bw, steps=False):
    ms, lo, hi = time_gpu(run)
    print(f"{label:60s} {ms:8.3f} ms ({lo:.3f}-{hi:.3f}) {100 * nbytes / ms / 1e6 / bw:6.1f}%", flush=True)
    if steps:
        for name, t in launch_times(run):
            print(f"    {name:40s} {t:8.3f} ms")


@contextlib.contextmanager
def overridden(**values):
    """The named thresholds set to values inside the block: a Tuning field
    (tuning.py, by its constant-style name) in every architecture's
    Tuning, else a dispatch_grad constant; the launch caches (the call
    path's included) cleared on the way in and out."""
    fields = {f.name for f in dataclasses.fields(tuning.Tuning)}
    saved_tunings = dict(tuning.BY_ARCH)
    saved = {name: getattr(dispatch_grad, name) for name in values if name.lower() not in fields}

    def apply(settings, tunings):
        tuned = {name.lower(): value for name, value in settings.items() if name.lower() in fields}
        for arch, t in tunings.items():
            tuning.BY_ARCH[arch] = dataclasses.replace(t, **tuned)
        for name, value in settings.items():
            if name.lower() not in fields:
                setattr(dispatch_grad, name, value)
        gradients._rows_launch.cache_clear()
        gradients._channel_launch.cache_clear()
        gradients.rows_grad_program.cache_clear()
        gradients.channel_grad_program.cache_clear()
        launch_cache.clear()  # (the signature-keyed launches, which would replay the first setting's)

    apply(values, saved_tunings)
    try:
        yield
    finally:
        apply(saved, saved_tunings)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s")
    if "cached" in args.only or not args.only:
        for op in ("ln", "rms"):
            run, nbytes = case(op, (32768, 4096), "bfloat16", -1)
            for target, min_blocks in ((128, 4), (256, 3)):
                for ahead in (False, True):
                    with overridden(GRAD_CACHED_TARGET_THREADS=target, GRAD_CACHED_TARGET_MIN_BLOCKS=min_blocks,
                                    GRAD_CACHED_PREFETCH_NEXT=ahead):
                        report(f"{op} bf16 32768x4096 threads {target} min blocks {min_blocks} prefetch {ahead:d}",
                               run, nbytes, bw)
            report(f"{op} bf16 32768x4096 (the dispatch's choice)", run, nbytes, bw, steps=True)
            del run
    if "clusters" in args.only or not args.only:
        for label, op, shape, dtype in (("rms bf16 4096x32768", "rms", (4096, 32768), "bfloat16"),
                                        ("ln bf16 4096x32768", "ln", (4096, 32768), "bfloat16"),
                                        ("rms bf16 2048x65536", "rms", (2048, 65536), "bfloat16"),
                                        ("ln f32 4096x16384", "ln", (4096, 16384), "float32"),
                                        ("rms bf16 1024x24576", "rms", (1024, 24576), "bfloat16")):
            run, nbytes = case(op, shape, dtype, -1)
            with overridden(GRAD_CACHED_MAX_CLUSTER=1):
                report(f"{label}, streamed", run, nbytes, bw, steps=True)
            for threads, most in ((128, 8), (256, 8), (512, 2), (512, 4)):
                with overridden(GRAD_CACHED_CLUSTER_THREADS=threads, GRAD_CACHED_MAX_CLUSTER=most):
                    for ahead in (True, False):
                        with overridden(GRAD_CACHED_PREFETCH_NEXT=ahead):
                            report(f"{label}, clusters of <= {most} x <= {threads} threads, prefetch {ahead:d}", run,
                                   nbytes, bw, steps=ahead)
            del run
    if "apply" in args.only or not args.only:
        for label, shape, dtype in (("ln bf16 16x2M", (16, 2 << 20), "bfloat16"), ("ln bf16 8x1M", (8, 1 << 20), "bfloat16"),
                                    ("ln f32 4x1M", (4, 1 << 20), "float32"), ("ln f32 64x100000", (64, 100000), "float32"),
                                    ("ln bf16 4096x32768", (4096, 32768), "bfloat16"),
                                    ("ln bf16 1024x65536", (1024, 65536), "bfloat16"),
                                    ("rms bf16 256x262144", (256, 262144), "bfloat16")):
            op = label.split()[0]
            run, nbytes = case(op, shape, dtype, -1)
            for per_sm in (8, 4, 3, 2):
                with overridden(GRAD_APPLY_BLOCKS_PER_SM=per_sm):
                    report(f"{label}, pass 2 aims at {per_sm} blocks an SM", run, nbytes, bw, steps=per_sm in (8, 3))
            del run
    if "streamed" in args.only or not args.only:
        for label, shape, dtype, axis in (("problem 40", (16, 64, 256, 256), "float32", (1, 2, 3)),
                                          ("ln bf16 4096x32768", (4096, 32768), "bfloat16", -1)):
            run, nbytes = case("ln", shape, dtype, axis)
            default = tuning.SM90.grad_chunk_blocks_per_sm
            for per_sm in (3, 6, 8, 12, 24):
                with overridden(GRAD_CHUNK_BLOCKS_PER_SM=per_sm):
                    report(f"{label}, streamed, pass-1 blocks an SM {per_sm}", run, nbytes, bw,
                           steps=per_sm == default)
            del run
    if "channels" in args.only or not args.only:
        run, nbytes = case("group", (112, 64, 512, 512), "float32", 8)
        default = tuning.SM90.grad_channel_max_chunk_bytes
        for cap in (None, 256 << 10, 64 << 10, 16 << 10):
            with overridden(GRAD_CHANNEL_MAX_CHUNK_BYTES=cap):
                report(f"problem 35 group_norm(8), chunks of at most {cap} bytes", run, nbytes, bw,
                       steps=cap == default)
        del run
    if "onchip" in args.only or not args.only:
        onchip_sweep(bw)
    cupy.get_default_memory_pool().free_all_blocks()


#: channel_grad_onchip's shapes tried beside the dispatch's and the four launches
ONCHIP_VARIANTS = ({"threads": 256, "elements": 16, "cluster": 1}, {"threads": 512, "elements": 16, "cluster": 1},
                   {"threads": 1024, "elements": 16, "cluster": 1}, {"threads": 256, "elements": 16, "cluster": 8},
                   {"threads": 512, "elements": 16, "cluster": 4}, {"threads": 1024, "elements": 16, "cluster": 8},
                   {"threads": 256, "elements": 32, "cluster": 8}, {"threads": 256, "elements": 32, "cluster": 1},
                   {"threads": 128, "elements": 32, "cluster": 1})


def onchip_sweep(bw):
    """BatchNorm's backward on ResNet-50's activations: the four launches,
    the dispatch's choice and channel_grad_onchip's shapes that hold a
    channel (grad_onchip_shapes, grad_onchip_max_elements)."""
    import cunorm

    rng = cupy.random.default_rng()
    for shape in ((64, 2048, 7, 7), (128, 2048, 7, 7), (64, 1024, 14, 14), (64, 512, 28, 28), (32, 512, 28, 28),
                  (32, 256, 56, 56)):
        for dtype in ("float32", "bfloat16"):
            npdtype = np.dtype(np.float32) if dtype == "float32" else np.dtype(dtypes.bfloat16)
            x = rng.standard_normal(shape, dtype=np.float32).astype(npdtype)
            dy = rng.standard_normal(shape, dtype=np.float32).astype(npdtype)
            w = (rng.random(shape[1], dtype=np.float32) * 1.5 + 0.5).astype(npdtype)
            _, mean, rstd = cunorm.batch_norm(x, w, w, return_stats=True)
            nbytes = 3 * x.nbytes
            for override in ({"walk": "split"}, None) + ONCHIP_VARIANTS:
                if override and "threads" in override:
                    override = {"walk": "onchip", **override}

                def run(override=override):
                    g = gradients.ChannelGradCall("batch", dy, x, mean, rstd, weight=w, bias=w, channel_axis=1)
                    return gradients.run_channels(g, None, override=override)

                label = f"batch_norm {dtype} {shape} {override or 'the dispatch'}"
                try:
                    report(label, run, nbytes, bw, steps=override is None)
                except ValueError:  # the walk's refusal: a shape that does not hold the channel
                    continue


if __name__ == "__main__":
    main()
