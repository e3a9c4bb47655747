"""The API's JSON 500 for an exception no handler took, sent from inside the middlewares that add the
X-Request-Id and CORS headers. Starlette answers such exceptions from its outermost layer
(ServerErrorMiddleware), whose response would miss those headers: a browser page could not read the error, and
a gateway could not match it to its request."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.responses import Response

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class UnhandledErrors:
    """ASGI middleware: `respond(scope, exc)` answers an exception the app raised before its response started
    (the handler logs it); one raised after that is re-raised, since the response can only be cut."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]],
                 respond: Callable[[Scope, Exception], Response]) -> None:
        self.app = app
        self.respond = respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:
                raise
            await self.respond(scope, exc)(scope, receive, send)
