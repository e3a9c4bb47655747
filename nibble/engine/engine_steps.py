"""The step loop of LLMEngine (a mixin: the engine holds the scheduler, runner, caches and requests): `step`
schedules one batch, runs the model, samples, and hands each sampled token to its request (stop conditions,
text, outputs).

Overlapped scheduling (`EngineConfig.async_scheduling`, on by default): once a step's model and sampling
work is queued on the device, `step` schedules and queues the next one before it waits for the sampled
tokens, feeding them to the next step on the device (the requests' pending tokens, request.py), and then
detokenizes and reports while the device runs that next step. So the host's work between two decode
steps no longer leaves the GPU idle; only decode steps are queued ahead (see `_can_overlap`). A request
that stops (EOS, stop string, error, abort) has its row of the step already queued discarded; requests
reaching max_tokens are not scheduled again. Off under tensor parallelism.

Speculative decoding (`EngineConfig.num_speculative_tokens`, the MTP head or n-gram lookup drafting): every
step runs to the end before the next is scheduled (`_spec_step`), since a verify step's accepted count moves
the positions of the next; a decoding request gets up to num_speculative_tokens + 1 tokens per step. The MTP
head's drafts come back with the step; n-gram drafts are looked up here, in the request's tokens.

Penalties (repetition/presence/frequency), structured outputs and bad words of several tokens need the token
of the step before on the host: the sampler counts it, the grammar's matcher must have taken it before it can
say which tokens come next, a bad word's last token is banned only right after its other tokens; so does the
one step that samples the token a thinking budget may force. While a request uses them (that step only, for
the budget), the queued step's forward pass still goes ahead, but its sampling is deferred
(`_Launched.logits`) until the host has handled the step before; the GPU keeps running the forward pass
meanwhile, and sampling queues behind it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nibble.engine.outputs import TextState, request_output, store_prompt_logprobs
from nibble.engine.parallel import WorkerError
from nibble.engine.request import Request, RequestOutput, RequestStatus, TokenLogprobs
from nibble.engine.sampler import PendingSample, sample_launch
from nibble.engine.scheduler import ScheduledBatch
from nibble.engine.spec_sampler import needs_full_sampler
from nibble.engine.token_masks import needs_token_context

if TYPE_CHECKING:
    from nibble.engine.block_manager import BlockManager
    from nibble.engine.config import EngineConfig
    from nibble.engine.model_runner import ModelRunner
    from nibble.engine.ngram_proposer import NgramProposer
    from nibble.engine.parallel import WorkerGroup
    from nibble.engine.scheduler import Scheduler
    from nibble.engine.structured_output import GrammarBackend

logger = logging.getLogger("nibble.engine")


@dataclass
class _Launched:
    """A step queued on the device (`step`: its number; `sched`: its batch): the requests whose rows were
    sampled (in row order) and their tokens; or, while its sampling is deferred, its logits [rows, V]."""

    step: int
    sched: ScheduledBatch
    sampled: list[Request]
    pending: PendingSample | None
    logits: torch.Tensor | None = None


class EngineSteps:
    """LLMEngine's step loop (a mixin)."""

    config: EngineConfig
    scheduler: Scheduler
    blocks: BlockManager
    runner: ModelRunner
    workers: WorkerGroup | None
    requests: dict[str, Request]
    _text: dict[str, TextState]
    _generator: torch.Generator
    _grammars: GrammarBackend | None
    _inflight: _Launched | None
    _step_error: Exception | None
    ngram: NgramProposer | None
    num_spec_tokens: int
    max_model_len: int
    num_steps: int
    num_generated_tokens: int
    num_computed_prompt_tokens: int
    num_preemptions: int
    num_drafts: int
    num_accepted_per_pos: list[int]

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens verified: k per sequence of a verify step that fed drafts."""
        return self.num_drafts * self.num_spec_tokens

    @property
    def num_accepted_tokens(self) -> int:
        """Draft tokens accepted, over every position."""
        return sum(self.num_accepted_per_pos)

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns an output for each request that advanced or finished. With
        overlapped scheduling the outputs are those of the step queued by the previous call, and this call
        leaves the next step running on the device."""
        if self._step_error is not None:
            error, self._step_error = self._step_error, None
            raise error
        if self.num_spec_tokens:
            return self._spec_step()
        try:
            cur = self._inflight or self._launch(None)
            self._inflight = None
            if cur is None:
                return []
            if self._can_overlap():
                self._inflight = self._launch(cur, defer_sampling=self._needs_host_tokens())
            outputs = self._finish_step(cur)
        except BaseException as exc:
            self._abandon_steps()
            self._fail_workers(exc)
            raise
        if self._inflight is not None and self._inflight.logits is not None:
            try:
                self._sample_deferred(self._inflight)
            except Exception as exc:
                # cur's outputs (final ones among them) are out of the engine's books already: deliver them,
                # and fail the next call instead
                self._abandon_steps()
                self._step_error = exc
        return outputs

    def _spec_step(self) -> list[RequestOutput]:
        """One step under speculative decoding (spec_decode.py), run to the end before returning: the next
        step's positions depend on how many drafts this one accepts."""
        sched = self.scheduler.schedule()
        self.num_preemptions += sched.num_preempted
        if sched.empty:
            return []
        self.num_steps += 1
        drafted = {i for i, r in enumerate(sched.requests) if not needs_full_sampler(r)}
        try:
            out = self.runner.execute_spec(sched, self._generator, self._bitmask)
        except BaseException as exc:
            self._abandon_steps()
            self._fail_workers(exc)
            raise
        if not sched.spec_verify:
            for req, n in zip(sched.requests, sched.num_new_tokens):
                self._count_prompt_tokens(req, n)
                req.num_computed_tokens += n
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        for j, i in enumerate(out.rows):
            req = sched.requests[i]
            if req.finished:
                continue
            tokens = out.tokens[j]
            context = req.num_computed_tokens
            group = [req.state_slot, *req.spec_slots]
            if sched.spec_verify and i in drafted:
                self.num_drafts += 1
                for pos in range(len(tokens) - 1):
                    self.num_accepted_per_pos[pos] += 1
            if j in out.bad_rows:
                outputs.append(self._fail_non_finite(req, self.num_steps, sched))
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            for t, token in enumerate(tokens):
                if sched.spec_verify:
                    # token t follows the last token and t accepted drafts: that is what the caches hold when
                    # it is appended, so a request ending here leaves a consistent prefix-cache entry
                    req.num_computed_tokens = context + 1 + t
                    self.blocks.accept_spec_state(req, group, t)  # type: ignore[arg-type]
                lps = out.logprobs[j]
                self._append_token(req, token, lps[t] if lps is not None else None)
                if req.finished:
                    break
            if not req.finished:
                req.draft_token_ids = self.ngram.propose(req) if self.ngram is not None else out.drafts[j]
            outputs.append(self._output(req))
        return outputs

    def _count_prompt_tokens(self, req: Request, n: int) -> None:
        """Count the prompt tokens among the n a step computes for req (before num_computed_tokens moves on):
        the stats lines' prompt throughput is what the model computed, not what arrived or came from the cache."""
        self.num_computed_prompt_tokens += max(0, min(req.num_computed_tokens + n, req.num_prompt_tokens)
                                               - req.num_computed_tokens)

    def _abandon_steps(self) -> None:
        """After a step failed: forget the step in flight and every pending token, and keep nothing of this
        state for the prefix cache (a failed step may have left caches half updated, or entries whose state
        copies never ran)."""
        self._inflight = None
        for req in self.requests.values():
            req.pending_rows.clear()
            req.cacheable = False
        self.blocks.clear_prefix_cache()

    def _fail_workers(self, exc: BaseException) -> None:
        """Under tensor parallelism a step that failed on this rank may have left the others inside a collective
        this rank never reaches: they are stopped and WorkerError raised (fatal: the server's engine thread ends
        and answers every request), where serving on would hang at the next step."""
        if self.workers is None or (isinstance(exc, WorkerError) and self.workers.failed):
            return
        reason = f"a tensor-parallel step failed on rank 0 ({type(exc).__name__}: {exc}); the workers were stopped"
        self.workers.fail(reason)
        if isinstance(exc, Exception):  # KeyboardInterrupt and the like go on as they are
            raise WorkerError(reason) from exc

    def _can_overlap(self) -> bool:
        """Whether to queue the next step before this one's tokens are seen: only when it will be a pure
        decode step (a CUDA-graph replay, quick to queue). Queuing an eager prefill chunk is itself long host
        work (about a thousand launches) that would hold back the delivery of this step's tokens, for little
        gain: the host work it hides is small next to a prefill chunk's GPU time."""
        sched = self.scheduler
        return (self.config.async_scheduling and self.workers is None and not sched.waiting
                and all(r.num_tokens - r.num_computed_tokens <= 1 for r in sched.running))

    def _needs_host_tokens(self) -> bool:
        """Whether a running request samples from its earlier tokens (penalties, a grammar's matcher, bad words
        of several tokens, a thinking budget reached)."""
        return any(r.sampling_params.needs_penalties or r.grammar is not None or needs_token_context(r)
                   for r in self.scheduler.running)

    def _launch(self, inflight: _Launched | None, defer_sampling: bool = False) -> _Launched | None:
        """Schedule a batch and queue its model work and, unless defer_sampling, its sampling; `inflight`:
        the step before it, whose sampled tokens are still on the device."""
        sched = self.scheduler.schedule()
        self.num_preemptions += sched.num_preempted
        if sched.empty:
            return None
        self.num_steps += 1
        tokens = inflight.pending.token_ids if inflight is not None and inflight.pending is not None else None
        logits, rows = self.runner.execute(sched, tokens)
        for i, (first, entries) in self.runner.prompt_logprob_results.items():
            store_prompt_logprobs(sched.requests[i], first, entries)
        for req, n in zip(sched.requests, sched.num_new_tokens):
            self._count_prompt_tokens(req, n)
            req.num_computed_tokens += n
        if logits is None:
            return _Launched(self.num_steps, sched, [], None)
        sampled = [sched.requests[i] for i in rows]
        launched = _Launched(self.num_steps, sched, sampled, None, logits if defer_sampling else None)
        if not defer_sampling:
            launched.pending = sample_launch(logits, sampled, self._generator, self._bitmask(sampled))
        for j, req in enumerate(sampled):
            req.pending_rows.append(j)
        return launched

    def _sample_deferred(self, launched: _Launched) -> None:
        """Queue the sampling of a step launched with defer_sampling, now that the host has handled the step
        before it (its tokens are in the requests' outputs and grammars)."""
        assert launched.logits is not None
        launched.pending = sample_launch(launched.logits, launched.sampled, self._generator,
                                         self._bitmask(launched.sampled), own_pending=1)
        launched.logits = None

    def _bitmask(self, sampled: list[Request]) -> tuple[list[int], torch.Tensor] | None:
        """The structured-output bitmask of the sampled rows under a constraint (their rows, int32 [rows,
        words] on the host), computed while the device runs the step's forward pass."""
        rows = [j for j, r in enumerate(sampled) if r.grammar is not None and r.grammar.started and not r.finished]
        if not rows or self._grammars is None:
            return None
        return rows, self._grammars.fill_bitmask([sampled[j].grammar for j in rows])  # type: ignore[misc]

    def _finish_step(self, launched: _Launched) -> list[RequestOutput]:
        """Wait for a step's sampled tokens and hand them to their requests (stop conditions, text)."""
        if launched.pending is None:
            return []
        result = launched.pending.result()
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        for j, req in enumerate(launched.sampled):
            if req.finished:
                continue  # stopped or aborted after this step was queued
            if req.pending_rows:
                req.pending_rows.pop(0)
            if j in result.bad_rows:
                outputs.append(self._fail_non_finite(req, launched.step, launched.sched))
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            self._append_token(req, result.token_ids[j], result.logprobs[j])
            outputs.append(self._output(req))
        return outputs

    def _fail_non_finite(self, req: Request, step: int, sched: ScheduledBatch) -> RequestOutput:
        """End a request whose row of engine step `step` had non-finite logits; its final output."""
        req.error = (f"the model produced non-finite logits (NaN/Inf) at engine step {step} for this request; "
                     "generation stopped")
        logger.error("non-finite logits: request %s, step %d, batch of %d sequences (%d tokens)",
                     req.request_id, step, len(sched.requests), sched.num_tokens)
        self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        return self._output(req)

    def _append_token(self, req: Request, token: int, logprobs: TokenLogprobs | None) -> None:
        sp = req.sampling_params
        req.output_token_ids.append(token)
        self.num_generated_tokens += 1
        if logprobs is not None:
            req.output_logprobs.append(logprobs)
        state = self._text[req.request_id]
        status: RequestStatus | None = None
        enough = req.num_output_tokens >= sp.min_tokens
        if enough and token in sp.stop_token_ids:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif enough and not sp.ignore_eos and token in req.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        grammar = req.grammar.accept(token) if req.grammar is not None else None
        if grammar is not None and grammar != "stopped":
            req.error = f"structured output: the sampled token broke the grammar ({grammar})"
            logger.error("request %s: %s", req.request_id, req.error)
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
            return
        if status is None and state.feed(token, check_stop=enough):
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, state.stop.matched
        if status is None and grammar == "stopped":
            status = RequestStatus.FINISHED_STOPPED
        # a pending token (of a step still in flight) is not part of this request's length yet
        length = req.num_prompt_tokens + req.num_output_tokens
        if status is None and (req.num_output_tokens >= (sp.max_tokens or 0) or length >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            state.finish()
            self.scheduler.finish(req, status)

    def _output(self, req: Request) -> RequestOutput:
        out = request_output(req, self._text[req.request_id])
        if req.finished:
            self.requests.pop(req.request_id, None)
            self._text.pop(req.request_id, None)
        return out
