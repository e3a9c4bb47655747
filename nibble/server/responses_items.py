"""Responses API items <-> chat messages.

A Responses request is served as the chat request it amounts to: its input items become chat messages for
the chat template, its function tools and tool_choice take their chat forms, `text.format` becomes
`response_format`. The generated assistant message (reasoning, content, tool calls) becomes output items.

Items of one assistant turn (reasoning, then an assistant message and/or function calls) are merged into
one chat message, because Qwen3.5's template renders a turn as think block + content + tool calls; a
function_call_output item becomes a `tool` message. Errors are `ItemError`s whose message and `param` name
the offending item, e.g. `input[2].content[0].type`.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from nibble.server.protocol import ChatMessage
from nibble.server.responses_protocol import (
    FunctionCallItem,
    MessageItem,
    OutputItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
)


class ItemError(ValueError):
    """A Responses request field that cannot be served; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


_INPUT_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def _text_of(content: Any, where: str) -> str:
    """A message's content (a string, or a list of text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ItemError(where, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        loc = f"{where}[{j}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise ItemError(loc, "must be an object like {'type': 'input_text', 'text': ...}")
        kind = part.get("type")
        if kind not in _TEXT_PARTS:
            raise ItemError(f"{loc}.type", f"content type {kind!r} is not supported here (input_text, "
                                           f"output_text; input_image in user messages)")
        key = "refusal" if kind == "refusal" else "text"
        text = part.get(key)
        if not isinstance(text, str):
            raise ItemError(f"{loc}.{key}", "must be a string")
        texts.append(text)
    return "".join(texts)


def _user_content_of(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A user message's content: its text (`_text_of`), or, when it holds input_image parts, chat content parts
    (text, and image_url for each image, in order) for the chat handler's image path, which fetches an
    http(s):// image_url (engine/media.py)."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _text_of(content, where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise ItemError(f"{where}[{j}].image_url", "images are taken as image_url URLs (data: or "
                                                           "http(s)://); file_id images are not supported")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": _text_of([part], f"{where}[{j}]")})
    return parts


def _reasoning_of(item: dict[str, Any], where: str) -> str:
    """The readable reasoning of a reasoning item: its reasoning_text content, else its summary."""
    for key in ("content", "summary"):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise ItemError(f"{where}.{key}", "must be a list")
        texts = [p.get("text") for p in parts if isinstance(p, dict)]
        if any(not isinstance(t, str) for t in texts) or len(texts) != len(parts):
            raise ItemError(f"{where}.{key}", "parts must be objects with a string 'text'")
        if texts:
            return "\n\n".join(texts)
    return ""


def _call_arguments(item: dict[str, Any], where: str) -> str:
    """A function_call item's `arguments` (a JSON object as a string; empty: none) for the chat message,
    its fields checked here so that an error names the item rather than the chat message it becomes.

    A call the token limit cut (status 'incomplete') may carry the start of its arguments only, as the stream
    sent them; the template can only render an object, so such a call goes on with none rather than making
    every later turn of its conversation fail."""
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise ItemError(f"{where}.{key}", "must be a string")
    if not item["name"]:
        raise ItemError(f"{where}.name", "must not be empty")
    arguments = item["arguments"]
    if not arguments.strip():
        return arguments
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as exc:
        problem = f"not valid JSON ({exc.msg})"
    except ValueError:
        problem = f"holds an integer of more than {sys.get_int_max_str_digits()} digits"
    else:
        if isinstance(parsed, dict):
            return arguments
        problem = "must be a JSON object"
    if item.get("status") == "incomplete":
        return "{}"
    raise ItemError(f"{where}.arguments", problem)


class _Conversation:
    """Chat messages being built from items; an assistant turn stays open until another role speaks."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._turn: dict[str, Any] | None = None

    def speak(self, message: dict[str, Any]) -> None:
        self._turn = None
        self.messages.append(message)

    def assistant(self, *, closed_by: tuple[str, ...]) -> dict[str, Any]:
        """The open assistant message, or a new one when none is open or the open one has any of the keys
        `closed_by` (reasoning after an answer starts the next turn, a function call never does)."""
        if self._turn is None or any(key in self._turn for key in closed_by):
            self._turn = {"role": "assistant"}
            self.messages.append(self._turn)
        return self._turn


