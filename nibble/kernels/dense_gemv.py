"""Dense (16/32-bit weight) linear for decode-sized batches: streaming GEMV kernels.

At a few tokens a BF16 projection is a pure weight read: y = x W^T with W [N, K] read once, a handful of
FMAs per weight element. cuBLAS covers the large ones near copy bandwidth, but on the Qwen3.5 decode shapes
with a long K and a short N (out_proj / o_proj 8192 -> 3072, the fused MoE input projection 3072 -> 2312)
it picks split-K GEMMs plus a reduce launch, which the batch-1 profile of the 122B-A10B puts at about 2.5
TB/s (docs/benchmarks.md). Here a program owns BLOCK_N whole weight rows and walks K in a software-pipelined
loop (`tl.range(num_stages=...)` turns the plain loads into asynchronous copies): no split-K, no second
launch. Two kernels:
- "gemv" (CUDA cores, up to 8 tokens): fp32 partial sums per thread [tokens, rows, K slice], reduced once
  at the end, no shuffles in the loop; few rows per program (2-16), so that even N = 2048 gives every SM a
  few programs. The partial sums grow with the tokens.
- "dot" (tensor cores, up to 16 tokens): the weights are the MMA's M side (16+ rows per program), the
  tokens its N side padded to 16, the sums in the MMA's accumulators.

`dense_linear` picks per shape (tuning table `dense_linear`, key tokens / n / k) between these and torch's
`F.linear` (path "gemv", "dot" or "torch"); default.json keeps torch everywhere, device tables turn the
kernels on where they measured faster. On sm_90+ both launch with PDL: the RMSNorm and gate kernels that
precede every projection of a layer let them start early (norm.py, activation.py), and a program asks for
the first bytes of its weight rows in L2 before it waits for x (`_pdl_start`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from nibble.kernels._triton import as_rows, cdiv, dot_precision, next_pow2, tl, triton
from nibble.kernels.pdl import gdc_wait, pdl_supported, prefetch_l2, prefetch_ok
from nibble.kernels.tuning_tables import lookup

MAX_TOKENS = 16  # the tensor-core kernel's limit
GEMV_MAX_TOKENS = 8  # the CUDA-core kernel's: its partial sums grow with the tokens


def dense_linear_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: [T, K]; w: [N, K] in x's dtype -> [T, N] (torch: cuBLAS on the GPU)."""
    return F.linear(x, w)


@triton.jit
def _pdl_start(w_ptr, n_out, stride_wn, pf_bytes, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
               PREFETCH: tl.constexpr):
    """Launched with PDL (while the norm or gate kernel ahead still runs): ask for the first pf_bytes of each of
    this program's weight rows in L2 (PREFETCH), then wait for the kernel ahead, which writes x and may still
    read memory that this kernel's output reuses. Without PDL: nothing."""
    if PDL:
        if PREFETCH:
            for r in tl.static_range(BLOCK_N):
                row = tl.minimum(tl.program_id(0) * BLOCK_N + r, n_out - 1).to(tl.int64)
                prefetch_l2(w_ptr + row * stride_wn, pf_bytes)
        gdc_wait()


