"""RoPE frequency scaling of long-context configs (YaRN, linear): `RopeScaling`, parsed from config.json's
`rope_parameters` as transformers parses it; nibble/kernels/rope.py builds the cos/sin table from it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from nibble.models.config_json import ConfigError

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
