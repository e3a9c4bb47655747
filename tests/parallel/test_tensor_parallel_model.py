"""The model split over 2 and 4 gloo ranks (tensor parallel, and tensor + expert parallel) against the same
model in one process: identical greedy tokens, fp32 logits within 1e-5, for an fp32 checkpoint (multimodal
layout, fused experts, a vocabulary that does not divide by 4) and an NVFP4 one (every linear quantized)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from nibble.checkpoint.loader import load_model
from nibble.kernels.kernel_set import KernelSet
from nibble.models.config import ModelConfig
from tests.parallel.launch import run_ranks
from tests.parallel.scenario import greedy_run

LOGITS_ATOL = 1e-5


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path]) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for name, path in checkpoints.items():
        config = ModelConfig.from_pretrained(path)
        model = load_model(path, config, KernelSet.reference(), dtype=torch.float32, device="cpu")
        out[name] = greedy_run(model, config)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_tp_and_ep_match_single_process(world: int, checkpoints: dict[str, Path],
                                        references: dict[str, Any], tmp_path: Path) -> None:
    cases = [(f"{name}-{mode}", path, mode == "ep") for name, path in checkpoints.items() for mode in ("tp", "ep")]
    results = run_ranks(world, cases, tmp_path / "results.pt")
    for case, _, _ in cases:
        got, ref = results[case], references[case.rsplit("-", 1)[0]]
        assert torch.equal(got["tokens"], ref["tokens"]), f"{case} at tp {world}: greedy tokens differ"
        err = float((got["logits"] - ref["logits"]).abs().max())
        assert err < LOGITS_ATOL, f"{case} at tp {world}: logits differ by {err:.2e}"
