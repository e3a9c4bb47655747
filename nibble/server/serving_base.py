"""What the completion, chat, responses and messages handlers share (their request bodies are read by
request_body.py): model-name check, sampling parameters (with the model's generation_config defaults),
context-length checks, disconnect-aware waiting, metrics and the one log line per request."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from nibble.engine.async_engine import AsyncEngine, EngineDead
from nibble.engine.chat_template import ChatTemplateError
from nibble.engine.llm_engine import LLMEngine
from nibble.engine.request import RequestOutput
from nibble.engine.sampling_params import SEED_MAX, SEED_MIN, SamplingParams, SamplingParamsError, truncate_prompt
from nibble.engine.structured_output import StructuredOutputError, StructuredOutputsParams
from nibble.models.multimodal import ImageInputs, VideoInputs, take_media
from nibble.server.engine_streams import EngineJob, EngineStreams
from nibble.server.errors import APIError, ClientDisconnected, bad_request, from_engine_error
from nibble.server.metrics import ServerMetrics
from nibble.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ConflictingConstraints,
    PromptTokensDetails,
    StreamOptions,
    UsageInfo,
)
from nibble.server.reasoning import THINK_END
from nibble.server.token_text import TokenTexts

logger = logging.getLogger("nibble.server")

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

# HTTP status logged (never seen by anyone) when the client left before the response was ready.
CLIENT_CLOSED = 499

# How often a non-streaming handler checks whether its client is still connected.
DISCONNECT_POLL_S = 0.2


async def wait_unless_disconnected(awaitable: Awaitable[T], request: Request) -> T:
    """Await `awaitable` in a task, cancelling it (and raising ClientDisconnected) if the client leaves."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()


def json_response(model: Any, status: int = 200) -> Response:
    """A pydantic model as a JSON response."""
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def usage_of(outputs: list[RequestOutput | None], prompt_lens: list[int]) -> UsageInfo:
    """Token counts summed over the prompts of one request."""
    prompt = sum(prompt_lens)
    completion = sum(len(o.outputs[0].token_ids) for o in outputs if o is not None)
    cached = sum(o.num_cached_tokens for o in outputs if o is not None)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def check_generation_error(out: RequestOutput) -> None:
    """Raise a 500 for a request the engine ended with finish_reason 'error' (e.g. non-finite logits)."""
    if out.outputs[0].finish_reason == "error":
        raise APIError(500, out.error or "generation failed", code="generation_error")


def leaves_thinking(prompt: str, template_kwargs: dict[str, Any]) -> bool:
    """Whether a rendered chat prompt leaves the model inside its think block (thinking not turned off, and no
    closed think block at the prompt's end), so that its output starts with reasoning."""
    return template_kwargs.get("enable_thinking") is not False and not prompt.rstrip().endswith(THINK_END)


def engine_core(engine: AsyncEngine) -> LLMEngine:
    """The synchronous engine behind `engine` (tokenizer, max_model_len, config...)."""
    return engine.engine


