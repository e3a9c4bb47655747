"""Tiny random Qwen3.5-MoE checkpoints built with transformers, and the transformers reference model of a
(possibly NVFP4) checkpoint.

`make_tiny_qwen35_moe` writes a checkpoint directory in any of the layouts nibble must read: text-only as
transformers' `save_pretrained` writes it (per-expert tensors), the multimodal layout of the published
Qwen3.5 checkpoints (`model.language_model.*`, plus vision tower and MTP tensors), and fused experts
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) as in the original BF16 files.
`load_dequantized_reference` rebuilds the transformers model from any of these, with NVFP4 weights
dequantized exactly, so tests can compare nibble against transformers. `MTPReference` does the same for the
checkpoint's MTP head.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from nibble.checkpoint.safetensors_io import (
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_FILE,
    ShardWriter,
    iter_tensors,
    list_shards,
)
from nibble.formats.nvfp4 import dequantize

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt")
_PER_EXPERT_RE = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def _transformers() -> Any:
    # transformers picks fla at import time when importable, and fla cannot run on a CPU; hiding it makes
    # transformers use its torch fallback (tests/conftest.py does the same for the whole session).
    if "fla" not in sys.modules:
        sys.modules["fla"] = None  # type: ignore[assignment]
    import transformers

    return transformers


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter seeded random values at scales that keep the tiny model's activations and
    logits O(1): transformers' own init leaves norms at 0/1 and dt_bias at 1, which would hide bugs."""
    gen = torch.Generator().manual_seed(seed)
    owners = {f"{mod_name}.{p_name}" if mod_name else p_name: type(mod).__name__
              for mod_name, mod in model.named_modules() for p_name, _ in mod.named_parameters(recurse=False)}
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            shape = tuple(p.shape)
            noise = torch.randn(shape, generator=gen)
            owner = owners[name]
            if owner.endswith("RMSNormGated"):
                # The gated norm of the GDN output multiplies by w, not by 1 + w.
                value = 1.0 + 0.1 * noise
            elif owner.endswith("RMSNorm"):
                value = 0.1 * noise
            elif name.endswith("A_log"):
                value = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
            elif name.endswith("dt_bias"):
                value = 1.0 + 0.1 * noise
            elif name.endswith("conv1d.weight"):
                value = 0.3 * noise
            elif name.endswith("embed_tokens.weight"):
                value = noise
            elif name == "lm_head.weight" or name.endswith("mlp.gate.weight"):
                value = noise / math.sqrt(shape[-1])
            elif p.ndim >= 2:
                value = 0.5 * noise / math.sqrt(shape[-1])
            else:
                value = 0.02 * noise
            p.copy_(value.to(p.dtype))


def _fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert `experts.E.{gate,up,down}_proj.weight` -> `experts.gate_up_proj` [E, 2I, H] (gate rows
    first) and `experts.down_proj` [E, H, I]."""
    per_layer: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        m = _PER_EXPERT_RE.fullmatch(name)
        if m is None:
            out[name] = t
        else:
            per_layer.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
    for base, parts in per_layer.items():
        num_experts = 1 + max(e for e, _ in parts)
        out[f"{base}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(num_experts)])
        out[f"{base}.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(num_experts)])
    return out


TINY_VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "in_channels": 3,
               "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 16,
               "hidden_act": "gelu_pytorch_tanh"}


def _vision_tensors(hidden: int, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A complete random vision tower (transformers' `Qwen3_5MoeVisionModel`, TINY_VISION, output width
    `hidden`) as `model.visual.*` tensors, at scales that keep its output O(1)."""
    _transformers()
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeVisionConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

    with torch.random.fork_rng(devices=[]):
        tower = Qwen3_5MoeVisionModel(Qwen3_5MoeVisionConfig(**TINY_VISION, out_hidden_size=hidden))
    gen = torch.Generator().manual_seed(seed + 2)
    out = {}
    for name, p in tower.state_dict().items():
        noise = torch.randn(p.shape, generator=gen)
        if p.dim() == 1:
            value = 1 + 0.1 * noise if "norm" in name and name.endswith("weight") else 0.1 * noise
        elif name == "pos_embed.weight":
            value = 0.5 * noise
        else:
            value = noise / p[0].numel() ** 0.5
        out[f"model.visual.{name}"] = value.to(dtype)
    return out


