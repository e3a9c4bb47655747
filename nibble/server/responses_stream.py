"""The Responses API's output as it is generated: which tokens belong to the answer, and the typed event
stream (`response.created` ... `response.completed`) built from the chat deltas.

A stream opens an output item when its kind of text starts (reasoning, answer, a function call), sends its
deltas, and closes it (`*.done`, `response.output_item.done`) when the next item opens or the generation
ends. The items it closes are the same as the non-streaming response's (`responses_items.output_items`),
which the tests check.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from nibble.engine.request import TokenLogprobs
from nibble.server.logprobs import chat_logprobs
from nibble.server.protocol import DeltaMessage
from nibble.server.responses_protocol import (
    FunctionCallItem,
    IncompleteDetails,
    MessageItem,
    OutputItem,
    OutputText,
    OutputTokenLogprob,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponseUsage,
)
from nibble.server.token_text import TokenTexts


class ContentTokens:
    """Sorts generated tokens into reasoning and answer: the answer (an output_text part) starts after
    `</think>` and the newlines the reasoning parser drops, and ends at the first `<tool_call>`.

    `feed` takes each step's new tokens (and their log-probabilities, when requested) and returns the
    log-probabilities of those that belong to the answer.
    """

    def __init__(self, thinking: bool, think_end_id: int | None, tool_start_id: int | None,
                 text_of: Callable[[int], str]) -> None:
        """`thinking`: the prompt left the model in its think block; `tool_start_id`: None when the request's
        tool calls are not parsed; `text_of`: a token's text."""
        self._in_reasoning = thinking and think_end_id is not None
        self._think_end_id = think_end_id
        self._tool_start_id = tool_start_id
        self._text_of = text_of
        self._answer_started = False
        self._in_tools = False
        self.num_reasoning_tokens = 0

    def feed(self, token_ids: list[int], entries: list[TokenLogprobs] | None = None) -> list[TokenLogprobs]:
        """The entries of `entries` (aligned with `token_ids`) that belong to the answer."""
        out = []
        for i, token_id in enumerate(token_ids):
            if self._in_reasoning:
                self.num_reasoning_tokens += 1
                self._in_reasoning = token_id != self._think_end_id
                continue
            if token_id == self._tool_start_id:
                self._in_tools = True
            if self._in_tools:
                continue
            if not self._answer_started and not self._text_of(token_id).strip("\n"):
                continue
            self._answer_started = True
            if entries is not None and i < len(entries):
                out.append(entries[i])
        return out


def output_logprobs(entries: list[TokenLogprobs], texts: TokenTexts, num_top: int) -> list[OutputTokenLogprob]:
    """output_text log-probabilities: per token its text, log-probability, UTF-8 bytes, top alternatives."""
    return [OutputTokenLogprob(token=e.token, logprob=e.logprob, bytes=e.bytes or [],
                               top_logprobs=[t.model_dump() for t in e.top_logprobs])
            for e in chat_logprobs(entries, texts, num_top)]


