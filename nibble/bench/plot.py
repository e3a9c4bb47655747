"""Plots of a concurrency sweep: output throughput, TPOT and TTFT against max concurrency.

Input rows are the flat result dicts of `BenchResult.to_dict()` (also what the result JSON holds), so
saved sweeps of different servers can be drawn on one figure. The figure is rendered with the Agg canvas
directly, which leaves the process-wide matplotlib backend alone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# (result key stem, y label, panel title); medians are drawn solid, p99 dashed.
_LATENCY_PANELS = (
    ("tpot", "TPOT (ms)", "Time per output token"),
    ("ttft", "TTFT (ms)", "Time to first token"),
)


def load_result_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a result JSON written by `nibble bench serve` (one pass or a sweep)."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and "runs" in data:
        return list(data["runs"])
    return [data]


def _concurrency(row: Mapping[str, Any]) -> float:
    """A pass without a cap is plotted at the number of requests it had in flight at its peak."""
    value = row.get("max_concurrency") or row.get("peak_concurrent_requests") or 0
    return float(value)


def plot_sweep(series: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path, title: str = "") -> Path:
    """Draw one line per series label and write a PNG to `path`; returns the path.

    Raises ImportError when matplotlib is not installed (it is an optional dependency).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_tput, *ax_lat = fig.subplots(1, 1 + len(_LATENCY_PANELS))
    for label, rows in series.items():
        ordered = sorted(rows, key=_concurrency)
        xs = [_concurrency(r) for r in ordered]
        (line,) = ax_tput.plot(xs, [r["output_throughput"] for r in ordered], marker="o", label=label)
        for ax, (key, _, _) in zip(ax_lat, _LATENCY_PANELS):
            if f"median_{key}_ms" not in ordered[0]:
                continue  # left out by --percentile-metrics: the panel stays empty
            color = line.get_color()
            ax.plot(xs, [r[f"median_{key}_ms"] for r in ordered], marker="o", color=color, label=f"{label} median")
            if f"p99_{key}_ms" in ordered[0]:
                ax.plot(
                    xs,
                    [r[f"p99_{key}_ms"] for r in ordered],
                    marker="x",
                    linestyle="--",
                    color=color,
                    label=f"{label} p99",
                )
    ax_tput.set_title("Output throughput")
    ax_tput.set_ylabel("output tokens/s")
    ax_tput.set_ylim(bottom=0)
    for ax, (_, ylabel, panel_title) in zip(ax_lat, _LATENCY_PANELS):
        ax.set_title(panel_title)
        ax.set_ylabel(ylabel)
    ticks = sorted({_concurrency(r) for rows in series.values() for r in rows})
    for ax in (ax_tput, *ax_lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("max concurrency")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # an empty panel has nothing to label
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
