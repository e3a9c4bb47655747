"""/v1/responses (OpenAI's Responses API) over HTTP with the official openai client: the same prompt and the
same generation as the chat request it amounts to, streamed events that add up to the non-streaming response,
function calls continued with previous_response_id, the store, and errors naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from openai._models import construct_type
from openai._types import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from openai.types.responses.response_item_list import ResponseItemList
from pydantic import TypeAdapter

from nibble.engine.tokenizer import Tokenizer
from nibble.server.protocol import ChatMessage, DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall, ToolCall
from nibble.server.response_store import ResponseStore
from nibble.server.responses_items import ItemError, input_to_messages, output_items, with_instructions
from nibble.server.responses_protocol import ResponseObject, ResponseUsage
from nibble.server.responses_stream import ResponseEventWriter

from .conftest import ServerHandle, metric_value, wait_idle

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                          "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                         "required": ["city", "days"]}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]


def prompt_len(tokenizer: Tokenizer, messages: list[dict], **kwargs) -> int:
    return len(tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)))


def respond(client: openai.OpenAI, server: ServerHandle, extra_body: dict | None = None, **kwargs):
    return client.responses.create(model=server.model, temperature=0.0,
                                   extra_body={"ignore_eos": True, **(extra_body or {})}, **kwargs)


def test_same_generation_as_chat(client: openai.OpenAI, server: ServerHandle, tokenizer: Tokenizer) -> None:
    """Instructions + input render the prompt of the chat messages [system, user]; reasoning and answer are
    what /v1/chat/completions returns for them."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    out = respond(client, server, instructions="Be brief.", input="Name a colour.", max_output_tokens=24)
    chat = client.chat.completions.create(model=server.model, messages=messages, max_tokens=24, temperature=0.0,
                                          extra_body={"ignore_eos": True})
    assert out.id.startswith("resp_") and out.object == "response" and out.model == server.model
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.input_tokens == chat.usage.prompt_tokens == prompt_len(tokenizer, messages)
    assert out.usage.output_tokens == 24 and out.usage.total_tokens == out.usage.input_tokens + 24
    reasoning = [o for o in out.output if o.type == "reasoning"]
    message = chat.choices[0].message
    assert reasoning and reasoning[0].content[0].text == message.model_extra["reasoning_content"]
    assert out.output_text == (message.content or "")
    assert 0 < out.usage.output_tokens_details.reasoning_tokens <= 24

    no_think = respond(client, server, input="Name a colour.", max_output_tokens=12, reasoning={"effort": "none"})
    chat = client.chat.completions.create(model=server.model, messages=messages[1:], max_tokens=12, temperature=0.0,
                                          extra_body={"ignore_eos": True, **NO_THINK})
    assert [o.type for o in no_think.output] == ["message"]
    assert no_think.output_text == chat.choices[0].message.content
    assert no_think.usage.output_tokens_details.reasoning_tokens == 0
    assert no_think.usage.input_tokens == prompt_len(tokenizer, messages[1:], enable_thinking=False)


def _events(stream) -> tuple[list, ResponseObject]:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events, events[-1].response


def _check_stream_adds_up(events: list, final) -> None:
    """Each item is opened, filled by its deltas, and closed with the text of those deltas."""
    for index, item in enumerate(final.output):
        added = [e for e in events if e.type == "response.output_item.added" and e.output_index == index]
        done = [e for e in events if e.type == "response.output_item.done" and e.output_index == index]
        assert len(added) == 1 and len(done) == 1 and done[0].item == item
        deltas = "".join(e.delta for e in events
                         if getattr(e, "item_id", None) == item.id and e.type.endswith(".delta"))
        if item.type in ("reasoning", "message"):
            assert deltas == item.content[0].text
        else:
            assert deltas == item.arguments
            assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"
                    and e.item_id == item.id] == [item.arguments]


def _strip_ids(items: list) -> list[dict]:
    return [{k: v for k, v in item.model_dump().items() if k not in ("id", "call_id")} for item in items]


