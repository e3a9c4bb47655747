"""Recording what a model's MoE blocks route: each `fused_moe` call's topk_ids."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from nibble.layers.moe import SparseMoE


def record_routing(model: nn.Module) -> list[torch.Tensor]:
    """Wrap the `fused_moe` of every MoE block of `model` so that each call appends a copy of its topk_ids
    (int32 [T, k]) to the returned list, then computes as before."""
    seen: list[torch.Tensor] = []
    for block in model.modules():
        if isinstance(block, SparseMoE):
            fused = block.kernels.fused_moe

            def spy(x, w, ids, experts, fused=fused):  # type: ignore[no-untyped-def]
                seen.append(ids.clone())
                return fused(x, w, ids, experts)

            block.kernels = replace(block.kernels, fused_moe=spy)
    return seen
