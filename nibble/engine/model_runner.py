"""Turns a scheduled batch into a model step: sizes and owns the caches, builds ForwardBatch, runs the
model (from a CUDA graph for decode and short prefill / mixed steps when one fits) and returns the logits of
the rows to sample. Speculative-decoding steps: spec_steps.py.

Under tensor parallelism every rank has a ModelRunner over its share of the model and caches. Rank 0's
`execute` turns the schedule into `StepInputs`, hands them to `broadcast` (the other ranks receive them in
nibble/engine/worker.py) and runs `run`; the other ranks run the same `run`, so every rank takes the same
path (graph or eager, same padded size) and their collectives match. For that every rank holds the same graph
sets: they capture them in step and all keep or all drop each one (`cuda_graphs.capture_set`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import accumulate, pairwise

import torch
from torch import nn

from nibble.engine.config import EngineConfig
from nibble.engine.cuda_graphs import DecodeGraphs, capture_set, capture_sizes
from nibble.engine.image_steps import image_step_inputs
from nibble.engine.mixed_graphs import MixedGraphs, mixed_capture_sizes
from nibble.engine.prompt_logprobs import prompt_logprobs
from nibble.engine.request import PENDING_BASE, TokenLogprobs
from nibble.engine.scheduler import ScheduledBatch
from nibble.engine.spec_decode import VerifyGraphs
from nibble.engine.spec_steps import SpecSteps
from nibble.engine.step_inputs import StepInputs
from nibble.kernels.gated_delta import RECURRENT_MAX_TOKENS
from nibble.kernels.host_copy import to_device_async
from nibble.layers.forward_batch import ForwardBatch, ModelCaches
from nibble.layers.moe import overlap_shared_experts
from nibble.layers.parallel import SINGLE, ParallelContext
from nibble.models.config import FULL_ATTENTION, ModelConfig
from nibble.models.mrope import MRopeParams, mrope_cos_sin
from nibble.models.multimodal import MultimodalStep

CPU_DEFAULT_KV_GB = 0.25
# How a model step can run: replayed from a decode, mixed-step or verify CUDA graph, or eagerly.
STEP_KINDS = ("decode_graph", "mixed_graph", "verify_graph", "eager")
# Verify graphs hold [B * (k + 1), vocab] fp32 logits per size; larger verify batches run eagerly.
MAX_VERIFY_GRAPH_BATCH = 64


def rank_cache_bytes(model_config: ModelConfig, dims: dict[str, int], block_size: int, dtype: torch.dtype,
                     kv_dtype: torch.dtype, num_mtp_layers: int = 0) -> tuple[int, int]:
    """(bytes of one KV block, bytes of one sequence's GDN state) over all layers (and the MTP head's, for
    speculative decoding), for a rank whose cache widths are `dims` (see `cache_dims()` of the model:
    num_kv_heads, num_v_heads, conv_dim)."""
    num_linear = sum(t != FULL_ATTENTION for t in model_config.layer_types)
    num_full = len(model_config.layer_types) - num_linear + num_mtp_layers
    kv = 2 * num_full * dims["num_kv_heads"] * model_config.head_dim * kv_dtype.itemsize * block_size
    conv = dims["conv_dim"] * (model_config.linear_conv_kernel_dim - 1) * dtype.itemsize
    ssm = dims["num_v_heads"] * model_config.linear_key_head_dim * model_config.linear_value_head_dim * 4
    return kv, num_linear * (conv + ssm)


def num_mtp_layers(engine: EngineConfig, model_config: ModelConfig) -> int:
    """MTP head layers the model is built with and the caches hold KV for: all of the checkpoint's when
    speculative decoding drafts with the head (draft step s runs layer s % n), else none."""
    return model_config.mtp_num_hidden_layers if engine.mtp_drafts else 0


def verify_graph_logits_bytes(engine: EngineConfig, model_config: ModelConfig) -> int:
    """Bytes of the logits the verify graphs keep, one [bs * (k + 1), vocab] fp32 buffer per captured size."""
    if not engine.speculative or engine.enforce_eager:
        return 0
    sizes = capture_sizes(min(engine.max_num_seqs, engine.cuda_graph_max_batch_size, MAX_VERIFY_GRAPH_BATCH))
    return sum(sizes) * (engine.num_speculative_tokens + 1) * model_config.vocab_size * 4


def model_cache_dims(model_config: ModelConfig, model: nn.Module) -> dict[str, int]:
    """The model's cache widths on this rank (the config's when the model does not say)."""
    dims = getattr(model, "cache_dims", None)
    if dims is not None:
        return dims()
    return {"num_kv_heads": model_config.num_key_value_heads, "num_v_heads": model_config.linear_num_value_heads,
            "conv_dim": model_config.linear_conv_dim}


def cache_budget(engine: EngineConfig, model_config: ModelConfig, max_model_len: int, model: nn.Module,
                 device: torch.device, parallel: ParallelContext = SINGLE,
                 vision_max_patches: int | None = None) -> tuple[int, int]:
    """(num_kv_blocks, num_state_slots) that fit the device's memory budget; under tensor parallelism,
    the smallest block count any rank can hold, so that all ranks index the same blocks. vision_max_patches:
    the largest vision-tower call (`image_steps.encode_vision`), whose working memory is kept free too."""
    num_blocks, num_slots = _rank_cache_budget(engine, model_config, max_model_len, model, device,
                                               vision_max_patches)
    return parallel.host_min(num_blocks), num_slots


def _rank_cache_budget(engine: EngineConfig, model_config: ModelConfig, max_model_len: int, model: nn.Module,
                       device: torch.device, vision_max_patches: int | None = None) -> tuple[int, int]:
    dtype, kv_dtype = engine.torch_dtype, engine.kv_torch_dtype
    num_slots = engine.num_state_slots
    dims = model_cache_dims(model_config, model)
    block_bytes, seq_state_bytes = rank_cache_bytes(model_config, dims, engine.block_size, dtype, kv_dtype,
                                                    num_mtp_layers(engine, model_config))
    state_bytes = num_slots * seq_state_bytes
    if engine.extra.get("num_kv_blocks"):
        return int(engine.extra["num_kv_blocks"]), num_slots
    if device.type == "cuda":
        peak = profile_peak_activation_bytes(engine, model_config, model, device)
        visual = getattr(model, "visual", None)
        if visual is not None and vision_max_patches:
            peak = max(peak, profile_vision_peak_bytes(visual, vision_max_patches, device))
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * engine.gpu_memory_utilization) - used - peak
        # CUDA graphs keep their own pool (logits and intermediate buffers of the largest batch); verify graphs
        # also keep the fp32 logits of every captured size as their outputs, and the mixed-step graphs the
        # working memory of their largest step (the profiled prefill's, scaled to its token count).
        graph_reserve = 0
        if not engine.enforce_eager:
            mixed_tokens = min(engine.cuda_graph_max_mixed_tokens, RECURRENT_MAX_TOKENS, engine.max_num_batched_tokens)
            graph_reserve = (512 * 2**20 + verify_graph_logits_bytes(engine, model_config)
                             + peak * mixed_tokens // engine.max_num_batched_tokens)
        kv_bytes = budget - state_bytes - graph_reserve
        if kv_bytes < 2 * block_bytes:
            raise RuntimeError(
                f"not enough GPU memory for the caches: {budget / 2**30:.2f} GiB left after weights "
                f"({used / 2**30:.2f} GiB in use) and activations ({peak / 2**30:.2f} GiB) at "
                f"--gpu-memory-utilization {engine.gpu_memory_utilization}; GDN states need "
                f"{state_bytes / 2**30:.2f} GiB for --max-num-seqs {engine.max_num_seqs}"
                + (f" with {engine.num_speculative_tokens} more per sequence for speculative decoding"
                   if engine.speculative else "")
                + (f" and --prefix-cache-slots {engine.prefix_cache_slots}" if engine.enable_prefix_caching else ""))
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
                                   engine.kv_torch_dtype, device, **model_cache_dims(model_config, model),
                                   num_mtp_layers=num_mtp_layers(engine, model_config))
    batch = ForwardBatch.build([[1] * num_tokens], [0], [list(range(1, blocks))], [1], engine.block_size, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    hidden = model(batch, scratch)
    model.compute_logits(hidden[batch.logits_indices])
    if engine.mtp_drafts:
        model.mtp_forward(batch.input_ids, hidden, batch, scratch)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del scratch, hidden
    torch.cuda.empty_cache()
    return int(peak)


@torch.inference_mode()
def profile_vision_peak_bytes(visual: nn.Module, max_patches: int, device: torch.device) -> int:
    """The extra memory one vision-tower call of about max_patches patches (one square image, sides a multiple
    of the merge size) peaks at."""
    merge = visual.config.spatial_merge_size
    side = max(merge, math.isqrt(max_patches) // merge * merge)
    pixels = torch.randn(side * side, visual.config.patch_dim, device=device, dtype=visual.dtype)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    rows = visual(pixels, [(1, side, side)])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del pixels, rows
    torch.cuda.empty_cache()
    return int(peak)


def _pending_inputs(ids: list[int], inflight_tokens: torch.Tensor | None, device: torch.device
                    ) -> tuple[list[int], tuple[torch.Tensor, torch.Tensor] | None]:
    """Flat input ids with pending placeholders (request.PENDING_BASE - row) set to 0, and (positions of
    those, int64 [n] on `device`; their tokens, gathered from inflight_tokens) to write over them there."""
    if not ids or min(ids) > PENDING_BASE:
        return ids, None
    if inflight_tokens is None:
        raise RuntimeError("a step feeds pending tokens, but no step is in flight")
    dst = [i for i, t in enumerate(ids) if t <= PENDING_BASE]
    src = [PENDING_BASE - ids[i] for i in dst]
    idx = to_device_async(torch.tensor([dst, src], dtype=torch.int64), device)
    fixed = [0 if t <= PENDING_BASE else t for t in ids]
    return fixed, (idx[0], inflight_tokens[idx[1]])


class ModelRunner(SpecSteps):
    """Owns one rank's caches and runs steps. parallel: this rank's place in the tensor-parallel group;
    broadcast (rank 0 of a group only): sends each step's inputs to the other ranks before running it;
    send_tokens (rank 0) / recv_tokens (the others): under speculative decoding, the tokens rank 0 samples
    within a step, which the MTP head's passes on every rank need."""

    def __init__(self, engine: EngineConfig, model_config: ModelConfig, model: nn.Module, max_model_len: int,
                 parallel: ParallelContext | None = None,
                 broadcast: Callable[[StepInputs], None] | None = None,
                 send_tokens: Callable[[torch.Tensor], None] | None = None,
                 recv_tokens: Callable[[], torch.Tensor] | None = None,
                 vision_max_patches: int | None = None) -> None:
        self.engine = engine
        self.model_config = model_config
        self.model = model
        self.device = engine.torch_device
        self.max_model_len = max_model_len
        self.block_size = engine.block_size
        self.parallel = parallel or SINGLE
        self.broadcast = broadcast
        self.send_tokens = send_tokens
        self.recv_tokens = recv_tokens
        # the most patches one vision-tower call takes (image_steps.encode_vision), profiled with the caches
        self.vision_max_patches = vision_max_patches
        if engine.shared_expert_overlap and self.device.type == "cuda":
            overlap_shared_experts(model, torch.cuda.Stream(self.device))
        self.num_blocks, self.num_state_slots = cache_budget(engine, model_config, max_model_len, model, self.device,
                                                             self.parallel, vision_max_patches)
        self.caches = ModelCaches.allocate(model_config, self.num_blocks, self.block_size, self.num_state_slots,
                                           engine.torch_dtype, engine.kv_torch_dtype, self.device,
                                           **model_cache_dims(model_config, model),
                                           num_mtp_layers=num_mtp_layers(engine, model_config))
        scales = getattr(model, "kv_scales", lambda: {})()
        if engine.kv_torch_dtype == torch.float8_e4m3fn:
            for layer_id, (ks, vs) in scales.items():
                cache = self.caches.kv[layer_id]
                assert cache is not None
                cache.k_scale, cache.v_scale = ks, vs
        self.num_spec_tokens = engine.num_speculative_tokens
        self.mtp_drafts = engine.mtp_drafts
        # a verify step and its drafts reach 2 * num_spec_tokens positions past the computed tokens
        self.max_seq_len = max_model_len + 2 * self.num_spec_tokens
        self.max_num_blocks_per_seq = -(-self.max_seq_len // self.block_size)
        # the last step's prompt log-probabilities ({row: (first position, entries)}), for the engine to take
        self.prompt_logprob_results: dict[int, tuple[int, list[TokenLogprobs]]] = {}
        # steps run so far by how they ran (the server's /metrics reports them)
        self.step_counts = dict.fromkeys(STEP_KINDS, 0)
        # image input (set by the engine for a model with a vision tower): placeholder id and M-RoPE sections
        self.mrope: MRopeParams | None = None
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        self.verify_graphs: VerifyGraphs | None = None
        if self.device.type == "cuda" and not engine.enforce_eager:
            if engine.speculative:
                self._capture_verify_graphs()
            else:
                self._capture_graphs()
            self._capture_mixed_graphs()

    def _capture_graphs(self) -> None:
        max_bs = min(self.engine.max_num_seqs, self.engine.cuda_graph_max_batch_size)
        graphs = DecodeGraphs(self.model, self.caches, max_bs, self.max_num_blocks_per_seq, self.max_model_len,
                              self.device, thread_local_capture=self.parallel.is_parallel)
        # each size keeps its fp32 logits [bs, vocab]
        kept = sum(graphs.sizes) * self.model_config.vocab_size * 4
        if capture_set(graphs, "decode steps", self.parallel, kept):
            self.graphs = graphs

    def _capture_mixed_graphs(self) -> None:
        max_tokens = min(self.engine.cuda_graph_max_mixed_tokens, self.engine.max_num_batched_tokens)
        if not mixed_capture_sizes(max_tokens, self.engine.max_num_seqs):
            return
        graphs = MixedGraphs(self.model, self.caches, max_tokens, self.engine.max_num_seqs,
                             self.max_num_blocks_per_seq, self.max_model_len, self.device,
                             thread_local_capture=self.parallel.is_parallel, full_hidden=self.engine.mtp_drafts)
        other = self.graphs or self.verify_graphs
        graphs.pool = other.pool if other is not None else None
        # each graph keeps its hidden rows: every token's with full_hidden, else each sequence's last
        rows = sum(t if graphs.full_hidden else b for t, b, _ in graphs.keys)
        kept = rows * self.model_config.hidden_size * self.engine.torch_dtype.itemsize
        if capture_set(graphs, "mixed prefill/decode steps", self.parallel, kept):
            self.mixed_graphs = graphs

    def _capture_verify_graphs(self) -> None:
        max_bs = min(self.engine.max_num_seqs, self.engine.cuda_graph_max_batch_size, MAX_VERIFY_GRAPH_BATCH)
        graphs = VerifyGraphs(self.model, self.caches, max_bs, self.num_spec_tokens, self.max_num_blocks_per_seq,
                              self.max_seq_len, self.block_size, self.device,
                              thread_local_capture=self.parallel.is_parallel, mtp_drafts=self.engine.mtp_drafts)
        if capture_set(graphs, "speculative verify steps", self.parallel,
                       verify_graph_logits_bytes(self.engine, self.model_config)):
            self.verify_graphs = graphs

    @torch.inference_mode()
    def execute(self, sched: ScheduledBatch, inflight_tokens: torch.Tensor | None = None
                ) -> tuple[torch.Tensor | None, list[int]]:
        """Run one step; returns (fp32 logits [num_sample_rows, vocab] or None, indices into
        sched.requests of the rows to sample). Rows whose prefill chunk stops short of the end of their
        known tokens are not sampled. inflight_tokens: int64 [rows] on the device, the tokens sampled by
        the step still in flight, which the requests' pending placeholders stand for (request.py)."""
        step = StepInputs.from_schedule(sched)
        if self.mrope is not None and any(r.has_vision for r in sched.requests):
            step.position_offsets, step.mm = image_step_inputs(
                sched.requests, sched.num_new_tokens, getattr(self.model, "visual", None),
                self.mrope, self.device, self.vision_max_patches)
        if self.broadcast is not None:
            if inflight_tokens is not None:
                raise RuntimeError("overlapped scheduling does not run under tensor parallelism")
            self.broadcast(step)
        self.prompt_logprob_results = {}
        num_top = [sched.requests[i].sampling_params.prompt_logprobs or 0 for i in step.prompt_logprob_rows]
        return self.run(step, inflight_tokens, num_prompt_top=num_top), step.sample_rows

    def _add_image_inputs(self, batch: ForwardBatch, mm: MultimodalStep) -> None:
        """Give an eager batch its per-token M-RoPE rows (read at positions arange(T)) and the vision rows of
        its placeholders."""
        assert self.mrope is not None
        table = self.model.rotary.cos_sin_cache
        batch.rope_cos_sin = mrope_cos_sin(mm.positions, table, self.mrope.mrope_section)
        batch.positions = torch.arange(batch.num_tokens, dtype=torch.int64, device=self.device)
        if mm.token_index.numel():
            batch.mm_token_index = to_device_async(mm.token_index, self.device)
            batch.mm_embeds = mm.embeds

    def _prepare_caches(self, step: StepInputs) -> None:
        if step.state_copies:
            self.caches.copy_state_slots(step.state_copies)
        if step.block_copies:
            self.caches.copy_kv_blocks(step.block_copies)
        if step.new_state_slots:
            self.caches.reset_state_slots(step.new_state_slots)

    @torch.inference_mode()
    def run(self, step: StepInputs, inflight_tokens: torch.Tensor | None = None,
            num_prompt_top: list[int] | None = None) -> torch.Tensor | None:
        """Run one step on this rank; fp32 logits [len(step.sample_rows), vocab], or None when no row is
        sampled. A step with prompt_logprob_rows runs eagerly (its graphs return no hidden rows but the last)
        and leaves their log-probabilities in `prompt_logprob_results` (num_prompt_top: the alternatives each
        wants, on rank 0; None on the other ranks, which take part in the head's collectives only)."""
        self._prepare_caches(step)
        num_seqs = step.num_seqs
        sample_rows = step.sample_rows
        # steps feeding image prompt chunks rotate with per-token tables: eager only
        graphs_ok = not step.prompt_logprob_rows and step.mm is None
        if (graphs_ok and self.graphs is not None and step.is_decode and num_seqs == len(sample_rows)
                and self.graphs.padded_size(num_seqs) is not None):
            bs = self.block_size
            pos = step.context_lens
            # an image request decodes at index + delta on all three axes: a plain shifted 1-D position
            rope_pos = [p + o for p, o in zip(pos, step.position_offsets)] if step.position_offsets else pos
            ids, pending = _pending_inputs([t[0] for t in step.token_ids], inflight_tokens, self.device)
            logits = self.graphs.run(
                input_ids=ids, positions=rope_pos,
                seq_lens=[p + 1 for p in pos], block_tables=step.block_tables,
                slot_mapping=[b[p // bs] * bs + p % bs for b, p in zip(step.block_tables, pos)],
                state_slots=step.state_slots, pending=pending)
            self.step_counts["decode_graph"] += 1
            return logits.clone()
        token_ids = step.token_ids
        flat, pending = _pending_inputs([t for toks in token_ids for t in toks], inflight_tokens, self.device)
        if pending is not None:
            lens = [len(t) for t in token_ids]
            starts = [0, *accumulate(lens)]
            token_ids = [flat[a:b] for a, b in pairwise(starts)]
        mixed = self.mixed_graphs
        size = (mixed.padded_size(len(flat), num_seqs, max(map(len, token_ids)))
                if mixed is not None and not mixed.full_hidden and graphs_ok and not step.position_offsets else None)
        if mixed is not None and size is not None:
            mixed.load(size, token_ids, step.context_lens, step.block_tables, step.state_slots, self.block_size,
                       pending)
            last = mixed.run(size, num_seqs)
            self.step_counts["mixed_graph" if mixed.replays(size) else "eager"] += 1
            if not sample_rows:
                return None
            if len(sample_rows) < num_seqs:
                last = last[to_device_async(torch.tensor(sample_rows, dtype=torch.int64), self.device)]
            return self.model.compute_logits(last)
        batch = ForwardBatch.build(token_ids, step.context_lens, step.block_tables, step.state_slots,
                                   self.block_size, self.device, position_offsets=step.position_offsets or None)
        if pending is not None:
            batch.input_ids[pending[0]] = pending[1]
        if step.mm is not None:
            self._add_image_inputs(batch, step.mm)
        hidden = self.model(batch, self.caches)
        self.step_counts["eager"] += 1
        if step.prompt_logprob_rows:
            self.prompt_logprob_results = prompt_logprobs(self.model, step, batch.cu_seqlens_q_cpu, hidden,
                                                          num_prompt_top)
        if not sample_rows:
            return None
        idx = batch.logits_indices[sample_rows] if len(sample_rows) < num_seqs else batch.logits_indices
        return self.model.compute_logits(hidden[idx])
