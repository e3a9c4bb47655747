"""Reading a checkpoint's config.json, with vLLM's `--hf-overrides` deep-merged into it, and the error every
config problem is reported as (ConfigError: the message names the file and the field)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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
