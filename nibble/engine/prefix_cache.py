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
and only one running request is cut per prefix at a time. The others that share that prefix (a burst of
requests with one system prompt, n > 1) wait in the queue until its entry exists instead of computing the
prefix once more each; they then start from it.

A request that ends (stop, length, abort) also leaves an entry of everything it computed, prompt and
output, at whatever length that is: it hands its blocks and its state slot over as they are, so this costs no
copy. The next prompt of an agent loop or a completion that continues the text (the same tokens, then more)
starts from there. Such an entry usually ends inside a block: its last, partial block is copied (KV only,
`StepInputs.block_copies`) into the new request's own block, which it then fills on. Until one is used, these
entries are evicted before the cut ones, least recently used first.

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


def salt_root(cache_salt: str | None) -> bytes:
    """The digest a request's chain starts from: b"" without a salt, else the salt's own digest, so that no
    entry of one salt (not even one shorter than a block) matches a request of another."""
    if cache_salt is None:
        return b""
    return hashlib.blake2b(cache_salt.encode("utf-8"), digest_size=16, person=b"nibble-salt").digest()


def block_digests(token_ids: Sequence[int], block_size: int, known: Sequence[bytes] = (),
                  root: bytes = b"") -> list[bytes]:
    """Chain digests of the full blocks: entry i identifies token_ids[:(i + 1) * block_size] (each block's
    tokens hashed together with the digest of the blocks before it, the first with `root`, see `salt_root`).
    known: the digests of the first blocks, already computed (e.g. the prompt's), which the chain continues
    from."""
    out = list(known[:len(token_ids) // block_size])
    start = len(out) * block_size
    data = array("q", token_ids[start:len(token_ids) // block_size * block_size]).tobytes()
    step = 8 * block_size
    parent = out[-1] if out else root
    for i in range(len(data) // step):
        parent = hashlib.blake2b(data[i * step:(i + 1) * step], digest_size=16, key=parent).digest()
        out.append(parent)
    return out


MIN_SPLIT_TOKENS = 256  # also the fewest tokens an ended request must have computed to leave an entry


@dataclass
class PrefixEntry:
    """A cached prefix: its first num_tokens tokens have their KV in `block_ids` (the full blocks, then the
    partial one holding `tail`, the tokens past the last full block) and their GDN state in `state_slot`.
    digest: the chain digest of its full blocks (its root, `salt_root`, for none); finished: left by an ended
    request and not used yet (evicted first); round: the scheduling round that last created or used it."""

    digest: bytes
    num_tokens: int
    block_ids: list[int]
    state_slot: int
    round: int
    tail: tuple[int, ...] = ()
    finished: bool = False

    @property
    def key(self) -> tuple[bytes, tuple[int, ...]]:
        return self.digest, self.tail


class PrefixIndex:
    """The entries (least recently used first) and the bounded record of prompt blocks seen so far."""

    def __init__(self, block_size: int, max_seen: int = 1 << 16, min_split_tokens: int = MIN_SPLIT_TOKENS) -> None:
        self.block_size = block_size
        self.max_seen = max_seen
        self.min_split_tokens = min_split_tokens
        self.entries: OrderedDict[tuple[bytes, tuple[int, ...]], PrefixEntry] = OrderedDict()
        self.tails: dict[bytes, set[tuple[int, ...]]] = {}
        # entries per block digest (aligned or with a tail after it)
        self.digests: dict[bytes, int] = {}
        self.seen: OrderedDict[bytes, None] = OrderedDict()
        self.splitting: set[bytes] = set()
        # bumped whenever entries, cuts under way or the recorded blocks change: what `match` and
        # `awaits_split` answer for a prompt can only change with it
        self.version = 0

    def __len__(self) -> int:
        return len(self.entries)

    def has_aligned(self, digest: bytes) -> bool:
        return (digest, ()) in self.entries

    def match(self, digests: list[bytes], token_ids: Sequence[int], touch: bool = True,
              root: bytes = b"") -> PrefixEntry | None:
        """The longest entry whose tokens begin `token_ids` (digests: their `block_digests` from `root`) and
        leave at least one of them to compute; marked most recently used unless touch is False."""
        n = len(token_ids)
        bs = self.block_size
        for depth in range(min(len(digests), (n - 1) // bs), -1, -1):
            digest = digests[depth - 1] if depth else root
            if digest not in self.digests:
                continue  # most depths: one lookup (a long prompt is matched every round while it waits)
            start = depth * bs
            for tail in sorted(self.tails.get(digest, ()), key=len, reverse=True):
                if start + len(tail) < n and tuple(token_ids[start:start + len(tail)]) == tail:
                    return self._used(self.entries[digest, tail], touch)
            entry = self.entries.get((digest, ())) if depth else None
            if entry is not None:
                return self._used(entry, touch)
        return None

    def _used(self, entry: PrefixEntry, touch: bool) -> PrefixEntry:
        if touch:
            self.entries.move_to_end(entry.key)
        return entry

    def _deepest_shared(self, digests: list[bytes], num_tokens: int, start: int) -> int | None:
        """The deepest full-block depth, at least min_split_tokens past `start` and leaving a token to
        compute, whose digest an earlier prompt had; None if there is none."""
        lowest = (start + self.min_split_tokens - 1) // self.block_size
        for depth in range(min(len(digests), (num_tokens - 1) // self.block_size), lowest, -1):
            if digests[depth - 1] in self.seen:
                return depth
        return None

    def split_point(self, digests: list[bytes], num_tokens: int, start: int) -> int | None:
        """The deepest block boundary past `start` (tokens already there) up to which an earlier prompt
        had the same tokens: where this prompt's state is worth keeping. None when that prefix adds fewer
        than min_split_tokens to `start`, is already cached, or another running request is cut there."""
        depth = self._deepest_shared(digests, num_tokens, start)
        if depth is None:
            return None
        d = digests[depth - 1]
        return None if self.has_aligned(d) or d in self.splitting else depth * self.block_size

    def awaits_split(self, digests: list[bytes], num_tokens: int, start: int) -> bool:
        """Whether the prefix this prompt shares with earlier ones (as `split_point` finds it) is being cut
        for by a running request: waiting for that entry beats computing the prefix once more."""
        depth = self._deepest_shared(digests, num_tokens, start)
        return depth is not None and digests[depth - 1] in self.splitting

    def record(self, digests: list[bytes]) -> None:
        """Remember a prompt's blocks (the oldest records go first beyond max_seen)."""
        for d in digests:
            if d not in self.seen:
                self.version += 1
            self.seen[d] = None
            self.seen.move_to_end(d)
        while len(self.seen) > self.max_seen:
            self.seen.popitem(last=False)
            self.version += 1

    def add_split(self, digest: bytes) -> None:
        self.splitting.add(digest)
        self.version += 1

    def add(self, entry: PrefixEntry) -> None:
        self.version += 1
        self.entries[entry.key] = entry
        self.digests[entry.digest] = self.digests.get(entry.digest, 0) + 1
        if entry.tail:
            self.tails.setdefault(entry.digest, set()).add(entry.tail)

    def remove_split(self, digest: bytes) -> None:
        self.splitting.discard(digest)
        self.version += 1

    def evictable(self, current_round: int) -> PrefixEntry | None:
        """The entry to evict: the least recently used finished one never used since, else the least
        recently used one; never one created or used in `current_round`."""
        fallback = None
        for e in self.entries.values():
            if e.round == current_round:
                continue
            if e.finished:
                return e
            fallback = fallback or e
        return fallback

    def remove(self, entry: PrefixEntry) -> None:
        self.version += 1
        del self.entries[entry.key]
        self.digests[entry.digest] -= 1
        if not self.digests[entry.digest]:
            del self.digests[entry.digest]
        if entry.tail:
            tails = self.tails[entry.digest]
            tails.discard(entry.tail)
            if not tails:
                del self.tails[entry.digest]

    def clear(self) -> list[PrefixEntry]:
        """Forget everything; returns the entries (whose blocks and slot the caller releases)."""
        out = list(self.entries.values())
        self.version += 1
        self.entries.clear()
        self.digests.clear()
        self.tails.clear()
        self.seen.clear()
        self.splitting.clear()
        return out
