"""Tensor / expert parallelism as the layers see it: which part of every weight this rank holds, and the
collectives that combine the ranks' partial results.

A `ParallelContext` is built once per process (by the engine, see nibble/engine/parallel.py) and handed to
the model constructor, which passes it down to every layer; nothing here is global. With `tp_size == 1`
every collective returns its input untouched and every `Partition` is the whole dimension, so the
single-GPU path does no extra work.

A `Partition` names the rows (or columns) of one checkpoint tensor dimension a rank keeps, as a list of
ranges: one range for a plain column/row split, several when a fused tensor is split part by part (e.g.
GDN's in_proj_qkv = [q | k | v], each split by heads). `read_partition` reads exactly those ranges from a
checkpoint tensor or a lazily read one, so a rank never loads more than its share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist


class ParallelError(ValueError):
    """A model shape that cannot be split over the requested number of ranks."""


@dataclass(frozen=True)
class ParallelContext:
    """This process's place in the tensor-parallel group.

    tp_rank / tp_size: rank and size of the group (one process per GPU). expert_parallel: routed experts are
    divided among the ranks whole (each rank holds num_experts / tp_size of them) instead of each expert's
    intermediate dim being split. group: the process group of the model's collectives (NCCL on GPU, gloo on
    CPU); cpu_group: a gloo group over the same ranks for host-side messages (step broadcast, agreement
    on cache sizes). Both are None when tp_size == 1.
    """

    tp_rank: int = 0
    tp_size: int = 1
    expert_parallel: bool = False
    group: Any = None
    cpu_group: Any = None

    @property
    def is_parallel(self) -> bool:
        return self.tp_size > 1

    def split(self, n: int, what: str) -> Partition:
        """This rank's contiguous 1/tp_size of a dimension of size n (ParallelError if n % tp_size)."""
        if n % self.tp_size:
            raise ParallelError(f"{what} ({n}) is not divisible by --tensor-parallel-size {self.tp_size}")
        size = n // self.tp_size
        return Partition(n, ((self.tp_rank * size, (self.tp_rank + 1) * size),))

    def split_padded(self, n: int) -> tuple[Partition, int]:
        """(this rank's part, rows per rank) of n rows split in ceil(n / tp_size) chunks; the last ranks'
        parts may be short (vocabularies that do not divide)."""
        per_rank = -(-n // self.tp_size)
        start = min(self.tp_rank * per_rank, n)
        return Partition(n, ((start, min(start + per_rank, n)),)), per_rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x [..] over the ranks, in place; x itself when tp_size == 1."""
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C] on every rank -> [N, tp_size * C] (rank r's columns at r*C), on every rank."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def host_min(self, value: int) -> int:
        """The smallest of every rank's `value` (host ints, over the gloo group)."""
        if self.tp_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


SINGLE = ParallelContext()


@dataclass(frozen=True)
class Partition:
    """The part of a checkpoint dimension of size `full` a rank holds: the concatenation of `ranges`
    ([start, stop) each, increasing)."""

    full: int
    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def whole(cls, n: int) -> Partition:
        return cls(n, ((0, n),))

    @classmethod
    def concat(cls, parts: Sequence[Partition]) -> Partition:
        """The partition of a dimension made of `parts` laid end to end (e.g. [q | k | v])."""
        ranges: list[tuple[int, int]] = []
        base = 0
        for p in parts:
            for a, b in p.ranges:
                if b <= a:
                    continue
                if ranges and ranges[-1][1] == base + a:
                    ranges[-1] = (ranges[-1][0], base + b)
                else:
                    ranges.append((base + a, base + b))
            base += p.full
        return cls(base, tuple(ranges) or ((0, 0),))

    @property
    def size(self) -> int:
        return sum(b - a for a, b in self.ranges)

    @property
    def is_whole(self) -> bool:
        return self.ranges == ((0, self.full),)

    def scaled(self, divisor: int, what: str) -> Partition:
        """The same partition in units of `divisor` elements (packed FP4 bytes: 2, NVFP4 block scales: 16);
        every boundary must fall on a unit."""
        if self.full % divisor or any(a % divisor or b % divisor for a, b in self.ranges):
            raise ParallelError(f"{what}: the split {self.ranges} of {self.full} does not fall on multiples of "
                                f"{divisor} (NVFP4 needs every rank's share of K to be a multiple of 16)")
        return Partition(self.full // divisor, tuple((a // divisor, b // divisor) for a, b in self.ranges))


class LazyTensor(Protocol):
    """A checkpoint tensor not read yet: `shape`/`dtype` from the file header, `tensor[index]` reads one
    block (a tuple of step-1 slices), `load()` the whole tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor: ...

    def load(self) -> torch.Tensor: ...


TensorSource = torch.Tensor | LazyTensor


def numel(src: TensorSource) -> int:
    n = 1
    for d in src.shape:
        n *= int(d)
    return n


def read_full(src: TensorSource) -> torch.Tensor:
    return src if isinstance(src, torch.Tensor) else src.load()


def read_partition(src: TensorSource, parts: Sequence[Partition | None]) -> torch.Tensor:
    """src restricted to parts[d] along each dim d (None = whole dim; trailing dims may be left out).

    Reads only the selected blocks; at most one dim may have several ranges (they are concatenated). A
    whole selection of an in-memory tensor returns it without a copy.
    """
    if all(p is None or p.is_whole for p in parts):
        return read_full(src)
    index = [slice(None)] * len(src.shape)
    multi = None
    for d, p in enumerate(parts):
        if p is None:
            continue
        if len(p.ranges) == 1:
            index[d] = slice(*p.ranges[0])
        elif multi is None:
            multi = d
        else:
            raise ValueError("read_partition: only one dim may have several ranges")
    if multi is None:
        return src[tuple(index)]
    pieces = []
    for a, b in parts[multi].ranges:  # type: ignore[union-attr]
        index[multi] = slice(a, b)
        pieces.append(src[tuple(index)])
    return torch.cat(pieces, dim=multi)
