"""A batch's FP8 K/V cache pages gathered into a dense 16-bit scratch cache, for long prefills.

A prefill program reads every K/V tile of its context once per query block, so an FP8 cache makes the
attention kernel convert each e4m3 element many times over, and its tiles take the detour global ->
registers -> convert -> shared memory instead of going to shared memory by asynchronous copy (the 128-row
prefill tile also spills registers then). Converting each page once beforehand costs one pass over the
context; the kernel then reads the scratch as a plain 16-bit cache. `paged_attention_launch` does this where
the tuning table's `fp8_gather` field says it pays, the batch's `max_seq_len` reaches `fp8_gather_min_seq_len`
(on an H200 it saved 9-16% from 8192 tokens of context and cost up to twice the time below 2048, where the extra
pass outweighs the conversions), and the scratch stays within `GATHER_MAX_BYTES`.

The scratch holds the e4m3 values exactly (in fp16, or the queries' dtype where the GPU lacks the native
converts), so the attention's result is the same as with the conversion in its K loop.
"""

from __future__ import annotations

import torch

from nibble.kernels._triton import cdiv, e4m3_to_f32, fp8_native, next_pow2, tl, triton

# The scratch is transient (the caching allocator hands the same block to every full-attention layer of a
# step) but not planned for by the KV-cache sizing, so it is bounded: 256 MiB holds 65536 tokens of a
# 2-KV-head, head_dim-256 layer (an 8192-token chunk after 57344 cached tokens). Longer contexts convert in
# the attention kernel, as before.
GATHER_MAX_BYTES = 256 << 20


@triton.jit
def _gather_kv_kernel(k_ptr, v_ptr, ko_ptr, vo_ptr, bt_ptr, lens_ptr, pages_per_seq, head_dim,
                      stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                      PAGE: tl.constexpr, BLOCK_D: tl.constexpr, FP8_NATIVE: tl.constexpr):
    """Scratch page program_id(0) (sequence s = pid // pages_per_seq, its page j), KV head program_id(1):
    the cache page block_table[s, j] converted. Pages at or past the sequence's length are not written."""
    pid = tl.program_id(0)
    seq = pid // pages_per_seq
    j = pid % pages_per_seq
    if j * PAGE >= tl.load(lens_ptr + seq):
        return
    kvh = tl.program_id(1).to(tl.int64)
    page = tl.load(bt_ptr + seq * stride_bt + j).to(tl.int64)
    s = tl.arange(0, PAGE)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = d < head_dim
    k = tl.load(k_ptr + page * stride_kb + kvh * stride_kh + s * stride_ks + d, mask=mask)
    v = tl.load(v_ptr + page * stride_vb + kvh * stride_vh + s * stride_vs + d, mask=mask)
    if not FP8_NATIVE:
        k = e4m3_to_f32(k)
        v = e4m3_to_f32(v)
    n_heads = tl.num_programs(1)
    out = ((pid.to(tl.int64) * PAGE + s) * n_heads + kvh) * head_dim + d
    tl.store(ko_ptr + out, k.to(ko_ptr.dtype.element_ty), mask=mask)
    tl.store(vo_ptr + out, v.to(vo_ptr.dtype.element_ty), mask=mask)


def _pages_per_seq(max_seq_len: int, page: int) -> int:
    return cdiv(max(1, max_seq_len), page)


def scratch_bytes(num_seqs: int, max_seq_len: int, k_cache: torch.Tensor, dtype: torch.dtype) -> int:
    """Bytes of the K and V scratch caches `gather_kv_pages` allocates."""
    _, page, hk, d = k_cache.shape
    return 2 * num_seqs * _pages_per_seq(max_seq_len, page) * page * hk * d * dtype.itemsize


def gather_kv_pages(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, max_seq_len: int, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k_cache, v_cache: e4m3 [num_blocks, page, Hk, D]; block_table: int32 [B, >= P]; seq_lens: int32 [B];
    max_seq_len: host int >= every seq_len, P = cdiv(max_seq_len, page). Returns (k, v [B * P, page, Hk, D]
    in dtype, block_table int32 [B, P]) where sequence b's page j is scratch page b * P + j. Scratch pages at
    or past a sequence's length are left unwritten (attention reads no key there)."""
    if k_cache.dtype != torch.float8_e4m3fn or v_cache.dtype != k_cache.dtype or v_cache.shape != k_cache.shape:
        raise ValueError(f"gather_kv_pages: e4m3 caches of one shape expected, got {k_cache.dtype} "
                         f"{tuple(k_cache.shape)} / {v_cache.dtype} {tuple(v_cache.shape)}")
    if k_cache.dim() != 4 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("gather_kv_pages: caches must be [num_blocks, page, Hk, D] with a contiguous head dim")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"gather_kv_pages: scratch dtype {dtype} is not a float type e4m3 converts into")
    b = seq_lens.shape[0]
    _, page, hk, d = k_cache.shape
    pages = _pages_per_seq(max_seq_len, page)
    if block_table.dim() != 2 or block_table.shape[0] != b or block_table.shape[1] < pages:
        raise ValueError(f"gather_kv_pages: block_table {tuple(block_table.shape)} for {b} sequences of up "
                         f"to {max_seq_len} tokens ({pages} pages of {page})")
    ko = torch.empty((b * pages, page, hk, d), dtype=dtype, device=k_cache.device)
    vo = torch.empty_like(ko)
    table = torch.arange(b * pages, dtype=torch.int32, device=k_cache.device).view(b, pages)
    if b == 0:
        return ko, vo, table
    native = fp8_native(k_cache.device)
    kc = k_cache if native else k_cache.view(torch.uint8)
    vc = v_cache if native else v_cache.view(torch.uint8)
    _gather_kv_kernel[(b * pages, hk)](
        kc, vc, ko, vo, block_table, seq_lens, pages, d, kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2), block_table.stride(0),
        PAGE=page, BLOCK_D=next_pow2(d), FP8_NATIVE=native, num_warps=4)
    return ko, vo, table


def gather_kv_pages_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, max_seq_len: int, dtype: torch.dtype
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch `gather_kv_pages`; here every scratch page is written (pages past a sequence's length too)."""
    b = seq_lens.shape[0]
    page = k_cache.shape[1]
    pages = _pages_per_seq(max_seq_len, page)
    idx = block_table[:, :pages].reshape(-1).long()
    table = torch.arange(b * pages, dtype=torch.int32, device=k_cache.device).view(b, pages)
    return k_cache[idx].to(dtype), v_cache[idx].to(dtype), table