@triton.jit(do_not_specialize=["n_tok"])
def _dense_gemv_kernel(x_ptr, w_ptr, out_ptr, n_tok, n_out, n_k, stride_xt, stride_wn, stride_ot, pf_bytes,
                       BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                       STAGES: tl.constexpr, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False):
    """out[t, n] = x[t] . w[n] for t < n_tok (<= BLOCK_T) and the BLOCK_N rows of this program, fp32 sums."""
    _pdl_start(w_ptr, n_out, stride_wn, pf_bytes, BLOCK_N, PDL, PREFETCH)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nc = tl.minimum(n, n_out - 1).to(tl.int64)  # clamped rows: loaded, not stored
    t = tl.arange(0, BLOCK_T)
    tc = tl.minimum(t, n_tok - 1).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + nc[None, :, None] * stride_wn + kk[None, None, :]
    x_rows = x_ptr + tc[:, None, None] * stride_xt + kk[None, None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.range(0, n_k, BLOCK_K, num_stages=STAGES):
        if EVEN_K:
            w = tl.load(w_rows + k0)
            x = tl.load(x_rows + k0)
        else:
            km = (k0 + kk < n_k)[None, None, :]
            w = tl.load(w_rows + k0, mask=km, other=0.0)
            x = tl.load(x_rows + k0, mask=km, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)
    y = tl.sum(acc, axis=2)
    tl.store(out_ptr + t[:, None].to(tl.int64) * stride_ot + n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=(t < n_tok)[:, None] & (n < n_out)[None, :])


@triton.jit(do_not_specialize=["n_tok"])
def _dense_dot_kernel(x_ptr, w_ptr, out_ptr, n_tok, n_out, n_k, stride_xt, stride_wn, stride_ot, pf_bytes,
                      BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                      STAGES: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr = False,
                      PREFETCH: tl.constexpr = False):
    """The same product on the tensor cores for 5-16 tokens: acc[rows, tokens] = W_tile @ x_tile^T (weights
    the MMA's M side, the tokens padded to BLOCK_T >= 16 columns), so the partial sums stay in the MMA's
    accumulators instead of growing with the tokens."""
    _pdl_start(w_ptr, n_out, stride_wn, pf_bytes, BLOCK_N, PDL, PREFETCH)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nc = tl.minimum(n, n_out - 1).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    tm = (t < n_tok)[None, :]  # padding columns are zero-filled, not read: every program reads all of x
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + nc[:, None] * stride_wn + kk[None, :]
    x_cols = x_ptr + t[None, :].to(tl.int64) * stride_xt + kk[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    for k0 in tl.range(0, n_k, BLOCK_K, num_stages=STAGES):
        if EVEN_K:
            w = tl.load(w_rows + k0)
            x = tl.load(x_cols + k0, mask=tm, other=0.0)
        else:
            w = tl.load(w_rows + k0, mask=(k0 + kk < n_k)[None, :], other=0.0)
            x = tl.load(x_cols + k0, mask=(k0 + kk < n_k)[:, None] & tm, other=0.0)
        acc = tl.dot(w, x, acc, input_precision=DOT_PREC)
    tl.store(out_ptr + t[None, :].to(tl.int64) * stride_ot + n[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=(n < n_out)[:, None] & (t < n_tok)[None, :])


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dim() < 1 or w.dim() != 2:
        raise ValueError(f"dense_linear: x must be [..., K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"dense_linear: K differs: x {tuple(x.shape)}, w {tuple(w.shape)}")
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dense_linear: x and w must share a 16/32-bit float dtype, got {x.dtype} and {w.dtype}")
    if x.device != w.device:
        raise ValueError(f"dense_linear: x on {x.device}, w on {w.device}")


@functools.lru_cache(maxsize=256)
def _table_config(device: torch.device, t: int, n: int, k: int) -> tuple[tuple[str, Any], ...]:
    # the lookup walks the table on every call; decode steps run eagerly too (--enforce-eager)
    return tuple(sorted(lookup("dense_linear", device, {"tokens": t, "n": n, "k": k}).items()))


def dense_linear_launch(x: torch.Tensor, w: torch.Tensor, *, config: dict[str, Any] | None = None) -> torch.Tensor:
    """`dense_linear` with the tuning table's fields overridable (benchmarks, tests): path ("gemv": the
    CUDA-core kernel, up to 8 tokens; "dot": the tensor-core one; "torch"), block_n, block_k, warps, stages."""
    _check(x, w)
    k = x.shape[-1]
    t = x.numel() // max(1, k)
    n = w.shape[0]
    if t == 0 or n == 0 or t > MAX_TOKENS:
        return F.linear(x, w)
    cfg = dict(_table_config(x.device, t, n, k))
    cfg.update(config or {})
    if cfg["path"] == "torch" or (cfg["path"] == "gemv" and t > GEMV_MAX_TOKENS):
        return F.linear(x, w)
    if cfg["path"] not in ("gemv", "dot"):
        raise ValueError(f"dense_linear: unknown path {cfg['path']!r}")
    lead = x.shape[:-1]
    x = as_rows(x)
    if w.stride(1) != 1:
        w = w.contiguous()
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    bn, bk = cfg["block_n"], min(cfg["block_k"], next_pow2(k))
    pdl, pf_bytes = _pdl_plan(w, cfg)
    args = (x, w, out, t, n, k, x.stride(0), w.stride(0), out.stride(0), pf_bytes)
    launch = {"PDL": True, "PREFETCH": pf_bytes > 0, "launch_pdl": True} if pdl else {}
    if cfg["path"] == "dot":
        # tl.dot takes 16 rows, 16 columns and a K step of 16 at least
        bn, bk = max(bn, 16), max(bk, 16)
        _dense_dot_kernel[(cdiv(n, bn),)](*args, BLOCK_T=max(16, next_pow2(t)), BLOCK_N=bn, BLOCK_K=bk,
                                          EVEN_K=k % bk == 0, STAGES=cfg["stages"],
                                          DOT_PREC=dot_precision(x.dtype), num_warps=cfg["warps"], **launch)
    else:
        _dense_gemv_kernel[(cdiv(n, bn),)](*args, BLOCK_T=next_pow2(t), BLOCK_N=bn, BLOCK_K=bk,
                                           EVEN_K=k % bk == 0, STAGES=cfg["stages"], num_warps=cfg["warps"],
                                           **launch)
    return out.view(*lead, n)


def _pdl_plan(w: torch.Tensor, cfg: dict[str, Any]) -> tuple[bool, int]:
    """(launch with PDL, bytes of each weight row to prefetch into L2 before the wait; 0: none). Tuning
    fields `pdl` (default on where supported) and `prefetch_mib` (the prefetch over all rows)."""
    if not (cfg.get("pdl", True) and pdl_supported(w.device)):
        return False, 0
    n, k = w.shape
    row_bytes = k * w.element_size()
    per_row = min(row_bytes, int(cfg.get("prefetch_mib", 8) * 2**20) // max(1, n)) // 16 * 16
    if per_row < 256 or not prefetch_ok(w) or row_bytes % 16:
        per_row = 0
    return True, per_row


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: [..., K]; w: [N, K] in x's dtype -> [..., N] in x's dtype: the GEMV kernel where the tuning
    table says so for (tokens, N, K), torch's F.linear elsewhere."""
    return dense_linear_launch(x, w)
