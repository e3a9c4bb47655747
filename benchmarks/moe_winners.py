"""`fused_moe` tuning-table entries from a `moe_bench.py --variant` result: for each (model, T) where an
`auto:<name>` variant's stream time beats the table's own choice ("auto", same run) by at least `--min-gain`
percent with a sound error, one entry for exactly that layer shape and token count, whose config is the
table's full configuration there with the variant's fields laid over it (so the entry means the same whatever
other tables lie under it).

    python benchmarks/moe_winners.py out/moe.json --out out/moe_entries.json [--min-gain 2] [--only REGEX]

`install_tuning_entries.py fused_moe out/moe_entries.json --prepend` puts them ahead of the table's entries.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_bench import MAX_ERR, spec

from nibble.kernels.fused_moe import tuning_key
from nibble.kernels.tuning_tables import lookup


def winners(result: dict[str, Any], shapes: Callable[[str], dict[str, int]], device: str, min_gain: float,
            only: str = "") -> list[dict[str, Any]]:
    """Entries `{"when": ..., "config": ..., "measured": ...}` of the winning variants, one per (model, T);
    shapes: a moe_bench model name (whole layer or one rank's share) -> its layer shapes (`moe_bench.spec`)."""
    by: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in result["records"]:
        by.setdefault((r["model"], r["T"]), []).append(r)
    entries = []
    for (model, t), recs in by.items():
        ok = [r for r in recs if "error" not in r and r["err"] < MAX_ERR]
        auto = next((r for r in ok if r["variant"] == "auto"), None)
        rivals = [r for r in ok if r["variant"].startswith("auto:") and re.search(only, r["variant"])]
        if auto is None or not rivals:
            continue
        best = min(rivals, key=lambda r: r["stream_us"])
        gain = 100 * (1 - best["stream_us"] / auto["stream_us"])
        if gain < min_gain:
            continue
        m = shapes(model)
        key = tuning_key(t, m["hidden"], m["inter"], m["experts"], m["top_k"], True, m["routed"])
        when = {f: key[f] for f in ("tokens", "hidden", "inter", "experts", "top_k")}
        config = {**lookup("fused_moe", device, key), **best["config"]}
        entries.append({"when": when, "config": config,
                        "measured": {"variant": best["variant"], "stream_us": round(best["stream_us"], 2),
                                     "auto_stream_us": round(auto["stream_us"], 2), "gain_pct": round(gain, 1),
                                     "device": result.get("device")}})
    return entries


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", type=Path, help="moe_bench.py --out file")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--min-gain", type=float, default=2.0, help="percent less stream time than auto")
    ap.add_argument("--only", default="", help="regular expression the variant names must match")
    ap.add_argument("--device", default="cuda:0", help="whose tables give the base configuration")
    args = ap.parse_args()
    entries = winners(json.loads(args.result.read_text()), spec, args.device, args.min_gain, args.only)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(entries, indent=1) + "\n")
    for e in entries:
        w, m = e["when"], e["measured"]
        print(f"H={w['hidden']} T={w['tokens']}: {m['variant']} {m['stream_us']} us against auto "
              f"{m['auto_stream_us']} us (-{m['gain_pct']}%)")
    print(f"{args.out}: {len(entries)} entries")


if __name__ == "__main__":
    main()
