"""Pydantic models of OpenAI's Responses API (POST /v1/responses): the request, and the response object with
its output items (reasoning, message, function_call) as the openai SDK parses them.

The request keeps `input`, `tools` and `tool_choice` as plain JSON: responses_items.py checks them item by
item, so that an error names the item (`input[3].content[0].type`). Fields that would change the result but
that nibble cannot honour are refused by name (`conversation`, `prompt`, `background`, `truncation: "auto"`);
hints that change nothing (service_tier, prompt_cache_key, safety_identifier, reasoning.summary,
max_tool_calls) are declared and accepted; any other field is accepted and logged as ignored (`parse_model`).
`stream` and `store` may be null, as the openai SDK types them: null means the default.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from nibble.server.protocol import MAX_STOP_STRINGS, SharedSamplingFields, no_reserved_template_kwargs

# `include` values of OpenAI's API. Only the logprobs one changes the output here; the others ask for the
# results of hosted tools (refused in `tools`) or for encrypted reasoning, which nibble does not produce: its
# reasoning items carry the reasoning as plain text, which a client sends back as it is.
INCLUDE_LOGPROBS = "message.output_text.logprobs"
KNOWN_INCLUDES = (
    INCLUDE_LOGPROBS,
    "reasoning.encrypted_content",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "web_search_call.action.sources",
    "web_search_call.results",
)

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def response_id(prefix: str) -> str:
    """An id in OpenAI's Responses style: `resp_<hex>`, `msg_<hex>`, `rs_<hex>`, `fc_<hex>`."""
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(SharedSamplingFields):
    """POST /v1/responses. `input`: a string (one user message) or a list of items; `instructions`: a system
    message put first. The sampling fields /v1/chat/completions takes (SharedSamplingFields: top_k, min_p,
    penalties, seed, logit_bias, structured_outputs, allowed_token_ids, bad_words...), `stop`,
    `include_reasoning` and `chat_template_kwargs` are accepted too and mean what they mean there."""

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_logprobs: int | None = Field(default=None, ge=0)
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    conversation: Any = None
    prompt: Any = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: bool | None = None
    # nibble has one service tier; the hint changes nothing
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # OpenAI routes requests with the same key to the same cache; nibble's prefix cache matches any request's
    # prompt by its tokens, without a key, so the key changes nothing (it is echoed in the response)
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # counts calls of hosted tools only (web search, file search...), which `tools` refuses: with function tools
    # there is nothing to limit, so any value is honoured as it is (and echoed)
    max_tool_calls: int | None = Field(default=None, ge=0)
    # false: the reasoning is still generated (and counted in usage), but the response and its stream leave
    # the reasoning item out, as /v1/chat/completions leaves reasoning_content out
    include_reasoning: bool = True
    stop: str | list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _string_or_items(cls, v: Any) -> Any:
        # Checked before the union so that the error names `input`, not the union member (`input.str`).
        if not isinstance(v, (str, list)):
            raise ValueError("must be a string or a list of input items")
        return v

    @field_validator("stream", "store", mode="before")
    @classmethod
    def _null_is_default(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None:
            return cls.model_fields[info.field_name or ""].default
        return v

    @field_validator("conversation")
    @classmethod
    def _no_conversation(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("conversations are not supported; send the earlier items in input, or continue "
                             "with previous_response_id")
        return v

    @field_validator("prompt")
    @classmethod
    def _no_prompt_template(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("stored prompt templates are not supported; send instructions and input instead")
        return v

    @field_validator("input")
    @classmethod
    def _non_empty_input(cls, v: str | list[Any]) -> str | list[Any]:
        if isinstance(v, list) and not v:
            raise ValueError("must not be an empty list")
        return v

    @field_validator("include")
    @classmethod
    def _known_includes(cls, v: list[str] | None) -> list[str] | None:
        for value in v or []:
            if value not in KNOWN_INCLUDES:
                raise ValueError(f"unknown value {value!r}; known values: {', '.join(KNOWN_INCLUDES)}")
        return v

    @field_validator("reasoning")
    @classmethod
    def _known_effort(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        effort = (v or {}).get("effort")
        if effort is not None and effort not in REASONING_EFFORTS:
            raise ValueError(f"effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}")
        return v

    @field_validator("metadata")
    @classmethod
    def _small_metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None and len(v) > 16:
            raise ValueError(f"at most 16 keys, got {len(v)}")
        for key, value in (v or {}).items():
            if len(key) > 64 or len(value) > 512:
                raise ValueError(f"key {key[:64]!r}: keys are at most 64 characters, values at most 512")
        return v

    @field_validator("truncation")
    @classmethod
    def _no_auto_truncation(cls, v: str | None) -> str | None:
        if v == "auto":
            raise ValueError("'auto' (dropping input items to fit the context) is not supported; use 'disabled'")
        return v

    @field_validator("background")
    @classmethod
    def _no_background(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("background responses are not supported")
        return v

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(v)}")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return no_reserved_template_kwargs(v)

    @property
    def wants_logprobs(self) -> bool:
        """Whether output_text parts carry token log-probabilities."""
        return INCLUDE_LOGPROBS in (self.include or []) or self.top_logprobs is not None

    @property
    def thinking_off(self) -> bool:
        """`reasoning.effort` "none": the prompt closes the think block (Qwen3.5 has no finer effort levels)."""
        return (self.reasoning or {}).get("effort") == "none"


class OutputTokenLogprob(BaseModel):
    """One token of an output_text part: text, log-probability, UTF-8 bytes and the top alternatives."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class OutputText(BaseModel):
    """The text part of an assistant message item."""

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[OutputTokenLogprob] | None = None


class ReasoningText(BaseModel):
    """The reasoning of a reasoning item, as plain text."""

    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """What the model thought before it answered (Qwen3.5's think block)."""

    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: response_id("rs"))
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class MessageItem(BaseModel):
    """The assistant's answer."""

    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: response_id("msg"))
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    """A call of one of the request's function tools; `arguments` is a JSON object as a string."""

    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: response_id("fc"))
    call_id: str
    name: str
    arguments: str = ""
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = ReasoningItem | MessageItem | FunctionCallItem


class InputTokensDetails(BaseModel):
    """`cached_tokens`: prompt tokens served from the prefix cache. `cache_write_tokens` (OpenAI's billing of
    explicit cache writes) is always 0 here, but the openai SDK's type requires it."""

    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    """Token counts: input (prompt, of which `cached_tokens` came from the prefix cache) and output (of which
    `reasoning_tokens` were thinking)."""

    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """The response object: returned by POST (non-streaming), carried by the stream's lifecycle events, and
    returned by GET /v1/responses/{id} when stored."""

    id: str = Field(default_factory=lambda: response_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    instructions: str | None = None
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tools: list[Any] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    truncation: str = "disabled"
    store: bool = True
    background: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    usage: ResponseUsage | None = None

    @property
    def output_text(self) -> str:
        """The text of all message items, as the openai SDK's `Response.output_text` joins it."""
        return "".join(part.text for item in self.output if isinstance(item, MessageItem) for part in item.content)
