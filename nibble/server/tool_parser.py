"""Qwen3-Coder XML tool calls, as the Qwen3.5 chat template teaches them, to OpenAI `tool_calls`.

The template shows the model this format (and renders past calls the same way):

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

String values appear raw, objects and arrays as JSON, other scalars as Python prints them ("True"), so
values are converted back using the JSON schema of the tool's parameters (falling back to the string);
`is_text_param` decides which values are raw text, for this parser and for the forced-call grammar alike.
Both are in tool_values.py, with `schema_types` and `listed_values`; their names are re-exported here.

One state machine, `ToolCallStreamParser`, serves both APIs: streaming feeds it deltas; `extract_tool_calls`
feeds it the whole text. A call is committed once its `<tool_call>` + `<function=NAME>` header is complete;
a header that turns out not to be one is passed through as content. Text outside calls is content, minus
the whitespace that only separates calls from each other and from the text around them.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from nibble.server.tool_values import (  # noqa: F401  (re-exported: tool_grammar.py imports them from here)
    convert_param_value,
    is_text_param,
    listed_values,
    schema_types,
)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION_PREFIX = "<function="
FUNCTION_END = "</function>"
PARAMETER_PREFIX = "<parameter="
PARAMETER_END = "</parameter>"

# A function or parameter name longer than this without its closing '>' is not a header.
_MAX_NAME_LEN = 256
_BODY_TAGS = (PARAMETER_PREFIX, FUNCTION_END, TOOL_CALL_END)
_VALUE_END_TAGS = (PARAMETER_END, PARAMETER_PREFIX, FUNCTION_END, TOOL_CALL_END)


def make_tool_call_id() -> str:
    """A fresh OpenAI-style tool call id ("call_" + 24 hex digits)."""
    return f"call_{secrets.token_hex(12)}"


def _partial_suffix_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    for n in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        tail = text[-n:]
        if any(t.startswith(tail) and len(t) > n for t in tags):
            return n
    return 0


def _inside_json_string(text: str) -> bool:
    """Whether `text`, the start of a JSON value, ends inside a string literal (an unclosed quote)."""
    inside = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif inside and ch == "\\":
            escaped = True
        elif ch == '"':
            inside = not inside
    return inside


def _first_tag(text: str, tags: tuple[str, ...]) -> tuple[int, str | None]:
    best, which = -1, None
    for tag in tags:
        i = text.find(tag)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, tag
    return best, which


def _param_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        params = function.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        out[function["name"]] = props if isinstance(props, dict) else {}
    return out


class ToolCallStreamParser:
    """Streaming Qwen3-Coder tool-call parser producing OpenAI `tool_calls` deltas.

    `feed(delta)` returns (content_delta, tool_call_deltas). The first delta of a call carries `index`,
    `id`, `type` and `function.name` (with empty arguments); later ones carry argument fragments, one per
    parameter once its value is complete, then the closing brace. Joined, a call's fragments are the JSON
    text `extract_tool_calls` returns. A call still open when generation ends is left as sent (its
    arguments unterminated) and `incomplete_call_text` holds its raw text.
    """

    _TEXT = "text"
    _HEADER = "header"
    _BODY = "body"
    _PARAM = "param"

    def __init__(self, tools: list[dict[str, Any]] | None = None, id_factory: Any = make_tool_call_id) -> None:
        """`tools`: the request's OpenAI tool list (for parameter types); `id_factory()` makes call ids."""
        self._schemas = _param_schemas(tools)
        self._new_id = id_factory
        self._state = self._TEXT
        self._buf = ""
        self._after_call = False  # just after a call: its trailing whitespace is pending
        self._content_emitted = False
        self._sep = ""  # whitespace held between content and a possible call
        self._raw: list[str] = []  # raw text of the current call, for returning it when unfinished
        self._index = -1
        self._name = ""
        self._param = ""
        self._args_open = False
        self._function_closed = False
        self._finishing = False
        self.incomplete_call_text: str | None = None

    @property
    def num_calls(self) -> int:
        """Calls committed so far."""
        return self._index + 1

    def feed(self, delta: str) -> tuple[str | None, list[dict[str, Any]]]:
        """Process the next text delta; returns (content_delta or None, tool-call deltas)."""
        if self._state != self._TEXT:
            self._raw.append(delta)
        self._buf += delta
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while self._step(content, calls):
            pass
        return "".join(content) or None, calls

    def finish(self) -> tuple[str | None, list[dict[str, Any]]]:
        """Flush at the end of generation; returns (content_delta or None, tool-call deltas)."""
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        if self._state == self._PARAM:
            # a JSON value still open: its closing tags inside strings count after all (see _value_end)
            self._finishing = True
            while self._step(content, calls):
                pass
            self._finishing = False
        if self._state == self._TEXT:
            rest = self._buf
            if self._after_call:
                rest = rest if rest.strip() and self._content_emitted else rest.lstrip()
            self._emit(content, rest)
        elif self._state == self._HEADER:
            self._emit(content, self._sep + TOOL_CALL_START + self._buf)
        elif self._function_closed:
            self._close_call(calls)
        else:
            self.incomplete_call_text = self._sep + TOOL_CALL_START + "".join(self._raw)
        self._buf, self._sep, self._raw = "", "", []
        self._state = self._TEXT
        return "".join(content) or None, calls

    def _step(self, content: list[str], calls: list[dict[str, Any]]) -> bool:
        """Advance as far as the buffer allows; returns True when it should be called again."""
        if self._state == self._TEXT:
            return self._step_text(content)
        if self._state == self._HEADER:
            return self._step_header(content, calls)
        if self._state == self._BODY:
            return self._step_body(calls)
        return self._step_param(calls)

    def _emit(self, content: list[str], text: str) -> None:
        if text:
            content.append(text)
            self._content_emitted = True

    def _step_text(self, content: list[str]) -> bool:
        if self._after_call:
            rest = self._buf.lstrip()
            if not rest or (len(rest) < len(TOOL_CALL_START) and TOOL_CALL_START.startswith(rest)):
                return False
            self._after_call = False
            # Whitespace after a call separates it from what follows: kept between two pieces of content,
            # dropped at the start of the content, and held as a possible call separator before a tag.
            if not rest.startswith(TOOL_CALL_START) and not self._content_emitted:
                self._buf = rest
        idx = self._buf.find(TOOL_CALL_START)
        if idx >= 0:
            before = self._buf[:idx]
            text = before.rstrip()
            self._emit(content, text)
            self._sep = before[len(text) :]
            self._buf = self._buf[idx + len(TOOL_CALL_START) :]
            self._raw = [self._buf]
            self._state = self._HEADER
            return True
        # Hold a possible partial "<tool_call>" and the whitespace before it (dropped if a call follows).
        keep = _partial_suffix_len(self._buf, (TOOL_CALL_START,))
        text = self._buf[: len(self._buf) - keep].rstrip()
        self._emit(content, text)
        self._buf = self._buf[len(text) :]
        return False

    def _step_header(self, content: list[str], calls: list[dict[str, Any]]) -> bool:
        s = self._buf.lstrip()
        if not s:
            return False
        if not s.startswith(FUNCTION_PREFIX):
            if FUNCTION_PREFIX.startswith(s):
                return False
            return self._reject_header(content)
        rest = s[len(FUNCTION_PREFIX) :]
        end = rest.find(">")
        name = rest if end < 0 else rest[:end]
        if "\n" in name or "<" in name or len(name) > _MAX_NAME_LEN:
            return self._reject_header(content)
        if end < 0:
            return False
        name = name.strip()
        if not name:
            return self._reject_header(content)
        self._index += 1
        self._name = name
        self._args_open = False
        self._function_closed = False
        calls.append(
            {
                "index": self._index,
                "id": self._new_id(),
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
        )
        self._buf = rest[end + 1 :]
        self._state = self._BODY
        return True

    def _reject_header(self, content: list[str]) -> bool:
        # Not a call after all: the tag and the whitespace before it are ordinary content, and the text
        # after the tag is scanned again (it may hold a real call).
        self._emit(content, self._sep + TOOL_CALL_START)
        self._sep, self._raw = "", []
        self._state = self._TEXT
        return True

    def _step_body(self, calls: list[dict[str, Any]]) -> bool:
        idx, tag = _first_tag(self._buf, _BODY_TAGS)
        if tag is None:
            # Stray text between parameters is ignored; only a possible partial tag is kept.
            keep = _partial_suffix_len(self._buf, _BODY_TAGS)
            self._buf = self._buf[len(self._buf) - keep :] if keep else ""
            return False
        after = self._buf[idx + len(tag) :]
        if tag == PARAMETER_PREFIX:
            end = after.find(">")
            name = after if end < 0 else after[:end]
            if "\n" in name or "<" in name or len(name) > _MAX_NAME_LEN:
                self._buf = after  # not a parameter header; skip the tag
                return True
            if end < 0:
                self._buf = self._buf[idx:]
                return False
            self._param = name.strip()
            self._buf = after[end + 1 :]
            self._state = self._PARAM
            return True
        if tag == FUNCTION_END:
            self._function_closed = True
            self._buf = after
            return True
        self._buf = after
        self._close_call(calls)
        return True

    def _value_end(self) -> tuple[int, str | None]:
        """Where the current parameter's value ends. A JSON object or array value (not `is_text_param`) may
        hold a closing tag inside one of its strings (code, markup): a tag met inside a string literal is
        skipped, unless the generation ended (`finish`) with no later tag outside one, where the first tag
        ends the value as it does for text values."""
        idx, tag = _first_tag(self._buf, _VALUE_END_TAGS)
        schema = self._schemas.get(self._name, {}).get(self._param)
        if tag is None or self._finishing or is_text_param(schema) or self._buf.lstrip()[:1] not in ("{", "["):
            return idx, tag
        start = 0
        while tag is not None and _inside_json_string(self._buf[:start + idx]):
            start += idx + 1
            idx, tag = _first_tag(self._buf[start:], _VALUE_END_TAGS)
        return (start + idx, tag) if tag is not None else (-1, None)

    def _step_param(self, calls: list[dict[str, Any]]) -> bool:
        idx, tag = self._value_end()
        if tag is None:
            return False
        value = self._buf[:idx]
        # The template wraps each value in one newline on either side.
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        self._buf = self._buf[idx + len(PARAMETER_END) :] if tag == PARAMETER_END else self._buf[idx:]
        converted = convert_param_value(value, self._schemas.get(self._name, {}).get(self._param))
        fragment = "{" if not self._args_open else ", "
        fragment += json.dumps(self._param, ensure_ascii=False) + ": " + json.dumps(converted, ensure_ascii=False)
        self._args_open = True
        calls.append({"index": self._index, "function": {"arguments": fragment}})
        self._state = self._BODY
        return True

    def _close_call(self, calls: list[dict[str, Any]]) -> None:
        calls.append({"index": self._index, "function": {"arguments": "}" if self._args_open else "{}"}})
        self._state = self._TEXT
        self._after_call = True
        self._sep, self._raw = "", []


def extract_tool_calls(
    text: str, tools: list[dict[str, Any]] | None = None, id_factory: Any = make_tool_call_id
) -> tuple[str | None, list[dict[str, Any]]]:
    """Non-streaming parse of a complete output: (content or None, OpenAI tool calls).

    Each call is `{"id", "type": "function", "function": {"name", "arguments": JSON string}}`. A call left
    unfinished at the end of the text, or a `<tool_call>` that does not start a valid call, is returned
    as content, so no text is lost.
    """
    parser = ToolCallStreamParser(tools, id_factory)
    content_parts: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for piece, deltas in (parser.feed(text), parser.finish()):
        if piece:
            content_parts.append(piece)
        for d in deltas:
            if "id" in d:
                calls[d["index"]] = {"id": d["id"], "type": "function", "function": dict(d["function"])}
            else:
                calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    if parser.incomplete_call_text is not None:
        calls.pop(parser.num_calls - 1, None)
        content_parts.append(parser.incomplete_call_text)
    content = "".join(content_parts)
    return content or None, [calls[i] for i in sorted(calls)]
