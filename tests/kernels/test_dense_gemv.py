"""The dense (16/32-bit weight) decode GEMV (Triton, interpreter, fp32) against torch's F.linear: odd row
counts, K tails, token counts up to the kernel's limit, strided activations, poisoned outputs; and the
table's torch path."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import poisoned, rel_err

from nibble.kernels import dense_gemv
from nibble.kernels.dense_gemv import GEMV_MAX_TOKENS, MAX_TOKENS, dense_linear, dense_linear_launch, dense_linear_ref


def gemv(bn: int, bk: int, warps: int = 4, stages: int = 2, path: str = "gemv") -> dict:
    return {"path": path, "block_n": bn, "block_k": bk, "warps": warps, "stages": stages}


def dot(bn: int, bk: int, warps: int = 4, stages: int = 2) -> dict:
    return gemv(bn, bk, warps, stages, "dot")


@pytest.mark.parametrize("t,n,k,cfg", [
    (1, 37, 96, gemv(8, 32)),     # rows past N in the last program
    (2, 40, 100, gemv(4, 64)),    # K tail (100 = 64 + 36)
    (3, 19, 48, gemv(16, 16, 2)),  # 3 tokens in a 4-slot block
    (5, 64, 200, gemv(8, 128)),   # 5 of 8 slots, K shorter than two steps
    (GEMV_MAX_TOKENS, 24, 512, gemv(4, 128, 4, 3)),
    (1, 9, 8, gemv(8, 256)),      # block_k capped at K's power of two
    (5, 40, 100, dot(16, 32)),    # tensor-core kernel: K tail, rows past N, 5 of 16 token columns
    (MAX_TOKENS, 64, 256, dot(32, 64, 2)),
    (12, 16, 48, dot(8, 8)),      # tile sizes raised to the MMA's 16
])
def test_dense_gemv_matches_reference(t: int, n: int, k: int, cfg: dict) -> None:
    gen = torch.Generator().manual_seed(t * 1000 + n)
    x = torch.randn(t, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    out = poisoned(dense_linear_launch, [((t, n), x.dtype)], x, w, config=cfg)
    assert rel_err(out, dense_linear_ref(x, w)) < 1e-5


def test_dense_gemv_strided_activations_and_leading_dims() -> None:
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(3, 150, generator=gen)
    x = wide[:, 10:110]  # a column slice: row stride 150
    w = torch.randn(33, 100, generator=gen)
    out = dense_linear_launch(x, w, config=gemv(8, 32))
    assert rel_err(out, dense_linear_ref(x, w)) < 1e-5
    x3 = torch.randn(2, 2, 100, generator=gen)
    out3 = dense_linear_launch(x3, w, config=gemv(8, 32))
    assert out3.shape == (2, 2, 33)
    assert rel_err(out3, dense_linear_ref(x3, w)) < 1e-5


def test_dense_linear_torch_path_and_large_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(dense_gemv._dense_gemv_kernel, "run", lambda *a, **kw: calls.append(1))
    monkeypatch.setattr(dense_gemv._dense_dot_kernel, "run", lambda *a, **kw: calls.append(1))
    x, w = torch.randn(MAX_TOKENS + 1, 64), torch.randn(16, 64)
    # more tokens than the kernels take: F.linear whatever the configuration says
    assert torch.equal(dense_linear_launch(x, w, config=dot(16, 32)), dense_linear_ref(x, w))
    assert torch.equal(dense_linear_launch(x[:GEMV_MAX_TOKENS + 1], w, config=gemv(8, 32)),
                       dense_linear_ref(x[:GEMV_MAX_TOKENS + 1], w))
    # the CPU's table is default.json, which keeps torch for every shape
    assert torch.equal(dense_linear(x[:2], w), dense_linear_ref(x[:2], w))
    assert calls == []
    assert dense_linear_launch(torch.randn(0, 64), w, config=gemv(8, 32)).shape == (0, 16)


def test_dense_linear_rejects_bad_input() -> None:
    w = torch.randn(16, 64)
    with pytest.raises(ValueError, match="K differs"):
        dense_linear_launch(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="dtype"):
        dense_linear_launch(torch.randn(2, 64, dtype=torch.float64), w.double())
    with pytest.raises(ValueError, match="share"):
        dense_linear_launch(torch.randn(2, 64), w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="unknown path"):
        dense_linear_launch(torch.randn(2, 64), w, config={"path": "cublas"})
