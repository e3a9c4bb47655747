"""Top-k softmax routing (Triton); the contract and the torch reference are `moe.route_ref`."""

from __future__ import annotations

import torch

from nibble.kernels._triton import next_pow2, tl, triton
from nibble.kernels.pdl import pdl_handoff, pdl_launch, pdl_supported
from nibble.kernels.tuning_tables import lookup


@triton.jit(do_not_specialize=["n_tok"])
def _route_kernel(logits_ptr, w_ptr, ids_ptr, valid_ptr, n_tok, n_exp, stride_l, TOP_K: tl.constexpr,
                  RENORM: tl.constexpr, K_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
                  HAS_VALID: tl.constexpr, PDL: tl.constexpr = False):
    """PDL: launched with PDL behind the router's projection, and the MoE's first kernel may start early (it
    waits before reading the ids)."""
    pdl_handoff(PDL, PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    e = tl.arange(0, BLOCK_E)
    rmask = rows < n_tok
    x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_l + e[None, :],
                mask=rmask[:, None] & (e[None, :] < n_exp), other=0.0).to(tl.float32)
    x = tl.where(e[None, :] < n_exp, x, float("-inf"))
    m = tl.max(x, axis=1)
    p = tl.exp(x - m[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    kk = tl.arange(0, K_PAD)
    top_w = tl.zeros([ROWS, K_PAD], tl.float32)
    top_i = tl.zeros([ROWS, K_PAD], tl.int32)
    # k rounds of arg-max; ties go to the lowest expert id
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=1)
        idx = tl.min(tl.where(p == best[:, None], e[None, :], BLOCK_E), axis=1)
        # A row with NaN/Inf logits matches no expert; clamping keeps its ids in range (its weights stay NaN
        # and only its own output is poisoned) instead of sending the MoE kernels past the last expert.
        idx = tl.minimum(idx, n_exp - 1)
        top_w = tl.where(kk[None, :] == j, best[:, None], top_w)
        top_i = tl.where(kk[None, :] == j, idx[:, None], top_i)
        p = tl.where(e[None, :] == idx[:, None], -1.0, p)
    if RENORM:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]
    if HAS_VALID:
        live = rows < tl.load(valid_ptr)
        top_w = tl.where(live[:, None], top_w, 0.0)
        top_i = tl.where(live[:, None], top_i, -1)
    offs = rows[:, None] * TOP_K + kk[None, :]
    omask = rmask[:, None] & (kk[None, :] < TOP_K)
    tl.store(w_ptr + offs, top_w, mask=omask)
    tl.store(ids_ptr + offs, top_i, mask=omask)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool = True,
          num_valid_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `route_ref`: router_logits [T, E] -> (weights fp32 [T, k], ids int32 [T, k]), sorted by
    weight, descending; rows from num_valid_tokens (int32 [1] on the logits' device) on get ids -1."""
    if router_logits.dim() != 2 or router_logits.stride(1) != 1:
        raise ValueError(f"route: logits must be [T, E] with contiguous experts, got {tuple(router_logits.shape)}")
    if num_valid_tokens is not None and (num_valid_tokens.dtype != torch.int32 or num_valid_tokens.numel() != 1
                                         or num_valid_tokens.device != router_logits.device):
        raise ValueError(f"route: num_valid_tokens must be one int32 on {router_logits.device}, got "
                         f"{num_valid_tokens.dtype} {tuple(num_valid_tokens.shape)} on {num_valid_tokens.device}")
    t, e = router_logits.shape
    if not 0 < top_k <= e:
        raise ValueError(f"route: top_k {top_k} not in 1..{e}")
    weights = torch.empty((t, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=router_logits.device)
    if t:
        block_e = next_pow2(e)
        # One token per program and a single warp: the k rounds of arg-max are then warp shuffles. Spreading
        # a row over 4 warps cost two block-wide barriers per round, 16 us per decode step's route on an
        # H200 (12% of a 122B-A10B batch-1 step).
        # tuning field `pdl` (sm_90+): start early behind the projection ahead and let the MoE's first kernel do so
        pdl = pdl_supported(router_logits.device) and bool(
            lookup("route", router_logits.device, {"tokens": t, "experts": e}).get("pdl", False))
        _route_kernel[(t,)](
            router_logits, weights, ids, ids if num_valid_tokens is None else num_valid_tokens, t, e,
            router_logits.stride(0), TOP_K=top_k, RENORM=renormalize, K_PAD=next_pow2(top_k), ROWS=1,
            BLOCK_E=block_e, HAS_VALID=num_valid_tokens is not None, num_warps=1 if block_e <= 512 else 4,
            **pdl_launch(pdl, "PDL"))
    return weights, ids
