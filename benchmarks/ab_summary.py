"""Summarise an A/B timing of a kernel change made by `gpu_session.sh` stages `moeab` / `linearab` (this
checkout, "new", against a copy with older files laid over it, "old", in the same device call).

    python benchmarks/ab_summary.py moe docs/bench_results/<dir>/<call>      # moeab_{new,old}{1,2}.jsonl
    python benchmarks/ab_summary.py linear docs/bench_results/<dir>/<call>   # linearab_{new,old}.json

MoE: the table's choice ("auto") per (model, T), stream µs of each run and the change of the mean of the new
runs against the mean of the old, with the new side's % of copy bandwidth. Linear: µs per (model, shape,
variant, T), new against old, with cuBLAS bf16 beside it. Runs that errored or were skipped show as "-".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

MOE_RUNS = ("new1", "old1", "new2", "old2")


def _change(new: list[float], old: list[float]) -> str:
    if not new or not old:
        return "-"
    return f"{100 * (sum(new) / len(new)) / (sum(old) / len(old)) - 100:+.1f}%"


def moe_rows(folder: Path) -> list[str]:
    """One line per (model, T) of the `moeab_*.jsonl` files in `folder`."""
    runs: dict[str, dict[tuple[str, int], dict[str, Any]]] = {}
    for tag in MOE_RUNS:
        path = folder / f"moeab_{tag}.jsonl"
        if path.exists():
            recs = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
            runs[tag] = {(r["model"], r["T"]): r for r in recs if r.get("variant") == "auto"}
    if not runs:
        sys.exit(f"{folder}: no moeab_*.jsonl files")
    lines = ["model     T " + " ".join(f"{t:>9}" for t in runs) + "  new vs old  % copy (new)"]
    for key in sorted({k for r in runs.values() for k in r}):
        us = {t: r[key].get("stream_us") for t, r in runs.items() if key in r}
        new = [v for t, v in us.items() if t.startswith("new") and v]
        old = [v for t, v in us.items() if t.startswith("old") and v]
        pct = next((runs[t][key].get("pct_copy") for t in runs if t.startswith("new") and key in runs[t]), None)
        cells = " ".join(f"{us[t]:9.1f}" if us.get(t) else f"{'-':>9}" for t in runs)
        lines.append(f"{key[0]:5} {key[1]:5d} {cells}  {_change(new, old):>10}  "
                     + (f"{pct:11.1f}" if pct else f"{'-':>11}"))
    return lines


def linear_rows(folder: Path) -> list[str]:
    """One line per (model, shape, variant, T) of `linearab_new.json` against `linearab_old.json`."""
    def load(side: str) -> dict[tuple[str, str, str, int], dict[str, Any]]:
        path = folder / f"linearab_{side}.json"
        if not path.exists():
            sys.exit(f"{path}: missing")
        recs = json.loads(path.read_text())["records"]
        return {(r["model"], r["case"], r["variant"], r["tokens"]): r for r in recs if r.get("op") == "nvfp4_linear"}

    new, old = load("new"), load("old")
    lines = [f"{'model':5} {'shape':24} {'variant':8} {'T':>5} {'new us':>9} {'old us':>9} {'change':>8} {'cuBLAS':>9}"]
    for key in sorted(new):
        a, b = new[key].get("us"), old.get(key, {}).get("us")
        base = new[key].get("baseline_us")
        cells = " ".join(f"{v:9.1f}" if v else f"{'-':>9}" for v in (a, b))
        lines.append(f"{key[0]:5} {key[1]:24} {key[2]:8} {key[3]:5d} {cells} "
                     f"{_change([a] if a else [], [b] if b else []):>8} " + (f"{base:9.1f}" if base else f"{'-':>9}"))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=("moe", "linear"))
    ap.add_argument("folder", type=Path, help="the device call's extracted results")
    args = ap.parse_args()
    print("\n".join(moe_rows(args.folder) if args.kind == "moe" else linear_rows(args.folder)))


if __name__ == "__main__":
    main()
