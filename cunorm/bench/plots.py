"""The benchmark's PNG plots (matplotlib, when importable)."""
from __future__ import annotations

from pathlib import Path


class PlotUnavailable(RuntimeError):
    """matplotlib is not importable."""


def plot(result: dict, out_dir, required: bool = False) -> list[Path]:
    """sweep.png (effective GB/s against x's size per op, the copy bandwidth
    as a line) and speedup.png (cunorm's speed-up over each peer per case of
    the kernelbench and llm suites), for the suites the run has. Returns the
    files written. Without matplotlib: PlotUnavailable where ``required``
    (``--plot``, whose only job is the plots), else none written and a note
    on stderr (a benchmark run keeps its tables)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        import sys

        message = ("matplotlib is not importable, so no plots were drawn: pip install 'cunorm[bench]' (or "
                   "matplotlib), then `python -m cunorm bench --plot results.json` draws them from the saved run")
        if required:
            raise PlotUnavailable(message) from None
        print(message, file=sys.stderr)
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = result["meta"]
    rows = [r for r in result["cases"] if not r.get("skipped")]
    title = f"{meta['gpu']}, {meta['date']} (commit {meta['commit']})"
    written = []
    sweep = [r for r in rows if r["suite"] == "sweep"]
    if sweep:
        series = list(dict.fromkeys(r["series"] for r in sweep))
        cols = min(4, len(series))
        nrows = -(-len(series) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.2 * nrows), squeeze=False, sharey=True)
        for ax, name in zip(axes.flat, series):
            pts = sorted((r["bytes"], r["gbps"], r.get("torch_ms") and r["bytes"] / (r["torch_ms"] * 1e-3) / 1e9)
                         for r in sweep if r["series"] == name)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="cunorm")
            if any(p[2] for p in pts):
                ax.plot([p[0] for p in pts if p[2]], [p[2] for p in pts if p[2]], "s--", label="torch eager")
            ax.axhline(meta["copy_gbps"], color="grey", linestyle=":", label="copy bandwidth")
            ax.set_xscale("log", base=2)
            ax.set_title(name)
            ax.set_xlabel("bytes moved")
            ax.grid(alpha=0.3)
        for ax in axes.flat[len(series):]:
            ax.set_visible(False)
        axes[0][0].set_ylabel("effective GB/s")
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"effective bandwidth against size (fp32) - {title}", fontsize=10)
        fig.tight_layout()
        path = out / "sweep.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    bars = [r for r in rows if r["suite"] in ("kernelbench", "llm")]
    if bars:
        peers = [(k, label) for k, label in (("torch_speedup", "torch eager"), ("compile_speedup", "torch.compile"),
                                             ("liger_speedup", "Liger")) if any(r.get(k) for r in bars)]
        if peers:
            fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(bars) * len(peers) + 2), 4.5))
            width = 0.8 / len(peers)
            for i, (key, label) in enumerate(peers):
                ax.bar([j + i * width for j in range(len(bars))], [r.get(key) or 0 for r in bars], width,
                       label=f"over {label}")
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(bars))])
            ax.set_xticklabels([r["case"] for r in bars], rotation=60, ha="right", fontsize=7)
            ax.set_ylabel("cunorm speed-up (x)")
            ax.legend(fontsize=8)
            ax.set_title(f"speed-up per case - {title}", fontsize=10)
            fig.tight_layout()
            path = out / "speedup.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    return written
