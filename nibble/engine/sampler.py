"""Sampling on the model's device for a batch of requests with per-request settings.

Order: non-finite guard -> penalties (repetition, presence, frequency over the generated tokens;
repetition also over the prompt, as vLLM) -> min_tokens suppression of stop tokens -> temperature ->
top-k -> top-p -> min-p -> sample. Sampling uses the exponential-race trick (argmax p / q, q ~ Exp(1)), with
q drawn from the request's own generator when it has a seed, so a seeded request gives the same tokens
whatever else is in the batch. Log-probabilities are those of the raw model distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nibble.engine.request import Request, TokenLogprobs


@dataclass
class SampleResult:
    """token_ids [B] (host list); logprobs per row or None; bad_rows: rows whose logits were not finite."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    bad_rows: list[int]


def _penalize(logits: torch.Tensor, requests: list[Request]) -> None:
    vocab = logits.shape[-1]
    for i, req in enumerate(requests):
        sp = req.sampling_params
        if not sp.needs_penalties:
            continue
        row = logits[i]
        if sp.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({t for t in req.prompt_token_ids + req.output_token_ids if t < vocab}),
                                dtype=torch.long, device=logits.device)
            if seen.numel():
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
        if req.output_token_ids and (sp.presence_penalty or sp.frequency_penalty):
            out = torch.tensor([t for t in req.output_token_ids if t < vocab], dtype=torch.long, device=logits.device)
            counts = torch.zeros(vocab, dtype=logits.dtype, device=logits.device)
            counts.scatter_add_(0, out, torch.ones_like(out, dtype=logits.dtype))
            row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(logits.dtype)


def _suppress_stop_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
    for i, req in enumerate(requests):
        sp = req.sampling_params
        if req.num_output_tokens < sp.min_tokens:
            ids = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(req.eos_token_ids))
            ids = [t for t in ids if t < logits.shape[-1]]
            if ids:
                logits[i, ids] = float("-inf")


def _filter(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on non-greedy rows; returns probabilities [B, V]."""
    device = logits.device
    temps = torch.tensor([max(r.sampling_params.temperature, 1e-5) for r in requests], device=device)
    logits = logits / temps[:, None]
    top_ks = [r.sampling_params.top_k for r in requests]
    top_ps = [r.sampling_params.top_p for r in requests]
    min_ps = [r.sampling_params.min_p for r in requests]
    vocab = logits.shape[-1]
    if any(0 < k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=device)
        ranks = torch.arange(vocab, device=device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
        ps = torch.tensor(top_ps, device=device, dtype=torch.float32)
        probs_sorted = torch.softmax(sorted_logits, dim=-1)
        # Keep a token while the mass before it is below top_p (the first token always stays).
        mass_before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted
        sorted_logits = sorted_logits.masked_fill(mass_before >= ps[:, None], float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    if any(p > 0 for p in min_ps):
        mp = torch.tensor(min_ps, device=device, dtype=probs.dtype)
        thresh = probs.max(dim=-1, keepdim=True).values * mp[:, None]
        probs = probs.masked_fill(probs < thresh, 0.0)
    return probs


# The runner produces logits under inference mode; the in-place edits below (non-finite rows, penalties,
# min_tokens) are only allowed on such tensors inside inference mode too.
@torch.inference_mode()
def sample(logits: torch.Tensor, requests: list[Request], generator: torch.Generator | None = None) -> SampleResult:
    """logits: fp32 [B, V] (one row per request, modified in place) -> sampled tokens and log-probs."""
    # NaN propagates through max and +-inf shows in max/min: two cheap reductions instead of a [B, V] mask.
    hi, lo = torch.aminmax(logits, dim=-1)
    bad = ~(torch.isfinite(hi) & torch.isfinite(lo))
    logits.masked_fill_(bad[:, None], 0.0)
    want_logprobs = [r.sampling_params.logprobs for r in requests]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(n is not None for n in want_logprobs) else None

    _penalize(logits, requests)
    _suppress_stop_tokens(logits, requests)
    greedy = [r.sampling_params.greedy for r in requests]
    tokens = torch.argmax(logits, dim=-1)
    if not all(greedy):
        idx = [i for i, g in enumerate(greedy) if not g]
        sub = [requests[i] for i in idx]
        probs = _filter(logits[idx], sub)
        q = torch.empty_like(probs).exponential_(generator=generator)
        for j, req in enumerate(sub):
            if req.generator is not None:
                q[j].exponential_(generator=req.generator)
        sampled = torch.argmax(probs / q, dim=-1)
        tokens[idx] = sampled
    # One device->host transfer for the tokens and the non-finite flags.
    host = torch.stack((tokens, bad.to(tokens.dtype))).tolist()
    token_list = host[0]
    bad_rows = [i for i, b in enumerate(host[1]) if b]

    logprobs: list[TokenLogprobs | None] = [None] * len(requests)
    if raw_logprobs is not None:
        max_top = max((n or 0) for n in want_logprobs)
        top_vals, top_ids = (torch.topk(raw_logprobs, max_top, dim=-1) if max_top > 0 else (None, None))
        chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        tv = top_vals.tolist() if top_vals is not None else None
        ti = top_ids.tolist() if top_ids is not None else None
        for i, n in enumerate(want_logprobs):
            if n is None:
                continue
            top = {ti[i][j]: tv[i][j] for j in range(n)} if (n and ti is not None and tv is not None) else {}
            logprobs[i] = TokenLogprobs(token_list[i], chosen[i], top)
    return SampleResult(token_list, logprobs, bad_rows)
