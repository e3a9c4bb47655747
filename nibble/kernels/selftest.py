"""Start-up self-tests: each candidate backend of an op runs once on the model's real shapes against the
torch reference, on fresh random inputs.

Outputs that kernels allocate themselves are caught when left unwritten (the allocator is poisoned:
selftest_harness.py, which holds what every test is built on). In-place state (caches, conv/ssm states) is
compared as well. A test raises `SelfTestFailure` with a short reason; it returns the worst relative error
||out - ref|| / ||ref|| it saw. The Gated DeltaNet ops' tests are in selftest_gdn.py; `SELF_TESTS` lists
every op's test, and the harness names importers know from here are re-exported.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nibble.formats.nvfp4 import NVFP4Tensor
from nibble.kernels.activation import moe_combine_ref, sigmoid_mul_ref, silu_and_mul_ref
from nibble.kernels.attention import paged_attention_ref, store_kv_ref
from nibble.kernels.dense_gemv import dense_linear_ref
from nibble.kernels.moe import MoEWeights, fused_moe_ref, route_ref, topk_counters
from nibble.kernels.norm import gated_rms_norm_ref, qk_rms_norm_ref, rms_norm_moe_ref, rms_norm_ref
from nibble.kernels.nvfp4_linear import nvfp4_linear_ref
from nibble.kernels.paged_attention import tuning_config
from nibble.kernels.rope import build_cos_sin_cache, rope_ref
from nibble.kernels.selftest_gdn import (
    test_causal_conv1d,
    test_causal_conv1d_spec,
    test_gated_delta_rule,
    test_gated_delta_rule_decode,
    test_gated_delta_rule_spec,
    test_gdn_gating,
)
from nibble.kernels.selftest_harness import (  # noqa: F401  (re-exported: the names importers know from here)
    SelfTestContext,
    SelfTestFailure,
    _call,
    dense_split,
    poison,
    rel_err,
)
from nibble.models.config import ModelConfig

MOE_TEST_BYTES = 2 << 30


def test_rms_norm(fn: Callable, ctx: SelfTestContext) -> float:
    h = ctx.config.hidden_size
    worst = 0.0
    for t in (1, 37):
        x, res = ctx.randn(t, h), ctx.randn(t, h, scale=4.0)
        w = 1.0 + 0.1 * ctx.randn(h, dtype=torch.float32)
        out, new_res = _call(fn, ctx.device, [((t, h), ctx.dtype)] * 2, x, w, ctx.config.rms_norm_eps, res)
        ref, ref_res = rms_norm_ref(x, w, ctx.config.rms_norm_eps, res)
        worst = max(worst, rel_err("out", out, ref, ctx.tol), rel_err("residual", new_res, ref_res, ctx.tol))
        out, none = _call(fn, ctx.device, [((t, h), ctx.dtype)], x, w, ctx.config.rms_norm_eps)
        if none is not None:
            raise SelfTestFailure("returned a residual without one given")
        worst = max(worst, rel_err("out (no residual)", out, rms_norm_ref(x, w, ctx.config.rms_norm_eps)[0],
                                   ctx.tol))
    return worst


def test_qk_rms_norm(fn: Callable, ctx: SelfTestContext) -> float:
    c = ctx.config
    (hq, hk), d = ctx.attention_heads, c.head_dim
    q_width = hq * (c.q_proj_size // c.num_attention_heads)
    qw = 1.0 + 0.1 * ctx.randn(d, dtype=torch.float32)
    kw = 1.0 + 0.1 * ctx.randn(d, dtype=torch.float32)
    worst = 0.0
    for t in (1, 37):
        # q and k as the model sees them: head slices of the fused [q (| gate) | k | v] projection
        qkv = ctx.randn(t, q_width + 2 * hk * d, scale=3.0)
        q = qkv[:, :q_width].view(t, hq, -1)[..., :d]
        k = qkv[:, q_width:q_width + hk * d].view(t, hk, d)
        q_out, k_out = _call(fn, ctx.device, [((t, hq, d), ctx.dtype), ((t, hk, d), ctx.dtype)], q, k, qw, kw,
                             c.rms_norm_eps)
        q_ref, k_ref = qk_rms_norm_ref(q, k, qw, kw, c.rms_norm_eps)
        worst = max(worst, rel_err(f"q T={t}", q_out, q_ref, ctx.tol), rel_err(f"k T={t}", k_out, k_ref, ctx.tol))
    return worst


def test_gated_rms_norm(fn: Callable, ctx: SelfTestContext) -> float:
    c = ctx.config
    n, d = 5 * ctx.linear_heads[1], c.linear_value_head_dim
    x, g = ctx.randn(n, d), ctx.randn(n, d)
    w = 1.0 + 0.1 * ctx.randn(d, dtype=torch.float32)
    out = _call(fn, ctx.device, [((n, d), ctx.dtype)], x, g, w, c.rms_norm_eps)
    return rel_err("out", out, gated_rms_norm_ref(x, g, w, c.rms_norm_eps), ctx.tol)


def test_rope(fn: Callable, ctx: SelfTestContext) -> float:
    c = ctx.config
    t, max_pos = 19, 4096
    cache = build_cos_sin_cache(c.rotary_dim, max_pos, c.rope_theta, ctx.device, scaling=c.rope_scaling)
    pos = (ctx.rand(t) * max_pos).long().clamp_max(max_pos - 1)
    # q as the model sees it: a strided view of the fused [query | gate] projection
    hq, hkv = ctx.attention_heads
    q_full = ctx.randn(t, hq, 2 * c.head_dim)
    k = ctx.randn(t, hkv, c.head_dim)
    q_ref, k_ref = rope_ref(q_full[..., :c.head_dim], k, pos, cache)
    gate_before = q_full[..., c.head_dim:].clone()
    q_out, k_out = _call(fn, ctx.device, [], q_full[..., :c.head_dim], k.clone(), pos, cache)
    if not torch.equal(q_full[..., c.head_dim:], gate_before):
        raise SelfTestFailure("wrote outside the query channels")
    return max(rel_err("q", q_out, q_ref, ctx.tol), rel_err("k", k_out, k_ref, ctx.tol))


def _paged_setup(ctx: SelfTestContext, ctx_lens: list[int], q_lens: list[int]):
    c = ctx.config
    bs = ctx.block_size
    nblocks = [-(-(a + b) // bs) for a, b in zip(ctx_lens, q_lens)]
    total = sum(nblocks) + 3
    perm = ctx.randperm(total).to(torch.int32)
    table = torch.zeros((len(q_lens), max(nblocks)), dtype=torch.int32, device=ctx.device)
    i = 0
    for s, n in enumerate(nblocks):
        table[s, :n] = perm[i:i + n]
        i += n
    shape = (total, bs, ctx.attention_heads[1], c.head_dim)
    return table, shape


def _slots(table: torch.Tensor, bs: int, ctx_lens: list[int], q_lens: list[int]) -> torch.Tensor:
    slots = []
    for s, (a, b) in enumerate(zip(ctx_lens, q_lens)):
        pos = torch.arange(a, a + b, device=table.device)
        slots.append(table[s, pos // bs].long() * bs + pos % bs)
    return torch.cat(slots)


def test_store_kv(fn: Callable, ctx: SelfTestContext) -> float:
    c = ctx.config
    ctx_lens, q_lens = [3, 0], [5, 20]
    table, shape = _paged_setup(ctx, ctx_lens, q_lens)
    slot_mapping = _slots(table, ctx.block_size, ctx_lens, q_lens)
    slot_mapping[2] = -1
    t = slot_mapping.numel()
    hkv = ctx.attention_heads[1]
    k, v = ctx.randn(t, hkv, c.head_dim), ctx.randn(t, hkv, c.head_dim)
    ks, vs = (0.05, 0.03) if ctx.kv_cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    kc = ctx.randn(*shape).to(ctx.kv_cache_dtype)
    vc = ctx.randn(*shape).to(ctx.kv_cache_dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    store_kv_ref(k, v, kc_ref, vc_ref, slot_mapping, ks, vs)
    _call(fn, ctx.device, [], k, v, kc, vc, slot_mapping, ks, vs)
    return max(rel_err("k_cache", kc.float(), kc_ref.float(), ctx.tol),
               rel_err("v_cache", vc.float(), vc_ref.float(), ctx.tol))


def _fp8_gather_cases(ctx: SelfTestContext) -> list[tuple[list[int], list[int]]]:
    """A prefill long enough to go through the FP8 cache's 16-bit scratch (kv_gather.py), where this GPU's table
    turns it on only past `fp8_gather_min_seq_len` tokens, longer than the other cases' contexts."""
    if ctx.kv_cache_dtype != torch.float8_e4m3fn:
        return []
    hq, hk = ctx.attention_heads
    q_len = 40
    cfg = tuning_config(ctx.device, ctx.config.head_dim, hq // hk, q_len)
    if not cfg["fp8_gather"]:
        return []
    return [([max(cfg["fp8_gather_min_seq_len"], 64) - q_len, 0], [q_len, 3])]


def test_paged_attention(fn: Callable, ctx: SelfTestContext) -> float:
    c = ctx.config
    worst = 0.0
    # decode (one long context to exercise split-KV), prefill with a cached prefix, a prefill past 512 query
    # tokens (the tables' long-prefill tiles, `min_query_len`) and, with an FP8 cache, one through the scratch
    cases = [([0, 130, 2900], [1, 1, 1]), ([0, 190, 7], [37, 5, 1]), ([40, 0], [520, 3]), *_fp8_gather_cases(ctx)]
    for ctx_lens, q_lens in cases:
        table, shape = _paged_setup(ctx, ctx_lens, q_lens)
        fp8 = ctx.kv_cache_dtype == torch.float8_e4m3fn
        ks, vs = (0.02, 0.015) if fp8 else (1.0, 1.0)
        kc = (ctx.randn(*shape, dtype=torch.float32) / ks).to(ctx.kv_cache_dtype)
        vc = (ctx.randn(*shape, dtype=torch.float32) / vs).to(ctx.kv_cache_dtype)
        t = sum(q_lens)
        q = ctx.randn(t, ctx.attention_heads[0], c.head_dim)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=ctx.device)
        lens = torch.tensor([a + b for a, b in zip(ctx_lens, q_lens)], dtype=torch.int32, device=ctx.device)
        args = (q, kc, vc, cu, lens, table, c.head_dim ** -0.5, ks, vs, max(q_lens), int(lens.max()))
        out = _call(fn, ctx.device, [(tuple(q.shape), q.dtype)], *args)
        worst = max(worst, rel_err("decode" if max(q_lens) == 1 else "prefill", out, paged_attention_ref(*args),
                                   ctx.tol))
    return worst


