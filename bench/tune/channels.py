"""Tuning sweep of the channel walks (GroupNorm, InstanceNorm, BatchNorm),
floor% against the copy bandwidth of the same run (a 1 GB fill before each
timed call, as in the benchmark):

- channel_stream against the three launches (split) and the row family
  (rows) on the benchmark's problems and on real activations, and
  channel_stream's knobs: its L2 hints (tuning.stream_hints), the slabs' lag, the
  slab size (tuning.stream_slab_l2_share) and the tile size (tuning.stream_tile_bytes);
  each stream variant's output is checked against the split walk's and
  its bytes against a second run;
- the L2 hints of the three launches' epilogue (channel_apply:
  tuning.channel_apply_hints_max_x_l2_share), the finalize launched or done
  by the apply (tuning.channel_apply_finalize_max_members), and the time of
  each launch of problems 33 and 37 (the two-read walks);
- on channels-last x, the three launches' tiles, chunks and grouping
  (TILE_VARIANTS), with the time of each launch.

PYTHONPATH=. python bench/tune/channels.py [--only TEXT] [--out DIR]"""
import argparse
import json
import os

import cupy
import numpy as np

import cunorm
from backward import launch_times  # (bench/tune/backward.py: this script's folder is on sys.path)
from cunorm._engine import channel_norms
from cunorm.bench._cases import fewest_bytes
from cunorm.bench._channel_cases import _channel_prepared, make_channel_inputs
from cunorm.bench._timing import copy_bandwidth, time_gpu

MB = 1 << 20
#: (name, op, shape, dtype, groups, params)
CASES = [
    ("problem 34 instance_norm (112,64,512,512) fp32", "instance_norm", (112, 64, 512, 512), "float32", None, ""),
    ("problem 35 group_norm(8) (112,64,512,512) fp32 +w+b", "group_norm", (112, 64, 512, 512), "float32", 8, "wb"),
    ("group_norm(32) (8,512,128,128) bf16 +w+b", "group_norm", (8, 512, 128, 128), "bfloat16", 32, "wb"),
    ("group_norm(32) (8,320,64,64) bf16 +w+b", "group_norm", (8, 320, 64, 64), "bfloat16", 32, "wb"),
    ("group_norm(32) (8,640,32,32) bf16 +w+b", "group_norm", (8, 640, 32, 32), "bfloat16", 32, "wb"),
    ("group_norm(32) (8,1280,16,16) bf16 +w+b", "group_norm", (8, 1280, 16, 16), "bfloat16", 32, "wb"),
    ("group_norm(32) channels-last (8,128,128,512) bf16 +w+b", "group_norm", (8, 128, 128, 512), "bfloat16", 32,
     "wb", -1),
    ("group_norm(32) channels-last (8,64,64,320) bf16 +w+b", "group_norm", (8, 64, 64, 320), "bfloat16", 32, "wb",
     -1),
    ("group_norm(32) channels-last (8,32,32,640) bf16 +w+b", "group_norm", (8, 32, 32, 640), "bfloat16", 32, "wb",
     -1),
    ("group_norm(32) channels-last (16,64,64,320) bf16 +w+b", "group_norm", (16, 64, 64, 320), "bfloat16", 32, "wb",
     -1),
    ("group_norm(32) channels-last (8,64,64,640) bf16 +w+b", "group_norm", (8, 64, 64, 640), "bfloat16", 32, "wb",
     -1),
    ("group_norm(32) channels-last (2,64,64,960) bf16 +w+b", "group_norm", (2, 64, 64, 960), "bfloat16", 32, "wb",
     -1),
    ("instance_norm (16,64,256,256) fp32 +w+b", "instance_norm", (16, 64, 256, 256), "float32", None, "wb"),
    ("instance_norm (4,128,512,512) fp32 +w+b", "instance_norm", (4, 128, 512, 512), "float32", None, "wb"),
    ("instance_norm (4,64,128,128) fp32 +w+b", "instance_norm", (4, 64, 128, 128), "float32", None, "wb"),
    ("instance_norm (4,128,64,64) fp32 +w+b", "instance_norm", (4, 128, 64, 64), "float32", None, "wb"),
    ("problem 33 batch_norm (64,64,512,512) fp32 +w+b", "batch_norm", (64, 64, 512, 512), "float32", None, "wb"),
    ("batch_norm (64,256,56,56) fp32 +w+b", "batch_norm", (64, 256, 56, 56), "float32", None, "wb"),
    ("batch_norm (64,256,56,56) bf16 +w+b", "batch_norm", (64, 256, 56, 56), "bfloat16", None, "wb"),
    ("batch_norm (64,512,28,28) fp32 +w+b", "batch_norm", (64, 512, 28, 28), "float32", None, "wb"),
    ("batch_norm (64,512,28,28) bf16 +w+b", "batch_norm", (64, 512, 28, 28), "bfloat16", None, "wb"),
    ("batch_norm (64,1024,14,14) fp32 +w+b", "batch_norm", (64, 1024, 14, 14), "float32", None, "wb"),
    ("batch_norm (64,2048,7,7) fp32 +w+b", "batch_norm", (64, 2048, 7, 7), "float32", None, "wb"),
    ("batch_norm (64,2048,7,7) bf16 +w+b", "batch_norm", (64, 2048, 7, 7), "bfloat16", None, "wb"),
]
KB = 1 << 10
STREAM_VARIANTS = [{}, {"hints": 0}, {"tile_bytes": 16 * KB}, {"tile_bytes": 8 * KB}, {"slab_bytes": 16 * MB},
                   {"slab_bytes": 16 * MB, "tile_bytes": 16 * KB}, {"slab_bytes": 24 * MB, "tile_bytes": 16 * KB},
                   {"lag": 2, "tile_bytes": 16 * KB}, {"lag": 2, "slab_bytes": 8 * MB, "tile_bytes": 16 * KB},
                   {"lag": 3, "slab_bytes": 6 * MB, "tile_bytes": 16 * KB}]
