"""Malformed and edge-case requests that used to end in a 500, a stalled event loop, a misleading message or a
value silently taken for another: each is now a 400 naming its field, on every endpoint it reaches."""

from __future__ import annotations

import sys
from typing import Any

import httpx
import pytest

from nibble.server.batch_format import BatchLineError, parse_batch_lines

from .conftest import ServerHandle
from .test_errors import assert_still_serving, check_error

USER = [{"role": "user", "content": "hi"}]
HUGE_INT = "9" * (sys.get_int_max_str_digits() + 1)
BAD_REQUIRED = {"type": "object", "properties": {"a": {"type": "string"}}, "required": 5}


def post(http: httpx.Client, path: str, body: dict[str, Any], model: str) -> httpx.Response:
    return http.post(path, json={"model": model, **body})


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 1}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
])
def test_logit_bias_key_of_non_decimal_digits(http: httpx.Client, server: ServerHandle, path: str,
                                              body: dict[str, Any]) -> None:
    """'²' is a digit to str.isdigit but no int(): it was a 500 (ValueError in logit_bias_ids)."""
    error = check_error(post(http, path, {**body, "logit_bias": {"²": 1}}, server.model), 400)
    assert error["param"] == "logit_bias" and "'²'" in error["message"]
    assert post(http, path, {**body, "logit_bias": {"٥": 1}}, server.model).status_code == 200
    assert_still_serving(http)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 1, "tool_choice": "required",
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_REQUIRED}}]}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 1, "tool_choice": "required",
                       "tools": [{"type": "function", "name": "f", "parameters": BAD_REQUIRED}]}),
    ("/v1/messages", {"messages": USER, "max_tokens": 1, "tool_choice": {"type": "any"},
                      "tools": [{"name": "f", "input_schema": BAD_REQUIRED}]}),
])
def test_forced_tool_call_with_malformed_required(http: httpx.Client, server: ServerHandle, path: str,
                                                  body: dict[str, Any]) -> None:
    """The forced-tool grammar iterated `required` as given: a number was a 500 (TypeError)."""
    r = post(http, path, body, server.model)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"].startswith("tools: function 'f': parameters.required must be a list")
    if path != "/v1/messages":
        assert error["param"] == "tools"


def test_integer_over_the_digit_limit(http: httpx.Client, server: ServerHandle) -> None:
    """json.loads raises a plain ValueError (not JSONDecodeError) past sys.get_int_max_str_digits()."""
    raw = b'{"prompt": "hi", "max_tokens": ' + HUGE_INT.encode() + b"}"
    error = check_error(http.post("/v1/completions", content=raw, headers={"content-type": "application/json"}), 400)
    assert "digits" in error["message"]
    items = [{"role": "user", "content": "hi"},
             {"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"a": ' + HUGE_INT + "}"},
             {"type": "function_call_output", "call_id": "c", "output": "ok"}]
    error = check_error(post(http, "/v1/responses", {"input": items, "max_output_tokens": 1}, server.model), 400)
    assert error["param"] == "input[1].arguments" and "digits" in error["message"]
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": ' + HUGE_INT + "}"}}]
    messages = [*USER, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c", "content": "ok"}]
    error = check_error(post(http, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}, server.model),
                        400)
    assert "arguments" in error["message"] and "digits" in error["message"]
    schema = '{"type": "object", "maxProperties": ' + HUGE_INT + "}"
    error = check_error(post(http, "/v1/chat/completions", {"messages": USER, "max_tokens": 1, "guided_json": schema},
                             server.model), 400)
    assert "digits" in error["message"]
    assert_still_serving(http)


def test_batch_line_with_huge_integer_is_a_line_error() -> None:
    """One such line ended the whole run-batch instead of failing alone."""
    data = b'{"custom_id": "a", "x": ' + HUGE_INT.encode() + b'}\n{"custom_id": "b", "url": "/v1/completions"}'
    first, _ = list(parse_batch_lines(data))
    assert isinstance(first, BatchLineError) and first.code == "invalid_json" and "digits" in first.message