def input_to_messages(items: list[Any], first_index: int = 0) -> list[dict[str, Any]]:
    """Chat messages for Responses input items. `first_index`: the index of `items[0]` in `input`, as errors
    name it (negative for the items of earlier turns that precede the request's own)."""
    conv = _Conversation()
    for i, item in enumerate(items, start=first_index):
        loc = f"input[{i}]"
        if not isinstance(item, dict):
            raise ItemError(loc, "must be an object (a message, reasoning, function_call or function_call_output "
                                 "item)")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _INPUT_ROLES:
                raise ItemError(f"{loc}.role", f"must be one of {', '.join(_INPUT_ROLES)}, got {role!r}")
            content = item.get("content")
            text = _user_content_of(content, f"{loc}.content") if role == "user" else \
                _text_of(content, f"{loc}.content")
            if role == "assistant":
                turn = conv.assistant(closed_by=("content", "tool_calls"))
                turn["content"] = text
            else:
                conv.speak({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "reasoning":
            text = _reasoning_of(item, loc)
            if text:
                turn = conv.assistant(closed_by=("content", "tool_calls"))
                turn["reasoning_content"] = f"{turn['reasoning_content']}\n\n{text}" if "reasoning_content" in turn \
                    else text
        elif kind == "function_call":
            arguments = _call_arguments(item, loc)
            turn = conv.assistant(closed_by=())
            turn.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments}})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ItemError(f"{loc}.call_id", "must be a string")
            output = _text_of(item.get("output"), f"{loc}.output")
            conv.speak({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        else:
            raise ItemError(f"{loc}.type", f"item type {kind!r} is not supported; use message, reasoning, "
                                           f"function_call or function_call_output")
    return conv.messages


def with_instructions(messages: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """`messages` after the system message `instructions`. The template takes one system message, at the
    start, so every system and developer message of the input (agents send several, and some insert one in the
    middle of a session) is joined to it, one paragraph each, in order, as /v1/messages does with Claude
    Code's. A conversation that gains one later misses the prefix cache on that turn."""
    texts = ([instructions] if instructions else []) + [m["content"] for m in messages if m["role"] == "system"]
    if not texts:
        return messages
    return [{"role": "system", "content": "\n\n".join(texts)}, *(m for m in messages if m["role"] != "system")]


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (`{"type": "function", "name", "description", "parameters", "strict"}`) in
    their chat form (`{"type": "function", "function": {...}}`), keys in the client's order."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        loc = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ItemError(loc, "must be an object")
        if tool.get("type") != "function":
            raise ItemError(f"{loc}.type", f"{tool.get('type')!r} tools are not supported; only 'function' tools "
                                           f"(the client runs them)")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise ItemError(f"{loc}.name", "must be a non-empty string")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """`tool_choice` in its chat form: the same strings, `{"type": "function", "function": {"name"}}`."""
    if choice is None or isinstance(choice, str):
        if choice not in (None, "auto", "none", "required"):
            raise ItemError("tool_choice", f"must be 'auto', 'none', 'required' or a function, got {choice!r}")
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise ItemError("tool_choice", 'only {"type": "function", "name": ...} names a tool here')
    return {"type": "function", "function": {"name": choice["name"]}}


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as a chat `response_format` (None for plain text)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ItemError("text.format", "must be an object")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), (dict, bool)):
            raise ItemError("text.format.schema", "type 'json_schema' needs a JSON schema object")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}
    raise ItemError("text.format.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def output_items(message: ChatMessage, *, incomplete: bool = False) -> list[OutputItem]:
    """Output items of a finished generation: reasoning, then the answer, then the function calls. When the
    token limit cut the generation (`incomplete`), the last item is the one it cut (reasoning that never
    reached its answer, too), and its status says so, as the stream's does."""
    items: list[OutputItem] = []
    if message.reasoning_content:
        items.append(ReasoningItem(content=[ReasoningText(text=message.reasoning_content)]))
    if message.content:
        items.append(MessageItem(content=[OutputText(text=message.content)]))
    for call in message.tool_calls:
        items.append(FunctionCallItem(call_id=call.id, name=call.function.name, arguments=call.function.arguments))
    if incomplete and items:
        items[-1].status = "incomplete"
    return items


def items_as_input(items: list[OutputItem]) -> list[dict[str, Any]]:
    """Output items as input items of a later turn (what previous_response_id continues from)."""
    return [item.model_dump(exclude_none=True) for item in items]
