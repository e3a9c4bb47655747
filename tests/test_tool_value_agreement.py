"""The forced-tool-call grammar (server/tool_grammar.py) and the tool parser (server/tool_parser.py) agree on
how each parameter value is written: for parameter schemas that are neither plainly string- nor plainly
otherwise-typed (anyOf / oneOf mixes, enum or const only, "properties" or "items" without a type, nullable
strings, no keys at all), a call the grammar accepts parses back to the arguments meant, and the other
spelling of the same value is refused by the grammar. Checked token by token with llguidance on the demo
tokenizer (no model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nibble.engine.structured_output import GrammarBackend, StructuredOutputsParams
from nibble.engine.tokenizer import Tokenizer
from nibble.server.tool_grammar import tool_call_grammar
from nibble.server.tool_parser import TOOL_CALL_END, TOOL_CALL_START, extract_tool_calls, is_text_param

DEMO_TOKENIZER = Path(__file__).resolve().parent.parent / "nibble" / "assets" / "demo_tokenizer"


@pytest.fixture(scope="module")
def grammar_env() -> tuple[Tokenizer, GrammarBackend, dict[str, int]]:
    tok = Tokenizer.from_pretrained(DEMO_TOKENIZER)
    tags = {t: i for t in (TOOL_CALL_START, TOOL_CALL_END) if (i := tok.token_to_id(t)) is not None}
    return tok, GrammarBackend(tok.backend, tok.vocab_size, tok.eos_token_ids), tags


def _tools(schema: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": schema}, "required": ["x"]}}}]


def _call(value_text: str) -> str:
    """A forced call of f with parameter x written as `value_text`, laid out as the template renders it."""
    return f"<tool_call>\n<function=f>\n<parameter=x>\n{value_text}\n</parameter>\n</function>\n</tool_call>"


def _accepted(env: tuple[Tokenizer, GrammarBackend, dict[str, int]], schema: Any, text: str) -> bool:
    tok, backend, tags = env
    grammar = tool_call_grammar(_tools(schema), "f", parallel=False, tag_ids=tags)
    state = backend.compile(StructuredOutputsParams(grammar=grammar))
    return all(state.accept(t) in (None, "stopped") for t in tok.encode(text)) and state.matcher.is_accepting()


def _arguments(schema: Any, text: str) -> Any:
    content, calls = extract_tool_calls(text, _tools(schema))
    assert content is None and [c["function"]["name"] for c in calls] == ["f"], (content, calls)
    return json.loads(calls[0]["function"]["arguments"])


# (id, schema, [(what the model writes, the value meant)], [spellings the grammar must refuse])
CASES = [
    ("anyOf-string-first", {"anyOf": [{"type": "string"}, {"type": "number"}]},
     [("Paris", "Paris"), ("3", "3"), ('"quoted"', '"quoted"')], []),
    ("anyOf-number-first", {"anyOf": [{"type": "number"}, {"type": "string"}]},
     [("3.5", 3.5), ('"Paris"', "Paris"), ('"3"', "3")], ["Paris"]),
    ("oneOf-integer-null", {"oneOf": [{"type": "integer"}, {"type": "null"}]},
     [("7", 7), ("null", None)], ["seven", '"7"']),
    ("oneOf-object-array", {"oneOf": [{"type": "object"}, {"type": "array"}]},
     [('{"a": [1, 2]}', {"a": [1, 2]}), ("[true]", [True])], ["a: 1"]),
    ("enum-strings", {"enum": ["celsius", "fahrenheit"]}, [("celsius", "celsius")], ['"celsius"', "kelvin"]),
    ("enum-integers", {"enum": [1, 2, 3]}, [("2", 2)], ['"2"', "4"]),
    ("enum-mixed", {"enum": ["auto", 1, None]}, [('"auto"', "auto"), ("1", 1), ("null", None)], ["auto"]),
    ("enum-nullable-string", {"type": ["string", "null"], "enum": ["a", None]}, [("a", "a"), ("null", None)],
     ['"a"', "b"]),
    ("const-integer", {"const": 5}, [("5", 5)], ["6"]),
    ("properties-no-type", {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
     [('{"a": 4}', {"a": 4})], ["4", '{"a": "x"}']),
    ("items-no-type", {"items": {"type": "integer"}}, [("[1, 2]", [1, 2])], ["1, 2", '["1"]']),
    ("type-string-null", {"type": ["string", "null"]}, [("Rome", "Rome"), ("null", None), ("a\nb", "a\nb")], []),
    ("type-null-string", {"type": ["null", "string"]}, [("Rome", "Rome"), ("null", None)], []),
    ("type-string-integer", {"type": ["string", "integer"]}, [("12", "12"), ("twelve", "twelve")], []),
    ("no-keys", {}, [('{"a": 1}', '{"a": 1}'), ("two\nlines", "two\nlines"), ("null", "null")],
     ["a </parameter> b"]),
    ("unknown-type-name", {"type": "str"}, [("free text", "free text")], []),
]


@pytest.mark.parametrize(("schema", "written", "refused"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_forced_value_parses_as_meant(grammar_env, schema: Any, written: list[tuple[str, Any]],
                                      refused: list[str]) -> None:
    for text, meant in written:
        call = _call(text)
        assert _accepted(grammar_env, schema, call), text
        assert _arguments(schema, call) == {"x": meant}, text
    for text in refused:
        assert not _accepted(grammar_env, schema, _call(text)), text


def test_plain_types_keep_their_spelling(grammar_env) -> None:
    """Plainly typed values as before: a string is raw text, the other types JSON (a raw string is refused
    where JSON is expected, JSON quotes are kept in a string)."""
    plain = [({"type": "string"}, '"hi"', '"hi"', None), ({"type": "integer"}, "-3", -3, "three"),
             ({"type": "number"}, "2.5", 2.5, "2,5"), ({"type": "boolean"}, "false", False, "no"),
             ({"type": "object"}, '{"k": null}', {"k": None}, "[]"), ({"type": "array"}, '["a"]', ["a"], "a")]
    for schema, text, meant, bad in plain:
        assert _accepted(grammar_env, schema, _call(text)) and _arguments(schema, _call(text)) == {"x": meant}
        if bad is not None:
            assert not _accepted(grammar_env, schema, _call(bad)), schema


def test_grammar_rule_follows_is_text_param() -> None:
    """Each case's parameter is generated as free text or a string choice exactly when the parser reads it as
    text, and as JSON otherwise."""
    for name, schema, _, _ in CASES:
        grammar = tool_call_grammar(_tools(schema), "f", parallel=False)
        rule = next(line for line in grammar.splitlines() if line.startswith("p0_0:"))
        assert ("%json" not in rule) == is_text_param(schema), name


def test_every_parameter_of_one_call(grammar_env) -> None:
    """Several awkward parameters in one forced call (in schema order, one optional left out) parse to the
    whole arguments object meant."""
    props = {"where": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "n": {"enum": [1, 2]},
             "opts": {"properties": {"deep": {"type": "boolean"}}}, "note": {}, "unit": {"const": "c"}}
    tools = [{"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": props, "required": ["where", "n", "opts", "unit"]}}}]
    text = ("<tool_call>\n<function=g>\n<parameter=where>\nNew York\n</parameter>\n<parameter=n>\n2\n</parameter>\n"
            '<parameter=opts>\n{"deep": true}\n</parameter>\n<parameter=unit>\nc\n</parameter>\n</function>\n'
            "</tool_call>")
    tok, backend, tags = grammar_env
    state = backend.compile(StructuredOutputsParams(grammar=tool_call_grammar(tools, "g", False, tags)))
    assert all(state.accept(t) in (None, "stopped") for t in tok.encode(text)) and state.matcher.is_accepting()
    _, calls = extract_tool_calls(text, tools)
    assert json.loads(calls[0]["function"]["arguments"]) == {"where": "New York", "n": 2, "opts": {"deep": True},
                                                             "unit": "c"}