def test_sigmoid_mul(fn: Callable, ctx: SelfTestContext) -> float:
    c = ctx.config
    worst = 0.0
    for t in (1, 37):
        # the gate as the model sees it: the second half of each head of the fused [query | gate] projection
        hq = ctx.attention_heads[0]
        q_full = ctx.randn(t, hq, 2 * c.head_dim, scale=3.0)
        x = ctx.randn(t, hq, c.head_dim)
        gate = q_full[..., c.head_dim:]
        out = _call(fn, ctx.device, [(tuple(x.shape), ctx.dtype)], x, gate)
        worst = max(worst, rel_err(f"T={t}", out, sigmoid_mul_ref(x, gate), ctx.tol))
    return worst


def _moe_projection(ctx: SelfTestContext, t: int) -> tuple[torch.Tensor, ...]:
    """The MoE block's fused projection output [T, E + 2 I + 1] and its views: router logits, shared gate,
    shared up, shared expert gate logit."""
    c = ctx.config
    e, i = c.num_experts, c.shared_expert_intermediate_size
    y = ctx.randn(t, e + 2 * i + 1, scale=3.0)
    return y, y[:, :e], y[:, e:e + i], y[:, e + i:e + 2 * i], y[:, e + 2 * i:]


def test_rms_norm_moe(fn: Callable, ctx: SelfTestContext) -> float:
    h = ctx.config.hidden_size
    worst = 0.0
    for t in (1, 37):
        gate_logit = _moe_projection(ctx, t)[4]
        routed, shared, res = ctx.randn(t, h), ctx.randn(t, h), ctx.randn(t, h, scale=4.0)
        w = 1.0 + 0.1 * ctx.randn(h, dtype=torch.float32)
        out, new_res = _call(fn, ctx.device, [((t, h), ctx.dtype)] * 2, routed, shared, gate_logit, w,
                             ctx.config.rms_norm_eps, res)
        ref, ref_res = rms_norm_moe_ref(routed, shared, gate_logit, w, ctx.config.rms_norm_eps, res)
        worst = max(worst, rel_err(f"out T={t}", out, ref, ctx.tol),
                    rel_err(f"residual T={t}", new_res, ref_res, ctx.tol))
    return worst


