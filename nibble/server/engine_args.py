"""The model, engine, media and chat-template flags of `nibble serve` (and `nibble run-batch`), and the
EngineConfig they make. Engine flags default to None, meaning "EngineConfig's default", so the defaults live
in one place and `--help` does not need to import torch."""

from __future__ import annotations

import argparse
import json
from typing import Any

from nibble.server.compat_args import add_compat_args, mm_limits

# CLI destination -> EngineConfig field, for the flags that map one to one.
_ENGINE_FIELDS = (
    "model", "tokenizer", "served_model_name", "device", "dtype", "kv_cache_dtype", "load_format", "max_model_len",
    "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "kv_cache_memory_gb", "block_size",
    "enforce_eager", "async_scheduling", "shared_expert_overlap", "warmup", "cuda_graph_max_batch_size",
    "cuda_graph_max_mixed_tokens", "seed",
    "moe_backend", "attention_backend", "linear_backend", "tensor_parallel_size", "enable_expert_parallel",
    "max_waiting_requests", "chat_template", "generation_config", "override_generation_config", "enable_prefix_caching",
    "prefix_cache_slots", "num_speculative_tokens", "scheduling_policy", "allowed_local_media_path",
    "allowed_media_domains", "media_fetch_timeout_s", "max_media_bytes", "quantization", "max_logprobs",
    "hf_overrides",
)


