"""Qwen3.5's multi-token-prediction (MTP) head, the draft model of speculative decoding.

For tokens t with the target model's final hidden states h_t (after its final norm), the head predicts the
token two places ahead of h_t's position: it reads the token that follows h_t's position (x_{t+1}), mixes
its embedding with h_t and runs one full-attention decoder layer at h_t's position:

    out = norm(layer(fc(cat[pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)])))

with `norm` applied to the layer's output plus its residual, as the model's own final norm is. Embedding
and lm_head are the target model's. With several MTP layers, draft step s uses layer s % num_layers.

Checkpoint tensors are `mtp.fc.weight` [H, 2H], `mtp.{pre_fc_norm_embedding,pre_fc_norm_hidden,norm}.weight`
[H] and `mtp.layers.i.*`, named as a model layer's tensors. The published NVFP4 exports keep all of them
BF16; the layers' quantization follows the quantization config's exclude globs (matched against
`mtp.layers.i...`), fc's the checkpoint's own dtype (see `_load_fc`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from nibble.kernels.kernel_set import KernelSet
from nibble.layers.forward_batch import ForwardBatch, ModelCaches
from nibble.layers.linear import FLOAT_DTYPES, Linear, WeightLoadError, check_tensor
from nibble.layers.norm import RMSNorm
from nibble.layers.parallel import ParallelContext, TensorSource, read_full
from nibble.layers.rotary import RotaryEmbedding
from nibble.models.config import ModelConfig
from nibble.models.qwen3_5_moe import DecoderLayer, layer_tensor_names, linear_tensor_names

MTP_PREFIX = "mtp."
_NORMS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
_LAYER_RE = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_NVFP4_KINDS = ("weight_scale", "weight_scale_2", "input_scale")

LayerLoader = Callable[[str, DecoderLayer, str, TensorSource], None]


class Qwen3_5MTP(nn.Module):
    """forward(embeds [T, H], hidden [T, H], batch, caches, step) -> [T, H] (after the head's final norm).

    Its layer i is a full-attention `DecoderLayer` whose KV cache is `caches.kv[num_hidden_layers + i]`
    (ModelCaches.allocate(..., num_mtp_layers=n) appends those). fc is replicated on every
    tensor-parallel rank; the layers are split like the model's.
    """

    def __init__(self, config: ModelConfig, num_layers: int, kernels: KernelSet, rotary: RotaryEmbedding,
                 dtype: torch.dtype, device: torch.device | str, parallel: ParallelContext) -> None:
        super().__init__()
        self.config = config
        self.num_layers = num_layers
        self.kernels = kernels
        self.dtype = dtype
        self.device = torch.device(device)
        h, eps = config.hidden_size, config.rms_norm_eps
        # Built as the checkpoint most likely stores it (loading then follows the tensors, see _load_fc): an
        # exclude list that keeps the MTP layers BF16 means a BF16 fc too, even when it does not name fc.
        quant = config.quant
        self.fc = self._make_fc(quant is not None and quant.is_quantized(f"{MTP_PREFIX}fc")
                                and quant.is_quantized(f"{MTP_PREFIX}layers.0.mlp.experts"))
        self.pre_fc_norm_embedding = RMSNorm(h, eps, kernels, device)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, kernels, device)
        self.norm = RMSNorm(h, eps, kernels, device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, config.num_hidden_layers + i, kernels, rotary, dtype, device, parallel,
                         prefix=f"{MTP_PREFIX}layers.{i}", full_attention=True)
            for i in range(num_layers))
        self._fc_loaded: set[str] = set()

    def _make_fc(self, quantized: bool) -> Linear:
        h = self.config.hidden_size
        return Linear(2 * h, [h], quantized=quantized, kernels=self.kernels, dtype=self.dtype, device=self.device)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, caches: ModelCaches,
                step: int = 0) -> torch.Tensor:
        """embeds: embeddings of the tokens following each row's position [T, H]; hidden: the target's final
        hidden states (or the previous draft step's output) [T, H]; batch.positions are those of `hidden`."""
        e, _ = self.pre_fc_norm_embedding(embeds)
        x, _ = self.pre_fc_norm_hidden(hidden)
        x = self.fc(torch.cat([e, x], dim=-1))
        layer = self.layers[step % self.num_layers]
        out, residual = layer(x, None, batch, caches)
        out, _ = self.norm(out, residual)
        return out

    def layer_ids(self) -> list[int]:
        """The cache indices (kv) of the head's layers."""
        return [layer.layer_id for layer in self.layers]

    def load(self, name: str, tensor: TensorSource, load_layer: LayerLoader) -> None:
        """One normalised `mtp.*` checkpoint tensor; `load_layer(name, layer, rest, tensor)` loads a layer's
        tensor (rest: the name after `mtp.layers.i.`) as the model loads its own layers'."""
        head, _, tail = name[len(MTP_PREFIX):].partition(".")
        if head in _NORMS and tail == "weight":
            norm = getattr(self, head)
            check_tensor(name, tensor, tuple(norm.weight.shape), FLOAT_DTYPES)
            norm.weight.data.copy_(read_full(tensor))
        elif head == "fc":
            self._load_fc(name, tail, tensor)
        elif (m := _LAYER_RE.match(name)) is not None:
            index = int(m.group(1))
            if index >= self.num_layers:
                raise WeightLoadError(f"tensor '{name}': MTP layer {index}, but the head was built with "
                                      f"{self.num_layers} layer(s)")
            load_layer(name, self.layers[index], m.group(2), tensor)
        else:
            raise WeightLoadError(f"tensor '{name}': not part of a Qwen3.5 MTP head")

    def _load_fc(self, name: str, kind: str, tensor: TensorSource) -> None:
        # nvidia/Qwen3.5-397B-A17B-NVFP4 stores mtp.fc in BF16 although its exclude list (`mtp.layers.0*`)
        # does not cover it, so the config cannot be trusted here: fc takes the format of its tensors.
        nvfp4 = tensor.dtype == torch.uint8 if kind == "weight" else kind in _NVFP4_KINDS
        if nvfp4 != self.fc.quantized:
            if self._fc_loaded:
                raise WeightLoadError(f"tensor '{name}': {'NVFP4' if nvfp4 else 'dense'} tensor, but "
                                      f"{sorted(self._fc_loaded)} of mtp.fc were "
                                      f"{'dense' if nvfp4 else 'NVFP4'}")
            self.fc = self._make_fc(nvfp4)
        self.fc.load(name, kind, tensor)
        self._fc_loaded.add(kind)

    def expected_tensor_names(self) -> list[str]:
        """Normalised checkpoint names the head needs, routed experts aside (see `missing_expert_names`)."""
        names = [f"{MTP_PREFIX}{n}.weight" for n in _NORMS]
        names += linear_tensor_names(f"{MTP_PREFIX}fc", self.fc)
        for layer in self.layers:
            names += layer_tensor_names(layer)
        return names

    def missing_expert_names(self) -> list[str]:
        return [f"{layer.prefix}.mlp.{n}" for layer in self.layers for n in layer.mlp.experts.missing()]
