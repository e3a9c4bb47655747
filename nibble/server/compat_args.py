"""The vLLM flags `nibble serve` takes so that a vLLM command line for Qwen3.5 works as is.

Some name what nibble always does with this model family (the tool-call and reasoning parsers, chunked prefill)
and are accepted and ignored; some map onto a nibble setting (--language-model-only, --uvicorn-log-level,
--hf-overrides);
-pp / -dp are accepted only at 1. vLLM flags that are not declared here or in launch.py stay argparse errors,
so that a setting nibble would not honour is never dropped silently.
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

# vLLM's names of the formats nibble parses: Qwen3.5 calls tools in the Qwen3-Coder XML format and thinks in
# <think> blocks.
TOOL_CALL_PARSERS = ("qwen3_coder", "qwen3_xml")
REASONING_PARSERS = ("qwen3", "deepseek_r1")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
MM_ENCODER_TP_MODES = ("weights", "data")
# --language-model-only: what --limit-mm-per-prompt says to serve text only (the vision tower is not loaded)
TEXT_ONLY_LIMITS = {"image": 0, "video": 0}


def add_compat_args(parser: argparse.ArgumentParser) -> None:
    """Declare the vLLM-compatibility flag group on `parser`."""
    compat = parser.add_argument_group(
        "vLLM compatibility", "vLLM flags accepted so that a vLLM command line for Qwen3.5 works as is; those "
        "whose help is in parentheses name what nibble does anyway and change nothing")
    compat.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="(always on: tool calls in the Qwen3-Coder format become OpenAI tool_calls)")
    compat.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                        help="(the Qwen3-Coder XML format is the one parsed)")
    compat.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                        help="(always on: text up to </think> becomes reasoning_content)")
    compat.add_argument("--reasoning-config", type=_reasoning_config, default=None, metavar="JSON",
                        help="(the reasoning markers of Qwen3.5, <think> and </think>, which thinking_token_budget "
                             "counts between; other markers are an error)")
    compat.add_argument("--trust-remote-code", action="store_true",
                        help="(nibble runs no code from the checkpoint; accepted and ignored)")
    compat.add_argument("--disable-log-requests", "--no-enable-log-requests", action="store_true",
                        help="(nibble does not log request contents)")
    compat.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic statistics lines (throughput, queues, KV-cache usage, prefix-cache hit "
                             "rate, speculative acceptance), which `nibble serve` otherwise logs every 10 s while the "
                             "engine works (run-batch logs none)")
    compat.add_argument("--enable-log-requests", action="store_true",
                        help="(nibble logs one line per request, its id, status, token counts and time, never its "
                             "contents; accepted and ignored)")
    compat.add_argument("--language-model-only", action="store_true",
                        help="serve text only: the same as --limit-mm-per-prompt '{\"image\": 0, \"video\": 0}' "
                             "(the vision tower is not loaded, its memory goes to the KV cache)")
    compat.add_argument("--mm-encoder-tp-mode", default=None, choices=MM_ENCODER_TP_MODES,
                        help="(either way nibble runs the vision tower unsharded on tensor-parallel rank 0)")
    compat.add_argument("--mm-processor-cache-gb", type=float, default=None, metavar="GB",
                        help="(nibble keeps no cache of preprocessed images; a prompt prefix that recurs with "
                             "the same images is served from the prefix cache instead)")
    compat.add_argument("--enable-chunked-prefill", action="store_true",
                        help="(always on: prompts longer than --max-num-batched-tokens are prefilled in chunks)")
    compat.add_argument("--async-scheduling", dest="async_scheduling", action="store_true", default=None,
                        help="(on by default: the next step is scheduled while the GPU runs this one; "
                             "--no-async-scheduling turns it off)")
    compat.add_argument("--disable-custom-all-reduce", action="store_true",
                        help="(tensor parallelism uses NCCL's all-reduce; there is no custom one to disable)")
    compat.add_argument("--pipeline-parallel-size", "-pp", type=_only_one("--pipeline-parallel-size"), default=1,
                        metavar="N", help="(only 1: nibble has no pipeline parallelism)")
    compat.add_argument("--data-parallel-size", "-dp", type=_only_one("--data-parallel-size"), default=1,
                        metavar="N", help="(only 1: nibble has no data parallelism)")
    compat.add_argument("--uvicorn-log-level", default=None, type=str.lower, choices=UVICORN_LOG_LEVELS,
                        help="log level of uvicorn's own loggers (default: --log-level)")
    compat.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="(uvicorn's access log is always off: nibble logs one line per request itself)")
    compat.add_argument("--enable-force-include-usage", action="store_true",
                        help="every streamed completion / chat completion ends with a usage chunk, as if it set "
                             "stream_options.include_usage")
    compat.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="(usage.prompt_tokens_details.cached_tokens is always returned)")
    compat.add_argument("--hf-overrides", type=hf_overrides_arg, default=None, metavar="JSON",
                        help=HF_OVERRIDES_HELP)
    compat.add_argument("--enable-request-id-headers", action="store_true",
                        help="(every response always carries X-Request-Id: the client's, else nibble's id)")


def hf_overrides_arg(text: str) -> dict[str, Any]:
    """argparse type of --hf-overrides (`nibble serve`, `generate`, `bench latency`): a JSON object."""
    from nibble.models.config import parse_hf_overrides

    try:
        return parse_hf_overrides(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


HF_OVERRIDES_HELP = ("config.json fields to replace, a JSON object deep-merged into the checkpoint's (vLLM's "
                     "flag), e.g. YaRN RoPE scaling for up to 1048576 tokens of --max-model-len: '{\"text_config\": "
                     "{\"rope_parameters\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
                     "\"original_max_position_embeddings\": 262144}}}'")


# vLLM's --reasoning-config keys and the values nibble's Qwen3.5 reasoning handling uses
REASONING_MARKERS = {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}


def _reasoning_config(text: str) -> dict[str, Any]:
    """argparse type of --reasoning-config: a JSON object whose markers, where given, are Qwen3.5's."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--reasoning-config must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--reasoning-config must be a JSON object, got {text!r}")
    parser = value.get("reasoning_parser")
    if parser is not None and parser not in REASONING_PARSERS:
        raise argparse.ArgumentTypeError(f"--reasoning-config: reasoning_parser {parser!r} is not supported; "
                                         f"known: {', '.join(REASONING_PARSERS)}")
    unknown = sorted(set(value) - set(REASONING_MARKERS) - {"reasoning_parser"})
    if unknown:
        raise argparse.ArgumentTypeError(f"--reasoning-config: unknown keys {unknown}; known: "
                                         f"{', '.join(REASONING_MARKERS)}")
    for key, marker in REASONING_MARKERS.items():
        if key in value and value[key] != marker:
            raise argparse.ArgumentTypeError(f"--reasoning-config: {key} {value[key]!r} is not supported; Qwen3.5 "
                                             f"reasons between <think> and </think>")
    return value


