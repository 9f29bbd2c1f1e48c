"""``python -m cunorm bench``: cunorm against its peers on the current GPU.

Suites (``--suite``, default all):

kernelbench
    KernelBench level 1's normalization problems 33-40 at their full shapes
    (../shared/spec/ops.md), fp32.
llm
    RMSNorm and LayerNorm over the last axis of (tokens, hidden) rows,
    hidden 1024 to 32768, bf16, fp16 and fp32, with a same-dtype weight (and
    bias), with and without the fused residual add; and a token sweep at
    hidden 4096 in bf16, 1 (decode) to 32768 tokens.
sweep
    Effective GB/s against size for each op (fp32, 256 KB to 1 GB of x).
backward
    The gradients: RMSNorm and LayerNorm rows, problems 40, 35 and 36.
host
    Host time: wall clock per call in a loop on decode-sized inputs (1x4096
    bf16, small images), cunorm against torch's own op or layer: the
    functions on CuPy arrays and torch tensors, the layers in eval, under
    autocast, and a training step through autograd.
models
    Whole timm and Hugging Face models before and after
    ``cunorm.torch.replace_norms`` (cunorm/bench/_models.py).
jax
    cunorm.jax inside ``jax.jit`` against XLA's fusion of the same op in
    ``jax.numpy``: forward, forward+backward, and forward+backward of a
    loss that reads y (cunorm/bench/_jax.py).

Every run first measures the device-to-device copy bandwidth, then reports
per case: the median ms of the GPU work and its spread (min to max over the
repetitions; the GPU kept busy ahead of each call so host time is hidden),
the single-call ms (CUDA events around one call on an idle GPU, host time
inside, as users and KernelBench time an op; cunorm called on torch tensors
where torch is importable),
effective GB/s (the fewest bytes the op must move over the median time),
floor% (that over the copy bandwidth), the speed-up over torch eager,
torch.compile and Liger where they are importable, and the max relative
error against the float64 reference (on the first rows or samples). Cases
that do not fit in the GPU's free memory are skipped with a note.

``--quick`` runs scaled-down shapes (and no torch.compile, whose compile
time alone would exceed the minute) in about 30 s. Results go to
``--out`` (default ``cunorm-bench/``): ``results.json`` and ``results.csv``
(with the GPU, driver, library versions, commit and date) and, where
matplotlib is importable, ``sweep.png`` (GB/s against size per op, the copy
bandwidth as a line) and ``speedup.png`` (speed-up bars per case of the
kernelbench and llm suites). ``--plot results.json`` redraws the plots from
a saved run, without a GPU; it needs matplotlib (``pip install
'cunorm[bench]'``) and exits non-zero with a message without it.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

SUITES = ("kernelbench", "llm", "sweep", "backward", "host", "models", "jax")
#: what runs without --suite (the models suite takes minutes, the jax suite
#: needs jax with its CUDA plugin: ask for them)
DEFAULT_SUITES = SUITES[:-2]
#: exit status without a GPU (as ``python -m cunorm precompile``)
NO_GPU_EXIT = 2
#: exit status of --plot without matplotlib
NO_PLOT_EXIT = 3
#: the command line's description (plain text: argparse prints it as it is)
DESCRIPTION = "cunorm against its peers on the current GPU: the benchmark suites."
SUITE_HELP = {
    "kernelbench": "KernelBench level 1's normalization problems 33-40 and the channel norms on real activations",
    "llm": "RMSNorm and LayerNorm over (tokens, hidden) rows, with and without the fused residual",
    "sweep": "effective GB/s against size for each op",
    "backward": "the gradients",
    "host": "host time per call on decode-sized inputs",
    "models": "whole timm and Hugging Face models before and after replace_norms (minutes)",
    "jax": "cunorm.jax inside jax.jit against XLA's fusions (needs jax with its CUDA plugin)",
}


@dataclass(frozen=True)
class Case:
    """One benchmark case: which runner of cunorm/bench/_cases.py, its
    arguments after the name, and what the x array holds (for the memory
    check and the sweep's size axis)."""

    suite: str
    name: str
    runner: str  # "rows", "channels", "lp" or "backward"
    args: tuple
    x_bytes: int
    op: str  # the plot's series
    #: GPU memory the case needs, in units of x_bytes (x, y, peers' temporaries)
    footprint: float = 4.0
    extra: dict = field(default_factory=dict, compare=False)


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}[dtype]


