"""Continuous batching with chunked prefill and preemption.

Every step the scheduler fills a token budget: first one token for each running request that is decoding,
then the next prefill chunk of running requests still prefilling, then new requests from the waiting
queue (FIFO) as long as sequences, state slots, blocks and budget allow. When the KV cache runs out for a
running request, the most recently arrived running request is preempted: its caches are freed and it goes
back to the front of the waiting queue, to be recomputed later (its generated tokens are kept).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nibble.engine.block_manager import BlockManager
from nibble.engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """What one step runs: requests with the number of tokens each feeds, and slots to zero first."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    new_state_slots: list[int] = field(default_factory=list)
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

    def schedule(self) -> ScheduledBatch:
        out = ScheduledBatch()
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
            n = min(req.num_tokens - req.num_computed_tokens, budget)
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
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.blocks.can_allocate(req, n):
                break
            if not self.blocks.allocate_slot(req):
                break
            self.waiting.popleft()
            assert req.state_slot is not None
            out.new_state_slots.append(req.state_slot)
            self.blocks.allocate(req, n)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.requests.append(req)
            out.num_new_tokens.append(n)
            budget -= n
        return out
