"""Sampling defaults a model ships in generation_config.json.

Servers apply these when a request leaves a parameter unset (vLLM's `--generation-config auto` behaviour):
Qwen3.5, for instance, asks for temperature 0.6, top_p 0.95, top_k 20. As in vLLM, `--generation-config vllm`
ignores them, `--generation-config DIR` reads DIR/generation_config.json instead, and
`--override-generation-config '{"temperature": 0.7}'` replaces single fields (`load_generation_defaults`).
The end-of-sequence ids always come from the model directory: they belong to the checkpoint, not to a
sampling preference.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any


class GenerationConfigError(ValueError):
    """generation_config.json exists but is malformed; the message names the file and the field."""


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_INT_FIELDS = ("top_k", "max_new_tokens")
# what --override-generation-config may set
OVERRIDE_FIELDS = (*_FLOAT_FIELDS, *_INT_FIELDS, "do_sample")
GENERATION_CONFIG_SOURCES = ("auto", "vllm")


@dataclass(frozen=True)
class GenerationDefaults:
    """Per-model defaults; every field is None when the file does not set it."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_new_tokens: int | None = None
    do_sample: bool | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> GenerationDefaults:
        """Read `model_dir/generation_config.json`; a missing file gives all-None defaults."""
        path = Path(model_dir) / "generation_config.json"
        if not path.is_file():
            return cls()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise GenerationConfigError(f"{path}: cannot read JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise GenerationConfigError(f"{path}: expected a JSON object")
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "generation_config") -> GenerationDefaults:
        """Build from the parsed JSON object; unknown keys are ignored, wrong types raise."""
        values: dict[str, Any] = {}
        for name in _FLOAT_FIELDS:
            value = data.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise GenerationConfigError(f"{source}: '{name}' must be a number, got {value!r}")
            values[name] = float(value)
        for name in _INT_FIELDS:
            value = data.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise GenerationConfigError(f"{source}: '{name}' must be an integer, got {value!r}")
            values[name] = value
        do_sample = data.get("do_sample")
        if do_sample is not None:
            if not isinstance(do_sample, bool):
                raise GenerationConfigError(f"{source}: 'do_sample' must be true or false, got {do_sample!r}")
            values["do_sample"] = do_sample
        eos = data.get("eos_token_id")
        if eos is not None:
            eos_list = eos if isinstance(eos, list) else [eos]
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos_list):
                raise GenerationConfigError(f"{source}: 'eos_token_id' must be an id or a list of ids, got {eos!r}")
            values["eos_token_ids"] = tuple(dict.fromkeys(eos_list))
        return cls(**values)

    def sampling_overrides(self) -> dict[str, Any]:
        """The sampling fields the file sets, by name (eos ids and do_sample excluded), for request defaults.

        `do_sample: false` means greedy decoding in transformers; it is reported as temperature 0 so a
        server that fills unset request fields from this dict behaves the same way.
        """
        out = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("eos_token_ids", "do_sample") and getattr(self, f.name) is not None
        }
        if self.do_sample is False:
            out["temperature"] = 0.0
        return out

    def sampling_params_kwargs(self) -> dict[str, Any]:
        """`sampling_overrides` under SamplingParams' names (max_new_tokens is max_tokens)."""
        out = self.sampling_overrides()
        if "max_new_tokens" in out:
            out["max_tokens"] = out.pop("max_new_tokens")
        return out


def load_generation_defaults(model_dir: str | Path, source: str = "auto",
                             override: dict[str, Any] | None = None) -> GenerationDefaults:
    """The sampling defaults an engine applies: `source` "auto" (the model's generation_config.json), "vllm"
    (none) or a directory holding a generation_config.json, then the fields of `override` on top (null
    clears a field). Raises GenerationConfigError naming the flag, file or field."""
    model = GenerationDefaults.from_pretrained(model_dir)
    if source == "auto":
        defaults = model
    elif source == "vllm":
        defaults = GenerationDefaults(eos_token_ids=model.eos_token_ids)
    else:
        folder = Path(source)
        if not (folder / "generation_config.json").is_file():
            raise GenerationConfigError(f"--generation-config: expected auto, vllm or a directory holding a "
                                        f"generation_config.json; {folder} has none")
        defaults = replace(GenerationDefaults.from_pretrained(folder), eos_token_ids=model.eos_token_ids)
    if override:
        unknown = sorted(set(override) - set(OVERRIDE_FIELDS))
        if unknown:
            raise GenerationConfigError(f"--override-generation-config: unknown field(s) {', '.join(unknown)}; "
                                        f"known: {', '.join(OVERRIDE_FIELDS)}")
        parsed = GenerationDefaults.from_dict(override, source="--override-generation-config")
        defaults = replace(defaults, **{name: getattr(parsed, name) for name in override})
    return defaults
