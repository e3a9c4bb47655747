"""Continuous batching with chunked prefill and preemption.

Every step the scheduler fills a token budget: first one token for each running request that is decoding,
then the next prefill chunk of running requests still prefilling, then new requests from the waiting
queue (FIFO) as long as sequences, state slots, blocks and budget allow. When the KV cache runs out for a
running request, the most recently arrived running request is preempted: its caches are freed and it goes
back to the front of the waiting queue, to be recomputed later (its generated tokens are kept).

Priority scheduling (`--scheduling-policy priority`, as vLLM's v1 scheduler): the waiting queue is kept in
(priority, arrival) order, lower values first, and a preempted request goes back to its place in that order
rather than to the front. The preemption victim is the running request that comes last in that order, even
one already given tokens this round (it gives them back), and possibly the very request that needs the
blocks; a round that preempts admits no waiting request, so that what the preemption freed goes to the
running requests it was for. As in vLLM, a waiting request never preempts a running one: priority decides
who is admitted next and who is preempted when a running request needs blocks, not who runs once a batch is
full (max_num_seqs) or the cache is short for a new request (vLLM issue #40004).

With prefix caching (prefix_cache.py) a new request starts from the longest cached prefix of its prompt:
its state slot is filled by a copy instead of being zeroed, and its prefill starts after the prefix. A
prompt that shares blocks with an earlier prompt has its prefill cut at the end of the shared part, and
the round after the cut copies its state into a new entry; new requests sharing that prefix wait for it. A
request that ends leaves its blocks and state to an entry of everything it computed.

With speculative decoding (num_spec_tokens > 0) steps are either verify steps, where each decoding
request feeds its last token and its draft tokens, or prefill steps; the two alternate while both have
work. A verify step holds blocks for 2 * num_spec_tokens tokens past the request's computed ones: the
verified tokens and the MTP head's KV writes for the next drafts (num_spec_tokens + 1 with n-gram drafts, which
write no KV).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from nibble.engine.block_manager import BlockManager
from nibble.engine.config import SCHEDULING_POLICIES
from nibble.engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """What one step runs: requests with the number of tokens each feeds, and before it the GDN state
    copies (source slot, destination slot), the KV block copies (source block, destination block) and
    then the slots to zero. spec_verify: a speculative verify step (each request feeds its last token and
    its draft tokens; num_new_tokens counts both)."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    new_state_slots: list[int] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0
    spec_verify: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def empty(self) -> bool:
        return not self.requests


def priority_key(req: Request) -> tuple[int, float]:
    """Where a request stands under priority scheduling: lower priority values first, then earlier arrivals."""
    return req.sampling_params.priority, req.arrival_time


