"""NVFP4 W4A16 linear (Triton, interpreter, fp32) against the reference: GEMV, tiles, split-K."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import poisoned, random_nvfp4, rel_err

from nibble.kernels.nvfp4_linear import nvfp4_linear_launch, nvfp4_linear_ref


@pytest.mark.parametrize("t,path,cfg", [
    (1, "gemv", {}),
    (3, "gemv", {"gemv_block_k": 32}),
    (5, "gemm", {"block_m": 16, "block_n": 16, "block_k": 32}),
    (21, "gemm", {"block_m": 16, "block_n": 32, "block_k": 32, "split_k": 2}),
])
def test_nvfp4_linear(t: int, path: str, cfg: dict) -> None:
    w = random_nvfp4(40, 96)
    x = torch.randn(t, 96)
    out = poisoned(nvfp4_linear_launch, [((t, 40), x.dtype)], x, w, path=path, config=cfg)
    assert rel_err(out, nvfp4_linear_ref(x, w)) < 1e-5
