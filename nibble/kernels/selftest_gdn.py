"""Self-tests of the Gated DeltaNet (linear attention) ops: the causal conv1d, the g/beta gating and the
gated delta rule, each in the forms the layers call (prefill and decode batches, the fused decode step, and
the speculative-decoding verify step that writes one state snapshot per token).

Separate from the other ops' tests (selftest.py, whose `SELF_TESTS` lists these too) because they share what
no other test needs: recurrent state pools indexed by slot, and the snapshot-slot layout of a verify step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nibble.kernels.conv1d import causal_conv1d_ref, causal_conv1d_spec_ref
from nibble.kernels.gated_delta import (
    RECURRENT_MAX_TOKENS,
    gated_delta_rule_decode_ref,
    gated_delta_rule_ref,
    gated_delta_rule_spec_ref,
)
from nibble.kernels.gdn_gating import gdn_gating_ref
from nibble.kernels.selftest_harness import SelfTestContext, SelfTestFailure, _call, rel_err


def test_causal_conv1d(fn: Callable, ctx: SelfTestContext) -> float:
    c = ctx.config
    ch, width = ctx.linear_conv_dim, c.linear_conv_kernel_dim
    worst = 0.0
    for q_lens in ([1, 1, 1], [1, 40, 2]):
        b, t = len(q_lens), sum(q_lens)
        x = ctx.randn(t, ch)
        w = ctx.randn(ch, width, scale=0.5)
        state = ctx.randn(7, width - 1, ch)
        state_ref = state.clone()
        slots = torch.tensor([5, 0, 3][:b], dtype=torch.int32, device=ctx.device)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=ctx.device)
        out = _call(fn, ctx.device, [((t, ch), ctx.dtype)], x, w, state, cu, slots)
        ref = causal_conv1d_ref(x, w, state_ref, cu, slots)
        worst = max(worst, rel_err("out", out, ref, ctx.tol), rel_err("conv_state", state, state_ref, ctx.tol))
    return worst


# A verify step of 2 sequences of 3 tokens each: starting slots, then one snapshot slot per token. The first
# sequence's first snapshot goes to its own starting slot, which must be read before it is overwritten.
SPEC_STATE_SLOTS = [4, 1]
SPEC_SLOTS = [[4, 6, 0], [2, 7, 8]]
SPEC_POOL = 10


def _spec_pool(ctx: SelfTestContext, *shape: int, dtype: torch.dtype | None = None, scale: float = 1.0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(state pool [SPEC_POOL, *shape] with the snapshot slots that no sequence starts from filled with NaN,
    state_slots int32 [2], spec_slots int32 [2, 3])."""
    pool = ctx.randn(SPEC_POOL, *shape, dtype=dtype, scale=scale)
    poisoned = sorted({s for row in SPEC_SLOTS for s in row} - set(SPEC_STATE_SLOTS))
    pool[poisoned] = float("nan")
    ints = {"dtype": torch.int32, "device": ctx.device}
    return pool, torch.tensor(SPEC_STATE_SLOTS, **ints), torch.tensor(SPEC_SLOTS, **ints)


def _spec_state_err(name: str, pool: torch.Tensor, pool_ref: torch.Tensor, before: torch.Tensor, tol: float
                    ) -> float:
    """The snapshot slots against the reference's; every other slot must be left as it was, bit for bit."""
    written = sorted({s for row in SPEC_SLOTS for s in row})
    others = [i for i in range(SPEC_POOL) if i not in written]
    if not torch.equal(pool[others], before[others]):
        raise SelfTestFailure(f"{name}: wrote outside the snapshot slots")
    return rel_err(f"{name} snapshots", pool[written], pool_ref[written], tol)


def test_causal_conv1d_spec(fn: Callable, ctx: SelfTestContext) -> float:
    c = ctx.config
    ch, width, hv = ctx.linear_conv_dim, c.linear_conv_kernel_dim, ctx.linear_heads[1]
    state, slots, spec = _spec_pool(ctx, width - 1, ch)
    t = spec.numel()
    # x as the model sees it: the first columns of the fused in_proj output
    x = ctx.randn(t, ch + hv * c.linear_value_head_dim + 2 * hv)[:, :ch]
    w = ctx.randn(ch, width, scale=0.5)
    before, state_ref = state.clone(), state.clone()
    out = _call(fn, ctx.device, [((t, ch), ctx.dtype)], x, w, state, slots, spec)
    ref = causal_conv1d_spec_ref(x, w, state_ref, slots, spec)
    return max(rel_err("out", out, ref, ctx.tol), _spec_state_err("conv_state", state, state_ref, before, ctx.tol))


def test_gdn_gating(fn: Callable, ctx: SelfTestContext) -> float:
    c = ctx.config
    hv = ctx.linear_heads[1]
    width = ctx.linear_conv_dim + hv * c.linear_value_head_dim + 2 * hv
    neg_a = -(ctx.rand(hv) * 15.0 + 1.0)
    dt_bias = ctx.randn(hv, dtype=torch.float32)
    worst = 0.0
    for t in (1, 37):
        # a and b as the model sees them: the last columns of the fused in_proj output (b then a); the
        # scale reaches past softplus's threshold of 20 and far into its exponential tail
        proj = ctx.randn(t, width, scale=12.0)
        b, a = proj[:, width - 2 * hv:width - hv], proj[:, width - hv:]
        g, beta = _call(fn, ctx.device, [((t, hv), torch.float32), ((t, hv), ctx.dtype)], a, b, neg_a, dt_bias)
        g_ref, beta_ref = gdn_gating_ref(a, b, neg_a, dt_bias)
        worst = max(worst, rel_err(f"g T={t}", g, g_ref, ctx.tol), rel_err(f"beta T={t}", beta, beta_ref, ctx.tol))
    return worst


