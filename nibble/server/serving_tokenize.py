"""POST /tokenize and /detokenize (vLLM's extra endpoints): a prompt or chat messages to the token ids the
engine would see, and token ids back to text, so that clients can count and budget tokens exactly."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from nibble.server.errors import bad_request
from nibble.server.protocol import no_reserved_template_kwargs
from nibble.server.request_body import parse_model
from nibble.server.serving_base import OpenAIServing, json_response


class TokenizeRequest(BaseModel):
    """Either `prompt` (raw text, as /v1/completions encodes it) or `messages` (rendered with the chat
    template, as /v1/chat/completions does)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = Field(default=None, min_length=1)
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return no_reserved_template_kwargs(v)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizeServing(OpenAIServing):
    """Handler of /tokenize and /detokenize."""

    def _encode(self, req: TokenizeRequest) -> list[int]:
        assert self.tokenizer is not None
        if req.prompt is not None:
            return self.tokenizer.encode(req.prompt)
        assert req.messages is not None
        return self.render_chat(req.messages, req.tools, req.add_generation_prompt, req.chat_template_kwargs or {},
                                req.continue_final_message)[1]

    async def tokenize(self, body: dict[str, Any]) -> Response:
        req = parse_model(TokenizeRequest, body)
        self.check_model(req.model)
        self.require_tokenizer()
        ids = await asyncio.to_thread(self._encode, req)
        return json_response(TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids))

    async def detokenize(self, body: dict[str, Any]) -> Response:
        req = parse_model(DetokenizeRequest, body)
        self.check_model(req.model)
        self.require_tokenizer()
        assert self.tokenizer is not None
        vocab = self.core.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids must be in [0, {vocab}), got {bad[:5]}", param="tokens")
        # special tokens stay in the text, so that /tokenize of a rendered chat round-trips
        return json_response(DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens, skip_special_tokens=False)))
