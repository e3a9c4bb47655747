"""The flags of `nibble bench serve`, named and defined as `vllm bench serve` has them, and their translation
into a checked `BenchServeConfig`. serve.py runs the command."""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nibble.bench.arrivals import RAMP_UP_STRATEGIES
from nibble.bench.backends import BACKEND_ENDPOINTS
from nibble.bench.bench_config import DATASETS, BenchError, BenchServeConfig
from nibble.bench.metrics import GOODPUT_METRICS, PERCENTILE_METRICS


class UsageError(ValueError):
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
    data.add_argument(
        "--model-path", default=None, help="local model directory whose tokenizer.json is used (nibble's older name)"
    )
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
    req.add_argument(
        "--extra-body", default=None, help="JSON object merged into every request body (over the fields below)"
    )

    sampling = parser.add_argument_group("sampling parameters (sent in every request body; unset ones are left out)")
    sampling.add_argument("--temperature", type=float, default=0.0, help="always sent; 0 = greedy")
    sampling.add_argument("--top-p", type=float, default=None, help="nucleus probability mass, in (0, 1]")
    sampling.add_argument("--top-k", type=int, default=None, help="most likely tokens to sample from (-1: all)")
    sampling.add_argument("--min-p", type=float, default=None, help="least probability relative to the top token")
    sampling.add_argument("--repetition-penalty", type=float, default=None, help="> 1 discourages repeats; 1: none")

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
    load.add_argument(
        "--ramp-up-strategy",
        choices=RAMP_UP_STRATEGIES,
        default=None,
        help="instead of --request-rate, move the rate from --ramp-up-start-rps to --ramp-up-end-rps over the "
        "requests of a pass, linearly or exponentially",
    )
    load.add_argument("--ramp-up-start-rps", type=float, default=None, help="request rate of the first request")
    load.add_argument("--ramp-up-end-rps", type=float, default=None, help="request rate of the last request")
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
    out.add_argument(
        "--metric-percentiles",
        "--percentiles",
        dest="metric_percentiles",
        default="50,90,99",
        help="comma-separated percentiles of the selected metrics, e.g. 25,50,75,99.9",
    )
    out.add_argument(
        "--percentile-metrics",
        default=",".join(PERCENTILE_METRICS),
        help="comma-separated metrics whose mean, median, std and percentiles are reported, among "
        f"{', '.join(PERCENTILE_METRICS)} (default: all; vLLM's default leaves out e2el)",
    )
    out.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:VALUE",
        help="service-level objectives in ms, e.g. ttft:500 tpot:50 (keys: "
        f"{', '.join(GOODPUT_METRICS)}): also report request goodput, the completed requests per second that "
        "meet every one",
    )
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


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """`--goodput` pairs such as `ttft:500` as {metric: objective in ms}; `UsageError` names a bad pair."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep:
            raise UsageError(
                f"--goodput takes KEY:VALUE pairs, a metric name and a number of milliseconds (e.g. ttft:500), "
                f"got {item!r}"
            )
        if name not in GOODPUT_METRICS:
            choices = ", ".join(GOODPUT_METRICS)
            raise UsageError(f"--goodput: unknown metric {name!r} in {item!r} (choose from {choices})")
        try:
            limit = float(value)
        except ValueError:
            raise UsageError(f"--goodput: {item!r} needs a number of milliseconds after the colon") from None
        if not 0 <= limit < math.inf:
            raise UsageError(f"--goodput: the objective for {name} must be a finite number of ms >= 0, got {value}")
        slos[name] = limit
    return slos


def parse_percentile_metrics(text: str) -> tuple[str, ...]:
    """`--percentile-metrics` as a tuple of metric names; `UsageError` names an unknown one."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise UsageError(f"--percentile-metrics is empty (choose from {', '.join(PERCENTILE_METRICS)})")
    for name in names:
        if name not in PERCENTILE_METRICS:
            raise UsageError(
                f"--percentile-metrics: unknown metric {name!r} (choose from {', '.join(PERCENTILE_METRICS)})"
            )
    return names


def parse_number_list(text: str, what: str, kind: type) -> list[Any]:
    """A comma-separated list of `kind` values from flag `what`; `UsageError` names the flag."""
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError as e:
        raise UsageError(f"{what} must be a comma-separated list of numbers, got {text!r}") from e
    if not values:
        raise UsageError(f"{what} is empty")
    return values


def _tokenizer_path(args: argparse.Namespace) -> str:
    """--tokenizer, else --model-path, else --model when it is a local directory (vLLM's fallback); checked
    here so that a wrong path stops the run before anything is sent."""
    tokenizer = args.tokenizer or args.model_path or (args.model if args.model and os.path.isdir(args.model) else None)
    if tokenizer is None:
        raise BenchError(f"the {args.dataset_name} dataset needs a tokenizer: pass --tokenizer or --model-path")
    path = Path(tokenizer)
    if not path.exists():
        # vLLM also takes Hugging Face hub names here; nibble never downloads, so say what it wants instead
        raise BenchError(
            f"tokenizer path {tokenizer} does not exist (pass a local tokenizer.json or a directory holding one; "
            "hub names are not downloaded)"
        )
    if path.is_dir() and not (path / "tokenizer.json").is_file():
        raise BenchError(f"tokenizer directory {tokenizer} holds no tokenizer.json")
    return tokenizer


def config_from_args(args: argparse.Namespace) -> BenchServeConfig:
    """Turn parsed flags into a validated config; `BenchError` or `UsageError` says which value is wrong."""
    try:
        extra_body = json.loads(args.extra_body) if args.extra_body else {}
    except json.JSONDecodeError as e:
        raise BenchError(f"--extra-body is not valid JSON: {e}") from e
    if not isinstance(extra_body, dict):
        raise BenchError("--extra-body must be a JSON object")
    percentiles = tuple(parse_number_list(args.metric_percentiles, "--metric-percentiles", float))
    percentile_metrics = parse_percentile_metrics(args.percentile_metrics)
    goodput = parse_goodput(args.goodput) if args.goodput else {}
    tokenizer = _tokenizer_path(args)
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
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        extra_body=extra_body,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        ramp_up_strategy=args.ramp_up_strategy,
        ramp_up_start_rps=args.ramp_up_start_rps,
        ramp_up_end_rps=args.ramp_up_end_rps,
        num_warmups=args.num_warmups,
        reset_prefix_cache=args.reset_prefix_cache,
        percentiles=percentiles,
        percentile_metrics=percentile_metrics,
        goodput=goodput,
        request_timeout_s=args.request_timeout,
        disable_tqdm=args.disable_tqdm,
    )
    cfg.validate()
    return cfg