class OpenAIServing:
    """Base of the two endpoint handlers; holds the engine, the served names and the metrics."""

    def __init__(self, engine: AsyncEngine, served_model_name: str, accepted_names: set[str],
                 metrics: ServerMetrics, default_template_kwargs: Mapping[str, Any] | None = None,
                 force_include_usage: bool = False) -> None:
        """`accepted_names`: model names a request may give (the served name, the model path...).
        `default_template_kwargs`: chat template kwargs every chat request gets unless it sets them itself
        (vLLM's --default-chat-template-kwargs, e.g. {"enable_thinking": false}). `force_include_usage`: every
        stream ends with a usage chunk, as if it asked for one (vLLM's --enable-force-include-usage)."""
        self.engine = engine
        self.force_include_usage = force_include_usage
        self.default_template_kwargs = dict(default_template_kwargs or {})
        self.core = engine_core(engine)
        self.served_model_name = served_model_name
        self.accepted_names = accepted_names
        self.metrics = metrics
        self.tokenizer = self.core.tokenizer
        self.token_texts = TokenTexts(self.tokenizer) if self.tokenizer is not None else None
        self.max_model_len = self.core.max_model_len
        defaults = self.core.generation_defaults.sampling_overrides()
        self.default_max_new_tokens: int | None = defaults.pop("max_new_tokens", None)
        self.sampling_defaults: dict[str, Any] = defaults
        self._background: set[asyncio.Task[None]] = set()

    def usage_default(self, req: M) -> M:
        """`req` with `stream_options.include_usage` turned on for a stream when the server forces usage."""
        if self.force_include_usage and getattr(req, "stream", False) and not getattr(req, "include_usage", True):
            options = req.stream_options or StreamOptions()  # type: ignore[attr-defined]
            req.stream_options = options.model_copy(update={"include_usage": True})  # type: ignore[attr-defined]
        return req

    def check_model(self, name: str | None) -> None:
        """404 model_not_found unless `name` is absent or one of the accepted names."""
        if name is not None and name not in self.accepted_names:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{self.served_model_name}'", param="model", code="model_not_found")

    def require_tokenizer(self) -> None:
        """400 when the model came without a tokenizer (only token-id prompts can work then)."""
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: send token ids as the prompt", param="prompt")

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    add_generation_prompt: bool, template_kwargs: dict[str, Any],
                    continue_final_message: bool = False) -> tuple[str, list[int]]:
        """The chat template's prompt text for `messages` and its token ids; a template error is a 400 naming
        `tools`, `messages` or `continue_final_message`. Every chat endpoint renders through here, so this is
        where the server's default template kwargs join the request's: `template_kwargs` is completed in place
        (the request's own values win), so that what the caller reads from it afterwards (leaves_thinking) is
        what the template saw."""
        assert self.tokenizer is not None
        for key, value in self.default_template_kwargs.items():
            template_kwargs.setdefault(key, value)
        try:
            prompt = self.tokenizer.apply_chat_template(messages, tools=tools,
                                                        add_generation_prompt=add_generation_prompt,
                                                        continue_final_message=continue_final_message,
                                                        **template_kwargs)
        except ChatTemplateError as exc:
            message = str(exc)
            param = next((p for p in ("tools", "continue_final_message") if message.startswith(p)), "messages")
            raise bad_request(message, param=param) from None
        return prompt, self.tokenizer.encode(prompt)

    async def render_chat_with_images(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                                      add_generation_prompt: bool, template_kwargs: dict[str, Any],
                                      continue_final_message: bool = False
                                      ) -> tuple[str, list[int], ImageInputs | None, VideoInputs | None]:
        """`render_chat`, off the event loop, for messages that may hold image and video parts (image_url,
        video_url): each becomes the template's placeholder, expanded after tokenizing (an image's to its token
        count, a video's to its frames' timestamps and placeholders), and the images and videos are fetched (an
        http(s):// or file:// URL, under the engine's media policy: engine/media.py), decoded and preprocessed.
        Returns (prompt text, token ids, images or None, videos or None). A template error is render_chat's
        400; a bad image or video, a URL that cannot be fetched or a model without a vision tower raises
        RequestError (its message names the URL and the reason), which the caller names by its own field."""
        messages, raw_images, raw_videos = take_media(messages)
        prompt, ids = await asyncio.to_thread(self.render_chat, messages, tools, add_generation_prompt,
                                              template_kwargs, continue_final_message)
        if not raw_images and not raw_videos:
            return prompt, ids, None, None
        ids, images, videos = await asyncio.to_thread(self.core.prepare_media, ids, raw_images, raw_videos)
        return prompt, ids, images, videos

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, param: str,
                     max_param: str = "max_tokens") -> None:
        """400 when the prompt (plus an explicit max_tokens) does not fit the context window."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise bad_request(f"this model's maximum context length is {limit} tokens, but the prompt has "
                              f"{num_prompt_tokens} tokens, leaving no room to generate; shorten the prompt",
                              param=param)
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise bad_request(f"this model's maximum context length is {limit} tokens; the prompt has "
                              f"{num_prompt_tokens} tokens and {max_param} asks for {max_tokens} more "
                              f"({num_prompt_tokens + max_tokens} in all); shorten the prompt or lower "
                              f"{max_param}", param=max_param)

    async def structured_outputs(self, req: CompletionRequest | ChatCompletionRequest, after_reasoning: bool = False,
                                 tool_grammar: str | None = None) -> StructuredOutputsParams | None:
        """The request's output constraint (None without one), compiled once against the tokenizer here, off
        the event loop, so that a bad schema, regex or grammar is a 400 naming its field. after_reasoning:
        the chat prompt leaves the model thinking; the constraint then starts after its `</think>`.
        tool_grammar: the grammar of a forced tool call (tool_grammar.py), which excludes the other kinds."""
        try:
            spec = req.structured_spec()
        except ConflictingConstraints as exc:
            raise bad_request(str(exc), param=", ".join(exc.fields)) from None
        if tool_grammar is not None:
            if spec is not None:
                raise bad_request(f"tool_choice cannot force a tool call together with {spec[0]}", param="tool_choice")
            spec = ("tool_choice", {"grammar": tool_grammar})
        if spec is None:
            return None
        name, kwargs = spec
        self.require_tokenizer()
        assert self.tokenizer is not None
        start = self.tokenizer.token_to_id(THINK_END) if after_reasoning else None
        try:
            params = StructuredOutputsParams(**kwargs, start_token_id=start)
            await asyncio.to_thread(self.core.structured_output_backend().compile, params)
        except StructuredOutputError as exc:
            raise bad_request(f"{name}: {exc}", param=name) from None
        return params

    def sampling_params(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                        logprobs: int | None, structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """SamplingParams for one prompt: the request's values, else the model's generation_config
        defaults for the fields it leaves unset, else the engine defaults."""
        values: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(req, name)
            if value is None:
                value = self.sampling_defaults.get(name)
            if value is not None:
                values[name] = value
        if req.seed is not None and not SEED_MIN <= req.seed <= SEED_MAX:
            raise bad_request(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {req.seed}", param="seed")
        # checked here, not left to the engine, so that the 400 names this endpoint's field
        self.check_logprobs(logprobs, "logprobs" if isinstance(req, CompletionRequest) else "top_logprobs")
        self.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
        try:
            params = SamplingParams(
                **values, seed=req.seed, stop=req.stop_list, stop_token_ids=list(req.stop_token_ids or []),
                max_tokens=max_tokens, min_tokens=req.min_tokens, logprobs=logprobs, ignore_eos=req.ignore_eos,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output, logit_bias=req.logit_bias_ids,
                structured_outputs=structured, cache_salt=req.cache_salt, priority=req.priority,
                allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
                thinking_token_budget=req.thinking_token_budget)
            self.core.check_priority(params)
        except SamplingParamsError as exc:
            raise from_engine_error(exc) from None
        return params

    def check_logprobs(self, value: int | None, param: str) -> None:
        """400 naming `param` when a request asks for more log-probabilities per token than the engine's
        --max-logprobs allows (vLLM's default cap: 20)."""
        limit = self.core.max_logprobs
        if value is not None and value > limit:
            raise bad_request(f"{param} must be at most {limit} (the server's --max-logprobs), got {value}",
                              param=param)

    def truncate(self, ids: list[int], truncate_prompt_tokens: int | None, has_vision: bool = False) -> list[int]:
        """The prompt's token ids cut to the request's `truncate_prompt_tokens` (the last k; -1: max_model_len),
        as vLLM cuts them, before the length checks and usage; a 400 naming the field when k exceeds
        max_model_len or the cut would split off image or video tokens."""
        try:
            return truncate_prompt(ids, truncate_prompt_tokens, self.max_model_len,
                                   self.core.vision_token_ids() if has_vision else ())
        except SamplingParamsError as exc:
            raise bad_request(str(exc), param="truncate_prompt_tokens") from None

    @staticmethod
    def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
        """Parameters of the n choices of one prompt, each its own engine request (`SamplingParams.for_choice`)."""
        return [params.for_choice(j) for j in range(n)]

    def engine_streams(self, jobs: list[EngineJob]) -> EngineStreams:
        """Engine requests for `jobs`, recording metrics for each as it ends."""

        def on_finish(i: int, out: RequestOutput | None, reason: str, end: float) -> None:
            prompt = len(out.prompt_token_ids) if out is not None else 0
            completion = len(out.outputs[0].token_ids) if out is not None else 0
            metrics = out.metrics if out is not None else {}
            self.metrics.observe_request(reason, prompt, completion, metrics.get("arrival_time"),
                                         metrics.get("first_token_time"), end)

        if not self.engine_alive():
            raise from_engine_error(EngineDead(self.engine.dead_reason or "the engine thread stopped"))
        return EngineStreams(self.engine, jobs, on_finish, self._background)

    def engine_alive(self) -> bool:
        return self.engine.is_alive

    def log_request(self, request_id: str, status: int, prompt_tokens: int, completion_tokens: int,
                    finish: str | None, start: float) -> None:
        """The one INFO line per HTTP request."""
        logger.info("%s: %s, prompt %d tokens, completion %d tokens, finish %s, %.3f s", request_id, status,
                    prompt_tokens, completion_tokens, finish or "-", time.monotonic() - start)

    def fail(self, request_id: str, exc: BaseException, start: float) -> APIError:
        """Map an exception to the APIError to answer with, counting and logging it."""
        err = from_engine_error(exc)
        self.metrics.observe_error(err.status)
        if err.status >= 500 and err.code == "internal_error":
            logger.error("%s: %s", request_id, err.message, exc_info=exc)
        logger.info("%s: HTTP %d (%s), %.3f s", request_id, err.status, err.message, time.monotonic() - start)
        return err
