"""Pydantic models of what the OpenAI-compatible endpoints answer: usage, logprobs, completion and chat
completion responses and their stream chunks, tool calls, model cards and the error body. The request models
are in protocol.py, which re-exports these names."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field


def random_id(prefix: str) -> str:
    """A response id such as 'chatcmpl-<32 hex>' or 'cmpl-<32 hex>'."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    """`usage.prompt_tokens_details`: cached_tokens, the prompt tokens served from the prefix cache."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts of a response."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(BaseModel):
    """Legacy completions logprobs: parallel lists per generated token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class ChatCompletionLogProb(BaseModel):
    """One candidate token: its text, log-probability and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    """A generated token with its most likely alternatives."""

    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    """Chat logprobs: one entry per generated token."""

    content: list[ChatCompletionLogProbsContent] | None = None


FinishReason = Literal["stop", "length", "tool_calls", "abort"]


class PromptLogprob(BaseModel):
    """vLLM's entry of `prompt_logprobs`: a token's log-probability, vocabulary rank and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionResponseChoice(BaseModel):
    """One choice of a /v1/completions response."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: FinishReason | None = None
    # vLLM extra: the stop string or stop token id that ended the choice.
    stop_reason: int | str | None = None
    # vLLM extra (request field `prompt_logprobs`): per prompt token {token id: entry}, null for the first.
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    """Non-streaming /v1/completions response."""

    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(BaseModel):
    """One choice of a streamed /v1/completions chunk."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class CompletionStreamResponse(BaseModel):
    """A streamed /v1/completions chunk; the usage chunk has no choices."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseStreamChoice] = Field(default_factory=list)
    usage: UsageInfo | None = None


class FunctionCall(BaseModel):
    """A complete function call: name and JSON-encoded arguments."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """A complete tool call in a chat message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    """Part of a function call in a stream: the name arrives first, then argument fragments."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A tool-call delta; `id` and `type` come only with the first delta of each call."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatMessage(BaseModel):
    """The assistant message of a non-streaming chat response."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class DeltaMessage(BaseModel):
    """A streamed chat delta. Serialise with `exclude_none=True` so absent parts are left out."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseChoice(BaseModel):
    """One choice of a non-streaming chat response."""

    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """Non-streaming /v1/chat/completions response."""

    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    # vLLM extra (request field `prompt_logprobs`): as in a completions choice, for the rendered prompt
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class ChatCompletionResponseStreamChoice(BaseModel):
    """One choice of a streamed chat chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    """A streamed /v1/chat/completions chunk; the usage chunk has no choices."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseStreamChoice] = Field(default_factory=list)
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    """An entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "nibble"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class ErrorInfo(BaseModel):
    """The body of an OpenAI error."""

    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """`{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


def error_response(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: int | str | None = 400
) -> ErrorResponse:
    """Build an `ErrorResponse`; `code` is the HTTP status by default, as vLLM reports it."""
    return ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
