"""Engine token log-probabilities in the two OpenAI formats: the legacy completions lists and the chat
`content` entries."""

from __future__ import annotations

from nibble.engine.request import TokenLogprobs
from nibble.server.protocol import ChatCompletionLogProb, ChatCompletionLogProbsContent, CompletionLogProbs
from nibble.server.token_text import TokenTexts

# JSON has no -inf; a token the model rules out completely is reported with this floor instead.
LOGPROB_FLOOR = -9999.0


def clamp_logprob(value: float) -> float:
    """A log-probability JSON can carry: LOGPROB_FLOOR for -inf."""
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


def completion_logprobs(entries: list[TokenLogprobs], texts: TokenTexts, text_offset: int,
                        num_top: int) -> tuple[CompletionLogProbs, int]:
    """Completions-format logprobs of `entries` and the text offset after them.

    `text_offset` is the position of the first token in the generated text (offsets add up token texts).
    `top_logprobs` maps token text to logprob for the `num_top` most likely tokens plus the sampled one;
    two tokens with the same text keep the more likely one.
    """
    out = CompletionLogProbs()
    for entry in entries:
        token = texts.text(entry.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(clamp_logprob(entry.logprob))
        out.text_offset.append(text_offset)
        text_offset += len(token)
        out.top_logprobs.append(_top_by_text(entry, token, texts, num_top))
    return out, text_offset


def _top_by_text(entry: TokenLogprobs, token: str, texts: TokenTexts, num_top: int) -> dict[str, float]:
    """The `num_top` most likely alternatives and the token itself (text `token`), by text; of two tokens with
    the same text the more likely one is kept."""
    top: dict[str, float] = {}
    for token_id, logprob in sorted(entry.top.items(), key=lambda kv: -kv[1])[:num_top]:
        top.setdefault(texts.text(token_id), clamp_logprob(logprob))
    top.setdefault(token, clamp_logprob(entry.logprob))
    return top


def prompt_completion_logprobs(prompt_ids: list[int], entries: list[TokenLogprobs | None], texts: TokenTexts,
                               num_top: int) -> tuple[CompletionLogProbs, int]:
    """Completions-format logprobs of an echoed prompt and the text offset after it: every prompt token with
    its log-probability given the ones before it (`RequestOutput.prompt_logprobs`), null for the first (and
    for any the engine did not return)."""
    out = CompletionLogProbs()
    offset = 0
    for token_id, entry in zip(prompt_ids, [*entries, *([None] * (len(prompt_ids) - len(entries)))]):
        token = texts.text(token_id)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(clamp_logprob(entry.logprob))
        out.top_logprobs.append(_top_by_text(entry, token, texts, num_top))
    return out, offset


def join_logprobs(first: CompletionLogProbs, second: CompletionLogProbs) -> CompletionLogProbs:
    """`first`'s lists followed by `second`'s (an echoed prompt, then the generated tokens)."""
    return CompletionLogProbs(text_offset=first.text_offset + second.text_offset,
                              token_logprobs=first.token_logprobs + second.token_logprobs,
                              tokens=first.tokens + second.tokens,
                              top_logprobs=first.top_logprobs + second.top_logprobs)


def chat_logprobs(entries: list[TokenLogprobs], texts: TokenTexts, num_top: int) -> list[ChatCompletionLogProbsContent]:
    """Chat-format logprobs: per token its text, logprob, UTF-8 bytes and the `num_top` alternatives."""
    content = []
    for entry in entries:
        text, raw = texts.get(entry.token_id)
        top = [
            ChatCompletionLogProb(token=texts.text(token_id), logprob=clamp_logprob(logprob),
                                  bytes=texts.byte_list(token_id))
            for token_id, logprob in sorted(entry.top.items(), key=lambda kv: -kv[1])[:num_top]
        ]
        content.append(ChatCompletionLogProbsContent(token=text, logprob=clamp_logprob(entry.logprob), bytes=list(raw),
                                                     top_logprobs=top))
    return content
