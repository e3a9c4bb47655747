"""Qwen3.5-MoE text model: 3 Gated DeltaNet layers then 1 gated full-attention layer, repeating, each
followed by a sparse MoE with a shared expert.

The model computes with the kernels of the `KernelSet` it is built with, reads and writes the paged KV cache
and the GDN state pool through `ForwardBatch`, and maps checkpoint tensors onto its parameters in
`load_weights` (names normalised to the text-only layout `model.layers.N...`; the MTP head's, when built,
stay `mtp.*`).

Built with a `ParallelContext` of tp_size > 1, the model is one tensor-parallel rank: every layer holds its
share of the weights (see nibble/layers/parallel.py), `load_weights` reads only that share of each
checkpoint tensor (given lazily, see nibble/checkpoint/loader.py), `forward` returns the full hidden states
on every rank (all-reduced after each row-parallel block) and `compute_logits` the full logits.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from nibble.kernels.kernel_set import KernelSet
from nibble.layers.attention import GatedAttention
from nibble.layers.embedding import Embedding, LMHead
from nibble.layers.forward_batch import ForwardBatch, ModelCaches
from nibble.layers.gdn import GatedDeltaNet
from nibble.layers.linear import FLOAT_DTYPES, FusedProjections, Linear, WeightLoadError, check_tensor
from nibble.layers.moe import MoEOutput, SparseMoE
from nibble.layers.norm import RMSNorm
from nibble.layers.parallel import SINGLE, ParallelContext, TensorSource, read_full, read_partition
from nibble.layers.rotary import RotaryEmbedding
from nibble.models.config import FULL_ATTENTION, ConfigError, ModelConfig

if TYPE_CHECKING:
    from nibble.models.qwen3_5_mtp import Qwen3_5MTP
    from nibble.models.qwen3_5_vision import Qwen3_5VisionModel

logger = logging.getLogger("nibble.models")

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
_LINEAR_KINDS = ("weight", "weight_scale", "weight_scale_2", "input_scale")


class DecoderLayer(nn.Module):
    """One decoder layer (token mixer + MoE, each with its pre-norm and residual).

    layer_id: the index of its cache in `ModelCaches` (kv or gdn). prefix: its checkpoint module name, which
    the quantization config's exclude globs are matched against (default `model.layers.{layer_id}`).
    full_attention: its mixer (default from config.layer_types[layer_id]). The MTP head builds its layers
    with all three given: `mtp.layers.i`, full attention, cache index num_hidden_layers + i.
    """

    def __init__(self, config: ModelConfig, layer_id: int, kernels: KernelSet, rotary: RotaryEmbedding,
                 dtype: torch.dtype, device: torch.device | str, parallel: ParallelContext, *,
                 prefix: str | None = None, full_attention: bool | None = None) -> None:
        super().__init__()
        prefix = prefix or f"model.layers.{layer_id}"
        self.layer_id = layer_id
        self.prefix = prefix
        self.is_full_attention = (config.layer_types[layer_id] == FULL_ATTENTION if full_attention is None
                                  else full_attention)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels, device)
        if self.is_full_attention:
            self.self_attn = GatedAttention(config, f"{prefix}.self_attn", kernels, rotary, dtype, device, parallel)
            self.kv_scales = [1.0, 1.0]
        else:
            self.linear_attn = GatedDeltaNet(config, f"{prefix}.linear_attn", kernels, dtype, device, parallel)
        self.mlp = SparseMoE(config, f"{prefix}.mlp", kernels, dtype, device, parallel)

    def forward(self, hidden: torch.Tensor | MoEOutput, residual: torch.Tensor | None, batch: ForwardBatch,
                caches: ModelCaches) -> tuple[torch.Tensor | MoEOutput, torch.Tensor]:
        """hidden: the embeddings (first layer, residual None) or the previous layer's MoE output, which this
        layer's input norm combines (`MoEOutput` on one rank). Returns (this layer's MoE output, residual)."""
        if residual is None:
            assert isinstance(hidden, torch.Tensor)
            residual = hidden
            hidden, _ = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.is_full_attention:
            cache = caches.kv[self.layer_id]
            assert cache is not None
            hidden = self.self_attn(hidden, batch, cache)
        else:
            state = caches.gdn[self.layer_id]
            assert state is not None
            hidden = self.linear_attn(hidden, batch, state)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        assert residual is not None
        return self.mlp(hidden, batch.num_valid_tokens), residual


class Qwen3_5MoeForCausalLM(nn.Module):
    """forward(batch, caches) -> hidden [num_tokens, hidden]; compute_logits(hidden [N, hidden]) -> fp32
    [N, vocab].

    num_mtp_layers > 0 also builds the MTP head (`self.mtp`, see nibble/models/qwen3_5_mtp.py) with that
    many of the checkpoint's MTP layers, run by `mtp_forward`; its KV caches follow the model's
    (ModelCaches.allocate(..., num_mtp_layers=n)).
    """

    def __init__(self, config: ModelConfig, kernels: KernelSet, dtype: torch.dtype,
                 device: torch.device | str, max_positions: int | None = None,
                 parallel: ParallelContext | None = None, num_mtp_layers: int = 0) -> None:
        super().__init__()
        self.config = config
        self.kernels = kernels
        self.dtype = dtype
        self.device = torch.device(device)
        self.parallel = parallel = parallel or SINGLE
        max_positions = max_positions or config.max_context_len
        self.rotary = RotaryEmbedding(config.rotary_dim, max_positions, config.rope_theta, kernels, device,
                                      scaling=config.rope_scaling)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype, device, parallel)
        self.layers = nn.ModuleList(DecoderLayer(config, i, kernels, self.rotary, dtype, device, parallel)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels, device)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, dtype, device,
                              tied=self.embed_tokens if config.tie_word_embeddings else None, parallel=parallel)
        self.num_mtp_layers = num_mtp_layers
        self.mtp: Qwen3_5MTP | None = None
        if num_mtp_layers > 0:
            if config.mtp_num_hidden_layers < num_mtp_layers:
                raise ConfigError(f"{config.source}: {num_mtp_layers} MTP layer(s) requested for speculative "
                                  f"decoding, but mtp_num_hidden_layers is {config.mtp_num_hidden_layers}")
            from nibble.models.qwen3_5_mtp import Qwen3_5MTP

            self.mtp = Qwen3_5MTP(config, num_mtp_layers, kernels, self.rotary, dtype, device, parallel)
        # the vision tower, set by the loader for a multimodal checkpoint (nibble/checkpoint/loader.py)
        self.visual: Qwen3_5VisionModel | None = None
        self._loaded: set[str] = set()

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        hidden: torch.Tensor | MoEOutput = self.embed_tokens(batch.input_ids)
        if batch.mm_embeds is not None:
            # image placeholders take the vision tower's rows instead of their (shared) token embedding
            hidden = hidden.index_copy(0, batch.mm_token_index, batch.mm_embeds.to(hidden.dtype))
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, batch, caches)
        out, _ = self.norm(hidden, residual)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def mtp_forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, caches: ModelCaches,
                    step: int = 0, embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One MTP draft step: input_ids int64 [T], the token following each row's position; hidden [T, H],
        what `forward` returned for those positions (or the previous step's output); batch: positions, KV
        slots and block tables of those rows; embeds: (row indices int64 [m], rows [m, H]) that replace the
        embeddings of those rows' tokens (vision rows of image placeholders). Returns [T, H] after the head's
        final norm, for `compute_logits`. Step s runs MTP layer s % num_mtp_layers."""
        if self.mtp is None:
            raise RuntimeError("mtp_forward: the model was built without an MTP head (num_mtp_layers=0)")
        x = self.embed_tokens(input_ids)
        if embeds is not None:
            index, rows = embeds
            x = x.index_copy(0, index.to(x.device), rows.to(x.dtype))
        return self.mtp(x, hidden, batch, caches, step)

    def cache_dims(self) -> dict[str, int]:
        """This rank's cache widths, as `ModelCaches.allocate` overrides: num_kv_heads, num_v_heads, conv_dim."""
        dims = {"num_kv_heads": self.config.num_key_value_heads, "num_v_heads": self.config.linear_num_value_heads,
                "conv_dim": self.config.linear_conv_dim}
        for layer in self.layers:
            if layer.is_full_attention:
                dims["num_kv_heads"] = layer.self_attn.num_kv_heads
            else:
                dims["num_v_heads"] = layer.linear_attn.num_v_heads
                dims["conv_dim"] = layer.linear_attn.conv_dim
        return dims

    def kv_scales(self) -> dict[int, tuple[float, float]]:
        """FP8 KV-cache scales found in the checkpoint, per full-attention layer (1.0 when absent), the MTP
        head's layers included (ids num_hidden_layers + i)."""
        layers = [*self.layers, *(self.mtp.layers if self.mtp is not None else ())]
        return {layer.layer_id: (layer.kv_scales[0], layer.kv_scales[1])
                for layer in layers if layer.is_full_attention}

    def load_weights(self, weights: Iterable[tuple[str, TensorSource]]) -> None:
        """Copy checkpoint tensors (normalised names, streamed one at a time, in memory or lazily read) into
        the parameters; of a lazy tensor only this rank's part is read.

        Raises WeightLoadError naming the tensor on any unknown name, shape or dtype mismatch; call
        `check_complete()` afterwards to find tensors the checkpoint lacked.
        """
        for name, tensor in weights:
            self._load_one(name, tensor)
            self._loaded.add(name)

    def _load_one(self, name: str, tensor: TensorSource) -> None:
        cfg = self.config
        if name == "model.embed_tokens.weight":
            check_tensor(name, tensor, (cfg.vocab_size, cfg.hidden_size), FLOAT_DTYPES)
            self.embed_tokens.load(tensor)
            return
        if name == "lm_head.weight":
            if self.lm_head.tied is not None:
                return
            check_tensor(name, tensor, (cfg.vocab_size, cfg.hidden_size), FLOAT_DTYPES)
            self.lm_head.load(tensor)
            return
        if name == "model.norm.weight":
            load_norm(name, self.norm, tensor)
            return
        if name.startswith("mtp."):
            if self.mtp is None:
                raise WeightLoadError(f"tensor '{name}': MTP head tensor, but the model was built without an "
                                      "MTP head (num_mtp_layers=0)")
            self.mtp.load(name, tensor, self._load_layer)
            return
        m = _LAYER_RE.match(name)
        if m is None:
            raise WeightLoadError(f"tensor '{name}': not part of a Qwen3.5-MoE text model")
        layer_id, rest = int(m.group(1)), m.group(2)
        if layer_id >= len(self.layers):
            raise WeightLoadError(f"tensor '{name}': layer {layer_id} but the config has "
                                  f"{len(self.layers)} layers")
        self._load_layer(name, self.layers[layer_id], rest, tensor)

    def _load_layer(self, name: str, layer: DecoderLayer, rest: str, tensor: TensorSource) -> None:
        """One tensor of a decoder layer (the model's or the MTP head's); rest: its name after the layer's
        prefix."""
        if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            load_norm(name, getattr(layer, rest.split(".")[0]), tensor)
        elif rest.startswith("self_attn."):
            if not layer.is_full_attention:
                raise WeightLoadError(f"tensor '{name}': {layer.prefix} is a linear-attention layer")
            self._load_attention(name, layer, rest[len("self_attn."):], tensor)
        elif rest.startswith("linear_attn."):
            if layer.is_full_attention:
                raise WeightLoadError(f"tensor '{name}': {layer.prefix} is a full-attention layer")
            self._load_gdn(name, layer.linear_attn, rest[len("linear_attn."):], tensor)
        elif rest.startswith("mlp."):
            self._load_moe(name, layer.mlp, rest, tensor)
        else:
            raise WeightLoadError(f"tensor '{name}': not part of a Qwen3.5-MoE text model")

    @staticmethod
    def _load_linear(name: str, target: Linear | FusedProjections, proj: str, kind: str,
                     tensor: TensorSource) -> None:
        if kind not in _LINEAR_KINDS:
            raise WeightLoadError(f"tensor '{name}': unknown tensor kind '{kind}'")
        if isinstance(target, FusedProjections):
            lin, shard = target.locate(proj)
            lin.load(name, kind, tensor, shard)
        else:
            target.load(name, kind, tensor)

    def _load_attention(self, name: str, layer: DecoderLayer, rest: str, tensor: TensorSource) -> None:
        attn = layer.self_attn
        proj, _, kind = rest.partition(".")
        if rest in ("q_norm.weight", "k_norm.weight"):
            load_norm(name, attn.q_norm if proj == "q_norm" else attn.k_norm, tensor)
        elif kind in ("k_scale", "v_scale") or rest in ("k_scale", "v_scale"):
            scale_kind = kind or rest
            layer.kv_scales[0 if scale_kind == "k_scale" else 1] = float(read_full(tensor).float().reshape(-1)[0])
        elif proj in ("q_proj", "k_proj", "v_proj"):
            self._load_linear(name, attn.qkv, proj, kind, tensor)
        elif proj == "o_proj":
            self._load_linear(name, attn.o_proj, proj, kind, tensor)
        else:
            raise WeightLoadError(f"tensor '{name}': unknown attention tensor")

    def _load_gdn(self, name: str, gdn: GatedDeltaNet, rest: str, tensor: TensorSource) -> None:
        proj, _, kind = rest.partition(".")
        if proj in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
            self._load_linear(name, gdn.in_proj, proj, kind, tensor)
        elif proj == "out_proj":
            self._load_linear(name, gdn.out_proj, proj, kind, tensor)
        elif rest == "conv1d.weight":
            c, w = gdn.conv_partition.full, gdn.conv_weight.shape[1]
            if len(tensor.shape) == 3:
                check_tensor(name, tensor, (c, 1, w), FLOAT_DTYPES)
                gdn.conv_weight.data.copy_(read_partition(tensor, (gdn.conv_partition,))[:, 0])
            else:
                check_tensor(name, tensor, (c, w), FLOAT_DTYPES)
                gdn.conv_weight.data.copy_(read_partition(tensor, (gdn.conv_partition,)))
        elif rest in ("A_log", "dt_bias"):
            param = getattr(gdn, rest)
            check_tensor(name, tensor, (gdn.head_partition.full,), FLOAT_DTYPES)
            param.data.copy_(read_partition(tensor, (gdn.head_partition,)))
        elif rest == "norm.weight":
            check_tensor(name, tensor, tuple(gdn.norm_weight.shape), FLOAT_DTYPES)
            gdn.norm_weight.data.copy_(read_full(tensor))
        else:
            raise WeightLoadError(f"tensor '{name}': unknown linear-attention tensor")

    def _load_moe(self, name: str, moe: SparseMoE, rest: str, tensor: TensorSource) -> None:
        m = _EXPERT_RE.match(rest)
        if m is not None:
            moe.experts.load_expert(name, int(m.group(1)), m.group(2), m.group(3), tensor)
            return
        if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            moe.experts.load_fused(name, rest.rsplit(".", 1)[1], tensor)
            return
        sub = rest[len("mlp."):]
        proj, _, kind = sub.rpartition(".")
        if proj == "gate" and tensor.dtype == torch.uint8:
            raise WeightLoadError(f"tensor '{name}': the router must be BF16, found an NVFP4 weight")
        if proj in moe.in_proj.names:
            self._load_linear(name, moe.in_proj, proj, kind, tensor)
        elif proj == "shared_expert.down_proj":
            self._load_linear(name, moe.shared_down, proj, kind, tensor)
        else:
            raise WeightLoadError(f"tensor '{name}': unknown MoE tensor")

    def expected_tensor_names(self) -> list[str]:
        """Checkpoint names (normalised) this model needs, routed experts aside (see RoutedExperts.missing)."""
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if self.lm_head.tied is None:
            names.append("lm_head.weight")
        for layer in self.layers:
            names += layer_tensor_names(layer)
        if self.mtp is not None:
            names += self.mtp.expected_tensor_names()
        return names

    def check_complete(self) -> None:
        """Raise WeightLoadError listing the tensors the checkpoint did not provide."""
        missing = [n for n in self.expected_tensor_names() if n not in self._loaded]
        for layer in self.layers:
            missing += [f"{layer.prefix}.mlp.{n}" for n in layer.mlp.experts.missing()]
        if self.mtp is not None:
            missing += self.mtp.missing_expert_names()
        if missing:
            shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} in all)" if len(missing) > 8 else "")
            raise WeightLoadError(f"checkpoint is missing tensors: {shown}")

    def finalize(self) -> None:
        """Derive compute-time values from loaded weights (norm multipliers, GDN decay rates)."""
        for mod in self.modules():
            if isinstance(mod, (RMSNorm, GatedDeltaNet)):
                mod.finalize()


