"""HTTP errors of the OpenAI-compatible API and the mapping from engine exceptions to them.

Every failure a client can cause or observe becomes an `APIError`, rendered as the OpenAI error body
`{"error": {"message", "type", "param", "code"}}` with a matching HTTP status.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

from nibble.engine.async_engine import EngineDead, EngineOverloaded
from nibble.engine.llm_engine import RequestError
from nibble.engine.sampling_params import SamplingParamsError
from nibble.server.protocol import error_response

# OpenAI's error types by HTTP status; anything else in the 5xx range is a server error.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error response: HTTP status, message, and the OpenAI `type`/`param`/`code` fields."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: int | str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = status if code is None else code

    def body(self) -> dict[str, Any]:
        """The JSON body of this error."""
        return error_response(self.message, type=self.type, param=self.param, code=self.code).model_dump()

    def response(self) -> JSONResponse:
        """This error as a JSON response."""
        return JSONResponse(self.body(), status_code=self.status)

    def sse_event(self) -> str:
        """This error as a server-sent event, for failures after a stream has started."""
        return f"data: {json.dumps(self.body(), ensure_ascii=False)}\n\n"


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


def bad_request(message: str, param: str | None = None) -> APIError:
    """An HTTP 400 invalid_request_error."""
    return APIError(400, message, param=param)


def _sampling_param_name(message: str) -> str | None:
    # SamplingParamsError messages start with the field name ("top_p must be in (0, 1], got 0").
    first = message.split(" ", 1)[0]
    return first if first.isidentifier() else None


def from_engine_error(exc: BaseException) -> APIError:
    """Map an exception raised by `AsyncEngine.generate` (or during generation) to an `APIError`."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, SamplingParamsError):
        return bad_request(str(exc), param=_sampling_param_name(str(exc)))
    if isinstance(exc, RequestError):
        return bad_request(str(exc))
    if isinstance(exc, RecursionError):
        return bad_request("the request is nested too deeply")
    if isinstance(exc, EngineOverloaded):
        return APIError(503, f"the server is overloaded, retry later ({exc})", code="server_overloaded")
    if isinstance(exc, EngineDead):
        return APIError(503, f"the engine is not running: {exc}", code="engine_dead")
    if isinstance(exc, RuntimeError) and str(exc):
        return APIError(500, str(exc), code="internal_error")  # engine step failures, already worded
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")
