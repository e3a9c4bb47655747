"""Acceptance of draft tokens in a speculative verify step, on the device.

Each sequence fed its last token and n - 1 draft tokens; the target model's logits at those n positions
say, for each draft, what the model itself would have produced there. Drafts are the MTP head's arg-max
(a one-hot draft distribution), so speculative sampling reduces to: accept draft j with probability
p_j(draft_j) under the request's filtered target distribution p_j (temperature, top-k, top-p, min-p), stop
at the first rejection and sample the replacement from p_j without the rejected token; when every draft is
accepted, sample one more token from p_{n-1}. The tokens produced are distributed exactly as sampling the
target model one token at a time. Greedy rows accept a draft iff it is the arg-max.

Rows that need host-side state (penalties, logit bias, structured outputs, min_tokens not reached yet)
accept no draft: their one token is sampled from position 0 by the regular sampler (sampler.py), so
everything it supports keeps working, one token per step. allowed_token_ids and bad_words keep their drafts:
the other rows' target logits are masked at every position first (token_masks.py; a position's bad words
follow the generated tokens and the drafts before it), so that acceptance and the token sampled after the
accepted drafts follow the masked distribution, as the regular sampler's would. A thinking budget forces
`</think>` at its position the same way, unless the tokens or drafts before it hold one (thinking_budget.py).
Log-probabilities (of the raw target distribution, before the masks, as the regular sampler reports them)
are computed for every position of the rows that want them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nibble.engine.request import Request
from nibble.engine.sampler import PendingSample, _filter, _on, sample_launch
from nibble.engine.thinking_budget import force_thinking_end_with_drafts, thinking_end_positions
from nibble.engine.token_masks import mask_allowed_token_ids, mask_bad_words_with_drafts


def needs_full_sampler(req: Request) -> bool:
    """Whether the request's next token must come from the regular sampler (no drafts accepted)."""
    sp = req.sampling_params
    return (sp.needs_penalties or bool(sp.logit_bias) or req.grammar is not None
            or req.num_output_tokens < sp.min_tokens)


@dataclass
class Acceptance:
    """tokens: int64 [B, n] (row b: its accepted drafts, then the token sampled after them, then padding);
    num_accepted: int64 [B]; bad: bool [B] (non-finite target logits); full: the regular sampler's result
    for the rows in full_rows (its tokens are tokens[full_rows, 0]); logprob_rows: the other rows that want
    log-probs, with logprob_parts: the log-prob of tokens[row, j] [L, n], and when some row wants top
    alternatives, their values and ids [L, n, max_top]."""

    tokens: torch.Tensor
    num_accepted: torch.Tensor
    bad: torch.Tensor
    full_rows: list[int]
    full: PendingSample | None
    logprob_rows: list[int] = field(default_factory=list)
    logprob_parts: tuple[torch.Tensor, ...] = ()


# Sampled rows are filtered in groups of this many sequences: [group * n, V] fp32 probabilities and their
# sort are the largest temporaries of a verify step.
RANDOM_GROUP = 32


