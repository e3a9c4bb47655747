"""store_kv and paged attention (Triton, interpreter, fp32 and FP8 caches) against the references:
prefill with a cached prefix, decode and speculative-decoding verify steps (a few query tokens per
sequence) with split-KV, shuffled block tables, odd lengths, GQA. Cache slots that no sequence owns hold
NaN, so a read of any of them shows in the output. (The interpreter computes bf16 on raw bits, so bf16 runs
only in the GPU tests.)"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import count_gathers, cu, poisoned, rel_err

from nibble.kernels import paged_attention as pa
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


def _poison_unowned(kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor, lens: list[int]) -> None:
    """NaN into every cache slot no sequence owns: the spare blocks, the slots past each sequence's end in
    its last block; the table's unused entries point at a spare block."""
    page = kc.shape[1]
    kb, vb = kc.view(torch.uint8), vc.view(torch.uint8)  # all-ones bits: NaN in fp32, bf16 and e4m3
    owned = torch.zeros(kc.shape[0], dtype=torch.bool)
    for s, n in enumerate(lens):
        nb = -(-n // page)
        owned[table[s, :nb].long()] = True
        kb[table[s, nb - 1], n - (nb - 1) * page:] = 0xFF
        vb[table[s, nb - 1], n - (nb - 1) * page:] = 0xFF
    spare = int((~owned).nonzero()[0])
    kb[~owned] = 0xFF
    vb[~owned] = 0xFF
    for s, n in enumerate(lens):
        table[s, -(-n // page):] = spare


def _attention_case(ctx: list[int], qlen: list[int], page: int, hq: int, hk: int, d: int, kv_dtype: torch.dtype,
                    splits: int | None = None, config: dict | None = None) -> None:
    table, total = _layout(ctx, qlen, page)
    fp8 = kv_dtype == torch.float8_e4m3fn
    ks, vs = (0.05, 0.04) if fp8 else (1.0, 1.0)
    kc = (torch.randn(total, page, hk, d) / ks).to(kv_dtype)
    vc = (torch.randn(total, page, hk, d) / vs).to(kv_dtype)
    seq_lens = [a + b for a, b in zip(ctx, qlen)]
    _poison_unowned(kc, vc, table, seq_lens)
    q = torch.randn(sum(qlen), hq, d)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    args = (q, kc, vc, cu(qlen), lens, table, d ** -0.5, ks, vs, max(qlen), int(lens.max()))
    ref = paged_attention_ref(*args)
    out = poisoned(paged_attention_launch, [(tuple(q.shape), q.dtype)], *args, num_splits=splits, config=config)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_prefill_cached_prefix(kv_dtype: torch.dtype) -> None:
    _attention_case([0, 21, 40], [9, 3, 1], 16, 8, 2, 32, kv_dtype)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("causal_split", [False, True])
def test_prefill_causal_split(kv_dtype: torch.dtype, causal_split: bool) -> None:
    """Long prefills in small tiles (4 query tokens x group 8 per program, 16 keys per tile), with and without
    the unmasked loop over the tiles below a program's diagonal: many full tiles, a diagonal inside a tile,
    first query positions one and two keys short of a tile boundary, and query blocks cut by the sequence end."""
    _attention_case([0, 47, 64, 5, 30, 2], [37, 20, 9, 1, 12, 20], 16, 16, 2, 32, kv_dtype,
                    config={"rows": 32, "block_n": 16, "causal_split": causal_split})


def test_prefill_block32_no_gqa_odd_head_dim() -> None:
    _attention_case([5, 0], [4, 7], 32, 3, 3, 24, torch.float32)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_split_kv(kv_dtype: torch.dtype, splits: int) -> None:
    _attention_case([0, 36, 70], [1, 1, 1], 16, 8, 2, 32, kv_dtype, splits)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("splits", [None, 1, 5])
@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_verify_split_kv(kv_dtype: torch.dtype, splits: int | None, n: int) -> None:
    """A verify step: n query tokens per sequence (the last token and n - 1 drafts), long contexts cut into
    several KV chunks (None: the heuristic's count, 2 here)."""
    _attention_case([300, 157, 40, 0], [n] * 4, 16, 8, 2, 32, kv_dtype, splits)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("splits", [None, 4])
def test_verify_mixed_query_lengths(kv_dtype: torch.dtype, splits: int | None) -> None:
    """Varlen: sequences with 1..5 query tokens in one step, one of them with no cached context."""
    _attention_case([200, 33, 90, 0, 61], [2, 5, 1, 4, 3], 16, 8, 2, 32, kv_dtype, splits)


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_verify_several_query_blocks(kv_dtype: torch.dtype, splits: int | None) -> None:
    """Query blocks of 2 tokens (16 rows / group 8), so the 5-token queries span 3 blocks, each split
    over the KV range up to its own last query token."""
    _attention_case([130, 70, 9], [5, 3, 4], 16, 16, 2, 32, kv_dtype, splits,
                    {"verify_rows": 16, "verify_fp8_rows": 16})


@pytest.mark.parametrize(("hq", "hk", "d", "page"), [(6, 2, 24, 32), (5, 1, 40, 16), (3, 3, 24, 8)])
def test_verify_odd_heads(hq: int, hk: int, d: int, page: int) -> None:
    """Groups of 3, 5 and 1 heads (padded rows), head dims that are no power of two, other page sizes."""
    _attention_case([170, 45, 2], [3, 2, 4], page, hq, hk, d, torch.float32, 4)


def test_split_grid_from_host_ints(monkeypatch: pytest.MonkeyPatch) -> None:
    """Given max_query_len and max_seq_len, the launch reads no device value (no host sync), and its grids
    are the same whatever the sequences' lengths: what a CUDA graph of a verify step needs."""
    grids: list[tuple] = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: grids.append((grid, kwargs.get("BLOCK_Q"), kwargs.get("BLOCK_S")))

    def sync(*_args, **_kwargs):
        raise AssertionError("device value read on the host")

    monkeypatch.setattr(pa, "_paged_attn_kernel", Recorder())
    monkeypatch.setattr(pa, "_merge_splits_kernel", Recorder())
    q = torch.randn(12, 32, 64)
    kc = torch.zeros(40, 16, 2, 64)
    table = torch.zeros(4, 32, dtype=torch.int32)
    cu_q = cu([3] * 4)
    all_lens = [torch.tensor(lens, dtype=torch.int32) for lens in ([500, 3, 3, 3], [3, 3, 3, 3], [512] * 4)]
    for name in ("__int__", "__index__", "__bool__", "__float__", "item", "tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    for seq_lens in all_lens:
        pa.paged_attention_launch(q, kc, kc, cu_q, seq_lens, table, 0.125, max_query_len=3, max_seq_len=512)
    monkeypatch.undo()
    splits = pa.num_decode_splits(q.device, 4, 2, 512, 128, 64, q_blocks=1)
    assert splits > 1
    assert grids == [((4, 2, splits), 4, None), ((12, 32), None, splits)] * 3


@pytest.mark.parametrize(("ctx", "qlen", "page", "hk", "d"),
                         [([0, 47, 64, 5], [37, 20, 9, 1], 16, 2, 32), ([170, 3], [40, 1], 8, 3, 24)])
def test_prefill_fp8_gather(ctx: list[int], qlen: list[int], page: int, hk: int, d: int) -> None:
    """Long FP8 prefills through the 16-bit scratch cache (`fp8_gather`): the same result as the reference,
    with a cache whose unowned slots are NaN (the scratch's copies of them must stay unread)."""
    _attention_case(ctx, qlen, page, 4 * hk, hk, d, torch.float8_e4m3fn,
                    config={"rows": 32, "block_n": 16, "fp8_gather": True})


def test_fp8_gather_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past GATHER_MAX_BYTES the launch converts in the attention kernel instead, and gets the same result;
    split-KV steps (decode, verify) never gather."""
    calls = count_gathers(monkeypatch)
    _attention_case([30, 0], [20, 9], 16, 8, 2, 32, torch.float8_e4m3fn, config={"fp8_gather": True})
    assert calls == [1]
    _attention_case([300, 40], [1, 1], 16, 8, 2, 32, torch.float8_e4m3fn, config={"fp8_gather": True})
    _attention_case([300, 40], [3, 4], 16, 8, 2, 32, torch.float8_e4m3fn, config={"fp8_gather": True})
    assert calls == [1]
    monkeypatch.setattr(pa, "GATHER_MAX_BYTES", 2 * 2 * 4 * 16 * 2 * 32 * 4 - 1)  # one byte short of 4 pages
    _attention_case([30, 0], [20, 9], 16, 8, 2, 32, torch.float8_e4m3fn, config={"fp8_gather": True})
    assert calls == [1]
    monkeypatch.setattr(pa, "GATHER_MAX_BYTES", 2 * 2 * 4 * 16 * 2 * 32 * 4)
    _attention_case([30, 0], [20, 9], 16, 8, 2, 32, torch.float8_e4m3fn, config={"fp8_gather": True})
    assert calls == [1, 1]
    monkeypatch.setattr(pa, "GATHER_MAX_BYTES", 1 << 30)
    kc = (torch.randn(5, 16, 2, 32) * 10).to(torch.float8_e4m3fn)
    q = torch.randn(20, 8, 32)
    args = (q, kc, kc, cu([20]), torch.tensor([50], dtype=torch.int32), torch.tensor([[4, 0, 2, 1]], dtype=torch.int32),
            0.2, 1.0, 1.0, 20)
    ref = paged_attention_ref(*args)
    out = paged_attention_launch(*args, 500, config={"fp8_gather": True})  # max_seq_len past the table's 64 slots
    assert calls == [1, 1] and rel_err(out, ref) < 1e-5


def test_fp8_gather_min_seq_len(monkeypatch: pytest.MonkeyPatch) -> None:
    """`fp8_gather_min_seq_len` bounds the gather by the batch's longest sequence (here 30 + 20 = 50 tokens):
    below it the kernel converts, from it on the scratch is read; the result is the same either way."""
    calls = count_gathers(monkeypatch)
    for min_len, want in ((51, []), (50, [1])):
        calls.clear()
        _attention_case([30, 0], [20, 9], 16, 8, 2, 32, torch.float8_e4m3fn,
                        config={"fp8_gather": True, "fp8_gather_min_seq_len": min_len})
        assert calls == want, min_len


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_kv_pages(dtype: torch.dtype) -> None:
    """Every page a sequence owns, converted exactly and in its place; fresh inputs each round, NaN-poisoned
    scratch; a cache that is a strided view (K and V halves of one tensor)."""
    from nibble.kernels.kv_gather import gather_kv_pages, gather_kv_pages_ref

    for seed in range(2):
        gen = torch.Generator().manual_seed(seed)
        kv = (torch.randn(30, 8, 2, 3, 40, generator=gen) * 30).to(torch.float8_e4m3fn)
        kc, vc = kv[:, :, 0], kv[:, :, 1]
        lens = torch.tensor([1, 45, 0, 17], dtype=torch.int32)
        table = torch.randperm(30, generator=gen)[:24].to(torch.int32).view(4, 6)
        max_len = 45
        size = (4 * 6 * 8 * 3 * 40,)
        k, v, t = poisoned(gather_kv_pages, [(size, dtype)] * 2, kc, vc, table, lens, max_len, dtype)
        kr, vr, tr = gather_kv_pages_ref(kc, vc, table, lens, max_len, dtype)
        assert t.tolist() == tr.tolist() == torch.arange(24).view(4, 6).tolist()
        for s, n in enumerate(lens.tolist()):
            owned = t[s, :-(-n // 8)].long()
            assert torch.equal(k[owned], kr[owned]) and torch.equal(v[owned], vr[owned])
            assert torch.equal(k[owned].float(), kc[table[s, :len(owned)].long()].float())


def test_gather_kv_pages_rejects_bad_input() -> None:
    from nibble.kernels.kv_gather import gather_kv_pages

    kc = torch.zeros(4, 16, 2, 32, dtype=torch.float8_e4m3fn)
    lens = torch.tensor([40], dtype=torch.int32)
    with pytest.raises(ValueError, match="e4m3 caches"):
        gather_kv_pages(kc.float(), kc.float(), torch.zeros(1, 3, dtype=torch.int32), lens, 40, torch.float16)
    with pytest.raises(ValueError, match="block_table"):
        gather_kv_pages(kc, kc, torch.zeros(1, 2, dtype=torch.int32), lens, 40, torch.float16)
    with pytest.raises(ValueError, match="scratch dtype"):
        gather_kv_pages(kc, kc, torch.zeros(1, 3, dtype=torch.int32), lens, 40, torch.int8)
