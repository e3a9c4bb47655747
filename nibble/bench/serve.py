"""`nibble bench serve`: benchmark any OpenAI-compatible server (nibble, vLLM, SGLang) under load.

This module is the public face: the CLI glue (`add_cli_args`, `run_cli`, `main`) plus the Python API
re-exported from `nibble.bench.runner` (`BenchServeConfig`, `run_benchmark`, `run_sweep`, `BenchResult`).

Example:
    nibble bench serve --base-url http://127.0.0.1:8000 --tokenizer /models/Qwen3.5-122B-A10B-NVFP4 \\
        --random-input-len 1000 --random-output-len 1000 --concurrency-sweep 1,8,32,128 \\
        --prompts-per-concurrency 4 --save-result --plot sweep.png

Other workloads: `--dataset-name sharegpt --dataset-path ShareGPT_V3_unfiltered_cleaned_split.json`,
`--dataset-name custom --dataset-path prompts.jsonl`, `--dataset-name prefix_repetition` (shared prefixes,
for the prefix cache), or `--random-prefix-len N` (one prefix before every random prompt).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from nibble.bench.backends import BACKEND_ENDPOINTS
from nibble.bench.metrics import format_metrics, format_sweep
from nibble.bench.runner import (
    DATASETS,
    BenchError,
    BenchResult,
    BenchServeConfig,
    build_requests,
    run_benchmark,
    run_sweep,
)

__all__ = [
    "BenchError",
    "BenchResult",
    "BenchServeConfig",
    "add_cli_args",
    "build_requests",
    "main",
    "run_benchmark",
    "run_cli",
    "run_sweep",
]


class _UsageError(ValueError):
    """A command-line value that parses but makes no sense."""


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Register the `bench serve` flags on `parser` (flag names follow `vllm bench serve`)."""
    srv = parser.add_argument_group("server")
    srv.add_argument(
        "--backend",
        choices=sorted(BACKEND_ENDPOINTS),
        default="openai",
        help="openai: /v1/completions; openai-chat: /v1/chat/completions",
    )
    srv.add_argument(
        "--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000 (overrides --host/--port)"
    )
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--endpoint", default=None, help="request path (default: the backend's)")
    srv.add_argument(
        "--model", default=None, help="model name sent in requests (default: the first id of GET /v1/models)"
    )
    srv.add_argument("--api-key", default=None, help="Bearer token (default: $OPENAI_API_KEY)")
    srv.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds per request")

    data = parser.add_argument_group("dataset")
    data.add_argument(
        "--dataset-name",
        choices=list(DATASETS),
        default="random",
        help="random: random tokens; sharegpt / custom: prompts from --dataset-path; prefix_repetition: "
        "random prompts sharing a few prefixes",
    )
    data.add_argument(
        "--dataset-path",
        default=None,
        help="sharegpt: JSON list of conversations; custom: JSON lines with 'prompt' (and optional 'output_tokens')",
    )
    data.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json or a directory holding one "
        "(default: --model-path, or --model when it is a local directory)",
    )
    data.add_argument("--model-path", default=None, help="local model directory (used for its tokenizer)")
    data.add_argument("--num-prompts", type=int, default=1000)
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths drawn uniformly in [len*(1-r), len*(1+r)]; 0 = fixed lengths",
    )
    data.add_argument(
        "--random-prefix-len",
        type=int,
        default=0,
        help="random tokens shared by every random prompt, before (and on top of) its --random-input-len",
    )
    data.add_argument(
        "--prompt-token-ids", action="store_true", help="send prompts as token-id lists (completions API only)"
    )
    data.add_argument("--seed", type=int, default=0, help="seeds the dataset's sampling and shuffling")
    data.add_argument(
        "--no-oversample",
        action="store_true",
        help="sharegpt/custom: send the usable prompts once when fewer than --num-prompts (default: repeat some)",
    )
    data.add_argument(
        "--disable-shuffle", action="store_true", help="take file prompts in file order, prefix groups in order"
    )

    files = parser.add_argument_group("sharegpt and custom datasets")
    files.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="tokens to generate per ShareGPT request (default: the token length of the conversation's reply)",
    )
    files.add_argument(
        "--custom-output-len",
        type=int,
        default=256,
        help="tokens to generate per custom request; a line's 'output_tokens' overrides it",
    )
    files.add_argument(
        "--skip-chat-template",
        "--custom-skip-chat-template",
        dest="skip_chat_template",
        action="store_true",
        help="custom, --backend openai: send prompts as they are instead of wrapped in the model's chat "
        "template (openai-chat never wraps them: the server does)",
    )

    prefix = parser.add_argument_group("prefix_repetition dataset")
    prefix.add_argument("--prefix-repetition-prefix-len", type=int, default=256, help="tokens of each shared prefix")
    prefix.add_argument(
        "--prefix-repetition-suffix-len", type=int, default=256, help="random tokens after the prefix, per prompt"
    )
    prefix.add_argument(
        "--prefix-repetition-num-prefixes",
        type=int,
        default=10,
        help="distinct prefixes; --num-prompts are spread evenly over them",
    )
    prefix.add_argument("--prefix-repetition-output-len", type=int, default=128, help="tokens to generate per request")

    req = parser.add_argument_group("requests")
    req.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos (for servers that reject unknown fields)",
    )
    req.add_argument("--temperature", type=float, default=0.0)
    req.add_argument("--extra-body", default=None, help="JSON object merged into every request body")

    load = parser.add_argument_group("load")
    load.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s with gamma-distributed arrivals (default inf: all at once)",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of arrival gaps: 1 = Poisson, < 1 burstier, > 1 steadier",
    )
    load.add_argument("--num-warmups", type=int, default=0, help="warm-up requests excluded from stats")
    load.add_argument("--keep-prefix-cache", dest="reset_prefix_cache", action="store_false",
                      help="do not reset the server's prefix cache before each pass (by default POST "
                           "/reset_prefix_cache, so that repeated prompts are not measured as cache hits)")
    load.add_argument(
        "--concurrency-sweep", default=None, metavar="C1,C2,...", help="one pass per max concurrency, e.g. 1,8,32,128"
    )
    load.add_argument(
        "--prompts-per-concurrency",
        type=int,
        default=None,
        help="in a sweep, prompts per pass = this x concurrency (default: --num-prompts)",
    )

    out = parser.add_argument_group("output")
    out.add_argument("--percentiles", default="50,90,99", help="comma-separated latency percentiles")
    out.add_argument("--disable-tqdm", action="store_true")
    out.add_argument("--save-result", action="store_true", help="write the result JSON")
    out.add_argument(
        "--save-detailed", action="store_true", help="also write per-request arrays (implies --save-result)"
    )
    out.add_argument("--result-dir", default=".")
    out.add_argument("--result-filename", default=None, help="implies --save-result")
    out.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="PNG of throughput/TPOT/TTFT vs concurrency (a sweep with --save-result "
        "writes one next to the JSON by default)",
    )


