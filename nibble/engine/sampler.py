"""Sampling on the model's device for a batch of requests with per-request settings.

Order: non-finite guard -> logit_bias -> penalties (repetition, presence, frequency over the generated tokens;
repetition also over the prompt, as vLLM) -> min_tokens suppression of stop tokens -> allowed_token_ids and
bad_words masks (token_masks.py) -> structured output bitmask -> the thinking budget's forced `</think>`
(thinking_budget.py; it overrides the masks before it) -> temperature -> top-k -> top-p -> min-p -> sample.
Sampling uses the exponential-race trick (argmax p / q, q ~ Exp(1)), with q drawn from the request's own
generator when it has a seed, so a seeded request gives the same tokens whatever else is in the batch.
Log-probabilities are those of the raw model distribution.

`sample_launch` queues all of it on the device and starts non-blocking copies of the results to the host; its
`PendingSample.token_ids` can feed the next step before the host has seen them (the engine's overlapped
scheduling), and `result()` waits for the copies. `sample` does both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nibble.engine.request import Request, TokenLogprobs
from nibble.engine.structured_output import apply_token_bitmask
from nibble.engine.thinking_budget import force_thinking_end
from nibble.engine.token_masks import mask_allowed_token_ids, mask_bad_words
from nibble.kernels.host_copy import to_device_async


@dataclass
class SampleResult:
    """token_ids [B] (host list); logprobs per row or None; bad_rows: rows whose logits were not finite."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    bad_rows: list[int]


def _on(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # small per-row settings: a pageable host->device copy could make the host wait for the running step
    return to_device_async(torch.tensor(values, dtype=dtype), device)


def _penalize(logits: torch.Tensor, requests: list[Request]) -> None:
    vocab = logits.shape[-1]
    for i, req in enumerate(requests):
        sp = req.sampling_params
        if not sp.needs_penalties:
            continue
        row = logits[i]
        if sp.repetition_penalty != 1.0:
            seen = _on(sorted({t for t in req.prompt_token_ids + req.output_token_ids if t < vocab}), torch.long,
                       logits.device)
            if seen.numel():
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
        if req.output_token_ids and (sp.presence_penalty or sp.frequency_penalty):
            out = _on([t for t in req.output_token_ids if t < vocab], torch.long, logits.device)
            counts = torch.zeros(vocab, dtype=logits.dtype, device=logits.device)
            counts.scatter_add_(0, out, torch.ones_like(out, dtype=logits.dtype))
            row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(logits.dtype)


def _add_logit_bias(logits: torch.Tensor, requests: list[Request]) -> None:
    rows: list[int] = []
    ids: list[int] = []
    biases: list[float] = []
    for i, req in enumerate(requests):
        for token, bias in (req.sampling_params.logit_bias or {}).items():
            rows.append(i)
            ids.append(token)
            biases.append(bias)
    if rows:
        idx = _on([rows, ids], torch.int64, logits.device)
        logits.index_put_((idx[0], idx[1]), _on(biases, logits.dtype, logits.device), accumulate=True)


def _suppress_stop_tokens(logits: torch.Tensor, requests: list[Request], own_pending: int) -> None:
    for i, req in enumerate(requests):
        sp = req.sampling_params
        # tokens sampled by a step still in flight count: this row samples the token after them
        if req.num_output_tokens + req.num_pending_tokens - own_pending < sp.min_tokens:
            ids = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(req.eos_token_ids))
            ids = [t for t in ids if t < logits.shape[-1]]
            if ids:
                logits[i].index_fill_(0, _on(ids, torch.int64, logits.device), float("-inf"))


