"""Compiling and caching the kernels.

Each kernel family is one ``.cu`` file in ``cunorm/kernels/``. Its
``#include "..."`` lines are inlined here, so the source string handed to
NVRTC is the whole program: CuPy's on-disk cache keys on that string (it does
not look inside headers reached through ``-I``), so editing any header changes
the key and a stale binary is never served. Each template instantiation is
its own ``cupy.RawModule`` (one compile of ~0.2 s on first use, then CuPy's
disk cache), memoized per device.
"""
from __future__ import annotations

import functools
import hashlib
import re
import sys
import threading
import time
from pathlib import Path

from .caches import BoundedCache

KERNEL_DIR = Path(__file__).parent.parent / "kernels"
#: options shared by the run-time and the offline (CI) compiles. CuPy adds
#: -arch for the current device and -ftz=true itself.
OPTIONS = ("-std=c++17",)
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


@functools.lru_cache(maxsize=None)
def source(family: str) -> str:
    """The family's source with every local header inlined once."""
    seen: set[str] = set()

    def expand(name: str) -> list[str]:
        lines = [f'#line 1 "{name}"']
        for number, line in enumerate((KERNEL_DIR / name).read_text().splitlines(), start=1):
            match = _INCLUDE.match(line)
            if match is None:
                if line.strip() != "#pragma once":
                    lines.append(line)
                continue
            header = match.group(1)
            if header not in seen:
                seen.add(header)
                lines.extend(expand(header))
            lines.append(f'#line {number + 1} "{name}"')
        return lines

    return "\n".join(expand(f"{family}.cu")) + "\n"


