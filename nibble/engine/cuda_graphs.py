"""CUDA graphs for decode steps: one graph per padded batch size, all sharing static input buffers and one
memory pool. A decode batch of B sequences runs the smallest captured size >= B; padded rows read block 0
and state slot 0 (reserved scratch) and write no KV (slot -1)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from nibble.kernels.host_copy import to_device_async
from nibble.layers.forward_batch import ForwardBatch, ModelCaches

logger = logging.getLogger("nibble.engine")

T = TypeVar("T")


def capture_graph(step: Callable[[], T], pool: tuple | None, capture_error_mode: str,
                  device: torch.device) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run `step` once eagerly (its kernels compile, its allocations settle), then capture it into `pool`
    (None: a new pool, `graph.pool()`); returns the graph and the output the capture produced."""
    step()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_error_mode):
        out = step()
    return graph, out


def capture_sizes(max_batch_size: int) -> list[int]:
    sizes = [1, 2, 4, 8, *range(16, 64, 8), *range(64, 256, 16), *range(256, 1025, 64)]
    return [s for s in sizes if s <= max_batch_size] or [1]


class DecodeGraphs:
    """Captured decode steps of `model` for batch sizes up to max_batch_size.

    thread_local_capture: capture in "thread_local" error mode, for tensor-parallel ranks whose graphs hold
    NCCL collectives: the process group's watchdog thread keeps querying CUDA events during the capture,
    which the default ("global") mode would turn into a capture error.
    """

    def __init__(self, model: nn.Module, caches: ModelCaches, max_batch_size: int, max_num_blocks_per_seq: int,
                 max_seq_len: int, device: torch.device, thread_local_capture: bool = False) -> None:
        self.model = model
        self.capture_error_mode = "thread_local" if thread_local_capture else "global"
        self.caches = caches
        self.sizes = capture_sizes(max_batch_size)
        self.max_batch_size = self.sizes[-1]
        self.max_seq_len = max_seq_len
        self.device = device
        n = self.max_batch_size
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(n, max_num_blocks_per_seq, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.state_slots = torch.zeros(n, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: tuple | None = None

    def _batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs], cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            seq_lens=self.seq_lens[:bs], block_table=self.block_table[:bs], slot_mapping=self.slot_mapping[:bs],
            state_slots=self.state_slots[:bs], logits_indices=self.logits_indices[:bs], max_query_len=1,
            max_seq_len=self.max_seq_len, cu_seqlens_q_cpu=list(range(bs + 1)), seq_lens_cpu=[1] * bs)

    def _step(self, bs: int) -> torch.Tensor:
        batch = self._batch(bs)
        hidden = self.model(batch, self.caches)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one memory pool (`self.pool`, which other graphs may share)."""
        pool = None
        for bs in reversed(self.sizes):
            graph, out = capture_graph(lambda bs=bs: self._step(bs), pool, self.capture_error_mode, self.device)
            pool = pool or graph.pool()
            self.graphs[bs] = graph
            self.outputs[bs] = out
        self.pool = pool
        torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def padded_size(self, num_seqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_seqs), None)

    @torch.inference_mode()
    def run(self, input_ids: list[int], positions: list[int], seq_lens: list[int], block_tables: list[list[int]],
            slot_mapping: list[int], state_slots: list[int],
            pending: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One decode step for len(input_ids) sequences; returns fp32 logits [num_seqs, vocab]. pending:
        (rows, token ids), both int64 [n] on the device, written over input_ids (tokens not yet on the host)."""
        num_seqs = len(input_ids)
        bs = self.padded_size(num_seqs)
        assert bs is not None
        width = max(len(b) for b in block_tables)
        pad = bs - num_seqs
        flat = [x for b in block_tables for x in (*b, *([0] * (width - len(b))))]
        table = torch.tensor(flat + [0] * (pad * width), dtype=torch.int32).view(bs, width)
        host = torch.tensor([input_ids + [0] * pad, positions + [0] * pad, slot_mapping + [-1] * pad],
                            dtype=torch.int64)
        small = torch.tensor([seq_lens + [1] * pad, state_slots + [0] * pad], dtype=torch.int32)
        host_d = to_device_async(host, self.device)
        small_d = to_device_async(small, self.device)
        self.input_ids[:bs].copy_(host_d[0])
        self.positions[:bs].copy_(host_d[1])
        self.slot_mapping[:bs].copy_(host_d[2])
        self.seq_lens[:bs].copy_(small_d[0])
        self.state_slots[:bs].copy_(small_d[1])
        self.block_table[:bs, :width].copy_(to_device_async(table, self.device))
        if pending is not None:
            self.input_ids[pending[0]] = pending[1]
        self.graphs[bs].replay()
        return self.outputs[bs][:num_seqs]