@pytest.mark.parametrize("kwargs", [
    {"input": "Name a colour.", "max_output_tokens": 30},
    {"input": "Name a colour.", "max_output_tokens": 20, "reasoning": {"effort": "none"}},
    {"input": "Weather in Rome?", "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
     "max_output_tokens": 200, "reasoning": {"effort": "none"}},
])
def test_stream_matches_non_stream(client: openai.OpenAI, server: ServerHandle, kwargs: dict) -> None:
    out = respond(client, server, extra_body={"ignore_eos": False}, **kwargs)
    events, final = _events(respond(client, server, extra_body={"ignore_eos": False}, stream=True, **kwargs))
    _check_stream_adds_up(events, final)
    assert _strip_ids(final.output) == _strip_ids(out.output)
    assert final.status == out.status and final.usage == out.usage
    if "tools" in kwargs:
        (call,) = final.output
        assert call.type == "function_call" and call.name == "get_weather" and call.call_id
        assert set(json.loads(call.arguments)) == {"city", "days"} and final.status == "completed"


def test_function_call_round_trip(client: openai.OpenAI, server: ServerHandle, tokenizer: Tokenizer) -> None:
    """A function call answered through previous_response_id: the follow-up's prompt is the chat template's
    rendering of user turn, assistant tool call and tool result (tools are not carried over, as in OpenAI)."""
    first = respond(client, server, input="Weather in Rome?", tools=TOOLS, tool_choice="required",
                    parallel_tool_calls=False, max_output_tokens=200, reasoning={"effort": "none"},
                    extra_body={"ignore_eos": False})
    (call,) = first.output
    follow = respond(client, server, previous_response_id=first.id, tools=TOOLS, max_output_tokens=8,
                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
                     reasoning={"effort": "none"})
    assert follow.previous_response_id == first.id
    messages = [{"role": "user", "content": "Weather in Rome?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]
    assert follow.usage.input_tokens == prompt_len(tokenizer, messages, tools=CHAT_TOOLS, enable_thinking=False)
    # the same conversation sent whole, without the store, is the same prompt
    whole = respond(client, server, store=False, tools=TOOLS, max_output_tokens=8, reasoning={"effort": "none"},
                    input=[{"role": "user", "content": "Weather in Rome?"}, call.model_dump(),
                           {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert whole.usage.input_tokens == follow.usage.input_tokens and whole.output_text == follow.output_text
    items = client.responses.input_items.list(follow.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]


def test_logprobs_of_the_answer(client: openai.OpenAI, server: ServerHandle) -> None:
    kwargs = {"input": "Name a colour.", "max_output_tokens": 16, "reasoning": {"effort": "none"},
              "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    out = respond(client, server, **kwargs)
    (message,) = out.output
    part = message.content[0]
    assert "".join(lp.token for lp in part.logprobs) == part.text and len(part.logprobs) == 16
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)
    events, final = _events(respond(client, server, stream=True, **kwargs))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in part.logprobs]
    assert final.output[0].content[0].logprobs == part.logprobs
    # with thinking on, only the answer's tokens are listed, not the reasoning's
    thinking = respond(client, server, input="Name a colour.", max_output_tokens=40, top_logprobs=0)
    for item in thinking.output:
        if item.type == "message":
            assert "".join(lp.token for lp in item.content[0].logprobs).endswith(item.content[0].text)


def test_json_schema_text_format(client: openai.OpenAI, server: ServerHandle) -> None:
    schema = {"type": "object", "properties": {"sky": {"enum": ["clear", "rain"]},
                                               "temp": {"type": "integer", "minimum": -50, "maximum": 50}},
              "required": ["sky", "temp"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "w", "schema": schema, "strict": True}
    out = client.responses.create(model=server.model, input="Weather as JSON", max_output_tokens=60, temperature=0.8,
                                  reasoning={"effort": "none"}, text={"format": fmt}, extra_body={"seed": 3})
    assert out.status == "completed"
    value = json.loads(out.output_text)
    assert set(value) == {"sky", "temp"} and value["sky"] in ("clear", "rain")


def test_store_retrieve_delete(client: openai.OpenAI, server: ServerHandle, http: httpx.Client) -> None:
    out = respond(client, server, input="Hello", max_output_tokens=4, metadata={"k": "v"})
    got = client.responses.retrieve(out.id)
    assert got.model_dump() == out.model_dump() and got.metadata == {"k": "v"}
    client.responses.delete(out.id)
    r = http.get(f"/v1/responses/{out.id}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
    unstored = respond(client, server, input="Hello", max_output_tokens=4, store=False)
    assert http.get(f"/v1/responses/{unstored.id}").status_code == 404
    r = http.post("/v1/responses", json={"input": "Hi", "previous_response_id": unstored.id})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_store_is_bounded() -> None:
    store = ResponseStore(2)
    responses = [ResponseObject(model="m") for _ in range(3)]
    store.put(responses[0], [])
    store.put(responses[1], [])
    assert store.get(responses[0].id) is not None  # now the most recently used
    store.put(responses[2], [])
    assert len(store) == 2 and store.get(responses[1].id) is None and store.get(responses[0].id) is not None
    empty = ResponseStore(0)
    empty.put(responses[0], [])
    assert len(empty) == 0 and not empty.enabled


def test_items_of_a_turn_become_one_assistant_message() -> None:
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hmm."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Done."}]},
        {"role": "assistant", "content": "Sunny."},
    ]
    messages = with_instructions(input_to_messages(items), "Be kind.")
    assert messages == [
        {"role": "system", "content": "Be kind.\n\nRules."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "reasoning_content": "Hmm.", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "reasoning_content": "Done.", "content": "Sunny."},
    ]
    with pytest.raises(ItemError) as err:
        input_to_messages([{"role": "user", "content": "a"}, {"type": "web_search_call", "id": "x"}])
    assert err.value.param == "input[1].type"
    # the template takes one system message: the leading ones (agents send several) are joined, as are the
    # instructions before them; with neither there is none
    leading = input_to_messages([{"role": "developer", "content": "A."}, {"role": "system", "content": "B."},
                                 {"role": "user", "content": "Hi"}])
    assert with_instructions(leading, None)[0] == {"role": "system", "content": "A.\n\nB."}
    assert with_instructions(leading, "I.")[0] == {"role": "system", "content": "I.\n\nA.\n\nB."}
    assert with_instructions(leading[2:], None) == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    # the demo model has no vision tower (images: tests/vision/test_image_generation.py)
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "include": ["everything"]}, "include"),
    ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format"),
    ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "model": "other"}, "model"),
    ({"input": "hi", "reasoning": {"effort": "none"}, "chat_template_kwargs": {"enable_thinking": True}},
     "reasoning"),
    ({"input": 5}, "input"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": [{"role": "user", "content": [{"type": "refusal"}]}]}, "input[0].content[0].refusal"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                    "arguments": "{oops"}]}, "input[1].arguments"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                    "arguments": "[1]"}]}, "input[1].arguments"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "",
                                                    "arguments": "{}"}]}, "input[1].name"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "c",
                                                    "output": {"temp": 21}}]}, "input[1].output"),
])
def test_bad_requests_name_the_field(http: httpx.Client, body: dict, param: str) -> None:
    r = http.post("/v1/responses", json=body)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["message"]


