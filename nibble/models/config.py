"""Typed, frozen view of a Hugging Face Qwen3.5-MoE config.json.

Both layouts are accepted: the multimodal `Qwen3_5MoeForConditionalGeneration` file, whose language model
settings sit under `text_config` and whose tensors are prefixed `model.language_model.`, and the text-only
`Qwen3_5MoeForCausalLM` file with everything at the top level and tensors under `model.`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nibble.models.quant_config import QuantConfig

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


class ConfigError(ValueError):
    """A config.json that nibble cannot serve; the message names the file and the field."""


def _require(d: dict[str, Any], key: str, path: str) -> Any:
    if key not in d:
        raise ConfigError(f"{path}: missing field '{key}'")
    return d[key]


# text-model settings that an override must put under text_config on the multimodal config.json layout
TEXT_MODEL_KEYS = frozenset({"rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings"})


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of `base` with `overrides` applied: objects present in both are merged key by key, recursively;
    any other value of `overrides` replaces `base`'s. Neither argument is modified."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_hf_overrides(raw: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """config.json's dict with vLLM's `--hf-overrides` deep-merged into it.

    The overrides usually target the published multimodal layout (`{"text_config": {"rope_parameters": ...}}`);
    on a text-only config.json, whose text settings sit at the top level, a `text_config` object is merged
    there instead, so the same command line serves both layouts.
    """
    if not overrides:
        return raw
    misplaced = sorted(k for k in overrides if k in TEXT_MODEL_KEYS) if "text_config" in raw else []
    if misplaced:
        # on the multimodal layout these top-level keys would be merged where nothing reads them
        raise ConfigError(f"--hf-overrides: put {', '.join(misplaced)} under \"text_config\": on this checkpoint "
                          f"they are settings of the text model")
    if "text_config" not in raw and isinstance(overrides.get("text_config"), dict):
        rest = {k: v for k, v in overrides.items() if k != "text_config"}
        return deep_merge(deep_merge(raw, overrides["text_config"]), rest)
    return deep_merge(raw, overrides)


def parse_hf_overrides(text: str) -> dict[str, Any]:
    """vLLM's `--hf-overrides` JSON text as a dict; ValueError naming the flag unless it is a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--hf-overrides is not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--hf-overrides takes a JSON object of config.json fields, e.g. "
                         f"'{{\"text_config\": {{\"rope_parameters\": {{...}}}}}}', got {text!r}")
    return value