def _extra_tensors(tensors: dict[str, torch.Tensor], text_config: dict[str, Any], seed: int,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A random tiny vision tower and a one-layer MTP head shaped like the model's last full-attention
    layer, so that the multimodal layout carries everything the published checkpoints do."""
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = text_config["hidden_size"]

    def rand(*shape: int) -> torch.Tensor:
        return (0.05 * torch.randn(shape, generator=gen)).to(dtype)

    out = {
        **_vision_tensors(hidden, seed, dtype),
        "mtp.fc.weight": rand(hidden, 2 * hidden),
        "mtp.pre_fc_norm_embedding.weight": rand(hidden),
        "mtp.pre_fc_norm_hidden.weight": rand(hidden),
        "mtp.norm.weight": rand(hidden),
    }
    full = max(i for i, t in enumerate(text_config["layer_types"]) if t == "full_attention")
    src = f"model.layers.{full}."
    for name, t in tensors.items():
        if name.startswith(src):
            out["mtp.layers.0." + name[len(src):]] = rand(*t.shape)
    return out


def _multimodal_config(text: dict[str, Any]) -> dict[str, Any]:
    text = {k: v for k, v in text.items() if k not in ("architectures", "transformers_version")}
    text["model_type"] = "qwen3_5_moe_text"
    text["mtp_num_hidden_layers"] = 1
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "dtype": text.get("dtype", "float32"),
        "image_token_id": text["vocab_size"] - 3,
        "video_token_id": text["vocab_size"] - 2,
        "vision_start_token_id": text["vocab_size"] - 5,
        "vision_end_token_id": text["vocab_size"] - 4,
        "text_config": text,
        "tie_word_embeddings": False,
        "vision_config": {"model_type": "qwen3_5_moe_vision", **TINY_VISION,
                          "out_hidden_size": text["hidden_size"], "deepstack_visual_indexes": []},
    }


def make_tiny_qwen35_moe(dst_dir: str | Path, *, hidden_size: int = 64, num_hidden_layers: int = 4,
                         num_attention_heads: int = 4, num_key_value_heads: int = 2, head_dim: int = 32,
                         linear_num_key_heads: int = 2, linear_num_value_heads: int = 4,
                         linear_key_head_dim: int = 16, linear_value_head_dim: int = 16, num_experts: int = 8,
                         num_experts_per_tok: int = 2, moe_intermediate_size: int = 32,
                         shared_expert_intermediate_size: int = 48, vocab_size: int = 256,
                         layer_types: list[str] | None = None, seed: int = 0, dtype: torch.dtype = torch.float32,
                         multimodal: bool = False, fused_experts: bool = False,
                         max_shard_size: int | str | None = None, tokenizer_dir: str | Path | None = None,
                         config_overrides: dict[str, Any] | None = None) -> Path:
    """Write a random Qwen3.5-MoE checkpoint to `dst_dir` and return the directory.

    Text-only and unsharded with per-expert tensors, the files are exactly what transformers'
    `Qwen3_5MoeForCausalLM.save_pretrained` writes. `multimodal` switches to the published layout
    (`Qwen3_5MoeForConditionalGeneration`, `text_config`, `model.language_model.*` names, dummy
    `model.visual.*` tensors, a one-layer `mtp.*` head); `fused_experts` stores experts as
    `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]; `max_shard_size` shards the safetensors (with an
    index). `tokenizer_dir` (e.g. nibble/assets/demo_tokenizer) is copied in when its vocabulary fits.
    `config_overrides` sets any other text-config field (e.g. eos_token_id).
    """
    transformers = _transformers()
    dst = Path(dst_dir)
    kwargs: dict[str, Any] = dict(
        hidden_size=hidden_size, num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, head_dim=head_dim, linear_num_key_heads=linear_num_key_heads,
        linear_num_value_heads=linear_num_value_heads, linear_key_head_dim=linear_key_head_dim,
        linear_value_head_dim=linear_value_head_dim, num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=moe_intermediate_size,
        shared_expert_intermediate_size=shared_expert_intermediate_size, vocab_size=vocab_size,
        **({"layer_types": layer_types} if layer_types is not None else {}), **(config_overrides or {}))
    config = transformers.Qwen3_5MoeTextConfig(**kwargs)
    config.architectures = ["Qwen3_5MoeForCausalLM"]
    # Module construction draws from the global RNG; keep the caller's stream untouched.
    with torch.random.fork_rng(devices=[]):
        model = transformers.Qwen3_5MoeForCausalLM(config)
    _randomize(model, seed)
    model.to(dtype)
    model.save_pretrained(dst)
    del model

    if multimodal or fused_experts or max_shard_size is not None:
        (shard,) = list_shards(dst)
        tensors = {name: t for name, t, _ in iter_tensors([shard])}
        shard.unlink()
        text_config = json.loads((dst / "config.json").read_text())
        if multimodal:
            tensors.update(_extra_tensors(tensors, text_config, seed, dtype))
        if fused_experts:
            tensors = _fuse_experts(tensors)
        if multimodal:
            tensors = {("model.language_model." + n[len("model."):]) if n.startswith("model.") and
                       not n.startswith("model.visual.") else n: t for n, t in tensors.items()}
            (dst / "config.json").write_text(json.dumps(_multimodal_config(text_config), indent=2) + "\n")
        (dst / INDEX_FILE).unlink(missing_ok=True)
        with ShardWriter(dst, max_shard_size or DEFAULT_MAX_SHARD_SIZE) as writer:
            for name in sorted(tensors):
                writer.add(name, tensors[name])
    if tokenizer_dir is not None:
        _copy_tokenizer(Path(tokenizer_dir), dst, vocab_size)
    return dst


def _copy_tokenizer(src: Path, dst: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer

    tok_path = src / "tokenizer.json"
    if not tok_path.is_file():
        raise ValueError(f"{src}: no tokenizer.json")
    tok_vocab = Tokenizer.from_file(str(tok_path)).get_vocab_size(with_added_tokens=True)
    if tok_vocab > vocab_size:
        raise ValueError(f"{tok_path}: tokenizer has {tok_vocab} ids but the model's vocab_size is {vocab_size}")
    for file in TOKENIZER_FILES:
        if (src / file).is_file():
            shutil.copy2(src / file, dst / file)


def _text_config(model_dir: Path) -> dict[str, Any]:
    """The text config of a checkpoint's config.json (either layout) as Qwen3_5MoeTextConfig arguments."""
    raw = json.loads((model_dir / "config.json").read_text())
    text = dict(raw.get("text_config", raw))
    for key in ("architectures", "quantization_config", "transformers_version", "model_type"):
        text.pop(key, None)
    return text


def _dequantized(raw_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp32 tensors with every NVFP4 weight dequantized exactly and its scale tensors dropped."""
    out: dict[str, torch.Tensor] = {}
    for name, t in raw_tensors.items():
        if name.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
            continue
        if t.dtype == torch.uint8:
            module = name[: -len(".weight")]
            t = dequantize(t, raw_tensors[f"{module}.weight_scale"], raw_tensors[f"{module}.weight_scale_2"])
        out[name] = t.float()
    return out


def load_dequantized_reference(nvfp4_dir: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """The transformers `Qwen3_5MoeForCausalLM` (eval mode, `dtype`) holding the checkpoint's language
    model, NVFP4 linears dequantized exactly (e2m1 * e4m3 block scale * weight_scale_2) with
    nibble.formats.nvfp4.dequantize. Accepts either layout, per-expert or fused experts, quantized or not;
    vision and MTP tensors are ignored."""
    transformers = _transformers()
    model_dir = Path(nvfp4_dir)
    config = transformers.Qwen3_5MoeTextConfig(**_text_config(model_dir))
    with torch.random.fork_rng(devices=[]):
        model = transformers.Qwen3_5MoeForCausalLM(config)

    raw_tensors: dict[str, torch.Tensor] = {}
    for name, t, _ in iter_tensors(list_shards(model_dir)):
        if name.startswith(("model.visual.", "mtp.")):
            continue
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        raw_tensors[name] = t
    state = _fuse_experts(_dequantized(raw_tensors))
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return model.to(dtype).eval()


class MTPReference(torch.nn.Module):
    """Qwen3.5's MTP head from a checkpoint's `mtp.*` tensors, written from its definition: transformers'
    own `Qwen3_5MoeDecoderLayer` (full attention) for the layer, plain torch and transformers' RMSNorm for
    the rest. forward(input_ids [L], hidden [L, H]) -> [L, H] for ONE sequence at positions 0..L-1 (causal
    attention over the rows): row t reads the token following position t and the target's hidden state at t.
    """

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32, layer: int = 0) -> None:
        super().__init__()
        _transformers()
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen

        model_dir = Path(model_dir)
        config = qwen.Qwen3_5MoeTextConfig(**_text_config(model_dir))
        config._attn_implementation = "eager"
        tensors = _dequantized({name: t for name, t, _ in iter_tensors(list_shards(model_dir))
                                if name.startswith("mtp.") or name.endswith("embed_tokens.weight")})
        (embed,) = [t for n, t in tensors.items() if n.endswith("embed_tokens.weight")]
        hidden, eps = config.hidden_size, config.rms_norm_eps
        with torch.random.fork_rng(devices=[]):
            self.layer = qwen.Qwen3_5MoeDecoderLayer(config, config.layer_types.index("full_attention"))
            self.rotary = qwen.Qwen3_5MoeTextRotaryEmbedding(config)
            self.norms = torch.nn.ModuleDict({n: qwen.Qwen3_5MoeRMSNorm(hidden, eps)
                                              for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")})
        prefix = f"mtp.layers.{layer}."
        layer_state = _fuse_experts({n: t for n, t in tensors.items() if n.startswith(prefix)})
        self.layer.load_state_dict({n[len(prefix):]: t for n, t in layer_state.items()}, strict=True)
        for n, norm in self.norms.items():
            norm.weight.data.copy_(tensors[f"mtp.{n}.weight"])
        self.register_buffer("embed", embed)
        self.register_buffer("fc", tensors["mtp.fc.weight"])
        self.to(dtype).eval()

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        e = self.norms["pre_fc_norm_embedding"](torch.nn.functional.embedding(input_ids, self.embed))
        x = self.norms["pre_fc_norm_hidden"](hidden.to(e.dtype))
        x = torch.nn.functional.linear(torch.cat([e, x], dim=-1), self.fc)[None]
        length = x.shape[1]
        positions = torch.arange(length)[None]
        mask = torch.full((length, length), float("-inf"), dtype=x.dtype).triu(1)[None, None]
        x = self.layer(x, position_embeddings=self.rotary(x, positions), attention_mask=mask,
                       position_ids=positions)
        return self.norms["norm"](x)[0]