def test_stream_disconnect_aborts(server: ServerHandle, http: httpx.Client) -> None:
    def aborted() -> float:
        return metric_value(http.get("/metrics").text, "nibble:request_success_total", finished_reason="abort")

    before = aborted()
    body = {"input": "Tell me a long story", "max_output_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as c, c.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events >= 5:
                break
    assert wait_idle(server.engine), server.engine.stats()
    assert aborted() == before + 1


def test_sdk_stream_helper_accumulates_the_same_response(client: openai.OpenAI, server: ServerHandle) -> None:
    """The openai SDK's `responses.stream` builds its snapshot from the events; it must end as the final
    response the server sent, and as a non-streaming response. (The helper wants response.completed: the output
    is constrained here so that the random model finishes.)"""
    schema = {"type": "object", "properties": {"sky": {"enum": ["clear", "rain"]}}, "required": ["sky"]}
    kwargs = {"input": "Sky as JSON", "max_output_tokens": 40, "temperature": 0.0, "reasoning": {"effort": "none"},
              "text": {"format": {"type": "json_schema", "name": "sky", "schema": schema}}}
    with client.responses.stream(model=server.model, **kwargs) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    out = client.responses.create(model=server.model, **kwargs)
    assert "".join(texts) == final.output_text == out.output_text and json.loads(out.output_text)["sky"]
    assert [(o.type, o.status) for o in final.output] == [(o.type, o.status) for o in out.output]
    assert out.status == "completed" and out.completed_at is not None


def _sse_events(http: httpx.Client, body: dict) -> list[dict]:
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("body", [
    {"input": [{"role": "developer", "content": "Rules."}, {"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Weather?"}],
     "max_output_tokens": 12, "text": {"verbosity": "low"}},
    {"input": "Weather in Rome?", "tools": TOOLS, "tool_choice": "required", "max_output_tokens": 200,
     "reasoning": {"effort": "none"}, "include": ["message.output_text.logprobs"], "top_logprobs": 2},
])
def test_sdk_types_validate_strictly(http: httpx.Client, body: dict) -> None:
    """The openai SDK builds its objects without validation; validated, its types are what OpenAI always
    sends: the response (usage's cache_write_tokens, text.format), every stream event, and input_items (text
    parts, not strings)."""
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    out = Response.model_validate(r.json())
    assert out.usage.input_tokens_details.cache_write_tokens == 0
    assert out.text.format.type == "text" and out.text.verbosity == (body.get("text") or {}).get("verbosity")
    items = ResponseItemList.model_validate(http.get(f"/v1/responses/{out.id}/input_items?order=asc").json())
    if isinstance(body["input"], list):
        assert [i.content[0].text for i in items.data] == [m["content"] for m in body["input"]]
    adapter = TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_python(e) for e in _sse_events(http, body)]
    assert events[-1].type in ("response.completed", "response.incomplete")


