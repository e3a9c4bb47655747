"""Check a checkpoint directory without loading it: config, quantization settings, tokenizer, the index and
its shards, every tensor's name, shape and dtype against the model the config describes, and the values of
the NVFP4 scales.

The model is built on the `meta` device (no memory for weights) and every checkpoint tensor is offered to
its `load_weights` as a meta tensor of the header's shape and dtype, so the checker applies exactly the
loader's rules; only scalar scales are read for that. Block scales (e4m3, one byte per 16 weights) are read
afterwards and checked for NaN and negative values; `deep=True` also reads every weight (finite floats, no
non-zero FP4 block under a zero scale). Problems become `Finding`s instead of exceptions, so one run reports
all of them.

The report itself (`Finding`, `CheckpointReport`, `render_report`) is in validate_report.py and the reading of
the index and the shard headers in validate_shards.py; the report's names are re-exported here.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from nibble.checkpoint.loader import SKIPPED_PREFIXES
from nibble.checkpoint.safetensors_io import _DTYPES as SAFETENSORS_DTYPES
from nibble.checkpoint.validate_report import (  # noqa: F401  (re-exported: the names importers know from here)
    ERROR,
    INFO,
    WARNING,
    CheckpointReport,
    Finding,
    render_report,
)
from nibble.checkpoint.validate_shards import _Shards, _Tensor
from nibble.kernels.kernel_set import KernelSet
from nibble.layers.linear import WeightLoadError
from nibble.models.config import ModelConfig
from nibble.models.quant_config import normalize_module_name
from nibble.models.registry import get_model_class

logger = logging.getLogger("nibble.checkpoint")

SCALAR_KINDS = ("weight_scale_2", "input_scale", "k_scale", "v_scale")
# A progress log line every this many tensors (a 397B checkpoint has about 370k).
PROGRESS_EVERY = 50_000
# Deep checks read big tensors in slices of about this many elements.
DEEP_CHUNK_ELEMENTS = 1 << 26


def validate_checkpoint(model_dir: str | Path, *, deep: bool = False, sample_scales: bool = False
                        ) -> CheckpointReport:
    """Check `model_dir`; see the module docstring. sample_scales: read the block scales of one expert per
    layer (plus every non-expert NVFP4 linear) instead of all of them."""
    t0 = time.perf_counter()
    model_dir = Path(model_dir)
    report = CheckpointReport(str(model_dir))
    report.facts["deep"] = deep
    report.facts["sampled"] = sample_scales
    if not model_dir.is_dir():
        report.add(ERROR, "not_a_directory", f"{model_dir}: not a directory")
        return report
    config = _check_config(model_dir, report)
    if config is not None:
        _check_tokenizer(model_dir, config, report)
    shards = _Shards.open(model_dir, report)
    if shards is not None:
        if config is not None:
            _check_tensors(config, shards, report)
        _check_scale_values(shards, report, sample_scales)
        if deep:
            _check_weights_deep(shards, report)
    report.facts["seconds"] = round(time.perf_counter() - t0, 3)
    return report


def _check_config(model_dir: Path, report: CheckpointReport) -> ModelConfig | None:
    try:
        config = ModelConfig.from_pretrained(model_dir)
        get_model_class(config)
    except (ValueError, OSError) as e:
        report.add(ERROR, "config", str(e), file="config.json")
        return None
    report.facts["architecture"] = config.architecture
    report.facts["layout"] = "multimodal" if config.is_multimodal else "text-only"
    scaling = config.rope_scaling
    report.facts["context"] = (f"{config.max_context_len} tokens"
                               + (f" ({scaling.rope_type} RoPE scaling: {scaling.original_max_position_embeddings}"
                                  f" x {scaling.factor:g})" if scaling is not None else
                                  " (max_position_embeddings; YaRN can extend it: --hf-overrides)"))
    q = config.quant
    report.facts["quantization"] = (f"{q.quant_algo} ({len(q.exclude_modules)} exclude globs, KV cache "
                                    f"{q.kv_cache_quant_algo or 'model dtype'})" if q else "not quantized")
    hf_quant = model_dir / "hf_quant_config.json"
    raw = json.loads((model_dir / "config.json").read_text())
    in_config = raw.get("quantization_config")
    if q is not None and hf_quant.is_file() and isinstance(in_config, dict):
        ignore = set(in_config.get("ignore") or [])
        if in_config.get("quant_algo") not in (None, q.quant_algo) or (ignore and ignore != set(q.exclude_modules)):
            report.add(WARNING, "quant_config_mismatch", "config.json's quantization_config and "
                       "hf_quant_config.json disagree (quant_algo or the exclude list); nibble follows "
                       "hf_quant_config.json, other engines may read config.json", file="hf_quant_config.json")
    return config


def _check_tokenizer(model_dir: Path, config: ModelConfig, report: CheckpointReport) -> None:
    from nibble.engine.generation_config import GenerationDefaults
    from nibble.engine.tokenizer import Tokenizer

    try:
        GenerationDefaults.from_pretrained(model_dir)
    except ValueError as e:
        report.add(ERROR, "generation_config", str(e), file="generation_config.json")
    if not (model_dir / "tokenizer.json").is_file():
        report.add(WARNING, "no_tokenizer", "no tokenizer.json: clients must send token ids (or pass --tokenizer)")
        return
    try:
        tok = Tokenizer.from_pretrained(model_dir)
    except Exception as e:  # any tokenizer failure is reported, not raised
        report.add(ERROR, "tokenizer", f"tokenizer does not load: {type(e).__name__}: {e}", file="tokenizer.json")
        return
    report.facts["tokenizer_vocab"] = tok.vocab_size
    if tok.vocab_size > config.vocab_size:
        report.add(ERROR, "tokenizer_vocab", f"the tokenizer has {tok.vocab_size} tokens but the model's "
                   f"vocab_size is {config.vocab_size}: prompts could contain ids the model cannot embed",
                   file="tokenizer.json")
    if not tok.has_chat_template:
        report.add(WARNING, "no_chat_template", "no chat template: /v1/chat/completions will refuse requests")


def _kind(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _check_tensors(config: ModelConfig, shards: _Shards, report: CheckpointReport) -> None:
    """Offer every tensor to a meta-device model's loader; then list what the model still lacks."""
    cls = get_model_class(config)
    with torch.device("meta"):
        model = cls(config, KernelSet.reference(), dtype=torch.bfloat16, device="meta")
    loaded: set[str] = set()
    rejected: set[str] = set()
    skipped = headers = scalars = 0
    for i, (name, info) in enumerate(shards.tensors.items()):
        if i and i % PROGRESS_EVERY == 0:
            logger.info("checked the headers of %d of %d tensors", i, len(shards.tensors))
        if any(name.startswith(p) for p in SKIPPED_PREFIXES):
            skipped += 1
            continue
        headers += 1
        norm = normalize_module_name(name)
        dtype = SAFETENSORS_DTYPES.get(info.dtype_code)
        file = info.shard.name
        if dtype is None:
            report.add(ERROR, "unsupported_dtype", f"{file}: tensor '{name}' has dtype {info.dtype_code}, which "
                       "nibble cannot load", file=file, tensor=name)
            continue
        tensor: torch.Tensor | None = torch.empty(info.shape, dtype=dtype, device="meta")
        if _kind(norm) in SCALAR_KINDS and info.numel <= 16:
            tensor = shards.read(name, report)
            scalars += 1
            if tensor is None:
                continue
            if not _check_scalar(norm, tensor, file, name, report):
                rejected.add(norm)
                continue
        if norm in loaded:
            report.add(WARNING, "duplicate_tensor", f"{file}: '{name}' maps to '{norm}', which another tensor "
                       "already provided (the last one read wins)", file=file, tensor=name)
        stored_as = f" (stored as '{name}')" if norm != name else ""
        try:
            model.load_weights([(norm, tensor)])
        except WeightLoadError as e:
            report.add(ERROR, "bad_tensor", f"{file}: {e}{stored_as}", file=file, tensor=name)
            rejected.add(norm)
            continue
        except Exception as e:  # a tensor the loader's own checks let through but cannot copy
            report.add(ERROR, "bad_tensor", f"{file}: tensor '{name}' {list(info.shape)} {info.dtype_code}: "
                       f"{type(e).__name__}: {e}", file=file, tensor=name)
            rejected.add(norm)
            continue
        loaded.add(norm)
    _report_missing(config, model, loaded, rejected, shards.unavailable, report)
    kv_fp8 = config.quant is not None and config.quant.kv_cache_quant_algo
    if kv_fp8 and not any(_kind(n) in ("k_scale", "v_scale") for n in loaded):
        report.add(WARNING, "no_kv_scales", "the quantization config names an FP8 KV cache but the checkpoint "
                   "has no k_scale/v_scale: --kv-cache-dtype fp8 would use scale 1.0")
    report.facts.update(skipped=skipped, headers_checked=headers, scalars_read=scalars)


