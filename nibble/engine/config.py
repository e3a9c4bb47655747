"""EngineConfig: every knob of one serving engine, frozen, with derived values as properties."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "half": torch.float16, "float32": torch.float32, "fp32": torch.float32,
          "float": torch.float32}


class EngineConfigError(ValueError):
    pass


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine instance. `model` is a checkpoint directory (or 'demo')."""

    model: str
    tokenizer: str | None = None
    served_model_name: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.90
    kv_cache_memory_gb: float | None = None
    enforce_eager: bool = False
    async_scheduling: bool = True
    warmup: bool = True
    cuda_graph_max_batch_size: int = 256
    seed: int = 0
    moe_backend: str | None = None
    attention_backend: str | None = None
    linear_backend: str | None = None
    self_test: bool = True
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    max_waiting_requests: int = 4096
    enable_prefix_caching: bool = True
    prefix_cache_slots: int = 16
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise EngineConfigError(msg)

        check(self.kv_cache_dtype in KV_CACHE_DTYPES,
              f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got '{self.kv_cache_dtype}'")
        check(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got '{self.dtype}'")
        check(self.load_format in ("auto", "dummy"), f"--load-format must be auto or dummy, got '{self.load_format}'")
        check(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
              f"--block-size must be a power of 2, got {self.block_size}")
        check(self.max_num_seqs >= 1, f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        check(self.max_num_batched_tokens >= 1,
              f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        check(0.0 < self.gpu_memory_utilization <= 1.0,
              f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        check(self.max_model_len is None or self.max_model_len >= 1,
              f"--max-model-len must be >= 1, got {self.max_model_len}")
        check(self.prefix_cache_slots >= 0, f"--prefix-cache-slots must be >= 0, got {self.prefix_cache_slots}")
        check(self.tensor_parallel_size >= 1, f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        check(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
              f"--device must be auto, cpu or cuda[:N], got '{self.device}'")

    @property
    def num_state_slots(self) -> int:
        """GDN state slots to allocate: one per sequence, the reserved scratch slot, and the prefix cache's."""
        return self.max_num_seqs + 1 + (self.prefix_cache_slots if self.enable_prefix_caching else 0)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        dt = DTYPES[self.dtype]
        if dt is not None:
            return dt
        return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.kv_cache_dtype.startswith("fp8") else self.torch_dtype

    @property
    def forced_backends(self) -> dict[str, str]:
        out = {}
        for group, value in (("moe", self.moe_backend), ("attention", self.attention_backend),
                             ("linear", self.linear_backend)):
            if value and value != "auto":
                out[group] = value
        return out

    def replace(self, **changes: Any) -> EngineConfig:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return EngineConfig(**values)
