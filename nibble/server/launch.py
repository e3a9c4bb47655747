"""`nibble serve`: command-line flags, engine construction and the uvicorn server.

`add_cli_args(parser)` declares the flags (vLLM's names where vLLM has the same knob): the server's here, the
model and engine flags in engine_args.py, the vLLM flags nibble accepts for compatibility in compat_args.py.
`run_cli(args)` builds the engine, prints a one-line error (no traceback) when the model or the settings are
unusable, and serves until interrupted.
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

from nibble.server.compat_args import log_compat_notes
from nibble.server.engine_args import add_engine_cli_args, engine_config_kwargs

logger = logging.getLogger("nibble.server")

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
GRACEFUL_SHUTDOWN_S = 10


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