def test_the_item_the_limit_cuts_is_incomplete(client: openai.OpenAI, server: ServerHandle) -> None:
    """Cut in its reasoning, the response is one incomplete reasoning item, streamed or not (with no
    completed_at: it did not complete)."""
    kwargs = {"input": "Name a colour.", "max_output_tokens": 6}
    out = respond(client, server, **kwargs)
    assert out.status == "incomplete" and out.completed_at is None
    assert [(o.type, o.status) for o in out.output] == [("reasoning", "incomplete")]
    events, final = _events(respond(client, server, stream=True, **kwargs))
    assert [(o.type, o.status) for o in final.output] == [("reasoning", "incomplete")]
    assert [e.item.status for e in events if e.type == "response.output_item.done"] == ["incomplete"]


def test_a_cut_function_call_is_incomplete() -> None:
    """A function call the limit cut is streamed as an incomplete item, and the openai SDK's stream state
    accumulates it so; a finished one before it stays completed. Sent back, its partial arguments are dropped
    rather than failing the conversation. The non-streaming items mark their last."""
    def call(index: int, arguments: str, new: bool) -> DeltaMessage:
        return DeltaMessage(tool_calls=[DeltaToolCall(index=index, id=f"call_{index}" if new else None,
                                                      function=DeltaFunctionCall(name="f" if new else None,
                                                                                 arguments=arguments))])

    writer = ResponseEventWriter(ResponseObject(model="m"))
    events = writer.start()
    for delta in (call(0, "", True), call(0, '{"a": 1}', False), call(1, "", True), call(1, '{"a": ', False)):
        events += writer.feed(delta, None)
    done, _ = writer.finish("length", ResponseUsage(input_tokens=3, output_tokens=9, total_tokens=12), 0)
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in [*events, *done]:
        fired = state.handle_event(construct_type(type_=ResponseStreamEvent,
                                                  value=json.loads(event.split("data: ", 1)[1])))
    (incomplete,) = fired
    assert incomplete.type == "response.incomplete"
    assert [(o.arguments, o.status) for o in incomplete.response.output] == [('{"a": 1}', "completed"),
                                                                              ('{"a": ', "incomplete")]
    # continued (previous_response_id, or sent back), the cut call goes on without its partial arguments
    cut = incomplete.response.output[1].model_dump(exclude_none=True)
    messages = input_to_messages([{"role": "user", "content": "Go"}, cut])
    assert messages[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    with pytest.raises(ItemError) as err:
        input_to_messages([{"role": "user", "content": "Go"}, {**cut, "status": "completed"}])
    assert err.value.param == "input[1].arguments"
    message = ChatMessage(content="Calling.", tool_calls=[
        ToolCall(id="call_0", function=FunctionCall(name="f", arguments='{"a": 1}'))])
    assert [i.status for i in output_items(message, incomplete=True)] == ["completed", "incomplete"]
    assert [i.status for i in output_items(message)] == ["completed", "completed"]


def test_null_stream_and_store_mean_the_defaults(http: httpx.Client) -> None:
    """The openai SDK types stream and store as optional; null is the default (not streamed, stored)."""
    r = http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 4, "stream": None, "store": None})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    assert r.json()["store"] is True and http.get(f"/v1/responses/{r.json()['id']}").status_code == 200


