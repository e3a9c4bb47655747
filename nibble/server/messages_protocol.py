"""Pydantic models of Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens): the request,
the message object with its content blocks (thinking, text, tool_use) as the anthropic SDK parses them, and
Anthropic's error body.

The request keeps `messages`, `system`, `tools`, `tool_choice` and `thinking` as plain JSON: messages_items.py
checks them block by block, so that an error names the block (`messages[2].content[0].type`). Fields that
would change the result but that nibble cannot honour are refused by name; hints that change nothing here
(metadata, service_tier, speed, inference_geo, cache_control) are declared and accepted; any other field is
accepted and logged as ignored (`parse_model`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nibble.server.errors import APIError
from nibble.server.protocol import MAX_STOP_STRINGS, SharedSamplingFields, no_reserved_template_kwargs

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors); any other 5xx is an api_error.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def message_id() -> str:
    """A message id in Anthropic's style: `msg_<hex>`."""
    return f"msg_{uuid.uuid4().hex}"


class AnthropicError(APIError):
    """An `APIError` rendered as Anthropic's error body, `{"type": "error", "error": {"type", "message"}}`, and
    in a stream as an `event: error`. The HTTP status is kept; the OpenAI `param` only renames the message's
    leading field (see `of`)."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: int | str | None = None) -> None:
        super().__init__(status, message, type=type, param=param, code=code)
        if type is None:
            # An overloaded engine is Anthropic's overloaded_error, though nibble answers it with 503 (not 529).
            overloaded = code == "server_overloaded"
            self.type = "overloaded_error" if overloaded else _ERROR_TYPES.get(
                status, "api_error" if status >= 500 else "invalid_request_error")

    @classmethod
    def of(cls, err: APIError, params: dict[str, str] | None = None) -> AnthropicError:
        """`err` as an Anthropic error; `params` renames the chat field a message starts with ('stop: ...' ->
        'stop_sequences: ...'), for errors raised by the chat machinery a Messages request goes through."""
        if isinstance(err, AnthropicError):
            return err
        message, param = err.message, err.param
        name = (params or {}).get(param or "")
        if name is not None and param is not None:
            if message.startswith(f"{param}:") or message.startswith(f"{param} "):
                message = name + message[len(param):]
            param = name
        return cls(err.status, message, param=param, code=err.code)

    def body(self) -> dict[str, Any]:
        """Anthropic's error body."""
        return {"type": "error", "error": {"type": self.type, "message": self.message}}

    def sse_event(self) -> str:
        """The error as Anthropic's `error` stream event."""
        return f"event: error\ndata: {json.dumps(self.body(), ensure_ascii=False)}\n\n"


def invalid_request(message: str, param: str | None = None) -> AnthropicError:
    """An HTTP 400 invalid_request_error in Anthropic's shape."""
    return AnthropicError(400, message, param=param)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CountTokensRequest(_Request):
    """POST /v1/messages/count_tokens: what a Messages request renders into a prompt."""

    model: str
    messages: list[Any] = Field(min_length=1)
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    # Anthropic's prompt caching (a breakpoint for the whole request) and its faster output mode: nibble caches
    # every prompt's prefix without being asked and has one speed, so both change nothing
    cache_control: dict[str, Any] | None = None
    speed: Literal["standard", "fast"] | None = None
    # nibble extras (vLLM accepts these on /v1/messages too)
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return no_reserved_template_kwargs(v)


class MessagesRequest(CountTokensRequest, SharedSamplingFields):
    """POST /v1/messages. Besides Anthropic's fields, the sampling fields nibble's other endpoints take
    (SharedSamplingFields: min_p, penalties, seed, ignore_eos, logit_bias, structured_outputs,
    allowed_token_ids, bad_words, cache_salt, priority...) are accepted and mean what they mean there."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    # Anthropic's range: "off" is leaving it out (vLLM's -1, which the chat field takes, is refused here)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None
    # nibble has one service tier and serves where it runs: hints that change nothing
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _bounded_stops(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences, got {len(v)}")
        if v is not None and not all(v):
            raise ValueError("stop sequences must not be empty")
        return v


class TextBlock(BaseModel):
    """The answer."""

    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(BaseModel):
    """What the model thought before it answered (Qwen3.5's think block). `signature` is empty: nibble does not
    sign its reasoning, and a client sends the block back as it is."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseBlock(BaseModel):
    """A call of one of the request's tools; `input` is the arguments as a JSON object."""

    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


ContentBlock = ThinkingBlock | TextBlock | ToolUseBlock

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"]


class MessagesUsage(BaseModel):
    """Token counts, as Anthropic splits them: the prompt is `input_tokens` + `cache_read_input_tokens` (the
    prompt tokens served from the prefix cache) + `cache_creation_input_tokens` (always 0: nibble caches every
    prompt without being asked, at no extra cost)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageObject(BaseModel):
    """The response of POST /v1/messages (without streaming), and the skeleton `message_start` carries."""

    id: str = Field(default_factory=message_id)
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock] = Field(default_factory=list)
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage


class TokenCount(BaseModel):
    """The response of POST /v1/messages/count_tokens."""

    input_tokens: int
