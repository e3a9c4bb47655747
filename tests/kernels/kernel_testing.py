"""Helpers for the kernel tests: random NVFP4 weights, NaN-poisoned allocations, error metrics."""

from __future__ import annotations

import pytest
import torch

from nibble.formats.nvfp4 import NVFP4Tensor, pack_fp4
from nibble.kernels import paged_attention as pa
from nibble.kernels.selftest import poison


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
    o, r = out.float(), ref.float()
    assert torch.isfinite(o).all(), "non-finite output (unwritten element?)"
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


def count_gathers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets a 1 for each FP8 scratch gather `paged_attention_launch` runs (kv_gather.py)."""
    calls: list[int] = []
    real = pa.gather_kv_pages
    monkeypatch.setattr(pa, "gather_kv_pages", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def random_nvfp4(*shape: int, gen: torch.Generator | None = None) -> NVFP4Tensor:
    """Random NVFP4 weight of logical shape [..., N, K]: all 16 codes, e4m3 scales incl. subnormals."""
    *lead, n, k = shape
    codes = torch.randint(0, 16, (*lead, n, k), dtype=torch.uint8, generator=gen)
    scale = torch.rand(*lead, n, k // 16, generator=gen) * 3.0
    scale[..., ::5] *= 0.004
    return NVFP4Tensor(pack_fp4(codes), scale.to(torch.float8_e4m3fn),
                       torch.rand(*lead, n, generator=gen) * 0.02 + 0.001)


def poisoned(fn, outs, *args, **kwargs):
    """Call fn after freeing NaN-filled blocks of the output sizes, so unwritten outputs show as NaN."""
    poison(torch.device("cpu"), *outs)
    return fn(*args, **kwargs)


def cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
