"""POST /v1/chat/completions: messages rendered with the model's chat template, output split into
reasoning, content and tool calls, streamed or not."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from nibble.engine.llm_engine import RequestError
from nibble.server.chat_output import ChatDeltaBuilder, build_chat_message, chat_finish_reason
from nibble.server.engine_streams import EngineJob, EngineStreams
from nibble.server.errors import ClientDisconnected, bad_request
from nibble.server.logprobs import chat_logprobs, vllm_prompt_logprobs
from nibble.server.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
    UsageInfo,
)
from nibble.server.reasoning import THINK_END, THINK_START
from nibble.server.request_body import UNSUPPORTED_FIELDS, parse_model, reject_unsupported
from nibble.server.request_ids import engine_request_id, request_id_of
from nibble.server.serving_base import (
    CLIENT_CLOSED,
    OpenAIServing,
    check_generation_error,
    json_response,
    leaves_thinking,
    usage_of,
    wait_unless_disconnected,
)
from nibble.server.sse import DONE_EVENT, EventStreamResponse, sse_event
from nibble.server.tool_grammar import ToolSchemaError, tool_call_grammar
from nibble.server.tool_parser import TOOL_CALL_END, TOOL_CALL_START

CHAT_UNSUPPORTED_FIELDS = {
    **UNSUPPORTED_FIELDS,
    "functions": "the legacy 'functions' API is not supported; use 'tools'",
    "function_call": "the legacy 'function_call' API is not supported; use 'tool_choice'",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "chat_template": "a per-request chat template is not supported; the model's template is used",
    "documents": "documents are not supported",
    "echo": "echo is not supported",
}


def _before_final_content(prompt: str, content: Any) -> str:
    """A continue_final_message prompt without the final message's content at its end, so that a `<think>` the
    client's own text holds is not taken for an open think block."""
    if isinstance(content, list):
        content = "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    text = content if isinstance(content, str) else ""
    for tail in (text, text.strip()):
        if tail and prompt.endswith(tail):
            return prompt[: -len(tail)]
    return prompt


