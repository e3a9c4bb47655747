"""Typed, frozen view of a Hugging Face Qwen3.5-MoE config.json.

Both layouts are accepted: the multimodal `Qwen3_5MoeForConditionalGeneration` file, whose language model
settings sit under `text_config` and whose tensors are prefixed `model.language_model.`, and the text-only
`Qwen3_5MoeForCausalLM` file with everything at the top level and tensors under `model.`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nibble.models.config_json import (  # noqa: F401  (re-exported: the names importers know from here)
    TEXT_MODEL_KEYS,
    ConfigError,
    _require,
    apply_hf_overrides,
    deep_merge,
    parse_hf_overrides,
    read_config_json,
)
from nibble.models.quant_config import QuantConfig
from nibble.models.rope_scaling import SCALED_ROPE_TYPES, RopeScaling  # noqa: F401

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of a Qwen3.5-MoE text model.

    Counts are `num_*`, lengths `*_len`, sizes `*_size`/`*_dim`. Derived values are properties.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    partial_rotary_factor: float
    rope_theta: float
    rms_norm_eps: float
    attn_output_gate: bool
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    torch_dtype: str
    mtp_num_hidden_layers: int
    is_multimodal: bool
    quant: QuantConfig | None = None
    # None: plain RoPE
    rope_scaling: RopeScaling | None = None
    source: str = field(default="", compare=False)

    @property
    def checkpoint_prefix(self) -> str:
        """Prefix of the language model's tensors in the checkpoint (`model.` or `model.language_model.`)."""
        return "model.language_model." if self.is_multimodal else "model."

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def num_full_attention_layers(self) -> int:
        return len(self.full_attention_layers)

    @property
    def num_linear_attention_layers(self) -> int:
        return len(self.linear_attention_layers)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def max_context_len(self) -> int:
        """The longest context (prompt + output, in tokens) the model's positions cover: max_position_embeddings,
        or what its RoPE scaling extends it to (YaRN: original_max_position_embeddings * factor, as vLLM)."""
        return self.max_position_embeddings if self.rope_scaling is None else self.rope_scaling.max_context_len

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_proj_size(self) -> int:
        """Output width of q_proj: query and output gate interleaved per head when gated."""
        return self.num_attention_heads * self.head_dim * (2 if self.attn_output_gate else 1)

    @property
    def kv_proj_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the GDN depthwise conv: q, k and v concatenated."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def quantized(self) -> bool:
        return self.quant is not None

    def kv_cache_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K and V one token occupies over all full-attention layers."""
        return 2 * self.num_full_attention_layers * self.num_key_value_heads * self.head_dim * element_size

    def gdn_state_bytes_per_seq(self, conv_element_size: int) -> int:
        """Bytes of conv + recurrent (fp32) state one sequence occupies over all GDN layers."""
        conv = self.linear_conv_dim * (self.linear_conv_kernel_dim - 1) * conv_element_size
        ssm = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * 4
        return self.num_linear_attention_layers * (conv + ssm)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json",
                  quant: QuantConfig | None = None) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else raw.get("model_type", "")
        multimodal = "text_config" in raw
        if multimodal and not isinstance(raw["text_config"], dict):
            raise ConfigError(f"{source}: text_config must be an object, got {raw['text_config']!r}")
        text = dict(raw["text_config"]) if multimodal else dict(raw)
        where = f"{source} (text_config)" if multimodal else source
        try:
            return cls._from_text(raw, text, arch, where, source, quant)
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            # a field of the wrong type (a string where a number belongs, often from --hf-overrides)
            raise ConfigError(f"{where}: {exc}") from None

    @classmethod
    def _from_text(cls, raw: dict[str, Any], text: dict[str, Any], arch: str, where: str, source: str,
                   quant: QuantConfig | None) -> ModelConfig:
        """from_dict's parse of the text model's settings `text` (raw: the whole config.json dict)."""

        def get(key: str, default: Any = ...) -> Any:
            if key in text:
                return text[key]
            if default is ...:
                raise ConfigError(f"{where}: missing field '{key}'")
            return default

        num_layers = int(get("num_hidden_layers"))
        interval = int(get("full_attention_interval", 4))
        layer_types = text.get("layer_types") or [
            FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)
        ]
        if len(layer_types) != num_layers:
            raise ConfigError(f"{where}: layer_types has {len(layer_types)} entries, "
                              f"num_hidden_layers is {num_layers}")
        bad = sorted({t for t in layer_types if t not in (FULL_ATTENTION, LINEAR_ATTENTION)})
        if bad:
            raise ConfigError(f"{where}: unsupported layer_types {bad}")
        for key in ("rope_parameters", "rope_scaling"):
            if not isinstance(text.get(key) or {}, dict):
                raise ConfigError(f"{where}: {key} must be an object, got {text[key]!r}")
        rope_key = "rope_parameters" if text.get("rope_parameters") else "rope_scaling"
        rope = dict(text.get(rope_key) or {})
        if rope_key == "rope_parameters" and text.get("rope_scaling"):
            # transformers v5 reads the legacy rope_scaling into rope_parameters; an override written the
            # Qwen3 docs' way (rope_scaling beside the checkpoint's rope_parameters) must not be lost
            rope.update(text["rope_scaling"])
            rope_key = "rope_parameters + rope_scaling"
        rope_theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
        rope_scaling = RopeScaling.from_rope_parameters(rope, text, f"{where}: {rope_key}")
        partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)))
        hidden = int(get("hidden_size"))
        num_heads = int(get("num_attention_heads"))
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        mlp_only = text.get("mlp_only_layers") or []
        if mlp_only:
            raise ConfigError(f"{where}: mlp_only_layers {mlp_only} (dense layers) are not supported")
        cfg = cls(
            architecture=str(arch),
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            layer_types=tuple(layer_types),
            num_attention_heads=num_heads,
            num_key_value_heads=int(get("num_key_value_heads", num_heads)),
            head_dim=int(get("head_dim", hidden // num_heads)),
            partial_rotary_factor=partial,
            rope_theta=rope_theta,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            attn_output_gate=bool(get("attn_output_gate", True)),
            linear_num_key_heads=int(get("linear_num_key_heads")),
            linear_num_value_heads=int(get("linear_num_value_heads")),
            linear_key_head_dim=int(get("linear_key_head_dim")),
            linear_value_head_dim=int(get("linear_value_head_dim")),
            linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", 4)),
            num_experts=int(get("num_experts")),
            num_experts_per_tok=int(get("num_experts_per_tok")),
            moe_intermediate_size=int(get("moe_intermediate_size")),
            shared_expert_intermediate_size=int(get("shared_expert_intermediate_size")),
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            max_position_embeddings=int(get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            eos_token_ids=eos_ids,
            bos_token_id=text.get("bos_token_id"),
            pad_token_id=text.get("pad_token_id"),
            torch_dtype=str(text.get("dtype") or text.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 0)),
            is_multimodal="text_config" in raw,
            quant=quant,
            rope_scaling=rope_scaling,
            source=source,
        )
        cfg._validate(where)
        return cfg

    def _validate(self, where: str) -> None:
        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{where}: {msg}")

        check(self.num_attention_heads % self.num_key_value_heads == 0,
              f"num_attention_heads {self.num_attention_heads} is not a multiple of "
              f"num_key_value_heads {self.num_key_value_heads}")
        check(self.linear_num_value_heads % self.linear_num_key_heads == 0,
              f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
              f"linear_num_key_heads {self.linear_num_key_heads}")
        check(self.rotary_dim % 2 == 0 and 0 < self.rotary_dim <= self.head_dim,
              f"partial_rotary_factor {self.partial_rotary_factor} gives rotary dim {self.rotary_dim}")
        check(0 < self.num_experts_per_tok <= self.num_experts,
              f"num_experts_per_tok {self.num_experts_per_tok} not in 1..num_experts {self.num_experts}")

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_overrides: dict[str, Any] | None = None) -> ModelConfig:
        """Read config.json, with `hf_overrides` (vLLM's --hf-overrides) deep-merged into it, and, if present,
        hf_quant_config.json of a checkpoint directory."""
        model_dir = Path(model_dir)
        raw = read_config_json(model_dir, hf_overrides)
        quant = QuantConfig.from_model_dir(model_dir, raw)
        source = str(model_dir / "config.json") + (" with --hf-overrides" if hf_overrides else "")
        return cls.from_dict(raw, source=source, quant=quant)
