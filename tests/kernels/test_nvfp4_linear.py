"""NVFP4 W4A16 linear (Triton, interpreter, fp32) against the reference: the weight-stationary kernel in
every token layout, K tails, split-K, and the first-generation GEMV / tiles."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import poisoned, random_nvfp4, rel_err

from nibble.kernels.nvfp4_linear import nvfp4_linear_launch, nvfp4_linear_ref


@pytest.mark.parametrize("t,path,cfg", [
    (1, "auto", {}),
    (3, "auto", {"xmode": "quad", "block_n": 16, "block_k": 32, "split_k": 1}),
    # split-K: 3 splits of one 32-wide K step each (K = 96), a block of 16 token slots over 5 tokens
    (5, "auto", {"xmode": "split", "slots": 16, "block_n": 32, "block_k": 32, "split_k": 3}),
    (6, "auto", {"xmode": "quad", "block_n": 16, "block_k": 64, "split_k": 2}),  # K tail in the last split
    (21, "auto", {"xmode": "perm", "slots": 16, "block_n": 32, "block_k": 64, "split_k": 1}),  # K tail
    (21, "auto", {"xmode": "perm", "slots": 16, "block_n": 16, "block_k": 32, "split_k": 2}),
    (1, "generic_gemv", {}),
    (3, "generic_gemv", {"gemv_block_k": 32}),
    (5, "generic_gemm", {"block_m": 16, "block_n": 16, "block_k": 32}),
    (21, "generic_gemm", {"block_m": 16, "block_n": 32, "block_k": 32, "split_k": 2}),
])
def test_nvfp4_linear(t: int, path: str, cfg: dict) -> None:
    w = random_nvfp4(40, 96)
    x = torch.randn(t, 96)
    out = poisoned(nvfp4_linear_launch, [((t, 40), x.dtype)], x, w, path=path, config=cfg)
    assert rel_err(out, nvfp4_linear_ref(x, w)) < 1e-5


def test_nvfp4_linear_rejects_bad_input() -> None:
    w = random_nvfp4(40, 96)
    with pytest.raises(ValueError, match="K=64"):
        nvfp4_linear_launch(torch.randn(2, 64), w)
    with pytest.raises(ValueError, match="unknown path"):
        nvfp4_linear_launch(torch.randn(2, 96), w, path="gemm")
