"""Build a model and fill it from a Hugging Face checkpoint directory (or with dummy weights).

Tensors are streamed one at a time from the safetensors shards straight into the model's parameters, so
the process never holds a second copy of the model. They are handed to the model lazily (`ShardTensor`:
header shape and dtype, blocks read on demand through safetensors' `get_slice`), so that a tensor-parallel
rank reads only its part of each tensor and skips other ranks' experts entirely. MTP head tensors, unless
the model is built with its MTP head (speculative decoding), are skipped with one log line; every other
tensor must map onto a parameter, and every parameter must be filled.

The vision tower (`model.visual.*`) is loaded into `model.visual` (nibble/models/qwen3_5_vision.py, in the
model dtype) when config.json has a `vision_config` and the checkpoint the tower's tensors, whole, on rank 0
only under tensor parallelism (the step channel sends its rows to the other ranks); otherwise `model.visual`
is None and the tensors are skipped.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nibble.checkpoint.demo import DEMO_DIR
from nibble.checkpoint.dummy import init_dummy_weights
from nibble.checkpoint.safetensors_io import CheckpointError, list_shards, open_shard
from nibble.kernels.kernel_set import KernelSet
from nibble.layers.linear import WeightLoadError
from nibble.layers.parallel import ParallelContext
from nibble.models.config import ConfigError, ModelConfig
from nibble.models.quant_config import normalize_module_name
from nibble.models.qwen3_5_vision import Qwen3_5VisionModel, VisionConfig
from nibble.models.registry import get_model_class

logger = logging.getLogger("nibble.checkpoint")

VISION_PREFIXES = {"model.visual.": "vision tower", "visual.": "vision tower"}
# Multimodal checkpoints keep the MTP head at the top level (`mtp.`); `model.mtp.` is read the same way.
MTP_PREFIXES = {"mtp.": "MTP head", "model.mtp.": "MTP head"}
SKIPPED_PREFIXES = {**VISION_PREFIXES, **MTP_PREFIXES}


_SAFETENSORS_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class ShardTensor:
    """One tensor of a memory-mapped safetensors shard, not read yet (nibble.layers.parallel.LazyTensor).

    `shape` and `dtype` come from the header; `t[index]` (a tuple of step-1 slices) reads that block only;
    `load()` reads the whole tensor.
    """

    def __init__(self, handle: Any, name: str, path: Path) -> None:
        self._handle = handle
        self._slice = handle.get_slice(name)
        self.name = name
        self.path = path
        self.shape = tuple(int(d) for d in self._slice.get_shape())
        code = self._slice.get_dtype()
        if code not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor '{name}' has dtype {code}, which nibble does not read")
        self.dtype = _SAFETENSORS_DTYPES[code]

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        try:
            return self._slice[index]
        except Exception as e:
            raise CheckpointError(f"{self.path}: cannot read tensor '{self.name}'{list(index)}: {e}") from e

    def load(self) -> torch.Tensor:
        try:
            return self._handle.get_tensor(self.name)
        except Exception as e:
            raise CheckpointError(f"{self.path}: cannot read tensor '{self.name}': {e}") from e


def normalize_tensor_name(name: str) -> str:
    """A checkpoint tensor name in the form the model's `load_weights` takes: `model.layers.N...` for the
    language model of either layout, `mtp.*` for the MTP head."""
    if name.startswith("model.mtp."):
        return name[len("model."):]
    return normalize_module_name(name)


def iter_model_tensors(model_dir: str | Path, config: ModelConfig, *,
                       with_mtp: bool = False) -> Iterator[tuple[str, ShardTensor, str]]:
    """Yield (normalised name, lazily read tensor, file name) for the language model's tensors, and the
    MTP head's when `with_mtp`, in storage order."""
    skip = VISION_PREFIXES if with_mtp else SKIPPED_PREFIXES
    skipped: dict[str, int] = {}
    for path in list_shards(model_dir):
        handle = open_shard(path)
        for name in handle.keys():
            what = next((w for p, w in skip.items() if name.startswith(p)), None)
            if what is not None:
                skipped[what] = skipped.get(what, 0) + 1
                continue
            yield normalize_tensor_name(name), ShardTensor(handle, name, path), path.name
    for what, count in skipped.items():
        logger.info("skipped %d %s tensors (not used for text generation)", count, what)


