"""Engine token log-probabilities in the two OpenAI formats: the legacy completions lists and the chat
`content` entries."""

from __future__ import annotations

from nibble.engine.request import TokenLogprobs
from nibble.server.protocol import ChatCompletionLogProb, ChatCompletionLogProbsContent, CompletionLogProbs
from nibble.server.token_text import TokenTexts

# JSON has no -inf; a token the model rules out completely is reported with this floor instead.
LOGPROB_FLOOR = -9999.0


def _clamp(value: float) -> float:
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
        out.token_logprobs.append(_clamp(entry.logprob))
        out.text_offset.append(text_offset)
        text_offset += len(token)
        top: dict[str, float] = {}
        for token_id, logprob in sorted(entry.top.items(), key=lambda kv: -kv[1])[:num_top]:
            top.setdefault(texts.text(token_id), _clamp(logprob))
        top.setdefault(token, _clamp(entry.logprob))
        out.top_logprobs.append(top)
    return out, text_offset


def chat_logprobs(entries: list[TokenLogprobs], texts: TokenTexts, num_top: int) -> list[ChatCompletionLogProbsContent]:
    """Chat-format logprobs: per token its text, logprob, UTF-8 bytes and the `num_top` alternatives."""
    content = []
    for entry in entries:
        text, raw = texts.get(entry.token_id)
        top = [
            ChatCompletionLogProb(token=texts.text(token_id), logprob=_clamp(logprob),
                                  bytes=texts.byte_list(token_id))
            for token_id, logprob in sorted(entry.top.items(), key=lambda kv: -kv[1])[:num_top]
        ]
        content.append(ChatCompletionLogProbsContent(token=text, logprob=_clamp(entry.logprob), bytes=list(raw),
                                                     top_logprobs=top))
    return content