def _report_missing(config: ModelConfig, model: Any, loaded: set[str], rejected: set[str],
                    unavailable: set[str] | None, report: CheckpointReport) -> None:
    """Tensors the model needs and nothing provided; those of failed shards or rejected tensors are already
    reported."""
    if unavailable is None:
        report.add(INFO, "incomplete", "a shard could not be read and there is no index: the list of missing "
                   "tensors is not checked")
        return
    missing = [n for n in model.expected_tensor_names() if n not in loaded]
    for layer in model.layers:
        missing += [f"model.layers.{layer.layer_id}.mlp.{n}" for n in layer.mlp.experts.missing()]
    covered = rejected | {normalize_module_name(n) for n in unavailable}
    prefix = config.checkpoint_prefix
    for name in missing:
        if name in covered:
            continue
        stored = prefix + name[len("model."):] if name.startswith("model.") else name
        report.add(ERROR, "missing_tensor", f"the model needs '{stored}', which the checkpoint lacks", tensor=stored)


def _check_scalar(norm: str, tensor: torch.Tensor, file: str, name: str, report: CheckpointReport) -> bool:
    """weight_scale_2 must be finite and >= 0 (0 for an all-zero weight), k/v scales finite and > 0;
    input_scale too, but nibble does not use it. Returns False after reporting an error."""
    values = tensor.float().reshape(-1)
    kind = _kind(norm)
    low_ok = (values >= 0) if kind == "weight_scale_2" else (values > 0)
    if values.numel() == 0 or bool(torch.isfinite(values).all() and low_ok.all()):
        return True
    severity = WARNING if kind == "input_scale" else ERROR
    why = " (unused by nibble's W4A16 kernels)" if severity == WARNING else ""
    bound = ">= 0" if kind == "weight_scale_2" else "> 0"
    report.add(severity, "bad_scale", f"{file}: '{name}' is {values.tolist()[:4]}; a scale must be finite and "
               f"{bound}" + why, file=file, tensor=name)
    return severity != ERROR


