"""Log-probabilities of prompt tokens (`SamplingParams.prompt_logprobs`, the completions API's `echo` with
`logprobs`): for each prompt position of a step's chunk, the model's distribution over the next token, read
at the prompt's own next token and its top alternatives.

Logits are computed in slices of `ROWS` positions (one [ROWS, vocab] fp32 buffer at a time, normalised in place:
256 MB for Qwen3.5's 248k vocabulary, where a whole 8192-token chunk would take 8 GB), and
under tensor parallelism every rank computes them (the head's all-gather is a collective), while only rank 0,
which knows how many alternatives each request wants, reduces them to log-probabilities.
"""

from __future__ import annotations

import torch
from torch import nn

from nibble.engine.request import TokenLogprobs
from nibble.engine.step_inputs import StepInputs
from nibble.kernels.host_copy import to_device_async

ROWS = 256


@torch.inference_mode()
def prompt_logprobs(model: nn.Module, step: StepInputs, cu_seqlens: list[int], hidden: torch.Tensor,
                    num_top: list[int] | None) -> dict[int, tuple[int, list[TokenLogprobs]]]:
    """For each of step.prompt_logprob_rows: (the prompt position of its first entry, one entry per position
    whose next token is a prompt token). hidden [T, H]: the step's final hidden states, cu_seqlens its host
    offsets; num_top[j]: alternatives for row j (None on ranks that only take part in the collectives: they
    get {})."""
    out: dict[int, tuple[int, list[TokenLogprobs]]] = {}
    for j, i in enumerate(step.prompt_logprob_rows):
        start = cu_seqlens[i]
        count = step.prompt_logprob_counts[j]
        tokens = step.token_ids[i]
        targets = tokens[1:count + 1]
        if len(targets) < count:
            targets.append(step.prompt_logprob_next[j])
        entries: list[TokenLogprobs] = []
        for a in range(0, count, ROWS):
            b = min(count, a + ROWS)
            logits = model.compute_logits(hidden[start + a:start + b])
            if num_top is None:
                continue
            logprobs = logits.float()
            logprobs -= torch.logsumexp(logprobs, dim=-1, keepdim=True)
            ids = to_device_async(torch.tensor(targets[a:b], dtype=torch.int64), logprobs.device)
            chosen_t = logprobs.gather(1, ids[:, None])
            ranks = ((logprobs > chosen_t).sum(dim=-1) + 1).tolist()
            chosen = chosen_t[:, 0].tolist()
            k = num_top[j]
            if k:
                top_vals, top_ids = (t.tolist() for t in torch.topk(logprobs, k, dim=-1))
            for r, (token, value) in enumerate(zip(targets[a:b], chosen, strict=True)):
                top = dict(zip(top_ids[r], top_vals[r], strict=True)) if k else {}
                entries.append(TokenLogprobs(token, value, top, ranks[r]))
        if num_top is not None:
            out[i] = (step.context_lens[i] + 1, entries)
    return out
