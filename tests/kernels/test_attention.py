"""store_kv and paged attention (Triton, interpreter, fp32 and FP8 caches) against the references:
prefill with a cached prefix, decode with split-KV, shuffled block tables, odd lengths, GQA."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import cu, poisoned, rel_err

from nibble.kernels.attention import paged_attention_ref, store_kv, store_kv_ref
from nibble.kernels.paged_attention import paged_attention_launch


def _layout(ctx: list[int], qlen: list[int], page: int) -> tuple[torch.Tensor, int]:
    nb = [-(-(a + b) // page) for a, b in zip(ctx, qlen)]
    total = sum(nb) + 2
    perm = torch.randperm(total).to(torch.int32)
    table = torch.zeros(len(nb), max(nb) + 1, dtype=torch.int32)
    i = 0
    for s, n in enumerate(nb):
        table[s, :n] = perm[i:i + n]
        i += n
    return table, total


def _slots(table: torch.Tensor, page: int, ctx: list[int], qlen: list[int]) -> torch.Tensor:
    out = []
    for s, (a, b) in enumerate(zip(ctx, qlen)):
        pos = torch.arange(a, a + b)
        out.append(table[s, pos // page].long() * page + pos % page)
    return torch.cat(out)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_store_kv(kv_dtype: torch.dtype) -> None:
    table, total = _layout([3, 0], [6, 17], 16)
    slots = _slots(table, 16, [3, 0], [6, 17])
    slots[[1, 7]] = -1
    k, v = torch.randn(23, 2, 24) * 3, torch.randn(23, 2, 24)
    kc = torch.randn(total, 16, 2, 24).to(kv_dtype)
    vc = torch.randn(total, 16, 2, 24).to(kv_dtype)
    kr, vr = kc.clone(), vc.clone()
    ks, vs = (1.0, 1.0) if kv_dtype == torch.float32 else (0.5, 0.25)
    store_kv_ref(k, v, kr, vr, slots, ks, vs)
    store_kv(k, v, kc, vc, slots, ks, vs)
    assert torch.equal(kc.view(torch.uint8), kr.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vr.view(torch.uint8))


def test_store_kv_fp8_saturates() -> None:
    k = torch.tensor([[[1000.0, -1000.0]]])
    kc = torch.zeros(1, 16, 1, 2, dtype=torch.float8_e4m3fn)
    vc = kc.clone()
    store_kv(k, k, kc, vc, torch.tensor([0]), 1.0, 1.0)
    assert kc[0, 0, 0].float().tolist() == [448.0, -448.0]


def _attention_case(ctx: list[int], qlen: list[int], page: int, hq: int, hk: int, d: int, kv_dtype: torch.dtype,
                    splits: int | None = None) -> None:
    table, total = _layout(ctx, qlen, page)
    fp8 = kv_dtype == torch.float8_e4m3fn
    ks, vs = (0.05, 0.04) if fp8 else (1.0, 1.0)
    kc = (torch.randn(total, page, hk, d) / ks).to(kv_dtype)
    vc = (torch.randn(total, page, hk, d) / vs).to(kv_dtype)
    q = torch.randn(sum(qlen), hq, d)
    lens = torch.tensor([a + b for a, b in zip(ctx, qlen)], dtype=torch.int32)
    args = (q, kc, vc, cu(qlen), lens, table, d ** -0.5, ks, vs, max(qlen), int(lens.max()))
    ref = paged_attention_ref(*args)
    out = poisoned(paged_attention_launch, [(tuple(q.shape), q.dtype)], *args, num_splits=splits)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_prefill_cached_prefix(kv_dtype: torch.dtype) -> None:
    _attention_case([0, 21, 40], [9, 3, 1], 16, 8, 2, 32, kv_dtype)


def test_prefill_block32_no_gqa_odd_head_dim() -> None:
    _attention_case([5, 0], [4, 7], 32, 3, 3, 24, torch.float32)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_split_kv(kv_dtype: torch.dtype, splits: int) -> None:
    _attention_case([0, 36, 70], [1, 1, 1], 16, 8, 2, 32, kv_dtype, splits)
