"""POST /v1/responses (OpenAI's Responses API), GET/DELETE /v1/responses/{id} and its input_items.

A Responses request is served as the chat request it amounts to (responses_items.py): the same template,
reasoning split, tool-call parser, structured outputs and sampling defaults as /v1/chat/completions. The
generated message becomes output items (reasoning, message, function_call); streamed, it becomes the typed
event sequence of responses_stream.py. Finished responses are kept in a bounded in-memory store when the
request says `store` (the default), so `previous_response_id` can continue a conversation.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from nibble.engine.llm_engine import RequestError
from nibble.engine.request import RequestOutput
from nibble.server.chat_output import ChatDeltaBuilder, build_chat_message
from nibble.server.engine_streams import EngineJob, EngineStreams
from nibble.server.errors import APIError, ClientDisconnected, bad_request
from nibble.server.protocol import SHARED_SAMPLING_FIELDS, ChatCompletionRequest
from nibble.server.reasoning import THINK_END
from nibble.server.request_body import parse_model
from nibble.server.response_store import ResponseStore, StoredResponse, input_items_with_ids
from nibble.server.responses_items import (
    ItemError,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    input_to_messages,
    output_items,
    with_instructions,
)
from nibble.server.responses_protocol import (
    InputTokensDetails,
    MessageItem,
    OutputTokensDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    response_id,
)
from nibble.server.responses_stream import ContentTokens, ResponseEventWriter, finish_response, output_logprobs
from nibble.server.serving_base import (
    CLIENT_CLOSED,
    check_generation_error,
    json_response,
    leaves_thinking,
    wait_unless_disconnected,
)
from nibble.server.serving_chat import ChatServing
from nibble.server.sse import EventStreamResponse
from nibble.server.tool_parser import TOOL_CALL_START

# Chat field names in errors of the chat machinery, as the Responses request calls them.
_PARAM_NAMES = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens",
                "logprobs": "top_logprobs", "tools": "tools", "tool_choice": "tool_choice"}


def _as_responses_error(err: APIError) -> APIError:
    """`err` with the chat field it names replaced by the Responses field."""
    name = _PARAM_NAMES.get(err.param or "")
    if name is None or name == err.param:
        return err
    message = err.message
    if message.startswith(f"{err.param}:"):
        message = name + message[len(err.param or ""):]
    return APIError(err.status, message, type=err.type, param=name, code=err.code)


def _text_config(text: dict[str, Any] | None) -> dict[str, Any]:
    """The response's `text`: the request's (its verbosity hint included), with the plain-text format when it
    names none, as OpenAI echoes it."""
    config = dict(text or {})
    if config.get("format") is None:
        config["format"] = {"type": "text"}
    return config


class _Job:
    """What a Responses request became: the chat request, the prompt, the engine streams, the skeleton of the
    response, and the input items to store."""

    def __init__(self, req: ResponsesRequest, chat: ChatCompletionRequest, num_prompt: int, thinking: bool,
                 streams: EngineStreams, response: ResponseObject, input_items: list[dict[str, Any]]) -> None:
        self.req = req
        self.chat = chat
        self.num_prompt = num_prompt
        self.thinking = thinking
        self.streams = streams
        self.response = response
        self.input_items = input_items
        self.parse_tools = bool(chat.tools) and chat.tool_choice != "none"


class ResponsesServing(ChatServing):
    """Handler of /v1/responses."""

    def __init__(self, *args: Any, store: ResponseStore, **kwargs: Any) -> None:
        """`store`: where finished responses are kept (a store of size 0 keeps none)."""
        super().__init__(*args, **kwargs)
        self.store = store

    def _chat_body(self, req: ResponsesRequest, body: dict[str, Any],
                   history: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat request `req` amounts to (after the conversation items `history`)."""
        given = req.input if isinstance(req.input, list) else [{"role": "user", "content": req.input}]
        messages = input_to_messages([*history, *given], first_index=-len(history))
        response_format = chat_response_format(req.text)
        if response_format is not None and req.structured_outputs is not None:
            raise bad_request("Cannot specify both structured_outputs and text.format", param="structured_outputs")
        chat: dict[str, Any] = {
            "messages": with_instructions(messages, req.instructions),
            "tools": chat_tools(req.tools),
            "tool_choice": chat_tool_choice(req.tool_choice),
            "parallel_tool_calls": req.parallel_tool_calls,
            "max_completion_tokens": req.max_output_tokens,
            "response_format": response_format,
            "logprobs": req.wants_logprobs,
            "top_logprobs": req.top_logprobs if req.wants_logprobs else None,
            "chat_template_kwargs": req.chat_template_kwargs,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "stop": req.stop,
            "include_reasoning": req.include_reasoning,
            **{name: getattr(req, name) for name in SHARED_SAMPLING_FIELDS},
            # read from the body, as /v1/chat/completions reads it (ChatServing._template_kwargs)
            "enable_thinking": body.get("enable_thinking"),
        }
        return {k: v for k, v in chat.items() if v is not None}

    def _template_kwargs_of(self, req: ResponsesRequest, chat: ChatCompletionRequest,
                            chat_body: dict[str, Any]) -> dict[str, Any]:
        kwargs = self._template_kwargs(chat, chat_body)
        if req.thinking_off:
            if kwargs.get("enable_thinking") is True:
                raise bad_request("reasoning.effort 'none' and enable_thinking true disagree", param="reasoning")
            kwargs["enable_thinking"] = False
        return kwargs

    async def _prepare(self, req: ResponsesRequest, body: dict[str, Any], request_id: str,
                       request: Request) -> _Job:
        self.check_model(req.model)
        self.require_tokenizer()
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            stored = self.store.get(req.previous_response_id)
            if stored is None:
                raise APIError(404, f"previous response '{req.previous_response_id}' not found: it was not stored "
                                    f"(store false), was deleted, or was evicted (the server keeps the last "
                                    f"{self.store.max_responses})", param="previous_response_id",
                               code="previous_response_not_found")
            history = stored.continuation()
        try:
            chat_body = self._chat_body(req, body, history)
        except ItemError as exc:
            raise bad_request(str(exc), param=exc.param) from None
        chat = parse_model(ChatCompletionRequest, chat_body)
        kwargs = self._template_kwargs_of(req, chat, chat_body)
        try:
            prompt, ids, images, videos = await self.render_chat_with_images(chat.messages, chat.tools_for_template,
                                                                             True, kwargs)
        except RequestError as exc:
            raise bad_request(str(exc), param="input") from None
        self.check_length(len(ids), req.max_output_tokens, "input", "max_output_tokens")
        room = self.max_model_len - len(ids)
        max_tokens = req.max_output_tokens or min(room, self.default_max_new_tokens or room)
        thinking = leaves_thinking(prompt, kwargs)
        structured = await self.structured_outputs(chat, after_reasoning=thinking,
                                                   tool_grammar=self._tool_grammar(chat))
        logprobs = (req.top_logprobs or 0) if req.wants_logprobs else None
        params = self.sampling_params(chat, max_tokens, logprobs, structured)
        response = ResponseObject(
            id=request_id, model=self.served_model_name, instructions=req.instructions,
            parallel_tool_calls=req.parallel_tool_calls is not False, previous_response_id=req.previous_response_id,
            reasoning={"effort": (req.reasoning or {}).get("effort"), "summary": None},
            text=_text_config(req.text), tools=req.tools or [], tool_choice=req.tool_choice or "auto",
            temperature=params.temperature, top_p=params.top_p, top_logprobs=req.top_logprobs,
            max_output_tokens=req.max_output_tokens, store=req.store and self.store.enabled,
            max_tool_calls=req.max_tool_calls, prompt_cache_key=req.prompt_cache_key,
            safety_identifier=req.safety_identifier, metadata=req.metadata or {}, user=req.user)
        streams = self.engine_streams([EngineJob(request_id, ids, params, images, videos)])
        await wait_unless_disconnected(streams.start(), request)
        input_items = [*history, *input_items_with_ids(req.input)]
        return _Job(req, chat, len(ids), thinking, streams, response, input_items)

    def _content_tokens(self, job: _Job) -> ContentTokens:
        assert self.tokenizer is not None and self.token_texts is not None
        tool_start = self.tokenizer.token_to_id(TOOL_CALL_START) if job.parse_tools else None
        return ContentTokens(job.thinking, self.tokenizer.token_to_id(THINK_END), tool_start, self.token_texts.text)

    def _usage(self, job: _Job, out: RequestOutput | None, tokens: ContentTokens) -> ResponseUsage:
        completion = len(out.outputs[0].token_ids) if out is not None else 0
        cached = out.num_cached_tokens if out is not None else 0
        return ResponseUsage(input_tokens=job.num_prompt, input_tokens_details=InputTokensDetails(cached_tokens=cached),
                             output_tokens=completion,
                             output_tokens_details=OutputTokensDetails(reasoning_tokens=tokens.num_reasoning_tokens),
                             total_tokens=job.num_prompt + completion)

    def _keep(self, job: _Job, response: ResponseObject) -> None:
        if job.req.store:
            self.store.put(response, job.input_items)

    async def create(self, body: dict[str, Any], request: Request) -> Response:
        """Serve one POST /v1/responses (already parsed as JSON)."""
        start = time.monotonic()
        request_id = response_id("resp")
        # a client's X-Request-Id is echoed, not taken: response ids key the store, so nibble keeps them unique
        request.state.request_id = request_id
        try:
            req = parse_model(ResponsesRequest, body, "/v1/responses", request_id, ("enable_thinking",))
            job = await self._prepare(req, body, request_id, request)
        except ClientDisconnected:
            self.log_request(request_id, CLIENT_CLOSED, 0, 0, "abort", start)
            return Response(status_code=CLIENT_CLOSED)
        except Exception as exc:
            err = self.fail(request_id, exc, start)
            return _as_responses_error(err).response()
        if req.stream:
            return EventStreamResponse(self._stream(job, start), job.streams.close)
        try:
            (out,) = await wait_unless_disconnected(job.streams.drain(), request)
            check_generation_error(out)
        except ClientDisconnected:
            self.log_request(request_id, CLIENT_CLOSED, job.num_prompt, 0, "abort", start)
            return Response(status_code=CLIENT_CLOSED)
        except Exception as exc:
            return self.fail(request_id, exc, start).response()
        c = out.outputs[0]
        message = build_chat_message(c.text, job.thinking, job.chat.tools, job.parse_tools,
                                     job.chat.include_reasoning)
        items = output_items(message, incomplete=c.finish_reason == "length")
        tokens = self._content_tokens(job)
        entries = tokens.feed(c.token_ids, c.logprobs)
        if job.req.wants_logprobs and self.token_texts is not None:
            for item in items:
                if isinstance(item, MessageItem):
                    item.content[0].logprobs = output_logprobs(entries, self.token_texts, job.req.top_logprobs or 0)
        response = finish_response(job.response, items, c.finish_reason, self._usage(job, out, tokens),
                                   int(time.time()))
        self._keep(job, response)
        self.log_request(request_id, 200, job.num_prompt, len(c.token_ids), c.finish_reason, start)
        return json_response(response)

    async def _stream(self, job: _Job, start: float) -> AsyncIterator[str]:
        writer = ResponseEventWriter(job.response)
        builder = ChatDeltaBuilder(job.thinking, job.chat.tools, job.parse_tools, job.chat.include_reasoning)
        tokens = self._content_tokens(job)
        outcome: str | None = None
        last: RequestOutput | None = None
        try:
            for event in writer.start():
                yield event
            async for _, out in job.streams:
                check_generation_error(out)
                last = out
                c = out.outputs[0]
                entries = tokens.feed(c.delta_token_ids, c.delta_logprobs if job.req.wants_logprobs else None)
                lps = None
                if job.req.wants_logprobs and self.token_texts is not None:
                    lps = output_logprobs(entries, self.token_texts, job.req.top_logprobs or 0)
                for event in writer.feed(builder.feed(c.delta_text, final=out.finished), lps):
                    yield event
                if out.finished:
                    events, response = writer.finish(c.finish_reason, self._usage(job, out, tokens), int(time.time()),
                                                     builder.has_unfinished_call)
                    # Stored before the last events go out: a client may hang up as soon as it reads
                    # response.completed, which cancels this generator at its next yield.
                    self._keep(job, response)
                    outcome = c.finish_reason or "-"
                    for event in events:
                        yield event
        except Exception as exc:
            outcome = "error"
            err = self.fail(job.response.id, exc, start)
            yield writer.fail("server_error" if err.status >= 500 else str(err.code), err.message)
        finally:
            job.streams.close()
            if outcome != "error":
                completion = len(last.outputs[0].token_ids) if last is not None else 0
                self.log_request(job.response.id, 200 if outcome else CLIENT_CLOSED, job.num_prompt, completion,
                                 outcome or "abort", start)

    def _stored(self, rid: str) -> StoredResponse:
        stored = self.store.get(rid)
        if stored is None:
            raise APIError(404, f"response '{rid}' not found: it was not stored (store false), was deleted, or was "
                                f"evicted (the server keeps the last {self.store.max_responses})",
                           param="response_id", code="response_not_found")
        return stored

    def retrieve(self, rid: str) -> Response:
        """GET /v1/responses/{id}."""
        return json_response(self._stored(rid).response)

    def delete(self, rid: str) -> Response:
        """DELETE /v1/responses/{id}."""
        self._stored(rid)
        self.store.delete(rid)
        return Response(json.dumps({"id": rid, "object": "response", "deleted": True}), media_type="application/json")

    def input_items(self, rid: str, limit: int = 20, order: str = "desc", after: str | None = None) -> Response:
        """GET /v1/responses/{id}/input_items: the items the response answered, earlier turns included."""
        if not 1 <= limit <= 100:
            raise bad_request(f"limit must be in [1, 100], got {limit}", param="limit")
        if order not in ("asc", "desc"):
            raise bad_request(f"order must be 'asc' or 'desc', got {order!r}", param="order")
        items = list(self._stored(rid).input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise bad_request(f"after: no input item '{after}' in response '{rid}'", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        body = {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
        return Response(json.dumps(body, ensure_ascii=False), media_type="application/json")
