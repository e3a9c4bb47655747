"""Reasoning split and Qwen3-Coder tool-call parsing.

The reference outputs are produced by the real Qwen3.5 chat template (through transformers): an assistant
turn rendered after its generation prompt is exactly what the model is trained to generate, so parsing it
must give back the reasoning, content and tool calls that went in. Streaming parsers must agree with the
non-streaming ones for every way of splitting the text into deltas.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest

from nibble.server.reasoning import ReasoningStreamParser, extract
from nibble.server.tool_parser import ToolCallStreamParser, convert_param_value, extract_tool_calls

ASSETS = Path(__file__).resolve().parent.parent / "nibble" / "assets"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "ratio": {"type": "number"},
                    "whole": {"type": "number"},
                    "flag": {"type": "boolean"},
                    "off": {"type": "boolean"},
                    "opts": {"type": "object"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "code": {"type": "string"},
                    "note": {"type": "string"},
                    "nothing": {"type": ["integer", "null"]},
                    "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]

WEATHER_ARGS = {
    "city": "São Paulo",
    "days": 3,
    "ratio": 0.25,
    "whole": 2.0,
    "flag": True,
    "off": False,
    "opts": {"a": [1, {"b": None}], "c": "<x>"},
    "tags": ["x", "y z"],
    "code": "007",
    "note": "line one\n  line two\n",
    "nothing": None,
    "either": "not a number",
}

TURNS: dict[str, dict[str, Any]] = {
    "plain": {"content": "The answer is 4."},
    "reasoning": {"reasoning_content": "Add two and two.\nThat is four.", "content": "The answer is 4."},
    "one_call": {
        "reasoning_content": "Need the weather.",
        "content": "Let me check.",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": WEATHER_ARGS}}],
    },
    "two_calls_no_content": {
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}},
            {"type": "function", "function": {"name": "ping", "arguments": {}}},
        ],
    },
    "unknown_param_is_string": {
        "content": "Calling.",
        "tool_calls": [{"type": "function", "function": {"name": "ping", "arguments": {"extra": "5"}}}],
    },
}


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(ASSETS / "demo_tokenizer" / "tokenizer.json"),
        chat_template=(ASSETS / "qwen3_5_chat_template.jinja").read_text(encoding="utf-8"),
    )


def _model_output(hf_tokenizer, turn: dict[str, Any], thinking: bool) -> str:
    """What the model generates for `turn`: the rendered turn minus the generation prompt and <|im_end|>."""
    user = [{"role": "user", "content": "What's the weather?"}]
    if not thinking:
        # With thinking off the model writes no reasoning; the template then renders an empty think block.
        turn = {k: v for k, v in turn.items() if k != "reasoning_content"}
    kwargs = {"tools": TOOLS, "tokenize": False, "enable_thinking": thinking}
    prompt = hf_tokenizer.apply_chat_template(user, add_generation_prompt=True, **kwargs)
    full = hf_tokenizer.apply_chat_template([*user, {"role": "assistant", **turn}], **kwargs)
    assert full.startswith(prompt) and full.endswith("<|im_end|>\n")
    return full[len(prompt) : -len("<|im_end|>\n")]


def _splits(text: str, rng: random.Random) -> list[list[str]]:
    """All two-piece splits, one-character pieces, and a few random multi-piece splits."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    out.append(list(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(1, 8))))
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in itertools.pairwise(bounds)])
    return out


def _stream_reasoning(pieces: list[str], thinking: bool) -> tuple[str | None, str | None]:
    parser = ReasoningStreamParser(thinking)
    reasoning, content = [], []
    for r, c in [*(parser.feed(p) for p in pieces), parser.finish()]:
        assert r is None or r  # deltas are None rather than empty
        assert c is None or c
        reasoning.append(r or "")
        content.append(c or "")
    return "".join(reasoning) or None, "".join(content) or None


