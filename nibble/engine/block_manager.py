"""Allocation of KV-cache blocks (full-attention layers) and GDN state slots (linear-attention layers), and
the prefix cache's share of both (prefix_cache.py).

Block 0 and slot 0 are reserved scratch space: padded rows of a CUDA-graph batch point there, so they
never touch a live sequence's cache. Blocks are reference counted: a cached prefix's blocks are shared by
the entry and by every request that starts from it.
"""

from __future__ import annotations

from collections import deque

from nibble.engine.prefix_cache import PrefixEntry, PrefixIndex, block_digests
from nibble.engine.request import Request


class BlockManager:
    """num_blocks blocks of block_size tokens and num_state_slots GDN slots, both with 1 reserved.
    prefix_caching: keep cached prefixes (they live on free capacity: evicted whenever blocks or slots
    are short). num_spec_slots: slots each request holds besides its own (speculative decoding: where a
    verify step leaves the GDN states after each draft token)."""

    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int, prefix_caching: bool = False,
                 num_spec_slots: int = 0) -> None:
        if num_blocks < 2 or num_state_slots < 2:
            raise ValueError(f"need at least 2 KV blocks and 2 state slots, got {num_blocks} and {num_state_slots}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_state_slots = num_state_slots
        self.free_blocks: deque[int] = deque(range(1, num_blocks))
        self.free_slots: deque[int] = deque(range(1, num_state_slots))
        self.ref_counts = [0] * num_blocks
        self.prefix: PrefixIndex | None = PrefixIndex(block_size) if prefix_caching else None
        self.round = 0
        self.num_spec_slots = num_spec_slots

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_cached_only_blocks(self) -> int:
        """Blocks that only prefix-cache entries hold (free for the taking by eviction)."""
        if not self.prefix:
            return 0
        refs: dict[int, int] = {}
        # stats() reads this from the server's thread while the engine thread changes the entries: list()
        # takes the values in one go (an entry's block list never changes once it is in the index)
        for entry in list(self.prefix.entries.values()):
            for b in entry.block_ids:
                refs[b] = refs.get(b, 0) + 1
        return sum(self.ref_counts[b] == n for b, n in refs.items())

    @property
    def usage(self) -> float:
        """Fraction of usable KV blocks that requests hold (blocks only the prefix cache holds count as free)."""
        return 1.0 - (self.num_free_blocks + self.num_cached_only_blocks) / self.num_usable_blocks

    def begin_round(self) -> None:
        """Start a scheduling round: entries created or used from now on stay until the next round."""
        self.round += 1

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = request.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Whether the blocks for num_new_tokens more tokens are free, evicting cached prefixes if needed."""
        return self._free_blocks_for(self.blocks_needed(request, num_new_tokens))

    def _free_blocks_for(self, need: int) -> bool:
        """Whether `need` blocks are free, evicting cached prefixes until they are (or none is left)."""
        while need > len(self.free_blocks) and self._evict_one():
            pass
        return need <= len(self.free_blocks)

    def allocate(self, request: Request, num_new_tokens: int) -> None:
        """Grow request.block_ids to cover num_computed_tokens + num_new_tokens tokens."""
        need = self.blocks_needed(request, num_new_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError("allocate() without can_allocate()")
        for _ in range(need):
            b = self.free_blocks.popleft()
            self.ref_counts[b] = 1
            request.block_ids.append(b)

    def _take_slot(self) -> int | None:
        while not self.free_slots and self._evict_one():
            pass
        return self.free_slots.popleft() if self.free_slots else None

    def allocate_slot(self, request: Request) -> bool:
        """Give the request a GDN state slot (and its num_spec_slots spare slots); False when they are not
        all free. The caller zeroes (or fills) the state slot."""
        if request.state_slot is not None:
            return True
        taken: list[int] = []
        for _ in range(1 + self.num_spec_slots):
            slot = self._take_slot()
            if slot is None:
                self.free_slots.extendleft(reversed(taken))
                return False
            taken.append(slot)
        request.state_slot, request.spec_slots = taken[0], taken[1:]
        return True

    def accept_spec_state(self, request: Request, group: list[int], num_accepted: int) -> None:
        """After a verify step that left the state after the last token and draft j in group[j] (group: the
        request's [state_slot] + spec_slots before the step), make the state after num_accepted drafts the
        request's state; the other slots of the group become its spares."""
        request.state_slot = group[num_accepted]
        request.spec_slots = group[:num_accepted] + group[num_accepted + 1:]

    def _release_blocks(self, block_ids: list[int]) -> None:
        for b in block_ids:
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_blocks.append(b)

    def free(self, request: Request) -> None:
        self.drop_split(request)
        self._release_blocks(request.block_ids)
        request.block_ids = []
        if request.state_slot is not None:
            self.free_slots.append(request.state_slot)
            request.state_slot = None
        self.free_slots.extend(request.spec_slots)
        request.spec_slots = []

    def all_free(self) -> bool:
        """Whether no request holds a block or slot (the prefix cache's entries may)."""
        num_entries = len(self.prefix) if self.prefix else 0
        return (len(self.free_blocks) + self.num_cached_only_blocks == self.num_blocks - 1
                and len(self.free_slots) + num_entries == self.num_state_slots - 1)

    def match_prefix(self, request: Request) -> PrefixEntry | None:
        """The longest cached prefix of a request about to start (nothing computed yet), pinned to this round."""
        if self.prefix is None or request.num_computed_tokens or request.block_ids:
            return None
        if request.sampling_params.prompt_logprobs is not None:
            return None  # the log-probabilities of the cached positions were never computed
        entry = self.prefix.match(request.block_digests(self.block_size), request.prefix_key_ids,
                                  root=request.digest_root)
        if entry is not None:
            entry.round = self.round
        return entry

    def can_attach(self, entry: PrefixEntry) -> bool:
        """Whether a request can start from `entry`: one ending inside a block needs a free block (after
        evicting other entries, if need be) for the request's copy of that block."""
        return not entry.tail or self._free_blocks_for(1)

    def attach_prefix(self, request: Request, entry: PrefixEntry) -> tuple[int, int] | None:
        """Start the request from a cached prefix (after `can_attach`): share its full blocks, count its
        tokens as computed, and for an entry ending inside a block give the request a block of its own for
        that block's KV. Returns that block copy (the entry's block, the request's), which the caller runs
        before the next forward pass as it does the state copy into the request's slot; None if none."""
        copy: tuple[int, int] | None = None
        full = entry.block_ids[:entry.num_tokens // self.block_size]
        for b in full:
            self.ref_counts[b] += 1
        request.block_ids = list(full)
        if entry.tail:
            own = self.free_blocks.popleft()
            self.ref_counts[own] = 1
            request.block_ids.append(own)
            copy = (entry.block_ids[-1], own)
        request.num_computed_tokens = entry.num_tokens
        entry.finished = False  # it proved useful: evicted by recency like the others from now on
        return copy

    def plan_split(self, request: Request) -> None:
        """Decide where a request starting now cuts its prefill for the prefix cache (request.cache_split_at)."""
        assert self.prefix is not None
        digests = request.block_digests(self.block_size)
        split = self.prefix.split_point(digests, request.num_prompt_tokens, request.num_computed_tokens)
        request.cache_split_at = split
        if split is not None:
            self.prefix.add_split(digests[split // self.block_size - 1])

    def awaits_cut(self, request: Request) -> bool:
        """Whether a waiting request (never started) should wait for a running request's cut: the prefix it
        shares with earlier prompts is about to become an entry."""
        if self.prefix is None or not self.prefix.splitting or request.num_computed_tokens or request.num_preemptions \
                or request.sampling_params.prompt_logprobs is not None:
            return False
        # asked every round for every waiting request while a cut lasts: the answer is kept until the index changes
        if request.awaits_cut_at is not None and request.awaits_cut_at[0] == self.prefix.version:
            return request.awaits_cut_at[1]
        digests = request.block_digests(self.block_size)
        entry = self.prefix.match(digests, request.prefix_key_ids, touch=False, root=request.digest_root)
        awaits = self.prefix.awaits_split(digests, request.num_prompt_tokens, entry.num_tokens if entry else 0)
        request.awaits_cut_at = (self.prefix.version, awaits)
        return awaits

    def drop_split(self, request: Request) -> None:
        """Forget a request's cut (reached, or the request stopped or was preempted first)."""
        split = request.cache_split_at
        if split is not None and self.prefix is not None:
            self.prefix.remove_split(request.block_digests(self.block_size)[split // self.block_size - 1])
        request.cache_split_at = None

    def add_prefix(self, request: Request) -> tuple[int, int] | None:
        """Cache the request's first num_computed_tokens tokens (a block boundary of its prompt): an entry
        sharing its blocks, with a slot for the state. Returns the state copy to run before the next
        forward pass (request's slot, entry's slot), or None when no slot can be had."""
        assert self.prefix is not None and request.state_slot is not None
        num_tokens = request.num_computed_tokens
        depth = num_tokens // self.block_size
        digest = request.block_digests(self.block_size)[depth - 1]
        if self.prefix.has_aligned(digest):
            return None
        slot = self._take_slot()
        if slot is None:
            return None
        blocks = request.block_ids[:depth]
        for b in blocks:
            self.ref_counts[b] += 1
        self.prefix.add(PrefixEntry(digest, num_tokens, blocks, slot, self.round))
        return request.state_slot, slot

    def cache_finished(self, request: Request) -> None:
        """Turn what an ending request computed (prompt and output, num_computed_tokens of them) into an
        entry that takes over its blocks and state slot as they are; the request keeps the blocks past
        them for `free`. Nothing when caching is off, the request is short, has no slot, fed tokens the
        host has not seen yet, or was in a step that failed."""
        num_tokens = request.num_computed_tokens
        if (self.prefix is None or not request.cacheable or request.state_slot is None
                or num_tokens < self.prefix.min_split_tokens
                or num_tokens > request.num_prompt_tokens + request.num_output_tokens):
            return
        token_ids = request.prefix_key_ids + request.output_token_ids
        depth = num_tokens // self.block_size
        digests = block_digests(token_ids[:depth * self.block_size], self.block_size,
                                known=request.block_digests(self.block_size), root=request.digest_root)
        entry = PrefixEntry(digests[-1] if digests else request.digest_root, num_tokens, [], request.state_slot,
                            self.round, tail=tuple(token_ids[depth * self.block_size:num_tokens]), finished=True)
        if entry.key in self.prefix.entries:
            return
        held = -(-num_tokens // self.block_size)
        entry.block_ids, request.block_ids = request.block_ids[:held], request.block_ids[held:]
        request.state_slot = None
        self.prefix.add(entry)

    def _evict_one(self) -> bool:
        """Drop an entry not pinned to this round (`PrefixIndex.evictable`: ended requests' unused entries
        first, then the least recently used); False when there is none."""
        entry = self.prefix.evictable(self.round) if self.prefix else None
        if entry is None:
            return False
        assert self.prefix is not None
        self.prefix.remove(entry)
        self._release_blocks(entry.block_ids)
        self.free_slots.append(entry.state_slot)
        return True

    def clear_prefix_cache(self) -> None:
        """Drop every cached prefix and the record of prompts seen."""
        if self.prefix is None:
            return
        for entry in self.prefix.clear():
            self._release_blocks(entry.block_ids)
            self.free_slots.append(entry.state_slot)