def test_silu_and_mul(fn: Callable, ctx: SelfTestContext) -> float:
    i = ctx.config.shared_expert_intermediate_size
    worst = 0.0
    for t in (1, 37):
        _, _, gate, up, _ = _moe_projection(ctx, t)
        out = _call(fn, ctx.device, [((t, i), ctx.dtype)], gate, up)
        worst = max(worst, rel_err(f"T={t}", out, silu_and_mul_ref(gate, up), ctx.tol))
    return worst


def test_moe_combine(fn: Callable, ctx: SelfTestContext) -> float:
    h = ctx.config.hidden_size
    worst = 0.0
    for t in (1, 37):
        gate_logit = _moe_projection(ctx, t)[-1]
        routed, shared = ctx.randn(t, h), ctx.randn(t, h)
        out = _call(fn, ctx.device, [((t, h), ctx.dtype)], routed, shared, gate_logit)
        worst = max(worst, rel_err(f"T={t}", out, moe_combine_ref(routed, shared, gate_logit), ctx.tol))
    return worst


def test_route(fn: Callable, ctx: SelfTestContext) -> float:
    c = ctx.config
    t = 33
    # the router logits as the model sees them: a strided view of the MoE block's fused projection
    logits = _moe_projection(ctx, t)[1]
    w, ids = _call(fn, ctx.device, [((t, c.num_experts_per_tok), torch.float32)], logits, c.num_experts_per_tok,
                   c.norm_topk_prob)
    w_ref, ids_ref = route_ref(logits, c.num_experts_per_tok, c.norm_topk_prob)
    if ids.dtype != torch.int32 or ids.shape != ids_ref.shape:
        raise SelfTestFailure(f"ids {ids.dtype} {tuple(ids.shape)}")
    if ((ids < 0) | (ids >= c.num_experts)).any():
        raise SelfTestFailure("expert ids out of range")
    # ties (frequent with bf16 logits) may pick different experts of equal logit: compare the logits chosen
    lf = logits.float()
    picked, picked_ref = lf.gather(1, ids.long()), lf.gather(1, ids_ref.long())
    if not torch.equal(picked, picked_ref):
        raise SelfTestFailure("selected experts differ from the reference")
    # a CUDA graph's padded batch: its padding rows route to no expert, the others as without the count
    num_valid = 20
    count = torch.tensor([num_valid], dtype=torch.int32, device=ctx.device)
    wv, idsv = _call(fn, ctx.device, [((t, c.num_experts_per_tok), torch.float32)], logits, c.num_experts_per_tok,
                     c.norm_topk_prob, count)
    if not (torch.equal(idsv[:num_valid], ids[:num_valid]) and torch.equal(wv[:num_valid], w[:num_valid])):
        raise SelfTestFailure("rows below num_valid_tokens routed differently with the count")
    if not (bool((idsv[num_valid:] == -1).all()) and bool((wv[num_valid:] == 0).all())):
        raise SelfTestFailure("rows from num_valid_tokens on were routed")
    return rel_err("weights", w, w_ref, 1e-5)


