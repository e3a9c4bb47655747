"""Qwen3.5's sparse MoE block: softmax top-k router (always BF16), routed experts (NVFP4 or dense),
and a shared expert scaled by sigmoid(shared_expert_gate(x)).

Two ways to spread the routed experts over tensor-parallel ranks: by default every rank holds every
expert with the intermediate dim I split (w13's gate rows and up rows, w2's columns), so each rank computes
a partial sum of every expert; with expert parallelism each rank holds num_experts / tp whole experts and
computes those for all tokens. Either way each rank's routed output is a partial sum, as is the output of
the shared expert (split like a dense MLP), and the block does a single all-reduce of their sum. The router
and shared_expert_gate are replicated.

Router, shared gate/up and shared_expert_gate all read the block's input: they are one fused projection
(rows [router | this rank's shared gate | its shared up | shared_expert_gate]), whose output columns feed
`route`, `silu_and_mul` and `moe_combine` as strided views. On one rank the block returns its parts
uncombined (`MoEOutput`): the next RMSNorm combines them in its own launch (`rms_norm_moe`).

On a GPU the shared expert may run on a second stream (`overlap_shared_experts`) while the routed experts run
on the current one: at small batches the routed kernels are bound by their own latency and leave most SMs
and bandwidth idle, and the two branches only meet in the combination. CUDA graphs capture the fork and join.
Measured on the H200 (122B-A10B decode steps, docs/benchmarks.md): 2.4-3.8% shorter steps at 2-16 tokens,
1% at 32, 0.3% at 64, but 1% longer at one token, which therefore stays on one stream
(SHARED_OVERLAP_MIN_TOKENS).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nibble.formats.nvfp4 import GROUP_SIZE, NVFP4Tensor
from nibble.kernels.kernel_set import KernelSet
from nibble.kernels.moe import MoEWeights, topk_counters
from nibble.layers.linear import (
    FLOAT_DTYPES,
    FusedProjections,
    RowParallelLinear,
    WeightLoadError,
    check_tensor,
    global_scale_value,
)
from nibble.layers.parallel import (
    SINGLE,
    ParallelContext,
    ParallelError,
    Partition,
    TensorSource,
    numel,
    read_full,
    read_partition,
)
from nibble.models.config import ModelConfig

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")

# fewest tokens of a step for which the shared expert runs on its own stream (see the module docstring)
SHARED_OVERLAP_MIN_TOKENS = 2


class RoutedExperts(nn.Module):
    """This rank's stacked experts: w13 [E_local, 2 I_local, H] (gate rows then up rows), w2
    [E_local, H, I_local], dense or NVFP4 (then with e4m3 block scales [.., K/16] and fp32 per-row global
    scales [E_local, rows]).

    Tensor-parallel experts: E_local = num_experts, I_local = I / tp. Expert-parallel: experts
    [first_expert, first_expert + num_local_experts) whole, I_local = I. Checkpoint expert ids are global.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, quantized: bool,
                 dtype: torch.dtype, device: torch.device | str, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.quantized = quantized
        if parallel.expert_parallel and parallel.is_parallel:
            experts = parallel.split(num_experts, "num_experts (expert parallelism)")
            self.inter_partition = Partition.whole(intermediate_size)
        else:
            experts = Partition.whole(num_experts)
            self.inter_partition = parallel.split(intermediate_size, "moe_intermediate_size")
        self.expert_partition = experts
        self.first_expert = experts.ranges[0][0]
        self.num_local_experts = experts.size
        self.intermediate_size = self.inter_partition.size
        e, h, i = self.num_local_experts, hidden_size, self.intermediate_size
        self.loaded: set[tuple[int, str, str]] = set()

        def p(*shape: int, dt: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dt, device=device), requires_grad=False)

        if quantized:
            if h % GROUP_SIZE:
                raise ValueError(f"NVFP4 experts need sizes divisible by {GROUP_SIZE}, got {h}")
            if i % GROUP_SIZE:
                if parallel.is_parallel and not parallel.expert_parallel:
                    raise ParallelError(
                        f"NVFP4 experts: moe_intermediate_size {intermediate_size} / --tensor-parallel-size "
                        f"{parallel.tp_size} = {i} is not a multiple of {GROUP_SIZE}; use a smaller "
                        "--tensor-parallel-size or --enable-expert-parallel")
                raise ValueError(f"NVFP4 experts need sizes divisible by {GROUP_SIZE}, got {i}")
            self.w13 = p(e, 2 * i, h // 2, dt=torch.uint8)
            self.w13_scale = p(e, 2 * i, h // GROUP_SIZE, dt=torch.float8_e4m3fn)
            self.w13_global = p(e, 2 * i, dt=torch.float32)
            self.w2 = p(e, h, i // 2, dt=torch.uint8)
            self.w2_scale = p(e, h, i // GROUP_SIZE, dt=torch.float8_e4m3fn)
            self.w2_global = p(e, h, dt=torch.float32)
        else:
            self.w13 = p(e, 2 * i, h, dt=dtype)
            self.w2 = p(e, h, i, dt=dtype)
        # this layer's own counters for the NVFP4 kernels' fused top-k sum (not a checkpoint tensor; dense experts
        # run kernels without that sum)
        self.register_buffer("topk_counters", topk_counters(h, device) if quantized else None, persistent=False)

    @property
    def local_expert_ids(self) -> range:
        return range(self.first_expert, self.first_expert + self.num_local_experts)

    def weights(self) -> MoEWeights:
        if self.quantized:
            return MoEWeights(NVFP4Tensor(self.w13, self.w13_scale, self.w13_global),
                              NVFP4Tensor(self.w2, self.w2_scale, self.w2_global), self.topk_counters,
                              num_routed_experts=self.num_experts)
        return MoEWeights(self.w13, self.w2, num_routed_experts=self.num_experts)

    def localize(self, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Under expert parallelism, global top-k (weights fp32 [T, k], ids int32 [T, k]) -> ids of this
        rank's experts, -1 for slots routed to other ranks' experts (fused_moe skips those)."""
        local = topk_ids - self.first_expert
        mine = (local >= 0) & (local < self.num_local_experts)
        return topk_weights, torch.where(mine, local, torch.full_like(local, -1)).to(torch.int32)

    def _rows(self, proj: str) -> slice:
        i = self.intermediate_size
        return {"gate_proj": slice(0, i), "up_proj": slice(i, 2 * i), "down_proj": slice(None)}[proj]

    def load_expert(self, name: str, expert: int, proj: str, kind: str, tensor: TensorSource) -> None:
        """One per-expert checkpoint tensor: proj in EXPERT_PROJS, kind in weight/weight_scale/
        weight_scale_2/input_scale. Only this rank's part is read; other ranks' experts are checked
        (shape, dtype) but not read."""
        if not 0 <= expert < self.num_experts:
            raise WeightLoadError(f"tensor '{name}': expert {expert} out of range 0..{self.num_experts - 1}")
        h, i = self.hidden_size, self.inter_partition.full
        is13 = proj != "down_proj"
        out_dim, in_dim = (i, h) if is13 else (h, i)
        # gate/up keep this rank's rows of I, down its columns of I.
        inter = self.inter_partition
        if kind == "input_scale":
            if not self.quantized:
                raise WeightLoadError(f"tensor '{name}': NVFP4 input_scale but these experts are not quantized")
            return
        if kind == "weight":
            if self.quantized:
                check_tensor(name, tensor, (out_dim, in_dim // 2), (torch.uint8,))
                parts = (inter,) if is13 else (None, inter.scaled(2, name))
            else:
                if tensor.dtype == torch.uint8:
                    raise WeightLoadError(f"tensor '{name}': NVFP4 (uint8) expert weight, but the checkpoint "
                                          "has no NVFP4 quantization config for it")
                check_tensor(name, tensor, (out_dim, in_dim), FLOAT_DTYPES)
                parts = (inter,) if is13 else (None, inter)
            target = self.w13 if is13 else self.w2
        elif kind == "weight_scale" and self.quantized:
            check_tensor(name, tensor, (out_dim, in_dim // GROUP_SIZE), (torch.float8_e4m3fn,))
            parts = (inter,) if is13 else (None, inter.scaled(GROUP_SIZE, name))
            target = self.w13_scale if is13 else self.w2_scale
        elif kind == "weight_scale_2" and self.quantized:
            if numel(tensor) != 1:
                raise WeightLoadError(f"tensor '{name}': expected a scalar, found shape {tuple(tensor.shape)}")
            parts = None
            target = self.w13_global if is13 else self.w2_global
        else:
            raise WeightLoadError(f"tensor '{name}': unexpected expert tensor kind '{kind}' "
                                  f"({'NVFP4' if self.quantized else 'dense'} experts)")
        if expert not in self.local_expert_ids:
            return
        local = expert - self.first_expert
        if parts is None:
            target.data[local, self._rows(proj)].fill_(global_scale_value(name, read_full(tensor)))
        else:
            target.data[local, self._rows(proj)].copy_(read_partition(tensor, parts))
        self.loaded.add((expert, proj, kind))

    def load_fused(self, name: str, which: str, tensor: TensorSource) -> None:
        """Fused dense checkpoint tensors: gate_up_proj [E, 2I, H] or down_proj [E, H, I] (this rank's
        experts / its part of I only are read)."""
        if self.quantized:
            raise WeightLoadError(f"tensor '{name}': fused dense experts, but the quantization config makes "
                                  "these experts NVFP4")
        e, h, i = self.num_experts, self.hidden_size, self.inter_partition.full
        if which == "gate_up_proj":
            check_tensor(name, tensor, (e, 2 * i, h), FLOAT_DTYPES)
            rows = Partition.concat([self.inter_partition, self.inter_partition])
            self.w13.data.copy_(read_partition(tensor, (self.expert_partition, rows)))
            projs = ("gate_proj", "up_proj")
        else:
            check_tensor(name, tensor, (e, h, i), FLOAT_DTYPES)
            self.w2.data.copy_(read_partition(tensor, (self.expert_partition, None, self.inter_partition)))
            projs = ("down_proj",)
        for ex in self.local_expert_ids:
            for pr in projs:
                self.loaded.add((ex, pr, "weight"))

    def missing(self) -> list[str]:
        kinds = ("weight", "weight_scale", "weight_scale_2") if self.quantized else ("weight",)
        out = []
        for ex in self.local_expert_ids:
            for pr in EXPERT_PROJS:
                for k in kinds:
                    if (ex, pr, k) not in self.loaded:
                        out.append(f"experts.{ex}.{pr}.{k}")
        return out


@dataclass(frozen=True)
class MoEOutput:
    """The MoE block's output before its combination: routed + sigmoid(gate_logit) * shared.
    routed, shared: [T, H]; gate_logit: [T, 1] (a strided column of the block's fused projection)."""

    routed: torch.Tensor
    shared: torch.Tensor
    gate_logit: torch.Tensor


class SparseMoE(nn.Module):
    """hidden [T, H] -> [T, H] summed over the tensor-parallel ranks, or on one rank its uncombined
    `MoEOutput`, which `RMSNorm` takes in place of a tensor."""

    def __init__(self, config: ModelConfig, prefix: str, kernels: KernelSet, dtype: torch.dtype,
                 device: torch.device | str, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.kernels = kernels
        self.parallel = parallel
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        h = config.hidden_size

        def quantized(name: str) -> bool:
            return config.quant is not None and config.quant.is_quantized(f"{prefix}.{name}")

        self.experts = RoutedExperts(config.num_experts, h, config.moe_intermediate_size,
                                     quantized=quantized("experts"), dtype=dtype, device=device, parallel=parallel)
        self.expert_parallel = self.experts.num_local_experts != config.num_experts
        si = config.shared_expert_intermediate_size
        si_part = parallel.split(si, "shared_expert_intermediate_size")
        # Everything that reads `hidden` besides the routed experts, in one GEMM when all of it is BF16 (as in
        # the released checkpoints). FusedProjections merges neighbours of one quantization method, and the
        # router is never quantized, so it goes first: an NVFP4 shared expert then still computes its
        # gate_proj, up_proj and shared_expert_gate in one NVFP4 GEMM.
        self.in_proj = FusedProjections(
            h, [("gate", Partition.whole(config.num_experts), False),
                ("shared_expert.gate_proj", si_part, quantized("shared_expert.gate_proj")),
                ("shared_expert.up_proj", si_part, quantized("shared_expert.up_proj")),
                ("shared_expert_gate", Partition.whole(1), quantized("shared_expert_gate") and h % 16 == 0)],
            kernels=kernels, dtype=dtype, device=device)
        self.shared_down = RowParallelLinear(si, h, quantized=quantized("shared_expert.down_proj"), kernels=kernels,
                                             dtype=dtype, device=device, parallel=parallel, reduce_results=False)
        # the stream the shared expert runs on beside the routed experts (`overlap_shared_experts`), or None
        self.side_stream: torch.cuda.Stream | None = None

    def forward(self, hidden: torch.Tensor, num_valid_tokens: torch.Tensor | None = None
                ) -> torch.Tensor | MoEOutput:
        """hidden [T, H]; num_valid_tokens: int32 [1], tokens from it on (padding of a CUDA-graph batch) are
        routed to no expert (their routed output is 0)."""
        router_logits, gate, up, shared_gate_logit = self.in_proj(hidden)
        side = self.side_stream if hidden.is_cuda and hidden.shape[0] >= SHARED_OVERLAP_MIN_TOKENS else None
        if side is not None:
            main = torch.cuda.current_stream(hidden.device)
            side.wait_stream(main)
            # `shared` is freed later on the main stream; its memory goes back to the side stream's pool, whose
            # next use comes after the next layer's fork, i.e. after everything queued here: no record_stream
            with torch.cuda.stream(side):
                shared = self.shared_down(self.kernels.silu_and_mul(gate, up))
        topk_weights, topk_ids = self.kernels.route(router_logits, self.top_k, self.renormalize, num_valid_tokens)
        if self.expert_parallel:
            topk_weights, topk_ids = self.experts.localize(topk_weights, topk_ids)
        routed = self.kernels.fused_moe(hidden, topk_weights, topk_ids, self.experts.weights())
        if side is not None:
            main.wait_stream(side)
        else:
            shared = self.shared_down(self.kernels.silu_and_mul(gate, up))
        if not self.parallel.is_parallel:
            return MoEOutput(routed, shared, shared_gate_logit)
        return self.parallel.all_reduce(self.kernels.moe_combine(routed, shared, shared_gate_logit))


def overlap_shared_experts(model: nn.Module, stream: torch.cuda.Stream | None) -> int:
    """Run the shared expert of every MoE block of `model` on `stream` (None: inline again); returns how many
    blocks there are."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    for block in blocks:
        block.side_stream = stream
    return len(blocks)
