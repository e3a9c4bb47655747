"""Qwen3.5's sparse MoE block: softmax top-k router (always BF16), routed experts (NVFP4 or dense),
and a shared expert scaled by sigmoid(shared_expert_gate(x))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nibble.formats.nvfp4 import GROUP_SIZE, NVFP4Tensor
from nibble.kernels.kernel_set import KernelSet
from nibble.kernels.moe import MoEWeights
from nibble.layers.linear import FLOAT_DTYPES, FusedProjections, Linear, WeightLoadError, check_tensor
from nibble.models.config import ModelConfig

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


class RoutedExperts(nn.Module):
    """Stacked experts: w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], dense or NVFP4.

    `first_expert`/`num_local_experts` select the experts this rank holds under expert parallelism.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, quantized: bool,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.quantized = quantized
        e, h, i = num_experts, hidden_size, intermediate_size
        self.loaded: set[tuple[int, str, str]] = set()

        def p(*shape: int, dt: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dt, device=device), requires_grad=False)

        if quantized:
            for d in (h, i):
                if d % GROUP_SIZE:
                    raise ValueError(f"NVFP4 experts need sizes divisible by {GROUP_SIZE}, got {d}")
            self.w13 = p(e, 2 * i, h // 2, dt=torch.uint8)
            self.w13_scale = p(e, 2 * i, h // GROUP_SIZE, dt=torch.float8_e4m3fn)
            self.w13_global = p(e, 2 * i, dt=torch.float32)
            self.w2 = p(e, h, i // 2, dt=torch.uint8)
            self.w2_scale = p(e, h, i // GROUP_SIZE, dt=torch.float8_e4m3fn)
            self.w2_global = p(e, h, dt=torch.float32)
        else:
            self.w13 = p(e, 2 * i, h, dt=dtype)
            self.w2 = p(e, h, i, dt=dtype)

    def weights(self) -> MoEWeights:
        if self.quantized:
            return MoEWeights(NVFP4Tensor(self.w13, self.w13_scale, self.w13_global),
                              NVFP4Tensor(self.w2, self.w2_scale, self.w2_global))
        return MoEWeights(self.w13, self.w2)

    def _rows(self, proj: str) -> slice:
        i = self.intermediate_size
        return {"gate_proj": slice(0, i), "up_proj": slice(i, 2 * i), "down_proj": slice(None)}[proj]

    def load_expert(self, name: str, expert: int, proj: str, kind: str, tensor: torch.Tensor) -> None:
        """One per-expert checkpoint tensor: proj in EXPERT_PROJS, kind in weight/weight_scale/
        weight_scale_2/input_scale."""
        if not 0 <= expert < self.num_experts:
            raise WeightLoadError(f"tensor '{name}': expert {expert} out of range 0..{self.num_experts - 1}")
        h, i = self.hidden_size, self.intermediate_size
        out_dim, in_dim = (h, i) if proj == "down_proj" else (i, h)
        rows = self._rows(proj)
        is13 = proj != "down_proj"
        if kind == "input_scale":
            if not self.quantized:
                raise WeightLoadError(f"tensor '{name}': NVFP4 input_scale but these experts are not quantized")
            return
        if kind == "weight":
            if self.quantized:
                check_tensor(name, tensor, (out_dim, in_dim // 2), (torch.uint8,))
            else:
                if tensor.dtype == torch.uint8:
                    raise WeightLoadError(f"tensor '{name}': NVFP4 (uint8) expert weight, but the checkpoint "
                                          "has no NVFP4 quantization config for it")
                check_tensor(name, tensor, (out_dim, in_dim), FLOAT_DTYPES)
            (self.w13 if is13 else self.w2).data[expert, rows].copy_(tensor)
        elif kind == "weight_scale" and self.quantized:
            check_tensor(name, tensor, (out_dim, in_dim // GROUP_SIZE), (torch.float8_e4m3fn,))
            (self.w13_scale if is13 else self.w2_scale).data[expert, rows].copy_(tensor)
        elif kind == "weight_scale_2" and self.quantized:
            if tensor.numel() != 1:
                raise WeightLoadError(f"tensor '{name}': expected a scalar, found shape {tuple(tensor.shape)}")
            (self.w13_global if is13 else self.w2_global).data[expert, rows].fill_(float(tensor.float().reshape(())))
        else:
            raise WeightLoadError(f"tensor '{name}': unexpected expert tensor kind '{kind}' "
                                  f"({'NVFP4' if self.quantized else 'dense'} experts)")
        self.loaded.add((expert, proj, kind))

    def load_fused(self, name: str, which: str, tensor: torch.Tensor) -> None:
        """Fused dense checkpoint tensors: gate_up_proj [E, 2I, H] or down_proj [E, H, I]."""
        if self.quantized:
            raise WeightLoadError(f"tensor '{name}': fused dense experts, but the quantization config makes "
                                  "these experts NVFP4")
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        if which == "gate_up_proj":
            check_tensor(name, tensor, (e, 2 * i, h), FLOAT_DTYPES)
            self.w13.data.copy_(tensor)
            projs = ("gate_proj", "up_proj")
        else:
            check_tensor(name, tensor, (e, h, i), FLOAT_DTYPES)
            self.w2.data.copy_(tensor)
            projs = ("down_proj",)
        for ex in range(e):
            for pr in projs:
                self.loaded.add((ex, pr, "weight"))

    def missing(self) -> list[str]:
        kinds = ("weight", "weight_scale", "weight_scale_2") if self.quantized else ("weight",)
        out = []
        for ex in range(self.num_experts):
            for pr in EXPERT_PROJS:
                for k in kinds:
                    if (ex, pr, k) not in self.loaded:
                        out.append(f"experts.{ex}.{pr}.{k}")
        return out


class SparseMoE(nn.Module):
    """hidden [T, H] -> [T, H]."""

    def __init__(self, config: ModelConfig, prefix: str, kernels: KernelSet, dtype: torch.dtype,
                 device: torch.device | str, shared_intermediate_size: int | None = None) -> None:
        super().__init__()
        self.kernels = kernels
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        h = config.hidden_size

        def quantized(name: str) -> bool:
            return config.quant is not None and config.quant.is_quantized(f"{prefix}.{name}")

        self.gate = Linear(h, [config.num_experts], quantized=False, kernels=kernels, dtype=dtype, device=device)
        self.experts = RoutedExperts(config.num_experts, h, config.moe_intermediate_size,
                                     quantized=quantized("experts"), dtype=dtype, device=device)
        si = shared_intermediate_size or config.shared_expert_intermediate_size
        self.shared_gate_up = FusedProjections(
            h, [("shared_expert.gate_proj", si, quantized("shared_expert.gate_proj")),
                ("shared_expert.up_proj", si, quantized("shared_expert.up_proj"))],
            kernels=kernels, dtype=dtype, device=device)
        self.shared_down = Linear(si, [h], quantized=quantized("shared_expert.down_proj"), kernels=kernels,
                                  dtype=dtype, device=device)
        self.shared_expert_gate = Linear(h, [1], quantized=quantized("shared_expert_gate") and h % 16 == 0,
                                         kernels=kernels, dtype=dtype, device=device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(hidden)
        topk_weights, topk_ids = self.kernels.route(router_logits, self.top_k, self.renormalize)
        routed = self.kernels.fused_moe(hidden, topk_weights, topk_ids, self.experts.weights())
        gate, up = self.shared_gate_up(hidden)
        shared = self.shared_down(F.silu(gate) * up)
        shared = torch.sigmoid(self.shared_expert_gate(hidden)) * shared
        return routed + shared
