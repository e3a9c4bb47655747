"""`nibble run-batch`: a file of OpenAI Batch requests answered offline, as vLLM's `vllm run-batch`.

Every request goes through the same FastAPI app `nibble serve` runs (`build_app`), called in-process as an ASGI
application rather than over a socket: validation, error bodies, reasoning and tool-call parsing are the HTTP
server's own, so a result body is byte for byte what the server would send for the same body (ids and
timestamps aside). Many requests are in flight at once, so the one engine batches them (continuous batching)
as it batches concurrent HTTP clients. The file format is batch_format.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

from nibble.server.batch_format import (
    BatchLineError,
    BatchRequest,
    error_line,
    output_tokens,
    parse_batch_lines,
    response_line,
)
from nibble.server.engine_args import add_engine_cli_args, engine_config_kwargs
from nibble.server.launch import LOG_LEVELS, app_settings

logger = logging.getLogger("nibble.server")

# A request refused because the engine's queue is full (503 server_overloaded) is sent again after a pause,
# up to this many times: the queue drains as the engine works, and a batch has no client to retry for it.
OVERLOAD_RETRIES = 60
OVERLOAD_PAUSE_S = 0.5


@dataclass
class BatchSummary:
    """What a batch run did: requests answered with status 200 (`ok`), the others (`failed`: error responses
    and lines that were no request), the output tokens of the ok ones and the wall time."""

    ok: int = 0
    failed: int = 0
    output_tokens: int = 0
    elapsed_s: float = 0.0

    def line(self) -> str:
        """One line for the terminal: counts, time and output tokens per second."""
        rate = self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0
        return (f"{self.ok + self.failed} requests: {self.ok} ok, {self.failed} failed in {self.elapsed_s:.1f} s "
                f"({self.output_tokens} output tokens, {rate:.1f} tokens/s)")


async def call_app(app: Any, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    """POST `body` (JSON) to `path` of the ASGI `app` in this process, as an HTTP client would; returns (status,
    headers with lower-case names, body). The client stays connected until the response is complete, so the
    handlers' disconnect checks see a patient client."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "client": None, "server": ("run-batch", 80), "state": {},
             "headers": [(b"host", b"run-batch"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    complete = asyncio.Event()
    sent_body = False
    status, headers, chunks = 500, {}, []

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await complete.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status = message["status"]
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in message.get("headers", ())}
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                complete.set()

    try:
        await app(scope, receive, send)
    finally:
        complete.set()
    return status, headers, b"".join(chunks)


def _overloaded(status: int, body: Any) -> bool:
    """Whether a response is the 503 of a full engine queue, in OpenAI's error shape or Anthropic's."""
    error = body.get("error") if isinstance(body, dict) else None
    return status == 503 and isinstance(error, dict) and \
        (error.get("code") == "server_overloaded" or error.get("type") == "overloaded_error")


async def _answer(app: Any, request: BatchRequest, summary: BatchSummary) -> bytes:
    """The output line of one request, sent to the app (again while the engine's queue is full)."""
    # ASCII escapes, so that a lone surrogate in the body reaches the server's own check as it would over HTTP
    payload = json.dumps(request.body).encode()
    for attempt in range(OVERLOAD_RETRIES + 1):
        try:
            status, headers, raw = await call_app(app, request.url, payload)
        except Exception as exc:  # the app answers its own errors; this is a failure after its response started
            logger.error("line %d: %s failed", request.line, request.url, exc_info=exc)
            summary.failed += 1
            return error_line(request.custom_id, "internal_error",
                              f"line {request.line}: internal error: {type(exc).__name__}: {exc}")
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not _overloaded(status, body) or attempt == OVERLOAD_RETRIES:
            break
        await asyncio.sleep(OVERLOAD_PAUSE_S)
    if body is None:
        summary.failed += 1
        return error_line(request.custom_id, "invalid_response",
                          f"line {request.line}: the server answered HTTP {status} without a JSON body")
    if b"\n" in raw:
        raw = json.dumps(body, ensure_ascii=False).encode()  # never seen: compact JSON, but a line it must stay
    if status == 200:
        summary.ok += 1
        summary.output_tokens += output_tokens(body)
    else:
        summary.failed += 1
    return response_line(request.custom_id, status, headers.get("x-request-id"), raw)


async def run_batch(engine: Any, data: bytes, write: Callable[[bytes], None],
                    progress: Callable[[int, int], None] | None = None, max_concurrency: int | None = None,
                    **app_kwargs: Any) -> BatchSummary:
    """Answer the batch file `data` with `engine` (an AsyncEngine), passing each output line to `write` in
    input order as soon as it and every line before it are done.

    `app_kwargs` go to build_app (served_model_name, default_chat_template_kwargs...). `max_concurrency`: the
    requests in flight at once (default: twice the engine's --max-num-seqs, so that finished sequences are
    replaced at once while the queue stays short). `progress(done, total)` is called as lines finish.
    """
    from nibble.server.api_server import build_app

    app = build_app(engine, **app_kwargs)
    config = engine.config
    limit = max_concurrency or max(1, min(2 * config.max_num_seqs, config.max_waiting_requests))
    items = list(parse_batch_lines(data))
    done: dict[int, bytes] = {}
    next_line = 0
    summary = BatchSummary()
    start = time.monotonic()
    # the workers share one iterator: no await between taking an item and the next take, so none is taken twice
    todo = iter(enumerate(items))

    async def worker() -> None:
        nonlocal next_line
        for index, item in todo:
            if isinstance(item, BatchLineError):
                summary.failed += 1
                done[index] = error_line(item.custom_id, item.code, item.message)
            else:
                done[index] = await _answer(app, item, summary)
            while next_line in done:
                write(done.pop(next_line))
                next_line += 1
            if progress is not None:
                progress(summary.ok + summary.failed, len(items))

    await asyncio.gather(*(worker() for _ in range(min(limit, max(1, len(items))))))
    summary.elapsed_s = time.monotonic() - start
    return summary


class OutputFile:
    """Where the output lines go: stdout for '-', else a temporary file beside `path` that replaces it only once
    the batch is complete, so that a failed run leaves no half-written results (nor truncates old ones)."""

    def __init__(self, path: str) -> None:
        """Open the output; OSError (naming the path) when it cannot be written."""
        self.path = path
        self._tmp: str | None = None
        if path == "-":
            self.file: BinaryIO = sys.stdout.buffer
            return
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if os.path.exists(path) and not os.path.isfile(path):
            # a device or a pipe (/dev/stdout, a FIFO) cannot be replaced: it is written in place
            self.file = open(path, "wb")
            return
        if os.path.exists(path) and not os.access(path, os.W_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        fd, self._tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                                         prefix=f".{os.path.basename(path)}.", suffix=".tmp")
        # mkstemp's file is private (0600); the results get the mode a plain open() would give them
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        self.file = os.fdopen(fd, "wb")

    def write(self, line: bytes) -> None:
        self.file.write(line)
        if self._tmp is None:
            self.file.flush()  # stdout or a pipe: whoever reads it gets each line as it is done

    def commit(self) -> None:
        """The output is complete: move the temporary file to the path."""
        if self._tmp is not None:
            self.file.close()
            os.replace(self._tmp, self.path)
            self._tmp = None
        elif self.file is not sys.stdout.buffer:
            self.file.close()

    def discard(self) -> None:
        """The run failed: remove the temporary file, leaving the path as it was."""
        if self._tmp is not None:
            self.file.close()
            os.unlink(self._tmp)
            self._tmp = None


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare `nibble run-batch`'s flags: the files, and `nibble serve`'s model, engine and chat flags."""
    batch = parser.add_argument_group("batch")
    batch.add_argument("-i", "--input-file", required=True, metavar="PATH",
                       help="OpenAI batch requests, one JSON object a line ('-': stdin)")
    batch.add_argument("-o", "--output-file", required=True, metavar="PATH",
                       help="where the results go, one line per request in input order ('-': stdout)")
    batch.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                       help="requests in flight at once (default: twice --max-num-seqs)")
    # SUPPRESS: as `nibble serve`'s, so that `nibble --log-level X run-batch` is not overwritten by a default
    batch.add_argument("--log-level", default=argparse.SUPPRESS, type=str.lower, choices=LOG_LEVELS,
                       help="(default: info)")
    return add_engine_cli_args(parser)


def _error(message: str, code: int) -> int:
    print(f"nibble run-batch: error: {message}", file=sys.stderr)
    return code


def _read_input(path: str) -> bytes:
    if path == "-":
        return sys.stdin.buffer.read()
    with open(path, "rb") as f:
        return f.read()


def run_cli(args: argparse.Namespace) -> int:
    """Run `nibble run-batch` with parsed flags: 0 once the file is processed (whatever the requests' outcome),
    2 when the input cannot be read or the output cannot be written, 1 when the engine cannot start."""
    logging.getLogger().setLevel(str(getattr(args, "log_level", None) or "info").upper())
    if args.max_concurrency is not None and args.max_concurrency < 1:
        return _error(f"--max-concurrency must be >= 1, got {args.max_concurrency}", 2)
    # the files first: a typo in a path should not cost an engine start
    try:
        data = _read_input(args.input_file)
    except OSError as exc:
        return _error(f"cannot read the input file {args.input_file}: {exc.strerror or exc}", 2)
    try:
        output = OutputFile(args.output_file)
    except OSError as exc:
        return _error(f"cannot write the output file {args.output_file}: {exc.strerror or exc}", 2)
    try:
        engine = _start_engine(args)
        if isinstance(engine, str):
            output.discard()
            return _error(engine, 1)
        try:
            summary = asyncio.run(_run_with_progress(engine, data, output, args))
        finally:
            engine.shutdown()
        output.commit()
    except OSError as exc:  # the output went away mid-run (a full disk, a closed pipe): the requests were served
        output.discard()
        return _error(f"cannot write the output file {args.output_file}: {exc.strerror or exc}", 2)
    except BaseException:
        output.discard()
        raise
    where = "" if args.output_file == "-" else f"; results in {args.output_file}"
    print(f"nibble run-batch: {summary.line()}{where}", file=sys.stderr)
    return 0


def _start_engine(args: argparse.Namespace) -> Any:
    """The AsyncEngine the flags describe, or the one-line reason it cannot start (as `nibble serve` words it)."""
    from nibble.engine.async_engine import AsyncEngine
    from nibble.engine.config import EngineConfig
    from nibble.server.protocol import no_reserved_template_kwargs

    try:
        no_reserved_template_kwargs(getattr(args, "default_chat_template_kwargs", None))
    except ValueError as exc:
        return f"--default-chat-template-kwargs: {exc}"
    try:
        config = EngineConfig(**engine_config_kwargs(args))
    except ValueError as exc:
        return str(exc)
    try:
        return AsyncEngine.from_config(config)
    except Exception as exc:
        logger.debug("engine start failed", exc_info=True)
        return f"cannot start the engine for '{args.model}': {exc}"


async def _run_with_progress(engine: Any, data: bytes, output: OutputFile, args: argparse.Namespace) -> BatchSummary:
    from tqdm import tqdm

    names = args.served_model_name
    with tqdm(desc="run-batch", unit="req", file=sys.stderr, disable=not sys.stderr.isatty()) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        return await run_batch(engine, data, output.write, progress=progress, max_concurrency=args.max_concurrency,
                               served_model_name=names[0] if names else None, **app_settings(args))