class Scheduler:
    """The waiting queue and the running requests, and the choice of what each step runs. policy: "fcfs"
    (arrival order) or "priority" (`priority_key` order, see the module docstring)."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 num_spec_tokens: int = 0, policy: str = "fcfs", mtp_drafts: bool = True) -> None:
        """mtp_drafts: the drafts come from the MTP head, whose draft steps write KV up to num_spec_tokens - 1
        positions past a step's last token (n-gram drafts write none)."""
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}")
        self.blocks = block_manager
        self.by_priority = policy == "priority"
        self.num_spec_tokens = num_spec_tokens
        self.draft_kv_len = max(num_spec_tokens - 1, 0) if mtp_drafts else 0
        self._last_verify = False
        self._pending_state_copies: list[tuple[int, int]] = []
        self._pending_block_copies: list[tuple[int, int]] = []
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        if self.by_priority:
            self._enqueue_by_priority(request)
        else:
            self.waiting.append(request)

    def _enqueue_by_priority(self, request: Request) -> None:
        # after the requests that tie with it, so that equal keys keep the order they came in
        i = bisect.bisect_right(self.waiting, priority_key(request), key=priority_key)
        self.waiting.insert(i, request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Mark a request finished (or aborted) and free its caches, wherever it is; tokens of steps still
        in flight for it are dropped."""
        request.status = status
        request.pending_rows.clear()
        if status != RequestStatus.FINISHED_ERROR:
            self.blocks.cache_finished(request)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request)

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.blocks.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        if self.by_priority:
            self._enqueue_by_priority(victim)
        else:
            self.waiting.appendleft(victim)

    def _victim(self, scheduled: set[str]) -> Request | None:
        """The running request to preempt for blocks: the last in priority order (scheduled this round or
        not), else the most recent arrival not yet scheduled this round."""
        if self.by_priority:
            return max(self.running, key=priority_key, default=None)
        return next((r for r in reversed(self.running) if r.request_id not in scheduled), None)

    def _chunk(self, req: Request, budget: int) -> int:
        """Tokens to feed this step: up to the budget, and not past the request's cache split point."""
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        split = req.cache_split_at
        if split is not None and req.num_computed_tokens < split:
            n = min(n, split - req.num_computed_tokens)
        return n

    def _take_cache_points(self, out: ScheduledBatch) -> None:
        """Cache the state of requests whose prefill stopped at their split point in the last step."""
        for req in self.running:
            split = req.cache_split_at
            if split is None or req.num_computed_tokens < split:
                continue
            self.blocks.drop_split(req)
            if req.num_computed_tokens == split:
                copy = self.blocks.add_prefix(req)
                if copy is not None:
                    out.state_copies.append(copy)

    def _admit(self, req: Request, budget: int, out: ScheduledBatch) -> bool:
        """Start a waiting request (from its longest cached prefix, if any); False if it does not fit."""
        entry = self.blocks.match_prefix(req)
        if entry is not None and not self.blocks.can_attach(entry):
            entry = None
        block_copy = self.blocks.attach_prefix(req, entry) if entry is not None else None
        first = req.num_preemptions == 0
        prefix = self.blocks.prefix
        if prefix is not None and first:
            self.blocks.plan_split(req)
        n = self._chunk(req, budget)
        n_alloc = self._alloc_len(req, n)
        if not self.blocks.can_allocate(req, n_alloc) or not self.blocks.allocate_slot(req):
            self.blocks.free(req)
            req.num_computed_tokens = 0
            return False
        assert req.state_slot is not None
        if prefix is not None and first:
            prefix.record(req.block_digests(self.blocks.block_size))
            req.num_cached_tokens = req.num_computed_tokens
            self.num_prefix_query_tokens += req.num_prompt_tokens
            self.num_prefix_hit_tokens += req.num_computed_tokens
        if entry is not None:
            out.state_copies.append((entry.state_slot, req.state_slot))
            if block_copy is not None:
                out.block_copies.append(block_copy)
        else:
            out.new_state_slots.append(req.state_slot)
        self.blocks.allocate(req, n_alloc)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.requests.append(req)
        out.num_new_tokens.append(n)
        return True

    def schedule(self) -> ScheduledBatch:
        if not self.num_spec_tokens:
            return self._keep_copies(self._schedule(verify=False))
        # Speculative decoding: a step is either a verify step (every decoding request feeds its last token and
        # its drafts) or a prefill step; they alternate while both have work, so that neither new requests nor
        # running ones wait on the other.
        has_decode = any(self.is_spec_decode(r) for r in self.running)
        verify = has_decode and (not self._last_verify or not self._has_prefill_work())
        out = self._schedule(verify)
        if out.empty and has_decode and not verify:
            retry = self._schedule(verify=True)
            retry.state_copies[:0] = out.state_copies
            retry.block_copies[:0] = out.block_copies
            retry.num_preempted += out.num_preempted
            out = retry
        self._last_verify = out.spec_verify
        return self._keep_copies(out)

    def _keep_copies(self, out: ScheduledBatch) -> ScheduledBatch:
        """Copies a round decided (a cut's state into its new entry) must run even when the round scheduled
        no request: they wait for the next batch that runs, ahead of its own."""
        if out.empty:
            self._pending_state_copies += out.state_copies
            self._pending_block_copies += out.block_copies
            out.state_copies, out.block_copies = [], []
        elif self._pending_state_copies or self._pending_block_copies:
            out.state_copies[:0] = self._pending_state_copies
            out.block_copies[:0] = self._pending_block_copies
            self._pending_state_copies, self._pending_block_copies = [], []
        return out

    def is_spec_decode(self, req: Request) -> bool:
        """Whether a running request is past its prefill with drafts to verify (speculative decoding)."""
        return req.num_tokens - req.num_computed_tokens == 1 and len(req.draft_token_ids) == self.num_spec_tokens

    def _has_prefill_work(self) -> bool:
        return bool(self.waiting) or any(not self.is_spec_decode(r) for r in self.running)

    def _alloc_len(self, req: Request, n: int) -> int:
        """Tokens to hold blocks for when feeding n: under speculative decoding a chunk that ends the known
        tokens is followed by the MTP head's draft steps, which write its KV up to num_spec_tokens - 1
        positions further."""
        if self.draft_kv_len and req.num_computed_tokens + n == req.num_tokens:
            return n + self.draft_kv_len
        return n

    def _schedule(self, verify: bool) -> ScheduledBatch:
        out = ScheduledBatch(spec_verify=verify)
        self.blocks.begin_round()
        if self.blocks.prefix is not None and self.blocks.prefix.splitting:  # a cut is under way
            self._take_cache_points(out)
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()
        k = self.num_spec_tokens
        # Decodes first (one token each) so running requests keep their pace, then running prefills. Verify
        # steps take the requests furthest behind first, so that a token budget too small for all of them
        # cannot leave the same ones out step after step.
        if verify:
            order = sorted(self.running, key=lambda r: r.num_output_tokens)
        else:
            order = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        for req in order:
            if req not in self.running or budget <= 0:
                continue
            max_tokens = req.sampling_params.max_tokens
            done = max_tokens is not None and req.num_output_tokens + req.num_pending_tokens >= max_tokens
            if req.pending_rows and done:
                continue  # finishes when its pending tokens are seen: another step would run past its end
            if k and self.is_spec_decode(req) != verify:
                continue
            if verify:
                n, n_alloc = k + 1, k + 1 + self.draft_kv_len
                if n > budget:
                    continue
            else:
                n = self._chunk(req, budget)
                n_alloc = self._alloc_len(req, n)
            if n <= 0:
                continue
            while not self.blocks.can_allocate(req, n_alloc):
                victim = self._victim(scheduled)
                if victim is None:
                    break
                if victim.request_id in scheduled:  # priority: an earlier pick of this round gives its tokens back
                    i = out.requests.index(victim)
                    del out.requests[i]
                    budget += out.num_new_tokens.pop(i)
                    scheduled.discard(victim.request_id)
                self._preempt(victim)
                out.num_preempted += 1
                if victim is req:
                    break
            if req not in self.running or not self.blocks.can_allocate(req, n_alloc):
                continue
            self.blocks.allocate(req, n_alloc)
            out.requests.append(req)
            out.num_new_tokens.append(n)
            scheduled.add(req.request_id)
            budget -= n
        # Under priority scheduling (as in vLLM) blocks freed by a preemption are for the running requests.
        admit = not verify and not (self.by_priority and out.num_preempted)
        i = 0
        while admit and i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[i]
            if self.blocks.awaits_cut(req):
                i += 1  # starts from the cached prefix once the request being cut there gets that far
                continue
            if not self._admit(req, budget, out):
                break
            del self.waiting[i]
            budget -= out.num_new_tokens[-1]
        return out
