"""What the tensor-parallel tests run on a model, identically on every rank and on the single-process
reference: tiny checkpoints with shapes that split over 2 and 4 ranks, and a fixed greedy run (batched
prefill of sequences of different lengths, then batched decode steps) that records every step's logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from nibble.layers.forward_batch import ForwardBatch, ModelCaches
from nibble.models.config import ModelConfig

PROMPT_LENS = [9, 3, 17, 1]
DECODE_STEPS = 6
BLOCK_SIZE = 4

# Divisible for tp 4: 4 query / 2 KV heads (KV heads replicated at tp 4), GDN 4 key / 8 value heads, 8
# experts, moe / shared intermediate 64 (NVFP4 needs I / tp to be a multiple of 16).
TINY_SHAPES: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16, linear_value_head_dim=16,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
)


def make_checkpoints(base: Path) -> dict[str, Path]:
    """{'fp32': multimodal layout, fused experts, vocab 254 (not divisible by 4: padded vocab slices),
    'nvfp4': every linear that can be NVFP4 quantized (attention, GDN, shared and routed experts)}."""
    from nibble.checkpoint.quantize import quantize_checkpoint
    from tests.helpers.tiny_models import make_tiny_qwen35_moe

    fp32 = make_tiny_qwen35_moe(base / "fp32", **TINY_SHAPES, vocab_size=254, multimodal=True, fused_experts=True,
                                seed=5)
    src = make_tiny_qwen35_moe(base / "src", **TINY_SHAPES, vocab_size=256, seed=7)
    nvfp4 = base / "nvfp4"
    quantize_checkpoint(src, nvfp4, exclude=[], progress=False)
    return {"fp32": fp32, "nvfp4": nvfp4}


@torch.inference_mode()
def greedy_run(model: nn.Module, config: ModelConfig) -> dict[str, torch.Tensor]:
    """{'logits': fp32 [DECODE_STEPS + 1, num_seqs, vocab], 'tokens': int64 [num_seqs, DECODE_STEPS + 1]}."""
    gen = torch.Generator().manual_seed(0)
    feed = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    num_seqs = len(feed)
    blocks_per_seq = -(-(max(PROMPT_LENS) + DECODE_STEPS + 1) // BLOCK_SIZE)
    block_tables = [[1 + i + j * num_seqs for j in range(blocks_per_seq)] for i in range(num_seqs)]
    dims = model.cache_dims()  # type: ignore[operator]
    caches = ModelCaches.allocate(config, 1 + blocks_per_seq * num_seqs, BLOCK_SIZE, num_seqs + 1, torch.float32,
                                  torch.float32, "cpu", **dims)
    slots = [4, 2, 1, 3]
    context = [0] * num_seqs
    logits_per_step, tokens = [], []
    for _ in range(DECODE_STEPS + 1):
        batch = ForwardBatch.build(feed, context, block_tables, slots, BLOCK_SIZE)
        logits = model.compute_logits(model(batch, caches)[batch.logits_indices])
        nxt = logits.argmax(-1)
        logits_per_step.append(logits)
        tokens.append(nxt)
        context = [c + len(f) for c, f in zip(context, feed)]
        feed = [[int(t)] for t in nxt]
    return {"logits": torch.stack(logits_per_step), "tokens": torch.stack(tokens, dim=1)}