def _filter(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on non-greedy rows; returns probabilities [B, V]."""
    device = logits.device
    temps = _on([max(r.sampling_params.temperature, 1e-5) for r in requests], torch.float32, device)
    logits = logits / temps[:, None]
    top_ks = [r.sampling_params.top_k for r in requests]
    top_ps = [r.sampling_params.top_p for r in requests]
    min_ps = [r.sampling_params.min_p for r in requests]
    vocab = logits.shape[-1]
    if any(0 < k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        ks = _on([k if 0 < k < vocab else vocab for k in top_ks], torch.int64, device)
        ranks = torch.arange(vocab, device=device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
        ps = _on(top_ps, torch.float32, device)
        probs_sorted = torch.softmax(sorted_logits, dim=-1)
        # Keep a token while the mass before it is below top_p (the first token always stays).
        mass_before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted
        sorted_logits = sorted_logits.masked_fill(mass_before >= ps[:, None], float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    if any(p > 0 for p in min_ps):
        mp = _on(min_ps, probs.dtype, device)
        thresh = probs.max(dim=-1, keepdim=True).values * mp[:, None]
        probs = probs.masked_fill(probs < thresh, 0.0)
    return probs


class PendingSample:
    """The device side of one step's sampling. token_ids: int64 [B] on the logits' device; `result()` waits
    for the host copies started by `sample_launch` and returns the `SampleResult`."""

    def __init__(self, token_ids: torch.Tensor, host: torch.Tensor, want_logprobs: list[int | None],
                 logprob_parts: tuple[torch.Tensor, ...] | None, event: torch.cuda.Event | None) -> None:
        self.token_ids = token_ids
        self._host = host
        self._want_logprobs = want_logprobs
        self._logprob_parts = logprob_parts
        self._event = event

    def result(self) -> SampleResult:
        if self._event is not None:
            self._event.synchronize()
        host = self._host.tolist()
        token_list = host[0]
        bad_rows = [i for i, b in enumerate(host[1]) if b]
        logprobs: list[TokenLogprobs | None] = [None] * len(token_list)
        if self._logprob_parts is not None:
            chosen, *top = (t.tolist() for t in self._logprob_parts)
            tv, ti = top if top else (None, None)
            for i, n in enumerate(self._want_logprobs):
                if n is None:
                    continue
                entries = {ti[i][j]: tv[i][j] for j in range(n)} if (n and ti is not None and tv is not None) else {}
                logprobs[i] = TokenLogprobs(token_list[i], chosen[i], entries)
        return SampleResult(token_list, logprobs, bad_rows)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    # from a GPU: into pinned memory without waiting, so that the copy is queued before the next step's work
    return t.to("cpu", non_blocking=True) if t.device.type == "cuda" else t


# The runner produces logits under inference mode; the in-place edits below (non-finite rows, penalties,
# min_tokens) are only allowed on such tensors inside inference mode too.
@torch.inference_mode()
def sample(logits: torch.Tensor, requests: list[Request], generator: torch.Generator | None = None,
           bitmask: tuple[list[int], torch.Tensor] | None = None) -> SampleResult:
    """logits: fp32 [B, V] (one row per request, modified in place) -> sampled tokens and log-probs."""
    return sample_launch(logits, requests, generator, bitmask).result()


@torch.inference_mode()
def sample_launch(logits: torch.Tensor, requests: list[Request], generator: torch.Generator | None = None,
                  bitmask: tuple[list[int], torch.Tensor] | None = None, own_pending: int = 0) -> PendingSample:
    """`sample` without waiting for the device: logits fp32 [B, V] (modified in place). bitmask: (rows,
    int32 [len(rows), ceil(V / 32)] on the host) of the rows under a structured-output constraint
    (structured_output.py), applied on the device. own_pending: 1 when the requests' pending rows already
    include the rows being sampled (a step whose sampling the engine deferred), which min_tokens must not
    count as generated."""
    # NaN propagates through max and +-inf shows in max/min: two cheap reductions instead of a [B, V] mask.
    hi, lo = torch.aminmax(logits, dim=-1)
    bad = ~(torch.isfinite(hi) & torch.isfinite(lo))
    logits.masked_fill_(bad[:, None], 0.0)
    want_logprobs = [r.sampling_params.logprobs for r in requests]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(n is not None for n in want_logprobs) else None

    _add_logit_bias(logits, requests)
    _penalize(logits, requests)
    _suppress_stop_tokens(logits, requests, own_pending)
    mask_allowed_token_ids(logits, requests)
    # the generated tokens are all on the host here: the engine defers the sampling of requests whose
    # bad words need the latest token (llm_engine._needs_host_tokens)
    mask_bad_words(logits, requests)
    if bitmask is not None and bitmask[0]:
        apply_token_bitmask(logits, _on(bitmask[0], torch.int64, logits.device),
                            to_device_async(bitmask[1], logits.device))
    # like the bad words, the budget's forced token depends on tokens the engine makes sure are on the host
    force_thinking_end(logits, requests, own_pending)
    greedy = [r.sampling_params.greedy for r in requests]
    tokens = torch.argmax(logits, dim=-1)
    if not all(greedy):
        rows = [i for i, g in enumerate(greedy) if not g]
        sub = [requests[i] for i in rows]
        idx = _on(rows, torch.int64, logits.device)
        probs = _filter(logits[idx], sub)
        q = torch.empty_like(probs).exponential_(generator=generator)
        for j, req in enumerate(sub):
            if req.generator is not None:
                q[j].exponential_(generator=req.generator)
        sampled = torch.argmax(probs / q, dim=-1)
        tokens[idx] = sampled
    # One device->host transfer for the tokens and the non-finite flags.
    host = _to_host(torch.stack((tokens, bad.to(tokens.dtype))))
    parts = None
    if raw_logprobs is not None:
        max_top = max((n or 0) for n in want_logprobs)
        chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0]
        if max_top > 0:
            top_vals, top_ids = torch.topk(raw_logprobs, max_top, dim=-1)
            parts = (_to_host(chosen), _to_host(top_vals), _to_host(top_ids))
        else:
            parts = (_to_host(chosen),)
    event = None
    if logits.device.type == "cuda":
        event = torch.cuda.Event()
        event.record()
    return PendingSample(tokens, host, want_logprobs, parts, event)
