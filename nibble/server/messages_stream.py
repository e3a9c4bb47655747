"""The Messages API's event stream (`message_start` ... `message_stop`) built from the chat deltas.

A stream opens a content block when its kind of output starts (thinking, text, a tool call), sends its deltas
(`thinking_delta`, `text_delta`, `input_json_delta`), and closes it (`content_block_stop`) when the next block
opens or the generation ends; `message_delta` then carries the stop reason and the final usage. The blocks it
closes are the non-streaming response's (`messages_items.content_blocks`), which the anthropic SDK's
`messages.stream()` helper accumulates back into the same message; the tests check it.
"""

from __future__ import annotations

import json
from typing import Any

from nibble.server.messages_items import tool_use_id
from nibble.server.messages_protocol import (
    ContentBlock,
    MessageObject,
    MessagesUsage,
    StopReason,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
)
from nibble.server.protocol import DeltaMessage


def message_event(kind: str, payload: dict[str, Any]) -> str:
    """One server-sent event: `event: <kind>` and its JSON data, whose `type` is the kind too."""
    data = json.dumps({"type": kind, **payload}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n"


class MessageEventWriter:
    """Server-sent events of one streamed message."""

    def __init__(self, message: MessageObject, omit_thinking: bool = False) -> None:
        """`message`: the message skeleton (id, model, prompt usage; no content yet). `omit_thinking`: thinking
        blocks are opened and closed without their text (`thinking.display` 'omitted')."""
        self.message = message
        self.blocks: list[ContentBlock] = []
        self._omit_thinking = omit_thinking
        self._open: ContentBlock | None = None
        # the open block's index: blocks compare by value, and two text blocks may hold the same text so far
        self._open_index = -1
        self._arguments: dict[int, str] = {}  # per tool_use block: its arguments as JSON text, as streamed

    def start(self) -> list[str]:
        """message_start (the message without content) and a ping, as Anthropic's API begins its streams."""
        return [message_event("message_start", {"message": self.message.model_dump(mode="json")}),
                message_event("ping", {})]

    def _open_block(self, block: ContentBlock) -> list[str]:
        events = self._close_open()
        self.blocks.append(block)
        self._open = block
        self._open_index = len(self.blocks) - 1
        start = block.model_copy(update={"input": {}}) if isinstance(block, ToolUseBlock) else block
        events.append(message_event("content_block_start", {"index": len(self.blocks) - 1,
                                                            "content_block": start.model_dump(mode="json")}))
        return events

    def _close_open(self) -> list[str]:
        block, self._open = self._open, None
        if block is None:
            return []
        index = self._open_index
        if isinstance(block, ToolUseBlock):
            try:
                block.input = json.loads(self._arguments.get(index) or "{}")
            except ValueError:
                pass  # a call cut off by max_tokens: its streamed arguments stay unterminated
        return [message_event("content_block_stop", {"index": index})]

    def _delta(self, delta: dict[str, Any]) -> str:
        assert self._open is not None
        return message_event("content_block_delta", {"index": self._open_index, "delta": delta})

    def feed(self, delta: DeltaMessage | None) -> list[str]:
        """Events for one chat delta (None: nothing new)."""
        events: list[str] = []
        if delta is None:
            return events
        if delta.reasoning_content:
            if not isinstance(self._open, ThinkingBlock):
                events += self._open_block(ThinkingBlock(thinking=""))
            if not self._omit_thinking:
                assert isinstance(self._open, ThinkingBlock)
                self._open.thinking += delta.reasoning_content
                events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning_content}))
        if delta.content:
            if not isinstance(self._open, TextBlock):
                events += self._open_block(TextBlock(text=""))
            assert isinstance(self._open, TextBlock)
            self._open.text += delta.content
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls or []:
            fn = call.function
            if call.id is not None:
                events += self._open_block(ToolUseBlock(id=tool_use_id(call.id), name=fn.name if fn and fn.name
                                                        else ""))
            if isinstance(self._open, ToolUseBlock) and fn is not None and fn.arguments:
                index = self._open_index
                self._arguments[index] = self._arguments.get(index, "") + fn.arguments
                events.append(self._delta({"type": "input_json_delta", "partial_json": fn.arguments}))
        return events

    def finish(self, stop_reason: StopReason | None, stop_sequence: str | None,
               usage: MessagesUsage) -> tuple[list[str], MessageObject]:
        """Close the open block and end with message_delta (stop reason, final usage) and message_stop;
        returns the events and the final message."""
        events = self._close_open()
        self.message = self.message.model_copy(update={"content": self.blocks, "stop_reason": stop_reason,
                                                       "stop_sequence": stop_sequence, "usage": usage})
        events.append(message_event("message_delta", {
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": usage.model_dump(mode="json")}))
        events.append(message_event("message_stop", {}))
        return events, self.message
