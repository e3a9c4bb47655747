"""Prefix caching for a hybrid model: reuse the KV blocks and the GDN state of a prompt prefix that an
earlier request computed.

For full attention, a cached prefix is its KV blocks. Gated DeltaNet layers have no per-token cache: a
sequence's whole past is one recurrent state (plus the conv window), which cannot be rewound. So an entry
is a block-aligned prefix with both: the KV blocks of its tokens (shared by reference count, never written
again: the requests that use them only append after the prefix) and a copy of the GDN state taken at
exactly that token, in a slot of the state pool.

Where to take the state copies? Taking one at every block boundary would cost a state slot (about 150 MB
for Qwen3.5-122B) per 16 tokens. Instead the cache remembers the chain digest of every full prompt block it
has seen. A new prompt whose first d blocks some earlier prompt also had (a shared system prompt, the
previous turn of a conversation, a repeated prompt) is the sign that this prefix recurs: its prefill is cut
into a chunk that ends at block boundary d, the state is copied there (`StepInputs.state_copies`, before the
next step's forward pass), and later prompts with the same first d blocks start from it. The request that
finds the shared prefix pays one extra prefill step and no recomputation is saved for it; every later one
skips those tokens.

A cut costs the request an extra prefill step, so a prompt is cut only where the shared part is long enough
to be worth it (`MIN_SPLIT_TOKENS`: short common openings such as a chat template's first tokens are not),
and only one running request is cut per prefix at a time (several requests for the same prompt at once,
e.g. n > 1, would otherwise all pay for the same entry).

An entry leaves at least one prompt token to compute (the sampler needs the last prompt token's logits).
Entries are evicted least recently used when blocks or state slots run short, before any running request
is preempted, and never in the scheduling round that created or used them (their copies are still to run).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


def block_digests(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chain digests of the full blocks: entry i identifies token_ids[:(i + 1) * block_size] (each block's
    tokens hashed together with the digest of the blocks before it)."""
    data = array("q", token_ids).tobytes()
    step = 8 * block_size
    out: list[bytes] = []
    parent = b""
    for i in range(len(token_ids) // block_size):
        parent = hashlib.blake2b(data[i * step:(i + 1) * step], digest_size=16, key=parent).digest()
        out.append(parent)
    return out


MIN_SPLIT_TOKENS = 256


@dataclass
class PrefixEntry:
    """A cached prefix: its first num_tokens tokens (num_blocks full blocks) have their KV in `block_ids`
    and their GDN state in `state_slot`. `round`: the scheduling round that last created or used it."""

    digest: bytes
    num_tokens: int
    block_ids: list[int]
    state_slot: int
    round: int


class PrefixIndex:
    """The entries (least recently used first) and the bounded record of prompt blocks seen so far."""

    def __init__(self, block_size: int, max_seen: int = 1 << 16, min_split_tokens: int = MIN_SPLIT_TOKENS) -> None:
        self.block_size = block_size
        self.max_seen = max_seen
        self.min_split_tokens = min_split_tokens
        self.entries: OrderedDict[bytes, PrefixEntry] = OrderedDict()
        self.seen: OrderedDict[bytes, None] = OrderedDict()
        self.splitting: set[bytes] = set()

    def __len__(self) -> int:
        return len(self.entries)

    def _max_depth(self, digests: list[bytes], num_tokens: int) -> int:
        return min(len(digests), (num_tokens - 1) // self.block_size)

    def match(self, digests: list[bytes], num_tokens: int) -> PrefixEntry | None:
        """The longest entry that is a prefix of a prompt of num_tokens tokens (digests: its
        `block_digests`) and leaves at least one of them to compute; marked most recently used."""
        for depth in range(self._max_depth(digests, num_tokens), 0, -1):
            entry = self.entries.get(digests[depth - 1])
            if entry is not None:
                self.entries.move_to_end(entry.digest)
                return entry
        return None

    def split_point(self, digests: list[bytes], num_tokens: int, start: int) -> int | None:
        """The deepest block boundary past `start` (tokens already there) up to which an earlier prompt
        had the same tokens: where this prompt's state is worth keeping. None when that prefix adds fewer
        than min_split_tokens to `start`, is already cached, or another running request is cut there."""
        lowest = (start + self.min_split_tokens - 1) // self.block_size
        for depth in range(self._max_depth(digests, num_tokens), lowest, -1):
            d = digests[depth - 1]
            if d in self.seen:
                return None if d in self.entries or d in self.splitting else depth * self.block_size
        return None

    def record(self, digests: list[bytes]) -> None:
        """Remember a prompt's blocks (the oldest records go first beyond max_seen)."""
        for d in digests:
            self.seen[d] = None
            self.seen.move_to_end(d)
        while len(self.seen) > self.max_seen:
            self.seen.popitem(last=False)

    def add(self, entry: PrefixEntry) -> None:
        self.entries[entry.digest] = entry

    def remove_split(self, digest: bytes) -> None:
        self.splitting.discard(digest)

    def evictable(self, current_round: int) -> PrefixEntry | None:
        """The least recently used entry not created or used in `current_round`."""
        return next((e for e in self.entries.values() if e.round != current_round), None)

    def remove(self, entry: PrefixEntry) -> None:
        del self.entries[entry.digest]

    def clear(self) -> list[PrefixEntry]:
        """Forget everything; returns the entries (whose blocks and slot the caller releases)."""
        out = list(self.entries.values())
        self.entries.clear()
        self.seen.clear()
        self.splitting.clear()
        return out
