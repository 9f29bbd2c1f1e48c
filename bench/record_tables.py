"""The tables of docs/performance.md, made from a saved run of the benchmark
of record (bench/bench.py's bench.json, kept as docs/bench/record.json):
the forward cases, the backward cases and the host time per call. The
test suite checks that performance.md holds exactly these tables.

    python bench/record_tables.py docs/bench/record.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

BEGIN = "<!-- the record's tables: python bench/record_tables.py docs/bench/record.json -->"
END = "<!-- end of the record's tables -->"


def _f(value, spec=".3f") -> str:
    return "" if value is None else format(value, spec)


def tables(record: dict) -> str:
    """The three tables as Markdown, with a line naming the run."""
    meta = record["meta"]
    out = [f"{meta['gpu']}, {meta['date']}, commit {meta['commit']}, copy bandwidth {meta['copy_gbps']:.0f} GB/s "
           "(read plus written).", "",
           "| case | tier | GPU ms | floor% | target | one call ms | torch eager GPU / one call | "
           "torch.compile GPU / one call | max rel err |",
           "|---|---|---|---|---|---|---|---|---|"]
    backward = []
    for r in record["cases"]:
        if r["case"].startswith("backward"):
            backward.append(r)
            continue
        out.append(f"| {r['case']} | {r['tier']} | {_f(r['ms'])} | {_f(r['floor_pct'], '.1f')} | "
                   f"{_f(r.get('target_floor_pct'), 'd')} | {_f(r.get('single_ms'))} | "
                   f"{_f(r.get('torch_ms'))} / {_f(r.get('torch_single_ms'))} | "
                   f"{_f(r.get('compile_ms'))} / {_f(r.get('compile_single_ms'))} | "
                   f"{_f(r.get('max_rel_err'), '.1e')} |")
    out += ["", "| backward case | tier | GPU ms | floor% | target | one call ms | torch eager GPU ms (floor%) / "
                "one call | torch.compile GPU ms (floor%) / one call | max rel err |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in backward:
        out.append(f"| {r['case'].removeprefix('backward ')} | {r['tier']} | {_f(r['ms'])} | "
                   f"{_f(r['floor_pct'], '.1f')} | {_f(r.get('target_floor_pct'), 'd')} | {_f(r.get('single_ms'))} | "
                   f"{_f(r.get('torch_ms'))} ({_f(r.get('torch_floor_pct'), '.1f')}) / "
                   f"{_f(r.get('torch_single_ms'))} | "
                   f"{_f(r.get('compile_ms'))} ({_f(r.get('compile_floor_pct'), '.1f')}) / "
                   f"{_f(r.get('compile_single_ms'))} | "
                   f"{_f(r.get('max_rel_err'), '.1e')} |")
    host = record.get("host_overhead_us", {})
    out += ["", "| host time per call | cunorm us | torch us |", "|---|---|---|"]
    for name, us in host.items():
        if name.endswith(" [torch]"):
            continue
        out.append(f"| {name} | {us:.1f} | {_f(host.get(name + ' [torch]'), '.1f')} |")
    return "\n".join(out)


def block(record: dict) -> str:
    """The tables between the markers performance.md carries them in."""
    return f"{BEGIN}\n\n{tables(record)}\n\n{END}"


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    print(block(json.loads(Path(args[0]).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
