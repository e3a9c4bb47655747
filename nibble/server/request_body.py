"""Reading a request body: the JSON object itself (size cap, lone surrogates refused), the fields nibble
refuses rather than drop (beam search...), and parsing into a protocol model with one 400 message naming the
first bad field and one log line naming the fields the model does not use."""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar, get_args

from fastapi import Request
from pydantic import BaseModel, ValidationError

from nibble.server.errors import APIError, bad_request
from nibble.server.protocol import format_validation_error

logger = logging.getLogger("nibble.server")

M = TypeVar("M", bound=BaseModel)

# Fields of vLLM/OpenAI requests that would change the result but that nibble does not implement. The
# protocol models ignore unknown fields, so these are refused here rather than silently dropped.
UNSUPPORTED_FIELDS = {
    "use_beam_search": "beam search is not supported",
    "length_penalty": "length_penalty (beam search) is not supported",
    "logits_processors": "logits processors are not supported",
}

# Request bodies above this size are refused (413): even a 256k-token prompt as JSON is far smaller.
MAX_BODY_BYTES = 64 * 2**20


def reject_unsupported(body: Mapping[str, Any], fields: Mapping[str, str]) -> None:
    """400 for any of `fields` that the client set to something other than null/false/empty."""
    for name, why in fields.items():
        value = body.get(name)
        if value is not None and value is not False and value != [] and value != {}:
            raise bad_request(f"{name}: {why}", param=name)


async def read_json_body(request: Request, limit: int | None = None) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 (413 when over `limit` bytes, default MAX_BODY_BYTES)
    saying what is wrong."""
    limit = limit or MAX_BODY_BYTES
    too_large = APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad_request("the request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise bad_request("the request body is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc.msg} (line {exc.lineno}, "
                          f"column {exc.colno})") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    except ValueError:
        raise bad_request(f"the request body holds an integer of more than {sys.get_int_max_str_digits()} "
                          "digits") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(body):
        raise bad_request("the request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its "
                          "pair), which is not valid Unicode text")
    return body


# JSON may escape unpaired surrogates, which Python keeps in str but no tokenizer can encode (it raised a
# TypeError, answered with a 500); a quick scan of the raw bytes decides whether the strings need a check.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


# the ignored fields one warning names, and the characters of each name it shows
MAX_LOGGED_FIELDS = 20
MAX_LOGGED_FIELD_LEN = 80


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field's annotation holds (`StreamOptions | None` -> StreamOptions), or None."""
    for kind in (annotation, *get_args(annotation)):
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            return kind
    return None


def ignored_fields(cls: type[BaseModel], body: Mapping[str, Any], read_elsewhere: Iterable[str] = ()) -> list[str]:
    """The keys of `body` that validating it as `cls` drops: neither a field of `cls` (by name or alias) nor one
    of `read_elsewhere`, the keys the handler reads from the body itself. Keys of nested models are named by
    their path (a misspelt `stream_options.include_usag`)."""
    known = set(read_elsewhere)
    nested: list[str] = []
    for name, field in cls.model_fields.items():
        known.update(n for n in (name, field.alias, field.validation_alias) if isinstance(n, str))
        inner = _nested_model(field.annotation)
        if inner is not None and isinstance(body.get(name), dict):
            nested += [f"{name}.{key}" for key in ignored_fields(inner, body[name])]
    return [key for key in body if key not in known] + nested


def parse_model(cls: type[M], body: dict[str, Any], route: str | None = None, request_id: str | None = None,
                read_elsewhere: Iterable[str] = ()) -> M:
    """Validate `body` into `cls`; a validation failure becomes a 400 naming the field.

    `route`: the endpoint a client sent `body` to. The fields validation drops (`ignored_fields`) are then
    logged in one WARNING line with `request_id`, as vLLM logs them: accepted, because SDKs send fields nibble
    has no use for, but not lost without a word. A body nibble built itself (the chat request a Responses or
    Messages request amounts to) passes no route.
    """
    try:
        req = cls.model_validate(body)
    except ValidationError as exc:
        message, param = format_validation_error(exc)
        raise bad_request(message, param=param) from None
    if route is not None:
        ignored = ignored_fields(cls, body, read_elsewhere)
        if ignored:
            # the keys are the client's text: quoted (no line breaks reach the log) and at most MAX_LOGGED_FIELDS
            names = ", ".join(repr(k)[:MAX_LOGGED_FIELD_LEN] for k in ignored[:MAX_LOGGED_FIELDS])
            more = f" and {len(ignored) - MAX_LOGGED_FIELDS} more" if len(ignored) > MAX_LOGGED_FIELDS else ""
            logger.warning("%s%s: the following fields were present in the request but ignored: %s%s",
                           f"{request_id} " if request_id else "", route, names, more)
    if getattr(req, "stream_options", None) is not None and not getattr(req, "stream", False):
        raise bad_request("stream_options: only allowed when stream is true", param="stream_options")
    return req
