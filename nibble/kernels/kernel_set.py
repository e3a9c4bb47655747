"""The kernels one model instance calls, one callable per op, chosen once at engine start.

Every field has the signature of the torch reference named in its comment; `KernelSet.reference()` is the
plain-PyTorch set that runs anywhere (CPU included). The backend registry builds other sets after each
candidate passed its self-test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nibble.kernels.activation import moe_combine_ref, sigmoid_mul_ref, silu_and_mul_ref
from nibble.kernels.attention import paged_attention_ref, store_kv_ref
from nibble.kernels.conv1d import causal_conv1d_ref, causal_conv1d_spec_ref
from nibble.kernels.dense_gemv import dense_linear_ref
from nibble.kernels.gated_delta import gated_delta_rule_decode_ref, gated_delta_rule_ref, gated_delta_rule_spec_ref
from nibble.kernels.gdn_gating import gdn_gating_ref
from nibble.kernels.moe import fused_moe_ref, route_ref
from nibble.kernels.norm import gated_rms_norm_ref, qk_rms_norm_ref, rms_norm_moe_ref, rms_norm_ref
from nibble.kernels.nvfp4_linear import nvfp4_linear_ref
from nibble.kernels.rope import rope_ref

OP_NAMES = ("rms_norm", "rms_norm_moe", "qk_rms_norm", "gated_rms_norm", "rope", "store_kv", "paged_attention",
            "sigmoid_mul", "causal_conv1d", "causal_conv1d_spec", "gdn_gating", "gated_delta_rule",
            "gated_delta_rule_decode", "gated_delta_rule_spec", "route", "fused_moe", "silu_and_mul", "moe_combine",
            "nvfp4_linear", "dense_linear")


@dataclass(frozen=True)
class KernelSet:
    rms_norm: Callable[..., Any]            # norm.rms_norm_ref
    rms_norm_moe: Callable[..., Any]        # norm.rms_norm_moe_ref
    qk_rms_norm: Callable[..., Any]         # norm.qk_rms_norm_ref
    gated_rms_norm: Callable[..., Any]      # norm.gated_rms_norm_ref
    rope: Callable[..., Any]                # rope.rope_ref
    store_kv: Callable[..., Any]            # attention.store_kv_ref
    paged_attention: Callable[..., Any]     # attention.paged_attention_ref
    sigmoid_mul: Callable[..., Any]         # activation.sigmoid_mul_ref
    causal_conv1d: Callable[..., Any]       # conv1d.causal_conv1d_ref
    causal_conv1d_spec: Callable[..., Any]  # conv1d.causal_conv1d_spec_ref
    gdn_gating: Callable[..., Any]          # gdn_gating.gdn_gating_ref
    gated_delta_rule: Callable[..., Any]    # gated_delta.gated_delta_rule_ref
    gated_delta_rule_decode: Callable[..., Any]  # gated_delta.gated_delta_rule_decode_ref
    gated_delta_rule_spec: Callable[..., Any]    # gated_delta.gated_delta_rule_spec_ref
    route: Callable[..., Any]               # moe.route_ref
    fused_moe: Callable[..., Any]           # moe.fused_moe_ref
    silu_and_mul: Callable[..., Any]        # activation.silu_and_mul_ref
    moe_combine: Callable[..., Any]         # activation.moe_combine_ref
    nvfp4_linear: Callable[..., Any]        # nvfp4_linear.nvfp4_linear_ref
    dense_linear: Callable[..., Any]        # dense_gemv.dense_linear_ref
    backend_names: dict[str, str] = field(default_factory=dict, compare=False)

    @classmethod
    def reference(cls) -> KernelSet:
        return cls(
            rms_norm=rms_norm_ref,
            rms_norm_moe=rms_norm_moe_ref,
            qk_rms_norm=qk_rms_norm_ref,
            gated_rms_norm=gated_rms_norm_ref,
            rope=rope_ref,
            store_kv=store_kv_ref,
            paged_attention=paged_attention_ref,
            sigmoid_mul=sigmoid_mul_ref,
            causal_conv1d=causal_conv1d_ref,
            causal_conv1d_spec=causal_conv1d_spec_ref,
            gdn_gating=gdn_gating_ref,
            gated_delta_rule=gated_delta_rule_ref,
            gated_delta_rule_decode=gated_delta_rule_decode_ref,
            gated_delta_rule_spec=gated_delta_rule_spec_ref,
            route=route_ref,
            fused_moe=fused_moe_ref,
            silu_and_mul=silu_and_mul_ref,
            moe_combine=moe_combine_ref,
            nvfp4_linear=nvfp4_linear_ref,
            dense_linear=dense_linear_ref,
            backend_names={op: "torch" for op in OP_NAMES},
        )
