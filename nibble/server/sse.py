"""Server-sent events response that stops generating as soon as the client goes away.

Starlette's StreamingResponse notices a disconnect only on servers that report ASGI spec < 2.4; on newer
ones it finds out when the next chunk fails to send, which may be long after the client left (a queued
request, a long prefill). This response always listens for the disconnect, cancels the stream at once,
and closes the body iterator, so the engine requests behind it are aborted promptly.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE_EVENT = "data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> str:
    """One `data:` event carrying `payload` as compact JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class EventStreamResponse(StreamingResponse):
    """`text/event-stream` response over an async iterator of event strings."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None] | None = None) -> None:
        """`events`: the already formatted events (see `sse_event`, `DONE_EVENT`). `on_close` runs when the
        response ends in any way, even if `events` was never started (closing an unstarted generator
        skips its own cleanup)."""
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the socket broke mid-send: the client is gone
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                while (await receive())["type"] != "http.disconnect":
                    pass
                group.cancel_scope.cancel()
        finally:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
            if self._on_close is not None:
                self._on_close()