def finish_response(response: ResponseObject, items: list[OutputItem], finish_reason: str | None,
                    usage: ResponseUsage, completed_at: int) -> ResponseObject:
    """`response` with its output, usage and final status: 'incomplete' when the token limit cut it
    (`completed_at` is only set on a completed response, as OpenAI documents it)."""
    incomplete = finish_reason == "length"
    return response.model_copy(update={
        "output": items, "usage": usage, "completed_at": None if incomplete else completed_at,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": IncompleteDetails(reason="max_output_tokens") if incomplete else None})


class ResponseEventWriter:
    """Server-sent events of one streamed response, numbered by `sequence_number`."""

    def __init__(self, response: ResponseObject) -> None:
        """`response`: the in-progress response object (no output yet)."""
        self.response = response
        self.items: list[OutputItem] = []
        self._seq = 0
        self._open: OutputItem | None = None
        self._pending_logprobs: list[OutputTokenLogprob] = []

    def event(self, kind: str, **fields: Any) -> str:
        """One event: `event: <kind>` and its JSON data, with the next sequence number."""
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _response_event(self, kind: str) -> str:
        return self.event(kind, response=self.response.model_dump(mode="json"))

    def start(self) -> list[str]:
        """response.created and response.in_progress."""
        return [self._response_event("response.created"), self._response_event("response.in_progress")]

    def _item_event(self, kind: str, item: OutputItem) -> str:
        dump = item.model_dump(mode="json", exclude_none=True)
        if kind == "response.output_item.added" and not isinstance(item, FunctionCallItem):
            dump["content"] = []  # its part arrives with response.content_part.added; clients append it
        return self.event(kind, output_index=self.items.index(item), item=dump)

    def _open_item(self, item: OutputItem) -> list[str]:
        events = self._close_open()
        self.items.append(item)
        self._open = item
        events.append(self._item_event("response.output_item.added", item))
        if isinstance(item, ReasoningItem):
            events.append(self._part_event("response.content_part.added", item, {"type": "reasoning_text",
                                                                                  "text": ""}))
        elif isinstance(item, MessageItem):
            events.append(self._part_event("response.content_part.added", item, OutputText(
                text="", logprobs=item.content[0].logprobs).model_dump(mode="json")))
        return events

    def _part_event(self, kind: str, item: OutputItem, part: dict[str, Any]) -> str:
        return self.event(kind, item_id=item.id, output_index=self.items.index(item), content_index=0, part=part)

    def _close_open(self, status: str = "completed") -> list[str]:
        """Events closing the open item with `status` ('incomplete' when the token limit cut it)."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        events = []
        if isinstance(item, ReasoningItem):
            text = item.content[0].text
            events.append(self.event("response.reasoning_text.done", item_id=item.id, output_index=index,
                                     content_index=0, text=text))
            events.append(self._part_event("response.content_part.done", item, {"type": "reasoning_text",
                                                                                 "text": text}))
        elif isinstance(item, MessageItem):
            part = item.content[0]
            if part.logprobs is not None:
                # tokens with no text of their own (the end-of-turn token) are listed in the final text only
                part.logprobs.extend(self._pending_logprobs)
            self._pending_logprobs = []
            lps = [lp.model_dump() for lp in part.logprobs or []]
            events.append(self.event("response.output_text.done", item_id=item.id, output_index=index,
                                     content_index=0, text=part.text, logprobs=lps))
            events.append(self._part_event("response.content_part.done", item, part.model_dump(mode="json")))
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                     name=item.name, arguments=item.arguments))
        item.status = status  # type: ignore[assignment]
        events.append(self._item_event("response.output_item.done", item))
        return events

    def feed(self, delta: DeltaMessage | None, logprobs: list[OutputTokenLogprob] | None) -> list[str]:
        """Events for one chat delta; `logprobs`: those of the answer tokens it carries (None when not
        requested). Log-probabilities of tokens whose text is not out yet wait for the next answer delta."""
        events: list[str] = []
        if logprobs:
            self._pending_logprobs += logprobs
        if delta is None:
            return events
        if delta.reasoning_content:
            if not isinstance(self._open, ReasoningItem):
                events += self._open_item(ReasoningItem(content=[ReasoningText(text="")], status="in_progress"))
            item = self._open
            assert isinstance(item, ReasoningItem)
            item.content[0].text += delta.reasoning_content
            events.append(self.event("response.reasoning_text.delta", item_id=item.id,
                                     output_index=self.items.index(item), content_index=0,
                                     delta=delta.reasoning_content))
        if delta.content:
            if not isinstance(self._open, MessageItem):
                events += self._open_item(MessageItem(
                    content=[OutputText(text="", logprobs=[] if logprobs is not None else None)],
                    status="in_progress"))
            item = self._open
            assert isinstance(item, MessageItem)
            part = item.content[0]
            part.text += delta.content
            new_lps, self._pending_logprobs = self._pending_logprobs, []
            if part.logprobs is not None:
                part.logprobs.extend(new_lps)
            events.append(self.event("response.output_text.delta", item_id=item.id,
                                     output_index=self.items.index(item), content_index=0, delta=delta.content,
                                     logprobs=[lp.model_dump() for lp in new_lps]))
        for call in delta.tool_calls or []:
            fn = call.function
            if call.id is not None:
                events += self._open_item(FunctionCallItem(call_id=call.id, name=fn.name if fn and fn.name else "",
                                                           arguments="", status="in_progress"))
            item = self._open
            if isinstance(item, FunctionCallItem) and fn is not None and fn.arguments:
                item.arguments += fn.arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=item.id,
                                         output_index=self.items.index(item), delta=fn.arguments))
        return events

    def finish(self, finish_reason: str | None, usage: ResponseUsage, completed_at: int,
               unfinished_call: bool = False) -> tuple[list[str], ResponseObject]:
        """Close the open item and end with response.completed (or response.incomplete at the token
        limit); returns the events and the final response. `unfinished_call`: the generation ended inside a
        function call (at the limit, or at a stop string or EOS): that item is 'incomplete', so that sent back
        it is not taken for a call with valid arguments."""
        cut = finish_reason == "length" or (unfinished_call and isinstance(self._open, FunctionCallItem))
        events = self._close_open("incomplete" if cut else "completed")
        self.response = finish_response(self.response, self.items, finish_reason, usage, completed_at)
        kind = "response.incomplete" if self.response.status == "incomplete" else "response.completed"
        events.append(self._response_event(kind))
        return events, self.response

    def fail(self, code: str, message: str) -> str:
        """response.failed, for an error after the stream started; `code`: one of OpenAI's response error
        codes (`server_error` for the server's own failures)."""
        self.response = self.response.model_copy(update={"status": "failed", "output": self.items,
                                                         "error": ResponseError(code=code, message=message)})
        return self._response_event("response.failed")
