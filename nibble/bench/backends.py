"""Streaming clients for OpenAI-compatible servers, timing each content chunk as it arrives.

Two backends: `openai` posts to /v1/completions, `openai-chat` to /v1/chat/completions. Both stream
server-sent events; a chunk counts as content when it carries generated text (for chat also reasoning text,
which thinking models such as Qwen3.5 stream before the answer). Token counts come from the final `usage`
object when the server sends one, else from the number of content chunks.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from nibble.bench.datasets import SampleRequest
from nibble.bench.metrics import RequestOutput

BACKEND_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}

# Enough of an error body to show what the server objected to without flooding the summary.
_ERROR_BODY_CHARS = 300


class ServerError(RuntimeError):
    """The server cannot be reached or refused a request outright."""


@dataclass(frozen=True)
class RequestSettings:
    """Everything a request needs besides its prompt."""

    backend: str
    url: str
    model: str
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    # the optional sampling fields the user set (top_p, top_k, min_p, repetition_penalty); absent ones are
    # left to the server's defaults, as vLLM's benchmark leaves them
    sampling: dict[str, Any] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)


def join_url(base_url: str, path: str) -> str:
    """`base_url` + `path`, tolerating a trailing slash or a base that already ends in /v1."""
    base = base_url.rstrip("/")
    if base.endswith("/v1") and path.startswith("/v1/"):
        base = base[: -len("/v1")]
    return base + ("" if path.startswith("/") else "/") + path


def auth_headers(api_key: str | None) -> dict[str, str]:
    """Bearer authorisation when a key is set."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def connection_message(url: str, exc: BaseException) -> str:
    """Human-readable reason a request to `url` failed below HTTP."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect to {url}: is the server running? ({exc.os_error or exc})"
    if isinstance(exc, TimeoutError):
        return f"request to {url} timed out"
    return f"request to {url} failed: {type(exc).__name__}: {exc}"


def _http_error(status: int, body: str) -> str:
    detail = body.strip()
    try:
        parsed = json.loads(detail)
        err = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
        detail = err.get("message", detail) if isinstance(err, dict) else str(err)
    except (json.JSONDecodeError, AttributeError):
        pass
    return f"HTTP {status}: {str(detail)[:_ERROR_BODY_CHARS]}"


async def fetch_first_model(session: aiohttp.ClientSession, base_url: str, api_key: str | None) -> str:
    """The first model id that GET /v1/models lists; `ServerError` if there is none or no server."""
    url = join_url(base_url, "/v1/models")
    try:
        async with session.get(url, headers=auth_headers(api_key)) as resp:
            body = await resp.text()
            if resp.status != 200:
                raise ServerError(f"GET {url} failed: {_http_error(resp.status, body)}")
    except (aiohttp.ClientError, TimeoutError) as e:
        raise ServerError(connection_message(url, e)) from e
    try:
        return str(json.loads(body)["data"][0]["id"])
    except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
        raise ServerError(f"GET {url} returned no model ids; pass --model") from e


def build_payload(settings: RequestSettings, req: SampleRequest) -> dict[str, Any]:
    """JSON body of one streamed request with a fixed output budget."""
    payload: dict[str, Any] = {
        "model": settings.model,
        "max_tokens": req.output_len,
        "temperature": settings.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.backend == "openai-chat":
        # Newer clients name the budget max_completion_tokens; vLLM, SGLang and nibble read either.
        payload["max_completion_tokens"] = req.output_len
        payload["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        payload["prompt"] = req.prompt
    if settings.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(settings.sampling)
    # last, so that --extra-body can override anything above
    payload.update(settings.extra_body)
    return payload


def _chunk_text(backend: str, choice: dict[str, Any]) -> str:
    if backend == "openai-chat":
        delta = choice.get("delta") or {}
        parts = (delta.get("content"), delta.get("reasoning_content"), delta.get("reasoning"))
        return "".join(p for p in parts if isinstance(p, str))
    text = choice.get("text")
    return text if isinstance(text, str) else ""


class _StreamState:
    """Timing bookkeeping while a response streams in."""

    def __init__(self, backend: str, start: float) -> None:
        self.backend = backend
        self.start = start
        self.last = start
        self.num_chunks = 0
        self.ttft = 0.0
        self.itl: list[float] = []
        self.usage: dict[str, Any] | None = None
        self.error = ""

    def on_event(self, data: str, now: float) -> None:
        """Handle one `data:` payload received at `now`."""
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"malformed stream event: {data[:_ERROR_BODY_CHARS]}"
            return
        if not isinstance(event, dict):
            return
        if "error" in event:
            err = event["error"]
            message = err.get("message", err) if isinstance(err, dict) else err
            self.error = f"error in stream: {str(message)[:_ERROR_BODY_CHARS]}"
            return
        if event.get("usage"):
            self.usage = event["usage"]
        choices = event.get("choices") or []
        if not any(_chunk_text(self.backend, c) for c in choices if isinstance(c, dict)):
            return
        if self.num_chunks == 0:
            self.ttft = now - self.start
        else:
            self.itl.append(now - self.last)
        self.last = now
        self.num_chunks += 1


async def _read_events(resp: aiohttp.ClientResponse, state: _StreamState) -> None:
    """Split the SSE byte stream into `data:` lines; a chunk's time is when its bytes arrived."""
    buffer = b""
    async for chunk in resp.content.iter_any():
        now = time.perf_counter()
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for raw in lines:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[len(b"data:") :].strip().decode("utf-8", errors="replace")
            if data == "[DONE]":
                return
            state.on_event(data, now)
            if state.error:
                return


async def send_request(session: aiohttp.ClientSession, settings: RequestSettings, req: SampleRequest) -> RequestOutput:
    """Stream one request and time it. Never raises for server or network trouble: the returned output
    says `success=False` and why, so one bad request does not end a benchmark."""
    out = RequestOutput(prompt_len=req.prompt_len)
    headers = {"Content-Type": "application/json", **auth_headers(settings.api_key)}
    payload = build_payload(settings, req)
    start = time.perf_counter()
    out.start_time = start
    state = _StreamState(settings.backend, start)
    try:
        async with session.post(settings.url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                out.error = _http_error(resp.status, await resp.text())
                return out
            await _read_events(resp, state)
    except (aiohttp.ClientError, TimeoutError) as e:
        out.error = connection_message(settings.url, e)
        return out
    out.latency = time.perf_counter() - start
    if state.error:
        out.error = state.error
        return out
    if state.num_chunks == 0:
        out.error = "stream ended without any generated text"
        return out
    usage = state.usage or {}
    completion_tokens = usage.get("completion_tokens")
    prompt_tokens = usage.get("prompt_tokens")
    out.output_tokens = int(completion_tokens) if completion_tokens is not None else state.num_chunks
    if prompt_tokens is not None:
        out.prompt_len = int(prompt_tokens)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if isinstance(cached, int):
        out.cached_tokens = cached
    out.ttft = state.ttft
    out.itl = state.itl
    out.success = True
    return out
