"""Token masks of vLLM's `allowed_token_ids` and `bad_words`, applied on the device by setting logits to -inf.

allowed_token_ids: every token outside the list is masked. The mask (bool [V], True for a banned token) is
built once per request on the logits' device and kept on the request, so a long list is not copied to the
device every step.

bad_words, as vLLM does it: each word is tokenized with its leading whitespace stripped, and once more with a
single leading space, that second form kept only when it starts with another token and has as many tokens (so
that the word is banned both at the start of the text and after a space). A word of one token is never
sampled; a word of several tokens has its last token masked whenever the generated tokens (not the prompt)
end with its other tokens. So the mask depends on the request's latest token: under overlapped scheduling a
request with a multi-token word samples only once the host has that token (`needs_token_context`).

Speculative decoding masks the target distribution of every verified position the same way: a position's
context is the generated tokens followed by the drafts before it, which is what the request holds if those
drafts are accepted (`mask_bad_words_with_drafts`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from nibble.engine.request import Request
from nibble.engine.sampling_params import SamplingParams, SamplingParamsError
from nibble.engine.thinking_budget import needs_budget_context
from nibble.kernels.host_copy import to_device_async

if TYPE_CHECKING:
    from nibble.engine.tokenizer import Tokenizer

# Tokens over a request's tokenized bad words: each is compared with the generated tokens every step.
MAX_BAD_WORD_TOKENS = 1024


class BadWordsError(ValueError):
    """Bad words that cannot be used (too many tokens, or a token outside the model's vocabulary)."""


def tokenize_bad_words(words: Sequence[str], encode: Callable[[str], list[int]], vocab_size: int
                       ) -> list[list[int]]:
    """The token sequences `words` ban (vLLM's tokenization, see the module docstring). encode: text to token
    ids without special tokens."""
    sequences: list[list[int]] = []
    for word in words:
        plain = encode(word.lstrip())
        if not plain:
            raise BadWordsError(f"bad_words entry {word!r} gives no tokens")
        sequences.append(plain)
        spaced = encode(" " + word.lstrip())
        # the spaced form only when it is another word token, not the plain one behind a space token
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    total = sum(len(s) for s in sequences)
    if total > MAX_BAD_WORD_TOKENS:
        raise BadWordsError(f"bad_words must come to at most {MAX_BAD_WORD_TOKENS} tokens, got {total}")
    outside = sorted({t for s in sequences for t in s if not 0 <= t < vocab_size})
    if outside:
        raise BadWordsError(f"bad_words give token ids outside the model's vocabulary [0, {vocab_size}): "
                            f"{outside[:5]}")
    return sequences


def check_token_fields(params: SamplingParams, tokenizer: Tokenizer | None, vocab_size: int) -> list[list[int]]:
    """At admission: check allowed_token_ids against the vocabulary and tokenize bad_words; returns the bad
    words' token sequences (`Request.bad_words_ids`). Raises SamplingParamsError naming the field."""
    outside = [t for t in params.allowed_token_ids or () if t >= vocab_size]
    if outside:
        raise SamplingParamsError(f"allowed_token_ids must be in [0, {vocab_size}), got {outside[:5]}")
    if not params.bad_words:
        return []
    if tokenizer is None:
        raise SamplingParamsError("bad_words need a tokenizer, and this model has none")
    try:
        return tokenize_bad_words(params.bad_words, lambda text: tokenizer.encode(text, add_special_tokens=False),
                                  vocab_size)
    except BadWordsError as exc:
        raise SamplingParamsError(str(exc)) from None


def banned_tokens(sequences: list[list[int]], context: list[int]) -> list[int]:
    """The tokens that may not follow `context` (the generated tokens): each sequence's last token when the
    context ends with the tokens before it (always, for a one-token sequence)."""
    banned: list[int] = []
    for seq in sequences:
        prefix = len(seq) - 1
        if prefix == 0 or (prefix <= len(context) and context[len(context) - prefix:] == seq[:-1]):
            banned.append(seq[-1])
    return banned


def needs_token_context(req: Request) -> bool:
    """Whether the request's next mask depends on its latest tokens: a bad word of more than one token, or a
    thinking budget whose forced position comes next while a token before it is pending (thinking_budget.py)."""
    return any(len(seq) > 1 for seq in req.bad_words_ids) or needs_budget_context(req)


def _allowed_ban_mask(req: Request, vocab: int, device: torch.device) -> torch.Tensor:
    """bool [vocab] on `device`: True for the tokens outside the request's allowed_token_ids (built once)."""
    mask = req.allowed_ban_mask
    if mask is None or mask.shape[0] != vocab or mask.device != device:
        ids = to_device_async(torch.tensor(req.sampling_params.allowed_token_ids or [], dtype=torch.int64), device)
        mask = torch.ones(vocab, dtype=torch.bool, device=device).index_fill_(0, ids, False)
        req.allowed_ban_mask = mask
    return mask


def mask_allowed_token_ids(logits: torch.Tensor, requests: Sequence[Request], rows: Sequence[int] | None = None
                           ) -> None:
    """Set to -inf, in place, the logits of the tokens a request's allowed_token_ids leave out. logits: [B, V]
    or [B, n, V] (every position of a row alike), row b of request b; rows: the rows to consider (all)."""
    vocab = logits.shape[-1]
    for i in range(len(requests)) if rows is None else rows:
        if requests[i].sampling_params.allowed_token_ids:
            logits[i].masked_fill_(_allowed_ban_mask(requests[i], vocab, logits.device), float("-inf"))


def _mask_pairs(logits: torch.Tensor, index: list[list[int]]) -> None:
    """Set logits[index[0][j], ..., index[-1][j]] to -inf for every j, in one device operation."""
    if index[0]:
        idx = to_device_async(torch.tensor(index, dtype=torch.int64), logits.device)
        # the values filled on the device: a tensor built from a host value would be a synchronous copy
        logits.index_put_(tuple(idx), logits.new_full((len(index[0]),), float("-inf")))


def mask_bad_words(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Set to -inf, in place, the tokens each request's bad words forbid after its generated tokens. logits:
    [B, V], row b of request b."""
    rows: list[int] = []
    tokens: list[int] = []
    for i, req in enumerate(requests):
        if req.bad_words_ids:
            banned = banned_tokens(req.bad_words_ids, req.output_token_ids)
            rows += [i] * len(banned)
            tokens += banned
    _mask_pairs(logits, [rows, tokens])


def mask_bad_words_with_drafts(logits: torch.Tensor, requests: Sequence[Request], drafts: Sequence[Sequence[int]],
                               rows: Sequence[int]) -> None:
    """The bad-words masks of a verify step's positions, in place. logits: [B, n, V]; drafts: [B][n - 1] the
    draft tokens fed after each request's last token; rows: the rows to consider. Position j follows the
    generated tokens and drafts[b][:j]."""
    index: list[list[int]] = [[], [], []]
    for i in rows:
        req = requests[i]
        if not req.bad_words_ids:
            continue
        # only the tokens a word's prefix can reach matter: no copy of a long output per position
        reach = max(len(seq) for seq in req.bad_words_ids) - 1
        out = req.output_token_ids
        tail = out[max(len(out) - reach, 0):] if reach else []
        for j in range(logits.shape[1]):
            banned = banned_tokens(req.bad_words_ids, tail + list(drafts[i][:j]))
            index[0] += [i] * len(banned)
            index[1] += [j] * len(banned)
            index[2] += banned
    _mask_pairs(logits, index)
