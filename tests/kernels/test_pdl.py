"""Host side of pdl.py: where programmatic dependent launch and the bulk L2 prefetch may be used (the device
side runs in tests/gpu: PDL launches give bitwise the outputs of plain launches)."""

from __future__ import annotations

import torch

from nibble.kernels.pdl import pdl_supported, prefetch_ok


def test_pdl_not_on_cpu() -> None:
    assert not pdl_supported(torch.device("cpu"))


def test_prefetch_ok_needs_16_byte_aligned_bases_and_strides() -> None:
    q = torch.zeros(4, 64, 96, dtype=torch.uint8)
    assert prefetch_ok(q, q.view(torch.int16))
    assert not prefetch_ok(q[:, :, 1:])  # base off by one byte
    assert not prefetch_ok(torch.zeros(4, 8, 24, dtype=torch.uint8))  # rows of 24 bytes
    assert not prefetch_ok(q, torch.zeros(3, 40, dtype=torch.uint8)[:, 2:])