def _stream_tools(pieces: list[str], tools=TOOLS) -> tuple[str | None, list[dict[str, Any]], ToolCallStreamParser]:
    parser = ToolCallStreamParser(tools)
    content, calls = [], {}
    for text, deltas in [*(parser.feed(p) for p in pieces), parser.finish()]:
        content.append(text or "")
        for d in deltas:
            if d["index"] not in calls:
                # First delta of a call: id, type and name, with empty arguments.
                assert d["index"] == len(calls) and d["id"].startswith("call_") and d["type"] == "function"
                assert d["function"]["arguments"] == "" and d["function"]["name"]
                calls[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return "".join(content) or None, [calls[i] for i in sorted(calls)], parser


def _plain_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]


@pytest.mark.parametrize("name", sorted(TURNS))
@pytest.mark.parametrize("thinking", [True, False])
def test_template_round_trip(hf_tokenizer, name: str, thinking: bool) -> None:
    turn = TURNS[name]
    output = _model_output(hf_tokenizer, turn, thinking)
    reasoning, content = extract(output, thinking)
    want_reasoning = turn.get("reasoning_content", "").strip() if thinking else ""
    assert reasoning == (want_reasoning or None)
    text, calls = extract_tool_calls(content or "", TOOLS)
    assert text == (turn["content"] or None)
    want_calls = [c["function"] for c in turn.get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == [c["name"] for c in want_calls]
    for got, want in zip(calls, want_calls):
        assert got["type"] == "function" and got["id"].startswith("call_")
        args = json.loads(got["function"]["arguments"])
        assert args == want["arguments"]
        assert [type(v) for v in args.values()] == [type(v) for v in want["arguments"].values()]


@pytest.mark.parametrize("name", sorted(TURNS))
def test_streaming_pipeline_matches_non_streaming(hf_tokenizer, name: str) -> None:
    """Reasoning parser feeding the tool parser, for every split of the real model output."""
    output = _model_output(hf_tokenizer, TURNS[name], True)
    reasoning, content = extract(output, True)
    want_text, want_calls = extract_tool_calls(content or "", TOOLS)
    for pieces in _splits(output, random.Random(0)):
        rparser = ReasoningStreamParser(True)
        got_reasoning, content_deltas = [], []
        for r, c in [*(rparser.feed(p) for p in pieces), rparser.finish()]:
            got_reasoning.append(r or "")
            content_deltas.append(c or "")
        got_text, got_calls, _ = _stream_tools(content_deltas)
        assert ("".join(got_reasoning) or None) == reasoning
        assert got_text == want_text
        assert got_calls == _plain_calls(want_calls)


REASONING_CASES = [
    "abc\n</think>\n\nanswer",
    "<think>\nabc</think>answer",
    "  <think>x</think>",
    "no end tag, all reasoning  \n",
    "",
    "\n\n",
    "</think>only content",
    "<thi",
    "<thinking about it",
    "reason </thinkX more</think>\n\nok",
    "r\n\n</think>\n\n\n  spaced content\n",
    "a</think>b</think>c",
    "<think><think>x</think></think>",
    "multi\nline\n\nreasoning \n \n</thi",
]


@pytest.mark.parametrize("text", REASONING_CASES)
@pytest.mark.parametrize("thinking", [True, False])
def test_reasoning_streaming_equals_extract(text: str, thinking: bool) -> None:
    want = extract(text, thinking)
    for pieces in _splits(text, random.Random(1)):
        assert _stream_reasoning(pieces, thinking) == want, pieces


def test_reasoning_semantics() -> None:
    assert extract("I think.\n</think>\n\nHello", True) == ("I think.", "Hello")
    assert extract("<think>\nI think.</think>Hello", True) == ("I think.", "Hello")
    assert extract("cut off by the length limit", True) == ("cut off by the length limit", None)
    assert extract("<think>x</think>y", False) == (None, "<think>x</think>y")
    assert extract("", False) == (None, None)
    parser = ReasoningStreamParser(True)
    assert parser.in_reasoning
    parser.feed("abc</think>")
    assert not parser.in_reasoning


TOOL_CASES = [
    "Just text, no calls.",
    "Text mentioning <tool_call> without a function.",
    "<tool_call>\nnot a function\n</tool_call> trailing",
    "<tool_call><tool_call>\n<function=ping>\n</function>\n</tool_call>",
    "Before.\n\n<tool_call>\n<function=ping>\n</function>\n</tool_call>\n\nAfter the call.",
    "<tool_call>\n<function= get_weather >\n<parameter=days>\n5\n<parameter=city>\nRome\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n</function>",
    "<tool_call>\n<function=get_weather>\njunk between\n<parameter=days>\nseven\n</parameter>\n"
    "</function>\n</tool_call>",
    "<tool_call>\n<function=bad\nname>\n</function>\n</tool_call>",
    "x <tool_call>\n<function=ping>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=ping>\n</function>\n</tool_call>",
]


@pytest.mark.parametrize("text", TOOL_CASES)
def test_tool_streaming_equals_extract(text: str) -> None:
    want_text, want_calls = extract_tool_calls(text, TOOLS)
    for pieces in _splits(text, random.Random(2)):
        got_text, got_calls, parser = _stream_tools(pieces)
        assert parser.incomplete_call_text is None
        assert (got_text, got_calls) == (want_text, _plain_calls(want_calls)), pieces


def test_tool_call_details() -> None:
    text, calls = extract_tool_calls(TOOL_CASES[5], TOOLS)
    # Leniency: a missing </parameter> ends the value at the next tag; the name is trimmed.
    assert text is None
    assert _plain_calls(calls) == [{"name": "get_weather", "arguments": '{"days": 5, "city": "Rome"}'}]
    text, calls = extract_tool_calls(TOOL_CASES[6], TOOLS)
    assert text is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Lyon"}
    text, calls = extract_tool_calls(TOOL_CASES[7], TOOLS)
    assert json.loads(calls[0]["function"]["arguments"]) == {"days": "seven"}  # unparsable -> string
    assert extract_tool_calls(TOOL_CASES[4], TOOLS)[0] == "Before.\n\nAfter the call."
    assert len({c["id"] for c in extract_tool_calls(TOOL_CASES[9], TOOLS)[1]}) == 2


@pytest.mark.parametrize("text", [*TOOL_CASES[1:3], TOOL_CASES[8]])
def test_malformed_calls_stay_content(text: str) -> None:
    assert extract_tool_calls(text, TOOLS) == (text, [])


@pytest.mark.parametrize(
    "text",
    [
        "Sure.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        "Sure.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",
        "Hi <tool_call>\n<func",
        "Hi <tool_call",
        "<tool_call>\n<function=ping>\n</function>\n</tool_call>\n<tool_call>\n<function=ping>",
    ],
)
def test_incomplete_call_at_end_is_kept_as_content(text: str) -> None:
    content, calls = extract_tool_calls(text, TOOLS)
    complete = text.count("</tool_call>")
    assert len(calls) == complete
    if not complete:
        assert content == text  # nothing lost
    # Streaming cannot take back a call header it already sent; it reports the unfinished text instead.
    for pieces in _splits(text, random.Random(3)):
        got_text, _, parser = _stream_tools(pieces)
        tail = parser.incomplete_call_text or ""
        assert (got_text or "") + tail == (content or "")


def test_closing_tags_inside_json_strings_stay_in_the_value() -> None:
    """An object or array value whose strings hold the call format's own tags (code, markup): a tag inside a
    string literal does not end the value, in one piece and streamed; text values keep ending at the first tag
    (raw text has no quoting to tell the two apart)."""
    opts = {"html": "<b>x</b></parameter>\n</function>", "q": 'say \"</tool_call>\"', "n": 1}
    tags = ["</parameter>", "<parameter=city>", "plain"]
    text = ("<tool_call>\n<function=get_weather>\n<parameter=opts>\n" + json.dumps(opts) + "\n</parameter>\n"
            "<parameter=tags>\n" + json.dumps(tags) + "\n</parameter>\n<parameter=city>\nLyon\n</parameter>\n"
            "</function>\n</tool_call>")
    want = [{"name": "get_weather", "arguments": json.dumps({"opts": opts, "tags": tags, "city": "Lyon"},
                                                             ensure_ascii=False)}]
    content, calls = extract_tool_calls(text, TOOLS)
    assert content is None and _plain_calls(calls) == want
    for pieces in _splits(text, random.Random(6)):
        got_text, got_calls, parser = _stream_tools(pieces)
        assert (got_text, got_calls, parser.incomplete_call_text) == (None, want, None), pieces
    # an unbalanced quote with no later tag outside a string: at the end the first tag ends the value
    broken = ('<tool_call>\n<function=get_weather>\n<parameter=opts>\n{"a": "x</parameter>\n'
              "<parameter=city>\nLyon\n</parameter>\n</function>\n</tool_call>")
    content, calls = extract_tool_calls(broken, TOOLS)
    assert content is None
    assert json.loads(calls[0]["function"]["arguments"]) == {"opts": '{"a": "x', "city": "Lyon"}
    for pieces in _splits(broken, random.Random(7)):
        assert _stream_tools(pieces)[:2] == (None, _plain_calls(calls)), pieces
    # text values: the first closing tag ends them
    _, calls = extract_tool_calls("<tool_call>\n<function=get_weather>\n<parameter=note>\na \"</parameter>"
                                  "\n</function>\n</tool_call>", TOOLS)
    assert json.loads(calls[0]["function"]["arguments"]) == {"note": 'a "'}


def test_convert_param_value() -> None:
    assert convert_param_value("42", {"type": "integer"}) == 42
    assert convert_param_value("4.0", {"type": "integer"}) == 4
    assert convert_param_value("4.5", {"type": "integer"}) == "4.5"
    assert convert_param_value(" 1e3 ", {"type": "number"}) == 1000.0
    assert convert_param_value("NaN", {"type": "number"}) == "NaN"
    assert convert_param_value("True", {"type": "boolean"}) is True
    assert convert_param_value("yes", {"type": "boolean"}) == "yes"
    assert convert_param_value("None", {"type": "null"}) is None
    assert convert_param_value('{"a": 1}', {"properties": {}}) == {"a": 1}
    assert convert_param_value("[1, 2]", {"type": "object"}) == "[1, 2]"
    assert convert_param_value("[1, 2]", {"type": "array"}) == [1, 2]
    assert convert_param_value("12", {"type": ["string", "integer"]}) == "12"
    assert convert_param_value("12", {"oneOf": [{"type": "integer"}, {"type": "string"}]}) == 12
    assert convert_param_value(" raw ", None) == " raw "


def test_tool_parser_fuzz_streaming_consistency() -> None:
    rng = random.Random(4)
    fragments = [
        "<tool_call>", "</tool_call>", "<function=ping>", "<function=get_weather>", "</function>",
        "<parameter=days>", "<parameter=city>", "</parameter>", "\n", "\n\n", " ", "text", "12", "<", "<tool", "你好",
    ]  # fmt: skip
    for _ in range(300):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(1, 14)))
        want_text, want_calls = extract_tool_calls(text, TOOLS)
        for _ in range(3):
            pieces = _splits(text, rng)[-1]
            got_text, got_calls, parser = _stream_tools(pieces)
            if parser.incomplete_call_text is None:
                assert (got_text, got_calls) == (want_text, _plain_calls(want_calls)), (text, pieces)
            else:
                assert (got_text or "") + parser.incomplete_call_text == (want_text or "")
                assert got_calls[:-1] == _plain_calls(want_calls)
