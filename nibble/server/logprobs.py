"""Engine token log-probabilities in the two OpenAI formats: the legacy completions lists and the chat
`content` entries, and vLLM's `prompt_logprobs` entries.

as_ids (vLLM's request field `return_tokens_as_token_ids`): every token, the alternatives too, is named
"token_id:<id>" instead of its text, so that tokens whose text is not valid UTF-8 on its own (part of a
multi-byte character) can still be told apart. The completions text offsets and the chat `bytes` stay those
of the token's text: they locate and spell the token in the generated text.
"""

from __future__ import annotations

from nibble.engine.request import TokenLogprobs
from nibble.server.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
    PromptLogprob,
)
from nibble.server.token_text import TokenTexts

# JSON has no -inf; a token the model rules out completely is reported with this floor instead.
LOGPROB_FLOOR = -9999.0


def clamp_logprob(value: float) -> float:
    """A log-probability JSON can carry: LOGPROB_FLOOR for -inf."""
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


def token_label(token_id: int, texts: TokenTexts, as_ids: bool) -> str:
    """How a logprobs entry names a token: its text, or "token_id:<id>" with `as_ids`."""
    return f"token_id:{token_id}" if as_ids else texts.text(token_id)


def completion_logprobs(entries: list[TokenLogprobs], texts: TokenTexts, text_offset: int,
                        num_top: int, as_ids: bool = False) -> tuple[CompletionLogProbs, int]:
    """Completions-format logprobs of `entries` and the text offset after them.

    `text_offset` is the position of the first token in the generated text (offsets add up token texts).
    `top_logprobs` maps token text to logprob for the `num_top` most likely tokens plus the sampled one;
    two tokens with the same text keep the more likely one.
    """
    out = CompletionLogProbs()
    for entry in entries:
        token = token_label(entry.token_id, texts, as_ids)
        out.tokens.append(token)
        out.token_logprobs.append(clamp_logprob(entry.logprob))
        out.text_offset.append(text_offset)
        text_offset += len(texts.text(entry.token_id))
        out.top_logprobs.append(_top_by_text(entry, token, texts, num_top, as_ids))
    return out, text_offset


def _top_by_text(entry: TokenLogprobs, token: str, texts: TokenTexts, num_top: int,
                 as_ids: bool) -> dict[str, float]:
    """The `num_top` most likely alternatives and the token itself (named `token`), by name; of two tokens with
    the same text the more likely one is kept."""
    top: dict[str, float] = {}
    for token_id, logprob in sorted(entry.top.items(), key=lambda kv: -kv[1])[:num_top]:
        top.setdefault(token_label(token_id, texts, as_ids), clamp_logprob(logprob))
    top.setdefault(token, clamp_logprob(entry.logprob))
    return top


def prompt_completion_logprobs(prompt_ids: list[int], entries: list[TokenLogprobs | None], texts: TokenTexts,
                               num_top: int, as_ids: bool = False) -> tuple[CompletionLogProbs, int]:
    """Completions-format logprobs of an echoed prompt and the text offset after it: every prompt token with
    its log-probability given the ones before it (`RequestOutput.prompt_logprobs`), null for the first (and
    for any the engine did not return)."""
    out = CompletionLogProbs()
    offset = 0
    for token_id, entry in zip(prompt_ids, [*entries, *([None] * (len(prompt_ids) - len(entries)))]):
        token = token_label(token_id, texts, as_ids)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(texts.text(token_id))
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(clamp_logprob(entry.logprob))
        out.top_logprobs.append(_top_by_text(entry, token, texts, num_top, as_ids))
    return out, offset


def join_logprobs(first: CompletionLogProbs, second: CompletionLogProbs) -> CompletionLogProbs:
    """`first`'s lists followed by `second`'s (an echoed prompt, then the generated tokens)."""
    return CompletionLogProbs(text_offset=first.text_offset + second.text_offset,
                              token_logprobs=first.token_logprobs + second.token_logprobs,
                              tokens=first.tokens + second.tokens,
                              top_logprobs=first.top_logprobs + second.top_logprobs)


def chat_logprobs(entries: list[TokenLogprobs], texts: TokenTexts, num_top: int,
                  as_ids: bool = False) -> list[ChatCompletionLogProbsContent]:
    """Chat-format logprobs: per token its text (or id, `as_ids`), logprob, UTF-8 bytes and the `num_top`
    alternatives."""
    content = []
    for entry in entries:
        raw = texts.get(entry.token_id)[1]
        top = [
            ChatCompletionLogProb(token=token_label(token_id, texts, as_ids), logprob=clamp_logprob(logprob),
                                  bytes=texts.byte_list(token_id))
            for token_id, logprob in sorted(entry.top.items(), key=lambda kv: -kv[1])[:num_top]
        ]
        content.append(ChatCompletionLogProbsContent(token=token_label(entry.token_id, texts, as_ids),
                                                     logprob=clamp_logprob(entry.logprob), bytes=list(raw),
                                                     top_logprobs=top))
    return content


def vllm_prompt_logprobs(entries: list[TokenLogprobs | None], texts: TokenTexts | None,
                         num_top: int) -> list[dict[int, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs` (completions choices, the chat response): per prompt token, that token and the
    `num_top` most likely alternatives by id, each with its log-probability, rank (the alternatives' by their
    order) and text; null for the first token."""
    result: list[dict[int, PromptLogprob] | None] = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        row = {token: PromptLogprob(logprob=clamp_logprob(value), rank=rank,
                                    decoded_token=texts.text(token) if texts is not None else None)
               for rank, (token, value) in enumerate(sorted(entry.top.items(), key=lambda kv: -kv[1])[:num_top],
                                                     start=1)}
        row.setdefault(entry.token_id, PromptLogprob(
            logprob=clamp_logprob(entry.logprob), rank=entry.rank,
            decoded_token=texts.text(entry.token_id) if texts is not None else None))
        result.append(row)
    return result