def _rows(suite, name, op, shape, dtype, axis, params, residual, *, series=None, target=None, footprint=None):
    fp = footprint or (6.0 if residual else 4.0)
    return Case(suite, name, "rows", (op, shape, dtype, axis, params, residual, target), _nbytes(shape, dtype),
                series or op, fp)


def _channels(suite, name, op, shape, dtype, groups, params, *, series=None, target=None, channel_axis=1):
    return Case(suite, name, "channels", (op, shape, dtype, groups, channel_axis, params, target),
                _nbytes(shape, dtype), series or op, 4.0)


def _lp(suite, name, op, shape, axis, *, series=None, target=None):
    return Case(suite, name, "lp", (op, shape, axis, target), _nbytes(shape, "float32"), series or op, 4.0)


def kernelbench_cases(quick: bool) -> list[Case]:
    """Problems 33-40 (quick: the batch cut to 2-4 samples, 256 rows for 38/39)."""
    n4 = (lambda n: 4) if quick else (lambda n: n)
    big = (n4(112), 64, 512, 512)
    s = "kernelbench"
    return [
        _channels(s, "33 batch_norm train", "batch_norm", (n4(64), 64, 512, 512), "float32", None, "wb"),
        _channels(s, "34 instance_norm", "instance_norm", big, "float32", None, ""),
        _channels(s, "35 group_norm(8)", "group_norm", big, "float32", 8, "wb"),
        _rows(s, "36 rms_norm axis 1", "rms_norm", big, "float32", 1, "", False),
        _lp(s, "37 frobenius_normalize", "frobenius_normalize", big, None),
        _lp(s, "38 mean_abs_normalize", "mean_abs_normalize", (256 if quick else 32768, 65535), 1),
        _lp(s, "39 normalize (L2)", "normalize", (256 if quick else 32768, 65535), 1),
        _rows(s, "40 layer_norm axes 1-3", "layer_norm", (2 if quick else 16, 64, 256, 256), "float32", (1, 2, 3),
              "wb", False),
    ] + activation_cases(quick)


#: real activations: BatchNorm on ResNet-50's, GroupNorm(32) on a
#: diffusion UNet's, InstanceNorm on a style-transfer network's
RESNET_BN = ((64, 256, 56, 56), (64, 512, 28, 28), (64, 2048, 7, 7))
UNET_GN = ((8, 320, 64, 64), (8, 640, 32, 32), (8, 1280, 16, 16), (8, 512, 128, 128))
STYLE_IN = ((4, 32, 256, 256), (4, 64, 128, 128), (4, 128, 64, 64))


def activation_cases(quick: bool) -> list[Case]:
    """The channel norms on the activations users run (quick: the first of
    each, batch cut to 4 / 2)."""
    s, out = "kernelbench", []
    cut = (lambda shape, n: (min(shape[0], n),) + shape[1:]) if quick else (lambda shape, n: shape)
    for shape in RESNET_BN[:1] if quick else RESNET_BN:
        for dtype in ("float32", "bfloat16"):
            for mode in ("train", "eval"):
                params = "wb" if mode == "train" else "wb eval"
                name = f"batch_norm {mode} {tuple(cut(shape, 4))} {SHORT[dtype]} +w+b"
                out.append(_channels(s, name, "batch_norm", cut(shape, 4), dtype, None, params))
    for shape in UNET_GN[:1] if quick else UNET_GN:
        shape = cut(shape, 2)
        nhwc = (shape[0], *shape[2:], shape[1])
        out.append(_channels(s, f"group_norm(32) {shape} bf16 +w+b", "group_norm", shape, "bfloat16", 32, "wb"))
        out.append(_channels(s, f"group_norm(32) channels-last {nhwc} bf16 +w+b", "group_norm", nhwc, "bfloat16", 32,
                             "wb", channel_axis=-1))
    for shape in STYLE_IN[:1] if quick else STYLE_IN:
        shape = cut(shape, 2)
        out.append(_channels(s, f"instance_norm {shape} fp32 +w+b", "instance_norm", shape, "float32", None, "wb"))
    return out


