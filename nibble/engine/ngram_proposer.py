"""N-gram drafts for speculative decoding (vLLM's `"method": "ngram"`, prompt lookup decoding).

The drafts for a request are the tokens that followed the last n tokens where those n tokens occurred
before in the request's prompt or output: in code edits, quoting, summaries and structured output the model
often copies spans of its input, and a verify step then keeps several tokens at the price of one step.

The search takes the longest such suffix with prompt_lookup_min <= n <= prompt_lookup_max and, among its
occurrences, the most recent. A continuation that runs into the end of the sequence goes on with the drafts
themselves, so that a repeating period is extended.

A verify step feeds every decoding sequence k draft rows (its CUDA graphs have one shape), so a request
always gets k drafts: when no n-gram of the configured sizes matches, shorter ones are tried down to the last
token alone, and failing that the last token is repeated. Such guesses are verified like any other draft;
they cost nothing the step would not run anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from nibble.engine.request import Request


class TokenHistory:
    """A request's tokens (prompt, then output) as an int64 array grown in place, so that each step's search
    reads an array without converting the whole token list again."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self._buf = np.empty(max(64, 2 * len(tokens)), dtype=np.int64)
        self._len = 0
        self.extend(tokens)

    def __len__(self) -> int:
        return self._len

    def extend(self, tokens: Sequence[int]) -> None:
        need = self._len + len(tokens)
        if need > self._buf.shape[0]:
            grown = np.empty(max(need, 2 * self._buf.shape[0]), dtype=np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len:need] = tokens
        self._len = need

    @property
    def array(self) -> np.ndarray:
        """int64 [len]: a view, valid until the next `extend`."""
        return self._buf[: self._len]


def find_ngram_continuation(tokens: np.ndarray, num_drafts: int, min_n: int, max_n: int) -> list[int] | None:
    """The num_drafts tokens after the most recent earlier occurrence of the longest suffix of tokens (int64
    [L]) whose length n is in [min_n, max_n]; None when no such suffix occurs earlier."""
    length = tokens.shape[0]
    n = min_n
    if length < n + 1:
        return None
    # windows starting at p < length - n end before the last token, so at least one token follows them. One
    # pass finds the windows starting with the suffix's first token; when those are few (a rare token: most
    # text) only they are checked further, else (a token on every few positions) whole-array passes are cheaper
    num_windows = length - n
    tail = tokens[length - n:]
    match = tokens[:num_windows] == tail[0]
    starts = np.flatnonzero(match)
    if starts.size * 16 > num_windows:
        for j in range(1, n):
            match &= tokens[j:j + num_windows] == tail[j]
        starts = np.flatnonzero(match)
    else:
        for j in range(1, n):
            starts = starts[tokens[starts + j] == tail[j]]
    if starts.size == 0:
        return None
    # a longer suffix matches at p - 1 where the n-gram matched at p and the token before each agrees
    while n < max_n and n < length - 1:
        longer = starts[starts >= 1] - 1
        longer = longer[tokens[longer] == tokens[length - n - 1]]
        if longer.size == 0:
            break
        starts, n = longer, n + 1
    begin = int(starts[-1]) + n
    drafts: list[int] = []
    for j in range(num_drafts):
        i = begin + j
        drafts.append(int(tokens[i]) if i < length else drafts[i - length])
    return drafts


def propose_ngram_drafts(tokens: np.ndarray, num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """Exactly num_drafts draft tokens after tokens (int64 [L], L >= 1): the n-gram continuation
    (`find_ngram_continuation`), else one from a shorter suffix, else the last token repeated."""
    drafts = find_ngram_continuation(tokens, num_drafts, min_n, max_n)
    if drafts is None and min_n > 1:
        drafts = find_ngram_continuation(tokens, num_drafts, 1, min_n - 1)
    if drafts is None:
        drafts = [int(tokens[-1])] * num_drafts
    return drafts


class NgramProposer:
    """The engine's n-gram drafter: k drafts for a request from its tokens, whose array it keeps on the
    request (`Request.token_history`) and extends by the tokens added since the last call."""

    def __init__(self, num_drafts: int, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.num_drafts = num_drafts
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, req: Request) -> list[int]:
        """num_drafts draft tokens after req's known tokens (prompt and output)."""
        history = req.token_history
        if history is None:
            history = req.token_history = TokenHistory(req.prompt_token_ids)
        done = len(history) - req.num_prompt_tokens
        if done < req.num_output_tokens:
            history.extend(req.output_token_ids[done:])
        return propose_ngram_drafts(history.array, self.num_drafts, self.min_n, self.max_n)
