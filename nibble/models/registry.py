"""Architecture name -> model class. One entry per architecture nibble serves."""

from __future__ import annotations

from torch import nn

from nibble.models.config import ConfigError, ModelConfig


def _qwen3_5_moe() -> type[nn.Module]:
    from nibble.models.qwen3_5_moe import Qwen3_5MoeForCausalLM

    return Qwen3_5MoeForCausalLM


ARCHITECTURES = {
    "Qwen3_5MoeForConditionalGeneration": _qwen3_5_moe,
    "Qwen3_5MoeForCausalLM": _qwen3_5_moe,
    "qwen3_5_moe": _qwen3_5_moe,
    "qwen3_5_moe_text": _qwen3_5_moe,
}


def get_model_class(config: ModelConfig) -> type[nn.Module]:
    factory = ARCHITECTURES.get(config.architecture)
    if factory is None:
        known = ", ".join(sorted(k for k in ARCHITECTURES if k[0].isupper()))
        raise ConfigError(f"{config.source}: architecture '{config.architecture}' is not supported (known: {known})")
    return factory()
