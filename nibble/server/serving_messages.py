"""POST /v1/messages (Anthropic's Messages API) and POST /v1/messages/count_tokens.

A Messages request is served as the chat request it amounts to (messages_items.py): the same template,
reasoning split, tool-call parser, structured outputs and sampling defaults as /v1/chat/completions. The
generated message becomes thinking, text and tool_use blocks; streamed, it becomes Anthropic's event sequence
(messages_stream.py). Every error of these routes, from a bad body to a failure mid-stream, has Anthropic's
error shape.

`max_tokens` is required, as in Anthropic's API, and is capped by the room the context window leaves after
the prompt (Claude Code asks for 32k and more whatever the conversation's length); a generation cut by the
window rather than by max_tokens stops with `model_context_window_exceeded`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from nibble.engine.llm_engine import RequestError
from nibble.engine.request import CompletionOutput, RequestOutput
from nibble.models.multimodal import ImageInputs, VideoInputs
from nibble.server.chat_output import ChatDeltaBuilder, build_chat_message
from nibble.server.engine_streams import EngineJob, EngineStreams
from nibble.server.errors import APIError, ClientDisconnected
from nibble.server.messages_items import (
    BlockError,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    check_context_management,
    content_blocks,
    thinking_budget,
    thinking_mode,
    to_chat_messages,
)
from nibble.server.messages_protocol import (
    AnthropicError,
    CountTokensRequest,
    MessageObject,
    MessagesRequest,
    MessagesUsage,
    StopReason,
    TokenCount,
    invalid_request,
    message_id,
)
from nibble.server.messages_stream import MessageEventWriter
from nibble.server.protocol import SHARED_SAMPLING_FIELDS, ChatCompletionRequest
from nibble.server.request_body import parse_model, read_json_body, reject_unsupported
from nibble.server.serving_base import (
    CLIENT_CLOSED,
    check_generation_error,
    json_response,
    leaves_thinking,
    wait_unless_disconnected,
)
from nibble.server.serving_chat import ChatServing
from nibble.server.sse import EventStreamResponse

# Chat field names in errors of the chat machinery, as the Messages request calls them.
_PARAM_NAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences",
                "response_format": "output_config.format"}

# Request fields of Anthropic's API that would change the result but that nibble does not implement.
MESSAGES_UNSUPPORTED_FIELDS = {
    "container": "containers (code execution, skills) are not supported",
    "mcp_servers": "MCP servers (the MCP connector) are not supported; the client runs its tools",
}

# Sampling fields passed on to the chat request as they are: Anthropic's, then those every endpoint takes.
_SAMPLING_FIELDS = ("temperature", "top_p", *SHARED_SAMPLING_FIELDS)


def stop_reason_of(out: CompletionOutput, has_tool_calls: bool, max_tokens: int) -> tuple[StopReason | None,
                                                                                          str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a finished generation that asked for `max_tokens`."""
    if out.finish_reason == "length":
        return ("max_tokens" if len(out.token_ids) >= max_tokens else "model_context_window_exceeded"), None
    if has_tool_calls:
        return "tool_use", None
    if isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return "end_turn", None


class _Job:
    """What a Messages request became: the chat request, the prompt, the engine streams."""

    def __init__(self, req: MessagesRequest, chat: ChatCompletionRequest, num_prompt: int, thinking: bool,
                 omit_thinking: bool, streams: EngineStreams, request_id: str) -> None:
        self.req = req
        self.chat = chat
        self.num_prompt = num_prompt
        self.thinking = thinking
        self.omit_thinking = omit_thinking
        self.streams = streams
        self.request_id = request_id
        self.parse_tools = bool(chat.tools) and chat.tool_choice != "none"


