"""Paged causal attention over each sequence's cached context (Triton); the contract and the torch
reference are `attention.paged_attention_ref`.

One kernel serves prefill and decode. A program owns BLOCK_Q query tokens of one sequence and ALL query
heads of one KV head (GQA packing: the rows of its tiles are (token, head-in-group) pairs), so each K/V
tile is read once per group and the dots have 16+ rows even for one decode token. K/V tiles are gathered
through the block table (any power-of-two page size), scores use an online softmax in fp32 (exp2 with the
scale folded in), FP8 caches are converted in registers and their scales applied to scores and output (or,
for a prefill where the table's `fp8_gather` is on, converted once into a 16-bit scratch cache: kv_gather.py).
Steps with few query tokens per sequence (decode, and the verify step of speculative decoding: the last
token plus a few drafts) split long contexts over several programs (split-KV) whose partial outputs and
log-sum-exps a second kernel merges; each program covers all of a sequence's query tokens (up to BLOCK_Q
of them) and group heads for one KV chunk, so a verify step reads its context once, like a decode step.
The K/V tiles below the diagonal of a program's first query token, which every row may see, run without the
causal and range masks (tuning field `causal_split`, default on; on the H200 2-29% faster decode, no slower
verify, 7-16% faster prefill, docs/benchmarks.md); only the last tiles are masked. A sequence's query blocks run
last-first, the ones that see the most keys starting earliest.
"""

from __future__ import annotations

import torch

from nibble.kernels._triton import cdiv, dot_precision, e4m3_to_f32, fp8_native, next_pow2, sm_count, tl, triton
from nibble.kernels.kv_gather import GATHER_MAX_BYTES, gather_kv_pages, scratch_bytes
from nibble.kernels.tuning_tables import lookup

LOG2E = 1.4426950408889634
# Split-KV serves steps whose longest query has at most this many tokens. Beyond it a step is a prefill
# with enough query blocks to fill the GPU, and the fp32 partial outputs ([T, Hq, splits, D]) would grow
# with T for nothing. Steps of 2..SPLIT_MAX_QUERY_LEN tokens (verify) take their tile from the table's
# `verify_*` fields (`verify_fp8_*` for FP8 caches, whose tiles hold twice the keys in the same bytes):
# the split kernel is bound by reading K/V like decode, but with decode's tile rows times the query tokens.
SPLIT_MAX_QUERY_LEN = 16
_VERIFY_FIELDS = ("rows", "block_n", "num_warps", "num_stages")


@triton.jit
def _load_kv_tile(ptr, offs, mask, KV_FP8: tl.constexpr, FP8_NATIVE: tl.constexpr, dtype: tl.constexpr):
    if mask is None:
        x = tl.load(ptr + offs)
    else:
        x = tl.load(ptr + offs, mask=mask, other=0.0)
    if KV_FP8:
        if FP8_NATIVE:
            x = x.to(dtype)
        else:
            x = e4m3_to_f32(x).to(dtype)
    return x


