"""Turns a scheduled batch into a model step: sizes and owns the caches, builds ForwardBatch, runs the
model (through CUDA graphs for decode when possible) and returns the logits of the rows to sample."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from nibble.engine.config import EngineConfig
from nibble.engine.cuda_graphs import DecodeGraphs
from nibble.engine.scheduler import ScheduledBatch
from nibble.layers.forward_batch import ForwardBatch, ModelCaches
from nibble.models.config import ModelConfig

logger = logging.getLogger("nibble.engine")

CPU_DEFAULT_KV_GB = 0.25


def cache_budget(engine: EngineConfig, model_config: ModelConfig, max_model_len: int, model: nn.Module,
                 device: torch.device) -> tuple[int, int]:
    """(num_kv_blocks, num_state_slots) that fit the device's memory budget."""
    dtype, kv_dtype = engine.torch_dtype, engine.kv_torch_dtype
    num_slots = engine.max_num_seqs + 1
    state_bytes = num_slots * model_config.gdn_state_bytes_per_seq(dtype.itemsize)
    block_bytes = engine.block_size * model_config.kv_cache_bytes_per_token(kv_dtype.itemsize)
    if engine.extra.get("num_kv_blocks"):
        return int(engine.extra["num_kv_blocks"]), num_slots
    if device.type == "cuda":
        peak = profile_peak_activation_bytes(engine, model_config, model, device)
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * engine.gpu_memory_utilization) - used - peak
        # CUDA graphs keep their own pool (logits and intermediate buffers of the largest batch).
        graph_reserve = 0 if engine.enforce_eager else 512 * 2**20
        kv_bytes = budget - state_bytes - graph_reserve
        if kv_bytes < 2 * block_bytes:
            raise RuntimeError(
                f"not enough GPU memory for the caches: {budget / 2**30:.2f} GiB left after weights "
                f"({used / 2**30:.2f} GiB in use) and activations ({peak / 2**30:.2f} GiB) at "
                f"--gpu-memory-utilization {engine.gpu_memory_utilization}; GDN states need "
                f"{state_bytes / 2**30:.2f} GiB for --max-num-seqs {engine.max_num_seqs}")
        return int(kv_bytes // block_bytes), num_slots
    gb = engine.kv_cache_memory_gb or CPU_DEFAULT_KV_GB
    wanted_blocks = engine.max_num_seqs * -(-max_model_len // engine.block_size) + 1
    return max(2, min(int(gb * 2**30 // block_bytes), wanted_blocks)), num_slots


@torch.inference_mode()
def profile_peak_activation_bytes(engine: EngineConfig, model_config: ModelConfig, model: nn.Module,
                                  device: torch.device) -> int:
    """Run one prefill of the full token budget on scratch caches and return the extra memory it peaked at."""
    num_tokens = engine.max_num_batched_tokens
    blocks = -(-num_tokens // engine.block_size) + 2
    scratch = ModelCaches.allocate(model_config, blocks, engine.block_size, 2, engine.torch_dtype,
                                   engine.kv_torch_dtype, device)
    batch = ForwardBatch.build([[1] * num_tokens], [0], [list(range(1, blocks))], [1], engine.block_size, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    hidden = model(batch, scratch)
    model.compute_logits(hidden[batch.logits_indices])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del scratch, hidden
    torch.cuda.empty_cache()
    return int(peak)


class ModelRunner:
    def __init__(self, engine: EngineConfig, model_config: ModelConfig, model: nn.Module, max_model_len: int) -> None:
        self.engine = engine
        self.model_config = model_config
        self.model = model
        self.device = engine.torch_device
        self.max_model_len = max_model_len
        self.block_size = engine.block_size
        self.num_blocks, self.num_state_slots = cache_budget(engine, model_config, max_model_len, model, self.device)
        self.caches = ModelCaches.allocate(model_config, self.num_blocks, self.block_size, self.num_state_slots,
                                           engine.torch_dtype, engine.kv_torch_dtype, self.device)
        scales = getattr(model, "kv_scales", lambda: {})()
        if engine.kv_torch_dtype == torch.float8_e4m3fn:
            for layer_id, (ks, vs) in scales.items():
                cache = self.caches.kv[layer_id]
                assert cache is not None
                cache.k_scale, cache.v_scale = ks, vs
        self.max_num_blocks_per_seq = -(-max_model_len // self.block_size)
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not engine.enforce_eager:
            self._capture_graphs()

    def _capture_graphs(self) -> None:
        t0 = time.perf_counter()
        max_bs = min(self.engine.max_num_seqs, self.engine.cuda_graph_max_batch_size)
        graphs = DecodeGraphs(self.model, self.caches, max_bs, self.max_num_blocks_per_seq, self.max_model_len,
                              self.device)
        try:
            graphs.capture()
        except Exception as e:  # any capture failure means: run eagerly
            logger.warning("CUDA graph capture failed (%s: %s); decode runs eagerly", type(e).__name__, e)
            torch.cuda.synchronize(self.device)
            return
        self.graphs = graphs
        logger.info("CUDA graphs ready in %.1f s", time.perf_counter() - t0)

    @torch.inference_mode()
    def execute(self, sched: ScheduledBatch) -> tuple[torch.Tensor | None, list[int]]:
        """Run one step; returns (fp32 logits [num_sample_rows, vocab] or None, indices into
        sched.requests of the rows to sample). Rows whose prefill chunk stops short of the end of their
        known tokens are not sampled."""
        if sched.new_state_slots:
            self.caches.reset_state_slots(sched.new_state_slots)
        reqs = sched.requests
        sample_rows = [i for i, (r, n) in enumerate(zip(reqs, sched.num_new_tokens))
                       if r.num_computed_tokens + n == r.num_tokens]
        if (self.graphs is not None and sched.is_decode and len(reqs) == len(sample_rows)
                and self.graphs.padded_size(len(reqs)) is not None):
            bs = self.block_size
            pos = [r.num_computed_tokens for r in reqs]
            logits = self.graphs.run(
                input_ids=[r.token_slice(p, p + 1)[0] for r, p in zip(reqs, pos)], positions=pos,
                seq_lens=[p + 1 for p in pos], block_tables=[r.block_ids for r in reqs],
                slot_mapping=[r.block_ids[p // bs] * bs + p % bs for r, p in zip(reqs, pos)],
                state_slots=[r.state_slot for r in reqs])  # type: ignore[misc]
            return logits.clone(), sample_rows
        tokens = [r.token_slice(r.num_computed_tokens, r.num_computed_tokens + n)
                  for r, n in zip(reqs, sched.num_new_tokens)]
        batch = ForwardBatch.build(
            tokens,
            [r.num_computed_tokens for r in reqs], [r.block_ids for r in reqs],
            [r.state_slot for r in reqs],  # type: ignore[misc]
            self.block_size, self.device)
        hidden = self.model(batch, self.caches)
        if not sample_rows:
            return None, []
        idx = batch.logits_indices[sample_rows] if len(sample_rows) < len(reqs) else batch.logits_indices
        return self.model.compute_logits(hidden[idx]), sample_rows
