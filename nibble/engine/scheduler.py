"""Continuous batching with chunked prefill and preemption.

Every step the scheduler fills a token budget: first one token for each running request that is decoding,
then the next prefill chunk of running requests still prefilling, then new requests from the waiting
queue (FIFO) as long as sequences, state slots, blocks and budget allow. When the KV cache runs out for a
running request, the most recently arrived running request is preempted: its caches are freed and it goes
back to the front of the waiting queue, to be recomputed later (its generated tokens are kept).

With prefix caching (prefix_cache.py) a new request starts from the longest cached prefix of its prompt:
its state slot is filled by a copy instead of being zeroed, and its prefill starts after the prefix. A
prompt that shares blocks with an earlier prompt has its prefill cut at the end of the shared part, and
the round after the cut copies its state into a new entry; new requests sharing that prefix wait for it. A
request that ends leaves its blocks and state to an entry of everything it computed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nibble.engine.block_manager import BlockManager
from nibble.engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """What one step runs: requests with the number of tokens each feeds, and before it the GDN state
    copies (source slot, destination slot), the KV block copies (source block, destination block) and
    then the slots to zero."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    new_state_slots: list[int] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.blocks = block_manager
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
        self.waiting.append(request)

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
        self.waiting.appendleft(victim)

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
        if not self.blocks.can_allocate(req, n) or not self.blocks.allocate_slot(req):
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
        self.blocks.allocate(req, n)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.requests.append(req)
        out.num_new_tokens.append(n)
        return True

    def schedule(self) -> ScheduledBatch:
        out = ScheduledBatch()
        self.blocks.begin_round()
        if self.blocks.prefix is not None and self.blocks.prefix.splitting:  # a cut is under way
            self._take_cache_points(out)
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()
        # Decodes first (one token each) so running requests keep their pace, then running prefills.
        order = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        for req in order:
            if req not in self.running or budget <= 0:
                continue
            max_tokens = req.sampling_params.max_tokens
            done = max_tokens is not None and req.num_output_tokens + req.num_pending_tokens >= max_tokens
            if req.pending_rows and done:
                continue  # finishes when its pending tokens are seen: another step would run past its end
            n = self._chunk(req, budget)
            if n <= 0:
                continue
            while not self.blocks.can_allocate(req, n):
                victim = next((r for r in reversed(self.running) if r.request_id not in scheduled), None)
                if victim is None:
                    break
                self._preempt(victim)
                out.num_preempted += 1
                if victim is req:
                    break
            if req not in self.running or not self.blocks.can_allocate(req, n):
                continue
            self.blocks.allocate(req, n)
            out.requests.append(req)
            out.num_new_tokens.append(n)
            scheduled.add(req.request_id)
            budget -= n
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[i]
            if self.blocks.awaits_cut(req):
                i += 1  # starts from the cached prefix once the request being cut there gets that far
                continue
            if not self._admit(req, budget, out):
                break
            del self.waiting[i]
            budget -= out.num_new_tokens[-1]
        return out
