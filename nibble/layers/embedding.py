"""Token embedding and the output head, vocab-parallel under tensor parallelism.

Each rank holds a contiguous slice of ceil(vocab / tp) vocabulary rows (the last slice zero-padded when the
vocabulary does not divide). The embedding looks up the ids of its slice, zeroes the others and all-reduces;
the head computes its slice of the logits and all-gathers them, so every rank ends with the full logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nibble.layers.parallel import SINGLE, ParallelContext, Partition, TensorSource, read_partition


class Embedding(nn.Module):
    """input_ids int64 [T] -> [T, H]; `weight` [vocab_per_rank, H] holds rows [vocab_start, vocab_start +
    vocab_per_rank) of the checkpoint matrix."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str,
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight, self.partition = _vocab_rows(vocab_size, hidden_size, dtype, device, parallel)
        self.vocab_per_rank = int(self.weight.shape[0])
        self.vocab_start = self.partition.ranges[0][0]

    def load(self, tensor: TensorSource) -> None:
        """Copy this rank's rows of the checkpoint's [vocab, H] matrix."""
        self.weight.data[: self.partition.size].copy_(read_partition(tensor, (self.partition,)))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.parallel.is_parallel:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.parallel.all_reduce(out)


class LMHead(nn.Module):
    """hidden [N, H] -> fp32 logits [N, vocab] (on every rank). Shares the embedding matrix when the config
    ties them."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str,
                 tied: Embedding | None = None, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.tied = tied
        self.parallel = parallel
        self.vocab_size = vocab_size
        if tied is None:
            self.weight, self.partition = _vocab_rows(vocab_size, hidden_size, dtype, device, parallel)

    def load(self, tensor: TensorSource) -> None:
        """Copy this rank's rows of the checkpoint's lm_head [vocab, H] (untied heads only)."""
        self.weight.data[: self.partition.size].copy_(read_partition(tensor, (self.partition,)))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.tied.weight if self.tied is not None else self.weight
        logits = F.linear(hidden, w).float()
        if not self.parallel.is_parallel:
            return logits
        return self.parallel.all_gather(logits)[:, : self.vocab_size]


def _vocab_rows(vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str,
                parallel: ParallelContext) -> tuple[nn.Parameter, Partition]:
    """This rank's [ceil(vocab / tp), H] parameter (padding rows zeroed) and the checkpoint rows it holds."""
    part, per_rank = parallel.split_padded(vocab_size)
    weight = nn.Parameter(torch.empty(per_rank, hidden_size, dtype=dtype, device=device), requires_grad=False)
    if part.size < per_rank:
        weight.data[part.size:].zero_()
    return weight, part
