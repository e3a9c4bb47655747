"""OpenAI's Batch file format, as `nibble run-batch` (and vLLM's `vllm run-batch`) read and write it.

Input: one JSON object a line, `{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions", "body":
{...}}`. Output: one line per request, in input order, `{"id": "batch_req_<hex>", "custom_id": ..., "response":
{"status_code", "request_id", "body"}, "error": null}`; a request the server answered with an error keeps that
status and error body in `response`, as OpenAI's batches do. A line that is no request at all (not JSON, a
missing field, an unsupported url, a repeated custom_id, a streaming body) gets `"response": null` and an `error`
whose message names the line. Blank lines are not requests and get no output line.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# the POST routes of the server that answer with one JSON body
SUPPORTED_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


@dataclass(frozen=True)
class BatchRequest:
    """One request line: its 1-based line number, custom_id, route and JSON body."""

    line: int
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class BatchLineError:
    """A line that is not a request the server can be asked: why (`code`, `message` naming the line)."""

    line: int
    custom_id: str | None
    code: str
    message: str


def parse_batch_lines(data: bytes) -> Iterator[BatchRequest | BatchLineError]:
    """The requests of a batch file, one item per non-blank line in file order.

    Lines are split on "\\n" only: JSON strings may hold U+2028 and other characters that `str.splitlines`
    would also split on. The first custom_id wins; a later line repeating it is a BatchLineError, since its
    result could not be told apart from the first one's.
    """
    seen: dict[str, int] = {}
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        item = _parse_line(number, raw.removeprefix(b"\xef\xbb\xbf") if number == 1 else raw)
        if isinstance(item, BatchRequest):
            first = seen.setdefault(item.custom_id, number)
            if first != number:
                item = BatchLineError(number, item.custom_id, "duplicate_custom_id",
                                      f"line {number}: custom_id {item.custom_id!r} was already used on line "
                                      f"{first}; each request needs its own")
        yield item


def _parse_line(number: int, raw: bytes) -> BatchRequest | BatchLineError:
    def error(code: str, message: str, custom_id: str | None = None) -> BatchLineError:
        return BatchLineError(number, custom_id, code, f"line {number}: {message}")

    try:
        obj = json.loads(raw)
    except UnicodeDecodeError:
        return error("invalid_json", "the line is not UTF-8 text")
    except json.JSONDecodeError as exc:
        return error("invalid_json", f"the line is not valid JSON: {exc.msg} (column {exc.colno})")
    except RecursionError:
        return error("invalid_json", "the line is nested too deeply")
    except ValueError:
        return error("invalid_json", f"the line holds an integer of more than {sys.get_int_max_str_digits()} digits")
    if not isinstance(obj, dict):
        return error("invalid_request", f"a request line must be a JSON object, got {type(obj).__name__}")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return error("missing_custom_id", "custom_id is missing or not a non-empty string")
    method, url, body = obj.get("method", "POST"), obj.get("url"), obj.get("body")
    if method != "POST":
        return error("unsupported_method", f"method must be 'POST', got {method!r}", custom_id)
    if not isinstance(url, str):
        return error("missing_url", f"url is missing; one of {', '.join(SUPPORTED_URLS)}", custom_id)
    if url not in SUPPORTED_URLS:
        return error("unsupported_url", f"url {url!r} is not supported; one of {', '.join(SUPPORTED_URLS)}",
                     custom_id)
    if not isinstance(body, dict):
        return error("missing_body", "body is missing or not a JSON object", custom_id)
    if body.get("stream") not in (None, False):  # the server coerces "true" and 1 to true as well
        # a batch result is one JSON body per request; the server's event stream has no place in it
        return error("stream_not_supported", "stream: true is not supported in a batch; leave it out", custom_id)
    return BatchRequest(number, custom_id, url, body)


def _new_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode()


def response_line(custom_id: str, status: int, request_id: str | None, body: bytes) -> bytes:
    """The output line of a request the server answered: `body` is the server's JSON body, spliced in as is
    rather than parsed and dumped again, so that it stays byte for byte what the HTTP server sends."""
    head = _json({"id": _new_id(), "custom_id": custom_id})[:-1]
    response = _json({"status_code": status, "request_id": request_id})[:-1]
    return head + b', "response": ' + response + b', "body": ' + body + b'}, "error": null}\n'


def error_line(custom_id: str | None, code: str, message: str) -> bytes:
    """The output line of a request that never reached the server (or got no JSON answer from it)."""
    return _json({"id": _new_id(), "custom_id": custom_id, "response": None,
                  "error": {"code": code, "message": message}}) + b"\n"


def output_tokens(body: Any) -> int:
    """Generated tokens in a response body's usage: `completion_tokens` of chat and text completions,
    `output_tokens` of responses and messages; 0 without usage."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0
    count = usage.get("completion_tokens", usage.get("output_tokens"))
    return count if isinstance(count, int) else 0
