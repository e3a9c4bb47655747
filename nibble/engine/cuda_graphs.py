"""CUDA graphs for decode steps: one graph per padded batch size, all sharing static input buffers and one
memory pool. A decode batch of B sequences runs the smallest captured size >= B; padded rows read block 0
and state slot 0 (reserved scratch), write no KV (slot -1) and are routed to no expert (the batch's
num_valid_tokens is B), so they cost the MoE blocks nothing.

`capture_set` captures any of the runner's graph sets (these, mixed_graphs.py's, spec_decode.py's verify
graphs) size by size, the tensor-parallel ranks in step."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from nibble.engine.parallel import rank_failures
from nibble.kernels.host_copy import to_device_async
from nibble.layers.forward_batch import ForwardBatch, ModelCaches
from nibble.layers.parallel import SINGLE, ParallelContext

logger = logging.getLogger("nibble.engine")

T = TypeVar("T")


class GraphSet(Protocol):
    """Graphs captured one size (key) at a time: `capture_one(key)` for each of `capture_keys()`, in order."""

    device: torch.device

    def capture_keys(self) -> list[Any]: ...

    def capture_one(self, key: Any) -> None: ...


def capture_set(graphs: GraphSet, what: str, parallel: ParallelContext = SINGLE, min_free_bytes: int = 0) -> bool:
    """Capture every size of `graphs`; False (logged: `what` then runs eagerly) if it fails in any way.

    Each size's capture runs the model, collectives included, so tensor-parallel ranks must capture the same
    sizes in the same order: before the set they agree (`rank_failures`) that each has min_free_bytes free (a
    lower bound of what the set keeps), after each size that each captured it, and a failure anywhere makes
    every rank drop the set. A rank failing between two collectives of a size's eager run still leaves the
    others waiting in the next one (until the process group's timeout): only the memory check keeps a
    certain shortfall out of there. At tensor-parallel size 1 nothing is agreed and the first failure drops
    the set."""
    if parallel.is_parallel:
        failures = rank_failures(parallel, _memory_shortfall(graphs.device, min_free_bytes))
        if failures:
            _log_dropped(what, "before the first size", failures, parallel)
            return False
    t0 = time.perf_counter()
    keys = graphs.capture_keys()
    for key in keys:
        error = None
        try:
            graphs.capture_one(key)
        except Exception as e:  # any capture failure means: run eagerly
            error = f"{type(e).__name__}: {e}"
            if parallel.is_parallel:
                logger.warning("CUDA graph capture of %s failed at size %s on this rank", what, key, exc_info=True)
            _recover(graphs.device)
        failures = rank_failures(parallel, error)
        if failures:
            _log_dropped(what, f"at size {key}", failures, parallel)
            return False
    if graphs.device.type == "cuda":
        torch.cuda.synchronize(graphs.device)
    logger.info("CUDA graphs for %s ready in %.1f s, sizes %s", what, time.perf_counter() - t0, keys)
    return True


def _recover(device: torch.device) -> None:
    """Leave the device usable for eager steps after a failed capture, without raising: this rank must still
    reach the agreement the other ranks wait in."""
    if device.type != "cuda":
        return
    try:
        # a capture whose end failed leaves its side stream current (torch.cuda.graph's exit stops at
        # capture_end); the engine runs on the default stream
        torch.cuda.set_stream(torch.cuda.default_stream(device))
        torch.cuda.synchronize(device)
    except Exception:  # a sticky device error: the next eager step reports it
        logger.warning("the device did not recover cleanly from the failed capture", exc_info=True)


def _memory_shortfall(device: torch.device, need: int) -> str | None:
    """Why `need` bytes cannot fit on `device` now, or None if they may."""
    if device.type != "cuda" or need <= 0:
        return None
    free = torch.cuda.mem_get_info(device)[0]
    # the caching allocator hands its unused blocks back to the driver before an allocation fails
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if free >= need:
        return None
    return f"{free / 2**30:.2f} GiB free, the graphs' outputs alone take {need / 2**30:.2f} GiB"


def _log_dropped(what: str, where: str, failures: dict[int, str], parallel: ParallelContext) -> None:
    if not parallel.is_parallel:
        logger.warning("CUDA graph capture of %s failed %s (%s); they run eagerly", what, where,
                       failures[parallel.tp_rank])
        return
    who = ", ".join(f"rank {rank} ({why})" for rank, why in sorted(failures.items()))
    logger.warning("CUDA graph capture of %s failed %s on %s; every rank runs them eagerly", what, where, who)


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
        self.num_valid_tokens = torch.full((1,), n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: tuple | None = None

    def _batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs], cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            seq_lens=self.seq_lens[:bs], block_table=self.block_table[:bs], slot_mapping=self.slot_mapping[:bs],
            state_slots=self.state_slots[:bs], logits_indices=self.logits_indices[:bs], max_query_len=1,
            max_seq_len=self.max_seq_len, cu_seqlens_q_cpu=list(range(bs + 1)), seq_lens_cpu=[1] * bs,
            num_valid_tokens=self.num_valid_tokens)

    def _step(self, bs: int) -> torch.Tensor:
        batch = self._batch(bs)
        hidden = self.model(batch, self.caches)
        return self.model.compute_logits(hidden)

    def capture_keys(self) -> list[int]:
        """The batch sizes, largest first: the smaller ones reuse its memory."""
        return sorted(self.sizes, reverse=True)

    @torch.inference_mode()
    def capture_one(self, bs: int) -> None:
        """Capture batch size bs into `self.pool` (which other graphs may share; the first capture makes it)."""
        graph, out = capture_graph(lambda: self._step(bs), self.pool, self.capture_error_mode, self.device)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[bs] = graph
        self.outputs[bs] = out

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
        # the sequence count rides in a spare column of the same copy
        small = torch.tensor([seq_lens + [1] * pad + [num_seqs], state_slots + [0] * pad + [0]], dtype=torch.int32)
        host_d = to_device_async(host, self.device)
        small_d = to_device_async(small, self.device)
        self.input_ids[:bs].copy_(host_d[0])
        self.positions[:bs].copy_(host_d[1])
        self.slot_mapping[:bs].copy_(host_d[2])
        self.seq_lens[:bs].copy_(small_d[0, :bs])
        self.state_slots[:bs].copy_(small_d[1, :bs])
        self.num_valid_tokens.copy_(small_d[0, bs:])
        self.block_table[:bs, :width].copy_(to_device_async(table, self.device))
        if pending is not None:
            self.input_ids[pending[0]] = pending[1]
        self.graphs[bs].replay()
        return self.outputs[bs][:num_seqs]