class ChatServing(OpenAIServing):
    """Handler of /v1/chat/completions."""

    def _template_kwargs(self, req: ChatCompletionRequest, body: dict[str, Any]) -> dict[str, Any]:
        kwargs = dict(req.chat_template_kwargs or {})
        # Some clients send enable_thinking at the top level rather than in chat_template_kwargs.
        top = body.get("enable_thinking")
        if top is not None:
            if not isinstance(top, bool):
                raise bad_request(f"enable_thinking: must be true or false, got {top!r}", param="enable_thinking")
            if kwargs.get("enable_thinking", top) != top:
                raise bad_request("enable_thinking and chat_template_kwargs.enable_thinking disagree",
                                  param="enable_thinking")
            kwargs["enable_thinking"] = top
        if req.reasoning_effort == "none":
            if kwargs.get("enable_thinking") is True:
                raise bad_request("reasoning_effort 'none' and enable_thinking true disagree", param="reasoning_effort")
            kwargs["enable_thinking"] = False
        return kwargs

    def _tool_grammar(self, req: ChatCompletionRequest) -> str | None:
        """The grammar that forces the tool call `tool_choice` asks for ("required" or a named function), or
        None; a 400 when there is nothing to call."""
        forced, name = req.forced_tool
        if not forced:
            return None
        if not req.tools:
            raise bad_request("tool_choice forces a tool call, but the request has no tools", param="tool_choice")
        assert self.tokenizer is not None
        tags = {t: i for t in (TOOL_CALL_START, TOOL_CALL_END) if (i := self.tokenizer.token_to_id(t)) is not None}
        try:
            return tool_call_grammar(req.tools, name, req.parallel_tool_calls is not False, tags)
        except ToolSchemaError as exc:
            raise bad_request(str(exc), param="tools") from None
        except ValueError as exc:
            raise bad_request(f"tool_choice: {exc}", param="tool_choice") from None

    async def create(self, body: dict[str, Any], request: Request) -> Response:
        """Serve one /v1/chat/completions request (already parsed as JSON)."""
        start = time.monotonic()
        request_id, chosen = request_id_of("chatcmpl", request, body)
        engine_id = engine_request_id(request_id, chosen)
        try:
            reject_unsupported(body, CHAT_UNSUPPORTED_FIELDS)
            modalities = body.get("modalities")
            if modalities is not None and modalities != ["text"]:
                raise bad_request("modalities: only ['text'] is supported", param="modalities")
            req = self.usage_default(parse_model(ChatCompletionRequest, body, "/v1/chat/completions", request_id,
                                                 (*CHAT_UNSUPPORTED_FIELDS, "modalities", "enable_thinking")))
            if req.stream and req.prompt_logprobs:
                # as vLLM: a chat stream has no place for them
                raise bad_request("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
            self.check_model(req.model)
            self.require_tokenizer()
            kwargs = self._template_kwargs(req, body)
            try:
                prompt, ids, images, videos = await self.render_chat_with_images(
                    req.messages, req.tools_for_template, req.add_generation_prompt, kwargs,
                    req.continue_final_message)
            except RequestError as exc:
                raise bad_request(str(exc), param="messages") from None
            ids = self.truncate(ids, req.truncate_prompt_tokens, images is not None or videos is not None)
            max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            self.check_length(len(ids), req.max_new_tokens, "messages", max_param)
            room = self.max_model_len - len(ids)
            max_tokens = req.max_new_tokens or min(room, self.default_max_new_tokens or room)
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            if req.continue_final_message:
                head = _before_final_content(prompt, req.messages[-1].get("content"))
                thinking = head.rfind(THINK_START) > head.rfind(THINK_END)
            else:
                thinking = leaves_thinking(prompt, kwargs)
            structured = await self.structured_outputs(req, after_reasoning=thinking,
                                                       tool_grammar=self._tool_grammar(req))
            params = self.sampling_params(req, max_tokens, logprobs, structured)
            if req.prompt_logprobs is not None and not req.stream:
                params = dataclasses.replace(params, prompt_logprobs=req.prompt_logprobs)
            parse_tools = bool(req.tools) and req.tool_choice != "none"
            jobs = [EngineJob(engine_id if req.n == 1 else f"{engine_id}-{j}", ids, p, images, videos)
                    for j, p in enumerate(self.choice_params(params, req.n))]
            streams = self.engine_streams(jobs)
            await wait_unless_disconnected(streams.start(), request)
        except ClientDisconnected:
            self.log_request(request_id, CLIENT_CLOSED, 0, 0, "abort", start)
            return Response(status_code=CLIENT_CLOSED)
        except Exception as exc:
            return self.fail(request_id, exc, start).response()
        if req.stream:
            return EventStreamResponse(
                self._stream(req, request_id, streams, len(ids), thinking, parse_tools, start), streams.close)
        try:
            outputs = await wait_unless_disconnected(streams.drain(), request)
            for out in outputs:
                check_generation_error(out)
        except ClientDisconnected:
            self.log_request(request_id, CLIENT_CLOSED, len(ids), 0, "abort", start)
            return Response(status_code=CLIENT_CLOSED)
        except Exception as exc:
            return self.fail(request_id, exc, start).response()
        choices = []
        for j, out in enumerate(outputs):
            c = out.outputs[0]
            message = build_chat_message(c.text, thinking, req.tools, parse_tools, req.include_reasoning)
            lp = None
            if req.logprobs and self.token_texts is not None:
                lp = ChatCompletionLogProbs(content=chat_logprobs(c.logprobs or [], self.token_texts,
                                                                  req.top_logprobs or 0,
                                                                  bool(req.return_tokens_as_token_ids)))
            choices.append(ChatCompletionResponseChoice(
                index=j, message=message, logprobs=lp, finish_reason=chat_finish_reason(c.finish_reason,
                                                                                        bool(message.tool_calls)),
                stop_reason=c.stop_reason))
        usage = usage_of(list(outputs), [len(ids)])
        self.log_request(request_id, 200, usage.prompt_tokens, usage.completion_tokens,
                         ",".join(sorted({ch.finish_reason or "-" for ch in choices})), start)
        # every choice has the same prompt: one top-level list, as vLLM returns it
        prompt_lps = outputs[0].prompt_logprobs if req.prompt_logprobs is not None else None
        return json_response(ChatCompletionResponse(
            id=request_id, model=self.served_model_name, choices=choices, usage=usage,
            prompt_logprobs=vllm_prompt_logprobs(prompt_lps, self.token_texts, req.prompt_logprobs or 0)
            if prompt_lps is not None else None))

    async def _stream(self, req: ChatCompletionRequest, request_id: str, streams: EngineStreams, num_prompt: int,
                      thinking: bool, parse_tools: bool, start: float) -> AsyncIterator[str]:
        created = int(time.time())
        builders = [ChatDeltaBuilder(thinking, req.tools, parse_tools, req.include_reasoning)
                    for _ in range(len(streams))]
        finishes: list[str | None] = [None] * len(streams)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        outcome: str | None = None

        def chunk(delta: DeltaMessage | None, *, index: int = 0, logprobs: ChatCompletionLogProbs | None = None,
                  finish: str | None = None, stop_reason: int | str | None = None,
                  usage: UsageInfo | None = None) -> str:
            choices = []
            if delta is not None:
                choices = [ChatCompletionResponseStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                                              finish_reason=finish, stop_reason=stop_reason)]
            payload = ChatCompletionStreamResponse(id=request_id, created=created, model=self.served_model_name,
                                                   choices=choices, usage=usage).model_dump(mode="json")
            if delta is not None:
                # Absent delta parts are left out rather than sent as null, as OpenAI does.
                payload["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
            return sse_event(payload)

        def running_usage() -> UsageInfo | None:
            return usage_of(streams.last, [num_prompt]) if req.include_usage and continuous else None

        try:
            for j in range(len(streams)):
                yield chunk(DeltaMessage(role="assistant", content=""), index=j, usage=running_usage())
            async for j, out in streams:
                check_generation_error(out)
                c = out.outputs[0]
                delta = builders[j].feed(c.delta_text, final=out.finished)
                lp = None
                if req.logprobs and self.token_texts is not None and c.delta_logprobs:
                    lp = ChatCompletionLogProbs(content=chat_logprobs(c.delta_logprobs, self.token_texts,
                                                                      req.top_logprobs or 0,
                                                                      bool(req.return_tokens_as_token_ids)))
                if delta is not None or lp is not None:
                    yield chunk(delta or DeltaMessage(), index=j, logprobs=lp, usage=running_usage())
                if out.finished:
                    finishes[j] = chat_finish_reason(c.finish_reason, builders[j].has_tool_calls)
                    yield chunk(DeltaMessage(), index=j, finish=finishes[j], stop_reason=c.stop_reason,
                                usage=running_usage())
            outcome = ",".join(sorted({f or "-" for f in finishes}))
            if req.include_usage:
                yield chunk(None, usage=usage_of(streams.last, [num_prompt]))
        except Exception as exc:
            outcome = "error"
            yield self.fail(request_id, exc, start).sse_event()
        finally:
            streams.close()
            if outcome != "error":
                usage = usage_of(streams.last, [num_prompt])
                self.log_request(request_id, 200 if outcome else CLIENT_CLOSED, usage.prompt_tokens,
                                 usage.completion_tokens, outcome or "abort", start)
        yield DONE_EVENT
