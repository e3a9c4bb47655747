"""Request ids a client or a gateway chose, as vLLM takes them: the `X-Request-Id` header, or the `request_id`
body field of /v1/completions and /v1/chat/completions, becomes the response's id (`cmpl-<id>`,
`chatcmpl-<id>`) and the name in the server's log lines, so that a request can be followed from the gateway's
logs into nibble's. Every HTTP response carries an `X-Request-Id` header (vLLM's --enable-request-id-headers):
the client's own when it sent one, else the id nibble gave the request, else a fresh one.

Engine requests keep unique ids whatever clients send (two clients may well send the same id): a client's id
gets a random suffix inside the engine (`engine_request_id`).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import Request

HEADER = "x-request-id"
MAX_ID_LEN = 256

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


def _usable(value: Any) -> str | None:
    """`value` when it can name a request: a string of printable ASCII (it goes into a header and the logs)
    of at most MAX_ID_LEN characters; else None, and the request gets an id of nibble's."""
    if isinstance(value, str) and 0 < len(value) <= MAX_ID_LEN and value.isascii() and value.isprintable():
        return value.strip() or None
    return None


def client_request_id(request: Request | None, body: dict[str, Any]) -> str | None:
    """The id the client chose for this request: its X-Request-Id header, else the body's `request_id`."""
    if request is not None:
        header = _usable(request.headers.get(HEADER))
        if header is not None:
            return header
    return _usable(body.get("request_id"))


def request_id_of(prefix: str, request: Request | None, body: dict[str, Any]) -> tuple[str, bool]:
    """(the response id `prefix-<id>`, whether the client chose <id>); remembered on the request for the
    X-Request-Id header of its response."""
    chosen = client_request_id(request, body)
    request_id = f"{prefix}-{chosen if chosen is not None else uuid.uuid4().hex}"
    if request is not None:
        request.state.request_id = request_id
    return request_id, chosen is not None


def engine_request_id(request_id: str, client_chosen: bool) -> str:
    """The id of the request inside the engine: `request_id`, made unique with a suffix when a client chose it."""
    return f"{request_id}-{uuid.uuid4().hex[:8]}" if client_chosen else request_id


class RequestIdHeader:
    """ASGI middleware that adds `X-Request-Id` to every HTTP response (see the module docstring). Plain ASGI,
    not a BaseHTTPMiddleware, so that streamed responses and client disconnects pass through untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                      send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = next((_usable(v.decode("latin-1")) for k, v in scope.get("headers", ())
                         if k.decode("latin-1").lower() == HEADER), None)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                state = scope.get("state") or {}
                value = incoming or state.get("request_id") or uuid.uuid4().hex
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != HEADER.encode()]
                message["headers"] = [*headers, (HEADER.encode(), value.encode("latin-1"))]
            await send(message)

        await self.app(scope, receive, send_with_id)