def source_digest() -> str:
    """A hash of every kernel source file (reported by precompile)."""
    h = hashlib.sha256()
    for path in sorted(KERNEL_DIR.glob("*.cu*")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


#: Most loaded kernels kept (oldest out first; the catalogue holds thousands
#: of instantiations, a process uses a few hundred; an evicted one loads
#: again from CuPy's disk cache). Launch-cache entries hold their own functions.
MAX_FUNCTIONS = 4096
_functions = BoundedCache(MAX_FUNCTIONS)
_compile_lock = threading.Lock()


def get_function(family: str, expression: str, device: int | None = None, cooperative: bool = False):
    """The compiled kernel for a template instantiation on ``device`` (the
    current device when None). ``cooperative`` kernels are launched with
    cuLaunchCooperativeKernel (all blocks co-resident, or no launch).
    Compile-and-insert holds a lock: threads asking for the same kernel at
    once compile it once."""
    import cupy

    if device is None:
        device = cupy.cuda.runtime.getDevice()
    key = (device, expression)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    with _compile_lock:
        fn = _functions.get(key)
        if fn is None:
            with cupy.cuda.Device(device):
                module = cupy.RawModule(code=source(family), options=OPTIONS, name_expressions=[expression],
                                        enable_cooperative_groups=cooperative)
                fn = module.get_function(expression)
            _functions.put(key, fn)
    return fn


def gpu_name():
    """The current GPU's name; None where CuPy finds no GPU (what the
    command line and the bench check before they start)."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
        return props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    except Exception:  # no driver, no device, no CUDA runtime: all mean no GPU here
        return None


def precompile(verbose: bool = False, jobs: int | None = None) -> dict:
    """Build every kernel instantiation the dispatch can choose for the
    current GPU (filling CuPy's disk cache), compiling in ``jobs`` processes
    (default: the CPU count; each compiles a share into the shared disk
    cache, then this process loads them all from it). Returns a summary
    with the time it took. Raises RuntimeError where there is no GPU
    (``python -m cunorm check`` compiles without one).

    The workers are fresh interpreters running this module (``python -m
    cunorm._engine.loader``), not multiprocessing's children, so a caller's script
    is never re-run in them (no ``if __name__ == "__main__"`` guard needed).
    """
    import os
    import subprocess

    from .catalogue import all_kernels

    if gpu_name() is None:
        raise RuntimeError("cunorm.precompile: no CUDA GPU found; precompile builds the kernels for the current "
                           "GPU. Without one, `python -m cunorm check` compiles a representative set with NVRTC for "
                           "sm_80 and sm_90 (`check --all`: every kernel).")
    import cupy

    arch = int(cupy.cuda.Device().compute_capability)
    kernels = [k for k in all_kernels() if k.min_arch <= arch]
    start = time.perf_counter()
    jobs = jobs or os.cpu_count() or 1
    if jobs > 1:
        package_parent = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
        workers = []
        for i in range(jobs):
            share = "\n".join(f"{k.family} {int(k.cooperative)} {k.expression}" for k in kernels[i::jobs])
            worker = subprocess.Popen([sys.executable, "-m", "cunorm._engine.loader"], stdin=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True)
            worker.stdin.write(share)
            worker.stdin.close()
            workers.append(worker)
        failed = []
        for done, worker in enumerate(workers):
            err = worker.stderr.read()
            if worker.wait():
                failed.append(err.strip().splitlines()[-1:] or [f"exit status {worker.returncode}"])
            if verbose and sys.stdout.isatty():
                print(f"\r  {done + 1}/{jobs} compiling processes done", end="", flush=True)
        if failed:
            raise RuntimeError(f"cunorm.precompile: {len(failed)} of {jobs} compiling processes failed: {failed[0][0]}")
    for i, kernel in enumerate(kernels):
        get_function(kernel.family, kernel.expression, cooperative=kernel.cooperative)
        if verbose and sys.stdout.isatty():
            print(f"\r  {i + 1}/{len(kernels)} kernels", end="", flush=True)
    if verbose and sys.stdout.isatty():
        print()
    return {"kernels": len(kernels), "seconds": time.perf_counter() - start, "source": source_digest()}


def _compile_share(lines) -> int:
    """Compile the kernels of precompile's worker: one per line, "family
    cooperative expression" (the expression last: it holds spaces)."""
    count = 0
    for line in lines:
        if line.strip():
            family, cooperative, expression = line.split(" ", 2)
            get_function(family, expression.strip(), cooperative=cooperative == "1")
            count += 1
    return count


# --- offline compile (no GPU): NVRTC through CuPy's low-level bindings --------

_PTXAS_FUNCTION = re.compile(r"Function properties for (\S+)")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SHARED = re.compile(r"(\d+) bytes smem")


#: Name expressions an offline NVRTC program compiles at most. The compile
#: time is linear in them (160 rows_grad_cached instantiations took the same
#: time as one program and as eight of 20), so small batches cost nothing
#: and keep every process busy to the end (docs/notes/verification.md).
OFFLINE_BATCH = 24


def offline_batches(arch: str, kernels, jobs: int) -> list[tuple[str, list[str], str]]:
    """``kernels`` split into (family, name expressions, arch) batches of at
    most OFFLINE_BATCH, in a multiple of ``jobs`` where there are enough,
    each taking every n-th expression of its family, so the heavy
    instantiations (neighbours in the catalogue) spread over the batches."""
    by_family: dict[str, list[str]] = {}
    for k in kernels:
        by_family.setdefault(k.family, []).append(k.expression)
    batches = []
    for family, expressions in by_family.items():
        count = -(-len(expressions) // OFFLINE_BATCH)
        count = min(len(expressions), -(-count // jobs) * jobs)
        batches += [(family, expressions[i::count], arch) for i in range(count)]
    return batches


def compile_offline(arch: str, kernels, jobs: int | None = None, progress=None, record=None) -> list[dict]:
    """Compile kernels with NVRTC for ``arch`` (e.g. "sm_90") without a GPU.

    The instantiations are compiled as name expressions of small NVRTC
    programs (offline_batches), spread over ``jobs`` processes (default:
    the CPU count). ``progress(done, total)``, where given, is called as
    kernels finish. ``record``, a CompileRecord, answers the instantiations
    it holds for the same sources and takes the new results. Returns, per
    kernel: expression, registers, stack frame bytes, spill store and load
    bytes; and the same for device functions the kernels call, marked
    ``helper``. Raises RuntimeError with NVRTC's log on an error.
    """
    import concurrent.futures
    import os

    known: list[dict] = []
    if record is not None:
        known, kernels = record.lookup(arch, kernels)
    jobs = jobs or os.cpu_count() or 1
    batches = offline_batches(arch, kernels, jobs)
    total = sum(len(b[1]) for b in batches)
    results: list[list[dict]] = [[] for _ in batches]
    done = 0
    if jobs == 1 or len(batches) <= 1:
        for i, batch in enumerate(batches):
            results[i] = compile_batch(*batch)
            done += len(batch[1])
            if progress:
                progress(done, total)
    else:
        with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(compile_batch, *batch): i for i, batch in enumerate(batches)}
            try:
                for future in concurrent.futures.as_completed(futures):
                    i = futures[future]
                    results[i] = future.result()
                    done += len(batches[i][1])
                    if progress:
                        progress(done, total)
            except BaseException:  # an NVRTC error or ^C: the batches not started are not waited for
                pool.shutdown(cancel_futures=True)
                raise
    if record is not None:
        for (family, _, _), result in zip(batches, results):
            record.add(arch, family, result)
    return known + [r for part in results for r in part]


class CompileRecord:
    """Offline compile results kept on disk, so a run does not compile what
    an earlier one compiled from the same sources (the default test run's
    sm_90 sets, then the full compile check). One JSON file an architecture
    and family, keyed by a hash of NVRTC's version (major and minor), the
    options and the family's whole source: a changed header, option or
    NVRTC starts the file afresh, so the files number at most the
    architectures times the families. Files are replaced whole: two
    processes writing one directory at once can lose each other's
    additions (compiled again later), never mix them."""

    def __init__(self, directory):
        self.directory = Path(directory)

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def _key(family: str) -> str:
        from cupy_backends.cuda.libs import nvrtc

        h = hashlib.sha256(repr((nvrtc.getVersion(), OPTIONS, _OFFLINE_OPTIONS)).encode())
        h.update(source(family).encode())
        return h.hexdigest()

    def _load(self, arch: str, family: str) -> dict:
        import json

        empty = {"key": self._key(family), "kernels": {}, "helpers": {}}
        try:
            held = json.loads((self.directory / f"{arch}-{family}.json").read_text())
        except (OSError, ValueError):
            return empty
        return held if held.get("key") == empty["key"] else empty

    def lookup(self, arch: str, kernels) -> tuple[list[dict], list]:
        """(the held results of ``kernels``, with the helpers they call; the
        kernels not held)."""
        files: dict[str, dict] = {}
        found: list[dict] = []
        helpers: dict[str, dict] = {}
        missing = []
        for k in kernels:
            held = files.get(k.family) or files.setdefault(k.family, self._load(arch, k.family))
            entry = held["kernels"].get(k.expression)
            if entry is None:
                missing.append(k)
                continue
            entry = dict(entry)
            for name in entry.pop("helpers", ()):
                helpers[name] = held["helpers"][name]
            found.append(entry)
        return found + list(helpers.values()), missing

    def add(self, arch: str, family: str, results: list[dict]) -> None:
        """Keep one compiled batch's results (each kernel names the helpers
        its batch reported)."""
        import json
        import os

        held = self._load(arch, family)
        batch_helpers = {r["expression"]: r for r in results if r.get("helper")}
        held["helpers"].update(batch_helpers)
        for r in results:
            if not r.get("helper"):
                held["kernels"][r["expression"]] = dict(r, helpers=sorted(batch_helpers))
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{arch}-{family}.json"
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(held))
        os.replace(temporary, path)


@functools.lru_cache(maxsize=512)
def kernel_resources(family: str, expression: str, arch: int) -> tuple[int, int]:
    """(registers a thread, static shared bytes) of one instantiation
    compiled for sm_<arch> without a GPU: what its occupancy follows from
    (targets.Target.resident_per_sm)."""
    (entry,) = [r for r in compile_batch(family, [expression], f"sm_{arch}") if not r.get("helper")]
    return entry["registers"], entry["shared"]


#: options of the offline compile besides OPTIONS and the architecture
#: (-ftz=true: CuPy adds it at run time)
_OFFLINE_OPTIONS = ("-ftz=true", "--ptxas-options=--verbose")


def compile_batch(family: str, expressions: list[str], arch: str) -> list[dict]:
    """One NVRTC program of the family's instantiations ``expressions`` for
    ``arch``: what compile_offline returns for them."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source(family), f"{family}.cu", [], [])
    try:
        for e in expressions:
            nvrtc.addNameExpression(prog, e)
        options = [f"--gpu-architecture={arch}", *OPTIONS, *_OFFLINE_OPTIONS]
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as err:
            raise RuntimeError(f"NVRTC failed on {family}.cu for {arch}:\n{nvrtc.getProgramLog(prog)}") from err
        log = nvrtc.getProgramLog(prog)
        lowered = {nvrtc.getLoweredName(prog, e): e for e in expressions}
        return _parse_ptxas(log, lowered)
    finally:
        nvrtc.destroyProgram(prog)


def _parse_ptxas(log: str, lowered: dict[str, str]) -> list[dict]:
    found: dict[str, dict] = {}
    current = None
    for line in log.splitlines():
        m = _PTXAS_FUNCTION.search(line)
        if m:
            current = found.setdefault(m.group(1), {"expression": lowered.get(m.group(1), m.group(1))})
            continue
        if current is None:
            continue
        m = _PTXAS_STACK.search(line)
        if m:
            current["stack"], current["spill_stores"], current["spill_loads"] = map(int, m.groups())
            continue
        m = _PTXAS_REGS.search(line)
        if m:
            current["registers"] = int(m.group(1))
            m = _PTXAS_SHARED.search(line)
            current["shared"] = int(m.group(1)) if m else 0
    missing = set(lowered) - set(found)
    if missing:
        raise RuntimeError(f"ptxas reported nothing for {sorted(lowered[m] for m in missing)[:3]}")
    # Functions ptxas reports besides the kernels asked for are device
    # functions they call (float64 pow's __internal_accurate_pow): marked
    # helpers, so callers count kernels apart but still see their spills.
    for name, entry in found.items():
        if name not in lowered:
            entry["helper"] = True
    return list(found.values())


if __name__ == "__main__":  # precompile's worker: the kernels to compile on stdin
    _compile_share(sys.stdin.read().splitlines())
