"""`nibble serve`: command-line flags, engine construction and the uvicorn server.

`add_cli_args(parser)` declares the flags (vLLM's names where vLLM has the same knob; the vLLM flags that nibble
accepts for compatibility are in compat_args.py); `run_cli(args)` builds the engine, prints a one-line error (no
traceback) when the model or the settings are unusable, and serves until interrupted. Engine flags default to
None, meaning "EngineConfig's default", so the defaults live in one place and `--help` does not need to import
torch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

from nibble.server.compat_args import add_compat_args, log_compat_notes, mm_limits

logger = logging.getLogger("nibble.server")

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
GRACEFUL_SHUTDOWN_S = 10

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


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare every `nibble serve` flag on `parser` and return it."""
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="0.0.0.0", help="address to listen on (default: %(default)s)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    server.add_argument("--api-key", default=os.environ.get("NIBBLE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/* (default: $NIBBLE_API_KEY, else none)")
    # SUPPRESS: when `nibble --log-level X serve` set it on the parent parser, an unset flag here must not
    # overwrite it with a default.
    server.add_argument("--log-level", default=argparse.SUPPRESS, type=str.lower, choices=LOG_LEVELS,
                        help="(default: info)")

    server.add_argument("--allowed-origins", type=_json_list("--allowed-origins"), default=["*"],
                        help="CORS: origins browsers may call from, a JSON list (default: %(default)s, as vLLM)")
    server.add_argument("--allowed-methods", type=_json_list("--allowed-methods"), default=["*"],
                        help="CORS: allowed methods, a JSON list (default: %(default)s)")
    server.add_argument("--allowed-headers", type=_json_list("--allowed-headers"), default=["*"],
                        help="CORS: allowed request headers, a JSON list (default: %(default)s)")
    server.add_argument("--allowed-credentials", action="store_true",
                        help="CORS: allow credentials (cookies, authorization headers)")
    server.add_argument("--max-stored-responses", type=int, default=None,
                        help="/v1/responses: how many finished responses to keep in memory for previous_response_id "
                             "and GET /v1/responses/{id}, the least recently used forgotten first; 0 keeps none "
                             "(default: 1000)")
    server.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the private key file (PEM)")
    server.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the certificate (chain) file (PEM)")
    server.add_argument("--ssl-ca-certs", default=None, help="CA certificates for verifying client certificates")
    server.add_argument("--ssl-cert-reqs", type=int, default=0, choices=(0, 1, 2),
                        help="client certificates: 0 not asked, 1 optional, 2 required (Python's ssl.CERT_*; "
                             "default: %(default)s)")
    server.add_argument("--root-path", default="",
                        help="behind a proxy that serves the API under a path prefix and strips it before forwarding: "
                             "that prefix (ASGI root_path, as vLLM's), e.g. /nibble")
    return add_engine_cli_args(parser)


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


def _json_list(flag: str) -> Any:
    """argparse type of a flag taking a JSON list of strings (vLLM's CORS flags)."""
    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON list of strings, e.g. '[\"*\"]', got {text!r}")
        return value

    return parse


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


def cors_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Starlette CORSMiddleware keyword arguments from the CORS flags."""
    return {"allow_origins": getattr(args, "allowed_origins", ["*"]),
            "allow_methods": getattr(args, "allowed_methods", ["*"]),
            "allow_headers": getattr(args, "allowed_headers", ["*"]),
            "allow_credentials": bool(getattr(args, "allowed_credentials", False))}


def _check_tls(args: argparse.Namespace) -> str | None:
    """Why the TLS flags cannot work (a missing file, a key without its certificate, a key that does not
    match), checked before the slow engine start; None when they can or are not given."""
    keyfile, certfile = getattr(args, "ssl_keyfile", None), getattr(args, "ssl_certfile", None)
    ca_certs = getattr(args, "ssl_ca_certs", None)
    if not keyfile and not certfile:
        return "--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile" if ca_certs else None
    if not (keyfile and certfile):
        return "--ssl-keyfile and --ssl-certfile go together: HTTPS needs both the key and the certificate"
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile), ("--ssl-ca-certs", ca_certs)):
        if path and not os.path.isfile(path):
            return f"{flag}: no such file: {path}"
    import ssl

    try:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(certfile, keyfile)
        if ca_certs:
            context.load_verify_locations(ca_certs)
    except (ssl.SSLError, OSError) as exc:
        return f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile}: cannot be used for HTTPS ({exc})"
    return None


def app_settings(args: argparse.Namespace) -> dict[str, Any]:
    """build_app's response-store, chat-template-defaults and stats-logging arguments for the flags given (else
    the app's defaults)."""
    from nibble.server.stat_logger import LOG_STATS_INTERVAL_S

    names = getattr(args, "served_model_name", None)
    settings = {"max_stored_responses": getattr(args, "max_stored_responses", None),
                "log_stats_interval_s": None if getattr(args, "disable_log_stats", False) else LOG_STATS_INTERVAL_S,
                "served_model_aliases": tuple(names[1:]) if isinstance(names, list) and len(names) > 1 else None,
                "default_chat_template_kwargs": getattr(args, "default_chat_template_kwargs", None),
                "force_include_usage": getattr(args, "enable_force_include_usage", None) or None}
    return {name: value for name, value in settings.items() if value is not None}


def _fail(message: str) -> int:
    print(f"nibble serve: error: {message}", file=sys.stderr)
    return 1


def _bind(host: str, port: int) -> socket.socket:
    """Bind the listening socket before the (slow) engine start, so a busy port fails at once."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def run_cli(args: argparse.Namespace) -> int:
    """Run `nibble serve` with parsed flags; returns the process exit code."""
    log_level = str(getattr(args, "log_level", None) or "info").lower()
    if log_level not in LOG_LEVELS:
        return _fail(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got '{log_level}'")
    args.log_level = log_level
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(log_level.upper())
    if not 0 <= args.port <= 65535:
        return _fail(f"--port must be in 0..65535, got {args.port}")
    tls_error = _check_tls(args)
    if tls_error:
        return _fail(tls_error)
    if (getattr(args, "max_stored_responses", None) or 0) < 0:
        return _fail(f"--max-stored-responses must be >= 0, got {args.max_stored_responses}")
    from nibble.server.protocol import no_reserved_template_kwargs

    try:
        no_reserved_template_kwargs(getattr(args, "default_chat_template_kwargs", None))
    except ValueError as exc:
        return _fail(f"--default-chat-template-kwargs: {exc}")
    log_compat_notes(args, logger)

    from nibble.engine.async_engine import AsyncEngine
    from nibble.engine.config import EngineConfig, EngineConfigError

    try:
        config = EngineConfig(**engine_config_kwargs(args))
    except EngineConfigError as exc:
        return _fail(str(exc))
    try:
        sock = _bind(args.host, args.port)
    except OSError as exc:
        return _fail(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
    try:
        engine = AsyncEngine.from_config(config)
    except KeyboardInterrupt:
        sock.close()
        return 130
    except Exception as exc:  # a bad model directory or setting: one line; the trace only at debug level
        sock.close()
        logger.debug("engine start failed", exc_info=True)
        return _fail(f"cannot start the engine for '{args.model}': {exc}")
    return _serve(engine, sock, args)


def _serve(engine: Any, sock: socket.socket, args: argparse.Namespace) -> int:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that a signal-triggered graceful shutdown ends with exit code 0.

        uvicorn re-raises the captured SIGINT/SIGTERM after shutting down, which turns a clean stop into a
        KeyboardInterrupt or a kill by signal.
        """

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    from nibble.server.api_server import build_app
    from nibble.server.serving_base import engine_core

    names = args.served_model_name
    app = build_app(engine, api_key=args.api_key or None, served_model_name=names[0] if names else None,
                    owns_engine=True, cors=cors_settings(args),
                    **app_settings(args))
    # A bounded graceful shutdown: open streams are cut (and their requests aborted) after this long. No access
    # log: nibble logs one line per request itself (serving_base.log_request).
    config = uvicorn.Config(app, log_level=getattr(args, "uvicorn_log_level", None) or args.log_level,
                            log_config=None, access_log=False,
                            timeout_keep_alive=30, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                            ssl_keyfile=getattr(args, "ssl_keyfile", None),
                            ssl_certfile=getattr(args, "ssl_certfile", None),
                            ssl_ca_certs=getattr(args, "ssl_ca_certs", None),
                            ssl_cert_reqs=getattr(args, "ssl_cert_reqs", 0),
                            root_path=getattr(args, "root_path", ""))
    host, port = sock.getsockname()[:2]
    scheme = "https" if getattr(args, "ssl_certfile", None) else "http"
    logger.info("listening on %s://%s:%d%s (model '%s')", scheme, host, port, getattr(args, "root_path", ""),
                engine_core(engine).model_name)
    try:
        Server(config).run(sockets=[sock])
    finally:
        engine.shutdown()
        sock.close()
    return 0
