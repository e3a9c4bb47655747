"""POST /v1/completions: raw prompts (text or token ids, one or a batch), streamed or not."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from nibble.engine.request import RequestOutput
from nibble.server.engine_streams import EngineJob, EngineStreams
from nibble.server.errors import APIError, ClientDisconnected, bad_request
from nibble.server.logprobs import (
    completion_logprobs,
    join_logprobs,
    prompt_completion_logprobs,
    vllm_prompt_logprobs,
)
from nibble.server.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    PromptLogprob,
    UsageInfo,
)
from nibble.server.request_body import UNSUPPORTED_FIELDS, parse_model, reject_unsupported
from nibble.server.request_ids import engine_request_id, request_id_of
from nibble.server.serving_base import (
    CLIENT_CLOSED,
    OpenAIServing,
    check_generation_error,
    json_response,
    usage_of,
    wait_unless_disconnected,
)
from nibble.server.sse import DONE_EVENT, EventStreamResponse

# OpenAI's default for /v1/completions when max_tokens is not given.
DEFAULT_COMPLETION_MAX_TOKENS = 16

class CompletionServing(OpenAIServing):
    """Handler of /v1/completions."""

    def _prompt_ids(self, req: CompletionRequest) -> tuple[list[list[int]], list[bool]]:
        """Each prompt's token ids, cut to `truncate_prompt_tokens`, and whether the cut shortened it."""
        prompts = req.prompts
        if any(isinstance(p, str) for p in prompts):
            self.require_tokenizer()
        ids, cut = [], []
        for i, prompt in enumerate(prompts):
            tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) and self.tokenizer else list(prompt)
            if not tokens:
                where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                raise APIError(400, f"{where}: the prompt is empty", param="prompt")
            kept = self.truncate(tokens, req.truncate_prompt_tokens)
            ids.append(kept)
            cut.append(len(kept) < len(tokens))
        return ids, cut

    def _check_choice_count(self, req: CompletionRequest) -> None:
        """400 when the prompts times n make more engine requests than the engine lets wait: such a request could
        never be admitted whole, and submitting each of them would hold the event loop for a long time."""
        limit = self.core.config.max_waiting_requests
        count = len(req.prompts) * req.n
        if count > limit:
            raise bad_request(f"prompt: {len(req.prompts)} prompts with n={req.n} ask for {count} completions; at most "
                              f"{limit} per request (the server's --max-waiting-requests)", param="prompt")

    def _max_tokens(self, req: CompletionRequest, num_prompt_tokens: int) -> int:
        room = self.max_model_len - num_prompt_tokens
        if req.max_tokens is not None:
            return req.max_tokens
        if "max_tokens" in req.model_fields_set:
            # An explicit null asks for as much as fits, as in vLLM.
            return min(room, self.default_max_new_tokens or room)
        return min(DEFAULT_COMPLETION_MAX_TOKENS, room)

    async def create(self, body: dict[str, Any], request: Request) -> Response:
        """Serve one /v1/completions request (already parsed as JSON)."""
        start = time.monotonic()
        request_id, chosen = request_id_of("cmpl", request, body)
        engine_id = engine_request_id(request_id, chosen)
        try:
            reject_unsupported(body, UNSUPPORTED_FIELDS)
            req = self.usage_default(parse_model(CompletionRequest, body, "/v1/completions", request_id,
                                                 UNSUPPORTED_FIELDS))
            self.check_model(req.model)
            self._check_choice_count(req)
            prompt_ids, cut = await asyncio.to_thread(self._prompt_ids, req)
            structured = await self.structured_outputs(req)
            jobs = []
            for i, ids in enumerate(prompt_ids):
                self.check_length(len(ids), req.max_tokens, "prompt")
                params = self.sampling_params(req, self._max_tokens(req, len(ids)), req.logprobs, structured)
                wanted = [v for v in (req.prompt_logprobs, req.logprobs if req.echo else None) if v is not None]
                if wanted:
                    params = dataclasses.replace(params, prompt_logprobs=max(wanted))
                # choice i * n + j is prompt i's j-th completion, as OpenAI numbers them
                for j, choice_params in enumerate(self.choice_params(params, req.n)):
                    jobs.append(EngineJob(f"{engine_id}-{i * req.n + j}", ids, choice_params))
            streams = self.engine_streams(jobs)
            await wait_unless_disconnected(streams.start(), request)
        except ClientDisconnected:
            self.log_request(request_id, CLIENT_CLOSED, 0, 0, "abort", start)
            return Response(status_code=CLIENT_CLOSED)
        except Exception as exc:
            return self.fail(request_id, exc, start).response()
        prompt_lens = [len(ids) for ids in prompt_ids]
        if req.stream:
            return EventStreamResponse(self._stream(req, request_id, streams, prompt_lens, cut, start), streams.close)
        try:
            outputs = await wait_unless_disconnected(streams.drain(), request)
            for out in outputs:
                check_generation_error(out)
        except ClientDisconnected:
            self.log_request(request_id, CLIENT_CLOSED, sum(prompt_lens), 0, "abort", start)
            return Response(status_code=CLIENT_CLOSED)
        except Exception as exc:
            return self.fail(request_id, exc, start).response()
        choices = []
        for i, out in enumerate(outputs):
            c = out.outputs[0]
            echo_text, echo_logprobs, offset = self._echo(req, i // req.n, out, cut[i // req.n])
            logprobs = None
            if req.logprobs is not None and self.token_texts is not None:
                logprobs, _ = completion_logprobs(c.logprobs or [], self.token_texts, offset, req.logprobs,
                                                  bool(req.return_tokens_as_token_ids))
                if echo_logprobs is not None:
                    logprobs = join_logprobs(echo_logprobs, logprobs)
            choices.append(CompletionResponseChoice(index=i, text=echo_text + c.text, logprobs=logprobs,
                                                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                    prompt_logprobs=self._vllm_prompt_logprobs(req, out)))
        usage = usage_of(list(outputs), prompt_lens)
        self.log_request(request_id, 200, usage.prompt_tokens, usage.completion_tokens,
                         ",".join(sorted({ch.finish_reason or "-" for ch in choices})), start)
        return json_response(CompletionResponse(id=request_id, model=self.served_model_name, choices=choices,
                                                usage=usage))

    def _echo(self, req: CompletionRequest, prompt_index: int, out: RequestOutput, cut: bool
              ) -> tuple[str, CompletionLogProbs | None, int]:
        """With `echo`: prompt `prompt_index`'s text (as sent, or decoded from its token ids; decoded from the
        tokens kept when `truncate_prompt_tokens` cut it, `cut`), its logprobs when the request asks for
        logprobs, and the text offset the generated tokens start at; ("", None, 0) without."""
        if not req.echo:
            return "", None, 0
        prompt = out.prompt_token_ids if cut else req.prompts[prompt_index]
        text = prompt if isinstance(prompt, str) else (self.tokenizer.decode(prompt) if self.tokenizer else "")
        if req.logprobs is None or self.token_texts is None:
            return text, None, len(text)
        logprobs, _ = prompt_completion_logprobs(out.prompt_token_ids, out.prompt_logprobs or [], self.token_texts,
                                                 req.logprobs, bool(req.return_tokens_as_token_ids))
        return text, logprobs, len(text)

    def _vllm_prompt_logprobs(self, req: CompletionRequest, out: RequestOutput
                              ) -> list[dict[int, PromptLogprob] | None] | None:
        """vLLM's `prompt_logprobs` of a choice (request field `prompt_logprobs`; logprobs.vllm_prompt_logprobs)."""
        if req.prompt_logprobs is None or out.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(out.prompt_logprobs, self.token_texts, req.prompt_logprobs)

    async def _stream(self, req: CompletionRequest, request_id: str, streams: EngineStreams,
                      prompt_lens: list[int], cut: list[bool], start: float) -> AsyncIterator[str]:
        created = int(time.time())
        offsets = [0] * len(streams)
        echoed = [False] * len(streams)
        finishes: list[str | None] = [None] * len(streams)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        outcome: str | None = None

        def chunk(choices: list[CompletionResponseStreamChoice], usage: UsageInfo | None = None) -> str:
            model = CompletionStreamResponse(id=request_id, created=created, model=self.served_model_name,
                                             choices=choices, usage=usage)
            return f"data: {model.model_dump_json()}\n\n"

        try:
            async for i, out in streams:
                check_generation_error(out)
                c = out.outputs[0]
                echo_text, echo_logprobs = "", None
                first = not echoed[i]
                if not echoed[i]:
                    # the first chunk of a choice starts with the echoed prompt
                    echoed[i] = True
                    echo_text, echo_logprobs, offsets[i] = self._echo(req, i // req.n, out, cut[i // req.n])
                logprobs: CompletionLogProbs | None = None
                if req.logprobs is not None and self.token_texts is not None:
                    logprobs, offsets[i] = completion_logprobs(c.delta_logprobs, self.token_texts, offsets[i],
                                                               req.logprobs, bool(req.return_tokens_as_token_ids))
                    if echo_logprobs is not None:
                        logprobs = join_logprobs(echo_logprobs, logprobs)
                text = echo_text + c.delta_text
                if not (text or (logprobs is not None and logprobs.tokens) or out.finished):
                    continue
                finishes[i] = c.finish_reason
                choice = CompletionResponseStreamChoice(
                    index=i, text=text, logprobs=logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    prompt_logprobs=self._vllm_prompt_logprobs(req, out) if first else None)
                usage = usage_of(streams.last, prompt_lens) if req.include_usage and continuous else None
                yield chunk([choice], usage)
            if req.include_usage:
                yield chunk([], usage_of(streams.last, prompt_lens))
            outcome = ",".join(sorted({f or "-" for f in finishes}))
        except Exception as exc:
            outcome = "error"
            yield self.fail(request_id, exc, start).sse_event()
        finally:
            streams.close()
            if outcome != "error":
                usage = usage_of(streams.last, prompt_lens)
                self.log_request(request_id, 200 if outcome else CLIENT_CLOSED, usage.prompt_tokens,
                                 usage.completion_tokens, outcome or "abort", start)
        yield DONE_EVENT
