"""Depthwise causal conv1d with SiLU for Gated DeltaNet, continuing each sequence from its conv state."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                      cu_seqlens: torch.Tensor, state_slots: torch.Tensor) -> torch.Tensor:
    """x: [T, C]; weight: [C, W]; conv_state: [num_slots, W-1, C] (previous inputs, oldest first);
    cu_seqlens: int32 [B+1]; state_slots: int32 [B].

    out[t] = silu(sum_j window[t + j] * weight[:, j]) over the window [state, x]; the state of each
    sequence is replaced by its last W-1 inputs. Returns [T, C] in x's dtype.
    """
    width = weight.shape[1]
    out = torch.empty_like(x)
    cu = cu_seqlens.tolist()
    for i, slot in enumerate(state_slots.tolist()):
        start, end = cu[i], cu[i + 1]
        if end == start:
            continue
        window = torch.cat((conv_state[slot].to(x.dtype), x[start:end]), dim=0)
        y = F.conv1d(window.t().unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])
        out[start:end] = F.silu(y[0].t()).to(x.dtype)
        conv_state[slot] = window[-(width - 1):].to(conv_state.dtype)
    return out