def _random_nvfp4(ctx: SelfTestContext, e: int, n: int, k: int) -> NVFP4Tensor:
    packed = torch.randint(0, 256, (e, n, k // 2), generator=ctx.generator, device=ctx.device, dtype=torch.uint8)
    scale = (ctx.rand(e, n, k // 16) * 2.0 + 0.05).to(torch.float8_e4m3fn)
    gscale = (ctx.rand(e, n) + 0.5) * (0.5 / (k ** 0.5))
    return NVFP4Tensor(packed, scale, gscale)


def moe_test_experts(ctx: SelfTestContext) -> int:
    """Experts to allocate for the MoE self-test: the count a rank holds if their weights stay under
    MOE_TEST_BYTES, else fewer (the per-expert shapes stay real)."""
    c = ctx.config
    held, inter = ctx.moe_share
    elems = 3 * inter * c.hidden_size
    per_expert = elems * 9 // 16 if ctx.config.quantized else elems * ctx.dtype.itemsize
    return max(2 * c.num_experts_per_tok, min(held, MOE_TEST_BYTES // max(1, per_expert)))


def test_fused_moe(fn: Callable, ctx: SelfTestContext) -> float:
    """The routed experts on this rank's share (`SelfTestContext.moe_share`), so that a tensor-parallel rank
    runs the tiles its I / tp picks; under expert parallelism the slots routed to other ranks' experts come
    as id -1, in the share a rank sees."""
    c = ctx.config
    h, k = c.hidden_size, c.num_experts_per_tok
    held, inter = ctx.moe_share
    e = min(held, moe_test_experts(ctx))
    routed = e * (c.num_experts // held)
    quantized = c.quant is not None and c.quant.is_quantized("model.layers.0.mlp.experts")
    # tiles are chosen by the pairs per expert over the model's experts, so each size runs the model's tile
    # (the fewer experts allocated here just get more pairs each)
    if quantized:
        experts = MoEWeights(_random_nvfp4(ctx, e, 2 * inter, h), _random_nvfp4(ctx, e, h, inter),
                             topk_counters(h, ctx.device), num_routed_experts=c.num_experts)
    else:
        experts = MoEWeights(ctx.randn(e, 2 * inter, h, scale=h ** -0.5), ctx.randn(e, h, inter, scale=inter ** -0.5),
                             num_routed_experts=c.num_experts)
    worst = 0.0
    # the last sizes reach the larger sorted blocks and the prefill tile (GPU only: the interpreter is too slow)
    for t in (1, 3, 40, 300) + ((700, 1500) if ctx.device.type == "cuda" else ()):
        x = ctx.randn(t, h)
        w, ids = route_ref(ctx.randn(t, routed, dtype=torch.float32), k, True)
        ids = torch.where(ids < e, ids, -1).to(ids.dtype)
        out = _call(fn, ctx.device, [((t, h), ctx.dtype)], x, w, ids, experts)
        worst = max(worst, rel_err(f"T={t}", out, fused_moe_ref(x, w, ids, experts), ctx.tol))
    return worst


def test_nvfp4_linear(fn: Callable, ctx: SelfTestContext) -> float:
    """The shared expert's gate_up shape (N / tp rows on a tensor-parallel rank)."""
    c = ctx.config
    si = c.shared_expert_intermediate_size
    h, n = c.hidden_size, 2 * (si // ctx.tp_size if si % (16 * ctx.tp_size) == 0 else si)
    w = _random_nvfp4(ctx, 1, n, h)
    w = NVFP4Tensor(w.packed[0], w.block_scale[0], w.global_scale[0])
    worst = 0.0
    for t in (1, 7, 130):
        x = ctx.randn(t, h)
        out = _call(fn, ctx.device, [((t, n), ctx.dtype)], x, w)
        worst = max(worst, rel_err(f"T={t}", out, nvfp4_linear_ref(x, w), ctx.tol))
    return worst


def dense_linear_shapes(c: ModelConfig, tp: int = 1) -> list[tuple[int, int]]:
    """(N, K) of the model's 16-bit projections at decode: GDN in_proj and out_proj, attention qkv and o_proj, the
    fused router + shared-expert input projection and the shared expert's down projection (the fused ones' rows
    padded to 8, as the layers hold them); with tp > 1 on one tensor-parallel rank, as the layers split them
    (column-parallel projections N / tp rows, row-parallel ones K / tp columns, the router whole, one KV head where
    there are fewer than ranks); the whole model's where tp does not divide its heads (the loader refuses that)."""
    tp = dense_split(c, tp)
    kv = c.kv_proj_size // tp if c.num_key_value_heads % tp == 0 else c.head_dim
    si = c.shared_expert_intermediate_size // tp
    gdn_in = (2 * c.linear_key_dim + 2 * c.linear_value_dim + 2 * c.linear_num_value_heads) // tp
    # the fused column-parallel projections (`FusedProjections`) pad their rows to a multiple of 8
    fused = [-(-n // 8) * 8 for n in (gdn_in, c.q_proj_size // tp + 2 * kv, c.num_experts + 2 * si + 1)]
    shapes = [(fused[0], c.hidden_size), (c.hidden_size, c.linear_value_dim // tp), (fused[1], c.hidden_size),
              (c.hidden_size, c.num_attention_heads * c.head_dim // tp), (fused[2], c.hidden_size),
              (c.hidden_size, si)]
    return sorted(set(shapes))


def test_dense_linear(fn: Callable, ctx: SelfTestContext) -> float:
    worst = 0.0
    for n, k in dense_linear_shapes(ctx.config, ctx.tp_size):
        w = ctx.randn(n, k, scale=k ** -0.5)
        for t in (1, 3, 8):
            x = ctx.randn(t, k)
            out = _call(fn, ctx.device, [((t, n), ctx.dtype)], x, w)
            worst = max(worst, rel_err(f"N={n} K={k} T={t}", out, dense_linear_ref(x, w), ctx.tol))
    return worst


SELF_TESTS: dict[str, Callable[[Callable, SelfTestContext], float]] = {
    "rms_norm": test_rms_norm,
    "rms_norm_moe": test_rms_norm_moe,
    "qk_rms_norm": test_qk_rms_norm,
    "gated_rms_norm": test_gated_rms_norm,
    "rope": test_rope,
    "store_kv": test_store_kv,
    "paged_attention": test_paged_attention,
    "sigmoid_mul": test_sigmoid_mul,
    "causal_conv1d": test_causal_conv1d,
    "causal_conv1d_spec": test_causal_conv1d_spec,
    "gdn_gating": test_gdn_gating,
    "gated_delta_rule": test_gated_delta_rule,
    "gated_delta_rule_decode": test_gated_delta_rule_decode,
    "gated_delta_rule_spec": test_gated_delta_rule_spec,
    "route": test_route,
    "fused_moe": test_fused_moe,
    "silu_and_mul": test_silu_and_mul,
    "moe_combine": test_moe_combine,
    "nvfp4_linear": test_nvfp4_linear,
    "dense_linear": test_dense_linear,
}