def read_config_json(model_dir: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json of a checkpoint directory as a dict, `overrides` (--hf-overrides) applied."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir}: no config.json (is this a Hugging Face model directory?)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return apply_hf_overrides(raw, overrides)


# the rope_type values that describe plain RoPE (mrope: the 3-D positions, which leave the frequencies as they are)
_UNSCALED_ROPE_TYPES = ("default", "mrope")
SCALED_ROPE_TYPES = ("yarn", "linear")


def _number(rope: dict[str, Any], key: str, where: str, *, minimum: float | None = None,
            default: float | None = None) -> float | None:
    """rope[key] as a float (`default` when absent or null); ConfigError naming the field (`where`.key)
    otherwise."""
    value = rope.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}.{key} must be a number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{where}.{key} must be >= {minimum:g}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling for contexts longer than pretraining's (config.json `rope_parameters`), the way
    transformers' `_compute_yarn_parameters` / `_compute_linear_scaling_rope_parameters` compute it.

    "yarn" (https://arxiv.org/abs/2309.00071): frequencies whose wavelength is short next to
    `original_max_position_embeddings` are kept, long ones divided by `factor`, a linear ramp between the
    dimensions that make `beta_fast` and `beta_slow` rotations over it; cos and sin are multiplied by
    `attention_scaling`. "linear": every frequency divided by `factor`. The tensors are built by
    nibble.kernels.rope.rope_inv_freq.
    """

    rope_type: str
    factor: float
    # the pretraining context length (linear: max_position_embeddings)
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # None: derived from factor (and mscale / mscale_all_dim when both are set), see attention_scaling
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @property
    def attention_scaling(self) -> float:
        """The factor cos and sin are multiplied by (YaRN's attention temperature; 1 for linear)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        # transformers tests truthiness: a zero mscale falls back to the factor-only formula too
        if self.mscale and self.mscale_all_dim:
            return float(get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim))
        return get_mscale(self.factor)

    @property
    def max_context_len(self) -> int:
        """The longest context the scaled frequencies are meant for, as vLLM derives it: the unscaled length
        times factor."""
        return int(self.original_max_position_embeddings * self.factor)

    def correction_range(self, rotary_dim: int, theta: float) -> tuple[float, float]:
        """YaRN's (low, high) frequency indices: below low the frequencies are kept, above high divided by
        factor, linearly mixed between."""
        def correction_dim(num_rotations: float) -> float:
            return (rotary_dim * math.log(self.original_max_position_embeddings / (num_rotations * 2 * math.pi))
                    / (2 * math.log(theta)))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, rotary_dim - 1)

    @classmethod
    def from_rope_parameters(cls, rope: dict[str, Any], text: dict[str, Any], where: str) -> RopeScaling | None:
        """The scaling `rope` (a text config's rope_parameters, or legacy rope_scaling) asks for; None for plain
        RoPE. `text` is the text config, for max_position_embeddings and a top-level
        original_max_position_embeddings (which transformers prefers to rope's). `where` names `rope` in
        errors (e.g. "config.json (text_config): rope_parameters"); ConfigError naming a bad field."""
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type in _UNSCALED_ROPE_TYPES:
            return None
        if rope_type not in SCALED_ROPE_TYPES:
            raise ConfigError(f"{where}: rope_type '{rope_type}' is not supported (nibble serves "
                              f"{', '.join(_UNSCALED_ROPE_TYPES + SCALED_ROPE_TYPES)})")
        if "factor" not in rope:
            raise ConfigError(f"{where}: missing field 'factor' (required with rope_type '{rope_type}')")
        max_pos = int(text.get("max_position_embeddings", 32768))
        if rope_type == "linear":
            factor = _number(rope, "factor", where, minimum=1.0)
            if factor is None:
                raise ConfigError(f"{where}.factor must be a number >= 1, got null")
            return cls("linear", factor, max_pos)
        original = text.get("original_max_position_embeddings",
                            rope.get("original_max_position_embeddings", max_pos))
        if isinstance(original, float) and original.is_integer():
            original = int(original)
        if isinstance(original, bool) or not isinstance(original, int) or original < 1:
            raise ConfigError(f"{where}.original_max_position_embeddings must be a positive integer, "
                              f"got {original!r}")
        # a null factor is the ratio of the two lengths (DeepSeek-V3's convention, as transformers has it)
        factor = _number(rope, "factor", where, minimum=1.0, default=max_pos / original)
        truncate = rope.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ConfigError(f"{where}.truncate must be true or false, got {truncate!r}")
        # transformers reads `get(...) or default`: 0 and null both mean the default
        beta_fast = _number(rope, "beta_fast", where) or 32.0
        beta_slow = _number(rope, "beta_slow", where) or 1.0
        if beta_fast < beta_slow:
            raise ConfigError(f"{where}.beta_fast {beta_fast:g} must be >= beta_slow {beta_slow:g}")
        attention_factor = _number(rope, "attention_factor", where)
        if attention_factor is not None and attention_factor <= 0:
            raise ConfigError(f"{where}.attention_factor must be > 0, got {attention_factor:g}")
        assert factor is not None
        return cls("yarn", factor, original, beta_fast=beta_fast, beta_slow=beta_slow,
                   attention_factor=attention_factor,
                   mscale=_number(rope, "mscale", where), mscale_all_dim=_number(rope, "mscale_all_dim", where),
                   truncate=truncate)


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
