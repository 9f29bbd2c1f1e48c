"""The repository's benchmark of record (docs/performance.md): every case of
bench/record_cases.py's CASES, CHANNEL_CASES and LP_CASES and cunorm/bench's BACKWARD_CASES
against torch eager and torch.compile, host overhead per call, and (--tune) a
sweep of launch overrides for the main cases. Writes bench.json and bench.md
to --out. The user-facing suites are ``python -m cunorm bench``.

    PYTHONPATH=. python bench/bench.py --out results/

A run longer than one call allows goes in parts (the device tool's 10
minutes a command), merged after:

    python bench/bench.py --part 0/2 --out p0   (and --part 1/2 --out p1)
    python bench/bench.py --merge p0/bench.json p1/bench.json --out results/
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from pathlib import Path

import cupy

import cunorm
from cunorm.bench._cases import BACKWARD_CASES, bench_backward_case, bench_case, bench_lp_case
from cunorm.bench._channel_cases import bench_channel_case
from cunorm.bench._host import host_rows
from cunorm.bench._timing import copy_bandwidth, torch
from record_cases import CASES, CHANNEL_CASES, LP_CASES  # (this script's folder is on sys.path)
from tune.forward import CHANNEL_TUNE, TUNE, tune_case, tune_channel_case


#: every case's name, in the order the run takes them (parts and merges follow it)
NAMES = [c[0] for c in (*CASES, *CHANNEL_CASES, *LP_CASES, *BACKWARD_CASES)]


def host_overhead(n_calls=2000) -> dict:
    """The host suite as {case: us} (bench/bench.py's table)."""
    out = {}
    for r in host_rows(n_calls):
        out[r["case"]] = r["us"]
        if r.get("torch_us"):
            out[r["case"] + " [torch]"] = r["torch_us"]
    return out


def fmt(v, spec=".1f"):
    return "" if v is None else format(v, spec)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--tune", action="store_true", help="also sweep launch overrides")
    ap.add_argument("--only", default="", help="run only the cases whose name contains this text")
    ap.add_argument("--part", default="0/1", help="K/N: run every N-th case from the K-th (K=0 also the host table)")
    ap.add_argument("--merge", nargs="+", metavar="BENCH_JSON", help="merge parts' bench.json into --out")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.merge:
        parts = [json.loads(Path(f).read_text()) for f in args.merge]
        result = {"meta": parts[0]["meta"], "cases": [], "tuning": [], "host_overhead_us": {}}
        for part in parts:
            for key in ("cases", "tuning"):
                result[key] += part[key]
            result["host_overhead_us"].update(part["host_overhead_us"])
        result["cases"].sort(key=lambda r: NAMES.index(r["case"]) if r["case"] in NAMES else len(NAMES))
        write(out_dir, result)
        return
    part, parts = (int(v) for v in args.part.split("/"))

    props = cupy.cuda.runtime.getDeviceProperties(0)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    # The GPU machine gets the tree without .git: bench/record_commit.sh
    # writes the hash into bench/.commit before a run is sent.
    stamp = Path(__file__).with_name(".commit")
    commit = (stamp.read_text().strip() if stamp.exists() else "") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"gpu": gpu, "date": datetime.date.today().isoformat(), "cupy": cupy.__version__,
            "torch": None if torch is None else torch.__version__, "cunorm": cunorm.__version__,
            "commit": commit or None, "driver": cupy.cuda.runtime.driverGetVersion()}
    copy_bw = copy_bandwidth()
    meta["copy_gbps"] = copy_bw
    print(f"{gpu}, {meta['date']}: copy bandwidth {copy_bw:.0f} GB/s (read + write)", flush=True)

    def mine(case):
        return NAMES.index(case[0]) % parts == part

    rows = []
    for case in [c for c in CASES if args.only in c[0] and mine(c)]:
        row = bench_case(*case, copy_bw, with_compile=not args.no_compile)
        rows.append(row)
        print(json.dumps(row), flush=True)
    for case in [c for c in CHANNEL_CASES if args.only in c[0] and mine(c)]:
        row = bench_channel_case(*case, copy_bw, with_compile=not args.no_compile)
        rows.append(row)
        print(json.dumps(row), flush=True)
    for case in [c for c in LP_CASES if args.only in c[0] and mine(c)]:
        row = bench_lp_case(*case, copy_bw, with_compile=not args.no_compile)
        rows.append(row)
        print(json.dumps(row), flush=True)
    for case in [c for c in BACKWARD_CASES if args.only in c[0] and mine(c)]:
        row = bench_backward_case(*case, copy_bw, with_compile=not args.no_compile)
        rows.append(row)
        print(json.dumps(row), flush=True)
    tuning = []
    if args.tune:
        for case in CASES:
            if case[0] in TUNE and args.only in case[0]:
                for r in tune_case(*case[:7], copy_bw):
                    tuning.append(r)
                    print("tune", json.dumps(r), flush=True)
        for case in CHANNEL_CASES:
            if case[0] in CHANNEL_TUNE and args.only in case[0]:
                for r in tune_channel_case(*case[:7], copy_bw):
                    tuning.append(r)
                    print("tune", json.dumps(r), flush=True)
    overhead = host_overhead() if (not args.only or "host" in args.only) and part == 0 else {}
    write(out_dir, {"meta": meta, "cases": rows, "tuning": tuning, "host_overhead_us": overhead})


def write(out_dir, result):
    """bench.json and bench.md of a run under out_dir."""
    meta, rows, tuning, overhead = result["meta"], result["cases"], result["tuning"], result["host_overhead_us"]
    gpu = meta["gpu"]
    copy_bw = meta["copy_gbps"]
    (out_dir / "bench.json").write_text(json.dumps(result, indent=1))

    lines = [f"GPU: {gpu}; date {meta['date']}; copy bandwidth {copy_bw:.0f} GB/s (read + write); "
             f"CuPy {meta['cupy']}; torch {meta['torch']}; commit {meta['commit']}", "",
             "| case | tier | cunorm ms | GB/s | floor% | target | torch eager ms | floor% | torch.compile ms | floor% | max rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['tier']} | {r['ms']:.3f} | {r['gbps']:.0f} | {r['floor_pct']:.1f} | "
                     f"{fmt(r['target_floor_pct'], 'd') if r['target_floor_pct'] else ''} | {fmt(r.get('torch_ms'), '.3f')} | "
                     f"{fmt(r.get('torch_floor_pct'))} | {fmt(r.get('compile_ms'), '.3f')} | "
                     f"{fmt(r.get('compile_floor_pct'))} | {fmt(r.get('max_rel_err'), '.1e')} |")
    lines += ["", "Host overhead per call, 1x4096 bf16 with weight (wall clock, enqueue-bound):", ""]
    lines += [f"- {k}: {v:.1f} us" for k, v in overhead.items()]
    if tuning:
        lines += ["", "| tuning case | override | ms | floor% |", "|---|---|---|---|"]
        lines += [f"| {t['case']} | {t['override']} | {fmt(t.get('ms'), '.3f')} | {fmt(t.get('floor_pct'))} |"
                  for t in tuning]
    (out_dir / "bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
