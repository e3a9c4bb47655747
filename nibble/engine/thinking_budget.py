"""A hard cap on thinking tokens: vLLM's `thinking_token_budget` (SGLang's strict thinking budget).

A request whose prompt leaves the model thinking (its last `<think>` comes after its last `</think>`, as the
Qwen3.5 template's generation prompt `<think>\\n` does) may generate `budget` tokens before `</think>`: the
token at output index `budget` is forced to be `</think>` unless one was generated before it. Forcing sets every
other logit of that position to -inf and the `</think>` logit to 0, after every other mask (penalties, logit
bias, allowed_token_ids, bad_words, a grammar), as vLLM's forced logit of 1e9 overrides them; the sampled token
is then `</think>` whatever the temperature. Afterwards sampling is free. max_tokens still applies, and the
forced token counts toward it. A structured output meant for the answer starts after `</think>`
(`StructuredOutputsParams.start_token_id`, which the server sets for a thinking prompt), so the forced token
starts it; a grammar that applies from the first token and has no room for `</think>` fails the request, as
any token that breaks a grammar does.

Only one position is ever forced: once the token at index `budget` has been sampled, a `</think>` is among the
output's first `budget + 1` tokens (generated or forced), so nothing after it depends on the budget. Hence:

- under overlapped scheduling a request defers its sampling (`needs_budget_context`) only at the step that
  samples index `budget` while some token before it is still on the device, since only then does the
  decision depend on a token the host has not seen; every other step keeps its overlap;
- under speculative decoding the verify position at index `budget` is forced unless the generated tokens or
  the drafts before it hold `</think>` (`force_thinking_end_with_drafts`), so a draft there other than
  `</think>` is rejected and `</think>` is the token emitted.

Where vLLM differs: it also counts the prompt's tokens after its last `<think>` (the template's newline), and a
`<think>` the model generates starts a new budgeted section; here only generated tokens count, only a prompt
that ends inside thinking is budgeted, and a later `<think>` does not restart the budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nibble.engine.sampling_params import SamplingParams, SamplingParamsError
from nibble.kernels.host_copy import to_device_async

if TYPE_CHECKING:
    from nibble.engine.request import Request
    from nibble.engine.tokenizer import Tokenizer

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ThinkingBudget:
    """The budget of a request whose prompt leaves the model thinking: the output token at index `budget` is
    `end_id` (`</think>`) unless an earlier output token is."""

    budget: int
    end_id: int

    def forces(self, context: Sequence[int], index: int) -> bool:
        """Whether output token `index` must be `end_id`; context: the output tokens before it (at least the
        first `budget`, when index is `budget`)."""
        return index == self.budget and self.end_id not in context[:index]


def thinking_budget_of(params: SamplingParams, tokenizer: Tokenizer | None, prompt_ids: Sequence[int],
                       vocab_size: int) -> ThinkingBudget | None:
    """At admission: the request's ThinkingBudget, or None when it has no thinking_token_budget or its prompt
    does not end inside thinking (the budget then changes nothing). Raises SamplingParamsError naming the field
    when the tokenizer has no `<think>` / `</think>` tokens."""
    if params.thinking_token_budget is None:
        return None
    ids = [tokenizer.token_to_id(t) if tokenizer is not None else None for t in (THINK_START, THINK_END)]
    start, end = ids
    if start is None or end is None or end >= vocab_size:
        raise SamplingParamsError(f"thinking_token_budget needs a tokenizer with {THINK_START} and {THINK_END} "
                                  "tokens, and this model has none")
    last_start = _last_index(prompt_ids, start)
    if last_start < 0 or last_start < _last_index(prompt_ids, end):
        return None
    return ThinkingBudget(params.thinking_token_budget, end)


def _last_index(ids: Sequence[int], token: int) -> int:
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1


def needs_budget_context(req: Request) -> bool:
    """Whether the request's next sampled token (output index: its known plus pending tokens) is the one its
    budget may force, while a token before it is still pending: the decision then needs that token."""
    b = req.thinking_budget
    return (b is not None and req.num_pending_tokens > 0
            and req.num_output_tokens + req.num_pending_tokens == b.budget
            and b.end_id not in req.output_token_ids)


def _force(logits: torch.Tensor, index: list[list[int]], ends: list[int]) -> None:
    """Leave only token ends[j] finite (at 0) at logits[index[0][j], ..., index[-1][j], :], in place."""
    if not ends:
        return
    idx = to_device_async(torch.tensor([*index, ends], dtype=torch.int64), logits.device)
    # the values filled on the device: a tensor built from a host value would be a synchronous copy
    logits.index_put_(tuple(idx[:-1]), logits.new_full((len(ends), logits.shape[-1]), float("-inf")))
    logits.index_put_(tuple(idx), logits.new_zeros(len(ends)))


def force_thinking_end(logits: torch.Tensor, requests: Sequence[Request], own_pending: int = 0) -> None:
    """Force `</think>` in the rows whose budget is reached, in place. logits: [B, V], row b of request b; a
    row samples output index num_output + num_pending - own_pending (as sampler.sample_launch counts it)."""
    rows: list[int] = []
    ends: list[int] = []
    for i, req in enumerate(requests):
        b = req.thinking_budget
        if b is not None and b.forces(req.output_token_ids,
                                      req.num_output_tokens + req.num_pending_tokens - own_pending):
            rows.append(i)
            ends.append(b.end_id)
    _force(logits, [rows], ends)


def thinking_end_positions(requests: Sequence[Request], n: int, rows: Sequence[int]) -> list[int]:
    """The rows (of `rows`) of a verify step with n positions whose budget position lies among them:
    position j of row b samples output index num_output + j."""
    return [i for i in rows if (b := requests[i].thinking_budget) is not None
            and 0 <= b.budget - requests[i].num_output_tokens < n]


def force_thinking_end_with_drafts(logits: torch.Tensor, requests: Sequence[Request],
                                   drafts: Sequence[Sequence[int]], rows: Sequence[int]) -> None:
    """Force `</think>` at the verify positions whose budget is reached, in place. logits: [B, n, V]; drafts:
    [B][n - 1] the drafts fed after each request's last token; rows: `thinking_end_positions`' rows. Position j
    follows the generated tokens and drafts[b][:j], so it is forced unless they hold `</think>`."""
    index: list[list[int]] = [[], []]
    ends: list[int] = []
    for i in rows:
        req = requests[i]
        b = req.thinking_budget
        assert b is not None
        j = b.budget - req.num_output_tokens
        if b.end_id not in req.output_token_ids and b.end_id not in drafts[i][:j]:
            index[0].append(i)
            index[1].append(j)
            ends.append(b.end_id)
    _force(logits, index, ends)