def _only_one(flag: str) -> Any:
    """argparse type of a vLLM parallelism flag nibble accepts only at 1."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes an integer, got {text!r}") from None
        if value != 1:
            raise argparse.ArgumentTypeError(f"{flag} {value} is not supported (only 1); to spread the model over "
                                             "several GPUs, use --tensor-parallel-size with "
                                             "--enable-expert-parallel")
        return value

    return parse


def mm_limits(args: argparse.Namespace) -> dict[str, int] | None:
    """EngineConfig.limit_mm_per_prompt from --limit-mm-per-prompt and --language-model-only. Raises
    EngineConfigError when the two disagree (a non-zero limit with --language-model-only)."""
    limits = getattr(args, "limit_mm_per_prompt", None)
    if not getattr(args, "language_model_only", False):
        return limits
    allowed = {kind: n for kind, n in (limits or {}).items() if n != 0}
    if allowed:
        from nibble.engine.config import EngineConfigError

        raise EngineConfigError(f"--language-model-only serves text only, but --limit-mm-per-prompt allows "
                                f"{allowed}; drop one of them")
    return dict(TEXT_ONLY_LIMITS)


def log_compat_notes(args: argparse.Namespace, logger: logging.Logger) -> None:
    """INFO lines for accepted vLLM flags whose setting nibble runs differently, where the difference shows."""
    tp = getattr(args, "tensor_parallel_size", None) or 1
    mode = getattr(args, "mm_encoder_tp_mode", None)
    if mode is not None and tp > 1:
        logger.info("--mm-encoder-tp-mode %s: nibble runs the vision tower unsharded on tensor-parallel rank 0 "
                    "(the text model is split over %d GPUs)", mode, tp)