LLM_HIDDEN = (1024, 2048, 4096, 8192, 16384, 32768)
LLM_TOKENS = 16384
LLM_SWEEP_TOKENS = (1, 16, 128, 1024, 4096, 32768)
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def llm_cases(quick: bool) -> list[Case]:
    """(tokens, hidden) rows, weight (and bias) of x's dtype; quick: 1024
    tokens, hidden 1024 and 4096, bf16, with and without the residual."""
    tokens = 1024 if quick else LLM_TOKENS
    hidden = (1024, 4096) if quick else LLM_HIDDEN
    dtypes = ("bfloat16",) if quick else ("bfloat16", "float16", "float32")
    out = []
    for op, params in (("rms_norm", "w"), ("layer_norm", "wb")):
        for residual in (False, True):
            for dtype in dtypes:
                for h in hidden:
                    label = f"{'residual+' if residual else ''}{op} {SHORT[dtype]} {tokens}x{h}"
                    out.append(_rows("llm", label, op, (tokens, h), dtype, -1, params, residual))
    # the token sweep of one model width, decode (1 token) to a long prefill
    for op, params in (("rms_norm", "w"), ("layer_norm", "wb")):
        for t in (LLM_SWEEP_TOKENS[:3] if quick else LLM_SWEEP_TOKENS):
            out.append(_rows("llm", f"{op} bf16 {t}x4096", op, (t, 4096), "bfloat16", -1, params, False))
    return out


SWEEP_SIZES = tuple(1 << k for k in range(16, 29, 2))  # elements: 64K .. 256M (256 KB .. 1 GB of fp32)
SWEEP_QUICK_SIZES = (1 << 16, 1 << 20, 1 << 22)