SPLIT_VARIANTS = [{"hints": 0}, {"hints": 1}, {"hints": 2}, {"hints": 3}, {"fold": False}, {"fold": True}]
#: channels-last: tiles of a power of two (against the position's vectors
#: exactly), the chunks a sample's positions are cut into, paired and a
#: statistic per channel, narrower vectors, the paired apply's own vectors
#: and blocks (ignored by the other layouts), the blocks a pass aims for
#: an SM
TILE_VARIANTS = [{}, {"exact_tile": False}, {"chunks": 66}, {"chunks": 132}, {"chunks": 16}, {"grouped": False},
                 {"grouped": False, "paired": False}, {"grouped": False, "exact_tile": False}, {"vec": 4},
                 {"vec": 4, "paired": True}, {"apply_vec": 8, "apply_blocks_per_sm": 2}, {"apply_blocks_per_sm": 4}
                 ] + [{"blocks_per_sm": k} for k in (1, 2, 3, 4, 6)]
ONCHIP_VARIANTS = [{}] + [{"threads": t, "elements": e, "cluster": k}
                          for t, e, k in ((256, 16, 1), (256, 32, 1), (512, 32, 1), (1024, 32, 1), (256, 32, 2),
                                          (512, 32, 2), (1024, 32, 2), (256, 32, 4), (512, 32, 4), (1024, 32, 4),
                                          (256, 32, 8), (512, 32, 8), (1024, 32, 8))]


