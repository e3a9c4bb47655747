"""`nibble bench serve`: benchmark any OpenAI-compatible server (nibble, vLLM, SGLang) under load.

This module is the public face: the CLI glue (`run_cli`, `main`; the flags are in serve_args.py) plus the Python
API re-exported from `nibble.bench.runner` (`BenchServeConfig`, `run_benchmark`, `run_sweep`, `BenchResult`).

Example:
    nibble bench serve --base-url http://127.0.0.1:8000 --tokenizer /models/Qwen3.5-122B-A10B-NVFP4 \\
        --random-input-len 1000 --random-output-len 1000 --concurrency-sweep 1,8,32,128 \\
        --prompts-per-concurrency 4 --save-result --plot sweep.png

Other workloads: `--dataset-name sharegpt --dataset-path ShareGPT_V3_unfiltered_cleaned_split.json`,
`--dataset-name custom --dataset-path prompts.jsonl`, `--dataset-name prefix_repetition` (shared prefixes,
for the prefix cache), or `--random-prefix-len N` (one prefix before every random prompt). Load and report
flags as vLLM's: `--request-rate` / `--burstiness` or `--ramp-up-strategy linear|exponential` with
`--ramp-up-start-rps` / `--ramp-up-end-rps`, `--goodput ttft:500 tpot:50`, `--percentile-metrics`,
`--metric-percentiles`, sampling fields `--temperature` / `--top-p` / `--top-k` / `--min-p` / `--repetition-penalty`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from nibble.bench.metrics import format_metrics, format_sweep
from nibble.bench.runner import (
    BenchError,
    BenchResult,
    BenchServeConfig,
    build_requests,
    run_benchmark,
    run_sweep,
)
from nibble.bench.serve_args import UsageError, add_cli_args, config_from_args, parse_number_list

__all__ = [
    "BenchError",
    "BenchResult",
    "BenchServeConfig",
    "add_cli_args",
    "build_requests",
    "config_from_args",
    "main",
    "run_benchmark",
    "run_cli",
    "run_sweep",
]


def _slug(text: str) -> str:
    name = Path(text.rstrip("/")).name or text
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"


def _result_path(args: argparse.Namespace, results: Sequence[BenchResult], sweep: bool) -> Path:
    if args.result_filename:
        return Path(args.result_dir) / args.result_filename
    first = results[0]
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    conc = first.config.max_concurrency
    shape = "sweep" if sweep else f"c{conc}" if conc else "cinf"
    name = f"bench-serve-{first.config.backend}-{_slug(first.model)}-{shape}-{stamp}.json"
    return Path(args.result_dir) / name


def _write_outputs(args: argparse.Namespace, results: list[BenchResult], sweep: bool) -> None:
    """Result JSON and plot as the flags ask; paths are printed so scripts can find them."""
    detailed = bool(args.save_detailed)
    rows = [r.to_dict(detailed=detailed) for r in results]
    json_path = None
    if args.save_result or args.save_detailed or args.result_filename:
        json_path = _result_path(args, results, sweep)
        doc: dict[str, Any] = rows[0]
        if sweep:
            doc = {
                "date": rows[0]["date"],
                "backend": rows[0]["backend"],
                "model_id": rows[0]["model_id"],
                "dataset": rows[0]["dataset"],
                "runs": rows,
            }
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"result written to {json_path}")
    plot_path = args.plot or (json_path.with_suffix(".png") if sweep and json_path else None)
    if plot_path:
        from nibble.bench.plot import plot_sweep

        first = results[0]
        label = f"{_slug(first.model)} ({first.config.backend})"
        title = f"{first.model}: {first.config.dataset_label()}"
        try:
            written = plot_sweep({label: rows}, plot_path, title=title)
        except ImportError as e:
            raise BenchError("plotting needs matplotlib: pip install matplotlib") from e
        print(f"plot written to {written}")


def run_cli(args: argparse.Namespace) -> int:
    """Run `bench serve` from parsed flags; returns the exit status (errors are printed, not raised)."""
    try:
        cfg = config_from_args(args)
        sweep = None
        if args.concurrency_sweep:
            sweep = parse_number_list(args.concurrency_sweep, "--concurrency-sweep", int)
            if any(c < 1 for c in sweep):
                raise UsageError(f"--concurrency-sweep values must be >= 1, got {args.concurrency_sweep}")
            if args.prompts_per_concurrency is not None and args.prompts_per_concurrency < 1:
                raise UsageError("--prompts-per-concurrency must be >= 1")
    except (BenchError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        dataset = cfg.dataset_label()
        print(f"benchmarking {cfg.url} ({cfg.backend}), {dataset}; {cfg.load_label()}", flush=True)
        if sweep:
            results = asyncio.run(
                run_sweep(
                    cfg,
                    sweep,
                    args.prompts_per_concurrency,
                    on_result=lambda r: print(format_metrics(r.metrics, dataset=dataset), flush=True),
                )
            )
            print(f"dataset: {dataset}")
            print(format_sweep([(r.config.max_concurrency or 0, r.metrics) for r in results]))
        else:
            results = [asyncio.run(run_benchmark(cfg))]
            print(format_metrics(results[0].metrics, dataset=dataset))
        _write_outputs(args, results, sweep is not None)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0 if any(r.metrics.num_completed for r in results) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point: `python -m nibble.bench.serve --help`."""
    parser = argparse.ArgumentParser(prog="nibble bench serve", description=__doc__.splitlines()[0])
    add_cli_args(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