def test_completion_count_over_the_waiting_limit(http: httpx.Client, server: ServerHandle) -> None:
    """Prompts times n were unbounded: 10000 prompts with n=64 held the event loop (and /health) for over a
    minute before the engine refused them as overload."""
    limit = server.engine.config.max_waiting_requests
    prompts = [[5]] * (limit // 64 + 1)
    error = check_error(post(http, "/v1/completions", {"prompt": prompts, "max_tokens": 1, "n": 64},
                             server.model), 400)
    assert error["param"] == "prompt" and f"at most {limit}" in error["message"]
    assert_still_serving(http)


@pytest.mark.parametrize("value", ["false", 0, "no"])
def test_enable_thinking_template_kwarg_must_be_a_boolean(http: httpx.Client, server: ServerHandle,
                                                          value: Any) -> None:
    """The template took "false" or 0 for thinking on, without a word; the top-level field was already checked."""
    kwargs = {"chat_template_kwargs": {"enable_thinking": value}}
    for path, body in (("/v1/chat/completions", {"messages": USER, "max_tokens": 1, **kwargs}),
                       ("/v1/responses", {"input": "hi", "max_output_tokens": 1, **kwargs}),
                       ("/tokenize", {"messages": USER, **kwargs})):
        error = check_error(post(http, path, body, server.model), 400)
        assert error["param"] == "chat_template_kwargs" and "enable_thinking" in error["message"]
    off = {"chat_template_kwargs": {"enable_thinking": None}}
    assert post(http, "/tokenize", {"messages": USER, **off}, server.model).status_code == 200


def test_query_parameter_error_names_it(http: httpx.Client, server: ServerHandle) -> None:
    """A bad query parameter was answered with the repr of FastAPI's error list and param null."""
    response_id = post(http, "/v1/responses", {"input": "hi", "max_output_tokens": 1}, server.model).json()["id"]
    error = check_error(http.get(f"/v1/responses/{response_id}/input_items", params={"limit": "x"}), 400)
    assert error["param"] == "limit" and error["message"].startswith("limit: ") and "'loc'" not in error["message"]


def test_field_message_fits_the_endpoint(http: httpx.Client, server: ServerHandle) -> None:
    """The union fields' 'must be ...' lines of /v1/completions and /v1/chat/completions were also given for
    fields of the same name and another type, telling the client to send what it had sent."""
    error = check_error(post(http, "/tokenize", {"prompt": ["a", "b"]}, server.model), 400)
    assert error["param"] == "prompt" and "list" not in error["message"]
    r = post(http, "/v1/messages", {"messages": USER, "max_tokens": 1, "tool_choice": "auto"}, server.model)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("tool_choice: Input should be a valid "
                                                                            "dictionary")
    error = check_error(post(http, "/v1/completions", {"prompt": 5, "max_tokens": 1}, server.model), 400)
    assert error["message"].startswith("prompt: must be a string, a list of strings")


@pytest.mark.parametrize(("body", "message"), [
    ({"system": [{"type": "image"}]}, "system[0].type: 'image' blocks are not supported here; only text blocks are"),
    ({"messages": [*USER, {"role": "assistant", "content": [{"type": "image"}]}]},
     "messages[1].content[0].type: 'image' blocks are not supported here; only text, thinking and tool_use blocks "
     "are"),
])
def test_messages_block_errors_say_what_is_accepted(http: httpx.Client, server: ServerHandle, body: dict[str, Any],
                                                    message: str) -> None:
    """Such blocks were refused as 'not supported; not supported (text and image blocks are)'."""
    r = post(http, "/v1/messages", {"messages": USER, "max_tokens": 1, **body}, server.model)
    assert r.status_code == 400 and r.json()["error"]["message"] == message, r.text
