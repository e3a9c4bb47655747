"""/v1/messages (Anthropic's Messages API) over HTTP with the official anthropic client: the same prompt and the
same generation as the chat request it amounts to, streamed events that the SDK accumulates into the
non-streaming message, forced tool use and a tool_result round trip, stop sequences, count_tokens, x-api-key
auth, and errors in Anthropic's shape naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from nibble.engine.async_engine import AsyncEngine
from nibble.engine.tokenizer import Tokenizer
from nibble.server.errors import APIError
from nibble.server.messages_items import BILLING_HEADER, BlockError, to_chat_messages
from nibble.server.messages_protocol import AnthropicError

from .conftest import MAX_MODEL_LEN, ServerHandle, metric_value, start_server, wait_idle

NO_THINK = {"type": "disabled"}
TOOLS = [
    {"name": "get_weather", "description": "Current weather of a city",
     "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                       "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                      "required": ["city", "days"]}},
    {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                          "required": ["zone"]}},
]
CHAT_TOOLS = [{"type": "function", "function": {
    **{k: v for k, v in t.items() if k in ("name", "description")}, "parameters": t["input_schema"]}}
    for t in TOOLS]
USER = [{"role": "user", "content": "Weather in Rome?"}]


@pytest.fixture()
def claude(server: ServerHandle) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def create(claude: anthropic.Anthropic, server: ServerHandle, extra_body: dict | None = None, **kwargs: Any):
    """A deterministic request (temperature 0, by default to max_tokens: ignore_eos). This SDK version has no
    temperature argument: it travels in the body as older clients send it."""
    kwargs.setdefault("messages", USER)
    return claude.messages.create(model=server.model, extra_body={"temperature": 0.0, "ignore_eos": True,
                                                                  **(extra_body or {})}, **kwargs)


def chat(client: openai.OpenAI, server: ServerHandle, messages: list[dict], max_tokens: int, **extra: Any):
    return client.chat.completions.create(model=server.model, messages=messages, max_tokens=max_tokens,
                                          temperature=0.0, extra_body={"ignore_eos": True, **extra})


def prompt_len(tokenizer: Tokenizer, messages: list[dict], **kwargs: Any) -> int:
    return len(tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)))


def prompt_tokens(usage) -> int:
    """Anthropic splits the prompt into uncached input tokens and tokens read from the (prefix) cache."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_same_generation_as_chat(claude: anthropic.Anthropic, client: openai.OpenAI, server: ServerHandle,
                                 tokenizer: Tokenizer) -> None:
    """system + messages render the prompt of the chat messages [system, user]; thinking and answer are what
    /v1/chat/completions returns for them, with thinking on (the model's default) and off."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    out = create(claude, server, system="Be brief.", messages=messages[1:], max_tokens=24)
    reference = chat(client, server, messages, 24)
    assert out.id.startswith("msg_") and out.type == "message" and out.role == "assistant"
    assert out.model == server.model and out.stop_reason == "max_tokens" and out.stop_sequence is None
    assert prompt_tokens(out.usage) == reference.usage.prompt_tokens == prompt_len(tokenizer, messages)
    assert out.usage.output_tokens == 24 and out.usage.cache_creation_input_tokens == 0
    message = reference.choices[0].message
    assert out.content[0].type == "thinking" and out.content[0].signature == ""
    assert out.content[0].thinking == message.model_extra["reasoning_content"]
    assert "".join(b.text for b in out.content if b.type == "text") == (message.content or "")

    no_think = create(claude, server, system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
                      messages=messages[1:], max_tokens=12, thinking=NO_THINK)
    reference = chat(client, server, messages, 12, chat_template_kwargs={"enable_thinking": False})
    assert [b.type for b in no_think.content] == ["text"]
    assert no_think.content[0].text == reference.choices[0].message.content
    assert prompt_tokens(no_think.usage) == prompt_len(tokenizer, messages, enable_thinking=False)
    # thinking 'enabled' (with a budget these 24 tokens do not reach) and 'adaptive' are the default: thinking on
    for thinking in ({"type": "enabled", "budget_tokens": 2048}, {"type": "adaptive"}):
        again = create(claude, server, system="Be brief.", messages=messages[1:], max_tokens=24, thinking=thinking)
        assert again.content == out.content


def test_omitted_thinking_display(claude: anthropic.Anthropic, server: ServerHandle) -> None:
    shown = create(claude, server, max_tokens=16, thinking={"type": "adaptive"})
    omitted = create(claude, server, max_tokens=16, thinking={"type": "adaptive", "display": "omitted"})
    assert shown.content[0].type == omitted.content[0].type == "thinking" and shown.content[0].thinking
    assert omitted.content[0].thinking == "" and omitted.usage.output_tokens == 16
    with claude.messages.stream(model=server.model, max_tokens=16, messages=USER,
                                thinking={"type": "adaptive", "display": "omitted"},
                                extra_body={"temperature": 0.0, "ignore_eos": True}) as stream:
        assert not [e for e in stream if e.type == "thinking"]
        assert stream.get_final_message().content == omitted.content


def _raw_events(server: ServerHandle, body: dict) -> list[tuple[str, dict]]:
    with httpx.Client(base_url=server.url, timeout=60) as http, \
            http.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    events = []
    for name, data in zip(lines[::2], lines[1::2]):
        assert name.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == name[len("event: "):]
        events.append((payload["type"], payload))
    return events


def _check_event_order(events: list[tuple[str, dict]]) -> None:
    """message_start, ping, then per block one start, its deltas and one stop, then message_delta and
    message_stop."""
    kinds = [k for k, _ in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    expected_index = 0
    open_index = None
    for kind, payload in events[2:-2]:
        if kind == "content_block_start":
            assert open_index is None and payload["index"] == expected_index
            open_index = expected_index
        elif kind == "content_block_delta":
            assert payload["index"] == open_index
        else:
            assert kind == "content_block_stop" and payload["index"] == open_index
            open_index, expected_index = None, expected_index + 1
    assert open_index is None


def _without_ids(message) -> dict:
    """The message to compare: without its random ids, the prompt whether cached or not, and without the fields
    the SDK's helper adds (ParsedTextBlock.parsed_output) or leaves unset."""
    dump = message.model_dump(exclude_none=True)
    dump.pop("id")
    for block in dump["content"]:
        block.pop("id", None)
    usage = dump.pop("usage")
    dump["prompt_tokens"] = usage["input_tokens"] + usage["cache_read_input_tokens"]
    dump["output_tokens"] = usage["output_tokens"]
    return dump


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": 30},
    {"max_tokens": 20, "thinking": NO_THINK},
    {"max_tokens": 200, "tools": TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
     "thinking": NO_THINK, "extra_body": {"ignore_eos": False}},
    {"max_tokens": 200, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_time"}, "thinking": NO_THINK,
     "system": "Call tools.", "extra_body": {"ignore_eos": False}},
])
def test_stream_matches_non_stream(claude: anthropic.Anthropic, server: ServerHandle, kwargs: dict) -> None:
    """The SDK's stream helper accumulates the events into the message the non-streaming request returns;
    the raw events follow Anthropic's order."""
    kwargs = {"messages": USER, **kwargs}
    extra = {"temperature": 0.0, "ignore_eos": True, **kwargs.pop("extra_body", {})}
    out = claude.messages.create(model=server.model, extra_body=extra, **kwargs)
    with claude.messages.stream(model=server.model, extra_body=extra, **kwargs) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert _without_ids(final) == _without_ids(out)
    assert "".join(texts) == "".join(b.text for b in out.content if b.type == "text")
    if "tools" in kwargs:
        (call,) = final.content
        assert call.id.startswith("toolu_") and final.stop_reason == "tool_use"
        _check_call(call, (kwargs["tool_choice"].get("name", "get_weather"), "get_time"))
    body = {"model": server.model, **kwargs, **extra}
    events = _raw_events(server, body)
    _check_event_order(events)
    start, delta = events[0][1], events[-2][1]
    assert start["message"]["content"] == [] and start["message"]["stop_reason"] is None
    assert delta["delta"]["stop_reason"] == out.stop_reason
    assert delta["usage"]["output_tokens"] == out.usage.output_tokens


