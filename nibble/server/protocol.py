"""Pydantic models of the requests of the OpenAI-compatible API that nibble serves (/v1/completions,
/v1/chat/completions), including the sampling extras vLLM clients send (top_k, min_p, repetition_penalty, ...).
The models of the answers are in response_models.py; their names are re-exported here.

Requests accept unknown fields, because OpenAI SDKs and agent frameworks send many; `parse_model`
(serving_base.py) logs the ones it drops. Values nibble cannot honour are rejected with a message naming the
field rather than silently ignored. `format_validation_error`, which turns a pydantic `ValidationError` into
one readable message for an HTTP 400 `ErrorResponse`, is in validation_errors.py; it is re-exported here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from nibble.engine.sampling_params import MAX_STOP_TOKEN_IDS
from nibble.server.response_models import (  # noqa: F401  (re-exported: the names importers know from here)
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ErrorInfo,
    ErrorResponse,
    FinishReason,
    FunctionCall,
    ModelCard,
    ModelList,
    PromptLogprob,
    PromptTokensDetails,
    ToolCall,
    UsageInfo,
    error_response,
    random_id,
)
from nibble.server.validation_errors import format_validation_error  # noqa: F401  (re-exported)

# Template inputs that have their own request fields (and parameters of `Tokenizer.apply_chat_template`).
_RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt", "continue_final_message")

# Every stop string is searched for after every generated token, on the engine thread that serves all
# requests: an unbounded list (100k strings added ~60 ms to each step of every request) is refused.
MAX_STOP_STRINGS = 256
# Choices per request (`n`): each is its own engine request, so this bounds what one request can occupy.
MAX_CHOICES = 64


def no_reserved_template_kwargs(v: dict[str, Any] | None) -> dict[str, Any] | None:
    """Validator of `chat_template_kwargs`: the keys that have request fields of their own are refused, and
    so is an `enable_thinking` other than true, false or null (the template would take "false" or 0 for on)."""
    for key in _RESERVED_TEMPLATE_KWARGS:
        if v and key in v:
            raise ValueError(f"{key!r} cannot be set here; use the request field of that name")
    thinking = (v or {}).get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise ValueError(f"enable_thinking must be true or false, got {thinking!r}")
    return v


_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# vLLM options that change nothing here: the JSON grammar never allows free whitespace, and there is no
# other backend to fall back to
_IGNORED_STRUCTURED_KEYS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties")


class ConflictingConstraints(ValueError):
    """More than one structured-output field of a request sets a constraint; `fields` names them, in the
    order `_SamplingRequest.structured_spec` reads them."""

    def __init__(self, fields: list[str]) -> None:
        super().__init__("only one output constraint per request; got " + ", ".join(fields))
        self.fields = tuple(fields)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    """`stream_options`: `include_usage` adds a final chunk with token counts."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SharedSamplingFields(_Request):
    """Sampling fields that every generating endpoint takes under the same name and with the same meaning
    (vLLM's extras among them). /v1/responses and /v1/messages declare them by inheriting this class and pass
    them on as they are to the chat request they amount to (SHARED_SAMPLING_FIELDS), so that a field added
    here reaches every endpoint."""

    # -1 and 0 both mean "off", as in vLLM.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    # vLLM: prefix-cache entries are shared only among requests with the same salt (one per tenant)
    cache_salt: str | None = Field(default=None, min_length=1)
    # vLLM: lower is served first under --scheduling-policy priority; anything but 0 is refused under fcfs
    priority: int = Field(default=0, strict=True)
    # vLLM's spelling of an output constraint (see _SamplingRequest.structured_spec for the others)
    structured_outputs: dict[str, Any] | None = None
    # vLLM extras: only these tokens may be sampled; words the output must not contain (nibble/engine/
    # token_masks.py)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM extra: at most this many tokens of thinking before `</think>` is forced (nibble/engine/thinking_budget.py)
    thinking_token_budget: int | None = Field(default=None, ge=0)

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.strip().isdecimal():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"values must be in [-100, 100], got {bias} for token {key}")
        return v

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and not v:
            raise ValueError("must not be empty (leave it out to allow every token)")
        if v and any(i < 0 for i in v):
            raise ValueError("token ids must be non-negative")
        return v

    @field_validator("structured_outputs")
    @classmethod
    def _known_constraints(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        for key, value in (v or {}).items():
            if key in _IGNORED_STRUCTURED_KEYS:
                continue
            if key not in _STRUCTURED_KEYS:
                if value in (None, False):
                    continue
                raise ValueError(f"{key!r} is not supported; use one of {', '.join(_STRUCTURED_KEYS)}")
        return v


SHARED_SAMPLING_FIELDS = tuple(SharedSamplingFields.model_fields)


class _SamplingRequest(SharedSamplingFields):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    user: str | None = None
    # structured outputs, three spellings: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields (structured_spec)
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM extra: the client's id of the request (request_ids.py), as an X-Request-Id header also gives it
    request_id: str | None = None
    # vLLM extras: keep only the last k prompt tokens (-1: max_model_len); logprobs name tokens "token_id:<id>"
    truncate_prompt_tokens: int | None = None
    return_tokens_as_token_ids: bool | None = None

    @field_validator("n")
    @classmethod
    def _choice_count(cls, v: int) -> int:
        if not 1 <= v <= MAX_CHOICES:
            raise ValueError(f"must be between 1 and {MAX_CHOICES}, got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(v)}")
        for s in [v] if isinstance(v, str) else v or []:
            if not s:
                raise ValueError("stop strings must not be empty")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _valid_stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v and any(i < 0 for i in v):
            raise ValueError("token ids must be non-negative")
        if v and len(v) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids are allowed, got {len(v)}")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation(cls, v: int | None) -> int | None:
        if v is not None and v < 1 and v != -1:
            raise ValueError(f"must be >= 1, or -1 for the model's maximum length, got {v}")
        return v

    @field_validator("response_format")
    @classmethod
    def _known_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        kind = v.get("type", "text")
        if kind not in ("text", "json_object", "json_schema", "structural_tag"):
            raise ValueError(f"type must be 'text', 'json_object', 'json_schema' or 'structural_tag', got {kind!r}")
        if kind == "json_schema":
            spec = v.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
                raise ValueError("type 'json_schema' needs json_schema.schema, a JSON schema object")
        return v

    def structured_spec(self) -> tuple[str, dict[str, Any]] | None:
        """The request's output constraint as (field name, `StructuredOutputsParams` keyword arguments), or
        None. Raises ConflictingConstraints when several fields set one."""
        found: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format or {}
        if fmt.get("type") == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif fmt.get("type") == "json_schema":
            found.append(("response_format", {"json": fmt["json_schema"]["schema"]}))
        elif fmt.get("type") == "structural_tag":  # checked where it compiles (engine/structural_tag.py)
            found.append(("response_format", {"structural_tag": fmt}))
        so = {k: v for k, v in (self.structured_outputs or {}).items()
              if k in _STRUCTURED_KEYS and v not in (None, False)}
        if so:
            found.append(("structured_outputs", so))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                found.append((name, {key: value}))
        if len(found) > 1:
            raise ConflictingConstraints([n for n, _ in found])
        return found[0] if found else None

    @property
    def logit_bias_ids(self) -> dict[int, float] | None:
        """`logit_bias` keyed by integer token id (None when unset or empty)."""
        return {int(k): float(b) for k, b in self.logit_bias.items()} if self.logit_bias else None

    @property
    def stop_list(self) -> list[str]:
        """`stop` as a list (empty when unset)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    # logprobs fields have no upper bound here: it is the engine's --max-logprobs (OpenAIServing.sampling_params)
    logprobs: int | None = Field(default=None, ge=0)
    # vLLM extra: log-probabilities of the prompt tokens (and this many alternatives), as vLLM returns them
    prompt_logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty_prompt(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("must not be an empty list")
            for p in v:
                ids = p if isinstance(p, list) else [p] if isinstance(p, int) else []
                if isinstance(p, list) and not p:
                    raise ValueError("token-id prompts must not be empty")
                if any(i < 0 for i in ids):
                    raise ValueError("token ids must be non-negative")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError(f"only best_of=1 is supported, got {v}")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("not supported")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each entry a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions. Messages and tools stay plain dicts (checked by the chat template layer),
    so they reach the template with the client's keys and key order."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    # vLLM/transformers: generation continues the final (assistant) message instead of starting a new turn
    continue_final_message: bool = False
    include_reasoning: bool = True
    # vLLM extra: log-probabilities of the prompt tokens, returned as the response's top-level prompt_logprobs
    prompt_logprobs: int | None = Field(default=None, ge=0)
    # OpenAI's chat field: "none" turns Qwen3.5's thinking off (enable_thinking false), as reasoning.effort does
    # on /v1/responses; the other levels leave it on, Qwen3.5 has no finer ones
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None

    @field_validator("tool_choice")
    @classmethod
    def _supported_tool_choice(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if v is None or v in ("auto", "none", "required"):
            return v
        if isinstance(v, dict):
            function = v.get("function")
            if v.get("type") != "function" or not isinstance(function, dict) or \
                    not isinstance(function.get("name"), str):
                raise ValueError('a named tool choice is {"type": "function", "function": {"name": ...}}')
            return v
        raise ValueError(f"must be 'auto', 'none', 'required' or a named function, got {v!r}")

    @property
    def forced_tool(self) -> tuple[bool, str | None]:
        """(whether tool_choice forces a tool call, the function it names or None for any)."""
        if self.tool_choice == "required":
            return True, None
        if isinstance(self.tool_choice, dict):
            return True, self.tool_choice["function"]["name"]
        return False, None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return no_reserved_template_kwargs(v)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("requires logprobs=true")
        return v

    @property
    def max_new_tokens(self) -> int | None:
        """`max_completion_tokens`, falling back to the older `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def enable_thinking(self) -> bool:
        """Whether the prompt opens a think block: `chat_template_kwargs.enable_thinking`, default true."""
        kwargs = self.chat_template_kwargs or {}
        return kwargs.get("enable_thinking") is not False

    @property
    def tools_for_template(self) -> list[dict[str, Any]] | None:
        """The tools to render in the prompt (none when `tool_choice` is 'none')."""
        return None if self.tool_choice == "none" else self.tools

