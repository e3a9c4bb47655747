"""The model runner's steps under speculative decoding (spec_decode.py has the passes they run): a prefill step
(the target, sampling of the rows that end their prompt, the MTP head over every chunk, drafts for the sampled
rows) or a verify step (the target on each request's last token and drafts, acceptance, drafts after the kept
tokens). With n-gram drafting (`mtp_drafts` false) the MTP passes are left out: the engine finds the next
drafts in each request's tokens (ngram_proposer.py). Under tensor parallelism rank 0 runs `execute_spec` and
the other ranks `follow_spec`: the same passes, with what rank 0 sampled or accepted sent to them in between,
since the head's passes on every rank need it (not sent for n-gram drafting, which has no such passes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nibble.engine.image_steps import image_step_inputs
from nibble.engine.request import Request, TokenLogprobs
from nibble.engine.sampler import sample_launch
from nibble.engine.scheduler import ScheduledBatch
from nibble.engine.spec_decode import draft_after_prefill, draft_after_verify
from nibble.engine.spec_sampler import accept_drafts
from nibble.engine.step_inputs import StepInputs
from nibble.kernels.host_copy import to_device_async
from nibble.layers.forward_batch import ForwardBatch
from nibble.models.mrope import MRopeParams
from nibble.models.multimodal import MultimodalStep

if TYPE_CHECKING:
    from torch import nn

    from nibble.engine.mixed_graphs import MixedGraphs
    from nibble.engine.spec_decode import VerifyGraphs
    from nibble.layers.forward_batch import ModelCaches


@dataclass
class SpecStepOutput:
    """What a speculative-decoding step produced, per sampled row (rows: indices into the step's requests):
    tokens (accepted drafts, then the new token), the next drafts, rows (positions in `rows`) whose logits
    were not finite, and the log-probs of each token (None for rows that did not ask for them)."""

    rows: list[int]
    tokens: list[list[int]]
    drafts: list[list[int]]
    bad_rows: list[int]
    logprobs: list[list[TokenLogprobs] | None]


class SpecSteps:
    """ModelRunner's speculative-decoding steps (a mixin: the runner holds the model, caches and graphs)."""

    model: nn.Module
    caches: ModelCaches
    device: torch.device
    block_size: int
    num_spec_tokens: int
    # drafts from the MTP head (its passes run here, after each step), else from the engine (n-gram)
    mtp_drafts: bool
    mixed_graphs: MixedGraphs | None
    verify_graphs: VerifyGraphs | None
    step_counts: dict[str, int]
    broadcast: Callable[[StepInputs], None] | None
    send_tokens: Callable[[torch.Tensor], None] | None
    recv_tokens: Callable[[], torch.Tensor] | None
    mrope: MRopeParams | None
    vision_max_patches: int | None
    _prepare_caches: Callable[[StepInputs], None]
    _add_image_inputs: Callable[[ForwardBatch, MultimodalStep], None]

    @torch.inference_mode()
    def execute_spec(self, sched: ScheduledBatch, generator: torch.Generator | None,
                     bitmask: Callable[[list[Request]], tuple[list[int], torch.Tensor] | None]) -> SpecStepOutput:
        """Run one step under speculative decoding and wait for its tokens (spec_decode.py): a verify step
        (sched.spec_verify) or a prefill step. bitmask(requests): the structured-output bitmask of the rows
        sampled by the regular sampler. Under tensor parallelism the step goes to the other ranks first, and
        what this rank samples follows it (`send_tokens`) before the MTP head's passes."""
        step = StepInputs.from_schedule(sched, speculative=True)
        if self.mrope is not None and any(r.has_vision for r in sched.requests):
            step.position_offsets, step.mm = image_step_inputs(
                sched.requests, sched.num_new_tokens, getattr(self.model, "visual", None),
                self.mrope, self.device, self.vision_max_patches)
        if self.broadcast is not None:
            self.broadcast(step)
        out = self._spec_step(step, sched.requests, generator, bitmask)
        assert out is not None
        return out

    @torch.inference_mode()
    def follow_spec(self, step: StepInputs) -> None:
        """Tensor-parallel ranks other than 0: the passes of rank 0's `execute_spec`, with the tokens it sampled
        received from it (`recv_tokens`) where it samples."""
        self._spec_step(step, None, None, None)

    def _sampled_everywhere(self, tokens: torch.Tensor | None) -> torch.Tensor:
        """The tokens rank 0 sampled (int64, on the device), on every rank: rank 0 passes them (and sends them
        to the other ranks under tensor parallelism), the others pass None and receive them."""
        if tokens is not None:
            if self.send_tokens is not None:
                self.send_tokens(tokens)
            return tokens
        if self.recv_tokens is None:
            raise RuntimeError("a follower rank needs recv_tokens")
        return self.recv_tokens().to(self.device)

    def _spec_step(self, step: StepInputs, requests: list[Request] | None, generator: torch.Generator | None,
                   bitmask: Callable[[list[Request]], tuple[list[int], torch.Tensor] | None] | None
                   ) -> SpecStepOutput | None:
        """`execute_spec` (requests given: this rank samples) or `follow_spec` (None: it receives)."""
        self._prepare_caches(step)
        if step.spec_slots:
            return self._verify(step, requests, generator, bitmask)
        offsets = step.position_offsets or None
        batch = ForwardBatch.build(step.token_ids, step.context_lens, step.block_tables, step.state_slots,
                                   self.block_size, self.device, position_offsets=offsets)
        if step.mm is not None:
            self._add_image_inputs(batch, step.mm)
        mixed = self.mixed_graphs if step.mm is None and offsets is None else None
        size = mixed.padded_size(batch.num_tokens, step.num_seqs, batch.max_query_len) if mixed is not None else None
        per_seq_rows = False
        if mixed is not None and size is not None:
            # the target pass from its graph (every token's hidden row for the MTP head, else each sequence's
            # last); the MTP head's pass below runs eagerly
            mixed.load(size, step.token_ids, step.context_lens, step.block_tables, step.state_slots,
                       self.block_size)
            per_seq_rows = not mixed.full_hidden
            hidden = mixed.run(size, step.num_seqs if per_seq_rows else batch.num_tokens)
            self.step_counts["mixed_graph" if mixed.replays(size) else "eager"] += 1
        else:
            hidden = self.model(batch, self.caches)
            self.step_counts["eager"] += 1
        rows = step.sample_rows
        pending = None
        tokens = None
        if rows:
            picked = to_device_async(torch.tensor(rows, dtype=torch.int64), self.device)
            logits = self.model.compute_logits(hidden[picked if per_seq_rows else batch.logits_indices[picked]])
            if requests is not None:
                assert bitmask is not None
                sampled = [requests[i] for i in rows]
                pending = sample_launch(logits, sampled, generator, bitmask(sampled))
            if self.mtp_drafts:
                tokens = self._sampled_everywhere(pending.token_ids if pending is not None else None)
        drafts = None
        if self.mtp_drafts:
            drafts = draft_after_prefill(self.model, self.caches, batch, hidden, step.next_token_ids, rows, tokens,
                                         self.block_size, self.num_spec_tokens, offsets, step.mm)
        if requests is None:
            return None
        if pending is None:
            return SpecStepOutput([], [], [], [], [])
        # n-gram drafts are found by the engine from the request's tokens
        host_drafts = drafts.cpu().tolist() if drafts is not None else [[] for _ in rows]
        result = pending.result()
        return SpecStepOutput(rows, [[t] for t in result.token_ids], host_drafts, result.bad_rows,
                              [[lp] if lp is not None else None for lp in result.logprobs])

    def _verify(self, step: StepInputs, requests: list[Request] | None, generator: torch.Generator | None,
                bitmask: Callable[[list[Request]], tuple[list[int], torch.Tensor] | None] | None
                ) -> SpecStepOutput | None:
        num_seqs, n = step.num_seqs, self.num_spec_tokens + 1
        graphs = self.verify_graphs
        bs = graphs.padded_size(num_seqs) if graphs is not None else None
        if graphs is not None and bs is not None:
            graphs.load(bs, step.token_ids, step.context_lens, step.block_tables, step.spec_slots,
                        step.position_offsets or None)
            logits = graphs.run_target(bs)[:num_seqs]
            self.step_counts["verify_graph"] += 1
        else:
            batch = ForwardBatch.build(step.token_ids, step.context_lens, step.block_tables, step.state_slots,
                                       self.block_size, self.device, position_offsets=step.position_offsets or None)
            batch.spec_slots = to_device_async(torch.tensor(step.spec_slots, dtype=torch.int32), self.device)
            hidden = self.model(batch, self.caches)
            self.step_counts["eager"] += 1
            logits = self.model.compute_logits(hidden).view(num_seqs, n, -1)
        acc = None
        if requests is not None:
            assert bitmask is not None
            host_drafts = [t[1:] for t in step.token_ids]
            drafts_in = to_device_async(torch.tensor(host_drafts, dtype=torch.int64), self.device)
            acc = accept_drafts(logits, drafts_in, requests, generator, bitmask(requests), host_drafts)
        if self.mtp_drafts:
            if acc is not None:
                kept = self._sampled_everywhere(torch.cat((acc.tokens, acc.num_accepted[:, None]), dim=1))
            else:
                kept = self._sampled_everywhere(None).view(num_seqs, n + 1)
            tokens, num_accepted = kept[:, :n], kept[:, n]
            if graphs is not None and bs is not None:
                drafts = graphs.run_draft(bs, tokens, num_accepted)[:num_seqs]
            else:
                drafts = draft_after_verify(self.model, self.caches, batch, hidden,
                                            batch.input_ids.view(num_seqs, n), tokens, num_accepted,
                                            self.block_size, self.num_spec_tokens,
                                            max(step.context_lens) + 2 * self.num_spec_tokens)
        else:
            # n-gram drafts come from the engine, after it has appended the kept tokens
            drafts = torch.empty(num_seqs, 0, dtype=torch.int64, device=self.device)
        if requests is None or acc is None:
            return None
        host = torch.cat((acc.tokens, acc.num_accepted[:, None], acc.bad[:, None].long(), drafts), dim=1).cpu()
        rows = host.tolist()
        full = acc.full.result() if acc.full is not None else None
        tokens_out = [r[: r[n] + 1] for r in rows]
        logprobs: list[list[TokenLogprobs] | None] = [None] * num_seqs
        if full is not None:
            for j, i in enumerate(acc.full_rows):
                lp = full.logprobs[j]
                logprobs[i] = [lp] if lp is not None else None
        if acc.logprob_rows:
            chosen, *top = (t.cpu().tolist() for t in acc.logprob_parts)
            for j, i in enumerate(acc.logprob_rows):
                want = requests[i].sampling_params.logprobs or 0
                logprobs[i] = [TokenLogprobs(tok, chosen[j][t], dict(zip(top[1][j][t][:want], top[0][j][t][:want]))
                                             if top else {}) for t, tok in enumerate(tokens_out[i])]
        bad = [i for i, r in enumerate(rows) if r[n + 1]]
        return SpecStepOutput(list(range(num_seqs)), tokens_out, [r[n + 2:] for r in rows], bad, logprobs)
