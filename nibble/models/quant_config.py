"""The checkpoint's quantization settings: ModelOpt NVFP4 (hf_quant_config.json or config.json's
`quantization_config`), and which modules stay unquantized (exclude globs)."""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NVFP4_GROUP_SIZE = 16
# vLLM's --quantization names for ModelOpt NVFP4 checkpoints, the one method nibble serves (vLLM calls it
# modelopt_fp4; "modelopt" is the quant_method such checkpoints write; "nvfp4" is its plain name)
QUANTIZATION_METHODS = ("modelopt_fp4", "modelopt", "nvfp4")


class QuantConfigError(ValueError):
    pass


def normalize_module_name(name: str) -> str:
    """Map checkpoint module names of both layouts to the text model's (`model.layers.N...`)."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


@dataclass(frozen=True)
class QuantConfig:
    """ModelOpt NVFP4 quantization of a checkpoint.

    `exclude_modules` holds the globs as written in the checkpoint; matching is done on normalized names so
    the multimodal (`model.language_model.`) and text-only (`model.`) layouts behave the same.
    """

    quant_algo: str
    group_size: int
    exclude_modules: tuple[str, ...]
    kv_cache_quant_algo: str | None = None

    def is_quantized(self, module_name: str) -> bool:
        """Whether the linear/experts module `module_name` (e.g. `model.layers.3.mlp.experts`) is NVFP4."""
        name = normalize_module_name(module_name)
        for pat in self.exclude_modules:
            p = normalize_module_name(pat)
            if fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name + ".weight", p):
                return False
        return True

    def to_hf_quant_config(self, producer: dict[str, str] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "producer": producer or {"name": "nibble", "version": "0.1.0"},
            "quantization": {
                "quant_algo": self.quant_algo,
                "kv_cache_quant_algo": self.kv_cache_quant_algo,
                "group_size": self.group_size,
                "exclude_modules": list(self.exclude_modules),
            },
        }
        return out

    def to_quantization_config(self) -> dict[str, Any]:
        """The `quantization_config` block of config.json in the form vLLM/SGLang read for ModelOpt."""
        group = {
            "input_activations": {"dynamic": False, "num_bits": 4, "type": "float",
                                  "group_size": self.group_size},
            "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": self.group_size},
            "targets": ["Linear"],
        }
        out: dict[str, Any] = {
            "config_groups": {"group_0": group},
            "ignore": list(self.exclude_modules),
            "quant_algo": self.quant_algo,
            "quant_method": "modelopt",
        }
        if self.kv_cache_quant_algo:
            out["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
        return out

    @classmethod
    def from_model_dir(cls, model_dir: Path, config_json: dict[str, Any]) -> QuantConfig | None:
        path = model_dir / "hf_quant_config.json"
        if path.is_file():
            try:
                raw = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise QuantConfigError(f"{path}: invalid JSON: {e}") from e
            q = raw.get("quantization", raw)
            return cls._from_fields(q.get("quant_algo"), q.get("group_size", NVFP4_GROUP_SIZE),
                                    q.get("exclude_modules") or [], q.get("kv_cache_quant_algo"), str(path))
        qc = config_json.get("quantization_config")
        if qc is None:
            return None
        where = f"{model_dir / 'config.json'} (quantization_config)"
        method = qc.get("quant_method")
        if method not in ("modelopt", None):
            raise QuantConfigError(f"{where}: quant_method '{method}' is not supported (only ModelOpt NVFP4)")
        group_size = NVFP4_GROUP_SIZE
        for g in (qc.get("config_groups") or {}).values():
            group_size = int(g.get("weights", {}).get("group_size", group_size))
        kv = "FP8" if qc.get("kv_cache_scheme") else None
        return cls._from_fields(qc.get("quant_algo"), group_size, qc.get("ignore") or [], kv, where)

    @classmethod
    def _from_fields(cls, algo: Any, group_size: Any, exclude: list[str], kv: Any, where: str) -> QuantConfig:
        if algo != "NVFP4":
            raise QuantConfigError(f"{where}: quant_algo '{algo}' is not supported (only NVFP4)")
        if int(group_size) != NVFP4_GROUP_SIZE:
            raise QuantConfigError(f"{where}: group_size {group_size} is not supported (NVFP4 uses 16)")
        return cls(quant_algo="NVFP4", group_size=NVFP4_GROUP_SIZE, exclude_modules=tuple(exclude),
                   kv_cache_quant_algo=kv)


def check_quantization(method: str | None, quant: QuantConfig | None, model_dir: Path) -> None:
    """Check `--quantization METHOD` against what the checkpoint at `model_dir` holds (`quant`: its parsed
    quantization config, None when unquantized); None (unset) takes the checkpoint's. A command line written for
    another checkpoint (an FP8, AWQ or GPTQ one, or an NVFP4 flag on BF16 weights) fails here, naming both."""
    if method is None:
        return
    holds = (f"ModelOpt {quant.quant_algo} weights" if quant is not None
             else "unquantized weights (no hf_quant_config.json, no quantization_config in config.json)")
    if method not in QUANTIZATION_METHODS:
        raise QuantConfigError(f"--quantization {method}: nibble serves ModelOpt NVFP4 checkpoints only "
                               f"({' / '.join(QUANTIZATION_METHODS)}); {model_dir} holds {holds}")
    if quant is None:
        raise QuantConfigError(f"--quantization {method}: {model_dir} holds {holds}; leave --quantization out to "
                               f"serve them as they are, or make an NVFP4 checkpoint with `nibble quantize`")
