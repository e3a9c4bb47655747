"""The first-generation MoE experts path (`fused_moe`'s `generic_*` paths, and every call with 16/32-bit
expert weights): a per-pair GEMV (moe_gemv.py) for small batches, a grouped GEMM over expert-sorted blocks
(moe_gemm.py) for larger ones, FP4 weights decoded by table; then the top-k sum in a fixed order."""

from __future__ import annotations

from typing import Any

import torch

from nibble.kernels._triton import cdiv, dot_precision, triton
from nibble.kernels.moe_align import moe_align
from nibble.kernels.moe_gemm import moe_down_kernel, moe_gate_up_kernel, moe_reduce_kernel
from nibble.kernels.moe_gemv import moe_down_gemv_kernel, moe_down_pair_gemv_kernel, moe_gate_up_gemv_kernel


def generic_experts(x: torch.Tensor, tw: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, e: int, inter: int,
                    top_k: int, fp4: bool, w13: tuple, w2: tuple, path: str, cfg: dict[str, Any]) -> None:
    """Dense (or, on request, NVFP4) experts through the per-pair GEMV / grouped GEMM kernels, for
    `fused_moe_launch` (which checked the arguments): x [T, H], tw fp32 [T, k], ids int32 [T, k] -> out [T, H];
    w13 / w2: (values, block scales, global scales, strides) of `fused_moe._weight_args`; path 'gemv' or
    'sorted'; cfg: the `fused_moe_dense` tuning fields."""
    t, h = x.shape
    q13, s13, g13, st13 = w13
    q2, s2, g2, st2 = w2
    prec = dot_precision(x.dtype)
    if path == "gemv":
        act = torch.empty((t * top_k, inter), dtype=x.dtype, device=x.device)
        bn, bk = cfg["gemv_gu_block_n"], min(cfg["gemv_gu_block_k"], triton.next_power_of_2(h))
        moe_gate_up_gemv_kernel[(t * top_k, cdiv(inter, bn))](
            x, q13, s13, g13, act, ids, top_k, h, inter, x.stride(0), *st13, act.stride(0), W_FP4=fp4,
            BLOCK_N=bn, BLOCK_K=bk, num_warps=cfg["gemv_warps"])
        bn, bk = cfg["gemv_dn_block_n"], min(cfg["gemv_dn_block_k"], triton.next_power_of_2(inter))
        if not cfg["gemv_dn_pairs"]:
            moe_down_gemv_kernel[(t, cdiv(h, bn))](
                act, q2, s2, g2, out, ids, tw, h, inter, act.stride(0), *st2, out.stride(0), TOP_K=top_k,
                W_FP4=fp4, BLOCK_N=bn, BLOCK_K=bk, num_warps=cfg["gemv_warps"])
            return
        y = torch.empty((t * top_k, h), dtype=torch.float32, device=x.device)
        moe_down_pair_gemv_kernel[(t * top_k, cdiv(h, bn))](
            act, q2, s2, g2, y, ids, tw, h, inter, act.stride(0), *st2, y.stride(0), W_FP4=fp4, BLOCK_N=bn,
            BLOCK_K=bk, num_warps=cfg["gemv_warps"])
        moe_reduce_kernel[(t, cdiv(h, 1024))](y, out, ids, h, y.stride(0), out.stride(0), TOP_K=top_k, BLOCK=1024,
                                              num_warps=4)
        return
    bm = cfg["block_m"]
    chunk = max(1, min(t, cfg["chunk_pairs"] // top_k))
    act = torch.empty((chunk * top_k, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((chunk * top_k, h), dtype=x.dtype, device=x.device)
    for c0 in range(0, t, chunk):
        c1 = min(t, c0 + chunk)
        ids_c = ids[c0:c1]
        al = moe_align(ids_c, e, bm)
        grid_m = al.max_blocks
        bn = cfg["gu_block_n"]
        moe_gate_up_kernel[(grid_m, cdiv(inter, bn))](
            x[c0:c1], q13, s13, g13, act, al.sorted_ids, al.block_expert, al.expert_start, al.expert_count,
            top_k, h, inter, x.stride(0), *st13, act.stride(0), W_FP4=fp4, BLOCK_M=bm, BLOCK_N=bn,
            BLOCK_K=cfg["gu_block_k"], DOT_PREC=prec, num_warps=cfg["gu_warps"], num_stages=cfg["gu_stages"])
        bn = cfg["dn_block_n"]
        moe_down_kernel[(grid_m, cdiv(h, bn))](
            act, q2, s2, g2, y, tw[c0:c1], al.sorted_ids, al.block_expert, al.expert_start, al.expert_count,
            h, inter, act.stride(0), *st2, y.stride(0), W_FP4=fp4, BLOCK_M=bm, BLOCK_N=bn,
            BLOCK_K=cfg["dn_block_k"], DOT_PREC=prec, num_warps=cfg["dn_warps"], num_stages=cfg["dn_stages"])
        block = 1024
        moe_reduce_kernel[(c1 - c0, cdiv(h, block))](
            y, out[c0:c1], ids_c, h, y.stride(0), out.stride(0), TOP_K=top_k, BLOCK=block, num_warps=4)
