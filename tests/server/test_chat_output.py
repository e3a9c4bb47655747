"""Reasoning and tool-call assembly of chat responses, fed the way the engine produces text: token by
token through the incremental detokenizer (the demo model is random, so it cannot be asked for a real
tool call)."""

from __future__ import annotations

import json

import pytest

from nibble.engine.detokenizer import IncrementalDetokenizer
from nibble.engine.request import CompletionOutput, RequestOutput
from nibble.engine.tokenizer import Tokenizer
from nibble.server.chat_output import ChatDeltaBuilder, build_chat_message, chat_finish_reason
from nibble.server.errors import APIError
from nibble.server.serving_base import check_generation_error

from .conftest import DEMO_TOKENIZER

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]

CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_pretrained(DEMO_TOKENIZER)


def engine_deltas(tok: Tokenizer, text: str) -> list[str]:
    """The text deltas the engine would report for a model that generated `text`."""
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    deltas = [detok.step([token]) for token in tok.encode(text)]
    deltas.append(detok.flush())
    return deltas


def stream(tok: Tokenizer, text: str, thinking: bool, parse_tools: bool) -> dict:
    builder = ChatDeltaBuilder(thinking, TOOLS, parse_tools)
    deltas = engine_deltas(tok, text)
    out = {"reasoning": "", "content": "", "calls": {}}
    for i, piece in enumerate(deltas):
        delta = builder.feed(piece, final=i == len(deltas) - 1)
        if delta is None:
            continue
        out["reasoning"] += delta.reasoning_content or ""
        out["content"] += delta.content or ""
        for call in delta.tool_calls or []:
            entry = out["calls"].setdefault(call.index, {"id": call.id, "name": None, "arguments": ""})
            if call.function and call.function.name:
                entry["name"] = call.function.name
            if call.function and call.function.arguments:
                entry["arguments"] += call.function.arguments
    out["has_calls"] = builder.has_tool_calls
    return out


CASES = [
    # (generated text, thinking, reasoning, content, number of calls)
    ("I should look it up.\n</think>\n\nLet me check." + "\n\n" + CALL, True, "I should look it up.",
     "Let me check.", 1),
    ("Thinking only, cut off", True, "Thinking only, cut off", None, 0),
    ("Plain answer with no tools.", False, None, "Plain answer with no tools.", 0),
    (CALL + "\n" + CALL, False, None, None, 2),
    ("Hmm.</think>\n\n" + CALL.replace("</tool_call>", ""), True, "Hmm.", None, 1),
]


@pytest.mark.parametrize(("text", "thinking", "reasoning", "content", "num_calls"), CASES)
def test_message_and_stream_agree(tok: Tokenizer, text: str, thinking: bool, reasoning: str | None,
                                  content: str | None, num_calls: int) -> None:
    message = build_chat_message(text, thinking, TOOLS, parse_tools=True)
    assert message.reasoning_content == reasoning
    assert len(message.tool_calls) == num_calls
    if num_calls and "</tool_call>" in text:
        assert message.content == content
        for call in message.tool_calls:
            assert call.function.name == "get_weather"
            assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
            assert call.id.startswith("call_")
    streamed = stream(tok, text, thinking, parse_tools=True)
    assert streamed["reasoning"] == (message.reasoning_content or "")
    if text.count("<tool_call>") == text.count("</tool_call>"):
        assert streamed["content"] == (message.content or "")
        args = [c["arguments"] for _, c in sorted(streamed["calls"].items())]
        assert args == [c.function.arguments for c in message.tool_calls]
    assert streamed["has_calls"] == (len(streamed["calls"]) > 0)


def test_tools_not_parsed_when_not_offered(tok: Tokenizer) -> None:
    message = build_chat_message(CALL, False, None, parse_tools=False)
    assert message.content == CALL and message.tool_calls == []
    assert stream(tok, CALL, False, parse_tools=False)["content"] == CALL


def test_include_reasoning_false_drops_reasoning(tok: Tokenizer) -> None:
    text = "secret thoughts</think>\n\nanswer"
    assert build_chat_message(text, True, None, False, include_reasoning=False).reasoning_content is None
    builder = ChatDeltaBuilder(True, None, False, include_reasoning=False)
    deltas = [builder.feed(p, final=i == 1) for i, p in enumerate([text, ""])]
    assert "".join(d.content or "" for d in deltas if d) == "answer"
    assert all(d.reasoning_content is None for d in deltas if d)


def test_finish_reason() -> None:
    assert chat_finish_reason("stop", True) == "tool_calls"
    assert chat_finish_reason("length", True) == "length"
    assert chat_finish_reason("stop", False) == "stop"


def test_engine_error_finish_becomes_500() -> None:
    out = RequestOutput("r", [1], [CompletionOutput(0, "", [], None, finish_reason="error")], True,
                        error="the model produced non-finite logits")
    with pytest.raises(APIError) as info:
        check_generation_error(out)
    assert info.value.status == 500 and "non-finite" in info.value.message


def test_a_call_left_unfinished_is_no_tool_call() -> None:
    """Generation stopped (a stop string, EOS) inside a tool call: the streamed deltas already named the call, but
    like build_chat_message (which returns it as content) the builder does not count it as a call, so the finish
    reason is not 'tool_calls'."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}}}}}]
    text = "Sure.\n<tool_call>\n<function=f>\n<parameter=a>\n4"
    builder = ChatDeltaBuilder(False, tools, True)
    builder.feed(text)
    builder.feed("", final=True)
    assert builder.has_unfinished_call and not builder.has_tool_calls
    message = build_chat_message(text, False, tools, True)
    assert not message.tool_calls and chat_finish_reason("stop", builder.has_tool_calls) == "stop"
