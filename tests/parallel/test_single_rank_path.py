"""At tensor-parallel size 1 the model runs none of the parallel machinery: no torch.distributed call, and
none of the ops that only the parallel branches issue (the vocab-parallel embedding's masking, the head's
gather). The ATen ops of a whole greedy run are recorded and checked, on both tiny checkpoints
(fp32 with fused experts, NVFP4 everywhere)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from nibble.checkpoint.loader import load_model
from nibble.kernels.kernel_set import KernelSet
from nibble.models.config import ModelConfig
from tests.parallel.scenario import greedy_run

# the in-place masking is the vocab-parallel embedding's (the torch attention reference masks out of place)
PARALLEL_ONLY_OPS = ("masked_fill_", "all_reduce", "all_gather", "c10d")


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["fp32", "nvfp4"])
def test_tp1_runs_no_parallel_code(name: str, checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*_args, **_kwargs) -> None:
        raise AssertionError("torch.distributed called at tensor-parallel size 1")

    for fn in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter"):
        monkeypatch.setattr(dist, fn, forbidden)
    path = checkpoints[name]
    config = ModelConfig.from_pretrained(path)
    model = load_model(path, config, KernelSet.reference(), dtype=torch.float32, device="cpu")
    log = _OpLog()
    with log:
        out = greedy_run(model, config)
    assert out["tokens"].numel() > 0
    hits = sorted(n for n in log.names if any(p in n for p in PARALLEL_ONLY_OPS))
    assert not hits, f"ops of the parallel branches ran at tp 1: {hits}"