def _check_call(block, names: tuple[str, ...] = ("get_weather", "get_time")) -> None:
    assert block.type == "tool_use" and block.name in names
    tool = next(t for t in TOOLS if t["name"] == block.name)
    assert set(tool["input_schema"]["required"]) <= set(block.input) <= set(tool["input_schema"]["properties"])
    if "days" in block.input:
        assert isinstance(block.input["days"], int) and 1 <= block.input["days"] <= 9


def test_forced_tool_use(claude: anthropic.Anthropic, server: ServerHandle) -> None:
    for seed in range(3):
        out = create(claude, server, max_tokens=200, tools=TOOLS, thinking=NO_THINK,
                     tool_choice={"type": "any", "disable_parallel_tool_use": True},
                     extra_body={"temperature": 1.0, "seed": seed, "ignore_eos": False})
        assert out.stop_reason == "tool_use" and len(out.content) == 1
        _check_call(out.content[0])
    named = create(claude, server, max_tokens=200, tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"},
                   thinking=NO_THINK, extra_body={"ignore_eos": False})
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_time"]
    _check_call(named.content[-1], ("get_time",))
    # tool_choice none: the tools are left out of the prompt, as in chat
    none = create(claude, server, max_tokens=4, tools=TOOLS, tool_choice={"type": "none"}, thinking=NO_THINK)
    plain = create(claude, server, max_tokens=4, thinking=NO_THINK)
    assert prompt_tokens(none.usage) == prompt_tokens(plain.usage)