def as_f32(a):
    """float32 copy of a GPU array (bfloat16 widened by its bits)."""
    if a.dtype.itemsize == 2 and a.dtype != np.float16:
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def sweep(name, op, shape, dtype, groups, params, channel_axis=1, *, copy_bw, rows, walks):
    x, w, b, running, y = make_channel_inputs(op, shape, dtype, channel_axis, params)
    nbytes = fewest_bytes(x, w, b, False)
    call, prep = _channel_prepared(op, x, groups, w, b, channel_axis, running, y)
    print(f"{name}: default walk {channel_norms.execute(call, *prep)[0]}", flush=True)
    reference = None
    for walk in walks:
        if walk in ("rows", "stream") and (op == "batch_norm" or channel_axis != 1):
            continue
        variants = {"stream": STREAM_VARIANTS, "split": TILE_VARIANTS if channel_axis != 1 else SPLIT_VARIANTS,
                    "onchip": ONCHIP_VARIANTS}.get(walk, [{}])
        if walk == "split" and "onchip" in walks:
            variants = [{}]
        for extra in variants:
            override = {"walk": walk, **extra}
            if walk == "onchip" and extra:  # only shapes the group fills to a quarter or more
                channels = shape[channel_axis]
                spatial = int(np.prod(shape)) // (shape[0] * channels)
                group = {"batch_norm": shape[0], "group_norm": channels // (groups or 1)}.get(op, 1) * spatial
                if extra["threads"] * extra["elements"] * extra["cluster"] > 4 * group:
                    continue
            if "tile_bytes" in override:
                override["tile_vecs"] = override.pop("tile_bytes") // 16
            row = {"case": name, "override": override}
            try:
                y.view(np.uint8).fill(0xFF)  # NaN in every float type
                channel_norms.execute(call, *prep, override=override)
                got = y.copy()
                if reference is None:
                    reference = as_f32(got)
                err = float(cupy.max(cupy.abs(as_f32(got) - reference)))
                channel_norms.execute(call, *prep, override=override)
                same = bool(cupy.all(got.view(np.uint8) == y.view(np.uint8)))
                ms, lo, hi = time_gpu(lambda: channel_norms.execute(call, *prep, override=override))
                row.update(ms=ms, floor_pct=100 * nbytes / (ms * 1e-3) / 1e9 / copy_bw, max_abs_diff=err,
                           nan=bool(cupy.isnan(as_f32(got)).any()), repeatable=same)
                print(f"  {override}: {ms:.4f} ms ({lo:.4f}-{hi:.4f}) {row['floor_pct']:.1f}%  "
                      f"diff {err:.2e} nan {row['nan']} repeatable {same}", flush=True)
                if channel_axis != 1:
                    row["launches"] = launch_times(lambda: channel_norms.execute(call, *prep, override=override),
                                                   verbose=False)
                    print("    " + ", ".join(f"{k} {t * 1e3:.1f} us" for k, t in row["launches"]), flush=True)
            except Exception as err:  # report, keep going
                row["error"] = repr(err)[:300]
                print(f"  {override}: {row['error']}", flush=True)
            rows.append(row)
    del x, w, b, y, call, prep, reference
    cupy.get_default_memory_pool().free_all_blocks()


def split_launches(rows):
    """Each launch of problems 33 and 37 (the two-read walks)."""
    x, w, b, running, y = make_channel_inputs("batch_norm", (64, 64, 512, 512), "float32", 1, "wb")
    run = lambda: cunorm.batch_norm(x, w, b, running_mean=running[0], running_var=running[1], out=y)  # noqa: E731
    times = launch_times(run, verbose=False)
    print("problem 33 launches:", times, flush=True)
    rows.append({"case": "problem 33 launches", "launches": times})
    del x, w, b, running, y
    x = cupy.random.standard_normal((112, 64, 512, 512), dtype=np.float32)
    y = cupy.empty_like(x)
    times = launch_times(lambda: cunorm.frobenius_normalize(x, out=y), verbose=False)
    print("problem 37 launches:", times, flush=True)
    rows.append({"case": "problem 37 launches", "launches": times})
    del x, y
    cupy.get_default_memory_pool().free_all_blocks()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-launches", action="store_true")
    ap.add_argument("--walks", default="split,rows,stream", help="comma-separated: split, rows, stream, onchip")
    args = ap.parse_args()
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    rows = [{"copy_gbps": copy_bw}]
    for case in CASES:
        if any(part in case[0] for part in args.only.split("|")):
            sweep(*case, copy_bw=copy_bw, rows=rows, walks=args.walks.split(","))
    if not args.no_launches:
        split_launches(rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_channels.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
