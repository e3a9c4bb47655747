"""Generated text -> chat message parts: reasoning, content and tool calls.

Reasoning is split off first (Qwen3.5 thinks before it answers); tool calls are parsed from the content
that follows. `build_chat_message` does it for a finished text, `ChatDeltaBuilder` step by step for a
stream; their results agree (concatenated deltas == the message), which the tests check.
"""

from __future__ import annotations

from typing import Any

from nibble.server import reasoning
from nibble.server.protocol import ChatMessage, DeltaMessage, DeltaToolCall, ToolCall
from nibble.server.tool_parser import ToolCallStreamParser, extract_tool_calls


def _join(a: str | None, b: str | None) -> str | None:
    return (a or "") + (b or "") or None


def build_chat_message(text: str, thinking: bool, tools: list[dict[str, Any]] | None, parse_tools: bool,
                       include_reasoning: bool = True) -> ChatMessage:
    """The assistant message for a finished generation.

    `thinking`: the prompt opened a think block; `parse_tools`: the request offered tools the model may
    call (tool_choice not 'none'); `include_reasoning` false leaves reasoning_content out.
    """
    thought, content = reasoning.extract(text, thinking)
    calls: list[dict[str, Any]] = []
    if parse_tools and content:
        content, calls = extract_tool_calls(content, tools)
    return ChatMessage(content=content, reasoning_content=thought if include_reasoning else None,
                       tool_calls=[ToolCall(**call) for call in calls])


def chat_finish_reason(engine_reason: str | None, has_tool_calls: bool) -> str | None:
    """OpenAI finish reason: a generation that stopped after calling tools reports 'tool_calls'."""
    if has_tool_calls and engine_reason == "stop":
        return "tool_calls"
    return engine_reason


class ChatDeltaBuilder:
    """Streaming form of `build_chat_message`: text deltas in, `DeltaMessage`s out."""

    def __init__(self, thinking: bool, tools: list[dict[str, Any]] | None, parse_tools: bool,
                 include_reasoning: bool = True) -> None:
        """Same arguments as `build_chat_message`."""
        self._reasoning = reasoning.ReasoningStreamParser(thinking)
        self._tools = ToolCallStreamParser(tools) if parse_tools else None
        self._include_reasoning = include_reasoning

    @property
    def has_tool_calls(self) -> bool:
        """Whether any complete tool call has been emitted (one the generation left unfinished does not count,
        as `build_chat_message` returns it as content)."""
        return self._tools is not None and self._tools.num_calls - self.has_unfinished_call > 0

    @property
    def has_unfinished_call(self) -> bool:
        """Whether the generation ended inside a tool call (known after the final `feed`): its deltas were
        sent, but its arguments are unterminated."""
        return self._tools is not None and self._tools.incomplete_call_text is not None

    def feed(self, delta_text: str, final: bool = False) -> DeltaMessage | None:
        """The delta for the next piece of text (None when nothing is ready); `final` flushes everything."""
        thought, content = self._reasoning.feed(delta_text) if delta_text else (None, None)
        if final:
            more_thought, more_content = self._reasoning.finish()
            thought, content = _join(thought, more_thought), _join(content, more_content)
        calls: list[dict[str, Any]] = []
        if self._tools is not None and (content or final):
            content, calls = self._tools.feed(content or "")
            if final:
                more_content, more_calls = self._tools.finish()
                content = _join(content, more_content)
                calls += more_calls
        if not self._include_reasoning:
            thought = None
        if not (thought or content or calls):
            return None
        return DeltaMessage(reasoning_content=thought, content=content,
                            tool_calls=[DeltaToolCall(**call) for call in calls] or None)