def test_tool_result_round_trip(claude: anthropic.Anthropic, client: openai.OpenAI, server: ServerHandle,
                                tokenizer: Tokenizer) -> None:
    """The assistant's message sent back as the SDK does (with a thinking block before its tool_use), then a
    tool_result: the prompt is the chat template's rendering of the user turn, the assistant's reasoning and
    tool call, and the tool message; the generation is chat's."""
    first = create(claude, server, max_tokens=200, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
                   thinking=NO_THINK, extra_body={"ignore_eos": False})
    (call,) = first.content
    _check_call(call, ("get_weather",))
    assistant = {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "I should look it up.", "signature": ""},
        *(block.model_dump(exclude_none=True) for block in first.content)]}
    result = [{"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "sunny, 21 C"}]}]
    conversation = [*USER, assistant, {"role": "user", "content": result}]
    follow = create(claude, server, max_tokens=8, tools=TOOLS, messages=conversation)
    messages = [*USER,
                {"role": "assistant", "reasoning_content": "I should look it up.", "tool_calls": [
                    {"id": call.id, "type": "function",
                     "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    reference = client.chat.completions.create(model=server.model, messages=messages, tools=CHAT_TOOLS, max_tokens=8,
                                               temperature=0.0, extra_body={"ignore_eos": True})
    assert prompt_tokens(follow.usage) == reference.usage.prompt_tokens == prompt_len(tokenizer, messages,
                                                                                      tools=CHAT_TOOLS)
    message = reference.choices[0].message
    assert [b.thinking for b in follow.content if b.type == "thinking"] == [message.model_extra["reasoning_content"]]
    # a string result, and is_error (which the template has no place for), render the same prompt
    result = [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C", "is_error": True}]
    again = create(claude, server, max_tokens=8, tools=TOOLS, messages=[*conversation[:2], {"role": "user",
                                                                                             "content": result}])
    assert prompt_tokens(again.usage) == prompt_tokens(follow.usage) and again.content == follow.content


def test_stop_sequences(claude: anthropic.Anthropic, server: ServerHandle) -> None:
    text = create(claude, server, max_tokens=40, thinking=NO_THINK).content[0].text
    start = next(i for i in range(4, len(text) - 3) if text[i:i + 3].isascii() and text[i:i + 3].strip())
    stop = text[start:start + 3]
    out = create(claude, server, max_tokens=40, thinking=NO_THINK, stop_sequences=["never-generated", stop])
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    assert out.content[0].text == text[:text.index(stop)]
    with claude.messages.stream(model=server.model, max_tokens=40, messages=USER, thinking=NO_THINK,
                                stop_sequences=[stop], extra_body={"temperature": 0.0, "ignore_eos": True}) as s:
        final = s.get_final_message()
    assert _without_ids(final) == _without_ids(out)


def test_max_tokens_is_capped_by_the_context_window(claude: anthropic.Anthropic, server: ServerHandle,
                                                    tokenizer: Tokenizer) -> None:
    """Anthropic clients ask for more tokens than the window leaves (Claude Code: 32k): the generation stops at
    the window with model_context_window_exceeded. Only a prompt that fills the window is refused."""
    words = " ".join(["lorem"] * (MAX_MODEL_LEN - 40))
    while prompt_len(tokenizer, [{"role": "user", "content": words}], enable_thinking=False) > MAX_MODEL_LEN - 6:
        words = words[: -len(" lorem")]
    room = MAX_MODEL_LEN - prompt_len(tokenizer, [{"role": "user", "content": words}], enable_thinking=False)
    out = create(claude, server, max_tokens=32000, thinking=NO_THINK, messages=[{"role": "user", "content": words}])
    assert out.stop_reason == "model_context_window_exceeded" and out.usage.output_tokens == room
    with pytest.raises(anthropic.BadRequestError, match="maximum context length"):
        create(claude, server, max_tokens=10, messages=[{"role": "user", "content": words * 2}])


def test_json_output_format(claude: anthropic.Anthropic, server: ServerHandle) -> None:
    schema = {"type": "object", "properties": {"sky": {"enum": ["clear", "rain"]},
                                               "temp": {"type": "integer", "minimum": -50, "maximum": 50}},
              "required": ["sky", "temp"], "additionalProperties": False}
    config = {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}
    out = create(claude, server, max_tokens=60, thinking=NO_THINK,
                 extra_body={"temperature": 0.8, "seed": 3, "ignore_eos": False, "output_config": config})
    assert out.stop_reason == "end_turn"
    value = json.loads(out.content[0].text)
    assert set(value) == {"sky", "temp"} and value["sky"] in ("clear", "rain")


def test_count_tokens(claude: anthropic.Anthropic, client: openai.OpenAI, server: ServerHandle) -> None:
    counted = claude.messages.count_tokens(model=server.model, system="Be brief.", messages=USER, tools=TOOLS)
    messages = [{"role": "system", "content": "Be brief."}, *USER]
    reference = client.chat.completions.create(model=server.model, messages=messages, tools=CHAT_TOOLS, max_tokens=1)
    assert counted.input_tokens == reference.usage.prompt_tokens
    off = claude.messages.count_tokens(model=server.model, system="Be brief.", messages=USER, tools=TOOLS,
                                       thinking=NO_THINK)
    assert off.input_tokens > counted.input_tokens  # the closed think block is part of the prompt
    sent = create(claude, server, max_tokens=1, system="Be brief.", tools=TOOLS)
    assert prompt_tokens(sent.usage) == counted.input_tokens


def test_system_messages_and_billing_header_fold_into_the_system_prompt() -> None:
    system = [{"type": "text", "text": f"{BILLING_HEADER} cc_version=2.1; cch=1a2b3;"},
              {"type": "text", "text": "You are a coder.", "cache_control": {"type": "ephemeral"}}]
    messages = [
        {"role": "system", "content": "Mind the tests."},
        {"role": "user", "content": [{"type": "text", "text": "Fix "}, {"type": "text", "text": "it."}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look first.", "signature": "s"},
                                          {"type": "redacted_thinking", "data": "x"},
                                          {"type": "text", "text": "Reading."}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {"p": "a"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "code"},
                                     {"type": "text", "text": "Go on."}]},
    ]
    assert to_chat_messages(system, messages) == [
        {"role": "system", "content": "You are a coder.\n\nMind the tests."},
        {"role": "user", "content": [{"type": "text", "text": "Fix "}, {"type": "text", "text": "it."}]},
        {"role": "assistant", "reasoning_content": "Look first.", "content": "Reading.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "read", "arguments": '{"p": "a"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "code"},
        {"role": "user", "content": [{"type": "text", "text": "Go on."}]},
    ]
    assert to_chat_messages(f"{BILLING_HEADER} cch=1;\nBe kind.", messages[1:2])[0] == \
        {"role": "system", "content": "Be kind."}
    with pytest.raises(BlockError) as err:
        to_chat_messages(None, [*messages[1:4]])
    assert err.value.param == "messages[2].role"  # a final assistant message: a prefill


@pytest.fixture()
def http_anthropic(server: ServerHandle) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60, headers={"anthropic-version": "2023-06-01"}) as c:
        yield c


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "demo", "max_tokens": 4, "messages": USER, **fields}


@pytest.mark.parametrize(("payload", "starts"), [
    ({"model": "demo", "messages": USER}, "max_tokens"),
    (body(max_tokens=0), "max_tokens"),
    (body(messages=[]), "messages"),
    (body(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
    # the demo model has no vision tower (images: tests/vision/test_image_generation.py)
    (body(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]),
     "messages: this model does not take image input"),
    (body(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]),
     "messages[0].content[0].source.type"),
    (body(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]),
     "messages[0].content[0].type"),
    (body(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}]), "messages[0].content[0].content[0].type"),
    (body(messages=[{"role": "user", "content": [{"type": "hologram"}]}]), "messages[0].content[0].type"),
    (body(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
     "messages[0].content[0].type"),
    (body(messages=[*USER, {"role": "assistant", "content": "Sure"}]), "messages[1].role"),
    (body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
    (body(tools=[{"name": "f"}]), "tools[0].input_schema"),
    (body(tools=[{**TOOLS[0], "defer_loading": True}]), "tools[0].defer_loading"),
    (body(tool_choice={"type": "any"}), "tool_choice"),
    (body(tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}), "tool_choice"),
    (body(tools=TOOLS, tool_choice={"type": "sometimes"}), "tool_choice.type"),
    (body(thinking={"type": "enabled"}), "thinking.budget_tokens"),
    (body(thinking={"type": "between_tools"}), "thinking.type"),
    (body(thinking={"type": "disabled"}, chat_template_kwargs={"enable_thinking": True}), "thinking"),
    (body(stop_sequences=[""]), "stop_sequences"),
    (body(temperature=1.5), "temperature"),
    (body(output_config={"format": {"type": "json_schema"}}), "output_config.format.schema"),
    (body(output_config={"format": {"type": "json_schema", "schema": {"type": "nope"}}}), "output_config.format"),
    (body(context_management={"edits": [{"type": "clear_tool_uses_20250919"}]}), "context_management.edits[0]"),
    (body(container="c1"), "container"),
    (body(mcp_servers=[{"type": "url", "url": "x", "name": "m"}]), "mcp_servers"),
])
def test_bad_requests_name_the_field(http_anthropic: httpx.Client, payload: dict, starts: str) -> None:
    r = http_anthropic.post("/v1/messages", json=payload)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"].startswith(starts), r.json()


def test_error_shapes(claude: anthropic.Anthropic, http_anthropic: httpx.Client) -> None:
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=USER)
    assert err.value.body["error"] == {"type": "not_found_error", "message": err.value.body["error"]["message"]}
    assert "claude-sonnet-4-5" in err.value.body["error"]["message"]
    r = http_anthropic.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = http_anthropic.get("/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"
    r = http_anthropic.post("/v1/messages/count_tokens", json={"model": "demo", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages")
    # engine errors take Anthropic's types; a chat field an error names is renamed to the Messages field
    assert AnthropicError.of(APIError(503, "busy", code="server_overloaded")).body()["error"]["type"] == \
        "overloaded_error"
    assert AnthropicError.of(APIError(503, "dead", code="engine_dead")).type == "api_error"
    renamed = AnthropicError.of(APIError(400, "stop: too many", param="stop"), {"stop": "stop_sequences"})
    assert renamed.message == "stop_sequences: too many"
    assert renamed.sse_event().startswith('event: error\ndata: {"type": "error"')
    # the OpenAI routes keep OpenAI's error body
    r = http_anthropic.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and set(r.json()) == {"error"} and r.json()["error"]["param"] == "messages"


def test_api_key(engine: AsyncEngine) -> None:
    handle = start_server(engine, api_key="sk-secret")
    try:
        def ask(**auth: str):
            c = anthropic.Anthropic(base_url=handle.url, max_retries=0, timeout=60, **auth)
            return c.messages.create(model=handle.model, max_tokens=2, messages=USER)

        assert ask(api_key="sk-secret").usage.output_tokens >= 1  # x-api-key
        assert ask(auth_token="sk-secret").usage.output_tokens >= 1  # Authorization: Bearer
        for auth in ({"api_key": "wrong"}, {"auth_token": "wrong"}):
            with pytest.raises(anthropic.AuthenticationError) as err:
                ask(**auth)
            assert err.value.body["error"]["type"] == "authentication_error"
        with httpx.Client(base_url=handle.url, timeout=30) as http:
            r = http.post("/v1/messages/count_tokens", json={"model": handle.model, "messages": USER})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            ok = http.post("/v1/messages/count_tokens", json={"model": handle.model, "messages": USER},
                           headers={"x-api-key": "sk-secret"})
            assert ok.status_code == 200 and ok.json()["input_tokens"] > 0
            # x-api-key is Anthropic's header: the OpenAI routes still want a Bearer token, and answer as before
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={"x-api-key": "sk-secret"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    finally:
        handle.stop()


def test_stream_disconnect_aborts(server: ServerHandle, http: httpx.Client) -> None:
    def aborted() -> float:
        return metric_value(http.get("/metrics").text, "nibble:request_success_total", finished_reason="abort")

    before = aborted()
    payload = {"model": server.model, "max_tokens": 900, "messages": [{"role": "user", "content": "A long story"}],
               "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as c, c.stream("POST", "/v1/messages", json=payload) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("event: content_block_delta")
            if events >= 4:
                break
        assert server.engine.stats()["num_running"] == 1
    assert wait_idle(server.engine), server.engine.stats()
    assert aborted() == before + 1


def test_stream_block_indices_are_positions_not_values() -> None:
    """Two text blocks with the same text so far (before and after a tool call) are distinct blocks: every delta
    and stop names the block it belongs to."""
    from nibble.server.messages_protocol import MessageObject, MessagesUsage
    from nibble.server.messages_stream import MessageEventWriter
    from nibble.server.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall

    writer = MessageEventWriter(MessageObject(model="m", usage=MessagesUsage(input_tokens=1, output_tokens=0)))
    events = writer.feed(DeltaMessage(content="Let"))
    events += writer.feed(DeltaMessage(tool_calls=[DeltaToolCall(index=0, id="call_1", type="function",
                                                                 function=DeltaFunctionCall(name="f", arguments=""))]))
    events += writer.feed(DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments="{}"))]))
    events += writer.feed(DeltaMessage(content="Let"))
    events += writer.feed(DeltaMessage(content=" me"))
    events += writer.finish("end_turn", None, MessagesUsage(input_tokens=1, output_tokens=5))[0]
    data = [json.loads(e.split("data: ", 1)[1]) for e in events]
    indexed = [(d["type"], d["index"]) for d in data if "index" in d]
    assert indexed == [("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
                       ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
                       ("content_block_start", 2), ("content_block_delta", 2), ("content_block_delta", 2),
                       ("content_block_stop", 2)]
    assert [b.text for b in writer.message.content if b.type == "text"] == ["Let", "Let me"]
