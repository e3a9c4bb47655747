"""Allocation of KV-cache blocks (full-attention layers) and GDN state slots (linear-attention layers).

Block 0 and slot 0 are reserved scratch space: padded rows of a CUDA-graph batch point there, so they
never touch a live sequence's cache.
"""

from __future__ import annotations

from collections import deque

from nibble.engine.request import Request


class BlockManager:
    """num_blocks blocks of block_size tokens and num_state_slots GDN slots, both with 1 reserved."""

    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int) -> None:
        if num_blocks < 2 or num_state_slots < 2:
            raise ValueError(f"need at least 2 KV blocks and 2 state slots, got {num_blocks} and {num_state_slots}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_state_slots = num_state_slots
        self.free_blocks: deque[int] = deque(range(1, num_blocks))
        self.free_slots: deque[int] = deque(range(1, num_state_slots))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def usage(self) -> float:
        """Fraction of usable KV blocks in use."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = request.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.blocks_needed(request, num_new_tokens) <= len(self.free_blocks)

    def allocate(self, request: Request, num_new_tokens: int) -> None:
        """Grow request.block_ids to cover num_computed_tokens + num_new_tokens tokens."""
        need = self.blocks_needed(request, num_new_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError("allocate() without can_allocate()")
        for _ in range(need):
            request.block_ids.append(self.free_blocks.popleft())

    def allocate_slot(self, request: Request) -> bool:
        """Give the request a GDN state slot; False when none is free. The caller zeroes the slot."""
        if request.state_slot is not None:
            return True
        if not self.free_slots:
            return False
        request.state_slot = self.free_slots.popleft()
        return True

    def free(self, request: Request) -> None:
        self.free_blocks.extend(request.block_ids)
        request.block_ids = []
        if request.state_slot is not None:
            self.free_slots.append(request.state_slot)
            request.state_slot = None

    def all_free(self) -> bool:
        return (len(self.free_blocks) == self.num_blocks - 1
                and len(self.free_slots) == self.num_state_slots - 1)
