"""Mixture-of-experts: softmax top-k routing and the expert computation (gate_up -> SiLU*up -> down,
weighted by the routing weights and summed over the top-k)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nibble.formats.nvfp4 import NVFP4Tensor


@dataclass
class MoEWeights:
    """Stacked routed experts.

    w13: gate and up projections stacked on the output dim, [E, 2I, H] (bf16/fp32, or NVFP4);
    w2: down projection [E, H, I]. Both are either dense tensors or NVFP4Tensor.
    topk_counters: int32 zeros owned by the caller (a layer allocates them once with
    `topk_counters`), the counters of the Triton kernels' fused top-k sum, which leaves them zero
    again; None (or too few for a call): that sum takes its own launch. The reference ignores them.
    num_routed_experts: the experts the router chooses among, on all ranks; under expert parallelism more
    than the E held here, whose slots of other ranks' experts come as id -1. The kernels' tile choice reads
    the pairs per expert from it (T * k / num_routed_experts: the pairs a held expert gets); None: E.
    """

    w13: torch.Tensor | NVFP4Tensor
    w2: torch.Tensor | NVFP4Tensor
    topk_counters: torch.Tensor | None = None
    num_routed_experts: int | None = None

    @property
    def num_experts(self) -> int:
        return int(self.w13.shape[0])

    @property
    def routed_experts(self) -> int:
        """`num_routed_experts`, or this object's E where it is None (no expert parallelism)."""
        return self.num_routed_experts or self.num_experts

    @property
    def intermediate_size(self) -> int:
        return int(self.w2.shape[-1])

    @property
    def hidden_size(self) -> int:
        return int(self.w2.shape[1])

    @property
    def is_nvfp4(self) -> bool:
        return isinstance(self.w13, NVFP4Tensor)

    def expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense (w13 [2I, H], w2 [H, I]) of expert e in `dtype`."""
        if isinstance(self.w13, NVFP4Tensor):
            assert isinstance(self.w2, NVFP4Tensor)
            return self.w13.select(e).dequantize(dtype), self.w2.select(e).dequantize(dtype)
        assert isinstance(self.w2, torch.Tensor)
        return self.w13[e].to(dtype), self.w2[e].to(dtype)


def topk_counters(hidden_size: int, device: torch.device | str, max_tokens: int = 16) -> torch.Tensor:
    """Zeroed int32 counters for the fused top-k sum of `moe_w4_down_kernel` (`MoEWeights.topk_counters`), one
    per (token, hidden slice) for up to `max_tokens` tokens at the narrowest slice (16 features). A layer
    allocates them once, outside any CUDA-graph capture, and owns them: every call leaves them at zero, and no
    two layers (or engines) share them, so concurrent streams never count into the same buffer."""
    return torch.zeros(max_tokens * -(-hidden_size // 16), dtype=torch.int32, device=device)


def route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool = True,
              num_valid_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E] -> (topk_weights fp32 [T, k], topk_ids int32 [T, k]); softmax in fp32,
    top-k, optional renormalisation of the k weights to sum 1. num_valid_tokens: int32 [1] on the logits'
    device, or None; rows from it on are padding of a CUDA-graph batch and get ids -1 (fused_moe skips
    them) and weights 0."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    ids = ids.to(torch.int32)
    if num_valid_tokens is not None:
        live = (torch.arange(ids.shape[0], device=ids.device) < num_valid_tokens)[:, None]
        weights = torch.where(live, weights, 0.0)
        ids = torch.where(live, ids, -1)
    return weights, ids


def fused_moe_ref(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  experts: MoEWeights) -> torch.Tensor:
    """x: [T, H]; topk_weights: fp32 [T, k]; topk_ids: int32 [T, k] -> [T, H] in x's dtype.

    out[t] = sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j], over the slots with
    e >= 0: id -1 marks a slot routed to an expert this rank does not hold (expert parallelism), which
    contributes nothing whatever its weight (a token whose slots are all -1 gets zeros).
    """
    inter = experts.intermediate_size
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        tok, slot = torch.where(ids == e)
        w13, w2 = experts.expert(e, x.dtype)
        h = F.linear(x[tok], w13)
        a = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(a, w2)
        out.index_add_(0, tok, y.float() * topk_weights[tok, slot, None].float())
    return out.to(x.dtype)