class MessagesServing(ChatServing):
    """Handler of /v1/messages and /v1/messages/count_tokens."""

    async def read_body(self, request: Request) -> dict[str, Any]:
        """The request body as a JSON object; its errors in Anthropic's shape."""
        try:
            return await read_json_body(request)
        except APIError as exc:
            raise AnthropicError.of(exc) from None

    def _chat_body(self, req: CountTokensRequest, body: dict[str, Any]) -> dict[str, Any]:
        """The chat request `req` amounts to (before the thinking setting, see `_template_kwargs_of`)."""
        try:
            check_context_management(req.context_management)
            tool_choice, parallel = chat_tool_choice(req.tool_choice)
            chat: dict[str, Any] = {
                "messages": to_chat_messages(req.system, req.messages),
                "tools": chat_tools(req.tools),
                "tool_choice": tool_choice,
                "parallel_tool_calls": parallel,
                "response_format": chat_response_format(req.output_config, req.output_format),
                "chat_template_kwargs": req.chat_template_kwargs,
            }
        except BlockError as exc:
            raise invalid_request(str(exc), param=exc.param) from None
        if isinstance(req, MessagesRequest):
            if req.structured_outputs is not None and chat["response_format"] is not None:
                fmt = "output_format" if req.output_format is not None else "output_config.format"
                raise invalid_request(f"structured_outputs: cannot be given together with {fmt}",
                                      param="structured_outputs")
            chat["max_completion_tokens"] = req.max_tokens
            chat["stop"] = req.stop_sequences
            for name in _SAMPLING_FIELDS:
                chat[name] = getattr(req, name)
            if req.thinking_token_budget is None:  # the vLLM field wins when both are given
                chat["thinking_token_budget"] = thinking_budget(req.thinking)
        if body.get("enable_thinking") is not None:
            chat["enable_thinking"] = body["enable_thinking"]
        return {k: v for k, v in chat.items() if v is not None}

    def _template_kwargs_of(self, req: CountTokensRequest, chat: ChatCompletionRequest,
                            chat_body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """The template's kwargs with the `thinking` setting applied, and whether thinking text is omitted."""
        kwargs = self._template_kwargs(chat, chat_body)
        try:
            enable, omit = thinking_mode(req.thinking)
        except BlockError as exc:
            raise invalid_request(str(exc), param=exc.param) from None
        if enable is not None:
            if kwargs.get("enable_thinking", enable) != enable:
                raise invalid_request("thinking and enable_thinking (chat_template_kwargs) disagree", param="thinking")
            kwargs["enable_thinking"] = enable
        return kwargs, omit

    async def _render(self, req: CountTokensRequest, body: dict[str, Any]
                      ) -> tuple[ChatCompletionRequest, list[int], bool, bool, ImageInputs | None, VideoInputs | None]:
        """(chat request, the prompt's token ids (image placeholders expanded), whether the prompt leaves the
        model thinking, whether thinking text is omitted, the preprocessed images or None, the videos or None:
        Anthropic blocks hold no video, but the chat path is shared)."""
        self.check_model(req.model)
        self.require_tokenizer()
        chat_body = self._chat_body(req, body)
        chat = parse_model(ChatCompletionRequest, chat_body)
        kwargs, omit = self._template_kwargs_of(req, chat, chat_body)
        try:
            prompt, ids, images, videos = await self.render_chat_with_images(chat.messages, chat.tools_for_template,
                                                                             True, kwargs)
        except RequestError as exc:
            raise invalid_request(f"messages: {exc}", param="messages") from None
        thinking = leaves_thinking(prompt, kwargs)
        return chat, ids, thinking, omit, images, videos

    def _error(self, request_id: str, exc: BaseException, start: float) -> AnthropicError:
        return AnthropicError.of(self.fail(request_id, exc, start), _PARAM_NAMES)

    async def count_tokens(self, body: dict[str, Any], request: Request) -> Response:
        """Serve one POST /v1/messages/count_tokens: the tokens of the prompt the request renders to."""
        start = time.monotonic()
        request_id = message_id()
        try:
            req = parse_model(CountTokensRequest, body, "/v1/messages/count_tokens", request_id,
                              ("enable_thinking",))
            _, ids, _, _, _, _ = await wait_unless_disconnected(self._render(req, body), request)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)
        except Exception as exc:
            return self._error(request_id, exc, start).response()
        return json_response(TokenCount(input_tokens=len(ids)))

    async def _prepare(self, req: MessagesRequest, body: dict[str, Any], request_id: str, request: Request) -> _Job:
        reject_unsupported(body, MESSAGES_UNSUPPORTED_FIELDS)
        chat, ids, thinking, omit, images, videos = await self._render(req, body)
        self.check_length(len(ids), None, "messages")
        max_tokens = min(req.max_tokens, self.max_model_len - len(ids))
        structured = await self.structured_outputs(chat, after_reasoning=thinking,
                                                   tool_grammar=self._tool_grammar(chat))
        params = self.sampling_params(chat, max_tokens, None, structured)
        streams = self.engine_streams([EngineJob(request_id, ids, params, images, videos)])
        await wait_unless_disconnected(streams.start(), request)
        return _Job(req, chat, len(ids), thinking, omit, streams, request_id)

    def _usage(self, job: _Job, out: RequestOutput | None) -> MessagesUsage:
        cached = out.num_cached_tokens if out is not None else 0
        completion = len(out.outputs[0].token_ids) if out is not None else 0
        return MessagesUsage(input_tokens=job.num_prompt - cached, output_tokens=completion,
                             cache_read_input_tokens=cached)

    async def create(self, body: dict[str, Any], request: Request) -> Response:
        """Serve one POST /v1/messages (already parsed as JSON)."""
        start = time.monotonic()
        request_id = message_id()
        request.state.request_id = request_id
        try:
            req = parse_model(MessagesRequest, body, "/v1/messages", request_id,
                              (*MESSAGES_UNSUPPORTED_FIELDS, "enable_thinking"))
            job = await self._prepare(req, body, request_id, request)
        except ClientDisconnected:
            self.log_request(request_id, CLIENT_CLOSED, 0, 0, "abort", start)
            return Response(status_code=CLIENT_CLOSED)
        except Exception as exc:
            return self._error(request_id, exc, start).response()
        if req.stream:
            return EventStreamResponse(self._stream(job, start), job.streams.close)
        try:
            (out,) = await wait_unless_disconnected(job.streams.drain(), request)
            check_generation_error(out)
        except ClientDisconnected:
            self.log_request(request_id, CLIENT_CLOSED, job.num_prompt, 0, "abort", start)
            return Response(status_code=CLIENT_CLOSED)
        except Exception as exc:
            return self._error(request_id, exc, start).response()
        c = out.outputs[0]
        message = build_chat_message(c.text, job.thinking, job.chat.tools, job.parse_tools)
        stop_reason, stop_sequence = stop_reason_of(c, bool(message.tool_calls), req.max_tokens)
        response = MessageObject(id=request_id, model=self.served_model_name,
                                 content=content_blocks(message, job.omit_thinking), stop_reason=stop_reason,
                                 stop_sequence=stop_sequence, usage=self._usage(job, out))
        self.log_request(request_id, 200, job.num_prompt, len(c.token_ids), stop_reason, start)
        return json_response(response)

    async def _stream(self, job: _Job, start: float) -> AsyncIterator[str]:
        builder = ChatDeltaBuilder(job.thinking, job.chat.tools, job.parse_tools)
        writer: MessageEventWriter | None = None
        outcome: str | None = None
        last: RequestOutput | None = None
        try:
            async for _, out in job.streams:
                check_generation_error(out)
                last = out
                if writer is None:
                    # the prefix-cache hits are known once the request is admitted, which its first output follows
                    usage = self._usage(job, out).model_copy(update={"output_tokens": 0})
                    writer = MessageEventWriter(MessageObject(id=job.request_id, model=self.served_model_name,
                                                              usage=usage), job.omit_thinking)
                    for event in writer.start():
                        yield event
                c = out.outputs[0]
                for event in writer.feed(builder.feed(c.delta_text, final=out.finished)):
                    yield event
                if out.finished:
                    stop_reason, stop_sequence = stop_reason_of(c, builder.has_tool_calls, job.req.max_tokens)
                    events, _ = writer.finish(stop_reason, stop_sequence, self._usage(job, out))
                    for event in events:
                        yield event
                    outcome = stop_reason or "-"
        except Exception as exc:
            outcome = "error"
            yield self._error(job.request_id, exc, start).sse_event()
        finally:
            job.streams.close()
            if outcome != "error":
                completion = len(last.outputs[0].token_ids) if last is not None else 0
                self.log_request(job.request_id, 200 if outcome else CLIENT_CLOSED, job.num_prompt, completion,
                                 outcome or "abort", start)
