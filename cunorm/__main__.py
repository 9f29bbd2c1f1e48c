"""python -m cunorm [check | precompile | bench]

check (the default): on a GPU, run every op on random data against the
float64 reference and print errors and timings; without a GPU, say so and
compile a representative instantiation of every kernel and norm for every
dtype with NVRTC for sm_80 and sm_90 (``check --all``: all of them).
precompile: build every kernel for the current GPU ahead of time.
bench: the benchmark suites (``python -m cunorm bench --help``; cunorm/bench).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def _check_cases():
    from ._engine import dtypes

    bf16, f32 = dtypes.bfloat16, dtypes.float32
    return [
        # op, shape, dtype, axis, weight
        ("rms_norm", (1, 4096), bf16, -1, True),
        ("rms_norm", (4096, 4096), bf16, -1, True),
        ("rms_norm", (1024, 32768), bf16, -1, True),
        ("rms_norm", (8192, 1024), f32, -1, True),
        ("rms_norm", (4, 1 << 20), f32, -1, False),
        ("rms_norm", (1000, 4097), dtypes.float16, -1, True),
        ("rms_norm", (16, 64, 128, 128), f32, 1, False),
        ("rms_norm", (64, 760), dtypes.float64, -1, True),
        ("layer_norm", (4096, 4096), bf16, -1, True),
        ("layer_norm", (8192, 1024), f32, -1, True),
        ("layer_norm", (4, 64, 128, 128), f32, (1, 2, 3), True),
        ("layer_norm", (16, 64, 32, 32), f32, 1, True),
        ("layer_norm", (300, 65535), f32, -1, False),
        ("normalize", (300, 65535), f32, -1, False),
        ("normalize", (64, 64, 33), bf16, 1, False),
        ("mean_abs_normalize", (300, 65535), f32, -1, False),
        ("frobenius_normalize", (16, 64, 128, 128), f32, None, False),
    ]


def _apply(module, op, x, w, axis, **kw):
    """An op of cunorm or of its reference, with or without a weight."""
    fn = getattr(module, op)
    if op.endswith("normalize"):
        return fn(x, axis=axis, **kw)
    return fn(x, w, axis=axis, **kw)


def check_gpu(name: str) -> int:
    import cupy

    import cunorm

    from . import reference

    print(f"cunorm {cunorm.__version__} on {name}: every op against the float64 NumPy reference")
    print("error: max |y - ref| / max(|ref|, rms(ref)); time: median of 10 calls (CUDA events, host launch included)")
    print(f"{'op':19} {'shape':>20} {'dtype':>9} {'axis':>9} {'max rel err':>12} {'ms':>9}")
    rng = np.random.default_rng()
    failures = 0
    tolerance = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 5e-5, "float64": 1e-12}
    for op, shape, dtype, axis, has_weight in _check_cases():
        x_np = rng.standard_normal(shape).astype(dtype)
        if has_weight:
            first = axis[0] if isinstance(axis, tuple) else axis % len(shape)
            last = axis[-1] if isinstance(axis, tuple) else first
            w_np = rng.standard_normal(shape[first : last + 1]).astype(dtype)
        else:
            w_np = None
        x = cupy.asarray(x_np)
        w = None if w_np is None else cupy.asarray(w_np)
        y = _apply(cunorm, op, x, w, axis)
        ref = _apply(reference, op, x_np, w_np, axis, exact=True)
        got = cupy.asnumpy(y).astype(np.float64)
        # relative to each element, or to the outputs' root mean square where
        # that is larger (LayerNorm cancels for x near the mean)
        scale = np.maximum(np.abs(ref), np.sqrt(np.mean(ref**2)))
        err = np.abs(got - ref) / scale
        worst = float(np.max(err)) if np.all(np.isfinite(got)) else float("nan")
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        times = []
        for _ in range(10):
            start.record()
            _apply(cunorm, op, x, w, axis)
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop))
        ok = worst <= tolerance[np.dtype(dtype).name]
        failures += not ok
        print(f"{op:19} {str(shape):>20} {np.dtype(dtype).name:>9} {str(axis):>9} {worst:12.2e} {np.median(times):9.4f}"
              f"{'' if ok else '  FAIL'}")
    print("all ops match the reference" if not failures else f"{failures} case(s) off the reference")
    return 1 if failures else 0


def check_compile(jobs=None, everything=False) -> int:
    from ._engine import catalogue, loader

    kernels = catalogue.all_kernels()
    print("No CUDA GPU found: nothing can run here. Checking what can be checked without one:")
    if everything:
        print(f"compiling all {len(kernels)} kernel instantiations with NVRTC for sm_80 and sm_90 (no spills "
              "allowed; thread-block clusters for sm_90 only)")
    else:
        print(f"compiling a representative set of the {len(kernels)} kernel instantiations with NVRTC for sm_80 "
              "and sm_90 (no spills allowed): every kernel and every norm for every dtype, each at its most "
              "work per thread")
    bad = 0
    for arch in ("sm_80", "sm_90"):
        start = time.perf_counter()
        number = int(arch[3:])
        for_arch = [k for k in kernels if k.min_arch <= number]
        chosen = for_arch if everything else catalogue.representative_kernels(for_arch)
        try:
            results = loader.compile_offline(arch, chosen, jobs=jobs, progress=_progress(arch))
        except Exception as err:  # report and fail, don't traceback
            print(f"  {arch}: FAILED\n{err}")
            bad += 1
            continue
        spilled = [r["expression"] for r in results if r.get("stack") or r.get("spill_stores") or r.get("spill_loads")]
        compiled = [r for r in results if not r.get("helper")]
        regs = max(r["registers"] for r in compiled)
        status = "ok" if not spilled else f"{len(spilled)} spill, e.g. {spilled[0]}"
        print(f"  {arch}: {len(compiled)} kernels in {time.perf_counter() - start:.1f} s, "
              f"at most {regs} registers, {status}")
        bad += bool(spilled)
    if not everything:
        print(f"all {len(kernels)}: python -m cunorm check --all (about 20 minutes on 2 cores)")
    return 1 if bad else 0


def _progress(arch):
    """A progress line about every tenth of the kernels of a long compile (a
    line each, so a log shows it too)."""
    shown = [0]

    def report(done, total):
        if total >= 1000 and done * 10 // total > shown[0] and done < total:
            shown[0] = done * 10 // total
            print(f"  {arch}: {done}/{total} ...", flush=True)

    return report


def _positive_int(text: str) -> int:
    """argparse's type of --jobs: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of processes, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1 process, got {value}")
    return value


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        from .bench import main as bench_main

        return bench_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m cunorm", description=__doc__.splitlines()[0],
                                     epilog="python -m cunorm COMMAND --help: the command's own options")
    commands = parser.add_subparsers(dest="command", metavar="{check,precompile,bench}")
    jobs = dict(type=_positive_int, default=None, help="compiling processes, at least 1 (default: the CPU count)")
    check = commands.add_parser("check", help="the default: check the ops on the GPU, or compile them without one",
                                description="On a GPU, run every op on random data against the float64 reference "
                                "and print errors and timings; without a GPU, compile a representative instantiation "
                                "of every kernel and norm for every dtype (--all: every instantiation) "
                                "with NVRTC for sm_80 and sm_90.")
    check.add_argument("--jobs", **jobs)
    check.add_argument("--all", action="store_true",
                       help="without a GPU: compile every instantiation, not the representative set")
    precompile = commands.add_parser("precompile", help="build every kernel for the current GPU ahead of time",
                                     description="Build every kernel for the current GPU into CuPy's disk cache.")
    precompile.add_argument("--jobs", **jobs)
    commands.add_parser("bench", help="the benchmark suites (python -m cunorm bench --help)", add_help=False)
    args = parser.parse_args(argv or ["check"])
    from ._engine.loader import gpu_name

    name = gpu_name()
    if args.command == "precompile":
        if name is None:
            print("No CUDA GPU found: precompile builds the kernels for the current GPU. Without one, "
                  "`python -m cunorm check` compiles a representative set for sm_80 and sm_90 "
                  "(`check --all`: every kernel).")
            return 2
        from ._engine.loader import precompile

        print(f"compiling every kernel for {name} ...")
        summary = precompile(verbose=True, jobs=args.jobs)
        print(f"{summary['kernels']} kernels in {summary['seconds']:.1f} s (source {summary['source']})")
        return 0
    return check_gpu(name) if name else check_compile(args.jobs, args.all)


if __name__ == "__main__":
    sys.exit(main())