def load_norm(name: str, norm: RMSNorm, tensor: TensorSource) -> None:
    check_tensor(name, tensor, tuple(norm.weight.shape), FLOAT_DTYPES)
    norm.weight.data.copy_(read_full(tensor))


def layer_tensor_names(layer: DecoderLayer) -> list[str]:
    """Normalised checkpoint names of a decoder layer's tensors, routed experts aside."""
    p = layer.prefix
    names = [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
    if layer.is_full_attention:
        a = layer.self_attn
        names += [f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"]
        names += linear_tensor_names(f"{p}.self_attn", a.qkv)
        names += linear_tensor_names(f"{p}.self_attn.o_proj", a.o_proj)
    else:
        g = layer.linear_attn
        names += [f"{p}.linear_attn.{n}" for n in ("conv1d.weight", "A_log", "dt_bias", "norm.weight")]
        names += linear_tensor_names(f"{p}.linear_attn", g.in_proj)
        names += linear_tensor_names(f"{p}.linear_attn.out_proj", g.out_proj)
    names += linear_tensor_names(f"{p}.mlp", layer.mlp.in_proj)
    names += linear_tensor_names(f"{p}.mlp.shared_expert.down_proj", layer.mlp.shared_down)
    return names


def linear_tensor_names(prefix: str, lin: Linear | FusedProjections) -> list[str]:
    """Checkpoint names of a linear's tensors (`prefix.kind`, or `prefix.proj.kind` for fused projections)."""
    if isinstance(lin, FusedProjections):
        out = []
        for name in lin.names:
            target, _ = lin.locate(name)
            out += [f"{prefix}.{name}.{k}" for k in target.param_kinds()]
        return out
    return [f"{prefix}.{k}" for k in lin.param_kinds()]
