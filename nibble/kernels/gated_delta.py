"""Gated delta rule (the recurrence of Gated DeltaNet) over a varlen batch, with states kept in a slot
pool and updated in place."""

from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, ssm_state: torch.Tensor, cu_seqlens: torch.Tensor,
                         state_slots: torch.Tensor) -> torch.Tensor:
    """q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g: fp32 [T, Hv] (log decay, <= 0); beta: [T, Hv];
    ssm_state: fp32 [num_slots, Hv, Dk, Dv]; cu_seqlens: int32 [B+1]; state_slots: int32 [B].

    q and k are L2-normalised and q scaled by Dk^-0.5; each k head serves Hv/Hk consecutive v heads.
    Per token: S = S*exp(g); S += k (beta (v - S^T k))^T; o = S^T q. Returns o [T, Hv, Dv] in v's dtype.
    """
    num_v_heads = v.shape[1]
    rep = num_v_heads // k.shape[1]
    qf = l2norm(q.float()).repeat_interleave(rep, dim=1) * (q.shape[-1] ** -0.5)
    kf = l2norm(k.float()).repeat_interleave(rep, dim=1)
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    cu = cu_seqlens.tolist()
    for i, slot in enumerate(state_slots.tolist()):
        state = ssm_state[slot].float()
        for t in range(cu[i], cu[i + 1]):
            state = state * gf[t].exp()[:, None, None]
            kv_mem = torch.einsum("hkv,hk->hv", state, kf[t])
            delta = (vf[t] - kv_mem) * bf[t][:, None]
            state = state + kf[t][:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", state, qf[t])
        ssm_state[slot] = state.to(ssm_state.dtype)
    return out.to(v.dtype)
