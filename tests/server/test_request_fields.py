"""Request fields that are not lost without a word, on the demo model over HTTP: /v1/responses and /v1/messages
pass every sampling field /v1/chat/completions takes on to the chat request they amount to (logit_bias,
allowed_token_ids, bad_words, structured_outputs, skip_special_tokens, include_stop_str_in_output...), Responses'
include_reasoning leaves the reasoning item out, streamed or not, and a field no endpoint uses is logged as
ignored, once per request, with the endpoint's route."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest

from nibble.engine.token_masks import tokenize_bad_words
from nibble.engine.tokenizer import Tokenizer
from nibble.server.messages_protocol import MessagesRequest
from nibble.server.protocol import SHARED_SAMPLING_FIELDS, ChatCompletionRequest
from nibble.server.request_body import ignored_fields
from nibble.server.responses_protocol import ResponsesRequest
from nibble.server.serving_messages import MessagesServing
from nibble.server.serving_responses import ResponsesServing

from .conftest import ServerHandle
from .test_sampling_fields import post

# Deterministic, without thinking: the output is the answer, token for token.
ANSWER = {"input": "Name a colour.", "temperature": 0.0, "reasoning": {"effort": "none"}, "ignore_eos": True}
MESSAGE = {"messages": [{"role": "user", "content": "Name a colour."}], "temperature": 0.0,
           "thinking": {"type": "disabled"}, "ignore_eos": True}
BOX_START = 996  # a special token of the demo tokenizer that stops nothing
# Thinking on, with a slight bias towards `</think>`: the demo model reasons for a few tokens and then
# answers within the constraint (unbiased, it reasons past any small token budget).
SHORT_REASONING = {"input": "Name a colour.", "temperature": 0.0, "max_output_tokens": 60,
                   "logit_bias": {"1016": 1.5}, "structured_outputs": {"choice": ["red", "green"]}}
# A value other than the default for every shared sampling field.
SHARED_VALUES: dict[str, Any] = {
    "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5,
    "seed": 7, "ignore_eos": True, "min_tokens": 2, "skip_special_tokens": False, "include_stop_str_in_output": True,
    "logit_bias": {"5": 1.0}, "cache_salt": "salt", "priority": 0, "structured_outputs": {"regex": "a+"},
    "allowed_token_ids": [5, 6], "bad_words": ["x"], "thinking_token_budget": 5}


def sse_events(server: ServerHandle, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.api + path, json={"model": server.model, "stream": True, **body},
                      timeout=120) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def output_text(response: dict[str, Any]) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


def test_every_shared_field_is_forwarded() -> None:
    """Whatever SharedSamplingFields declares reaches the chat request, from both endpoints, with its value."""
    assert set(SHARED_VALUES) == set(SHARED_SAMPLING_FIELDS)
    responses = ResponsesServing.__new__(ResponsesServing)
    req = ResponsesRequest.model_validate({"input": "hi", **SHARED_VALUES})
    chat = responses._chat_body(req, {}, [])
    messages = MessagesServing.__new__(MessagesServing)
    anthropic = MessagesRequest.model_validate({**MESSAGE, "model": "m", "max_tokens": 4, **SHARED_VALUES})
    for body in (chat, messages._chat_body(anthropic, {})):
        assert {k: body[k] for k in SHARED_VALUES} == SHARED_VALUES
        assert ChatCompletionRequest.model_validate(body).model_dump(include=set(SHARED_VALUES)) == SHARED_VALUES


def test_responses_token_masks(server: ServerHandle, tokenizer: Tokenizer) -> None:
    token = tokenizer.encode(" blue", add_special_tokens=False)[0]
    out = post(server, "/responses", {**ANSWER, "max_output_tokens": 8, "allowed_token_ids": [token]})
    assert output_text(out) == tokenizer.decode([token] * 8) and out["usage"]["output_tokens"] == 8
    biased = post(server, "/responses", {**ANSWER, "max_output_tokens": 8, "logit_bias": {str(token): 100}})
    assert output_text(biased) == output_text(out)
    # skip_special_tokens false: the special token the bias forces is in the text, as on the other endpoints
    special = {**ANSWER, "max_output_tokens": 4, "logit_bias": {str(BOX_START): 100}}
    assert output_text(post(server, "/responses", {**special, "skip_special_tokens": False})) == "<|box_start|>" * 4
    assert output_text(post(server, "/responses", special)) == ""
    chat = {"messages": [{"role": "user", "content": ANSWER["input"]}], "temperature": 0.0, "ignore_eos": True,
            "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 12}
    free = post(server, "/chat/completions", {**chat, "logprobs": True, "return_tokens_as_token_ids": True})
    ids = [int(e["token"].removeprefix("token_id:")) for e in free["choices"][0]["logprobs"]["content"]]
    # a generated token that bad_words bans as a word of its own (vLLM's tokenization)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    word = next(w for i in ids if [i] in tokenize_bad_words([w := tokenizer.decode([i])], encode, 1024))
    banned = post(server, "/responses", {**ANSWER, "max_output_tokens": 12, "bad_words": [word]})
    want = post(server, "/chat/completions", {**chat, "bad_words": [word]})["choices"][0]["message"]["content"]
    assert output_text(banned) == want != free["choices"][0]["message"]["content"]


def test_responses_stop_string_kept_on_request(server: ServerHandle) -> None:
    free = output_text(post(server, "/responses", {**ANSWER, "max_output_tokens": 16}))
    at = next(i for i in range(len(free) // 2, len(free) - 1) if free[i:i + 2].isascii() and free[i:i + 2].isalpha())
    stop = free[at:at + 2]
    cut = post(server, "/responses", {**ANSWER, "max_output_tokens": 16, "stop": [stop]})
    kept = post(server, "/responses", {**ANSWER, "max_output_tokens": 16, "stop": [stop],
                                       "include_stop_str_in_output": True})
    assert cut["status"] == kept["status"] == "completed"
    assert output_text(kept) == output_text(cut) + stop and free.startswith(output_text(kept))


def test_responses_structured_outputs(server: ServerHandle) -> None:
    body = {**ANSWER, "ignore_eos": False, "max_output_tokens": 30,
            "structured_outputs": {"choice": ["crimson", "teal"]}}
    out = post(server, "/responses", body)
    assert out["status"] == "completed" and output_text(out) in ("crimson", "teal")
    events = sse_events(server, "/responses", body)
    assert output_text(events[-1]["response"]) == output_text(out)


def test_responses_include_reasoning_false(server: ServerHandle) -> None:
    """The reasoning is generated and counted, but neither the response nor its events carry it."""
    full = post(server, "/responses", SHORT_REASONING)
    assert [o["type"] for o in full["output"]] == ["reasoning", "message"]
    out = post(server, "/responses", {**SHORT_REASONING, "include_reasoning": False})
    assert [o["type"] for o in out["output"]] == ["message"] and output_text(out) == output_text(full)
    assert out["usage"] == full["usage"] and out["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    events = sse_events(server, "/responses", {**SHORT_REASONING, "include_reasoning": False})
    assert not [e for e in events if "reasoning" in e["type"] or e.get("item", {}).get("type") == "reasoning"]
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message"] and final["usage"] == out["usage"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == output_text(out)


def test_responses_echo_hints(server: ServerHandle) -> None:
    hints = {"max_tool_calls": 3, "prompt_cache_key": "repo-1", "safety_identifier": "user-1", "service_tier": "flex"}
    out = post(server, "/responses", {**ANSWER, "max_output_tokens": 2, **hints})
    assert {k: out[k] for k in ("max_tool_calls", "prompt_cache_key", "safety_identifier")} == \
        {"max_tool_calls": 3, "prompt_cache_key": "repo-1", "safety_identifier": "user-1"}


@pytest.mark.parametrize(("fields", "param"), [
    ({"logit_bias": {"blue": 1}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": "blue"}, "bad_words"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"skip_special_tokens": "sometimes"}, "skip_special_tokens"),
    ({"include_reasoning": "sometimes"}, "include_reasoning"),
    ({"structured_outputs": {"xml": "x"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["a"]}, "text": {"format": {"type": "json_object"}}}, "structured_outputs"),
    ({"service_tier": "gold"}, "service_tier"),
    ({"max_tool_calls": -1}, "max_tool_calls"),
    ({"cache_salt": ""}, "cache_salt"),
])
def test_responses_bad_fields_are_named(server: ServerHandle, fields: dict[str, Any], param: str) -> None:
    r = httpx.post(server.api + "/responses", json={"input": "hi", **fields}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    if "text" in fields:
        assert r.json()["error"]["message"] == "Cannot specify both structured_outputs and text.format"


def test_messages_sampling_fields(server: ServerHandle, tokenizer: Tokenizer) -> None:
    token = tokenizer.encode(" blue", add_special_tokens=False)[0]
    for fields in ({"allowed_token_ids": [token]}, {"logit_bias": {str(token): 100}}):
        out = post(server, "/messages", {**MESSAGE, "max_tokens": 6, **fields})
        assert out["content"] == [{"type": "text", "text": tokenizer.decode([token] * 6)}]
    choice = post(server, "/messages", {**MESSAGE, "ignore_eos": False, "max_tokens": 30,
                                        "structured_outputs": {"choice": ["crimson", "teal"]}})
    assert choice["stop_reason"] == "end_turn" and choice["content"][0]["text"] in ("crimson", "teal")
    conflict = httpx.post(server.url + "/v1/messages", timeout=60, json={
        **MESSAGE, "model": server.model, "max_tokens": 4, "structured_outputs": {"choice": ["a"]},
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}})
    assert conflict.status_code == 400 and conflict.json()["error"]["message"] == \
        "structured_outputs: cannot be given together with output_config.format"
    bad = httpx.post(server.url + "/v1/messages", timeout=60,
                     json={**MESSAGE, "model": server.model, "max_tokens": 4, "logit_bias": {"blue": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("logit_bias"), bad.text


def test_ignored_fields_are_named() -> None:
    body = {"messages": [], "store": True, "stream_options": {"include_usag": True, "include_usage": True},
            "enable_thinking": False, "logprobs": True}
    assert ignored_fields(ChatCompletionRequest, body) == ["store", "enable_thinking", "stream_options.include_usag"]
    assert ignored_fields(ChatCompletionRequest, body, ("enable_thinking",)) == ["store", "stream_options.include_usag"]


def _ignored_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "present in the request but ignored" in r.getMessage()]


@pytest.mark.parametrize(("path", "known", "extra", "named"), [
    ("/chat/completions", {"messages": MESSAGE["messages"], "max_tokens": 1},
     {"store": True, "service_tier": "auto", "enable_thinking": False, "use_beam_search": False, "stream": True,
      "stream_options": {"include_usag": True}}, "store, service_tier, stream_options.include_usag"),
    ("/completions", {"prompt": "hi", "max_tokens": 1}, {"sufix": "x"}, "sufix"),
    ("/responses", {"input": "hi", "max_output_tokens": 1},
     {"enable_thinking": False, "prompt_cache_key": "k", "frobnicate": 1}, "frobnicate"),
    ("/messages", {**MESSAGE, "max_tokens": 1},
     {"enable_thinking": False, "speed": "fast", "container": None, "workspace_id": "w"}, "workspace_id"),
    ("/messages/count_tokens", {"messages": MESSAGE["messages"]}, {"max_tokens": 1, "thinking": None, "n": 2},
     "max_tokens, n"),
])
def test_ignored_fields_are_logged(server: ServerHandle, caplog: pytest.LogCaptureFixture, path: str,
                                   known: dict[str, Any], extra: dict[str, Any], named: str) -> None:
    """One warning per request, with its id and route, naming exactly the fields nothing reads: not those the
    handler reads from the body itself, nor those of the chat request a Responses or Messages request becomes."""
    caplog.set_level(logging.WARNING, logger="nibble.server")
    post(server, path, known)
    assert not _ignored_lines(caplog)
    if extra.get("stream"):
        sse_events(server, path, {**known, **extra})
    else:
        post(server, path, {**known, **extra})
    (line,) = _ignored_lines(caplog)
    request_id, route = line.split(" ")[:2]
    assert request_id.startswith(("chatcmpl-", "cmpl-", "resp_", "msg_")) and route == f"/v1{path}:"
    quoted = ", ".join(repr(name) for name in named.split(", "))
    assert line.endswith(f"the following fields were present in the request but ignored: {quoted}")


def test_ignored_field_names_cannot_forge_log_lines(server: ServerHandle, caplog: pytest.LogCaptureFixture) -> None:
    """A client's key goes into the log quoted (a line break stays an escape) and the list is capped."""
    caplog.set_level(logging.WARNING, logger="nibble.server")
    junk = {f"junk{i}": i for i in range(100)}
    post(server, "/completions", {"prompt": "hi", "max_tokens": 1, "a\nFAKE LOG LINE": 1, **junk})
    (line,) = _ignored_lines(caplog)
    assert "\n" not in line and "'a\\nFAKE LOG LINE'" in line and line.endswith("and 81 more")
