"""Build a model and fill it from a Hugging Face checkpoint directory (or with dummy weights).

Tensors are streamed one at a time from the safetensors shards straight into the model's parameters, so
the process never holds a second copy of the model. Vision tower and MTP tensors are skipped with one log
line each; every other tensor must map onto a parameter, and every parameter must be filled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from nibble.checkpoint.dummy import init_dummy_weights
from nibble.checkpoint.safetensors_io import iter_tensors, list_shards
from nibble.kernels.kernel_set import KernelSet
from nibble.layers.linear import WeightLoadError
from nibble.models.config import ModelConfig
from nibble.models.quant_config import normalize_module_name
from nibble.models.registry import get_model_class

logger = logging.getLogger("nibble.checkpoint")

SKIPPED_PREFIXES = {"model.visual.": "vision tower", "visual.": "vision tower", "mtp.": "MTP head",
                    "model.mtp.": "MTP head"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and tensor."""


def iter_model_tensors(model_dir: str | Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Yield (normalised name, tensor, file name) for the language model's tensors, one at a time."""
    skipped: dict[str, int] = {}
    for name, tensor, path in iter_tensors(list_shards(model_dir)):
        what = next((w for p, w in SKIPPED_PREFIXES.items() if name.startswith(p)), None)
        if what is not None:
            skipped[what] = skipped.get(what, 0) + 1
            continue
        yield normalize_module_name(name), tensor, path.name
    for what, count in skipped.items():
        logger.info("skipped %d %s tensors (not used for text generation)", count, what)


def load_model(model_dir: str | Path, config: ModelConfig, kernels: KernelSet, *, dtype: torch.dtype,
               device: torch.device | str, load_format: str = "auto", max_positions: int | None = None,
               seed: int = 0) -> nn.Module:
    """Construct the model for `config` on `device` and load its weights.

    load_format: 'auto' (safetensors in model_dir) or 'dummy' (random weights of the right format).
    """
    t0 = time.perf_counter()
    cls = get_model_class(config)
    with torch.device(device):
        model = cls(config, kernels, dtype=dtype, device=device, max_positions=max_positions)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    elif load_format == "auto":
        current = "?"
        try:
            for name, tensor, file in iter_model_tensors(model_dir, config):
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
    model.eval()
    logger.info("loaded %s (%s, %s) in %.1f s", Path(model_dir).name or config.architecture, load_format,
                str(dtype).replace("torch.", ""), time.perf_counter() - t0)
    return model