def add_engine_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare the model, engine, media and chat-template flags (those that shape response bodies) on `parser`
    and return it: shared by `nibble serve` and `nibble run-batch`, which answer requests alike."""
    responses = parser.add_argument_group("model name and chat template")
    responses.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                           help="model name(s) clients use in requests and see in /v1/models (default: --model); "
                                "responses carry the first")
    responses.add_argument("--chat-template", default=None,
                           help="a Jinja chat template, or the path of a file holding one, in place of the model's")
    responses.add_argument("--default-chat-template-kwargs", type=_json_object("--default-chat-template-kwargs"),
                           default=None, metavar="JSON",
                           help="chat template kwargs of every chat request that does not set them itself, e.g. "
                                "'{\"enable_thinking\": false}' (chat completions, responses, messages, /tokenize)")

    media = parser.add_argument_group(
        "image URLs", "images given as http(s):// URLs are fetched by the server, as vLLM does; by default from any "
        "host, so a public deployment should restrict them with --allowed-media-domains (else clients can make "
        "the server fetch from its own network)")
    media.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                       help="the only hosts image URLs (and their redirects) may point at, matched exactly "
                            "(default: any host)")
    media.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                       help="let file:// image URLs read files inside DIR (default: file:// URLs are refused)")
    media.add_argument("--media-fetch-timeout", dest="media_fetch_timeout_s", type=float, default=None,
                       metavar="SECONDS", help="time limit of fetching one image (default: 10)")
    media.add_argument("--max-media-bytes", type=int, default=None, metavar="N",
                       help="largest image a URL may give, in bytes (default: 20971520, 20 MiB)")
    media.add_argument("--limit-mm-per-prompt", type=_json_object("--limit-mm-per-prompt"), default=None,
                       metavar="JSON", help="most images / videos one prompt may hold, a JSON object as vLLM's, e.g. "
                                            "'{\"image\": 4, \"video\": 1}' (default: no limit); "
                                            "'{\"image\": 0, \"video\": 0}' serves text only and does not load "
                                            "the vision tower, leaving its memory to the KV cache")

    add_compat_args(parser)

    model = parser.add_argument_group("model")
    model.add_argument("--model", default="demo",
                       help="Hugging Face checkpoint directory, or 'demo' for the embedded demo model "
                            "(default: %(default)s)")
    model.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model directory)")
    model.add_argument("--quantization", "-q", default=None, metavar="METHOD",
                       help="the checkpoint's quantization as vLLM names it: modelopt_fp4, modelopt or nvfp4 "
                            "(ModelOpt NVFP4, the one nibble serves); checked against the checkpoint at start-up "
                            "(default: the checkpoint's, NVFP4 or none)")
    model.add_argument("--load-format", default=None, choices=("auto", "dummy"),
                       help="'dummy' builds the model from config.json with random weights (default: auto)")
    model.add_argument("--dtype", default=None,
                       choices=("auto", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32", "float"),
                       help="activation/weight dtype of unquantized parts (default: auto = bf16 on GPU, fp32 on CPU)")
    model.add_argument("--max-model-len", type=int, default=None,
                       help="context length, prompt + output (default: the model's, at most 32768)")
    model.add_argument("--seed", type=int, default=None, help="engine random seed (default: 0)")
    model.add_argument("--generation-config", default=None,
                       help="request defaults: 'auto' (the model's generation_config.json), 'vllm' (none: the "
                            "engine's) or a directory holding a generation_config.json (default: auto)")
    model.add_argument("--override-generation-config", type=_json_object("--override-generation-config"),
                       default=None, help="request default fields to replace, a JSON object, e.g. "
                                          "'{\"temperature\": 0.7, \"max_new_tokens\": 4096}'")

    engine = parser.add_argument_group("engine")
    engine.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N (default: auto)")
    engine.add_argument("--kv-cache-dtype", default=None, choices=("auto", "fp8", "fp8_e4m3"),
                        help="KV-cache element type (default: auto = the model dtype)")
    engine.add_argument("--max-num-seqs", type=int, default=None,
                        help="most sequences in one batch (default: 256)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="token budget of one engine step; longer prompts are prefilled in chunks "
                             "(default: 8192)")
    engine.add_argument("--max-waiting-requests", type=int, default=None,
                        help="queue length beyond which new requests get HTTP 503 (default: 4096)")
    engine.add_argument("--scheduling-policy", default=None, choices=("fcfs", "priority"),
                        help="order of admission and of preemption, as vLLM's flag: fcfs (arrival; the default) or "
                             "priority (each request's `priority` field, lower first, then arrival)")
    engine.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="fraction of GPU memory nibble may use, caches included (default: 0.9)")
    engine.add_argument("--kv-cache-memory-gb", type=float, default=None,
                        help="KV-cache size on CPU, in GiB (default: 1)")
    engine.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block (default: 16)")
    engine.add_argument("--enforce-eager", action="store_true", default=None, help="do not use CUDA graphs")
    engine.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false", default=None,
                        help="wait for each step's sampled tokens before scheduling the next one (default: "
                             "schedule and queue the next step while the GPU runs this one)")
    engine.add_argument("--no-shared-expert-overlap", dest="shared_expert_overlap", action="store_false",
                        default=None, help="run each MoE block's shared expert after its routed experts on one CUDA "
                                           "stream (default: beside them, on a second stream)")
    engine.add_argument("--no-warmup", dest="warmup", action="store_false", default=None,
                        help="skip the start-up warm-up: dummy requests that compile and autotune the kernels "
                             "of every step shape before the server takes requests (GPU only; default: run it)")
    engine.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=None,
                        help="reuse the KV blocks and GDN state of prompt prefixes that recur (default: on)")
    engine.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        default=None, help="compute every prompt from its first token")
    engine.add_argument("--prefix-cache-slots", type=int, default=None,
                        help="GDN state slots set aside for cached prefixes, beyond one per sequence; each holds "
                             "one prefix's recurrent state (default: 16)")
    engine.add_argument("--speculative-config", default=None,
                        help="speculative decoding, as vLLM's flag: "
                             '\'{"method": "mtp", "num_speculative_tokens": 2}\' drafts with the model\'s MTP head; '
                             '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                             '"prompt_lookup_min": 2}\' drafts the tokens that followed the last n-gram where it '
                             "occurred before in the prompt or output (no draft model) (default: off)")
    engine.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="draft tokens per step from the model's MTP head (0 = off; default: 0)")
    engine.add_argument("--cuda-graph-max-batch-size", "--max-cudagraph-capture-size", type=int, default=None,
                        dest="cuda_graph_max_batch_size", metavar="N",
                        help="largest decode batch captured in a CUDA graph (default: 256)")
    engine.add_argument("--cuda-graph-max-mixed-tokens", type=int, default=None,
                        help="largest prefill or mixed prefill+decode step, in tokens, run from a CUDA graph "
                             "(0: such steps run eagerly; at most 512; default: 512)")
    engine.add_argument("--moe-backend", default=None, help="force a MoE kernel backend (default: auto)")
    engine.add_argument("--attention-backend", default=None, help="force an attention kernel backend (default: auto)")
    engine.add_argument("--linear-backend", default=None, help="force an NVFP4 linear kernel backend (default: auto)")
    engine.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, help="GPUs per model (default: 1)")
    engine.add_argument("--enable-expert-parallel", action="store_true", default=None,
                        help="shard experts across GPUs instead of tensor-splitting them")
    engine.add_argument("--max-logprobs", type=int, default=None, metavar="N",
                        help="most logprobs / top_logprobs / prompt_logprobs a request may ask for; more is an "
                             "HTTP 400 (-1: up to the vocabulary size; default: 20, as vLLM)")
    return parser


def _json_object(flag: str) -> Any:
    """argparse type of a flag taking a JSON object."""
    def parse(text: str) -> dict[str, Any]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON object, e.g. '{{\"temperature\": 0.7}}', "
                                             f"got {text!r}")
        return value

    return parse


def engine_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from parsed flags (only those the user set, plus the model)."""
    kwargs = {name: getattr(args, name) for name in _ENGINE_FIELDS if getattr(args, name, None) is not None}
    if isinstance(kwargs.get("served_model_name"), list):
        # the engine knows the first name (the one responses carry); build_app accepts the others too
        kwargs["served_model_name"] = kwargs["served_model_name"][0]
    limits = mm_limits(args)
    if limits is not None:
        kwargs["limit_mm_per_prompt"] = limits
    if "allowed_media_domains" in kwargs:
        kwargs["allowed_media_domains"] = tuple(kwargs["allowed_media_domains"])
    spec = getattr(args, "speculative_config", None)
    if spec:
        from nibble.engine.config import parse_speculative_config

        kwargs = {**parse_speculative_config(spec), **kwargs}
    kwargs.setdefault("model", "demo")
    return kwargs
