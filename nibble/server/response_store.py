"""In-memory store of finished Responses API responses, for `previous_response_id`, GET /v1/responses/{id}
and its input_items.

Each stored response keeps the whole conversation it answered (every earlier turn's items, then its own
input), so a chain keeps working after its older responses were evicted: the store holds at most
`max_responses` responses and forgets the least recently used. Items are shared between the responses of a
chain, not copied.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from nibble.server.responses_items import items_as_input
from nibble.server.responses_protocol import ResponseObject, response_id

# What `nibble serve` keeps by default. Each response holds references to its conversation's items (shared along
# a chain, not copied), so even long agent sessions stay within a few hundred MB.
DEFAULT_MAX_STORED_RESPONSES = 1000

_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


@dataclass(frozen=True)
class StoredResponse:
    """A finished response and the input items it answered (earlier turns included)."""

    response: ResponseObject
    input_items: list[dict[str, Any]]

    def continuation(self) -> list[dict[str, Any]]:
        """The items a follow-up response starts from: this response's input, then its output."""
        return [*self.input_items, *items_as_input(self.response.output)]


def input_items_with_ids(items: str | list[Any]) -> list[dict[str, Any]]:
    """A request's (already checked) `input` as a list of items, each with an `id` (given, or a new one), for
    input_items. A message's string content becomes one text part, and a message gets a status, as the openai
    SDK's item types require; the chat messages the items make are the same."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    out = []
    for item in items:
        item = dict(item)
        if "id" not in item:
            item["id"] = response_id(_ID_PREFIXES.get(item.get("type", "message"), "item"))
        if "type" not in item:
            item["type"] = "message"
        if item["type"] == "message":
            if isinstance(item.get("content"), str):
                item["content"] = [_text_part(item.get("role"), item["content"])]
            item.setdefault("status", "completed")
        out.append(item)
    return out


def _text_part(role: Any, text: str) -> dict[str, Any]:
    if role == "assistant":
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "input_text", "text": text}


class ResponseStore:
    """Bounded LRU store of responses by id; `max_responses` 0 stores nothing."""

    def __init__(self, max_responses: int) -> None:
        if max_responses < 0:
            raise ValueError(f"max_responses must be >= 0, got {max_responses}")
        self.max_responses = max_responses
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, response: ResponseObject, input_items: list[dict[str, Any]]) -> None:
        """Store `response` (which answered `input_items`), evicting the least recently used beyond the bound."""
        if not self.enabled:
            return
        self._responses[response.id] = StoredResponse(response, input_items)
        self._responses.move_to_end(response.id)
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def get(self, rid: str) -> StoredResponse | None:
        """The stored response `rid`, or None (never stored, evicted or deleted)."""
        stored = self._responses.get(rid)
        if stored is not None:
            self._responses.move_to_end(rid)
        return stored

    def delete(self, rid: str) -> bool:
        """Forget `rid`; False when it was not stored."""
        return self._responses.pop(rid, None) is not None