@triton.jit
def _attn_tile(q, k_ptr, v_ptr, bt_ptr, seq, n0, hi, qpos, row_ok, m_i, l_i, acc, qk_scale, kvh, head_dim,
               stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, PAGE: tl.constexpr, KV_FP8: tl.constexpr, FP8_NATIVE: tl.constexpr,
               DOT_PREC: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """One K/V tile (keys n0 .. n0 + BLOCK_N) of the online softmax: (m_i, l_i, acc) updated. MASKED: keys at
    or past hi, or after a row's query position, are left out (the last tiles); otherwise the caller vouches
    that every row may see every key of the tile."""
    kpos = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    if MASKED:
        kmask = kpos < hi
        page = tl.load(bt_ptr + seq * stride_bt + kpos // PAGE, mask=kmask, other=0).to(tl.int64)
    else:
        page = tl.load(bt_ptr + seq * stride_bt + kpos // PAGE).to(tl.int64)
    in_page = (kpos % PAGE).to(tl.int64)
    k_offs = (page * stride_kb + in_page * stride_ks + kvh * stride_kh)[:, None] + d[None, :]
    v_offs = (page * stride_vb + in_page * stride_vs + kvh * stride_vh)[:, None] + d[None, :]
    if MASKED:
        m2 = kmask[:, None] & (d < head_dim)[None, :]
    elif EVEN_D:
        m2 = None
    else:
        m2 = (d < head_dim)[None, :]
    cdt = q.dtype
    k = _load_kv_tile(k_ptr, k_offs, m2, KV_FP8, FP8_NATIVE, cdt)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    if MASKED:
        ok = row_ok[:, None] & kmask[None, :] & (kpos[None, :] <= qpos[:, None])
        s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = _load_kv_tile(v_ptr, v_offs, m2, KV_FP8, FP8_NATIVE, cdt)
    acc = acc * alpha[:, None] + tl.dot(p.to(cdt), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["n_qblk", "n_splits"])
def _paged_attn_kernel(q_ptr, k_ptr, v_ptr, out_ptr, po_ptr, plse_ptr, cu_ptr, lens_ptr, bt_ptr,
                       qk_scale, v_scale, group, n_heads, head_dim, n_qblk, n_splits,
                       stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                       stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_bt,
                       BLOCK_Q: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, PAGE: tl.constexpr, KV_FP8: tl.constexpr,
                       FP8_NATIVE: tl.constexpr, SPLIT: tl.constexpr, DOT_PREC: tl.constexpr,
                       EVEN_D: tl.constexpr, CAUSAL_SPLIT: tl.constexpr, F16_DOTS: tl.constexpr):
    ROWS: tl.constexpr = BLOCK_Q * G_PAD
    pid = tl.program_id(0)
    seq = pid // n_qblk
    # a sequence's last query blocks see the most keys: started first, they do not trail the others at the end
    qb = n_qblk - 1 - pid % n_qblk
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    if qb * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(lens_ptr + seq)
    ctx = seq_len - q_len

    rows = tl.arange(0, ROWS)
    tq = qb * BLOCK_Q + rows // G_PAD
    hh = rows % G_PAD
    row_ok = (tq < q_len) & (hh < group)
    qpos = ctx + tq
    head = kvh * group + hh
    tok = (q_start + tq).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & dmask[None, :], other=0.0)
    cdt = q.dtype
    if F16_DOTS:
        # FP8 cache (or its fp16 scratch, kv_gather.py) with bf16 queries: the dots run in fp16, into which
        # e4m3 converts in one instruction per pair (bf16 takes a detour through fp32); e4m3 values and the
        # probabilities are exact or finer in fp16, and q has 3 more mantissa bits than in bf16 (it
        # overflows only beyond 65504, far outside normed queries)
        cdt = tl.float16
        q = q.to(cdt)

    kv_end = tl.minimum(seq_len, ctx + qb * BLOCK_Q + BLOCK_Q)
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(kv_end, n_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, kv_end)
    else:
        lo = 0
        hi = kv_end

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    start = lo
    if CAUSAL_SPLIT:
        # tiles whose keys every row of the program may see (below the diagonal of its first query token, inside
        # [lo, hi)) skip the causal and range masks: in a long prefill nearly all tiles are such
        start = lo + tl.maximum(tl.minimum(ctx + qb * BLOCK_Q + 1, hi) - lo, 0) // BLOCK_N * BLOCK_N
        for n0 in range(lo, start, BLOCK_N):
            m_i, l_i, acc = _attn_tile(q, k_ptr, v_ptr, bt_ptr, seq, n0, hi, qpos, row_ok, m_i, l_i, acc, qk_scale,
                                       kvh, head_dim, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                                       stride_vh, stride_bt, BLOCK_N, BLOCK_D, PAGE, KV_FP8, FP8_NATIVE, DOT_PREC,
                                       False, EVEN_D)
    for n0 in range(start, hi, BLOCK_N):
        m_i, l_i, acc = _attn_tile(q, k_ptr, v_ptr, bt_ptr, seq, n0, hi, qpos, row_ok, m_i, l_i, acc, qk_scale,
                                   kvh, head_dim, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                   stride_bt, BLOCK_N, BLOCK_D, PAGE, KV_FP8, FP8_NATIVE, DOT_PREC, True, EVEN_D)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc * (v_scale / l_safe)[:, None]
    omask = row_ok[:, None] & dmask[None, :]
    if SPLIT:
        tl.store(po_ptr + tok[:, None] * stride_pt + head[:, None] * stride_ph + split * stride_ps + d[None, :],
                 o, mask=omask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(plse_ptr + (tok * n_heads + head) * n_splits + split, lse, mask=row_ok)
    else:
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit(do_not_specialize=["n_splits"])
def _merge_splits_kernel(po_ptr, plse_ptr, out_ptr, n_heads, n_splits, head_dim, stride_pt, stride_ph,
                         stride_ps, stride_ot, stride_oh, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < n_splits
    lse = tl.load(plse_ptr + (tok * n_heads + head) * n_splits + s, mask=smask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    w = w / tl.maximum(tl.sum(w, axis=0), 1e-30)
    o = tl.load(po_ptr + tok * stride_pt + head * stride_ph + s[:, None] * stride_ps + d[None, :],
                mask=smask[:, None] & (d[None, :] < head_dim), other=0.0)
    res = tl.sum(o * w[:, None], axis=0)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + d, res.to(out_ptr.dtype.element_ty),
             mask=d < head_dim)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
           seq_lens: torch.Tensor, block_table: torch.Tensor) -> None:
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"paged_attention: q must be [T, Hq, D] with a contiguous head dim, got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"paged_attention: caches {tuple(k_cache.shape)} for q {tuple(q.shape)}")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or k_cache.dtype != v_cache.dtype:
        raise ValueError("paged_attention: caches must share a dtype and have a contiguous head dim")
    page = k_cache.shape[1]
    if page & (page - 1):
        raise ValueError(f"paged_attention: block size {page} is not a power of two")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"paged_attention: {q.shape[1]} query heads for {k_cache.shape[2]} KV heads")
    if k_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise ValueError(f"paged_attention: cache dtype {k_cache.dtype} with {q.dtype} queries")
    b = seq_lens.shape[0]
    if cu_seqlens_q.shape != (b + 1,) or block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError("paged_attention: cu_seqlens_q [B+1], seq_lens [B], block_table [B, n] expected")
    if cu_seqlens_q.dtype != torch.int32 or seq_lens.dtype != torch.int32 or block_table.dtype != torch.int32:
        raise ValueError("paged_attention: cu_seqlens_q, seq_lens and block_table must be int32")
    if block_table.stride(1) != 1:
        raise ValueError("paged_attention: block_table rows must be contiguous")
    devs = {x.device for x in (q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table)}
    if len(devs) != 1:
        raise ValueError("paged_attention: tensors on different devices")


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def tuning_config(device: torch.device | str, head_dim: int, group: int, max_query_len: int) -> dict:
    """The tuning table's launch configuration for a step whose longest query is max_query_len tokens (a fresh
    dict: the verify step's fields are not folded in yet)."""
    return lookup("paged_attention", device, {"head_dim": head_dim, "decode": max_query_len == 1, "group": group,
                                              "query_len": max_query_len})


def num_decode_splits(device: torch.device, num_seqs: int, num_kv_heads: int, max_seq_len: int,
                      min_chunk: int, max_splits: int, q_blocks: int = 1) -> int:
    """Split-KV factor for a decode or verify step of `num_seqs * q_blocks * num_kv_heads` programs per
    split: enough programs to fill the GPU twice over, each split still covering at least `min_chunk` keys
    of the longest context. Host ints only, so that a captured step's grid is fixed."""
    want = cdiv(2 * sm_count(device), max(1, num_seqs * q_blocks * num_kv_heads))
    return int(max(1, min(want, cdiv(max(1, max_seq_len), min_chunk), max_splits)))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float, k_scale: float = 1.0,
                    v_scale: float = 1.0, max_query_len: int = 0, max_seq_len: int = 0) -> torch.Tensor:
    """Triton `paged_attention_ref`. max_query_len / max_seq_len are host ints (0 = unknown: computed
    with a device sync); decode is max_query_len == 1, up to SPLIT_MAX_QUERY_LEN the KV range may be split.
    The launch grid depends on these two ints, the shapes and the device alone, so a CUDA graph captured
    with max_seq_len = the model's longest context serves every shorter one."""
    return paged_attention_launch(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale, k_scale,
                                  v_scale, max_query_len, max_seq_len)


def paged_attention_launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                           scale: float, k_scale: float = 1.0, v_scale: float = 1.0, max_query_len: int = 0,
                           max_seq_len: int = 0, *, num_splits: int | None = None,
                           config: dict | None = None) -> torch.Tensor:
    """`paged_attention` with the split count (any query length) and tuning fields overridable (tests,
    benchmarks); a verify step's tile is the `verify_*` (`verify_fp8_*`) fields, so override those there.

    q: [T, Hq, D]; caches: [num_blocks, block_size, Hk, D]; cu_seqlens_q: int32 [B+1]; seq_lens: int32 [B];
    block_table: int32 [B, max_blocks]. Returns [T, Hq, D] in q's dtype.
    """
    _check(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table)
    t, hq, hd = q.shape
    b = seq_lens.shape[0]
    hk = k_cache.shape[2]
    group = hq // hk
    out = torch.empty_like(q)
    if t == 0 or b == 0:
        return out
    if max_query_len <= 0:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_seq_len <= 0:
        max_seq_len = int(seq_lens.max())
    split_kv = max_query_len <= SPLIT_MAX_QUERY_LEN
    g_pad = next_pow2(group)
    block_d = next_pow2(hd)
    cfg = tuning_config(q.device, hd, group, max_query_len)
    cfg.update(config or {})
    kv_fp8 = k_cache.dtype == torch.float8_e4m3fn
    if split_kv and max_query_len > 1:
        prefix = "verify_fp8_" if kv_fp8 else "verify_"
        cfg.update({f: cfg[prefix + f] for f in _VERIFY_FIELDS})
    block_q = max(1, cfg["rows"] // g_pad)
    if split_kv:
        # no padding tokens beyond the longest query (decode: one token, its group padded to 16 rows)
        block_q = min(block_q, next_pow2(max_query_len))
    g_pad = max(g_pad, cdiv(16, block_q))
    n_qblk = cdiv(max_query_len, block_q)
    if num_splits:
        splits = num_splits
    elif split_kv:
        splits = num_decode_splits(q.device, b, hk, max_seq_len, cfg["min_chunk"], cfg["max_splits"], n_qblk)
    else:
        splits = 1
    native = fp8_native(q.device)
    f16_dots = q.dtype == torch.bfloat16 and kv_fp8 and native
    # not while a CUDA graph captures: its scratch would stay allocated in the graph's memory pool; not for short
    # contexts, where the extra launch and the scratch's round trip cost more than the conversions they save
    gather = cfg["fp8_gather"] and max_seq_len >= cfg["fp8_gather_min_seq_len"]
    if kv_fp8 and not split_kv and gather and not _capturing(q):
        dt = torch.float16 if f16_dots else q.dtype
        fits = block_table.shape[1] * k_cache.shape[1] >= max_seq_len  # an inflated max_seq_len: no gather
        if fits and scratch_bytes(b, max_seq_len, k_cache, dt) <= GATHER_MAX_BYTES:
            k_cache, v_cache, block_table = gather_kv_pages(k_cache, v_cache, block_table, seq_lens, max_seq_len, dt)
            kv_fp8 = False
    kc = k_cache.view(torch.uint8) if kv_fp8 and not native else k_cache
    vc = v_cache.view(torch.uint8) if kv_fp8 and not native else v_cache
    if splits > 1:
        po = torch.empty((t, hq, splits, hd), dtype=torch.float32, device=q.device)
        plse = torch.empty((t, hq, splits), dtype=torch.float32, device=q.device)
    else:
        po, plse = out, out
    _paged_attn_kernel[(b * n_qblk, hk, splits)](
        q, kc, vc, out, po, plse, cu_seqlens_q, seq_lens, block_table,
        float(scale) * float(k_scale) * LOG2E, float(v_scale), group, hq, hd, n_qblk, splits,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1),
        vc.stride(2), out.stride(0), out.stride(1), po.stride(0) if splits > 1 else 0,
        po.stride(1) if splits > 1 else 0, po.stride(2) if splits > 1 else 0, block_table.stride(0),
        BLOCK_Q=block_q, G_PAD=g_pad, BLOCK_N=cfg["block_n"], BLOCK_D=block_d, PAGE=k_cache.shape[1],
        KV_FP8=kv_fp8, FP8_NATIVE=native, SPLIT=splits > 1, DOT_PREC=dot_precision(q.dtype), EVEN_D=block_d == hd,
        CAUSAL_SPLIT=bool(cfg.get("causal_split", True)), F16_DOTS=f16_dots,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if splits > 1:
        _merge_splits_kernel[(t, hq)](
            po, plse, out, hq, splits, hd, po.stride(0), po.stride(1), po.stride(2), out.stride(0),
            out.stride(1), BLOCK_S=next_pow2(splits), BLOCK_D=block_d, num_warps=4)
    return out
