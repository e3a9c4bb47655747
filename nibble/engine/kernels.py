"""Kernel selection for an engine: the backend registry's choice for this device and model, self-tested."""

from __future__ import annotations

import logging

from nibble.engine.config import EngineConfig
from nibble.kernels.kernel_set import KernelSet
from nibble.kernels.registry import SelectionReport, select_kernels
from nibble.models.config import ModelConfig

logger = logging.getLogger("nibble.engine")


def select_engine_kernels(config: EngineConfig, model_config: ModelConfig) -> tuple[KernelSet, SelectionReport]:
    """(KernelSet, selection report) for the engine's device, dtype and KV-cache dtype.

    Raises KernelSelectionError when a forced backend (--moe-backend, --attention-backend,
    --linear-backend) is unsupported or fails its self-test.
    """
    kernels, report = select_kernels(model_config, config.torch_device, config.torch_dtype,
                                     config.kv_torch_dtype, forced=config.forced_backends,
                                     self_test=config.self_test, block_size=config.block_size,
                                     tp_size=config.tensor_parallel_size,
                                     expert_parallel=config.enable_expert_parallel)
    logger.info("kernels: %s (self-tests %.1f s)",
                ", ".join(f"{op}={name}" for op, name in report.selected.items()), report.total_seconds)
    return kernels, report