def _check_has_mtp(model_dir: str | Path) -> None:
    """Fail before reading any weight when the MTP head is wanted and the checkpoint has none (header only)."""
    for path in list_shards(model_dir):
        if any(name.startswith(tuple(MTP_PREFIXES)) for name in open_shard(path).keys()):
            return
    raise CheckpointError(f"{model_dir}: the checkpoint has no 'mtp.*' tensors; speculative decoding with MTP "
                          "needs the MTP head's 'mtp.*' tensors (the original Qwen3.5 checkpoints have them; "
                          "text-only exports often drop them)")


def has_vision_config(model_dir: str | Path) -> bool:
    """Whether config.json describes a vision tower (a multimodal checkpoint's layout)."""
    path = Path(model_dir) / "config.json"
    return path.is_file() and isinstance(json.loads(path.read_text()).get("vision_config"), dict)


def load_vision_tower(model_dir: str | Path, *, dtype: torch.dtype,
                      device: torch.device | str) -> Qwen3_5VisionModel | None:
    """The checkpoint's vision tower in `dtype` on `device`, or None when config.json has no vision_config
    or the checkpoint no `model.visual.*` tensors. A tower that cannot be built (an incomplete vision_config,
    missing or mis-shaped tensors, as in text-only test exports that keep a stub) is skipped with a warning:
    text generation does not need it, image requests are then refused."""
    if not has_vision_config(model_dir):
        return None
    shards = [(path, open_shard(path)) for path in list_shards(model_dir)]
    names = [(path, handle, n) for path, handle in shards for n in handle.keys()
             if n.startswith(tuple(VISION_PREFIXES))]
    if not names:
        return None
    try:
        tower = Qwen3_5VisionModel(VisionConfig.from_pretrained(model_dir), dtype=dtype, device=device)
        for path, handle, name in names:
            tower.load_weights([(name, ShardTensor(handle, name, path))])
        tower.check_complete()
    except (WeightLoadError, ConfigError) as e:
        # the embedded demo model keeps the published layout with a stub tower, by design: no warning for it
        level = logging.INFO if Path(model_dir).resolve() == DEMO_DIR.resolve() else logging.WARNING
        logger.log(level, "%s: vision tower not loaded, image input disabled: %s", model_dir, e)
        return None
    return tower.eval()


def load_model(model_dir: str | Path, config: ModelConfig, kernels: KernelSet, *, dtype: torch.dtype,
               device: torch.device | str, load_format: str = "auto", max_positions: int | None = None,
               seed: int = 0, parallel: ParallelContext | None = None, num_mtp_layers: int = 0,
               load_vision: bool = True) -> nn.Module:
    """Construct the model for `config` on `device` and load its weights.

    load_format: 'auto' (safetensors in model_dir) or 'dummy' (random weights of the right format).
    parallel: this process's tensor-parallel rank (None: the whole model); it builds and reads only its
    share of the weights. num_mtp_layers > 0 also builds and loads that many layers of the checkpoint's MTP
    head (the draft model of speculative decoding); the config must declare at least as many
    (mtp_num_hidden_layers) and the checkpoint must hold its `mtp.*` tensors. load_vision False leaves the
    vision tower out (text-only serving).
    """
    t0 = time.perf_counter()
    cls = get_model_class(config)
    with torch.device(device):
        model = cls(config, kernels, dtype=dtype, device=device, max_positions=max_positions, parallel=parallel,
                    num_mtp_layers=num_mtp_layers)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    elif load_format == "auto":
        if num_mtp_layers > 0:
            _check_has_mtp(model_dir)
        current = "?"
        try:
            for name, tensor, file in iter_model_tensors(model_dir, config, with_mtp=num_mtp_layers > 0):
                current = f"{file}: {name}"
                model.load_weights([(name, tensor)])
        except WeightLoadError as e:
            raise CheckpointError(f"{model_dir}: {current.split(':')[0]}: {e}") from e
        try:
            model.check_complete()
        except WeightLoadError as e:
            raise CheckpointError(f"{model_dir}: {e}") from e
    else:
        raise CheckpointError(f"unknown load format '{load_format}' (expected 'auto' or 'dummy')")
    model.finalize()
    # under tensor parallelism rank 0 alone holds the tower (whole) and sends its rows with each step
    model.visual = (load_vision_tower(model_dir, dtype=dtype, device=device)
                    if load_vision and load_format == "auto" and (parallel is None or parallel.tp_rank == 0)
                    else None)
    model.eval()
    where = f", rank {parallel.tp_rank} of {parallel.tp_size}" if parallel and parallel.is_parallel else ""
    logger.info("loaded %s (%s, %s%s) in %.1f s", Path(model_dir).name or config.architecture, load_format,
                str(dtype).replace("torch.", ""), where, time.perf_counter() - t0)
    return model