def _parse_number_list(text: str, what: str, kind: type) -> list[Any]:
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError as e:
        raise _UsageError(f"{what} must be a comma-separated list of numbers, got {text!r}") from e
    if not values:
        raise _UsageError(f"{what} is empty")
    return values


def _tokenizer_path(args: argparse.Namespace) -> str | None:
    if args.tokenizer:
        return args.tokenizer
    if args.model_path:
        return args.model_path
    if args.model and os.path.isdir(args.model):
        return args.model
    return None


def config_from_args(args: argparse.Namespace) -> BenchServeConfig:
    """Turn parsed flags into a validated config; `BenchError` or `ValueError` says which value is wrong."""
    try:
        extra_body = json.loads(args.extra_body) if args.extra_body else {}
    except json.JSONDecodeError as e:
        raise BenchError(f"--extra-body is not valid JSON: {e}") from e
    if not isinstance(extra_body, dict):
        raise BenchError("--extra-body must be a JSON object")
    percentiles = tuple(_parse_number_list(args.percentiles, "--percentiles", float))
    tokenizer = _tokenizer_path(args)
    if tokenizer is None:
        raise BenchError(f"the {args.dataset_name} dataset needs a tokenizer: pass --tokenizer or --model-path")
    if not Path(tokenizer).exists():
        raise BenchError(f"tokenizer path {tokenizer} does not exist")
    if args.dataset_path and not Path(args.dataset_path).is_file():
        what = "is not a file" if Path(args.dataset_path).exists() else "does not exist"
        raise BenchError(f"dataset file {args.dataset_path} {what}")
    cfg = BenchServeConfig(
        base_url=args.base_url or f"http://{args.host}:{args.port}",
        backend=args.backend,
        endpoint=args.endpoint,
        model=args.model,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
        tokenizer=tokenizer,
        dataset_name=args.dataset_name,
        dataset_path=args.dataset_path,
        num_prompts=args.num_prompts,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        random_prefix_len=args.random_prefix_len,
        sharegpt_output_len=args.sharegpt_output_len,
        custom_output_len=args.custom_output_len,
        skip_chat_template=args.skip_chat_template,
        prefix_repetition_prefix_len=args.prefix_repetition_prefix_len,
        prefix_repetition_suffix_len=args.prefix_repetition_suffix_len,
        prefix_repetition_num_prefixes=args.prefix_repetition_num_prefixes,
        prefix_repetition_output_len=args.prefix_repetition_output_len,
        no_oversample=args.no_oversample,
        disable_shuffle=args.disable_shuffle,
        prompt_token_ids=args.prompt_token_ids,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        extra_body=extra_body,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        num_warmups=args.num_warmups,
        reset_prefix_cache=args.reset_prefix_cache,
        percentiles=percentiles,
        request_timeout_s=args.request_timeout,
        disable_tqdm=args.disable_tqdm,
    )
    cfg.validate()
    return cfg


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
            sweep = _parse_number_list(args.concurrency_sweep, "--concurrency-sweep", int)
            if any(c < 1 for c in sweep):
                raise _UsageError(f"--concurrency-sweep values must be >= 1, got {args.concurrency_sweep}")
            if args.prompts_per_concurrency is not None and args.prompts_per_concurrency < 1:
                raise _UsageError("--prompts-per-concurrency must be >= 1")
    except (BenchError, _UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        dataset = cfg.dataset_label()
        print(f"benchmarking {cfg.url} ({cfg.backend}), {dataset}", flush=True)
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
