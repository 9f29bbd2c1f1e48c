"""Where do a kernel's instructions and stalls go? The opcode mix and the
warp-stall reasons of each kernel in Nsight Compute's SASS source page.

On the GPU machine (any script that launches the kernel; the source
counters need no source files):
    ncu --clock-control none -k regex:rows_cached --launch-skip 2 --launch-count 1 \\
        --section SourceCounters --section WarpStateStats --import-source no -o r python3 SCRIPT
    ncu -i r.ncu-rep --page source --print-source sass --csv > src.csv
Then, anywhere:
    python3 bench/tools/sass_mix.py src.csv [--kernel SUBSTRING] [--listing]
prints, per kernel, the warp instructions executed, each opcode's share of
them and each stall reason's share of the stall samples; --listing adds
every instruction with its executed count (a loop body shows as the run of
instructions with the same, larger count).
"""
from __future__ import annotations

import argparse
import collections
import csv
import re
import sys
from dataclasses import dataclass, field

_OPCODE = re.compile(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


@dataclass
class Kernel:
    name: str
    header: list[str] | None = None
    rows: list[dict[str, str]] = field(default_factory=list)


def read_kernels(lines) -> list[Kernel]:
    """The kernels of a source-page CSV: a "Kernel Name" line, then a header
    line starting with "Address", then a row an instruction."""
    kernels: list[Kernel] = []
    for row in csv.reader(lines):
        if not row:
            continue
        if row[0] == "Kernel Name":
            kernels.append(Kernel(row[1]))
        elif row[0] == "Address" and kernels:
            kernels[-1].header = row
        elif kernels and kernels[-1].header:
            kernels[-1].rows.append(dict(zip(kernels[-1].header, row)))
    return kernels


def _count(text: str) -> float:
    text = (text or "0").replace(",", "")
    return float(text) if text else 0.0


def mix(kernel: Kernel) -> tuple[int, collections.Counter, collections.Counter]:
    """Warp instructions executed, executed instructions by opcode, and
    stall samples by reason (all samples; the "(Not Issued)" columns, a
    subset of them, are left out)."""
    ops: collections.Counter = collections.Counter()
    stalls: collections.Counter = collections.Counter()
    reasons = [h for h in kernel.header or () if h.startswith("stall_") and "(" not in h]
    for r in kernel.rows:
        m = _OPCODE.match(r.get("Source", "").strip())
        if not m:
            continue
        ops[m.group(1)] += int(_count(r.get("Instructions Executed")))
        for h in reasons:
            stalls[h.removeprefix("stall_")] += _count(r.get(h))
    return sum(ops.values()), ops, stalls


def report(kernels: list[Kernel], substring: str | None = None, listing: bool = False, out=sys.stdout) -> None:
    for k in kernels:
        if substring and substring not in k.name:
            continue
        total, ops, stalls = mix(k)
        print(f"== {k.name[:200]}", file=out)
        print(f"  warp instructions executed: {total:,}", file=out)
        if total:
            print("  opcodes: " + ", ".join(f"{op} {100 * n / total:.1f}%" for op, n in ops.most_common(24)), file=out)
        samples = sum(stalls.values())
        if samples:
            print("  stalls: " + ", ".join(f"{s} {100 * n / samples:.1f}%" for s, n in stalls.most_common(10)),
                  file=out)
        if listing:
            for r in k.rows:
                print(f"  {int(_count(r.get('Instructions Executed'))):>12,}  {r.get('Source', '').strip()}", file=out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu --page source --print-source sass --csv output")
    parser.add_argument("--kernel", help="only kernels whose name contains this")
    parser.add_argument("--listing", action="store_true", help="every instruction with its executed count")
    args = parser.parse_args(argv)
    with open(args.csv, newline="") as f:
        report(read_kernels(f), args.kernel, args.listing)


if __name__ == "__main__":
    main()