@torch.inference_mode()
def accept_drafts(logits: torch.Tensor, drafts: torch.Tensor, requests: list[Request],
                  generator: torch.Generator | None = None,
                  bitmask: tuple[list[int], torch.Tensor] | None = None,
                  host_drafts: list[list[int]] | None = None) -> Acceptance:
    """logits: fp32 [B, n, V] (modified in place); drafts: int64 [B, n - 1] on the logits' device, and
    host_drafts the same on the host (read from `drafts` when a row's bad words or thinking budget need them
    and it is None).
    bitmask: the structured-output bitmask of full rows, as `sample_launch` takes it (rows index
    `requests`). A position whose logits are not finite accepts no draft after it; a row is bad only when
    the position its new token comes from is."""
    num_seqs, n, _ = logits.shape
    device = logits.device
    hi, lo = torch.aminmax(logits, dim=-1)
    bad_pos = ~(torch.isfinite(hi) & torch.isfinite(lo))
    logits.masked_fill_(bad_pos[..., None], 0.0)
    full_rows = [i for i, r in enumerate(requests) if needs_full_sampler(r)]
    full_set = set(full_rows)
    lp_rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None and i not in full_set]
    # full rows get their masks from the regular sampler, which must see their raw logits for their log-probs
    free_rows = [i for i in range(num_seqs) if i not in full_set]
    budget_rows = thinking_end_positions(requests, n, free_rows)
    masked = [i for i in free_rows if requests[i].sampling_params.allowed_token_ids or requests[i].bad_words_ids
              or i in budget_rows]
    raw = None
    if lp_rows and set(masked) & set(lp_rows):
        raw = torch.log_softmax(logits[_on(lp_rows, torch.int64, device)], dim=-1)  # before the masks
    if masked:
        mask_allowed_token_ids(logits, requests, masked)
        bad_words = any(requests[i].bad_words_ids for i in masked)
        if bad_words or budget_rows:
            context = drafts.tolist() if host_drafts is None else host_drafts
            if bad_words:
                mask_bad_words_with_drafts(logits, requests, context, masked)
            force_thinking_end_with_drafts(logits, requests, context, budget_rows)
    target = torch.argmax(logits, dim=-1)
    match = drafts == target[:, :-1]
    random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy and i not in full_set]
    draws = [_draw(logits, drafts, random_rows[g:g + RANDOM_GROUP], requests, generator)
             for g in range(0, len(random_rows), RANDOM_GROUP)]
    for idx, accepted, _ in draws:
        match[idx] = accepted
    match &= ~bad_pos[:, :-1]
    num_accepted = match.long().cumprod(dim=-1).sum(dim=-1)
    if full_rows:
        num_accepted[_on(full_rows, torch.int64, device)] = 0
    bonus = target.gather(1, num_accepted[:, None])[:, 0]
    for idx, _, sample in draws:
        bonus[idx] = sample(num_accepted[idx])
    full = None
    if full_rows:
        fidx = _on(full_rows, torch.int64, device)
        remap = {r: j for j, r in enumerate(full_rows)}
        fmask = None
        if bitmask is not None and bitmask[0]:
            keep = [k for k, r in enumerate(bitmask[0]) if r in remap]
            fmask = ([remap[bitmask[0][k]] for k in keep], bitmask[1][keep])
        full = sample_launch(logits[fidx, 0].contiguous(), [requests[i] for i in full_rows], generator, fmask)
        bonus[fidx] = full.token_ids
    padded = torch.cat((drafts, drafts.new_zeros((num_seqs, 1))), dim=1)
    cols = torch.arange(n, device=device)[None, :]
    tokens = torch.where(cols < num_accepted[:, None], padded, bonus[:, None])
    bad = bad_pos.gather(1, num_accepted[:, None])[:, 0]
    parts: tuple[torch.Tensor, ...] = ()
    if lp_rows:
        lidx = _on(lp_rows, torch.int64, device)
        if raw is None:
            # no masked row among them: computed only now, after the acceptance's temporaries are freed
            raw = torch.log_softmax(logits[lidx], dim=-1)
        parts = (raw.gather(-1, tokens[lidx][..., None])[..., 0],)
        max_top = max(requests[i].sampling_params.logprobs or 0 for i in lp_rows)
        if max_top > 0:
            parts += tuple(torch.topk(raw, max_top, dim=-1))
    return Acceptance(tokens, num_accepted, bad, full_rows, full, lp_rows, parts)


def _draw(logits: torch.Tensor, drafts: torch.Tensor, rows: list[int], requests: list[Request],
          generator: torch.Generator | None
          ) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """Speculative sampling for sampled (non-greedy) rows: (their indices on the device, whether each draft
    passes its acceptance test [R, n - 1], and a function from their accepted counts [R] to the token sampled
    after the accepted drafts)."""
    _, n, vocab = logits.shape
    device = logits.device
    idx = _on(rows, torch.int64, device)
    sub = [requests[i] for i in rows]
    probs = _filter(logits[idx].reshape(len(rows) * n, vocab), [r for r in sub for _ in range(n)])
    # min-p zeroes tokens without renormalising (the exponential race does not need it); acceptance does
    probs = (probs / probs.sum(dim=-1, keepdim=True)).view(len(rows), n, vocab)
    u = torch.rand((len(rows), n - 1), generator=generator, device=device)
    q = torch.empty((len(rows), vocab), device=device).exponential_(generator=generator)
    for j, req in enumerate(sub):
        if req.generator is not None:
            u[j].uniform_(generator=req.generator)
            q[j].exponential_(generator=req.generator)
    row_drafts = drafts[idx]
    accepted = u < probs[:, :-1].gather(-1, row_drafts[:, :, None])[..., 0]

    def sample(num_accepted: torch.Tensor) -> torch.Tensor:
        residual = probs.gather(1, num_accepted[:, None, None].expand(-1, 1, vocab))[:, 0]
        if n > 1:
            # the rejected draft may not be drawn again: sampling from (p - onehot(draft))+ renormalised
            rejected = row_drafts.gather(1, num_accepted.clamp(max=n - 2)[:, None])
            kept = torch.where(num_accepted[:, None] < n - 1, 0.0, residual.gather(1, rejected))
            residual = residual.scatter(1, rejected, kept)
        return torch.argmax(residual / q, dim=-1)

    return idx, accepted, sample