def test_leading_system_messages_join_the_instructions(client: openai.OpenAI, server: ServerHandle,
                                                       tokenizer: Tokenizer) -> None:
    """Agents start their input with several developer / system messages; the template takes one: the
    prompt is the chat template's for the instructions and those messages joined, and so is the answer."""
    out = respond(client, server, instructions="Be brief.", max_output_tokens=12, input=[
        {"role": "developer", "content": "Rules."}, {"role": "system", "content": [{"type": "input_text",
                                                                                    "text": "More."}]},
        {"role": "user", "content": "Hi"}])
    messages = [{"role": "system", "content": "Be brief.\n\nRules.\n\nMore."}, {"role": "user", "content": "Hi"}]
    assert out.usage.input_tokens == prompt_len(tokenizer, messages)
    chat = client.chat.completions.create(model=server.model, messages=messages, max_tokens=12, temperature=0.0,
                                          extra_body={"ignore_eos": True})
    assert out.output[0].content[0].text == chat.choices[0].message.model_extra["reasoning_content"]
    # a developer message in the middle of a session joins the system message too
    later = respond(client, server, instructions="Be brief.", max_output_tokens=4, input=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
        {"role": "developer", "content": "Rules."}, {"role": "user", "content": "Again"}])
    moved = [{"role": "system", "content": "Be brief.\n\nRules."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again"}]
    assert later.usage.input_tokens == prompt_len(tokenizer, moved)


def test_stored_even_when_the_client_leaves_at_completed(http: httpx.Client, server: ServerHandle) -> None:
    """A client may hang up as soon as it reads response.completed; the response is stored by then, so a
    follow-up can continue it."""
    body = {"input": "Hi", "max_output_tokens": 4, "stream": True}
    rid = None
    with httpx.Client(base_url=server.url, timeout=30) as c, c.stream("POST", "/v1/responses", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["type"] == "response.incomplete":
                rid = json.loads(line[6:])["response"]["id"]
                break
    assert rid is not None and http.get(f"/v1/responses/{rid}").json()["status"] == "incomplete"


def test_failure_mid_stream_is_response_failed(http: httpx.Client, server: ServerHandle) -> None:
    """An engine failure after the stream started ends it with response.failed, its error code one of
    OpenAI's (server_error), and nothing stored."""
    runner = server.engine.engine.runner
    real_execute = runner.execute
    calls = {"n": 0}

    def execute(sched, inflight_tokens=None):  # type: ignore[no-untyped-def]
        logits, rows = real_execute(sched, inflight_tokens)
        calls["n"] += 1
        if logits is not None and calls["n"] == 3:
            logits = torch.full_like(logits, float("nan"))
        return logits, rows

    runner.execute = execute
    try:
        events = _sse_events(http, {"input": "Hi", "max_output_tokens": 20, "ignore_eos": True})
    finally:
        runner.execute = real_execute
    failed = Response.model_validate(events[-1]["response"])
    assert events[-1]["type"] == "response.failed" and failed.status == "failed"
    assert failed.error.code == "server_error" and "non-finite" in failed.error.message
    assert http.get(f"/v1/responses/{failed.id}").status_code == 404


def test_a_call_cut_by_a_stop_is_incomplete() -> None:
    """The generation ended inside a function call without reaching the token limit (a stop string, EOS): the
    streamed call is closed 'incomplete', so that sent back it is not taken for a call with valid arguments."""
    from nibble.server.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall
    from nibble.server.responses_protocol import ResponseUsage
    from nibble.server.responses_stream import ResponseEventWriter

    writer = ResponseEventWriter(ResponseObject(model="m"))
    writer.feed(DeltaMessage(tool_calls=[DeltaToolCall(index=0, id="call_1", type="function",
                                                       function=DeltaFunctionCall(name="f", arguments=""))]), None)
    writer.feed(DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='{"a": '))]),
                None)
    _, final = writer.finish("stop", ResponseUsage(input_tokens=1, output_tokens=9, total_tokens=10), 0,
                             unfinished_call=True)
    assert final.status == "completed" and [(i.type, i.status) for i in final.output] == [("function_call",
                                                                                          "incomplete")]