def sweep_cases(quick: bool) -> list[Case]:
    """Each op on fp32 x of growing size: rows of 4096 (rms_norm,
    layer_norm, normalize), (N, 64, 64, 64) images (the channel norms), the
    whole array (frobenius_normalize). torch eager beside each, no compile."""
    out = []
    for n in SWEEP_QUICK_SIZES if quick else SWEEP_SIZES:
        rows = (n // 4096, 4096)
        images = (max(1, n // (64 * 64 * 64)), 64, 64, 64) if n >= 64 * 64 * 64 else (1, 64, 32, n // (64 * 32))
        mb = f"{n * 4 / 2**20:g} MB"
        out += [
            _rows("sweep", f"rms_norm {mb}", "rms_norm", rows, "float32", -1, "w", False),
            _rows("sweep", f"layer_norm {mb}", "layer_norm", rows, "float32", -1, "wb", False),
            _channels("sweep", f"group_norm(8) {mb}", "group_norm", images, "float32", 8, "wb"),
            _channels("sweep", f"instance_norm {mb}", "instance_norm", images, "float32", None, ""),
            _channels("sweep", f"batch_norm {mb}", "batch_norm", images, "float32", None, "wb"),
            _lp("sweep", f"normalize {mb}", "normalize", rows, -1),
            _lp("sweep", f"frobenius_normalize {mb}", "frobenius_normalize", rows, None),
        ]
    return out


def backward_cases(quick: bool) -> list[Case]:
    """Gradients (dx, dweight, dbias) from the forward's statistics."""
    from ._cases import BACKWARD_CASES

    if quick:
        chosen = [("rms_norm bf16 4096x4096 +w", "rms", (4096, 4096), "bfloat16", -1, None),
                  ("layer_norm bf16 4096x4096 +w+b", "ln", (4096, 4096), "bfloat16", -1, None),
                  ("problem 40 layer_norm (2,64,256,256) fp32 +w+b", "ln", (2, 64, 256, 256), "float32", (1, 2, 3),
                   None),
                  ("problem 35 group_norm(8) (4,64,512,512) fp32 +w+b", "group", (4, 64, 512, 512), "float32", 8,
                   None)]
    else:
        chosen = [(name.removeprefix("backward "), *rest) for name, *rest in BACKWARD_CASES]
    return [Case("backward", name, "backward", (op, shape, dtype, axis, target), _nbytes(shape, dtype),
                 f"{op} backward", 5.0) for name, op, shape, dtype, axis, target in chosen]


SUITE_CASES = {"kernelbench": kernelbench_cases, "llm": llm_cases, "sweep": sweep_cases, "backward": backward_cases,
               # (not per-case: host_rows, _models.rows, _jax.rows)
               "host": lambda quick: [], "models": lambda quick: [], "jax": lambda quick: []}


def cases(suites=DEFAULT_SUITES, quick=False) -> list[Case]:
    """The cases of the named suites, in order."""
    unknown = [s for s in suites if s not in SUITE_CASES]
    if unknown:
        raise ValueError(f"unknown suite(s) {unknown}; expected some of {list(SUITES)}")
    return [c for s in suites for c in SUITE_CASES[s](quick)]


# --- running ---------------------------------------------------------------------


def run_case(case: Case, copy_gbps: float, with_compile: bool) -> dict:
    """Run one case; a case that does not fit in free GPU memory is a row
    with ``skipped`` set (checked before allocating, and on an allocation
    failure)."""
    import cupy

    from . import _cases, _channel_cases, _timing

    base = {"suite": case.suite, "case": case.name, "series": case.op}
    free, _ = cupy.cuda.runtime.memGetInfo()
    cupy.get_default_memory_pool().free_all_blocks()
    need = case.footprint * case.x_bytes
    if need > free + cupy.get_default_memory_pool().total_bytes():
        return base | {"skipped": f"needs about {need / 2**30:.1f} GiB of GPU memory, {free / 2**30:.1f} GiB free"}
    runner = {"rows": _cases.bench_case, "channels": _channel_cases.bench_channel_case, "lp": _cases.bench_lp_case,
              "backward": _cases.bench_backward_case}[case.runner]
    try:
        row = runner(case.name, *case.args, copy_gbps, with_compile=with_compile)
    except Exception as err:  # out of memory (cupy's or torch's): skip with a note
        if "OutOfMemory" not in type(err).__name__ and "out of memory" not in str(err).lower():
            raise
        _timing.release()
        return base | {"skipped": f"out of GPU memory ({type(err).__name__})"}
    row = base | row
    for peer in ("torch", "compile", "liger"):
        if row.get(f"{peer}_ms"):
            row[f"{peer}_speedup"] = row[f"{peer}_ms"] / row["ms"]
    return row


class Progress:
    """A one-line progress bar on stderr (a line per case when stderr is
    not a terminal)."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.start = total, 0, time.perf_counter()
        self.enabled = enabled
        self.tty = sys.stderr.isatty()

    def update(self, label: str):
        if not self.enabled:
            return
        width = 30
        filled = width * self.done // max(self.total, 1)
        elapsed = time.perf_counter() - self.start
        line = f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {elapsed:5.0f} s  {label}"
        if self.tty:
            cols = shutil.get_terminal_size().columns
            sys.stderr.write("\r" + line[: cols - 1].ljust(cols - 1))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def step(self, label: str):
        self.done += 1
        self.update(label)

    def close(self):
        if self.enabled and self.tty:
            sys.stderr.write("\n")


def metadata(quick: bool, suites) -> dict:
    """The GPU, driver, library versions, commit and date of a run."""
    import cupy
    import numpy

    import cunorm

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    versions = {"cunorm": cunorm.__version__, "cupy": cupy.__version__, "numpy": numpy.__version__,
                "python": sys.version.split()[0]}
    for mod in ("torch", "jax", "liger_kernel", "triton"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # not importable: not recorded
            pass
    return {"gpu": name, "driver": _driver_version(), "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
            "versions": versions, "commit": _commit(), "date": datetime.date.today().isoformat(),
            "quick": quick, "suites": list(suites)}


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def _commit() -> str | None:
    """The source tree's commit: $CUNORM_COMMIT, the repository's
    bench/.commit stamp (trees copied without .git), or git."""
    if os.environ.get("CUNORM_COMMIT"):
        return os.environ["CUNORM_COMMIT"]
    root = Path(__file__).resolve().parents[2]
    stamp = root / "bench" / ".commit"
    if stamp.exists() and stamp.read_text().strip():
        return stamp.read_text().strip()
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=20)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run(suites=DEFAULT_SUITES, *, quick=False, with_compile=None, only="", progress=True) -> dict:
    """Measure the copy bandwidth, then every case of the suites. Returns
    ``{"meta": ..., "cases": [row, ...]}``; with_compile defaults to not
    quick."""
    from . import _host, _timing

    with_compile = (not quick) if with_compile is None else with_compile
    chosen = [c for c in cases(suites, quick) if only in c.name]
    meta = metadata(quick, suites)
    bar = Progress(len(chosen) + 1, progress)
    bar.update("copy bandwidth")
    meta["copy_gbps"] = _timing.copy_bandwidth(256 << 20 if quick else 4 << 30)
    meta["torch_compile"] = with_compile and _timing.torch is not None
    bar.step(f"copy bandwidth {meta['copy_gbps']:.0f} GB/s")
    rows = []
    for case in chosen:
        bar.update(case.name)
        rows.append(run_case(case, meta["copy_gbps"], with_compile))
        bar.step(case.name)
    bar.close()
    result = {"meta": meta, "cases": rows}
    if "host" in suites:
        result["host"] = _host.host_rows(200 if quick else 2000)
    if "models" in suites:
        from . import _models

        result["models"] = _models.rows(quick, with_compile, only)
    if "jax" in suites:
        from . import _jax

        result["jax"] = _jax.rows(quick, only, meta["copy_gbps"])
    return result


# --- reporting ---------------------------------------------------------------------

COLUMNS = ("suite", "case", "tier", "shape", "dtype", "bytes", "ms", "ms_min", "ms_max", "gbps", "floor_pct",
           "torch_ms", "torch_speedup", "compile_ms", "compile_speedup", "liger_ms", "liger_speedup",
           "single_ms", "single_floor_pct", "torch_single_ms", "compile_single_ms", "max_rel_err", "skipped")


def _f(v, spec):
    return "" if v is None else format(v, spec)


def format_table(result: dict, markdown: bool = False) -> str:
    """The run as a table: a header line (GPU, date, copy bandwidth), then
    a row per case."""
    meta = result["meta"]
    head = (f"{meta['gpu']}, driver {meta['driver']}, {meta['date']}, commit {meta['commit']}: copy bandwidth "
            f"{meta['copy_gbps']:.0f} GB/s{' (quick)' if meta['quick'] else ''}")
    titles = ["suite", "case", "ms (median)", "spread", "GB/s", "floor%", "x eager", "x compile", "x Liger",
              "1-call ms", "1-call floor%", "eager 1-call", "compile 1-call", "max rel err"]
    body = []
    for r in result["cases"]:
        if r.get("skipped"):
            body.append([r["suite"], r["case"], "skipped: " + r["skipped"]] + [""] * 11)
            continue
        spread = f"{r['ms_min']:.3f}-{r['ms_max']:.3f}"
        body.append([r["suite"], r["case"], f"{r['ms']:.3f}", spread, f"{r['gbps']:.0f}", f"{r['floor_pct']:.1f}",
                     _f(r.get("torch_speedup"), ".2f"), _f(r.get("compile_speedup"), ".2f"),
                     _f(r.get("liger_speedup"), ".2f"), _f(r.get("single_ms"), ".3f"),
                     _f(r.get("single_floor_pct"), ".1f"), _f(r.get("torch_single_ms"), ".3f"),
                     _f(r.get("compile_single_ms"), ".3f"), _f(r.get("max_rel_err"), ".1e")])
    host = [[r["case"], f"{r['us']:.1f}", _f(r.get("torch_us"), ".1f"), _f(r.get("ratio"), ".2f")]
            for r in result.get("host", [])]
    host_titles = ["host time per call", "cunorm us", "torch us", "cunorm / torch"]
    from ._models import TITLES as model_titles
    from ._models import format_rows

    models = format_rows(result.get("models", []))
    from . import _jax

    jax_rows = _jax.format_rows(result.get("jax", []))
    if markdown:
        lines = [head, ""]
        if body:
            lines += ["| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
            lines += ["| " + " | ".join(row) + " |" for row in body]
        for names, table in ((host_titles, host), (model_titles, models), (_jax.TITLES, jax_rows)):
            if table:
                lines += ["", "| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
                lines += ["| " + " | ".join(row) + " |" for row in table]
        return "\n".join(lines)
    out = [head]
    for names, table in ((titles, body), (host_titles, host), (model_titles, models), (_jax.TITLES, jax_rows)):
        if not table:
            continue
        widths = [max(len(t), *(len(row[i]) for row in table)) for i, t in enumerate(names)]
        fmt_row = lambda row: "  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))  # noqa: E731
        out += ["", fmt_row(names), fmt_row(["-" * w for w in widths])] + [fmt_row(r) for r in table]
    return "\n".join(out)


def write_results(result: dict, out_dir) -> list[Path]:
    """results.json, results.csv, results.md and the plots into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.csv", out / "results.md"]
    paths[0].write_text(json.dumps(result, indent=1, default=str))
    meta = result["meta"]
    with open(paths[1], "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["# " + json.dumps({k: v for k, v in meta.items()}, default=str)])
        writer.writerow(COLUMNS)
        for r in result["cases"]:
            writer.writerow(["" if r.get(c) is None else r.get(c) for c in COLUMNS])
    paths[2].write_text(format_table(result, markdown=True) + "\n")
    from .plots import plot

    return paths + plot(result, out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cunorm bench", description=DESCRIPTION,
        epilog="Suites: " + "; ".join(f"{name}: {text}" for name, text in SUITE_HELP.items()) + ".")
    parser.add_argument("--suite", action="append", choices=SUITES,
                        help="a suite to run (repeatable; default: all but models and jax)")
    parser.add_argument("--quick", action="store_true", help="scaled-down shapes, no torch.compile (about 30 s)")
    parser.add_argument("--out", default="cunorm-bench", help="directory for results.json/.csv/.md and the plots")
    parser.add_argument("--only", default="",
                        help="only the cases (and the models rows, by 'model mode') whose name contains this text")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--compile", action="store_true", help="time torch.compile also with --quick")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--plot", metavar="RESULTS_JSON", help="only redraw the plots of a saved run (no GPU needed)")
    args = parser.parse_args(argv)
    if args.plot:
        from .plots import PlotUnavailable, plot

        result = json.loads(Path(args.plot).read_text())
        try:
            written = plot(result, Path(args.out), required=True)
        except PlotUnavailable as err:
            print(err, file=sys.stderr)
            return NO_PLOT_EXIT
        for p in written:
            print(p)
        return 0
    from .._engine.loader import gpu_name

    gpu = gpu_name()
    if gpu is None:
        print("No CUDA GPU found: `python -m cunorm bench` measures kernels on a GPU and has nothing to run here. "
              "(Without one, `python -m cunorm check` compiles a representative set of the kernels; "
              "`check --all` compiles every one.)")
        return NO_GPU_EXIT
    with_compile = False if args.no_compile else (True if args.compile else None)
    result = run(tuple(args.suite or DEFAULT_SUITES), quick=args.quick, with_compile=with_compile, only=args.only,
                 progress=not args.no_progress)
    print(format_table(result))
    print()
    for p in write_results(result, args.out):
        print(f"wrote {p}")
    return 0