def _sampled_out(name: str) -> bool:
    """With sampling, skip the block scales of every routed expert but expert 0."""
    parts = name.split(".")
    if "experts" not in parts:
        return False
    i = parts.index("experts")
    return i + 1 < len(parts) and parts[i + 1].isdigit() and parts[i + 1] != "0"


def _check_scale_values(shards: _Shards, report: CheckpointReport, sample: bool) -> None:
    """Block scales (e4m3): no NaN encodings, no negative values; an all-zero tensor is suspicious."""
    read = 0
    for name, info in shards.tensors.items():
        if _kind(name) != "weight_scale" or info.dtype_code != "F8_E4M3" or (sample and _sampled_out(name)):
            continue
        tensor = shards.read(name, report)
        read += 1
        if read % PROGRESS_EVERY == 0:
            logger.info("read %d block-scale tensors", read)
        if tensor is None:
            continue
        b = tensor.view(torch.uint8)
        mag = b & 0x7F
        nan = int((mag == 0x7F).sum())
        negative = int(((b & 0x80) != 0).logical_and(mag != 0).logical_and(mag != 0x7F).sum())
        file = info.shard.name
        if nan or negative:
            report.add(ERROR, "bad_block_scale", f"{file}: '{name}' has {nan} NaN and {negative} negative block "
                       f"scales (of {b.numel()}); these blocks would dequantize to garbage", file=file, tensor=name)
        elif b.numel() and not bool(mag.any()):
            report.add(WARNING, "zero_block_scales", f"{file}: every block scale of '{name}' is 0: the weight "
                       "dequantizes to all zeros", file=file, tensor=name)
    report.facts["block_scales_read"] = read


def _check_weights_deep(shards: _Shards, report: CheckpointReport) -> None:
    """Read every weight: floats must be finite; an FP4 block with non-zero codes needs a non-zero scale."""
    read = 0
    for name, info in shards.tensors.items():
        dtype = SAFETENSORS_DTYPES.get(info.dtype_code)
        if dtype is None or not info.shape:
            continue
        file = info.shard.name
        if dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            read += 1
            bad = _count_non_finite(shards, name, info, report)
            if bad:
                report.add(ERROR, "non_finite_weight", f"{file}: '{name}' holds {bad} NaN/Inf values",
                           file=file, tensor=name)
        elif dtype == torch.uint8 and _kind(name) == "weight":
            scale_name = name[: -len("weight")] + "weight_scale"
            scale_info = shards.tensors.get(scale_name)
            if scale_info is None or scale_info.shape != (*info.shape[:-1], info.shape[-1] // 8):
                continue
            read += 1
            packed, scale = shards.read(name, report), shards.read(scale_name, report)
            if packed is None or scale is None:
                continue
            # 16 FP4 values = 8 bytes per block; 0x77 masks the two magnitudes of a byte (sign bits aside)
            used = ((packed & 0x77) != 0).reshape(*scale.shape, 8).any(dim=-1)
            lost = int(used.logical_and((scale.view(torch.uint8) & 0x7F) == 0).sum())
            if lost:
                report.add(WARNING, "zero_scale_nonzero_block", f"{file}: '{name}' has {lost} blocks with non-zero "
                           "FP4 codes under a zero block scale (they dequantize to 0)", file=file, tensor=name)
    report.facts["deep_tensors_read"] = read


def _count_non_finite(shards: _Shards, name: str, info: _Tensor, report: CheckpointReport) -> int:
    row = max(1, info.numel // max(1, info.shape[0]))
    step = max(1, DEEP_CHUNK_ELEMENTS // row)
    handle = shards.handles[info.shard]
    bad = 0
    try:
        sl = handle.get_slice(name)
        for start in range(0, info.shape[0], step):
            chunk = sl[start:start + step]
            bad += int((~torch.isfinite(chunk)).sum())
    except Exception as e:  # a damaged data section
        report.add(ERROR, "unreadable_tensor", f"{info.shard.name}: cannot read '{name}': {e}",
                   file=info.shard.name, tensor=name)
    return bad
