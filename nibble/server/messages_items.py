"""Anthropic Messages content blocks <-> chat messages.

A Messages request is served as the chat request it amounts to: `system` (and system-role messages, which
Claude Code puts into `messages`) becomes the one system message Qwen3.5's template takes, first; a user
message's text blocks become a user message and each `tool_result` block a `tool` message, in their order;
the assistant messages of one turn (thinking, text, tool_use blocks) become one assistant message with
`reasoning_content`, `content` and `tool_calls`. Custom tools take their chat form; `tool_choice` becomes the
chat tool_choice and parallel_tool_calls; `output_config.format` becomes `response_format`; `thinking` becomes
enable_thinking and, for type 'enabled', a `thinking_token_budget` of its budget_tokens.

The generated assistant message (reasoning, content, tool calls) becomes thinking, text and tool_use blocks.
Errors are `BlockError`s whose message and `param` name the offending field, e.g. `messages[2].content[0].type`.
"""

from __future__ import annotations

import json
from typing import Any

from nibble.server.messages_protocol import ContentBlock, TextBlock, ThinkingBlock, ToolUseBlock
from nibble.server.protocol import ChatMessage


class BlockError(ValueError):
    """A Messages request field that cannot be served; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


# Claude Code starts its system prompt with this line; its `cch=` hash changes with every request, which would
# end the prompt's cached prefix at its first tokens. It means nothing to the model, so it is dropped.
BILLING_HEADER = "x-anthropic-billing-header:"

# Blocks that carry media, or the results of Anthropic's server tools, which nibble does not run.
_MEDIA_BLOCKS = ("image", "document", "search_result", "container_upload")


def _unsupported_block(kind: Any, where: str, accepted: str = "text and image") -> BlockError:
    if kind in _MEDIA_BLOCKS:
        return BlockError(f"{where}.type", f"{kind!r} blocks are not supported here; only {accepted} blocks are")
    return BlockError(f"{where}.type", f"block type {kind!r} is not supported here")


def _text_blocks(content: Any, where: str) -> list[str]:
    """The texts of a string or a list of text blocks (a tool result's content, a system prompt)."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise BlockError(where, "must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(content):
        loc = f"{where}[{j}]"
        if not isinstance(block, dict):
            raise BlockError(loc, "must be an object like {'type': 'text', 'text': ...}")
        if block.get("type") != "text":
            raise _unsupported_block(block.get("type"), loc, "text")
        if not isinstance(block.get("text"), str):
            raise BlockError(f"{loc}.text", "must be a string")
        texts.append(block["text"])
    return texts


def _system_parts(system: Any, where: str) -> list[str]:
    if isinstance(system, str) and system.startswith(BILLING_HEADER):
        system = system.partition("\n")[2]
    # Text blocks are joined as Qwen3.5's template joins a message's text parts: with nothing between them.
    text = "".join(t for t in _text_blocks(system, where) if not t.startswith(BILLING_HEADER))
    return [text] if text else []


class _Conversation:
    """Chat messages being built; consecutive assistant messages make one turn, as Anthropic combines them."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.system: list[str] = []
        self._turn: dict[str, Any] | None = None

    def speak(self, message: dict[str, Any]) -> None:
        self._turn = None
        self.messages.append(message)

    def assistant(self) -> dict[str, Any]:
        if self._turn is None:
            self._turn = {"role": "assistant"}
            self.messages.append(self._turn)
        return self._turn

    def user(self, blocks: list[Any], where: str) -> None:
        """Text blocks in a row become one user message, each tool_result a tool message, in their order."""
        texts: list[dict[str, Any]] = []

        def flush() -> None:
            if texts:
                self.speak({"role": "user", "content": list(texts)})
                texts.clear()

        for j, block in enumerate(blocks):
            loc = f"{where}[{j}]"
            kind = _block_kind(block, loc)
            if kind == "text":
                texts.append({"type": "text", "text": _block_str(block, "text", loc)})
            elif kind == "image":
                # the chat handler's image path takes it from here (multimodal.take_media)
                texts.append({"type": "image_url", "image_url": {"url": _image_url(block, loc)}})
            elif kind == "tool_result":
                flush()
                tool_id = _block_str(block, "tool_use_id", loc)
                if not isinstance(block.get("is_error", False), bool):
                    raise BlockError(f"{loc}.is_error", "must be true or false")
                # is_error has no place in the template: the result's text is what the model reads
                content = block.get("content")
                text = "".join(_text_blocks(content, f"{loc}.content")) if content is not None else ""
                self.speak({"role": "tool", "tool_call_id": tool_id, "content": text})
            elif kind in ("tool_use", "thinking", "redacted_thinking"):
                raise BlockError(f"{loc}.type", f"{kind!r} blocks belong in assistant messages")
            else:
                raise _unsupported_block(kind, loc)
        flush()

    def assistant_blocks(self, blocks: list[Any], where: str) -> None:
        turn = self.assistant()
        for j, block in enumerate(blocks):
            loc = f"{where}[{j}]"
            kind = _block_kind(block, loc)
            if kind == "text":
                turn["content"] = turn.get("content", "") + _block_str(block, "text", loc)
            elif kind == "thinking":
                thought = _block_str(block, "thinking", loc)
                turn["reasoning_content"] = f"{turn['reasoning_content']}\n\n{thought}" \
                    if turn.get("reasoning_content") else thought
            elif kind == "redacted_thinking":
                continue  # Anthropic's encrypted reasoning: nothing nibble can read
            elif kind == "tool_use":
                call_id, name = _block_str(block, "id", loc), _block_str(block, "name", loc)
                if not name:
                    raise BlockError(f"{loc}.name", "must be a non-empty string")
                if not isinstance(block.get("input"), dict):
                    raise BlockError(f"{loc}.input", "must be a JSON object")
                turn.setdefault("tool_calls", []).append(
                    {"id": call_id, "type": "function",
                     "function": {"name": name, "arguments": json.dumps(block["input"], ensure_ascii=False)}})
            elif kind == "tool_result":
                raise BlockError(f"{loc}.type", "'tool_result' blocks belong in user messages")
            else:
                raise _unsupported_block(kind, loc, "text, thinking and tool_use")


def _image_url(block: dict[str, Any], where: str) -> str:
    """An image block's source as a URL: base64 data as a data URL, a url source as given (the engine fetches
    an http(s):// one, engine/media.py)."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise BlockError(f"{where}.source", "must be an object ({'type': 'base64', 'media_type', 'data'})")
    if source.get("type") == "base64":
        media_type, data = _block_str(source, "media_type", f"{where}.source"), _block_str(source, "data",
                                                                                           f"{where}.source")
        return f"data:{media_type};base64,{data}"
    if source.get("type") == "url":
        return _block_str(source, "url", f"{where}.source")
    raise BlockError(f"{where}.source.type", f"must be 'base64' or 'url', got {source.get('type')!r}")


def _block_kind(block: Any, where: str) -> Any:
    if not isinstance(block, dict):
        raise BlockError(where, "must be a content block object with a 'type'")
    return block.get("type")


def _block_str(block: dict[str, Any], key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise BlockError(f"{where}.{key}", "must be a string")
    return value


def to_chat_messages(system: Any, messages: list[Any]) -> list[dict[str, Any]]:
    """Chat messages for a Messages request's `system` and `messages`.

    System-role messages in `messages` are folded into the system prompt after `system` (separated by a blank
    line), since the template takes one system message, at the start. A final assistant message (a prefill
    Anthropic continues) is refused: nibble does not continue a message the client started."""
    conv = _Conversation()
    if system is not None:
        conv.system += _system_parts(system, "system")
    for i, message in enumerate(messages):
        loc = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BlockError(loc, "must be an object with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant", "system"):
            raise BlockError(f"{loc}.role", f"must be 'user', 'assistant' or 'system', got {role!r}")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        elif not isinstance(content, list):
            raise BlockError(f"{loc}.content", "must be a string or a list of content blocks")
        elif not content:
            raise BlockError(f"{loc}.content", "must not be empty")
        if role == "system":
            conv.system += _system_parts(message["content"], f"{loc}.content")
        elif role == "user":
            conv.user(content, f"{loc}.content")
        else:
            conv.assistant_blocks(content, f"{loc}.content")
    if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        raise BlockError(f"messages[{len(messages) - 1}].role", "a final assistant message (a prefill to continue) "
                                                                "is not supported; end with a user message")
    system_message = [{"role": "system", "content": "\n\n".join(conv.system)}] if conv.system else []
    return system_message + conv.messages


# Tool fields that change nothing here: cache breakpoints (nibble caches prefixes by itself), strictness and
# streaming hints (tool arguments are parsed by the tool's schema and streamed per parameter anyway).
_IGNORED_TOOL_FIELDS = ("cache_control", "strict", "eager_input_streaming", "type")


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Custom tools (`{"name", "description", "input_schema"}`) in their chat form. Anthropic's server tools
    (web search, code execution...) and schema-less client tools (bash, text editor, computer) are refused:
    nibble runs no tools and knows no schema for them."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        loc = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise BlockError(loc, "must be an object")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise BlockError(f"{loc}.type", f"{kind!r} tools are not supported; only custom tools with an "
                                            f"input_schema (the client runs them)")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise BlockError(f"{loc}.name", "must be a non-empty string")
        if not isinstance(tool.get("input_schema"), dict):
            raise BlockError(f"{loc}.input_schema", "must be a JSON schema object")
        if tool.get("description") is not None and not isinstance(tool["description"], str):
            raise BlockError(f"{loc}.description", "must be a string")
        if tool.get("defer_loading"):
            raise BlockError(f"{loc}.defer_loading", "deferred tools (tool search) are not supported")
        if tool.get("input_examples"):
            raise BlockError(f"{loc}.input_examples", "tool input examples are not supported")
        if tool.get("allowed_callers") not in (None, ["direct"]):
            raise BlockError(f"{loc}.allowed_callers", "only direct calls are supported (no code execution)")
        function: dict[str, Any] = {"name": tool["name"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        function["parameters"] = tool["input_schema"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[str | dict[str, Any] | None, bool | None]:
    """(chat tool_choice, parallel_tool_calls) for an Anthropic tool_choice: auto, any -> required, tool ->
    the named function, none; `disable_parallel_tool_use` -> parallel_tool_calls false."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise BlockError("tool_choice.disable_parallel_tool_use", "must be true or false")
    parallel_calls = None if parallel is None else not parallel
    if kind == "auto":
        return "auto", parallel_calls
    if kind == "any":
        return "required", parallel_calls
    if kind == "none":
        return "none", None
    if kind == "tool":
        if not isinstance(choice.get("name"), str) or not choice["name"]:
            raise BlockError("tool_choice.name", "type 'tool' needs the name of one of the tools")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel_calls
    raise BlockError("tool_choice.type", f"must be 'auto', 'any', 'tool' or 'none', got {kind!r}")


def thinking_mode(thinking: dict[str, Any] | None) -> tuple[bool | None, bool]:
    """(enable_thinking, whether the thinking text is omitted) for the `thinking` setting: 'enabled' and
    'adaptive' think, 'disabled' does not, absent is the model's default (Qwen3.5 thinks). 'adaptive' lets
    Qwen3.5 decide how long; 'enabled' caps its thinking at `budget_tokens` (`thinking_budget`), after which
    `</think>` is forced. Reasoning and answer share max_tokens, as thinking counts toward max_tokens in
    Anthropic's API too. `display: "omitted"` returns thinking blocks without their text."""
    if thinking is None:
        return None, False
    kind = thinking.get("type")
    if kind == "disabled":
        return False, False
    if kind not in ("enabled", "adaptive"):
        raise BlockError("thinking.type", f"must be 'enabled', 'adaptive' or 'disabled', got {kind!r}")
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise BlockError("thinking.budget_tokens", "type 'enabled' needs budget_tokens, a positive integer")
    display = thinking.get("display")
    if display not in (None, "summarized", "omitted"):
        raise BlockError("thinking.display", f"must be 'summarized' or 'omitted', got {display!r}")
    return True, display == "omitted"


def thinking_budget(thinking: dict[str, Any] | None) -> int | None:
    """The thinking-token budget of a `thinking` setting: budget_tokens of type 'enabled', else None (an
    invalid setting too: `thinking_mode` names its error)."""
    budget = (thinking or {}).get("budget_tokens")
    if (thinking or {}).get("type") != "enabled" or not isinstance(budget, int) or isinstance(budget, bool):
        return None
    return budget if budget >= 1 else None


def chat_response_format(output_config: dict[str, Any] | None,
                         output_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """`output_config.format` (or the older `output_format`), a JSON schema the answer must follow, as a chat
    `response_format`. `output_config.effort` is accepted and ignored: Qwen3.5 has no effort levels."""
    fmt, where = (output_config or {}).get("format"), "output_config.format"
    if output_format is not None:
        if fmt is not None:
            raise BlockError("output_format", "give either output_format or output_config.format, not both")
        fmt, where = output_format, "output_format"
    effort = (output_config or {}).get("effort")
    if effort not in (None, "low", "medium", "high", "xhigh", "max"):
        raise BlockError("output_config.effort", f"must be low, medium, high, xhigh or max, got {effort!r}")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise BlockError(f"{where}.type", "only 'json_schema' is supported")
    if not isinstance(fmt.get("schema"), dict):
        raise BlockError(f"{where}.schema", "must be a JSON schema object")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def check_context_management(cm: dict[str, Any] | None) -> None:
    """Context editing would drop parts of the conversation on the server; only the edit that changes nothing
    here is accepted: keeping all thinking (`clear_thinking_20251015` with keep 'all', which Claude Code
    sends)."""
    edits = (cm or {}).get("edits") or []
    if not isinstance(edits, list):
        raise BlockError("context_management.edits", "must be a list")
    for i, edit in enumerate(edits):
        if not isinstance(edit, dict) or edit.get("type") != "clear_thinking_20251015" or edit.get("keep") != "all":
            raise BlockError(f"context_management.edits[{i}]", "context editing is not supported (only "
                                                               "clear_thinking_20251015 with keep 'all')")


def tool_use_id(call_id: str) -> str:
    """A chat tool-call id ('call_<hex>') in Anthropic's style ('toolu_<hex>')."""
    return "toolu_" + call_id.removeprefix("call_")


def content_blocks(message: ChatMessage, omit_thinking: bool = False) -> list[ContentBlock]:
    """Content blocks of a finished generation: thinking, then the answer, then the tool calls."""
    blocks: list[ContentBlock] = []
    if message.reasoning_content:
        blocks.append(ThinkingBlock(thinking="" if omit_thinking else message.reasoning_content))
    if message.content:
        blocks.append(TextBlock(text=message.content))
    for call in message.tool_calls:
        blocks.append(ToolUseBlock(id=tool_use_id(call.id), name=call.function.name,
                                   input=json.loads(call.function.arguments)))
    return blocks
