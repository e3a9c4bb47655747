"""Structured outputs over HTTP with the official openai client: response_format (json_object, json_schema),
vLLM's structured_outputs and guided_* fields, on both endpoints, streamed and not, with n choices, and
after the reasoning of a thinking chat prompt. (Bad constraints: test_errors.py.)"""

from __future__ import annotations

import json
import re

import openai
import pytest

from nibble.engine.tokenizer import Tokenizer
from nibble.server.protocol import ChatCompletionRequest, CompletionRequest, ConflictingConstraints

from .conftest import ServerHandle

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "temp": {"type": "integer"},
                   "sky": {"enum": ["clear", "cloudy", "rain"]}},
    "required": ["city", "temp", "sky"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Weather in Paris as JSON"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def _check(value: dict) -> None:
    assert set(value) == {"city", "temp", "sky"} and value["sky"] in ("clear", "cloudy", "rain")
    assert isinstance(value["city"], str) and len(value["city"]) <= 12 and isinstance(value["temp"], int)


def test_chat_json_schema(client: openai.OpenAI, server: ServerHandle) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    out = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=100, temperature=0.9,
                                         seed=5, n=3, response_format=fmt, extra_body=NO_THINK)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        _check(json.loads(choice.message.content))
    chunks = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=100,
                                            temperature=0.9, seed=5, n=3, response_format=fmt, extra_body=NO_THINK,
                                            stream=True)
    texts: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert [texts[i] for i in range(3)] == [c.message.content for c in out.choices]


def test_chat_json_object(client: openai.OpenAI, server: ServerHandle) -> None:
    out = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=60, temperature=0.0,
                                         response_format={"type": "json_object"}, extra_body=NO_THINK)
    content = out.choices[0].message.content
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:
        assert content.startswith("{")


def test_chat_constraint_starts_after_the_reasoning(client: openai.OpenAI, server: ServerHandle,
                                                    tokenizer: Tokenizer) -> None:
    """Thinking on: the constraint waits for `</think>` (forced here by logit_bias, which the mask then
    overrides), and the answer after it follows the regex."""
    think_end = tokenizer.token_to_id("</think>")
    out = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=30, temperature=0.0,
                                         logit_bias={str(think_end): 100},
                                         extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    message = out.choices[0].message
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", message.content), message
    assert out.choices[0].finish_reason == "stop"


def test_completions_guided_fields(client: openai.OpenAI, server: ServerHandle) -> None:
    def complete(extra: dict, **kw):
        return client.completions.create(model=server.model, prompt="Answer:", extra_body=extra,
                                         **{"max_tokens": 80, **kw})

    out = complete({"guided_choice": ["red", "green", "light blue"]}, temperature=1.0, seed=1, n=4)
    assert all(c.text in ("red", "green", "light blue") and c.finish_reason == "stop" for c in out.choices)
    out = complete({"guided_regex": r"[A-Z][a-z]{1,6}( [0-9]{2})?"}, temperature=0.0)
    assert re.fullmatch(r"[A-Z][a-z]{1,6}( [0-9]{2})?", out.choices[0].text)
    out = complete({"structured_outputs": {"json": SCHEMA}}, temperature=0.7, seed=2)
    _check(json.loads(out.choices[0].text))
    out = complete({"guided_json": json.dumps(SCHEMA)}, temperature=0.0)
    _check(json.loads(out.choices[0].text))
    out = complete({"structured_outputs": {"grammar": 'root ::= "a" "b"+', "disable_any_whitespace": True}},
                   temperature=0.0, max_tokens=8)
    assert re.fullmatch("ab+", out.choices[0].text)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=server.model, prompt="Answer:", max_tokens=80, temperature=0.7, seed=2, stream=True,
        extra_body={"structured_outputs": {"json": SCHEMA}}))
    assert streamed == complete({"structured_outputs": {"json": SCHEMA}}, temperature=0.7, seed=2).choices[0].text


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                        "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                                        "units": {"enum": ["c", "f"]}},
                       "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}},
]


def _calls(out, finish: tuple[str, ...] = ("tool_calls",)) -> list:
    choice = out.choices[0]
    assert choice.finish_reason in finish, choice
    calls = choice.message.tool_calls
    assert calls
    for call in calls:
        args = json.loads(call.function.arguments)
        fn = next(t["function"] for t in TOOLS if t["function"]["name"] == call.function.name)
        assert set(fn["parameters"]["required"]) <= set(args) <= set(fn["parameters"]["properties"])
        if "days" in args:
            assert isinstance(args["days"], int)
    return calls


def test_tool_choice_required_forces_calls(client: openai.OpenAI, server: ServerHandle) -> None:
    for seed in range(3):
        out = client.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS,
                                             tool_choice="required", parallel_tool_calls=False, max_tokens=300,
                                             temperature=1.0, seed=seed, extra_body=NO_THINK)
        assert len(_calls(out)) == 1
    # parallel calls: a random model may go on calling until max_tokens; every complete call is valid
    out = client.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         max_tokens=300, temperature=0.0, extra_body=NO_THINK)
    _calls(out, ("tool_calls", "length"))


def test_named_tool_choice(client: openai.OpenAI, server: ServerHandle, tokenizer: Tokenizer) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                         max_tokens=200, temperature=0.7, seed=1, extra_body=NO_THINK)
    calls = _calls(out)
    assert [c.function.name for c in calls] == ["get_time"]
    # thinking on: free reasoning first (here cut short by logit_bias on </think>), then the forced call
    think_end = tokenizer.token_to_id("</think>")
    out = client.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                         max_tokens=200, temperature=0.0, logit_bias={str(think_end): 100})
    assert [c.function.name for c in _calls(out)] == ["get_time"]
    streamed = client.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                              max_tokens=200, temperature=0.7, seed=1, extra_body=NO_THINK,
                                              stream=True)
    names, finish = [], None
    for chunk in streamed:
        for c in chunk.choices:
            names += [t.function.name for t in c.delta.tool_calls or [] if t.function and t.function.name]
            finish = c.finish_reason or finish
    assert names == ["get_time"] and finish == "tool_calls"


def test_conflicting_constraints_name_the_fields_given() -> None:
    """Several constraint fields: the error names those given, in the order the request model reads them, and no
    other (a response_format of type "text" sets none)."""
    cases = [({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, ("response_format", "guided_regex")),
             ({"structured_outputs": {"regex": "a+"}, "guided_json": SCHEMA}, ("structured_outputs", "guided_json")),
             ({"response_format": {"type": "text"}, "guided_choice": ["a"], "guided_grammar": 'start: "a"'},
              ("guided_choice", "guided_grammar"))]
    for fields, given in cases:
        for request in (CompletionRequest(prompt="x", **fields), ChatCompletionRequest(messages=MESSAGES, **fields)):
            with pytest.raises(ConflictingConstraints) as info:
                request.structured_spec()
            assert info.value.fields == given
            named = str(info.value).split("; got ", 1)[1]
            assert named == ", ".join(given)