def test_gated_delta_rule(fn: Callable, ctx: SelfTestContext) -> float:
    c = ctx.config
    (hk, hv), dk, dv = ctx.linear_heads, c.linear_key_head_dim, c.linear_value_head_dim
    worst = 0.0
    # on the GPU also a batch past RECURRENT_MAX_TOKENS, which the fla backend runs through fla's own kernel
    longer = ([1, 45, RECURRENT_MAX_TOKENS],) if ctx.device.type == "cuda" else ()
    for q_lens in ([1, 1, 1], [1, 45, 20], *longer):
        b, t = len(q_lens), sum(q_lens)
        q, k, v = ctx.randn(t, hk, dk), ctx.randn(t, hk, dk), ctx.randn(t, hv, dv)
        g = -0.5 * ctx.rand(t, hv)
        beta = ctx.rand(t, hv).to(ctx.dtype)
        state = ctx.randn(6, hv, dk, dv, dtype=torch.float32, scale=0.1)
        state_ref = state.clone()
        slots = torch.tensor([4, 1, 2][:b], dtype=torch.int32, device=ctx.device)
        offsets = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
        cu = torch.tensor(offsets, dtype=torch.int32, device=ctx.device)
        ref = gated_delta_rule_ref(q, k, v, g, beta, state_ref, cu, slots)
        # both ways the layers call it: with the host copy of the offsets (the engine's batches) and without
        for host in (None, offsets):
            st = state.clone()
            out = _call(fn, ctx.device, [((t, hv, dv), ctx.dtype)], q, k, v, g, beta, st, cu, slots,
                        cu_seqlens_cpu=host)
            worst = max(worst, rel_err("out", out, ref, ctx.tol), rel_err("ssm_state", st, state_ref, ctx.tol))
    return worst


def test_gated_delta_rule_decode(fn: Callable, ctx: SelfTestContext) -> float:
    c = ctx.config
    (hk, hv), dk, dv = ctx.linear_heads, c.linear_key_head_dim, c.linear_value_head_dim
    b = 3
    q, k, v = ctx.randn(b, hk, dk), ctx.randn(b, hk, dk), ctx.randn(b, hv, dv)
    # a and b as the model sees them: strided columns of the fused in_proj output
    proj = ctx.randn(b, 2 * hv + 5, scale=4.0)
    bb, a = proj[:, :hv], proj[:, hv:2 * hv]
    neg_a = -(ctx.rand(hv) * 15.0 + 1.0)
    dt_bias = ctx.randn(hv, dtype=torch.float32)
    state = ctx.randn(6, hv, dk, dv, dtype=torch.float32, scale=0.1)
    state_ref = state.clone()
    slots = torch.tensor([4, 1, 2], dtype=torch.int32, device=ctx.device)
    ref = gated_delta_rule_decode_ref(q, k, v, a, bb, neg_a, dt_bias, state_ref, slots)
    out = _call(fn, ctx.device, [((b, hv, dv), ctx.dtype)], q, k, v, a, bb, neg_a, dt_bias, state, slots)
    return max(rel_err("out", out, ref, ctx.tol), rel_err("ssm_state", state, state_ref, ctx.tol))


def test_gated_delta_rule_spec(fn: Callable, ctx: SelfTestContext) -> float:
    c = ctx.config
    (hk, hv), dk, dv = ctx.linear_heads, c.linear_key_head_dim, c.linear_value_head_dim
    state, slots, spec = _spec_pool(ctx, hv, dk, dv, dtype=torch.float32, scale=0.1)
    t = spec.numel()
    # q, k, v as the model sees them: head views of the conv output; a and b strided columns of in_proj's
    mixed = ctx.randn(t, 2 * hk * dk + hv * dv)
    q = mixed[:, :hk * dk].view(t, hk, dk)
    k = mixed[:, hk * dk:2 * hk * dk].view(t, hk, dk)
    v = mixed[:, 2 * hk * dk:].view(t, hv, dv)
    proj = ctx.randn(t, 2 * hv + 5, scale=4.0)
    bb, a = proj[:, :hv], proj[:, hv:2 * hv]
    neg_a = -(ctx.rand(hv) * 15.0 + 1.0)
    dt_bias = ctx.randn(hv, dtype=torch.float32)
    before, state_ref = state.clone(), state.clone()
    out = _call(fn, ctx.device, [((t, hv, dv), ctx.dtype)], q, k, v, a, bb, neg_a, dt_bias, state, slots, spec)
    ref = gated_delta_rule_spec_ref(q, k, v, a, bb, neg_a, dt_bias, state_ref, slots, spec)
    return max(rel_err("out", out, ref, ctx.tol), _spec_state_err("ssm_state", state, state_ref, before, ctx.tol))
