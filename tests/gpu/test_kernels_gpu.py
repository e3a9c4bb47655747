"""Triton kernels on a CUDA GPU, bf16 on the real Qwen3.5-122B-A10B and 397B-A17B layer shapes, against
the torch references evaluated in fp32 on the same GPU. Run with NIBBLE_TEST_GPU=1 (skipped otherwise).

    NIBBLE_TEST_GPU=1 python -m pytest tests/gpu/test_kernels_gpu.py -q
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial

import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get("NIBBLE_TEST_GPU") != "1" or not torch.cuda.is_available(),
    reason="GPU kernel tests need NIBBLE_TEST_GPU=1 and a CUDA device")

from nibble.bench.gpu_timing import capture_graph  # noqa: E402
from nibble.formats.nvfp4 import NVFP4Tensor  # noqa: E402
from nibble.kernels import attention, kv_gather, selftest  # noqa: E402
from nibble.kernels import paged_attention as pa  # noqa: E402
from nibble.kernels.activation import (  # noqa: E402
    moe_combine,
    moe_combine_ref,
    sigmoid_mul,
    sigmoid_mul_ref,
    silu_and_mul,
    silu_and_mul_ref,
)
from nibble.kernels.conv1d import (  # noqa: E402
    causal_conv1d,
    causal_conv1d_ref,
    causal_conv1d_spec,
    causal_conv1d_spec_ref,
)
from nibble.kernels.fused_moe import fused_moe_launch  # noqa: E402
from nibble.kernels.gated_delta import (  # noqa: E402
    FLA_CHUNK,
    fla_chunk_indices,
    gated_delta_rule_decode,
    gated_delta_rule_decode_ref,
    gated_delta_rule_fla,
    gated_delta_rule_recurrent,
    gated_delta_rule_ref,
    gated_delta_rule_spec,
    gated_delta_rule_spec_ref,
)
from nibble.kernels.gdn_gating import gdn_gating, gdn_gating_ref  # noqa: E402
from nibble.kernels.moe import MoEWeights, fused_moe_ref, route_ref, topk_counters  # noqa: E402
from nibble.kernels.moe_align import moe_align, moe_align_ref, moe_align_split  # noqa: E402
from nibble.kernels.moe_route import route  # noqa: E402
from nibble.kernels.norm import (  # noqa: E402
    gated_rms_norm,
    gated_rms_norm_ref,
    qk_rms_norm,
    qk_rms_norm_ref,
    rms_norm,
    rms_norm_moe,
    rms_norm_moe_ref,
    rms_norm_ref,
)
from nibble.kernels.nvfp4_linear import nvfp4_linear_launch, nvfp4_linear_ref  # noqa: E402
from nibble.kernels.pdl import pdl_supported  # noqa: E402
from nibble.kernels.rope import build_cos_sin_cache, rope, rope_ref  # noqa: E402
from nibble.kernels.selftest_harness import SelfTestContext, poison  # noqa: E402
from nibble.models.config import ModelConfig  # noqa: E402
from nibble.models.quant_config import QuantConfig  # noqa: E402
from tests.helpers.moe_align_check import assert_alignment_matches  # noqa: E402
from tests.kernels.kernel_testing import count_gathers  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
TOL = 2e-2
# fused_moe's mixed sorted path: quad-4 blocks for experts with up to 9 pairs, split-16 for the others
MIXED = {"xmode": "quad", "block_t": 4, "mixed_max_pairs": 9, "lg_xmode": "split", "lg_block_t": 16,
         "lg_gu_block_n": 64, "lg_gu_block_k": 256, "lg_gu_warps": 8, "lg_gu_stages": 4, "lg_dn_block_n": 64,
         "lg_dn_block_k": 256, "lg_dn_warps": 4, "lg_dn_stages": 4}
# FP8 prefills through the 16-bit scratch whatever the context (a GPU's table turns it on only past a threshold)
GATHER = {"fp8_gather": True, "fp8_gather_min_seq_len": 0}

_COMMON = {"architectures": ["Qwen3_5MoeForCausalLM"], "vocab_size": 248320, "num_attention_heads": 32,
           "num_key_value_heads": 2, "head_dim": 256, "partial_rotary_factor": 0.25,
           "rope_parameters": {"rope_theta": 10000000, "rope_type": "default", "partial_rotary_factor": 0.25},
           "linear_num_key_heads": 16, "linear_num_value_heads": 64, "linear_key_head_dim": 128,
           "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "moe_intermediate_size": 1024,
           "shared_expert_intermediate_size": 1024, "rms_norm_eps": 1e-6}
SHAPES = {
    "122B": {**_COMMON, "hidden_size": 3072, "num_hidden_layers": 48, "num_experts": 256, "num_experts_per_tok": 8},
    "397B": {**_COMMON, "hidden_size": 4096, "num_hidden_layers": 60, "num_experts": 512, "num_experts_per_tok": 10},
}
NVFP4 = QuantConfig("NVFP4", 16, ("*self_attn*", "*linear_attn*", "*shared_expert*", "lm_head"))


def config(name: str) -> ModelConfig:
    return ModelConfig.from_dict(SHAPES[name], quant=NVFP4)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape
    o = out.float()
    assert torch.isfinite(o).all()
    return float((o - ref.float()).norm() / ref.float().norm())


def cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)


def random_nvfp4(*shape: int) -> NVFP4Tensor:
    *lead, n, k = shape
    packed = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, device=DEV)
    scale = (torch.rand(*lead, n, k // 16, device=DEV) * 2 + 0.05).to(torch.float8_e4m3fn)
    return NVFP4Tensor(packed, scale, (torch.rand(*lead, n, device=DEV) + 0.5) * (0.5 / k ** 0.5))


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("t", [1, 256, 4096])
def test_norms_and_rope(name: str, t: int) -> None:
    c = config(name)
    x = torch.randn(t, c.hidden_size, device=DEV, dtype=BF16)
    res = torch.randn(t, c.hidden_size, device=DEV, dtype=BF16)
    w = 1 + 0.1 * torch.randn(c.hidden_size, device=DEV)
    out, new_res = rms_norm(x, w, 1e-6, res)
    s = (x + res).float()
    assert rel(out, rms_norm_ref(s, w, 1e-6)[0]) < TOL and rel(new_res, s) < TOL
    n, d = t * c.linear_num_value_heads, c.linear_value_head_dim
    xg, g = torch.randn(n, d, device=DEV, dtype=BF16), torch.randn(n, d, device=DEV, dtype=BF16)
    wg = torch.rand(d, device=DEV, dtype=BF16)
    assert rel(gated_rms_norm(xg, g, wg, 1e-6), gated_rms_norm_ref(xg.float(), g.float(), wg.float(), 1e-6)) < TOL
    cache = build_cos_sin_cache(c.rotary_dim, 65536, c.rope_theta, DEV)
    pos = torch.randint(0, 65536, (t,), device=DEV)
    qf = torch.randn(t, c.num_attention_heads, 2 * c.head_dim, device=DEV, dtype=BF16)
    k = torch.randn(t, c.num_key_value_heads, c.head_dim, device=DEV, dtype=BF16)
    qw, kw = 1 + 0.1 * torch.randn(c.head_dim, device=DEV), 1 + 0.1 * torch.randn(c.head_dim, device=DEV)
    q_n, k_n = qk_rms_norm(qf[..., :c.head_dim], k, qw, kw, 1e-6)
    q_n_ref, k_n_ref = qk_rms_norm_ref(qf[..., :c.head_dim].float(), k.float(), qw, kw, 1e-6)
    assert rel(q_n, q_n_ref) < TOL and rel(k_n, k_n_ref) < TOL
    q_ref, k_ref = rope_ref(qf[..., :c.head_dim].float(), k.float(), pos, cache)
    q_out, k_out = rope(qf[..., :c.head_dim], k, pos, cache)
    assert rel(q_out, q_ref) < TOL and rel(k_out, k_ref) < TOL


def _paged(ctx_lens: list[int], q_lens: list[int], page: int, hk: int, d: int, kv_dtype: torch.dtype):
    nb = [-(-(a + b) // page) for a, b in zip(ctx_lens, q_lens)]
    total = sum(nb) + 5
    perm = torch.randperm(total, device=DEV).to(torch.int32)
    table = torch.zeros(len(nb), max(nb), dtype=torch.int32, device=DEV)
    i = 0
    for s, n in enumerate(nb):
        table[s, :n] = perm[i:i + n]
        i += n
    fp8 = kv_dtype == torch.float8_e4m3fn
    ks, vs = (0.02, 0.015) if fp8 else (1.0, 1.0)
    kc = (torch.randn(total, page, hk, d, device=DEV) / ks).to(kv_dtype)
    vc = (torch.randn(total, page, hk, d, device=DEV) / vs).to(kv_dtype)
    return table, kc, vc, ks, vs


@pytest.mark.parametrize("kv_dtype", [BF16, torch.float8_e4m3fn])
@pytest.mark.parametrize("native_fp8", [True, False])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_paged_attention(kv_dtype: torch.dtype, native_fp8: bool, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if not native_fp8:
        if kv_dtype != torch.float8_e4m3fn:
            pytest.skip("software FP8 path only matters for FP8 caches")
        monkeypatch.setattr(pa, "fp8_native", lambda _d: False)
        monkeypatch.setattr(attention, "fp8_native", lambda _d: False)
    c = config("397B")
    if mode == "decode":
        ctx_lens, q_lens = [0, 17, 1000, 31000, 5, 4095], [1] * 6
    else:
        ctx_lens, q_lens = [0, 3000, 33], [1500, 700, 1]
    for page in (16, 64):
        table, kc, vc, ks, vs = _paged(ctx_lens, q_lens, page, c.num_key_value_heads, c.head_dim, kv_dtype)
        t = sum(q_lens)
        # the new tokens go through store_kv like in the model
        pos = [torch.arange(a, a + b, device=DEV) for a, b in zip(ctx_lens, q_lens)]
        slots = torch.cat([table[s, p // page].long() * page + p % page for s, p in enumerate(pos)])
        k_new = torch.randn(t, c.num_key_value_heads, c.head_dim, device=DEV, dtype=BF16) * 0.3
        v_new = torch.randn(t, c.num_key_value_heads, c.head_dim, device=DEV, dtype=BF16) * 0.3
        kc_ref, vc_ref = kc.clone(), vc.clone()
        attention.store_kv_ref(k_new, v_new, kc_ref, vc_ref, slots, ks, vs)
        attention.store_kv(k_new, v_new, kc, vc, slots, ks, vs)
        assert rel(kc.float(), kc_ref.float()) < 1e-2 and rel(vc.float(), vc_ref.float()) < 1e-2
        q = torch.randn(t, c.num_attention_heads, c.head_dim, device=DEV, dtype=BF16)
        lens = torch.tensor([a + b for a, b in zip(ctx_lens, q_lens)], dtype=torch.int32, device=DEV)
        args = (cu(q_lens), lens, table, c.head_dim ** -0.5, ks, vs, max(q_lens), int(lens.max()))
        out = pa.paged_attention(q, kc, vc, *args)
        kf = kc.float() if kv_dtype == BF16 else kc
        vf = vc.float() if kv_dtype == BF16 else vc
        ref = attention.paged_attention_ref(q.float(), kf, vf, *args)
        assert rel(out, ref) < TOL, (page, rel(out, ref))


@pytest.mark.parametrize("native_fp8", [True, False])
@pytest.mark.parametrize("num_heads", [32, 16])  # 122B / 397B, 35B: 2 KV heads each
def test_paged_attention_fp8_gather(num_heads: int, native_fp8: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 prefills through the 16-bit scratch cache (kv_gather.py) against the conversion in the kernel and
    the reference, on the prefill tiles of the table (short and 513+ query tokens), fresh caches each round."""
    if not native_fp8:
        monkeypatch.setattr(pa, "fp8_native", lambda _d: False)
        monkeypatch.setattr(kv_gather, "fp8_native", lambda _d: False)
    c = ModelConfig.from_dict({**SHAPES["122B"], "num_attention_heads": num_heads}, quant=NVFP4)
    gathers = count_gathers(monkeypatch)
    for ctx_lens, q_lens in (([0, 3000, 33], [1500, 700, 1]), ([5000, 0], [40, 300])):
        table, kc, vc, ks, vs = _paged(ctx_lens, q_lens, 16, c.num_key_value_heads, c.head_dim, torch.float8_e4m3fn)
        q = torch.randn(sum(q_lens), c.num_attention_heads, c.head_dim, device=DEV, dtype=BF16)
        lens = torch.tensor([a + b for a, b in zip(ctx_lens, q_lens)], dtype=torch.int32, device=DEV)
        args = (q, kc, vc, cu(q_lens), lens, table, c.head_dim ** -0.5, ks, vs, max(q_lens), int(lens.max()))
        direct = pa.paged_attention_launch(*args, config={"fp8_gather": False})
        poison(q.device, (tuple(q.shape), BF16))
        gather = pa.paged_attention_launch(*args, config=GATHER)
        ref = attention.paged_attention_ref(q.float(), kc, vc, *args[3:])
        assert rel(gather, ref) < TOL and rel(direct, ref) < TOL
        assert rel(gather, direct) < 1e-3, (q_lens, rel(gather, direct))
    assert len(gathers) == 2


def test_paged_attention_fp8_gather_not_in_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A captured FP8 prefill converts in the kernel (a scratch cache would stay in the graph's pool), and its
    replay matches the eager launch through the scratch."""
    c = config("122B")
    ctx_lens, q_lens = [700, 0], [100, 60]
    table, kc, vc, ks, vs = _paged(ctx_lens, q_lens, 16, c.num_key_value_heads, c.head_dim, torch.float8_e4m3fn)
    q = torch.randn(sum(q_lens), c.num_attention_heads, c.head_dim, device=DEV, dtype=BF16)
    lens = torch.tensor([a + b for a, b in zip(ctx_lens, q_lens)], dtype=torch.int32, device=DEV)
    args = (q, kc, vc, cu(q_lens), lens, table, c.head_dim ** -0.5, ks, vs, max(q_lens), int(lens.max()))
    eager = pa.paged_attention_launch(*args, config=GATHER)
    real, calls = pa.gather_kv_pages, []
    monkeypatch.setattr(pa, "gather_kv_pages", lambda *a, **k: calls.append(torch.cuda.is_current_stream_capturing())
                        or real(*a, **k))
    out: list[torch.Tensor] = []
    graph = capture_graph(lambda: out.append(pa.paged_attention_launch(*args, config=GATHER)))
    out[-1].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert calls == [False]  # the warm-up call before the capture only
    assert rel(out[-1], eager) < 1e-3


@pytest.mark.parametrize("name", list(SHAPES))
def test_conv1d(name: str) -> None:
    c = config(name)
    ch, w = c.linear_conv_dim, c.linear_conv_kernel_dim
    for lens in ([1] * 64, [1, 700, 3, 2000]):
        x = torch.randn(sum(lens), ch, device=DEV, dtype=BF16)
        wt = torch.randn(ch, w, device=DEV, dtype=BF16) * 0.5
        state = torch.randn(80, w - 1, ch, device=DEV, dtype=BF16)
        slots = torch.randperm(80, device=DEV)[:len(lens)].to(torch.int32)
        st_ref = state.float()
        ref = causal_conv1d_ref(x.float(), wt.float(), st_ref, cu(lens), slots)
        out = causal_conv1d(x, wt, state, cu(lens), slots)
        assert rel(out, ref) < TOL and rel(state, st_ref) < TOL


def _gdn_inputs(c: ModelConfig, t: int):
    q = torch.randn(t, c.linear_num_key_heads, c.linear_key_head_dim, device=DEV, dtype=BF16)
    k = torch.randn(t, c.linear_num_key_heads, c.linear_key_head_dim, device=DEV, dtype=BF16)
    v = torch.randn(t, c.linear_num_value_heads, c.linear_value_head_dim, device=DEV, dtype=BF16)
    g = -torch.rand(t, c.linear_num_value_heads, device=DEV) * 0.3
    beta = torch.rand(t, c.linear_num_value_heads, device=DEV).to(BF16)
    return q, k, v, g, beta


@pytest.mark.parametrize("first_len", [300, 700])
@pytest.mark.parametrize("host_offsets", [False, True])
@pytest.mark.parametrize("fn", [gated_delta_rule_fla, gated_delta_rule_recurrent])
def test_gated_delta_prefill_then_decode_matches_whole_sequence(fn, host_offsets: bool, first_len: int) -> None:
    """Chunked prefill of sequences (with a mixed batch) then decode steps == the reference run over the
    whole sequences at once; with the offsets also given as a host list (what the GDN layer passes, so
    that fla plans its chunks without a device sync) or not. The fla backend takes its recurrent kernel up to
    RECURRENT_MAX_TOKENS tokens (first_len 300) and fla's chunked one beyond (700)."""
    c = config("122B")
    lens, decode_steps = [first_len, 1, 77], 4
    total = [n + decode_steps for n in lens]
    seqs = [_gdn_inputs(c, n) for n in total]
    slots = torch.tensor([9, 2, 5], dtype=torch.int32, device=DEV)
    shape = (12, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
    state = torch.zeros(shape, device=DEV)
    state_ref = torch.zeros(shape, device=DEV)
    whole = [torch.cat([s[i] for s in seqs]) for i in range(5)]
    ref = gated_delta_rule_ref(*[x.float() for x in whole], state_ref, cu(total), slots)
    outs: list[list[torch.Tensor]] = [[] for _ in lens]
    pre = [torch.cat([s[i][:n] for s, n in zip(seqs, lens)]) for i in range(5)]
    host = [0, *torch.tensor(lens).cumsum(0).tolist()] if host_offsets else None
    o = fn(*pre, state, cu(lens), slots, cu_seqlens_cpu=host)
    for j, part in enumerate(o.split(lens)):
        outs[j].append(part)
    for step in range(decode_steps):
        dec = [torch.cat([s[i][n + step:n + step + 1] for s, n in zip(seqs, lens)]) for i in range(5)]
        o = fn(*dec, state, cu([1, 1, 1]), slots)
        for j in range(3):
            outs[j].append(o[j:j + 1])
    out = torch.cat([torch.cat(o) for o in outs])
    assert rel(out, ref) < TOL
    assert rel(state, state_ref) < TOL


@pytest.mark.parametrize("name", ["122B", "397B"])
def test_gated_delta_decode_with_fused_gating(name: str) -> None:
    """The decode step with the gating fused, on the real layer shapes: bitwise the separate gdn_gating
    launch followed by the recurrent kernel, and the fp32 reference within tolerance."""
    c = config(name)
    b, hv = 5, c.linear_num_value_heads
    q, k, v, _, _ = _gdn_inputs(c, b)
    proj = torch.randn(b, 2 * hv + 8, device=DEV, dtype=BF16) * 8
    bb, a = proj[:, :hv], proj[:, hv + 8:]
    neg_a = -(torch.rand(hv, device=DEV) * 15 + 1)
    dt_bias = torch.randn(hv, device=DEV)
    shape = (9, hv, c.linear_key_head_dim, c.linear_value_head_dim)
    state = torch.randn(shape, device=DEV) * 0.1
    s_ref, s_two = state.clone(), state.clone()
    slots = torch.tensor([8, 0, 3, 6, 1], dtype=torch.int32, device=DEV)
    out = gated_delta_rule_decode(q, k, v, a, bb, neg_a, dt_bias, state, slots)
    g, beta = gdn_gating(a, bb, neg_a, dt_bias)
    two = gated_delta_rule_recurrent(q, k, v, g, beta, s_two, cu([1] * b), slots)
    ref = gated_delta_rule_decode_ref(q, k, v, a, bb, neg_a, dt_bias, s_ref, slots)
    assert torch.equal(out, two) and torch.equal(state, s_two)
    assert rel(out, ref) < TOL and rel(state, s_ref) < TOL


def _spec_slots(b: int, n: int, num: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(state_slots [b], spec_slots [b, n], the slots neither lists): distinct random slots of a pool of num,
    sequence 0's first snapshot in its own starting slot."""
    perm = torch.randperm(num, device=DEV)
    state, spec = perm[:b], perm[b:b + b * n].view(b, n).clone()
    spec[0, 0] = state[0]
    listed = set(spec.flatten().tolist())
    return state.to(torch.int32), spec.to(torch.int32), [i for i in range(num) if i not in listed]


@pytest.mark.parametrize("n", [2, 4, 9])
def test_gated_delta_spec_verify_step(n: int) -> None:
    """The verify step on the real layer shapes (122B; the 397B's GDN heads are the same): the fp32 reference
    within tolerance, output and every snapshot; n decode steps of the Triton decode kernel with the state
    copied out after each, up to rounding; the slots not listed as snapshots untouched."""
    c = config("122B")
    b, hv = 5, c.linear_num_value_heads
    q, k, v, _, _ = _gdn_inputs(c, b * n)
    proj = torch.randn(b * n, 2 * hv + 8, device=DEV, dtype=BF16) * 8
    bb, a = proj[:, :hv], proj[:, hv + 8:]
    neg_a = -(torch.rand(hv, device=DEV) * 15 + 1)
    dt_bias = torch.randn(hv, device=DEV)
    num = b * (n + 1) + 3
    state_slots, spec_slots, others = _spec_slots(b, n, num)
    before = torch.randn(num, hv, c.linear_key_head_dim, c.linear_value_head_dim, device=DEV) * 0.1
    state, s_ref, work, steps = before.clone(), before.clone(), before.clone(), before.clone()
    out = gated_delta_rule_spec(q, k, v, a, bb, neg_a, dt_bias, state, state_slots, spec_slots)
    ref = gated_delta_rule_spec_ref(q, k, v, a, bb, neg_a, dt_bias, s_ref, state_slots, spec_slots)
    dec = torch.empty_like(out)
    for j in range(n):
        dec[j::n] = gated_delta_rule_decode(q[j::n], k[j::n], v[j::n], a[j::n], bb[j::n], neg_a, dt_bias, work,
                                            state_slots)
        steps[spec_slots[:, j].long()] = work[state_slots.long()]
    written = spec_slots.flatten().long()
    assert torch.equal(state[others], before[others])
    assert rel(out, ref) < TOL and rel(state[written], s_ref[written]) < TOL
    # the same arithmetic compiled into another loop: equal up to rounding (bf16 outputs, fp32 states)
    assert rel(out, dec) < 1e-2 and rel(state[written], steps[written]) < 1e-5


@pytest.mark.parametrize("n", [2, 4, 9])
def test_conv1d_spec_verify_step(n: int) -> None:
    """The verify step's conv on the 122B shapes, x a column slice of the fused projection: output within
    tolerance of the fp32 reference, the snapshots exact (they are the inputs, moved), other slots untouched."""
    c = config("122B")
    ch, w, b = c.linear_conv_dim, c.linear_conv_kernel_dim, 6
    x = torch.randn(b * n, ch + c.linear_value_dim + 2 * c.linear_num_value_heads, device=DEV, dtype=BF16)[:, :ch]
    wt = torch.randn(ch, w, device=DEV, dtype=BF16) * 0.5
    num = b * (n + 1) + 3
    state_slots, spec_slots, others = _spec_slots(b, n, num)
    before = torch.randn(num, w - 1, ch, device=DEV, dtype=BF16)
    state, st_ref = before.clone(), before.float()
    out = causal_conv1d_spec(x, wt, state, state_slots, spec_slots)
    ref = causal_conv1d_spec_ref(x.float(), wt.float(), st_ref, state_slots, spec_slots)
    assert rel(out, ref) < TOL
    assert torch.equal(state.float(), st_ref) and torch.equal(state[others], before[others])


@pytest.mark.parametrize("lens", [[1], [64], [65, 1, 0, 200], [3, 128, 129, 7]])
def test_host_chunk_plan_matches_fla(lens: list[int]) -> None:
    """The GDN chunk plan built from host offsets is fla's own `prepare_chunk_indices` (empty sequences,
    exact multiples of the chunk length and one-token sequences included)."""
    from fla.ops.utils.index import prepare_chunk_indices

    offsets = [0, *torch.tensor(lens).cumsum(0).tolist()]
    ours = fla_chunk_indices(offsets, torch.device(DEV))
    theirs = prepare_chunk_indices(torch.tensor(offsets, device=DEV), FLA_CHUNK)
    assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


@pytest.mark.parametrize("t", [1, 256, 4096])
def test_fused_elementwise_on_projection_views(t: int) -> None:
    """The ops that read strided column views of the fused projections, bf16, 122B shapes: GDN gating from
    in_proj's b and a columns, the router, SiLU-and-mul and the shared-expert combination (alone and inside
    the next RMSNorm) from the MoE block's [router | shared gate | shared up | shared_expert_gate] output,
    attention's sigmoid gate."""
    c = config("122B")
    hv, h, e, si = c.linear_num_value_heads, c.hidden_size, c.num_experts, c.shared_expert_intermediate_size
    width = c.linear_conv_dim + c.linear_value_dim + 2 * hv
    proj = torch.randn(t, width, device=DEV, dtype=BF16) * 8
    b, a = proj[:, width - 2 * hv:width - hv], proj[:, width - hv:]
    neg_a = -(torch.rand(hv, device=DEV) * 15 + 1)
    dt_bias = torch.randn(hv, device=DEV)
    g, beta = gdn_gating(a, b, neg_a, dt_bias)
    g_ref, beta_ref = gdn_gating_ref(a.float(), b.float(), neg_a, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == BF16
    assert rel(g, g_ref) < 1e-5 and rel(beta, beta_ref) < TOL

    moe = torch.randn(t, e + 2 * si + 1, device=DEV, dtype=BF16) * 3
    logits, gate, up, gate_logit = moe[:, :e], moe[:, e:e + si], moe[:, e + si:e + 2 * si], moe[:, e + 2 * si:]
    w, ids = route(logits, c.num_experts_per_tok)
    w_ref, ids_ref = route_ref(logits, c.num_experts_per_tok)
    lf = logits.float()
    assert torch.equal(lf.gather(1, ids.long()), lf.gather(1, ids_ref.long())) and rel(w, w_ref) < 1e-5
    assert rel(silu_and_mul(gate, up), silu_and_mul_ref(gate.float(), up.float())) < TOL
    routed = torch.randn(t, h, device=DEV, dtype=BF16)
    shared = torch.randn(t, h, device=DEV, dtype=BF16)
    out = moe_combine(routed, shared, gate_logit)
    assert out.dtype == BF16
    assert rel(out, moe_combine_ref(routed.float(), shared.float(), gate_logit.float())) < TOL
    # the combination inside the next layer's RMSNorm: bitwise the two launches it replaces
    res = torch.randn(t, h, device=DEV, dtype=BF16) * 4
    w_norm = 1.0 + 0.1 * torch.randn(h, device=DEV)
    fused, fused_res = rms_norm_moe(routed, shared, gate_logit, w_norm, c.rms_norm_eps, res)
    two, two_res = rms_norm(out, w_norm, c.rms_norm_eps, res)
    assert torch.equal(fused, two) and torch.equal(fused_res, two_res)
    ref, ref_res = rms_norm_moe_ref(routed.float(), shared.float(), gate_logit.float(), w_norm, c.rms_norm_eps,
                                    res.float())
    assert rel(fused, ref) < TOL and rel(fused_res, ref_res) < TOL

    qg = torch.randn(t, c.num_attention_heads, 2 * c.head_dim, device=DEV, dtype=BF16) * 3
    x = torch.randn(t, c.num_attention_heads, c.head_dim, device=DEV, dtype=BF16)
    gate_half = qg[..., c.head_dim:]
    assert rel(sigmoid_mul(x, gate_half), sigmoid_mul_ref(x.float(), gate_half.float())) < TOL


@pytest.mark.parametrize("name", list(SHAPES))
def test_route(name: str) -> None:
    """Same experts as torch's softmax + topk, except where two probabilities round to (nearly) the same fp32
    value: with 3000 x 512 random logits such near-ties occur in about every other run, and either choice is
    right. So the chosen experts' logits must agree, and the ids wherever the choice is not a near-tie."""
    c = config(name)
    logits = torch.randn(3000, c.num_experts, device=DEV)
    w, ids = route(logits, c.num_experts_per_tok)
    w_ref, ids_ref = route_ref(logits, c.num_experts_per_tok)
    picked, picked_ref = logits.gather(1, ids.long()), logits.gather(1, ids_ref.long())
    assert torch.allclose(picked, picked_ref, rtol=0, atol=1e-5)
    assert int((ids != ids_ref).sum()) <= 4 and rel(w, w_ref) < 1e-5


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("t", [1, 37, 256, 409, 600, 4096])
def test_align_matches_ref(name: str, t: int) -> None:
    """The one-program alignment (up to `SMALL_PAIRS` pairs) and the multi-program one, single and split in two by pair
    count, on fresh routings (some slots of another rank) each time: its relaxed counting atomics and the -1
    fill before the scatter must leave the same blocks and segments as the reference, every time."""
    c = config(name)
    e, k = c.num_experts, c.num_experts_per_tok
    for _ in range(4):
        _, ids = route_ref(torch.randn(t, e, device=DEV), k)
        ids[torch.rand(t, k, device=DEV) < 0.05] = -1
        for bm in (16, 64):
            assert_alignment_matches(moe_align(ids, e, bm), moe_align_ref(ids, e, bm))
        for al, ref in zip(moe_align_split(ids, e, 4, 16, 4), (moe_align_ref(ids, e, 4, 1, 4),
                                                                moe_align_ref(ids, e, 16, 5))):
            assert_alignment_matches(al, ref)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("fp4", [True, False])
def test_fused_moe(name: str, fp4: bool) -> None:
    c = config(name)
    h, inter, k = c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok
    e = c.num_experts if fp4 else 64
    if fp4:
        experts = MoEWeights(random_nvfp4(e, 2 * inter, h), random_nvfp4(e, h, inter), topk_counters(h, DEV))
    else:
        experts = MoEWeights(torch.randn(e, 2 * inter, h, device=DEV, dtype=BF16) * h ** -0.5,
                             torch.randn(e, h, inter, device=DEV, dtype=BF16) * inter ** -0.5)
    paths = ("auto", "gemv", "sorted", "generic_gemv", "generic_sorted") if fp4 else ("auto", "gemv", "sorted")
    for t in (1, 3, 64, 700, 2048):
        x = torch.randn(t, h, device=DEV, dtype=BF16)
        w, ids = route_ref(torch.randn(t, e, device=DEV), k)
        ref = fused_moe_ref(x.float(), w, ids, experts)
        for path in paths if t <= 64 else ("auto",):
            out = fused_moe_launch(x, w, ids, experts, path=path)
            assert rel(out, ref) < TOL, (t, path, rel(out, ref))


@pytest.mark.parametrize("name,tp", [("397B", 8), ("122B", 4)])
def test_fused_moe_tensor_parallel_share(name: str, tp: int) -> None:
    """One rank's share of a tensor-parallel layer (I / tp features of every expert: 128 for the 397B at tp 8),
    whose tiles the tables pick by I and whose down K blocks are cut to half of I, at decode, mid and prefill
    sizes."""
    c = config(name)
    h, inter, k, e = c.hidden_size, c.moe_intermediate_size // tp, c.num_experts_per_tok, c.num_experts
    experts = MoEWeights(random_nvfp4(e, 2 * inter, h), random_nvfp4(e, h, inter), topk_counters(h, DEV))
    for t in (1, 4, 64, 256, 700, 2048):
        x = torch.randn(t, h, device=DEV, dtype=BF16)
        w, ids = route_ref(torch.randn(t, e, device=DEV), k)
        out = fused_moe_launch(x, w, ids, experts)
        assert rel(out, fused_moe_ref(x.float(), w, ids, experts)) < TOL, t


@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
def test_fused_moe_nvfp4_dtypes_and_skipped_experts(dtype: torch.dtype) -> None:
    """Every decode variant (bf16 / fp16 activations with the e4m3-converter decode and with the shift
    decode, bf16 ones, which are staged, also without the converter decode's byte permute; fp32), subnormal
    e4m3 block scales, odd token counts and expert id -1 (expert-parallel slots of other ranks) on every
    path."""
    c = config("122B")
    h, inter, k = c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok
    e = 64
    w13, w2 = random_nvfp4(e, 2 * inter, h), random_nvfp4(e, h, inter)
    for w_ in (w13, w2):
        s = w_.block_scale.float()
        s[..., ::5] *= 0.01
        w_.block_scale.copy_(s.to(torch.float8_e4m3fn))
    experts = MoEWeights(w13, w2, topk_counters(h, DEV))
    for t in (1, 5, 300):
        x = torch.randn(t, h, device=DEV, dtype=dtype)
        w, ids = route_ref(torch.randn(t, e, device=DEV), k)
        ids[0, 0] = -1
        if t > 1:
            ids[t // 2, :] = -1
        ref = fused_moe_ref(x.float(), w, ids, experts)
        decodes = ({"cvt_decode": True}, {"cvt_decode": True, "pair_decode": False}, {"cvt_decode": False})
        decodes = decodes if dtype != torch.float32 else decodes[:1]
        for path, cfgs in (("gemv", decodes), ("sorted", decodes), ("auto", decodes), ("sorted", (MIXED,))):
            for dcfg in cfgs:
                out = fused_moe_launch(x, w, ids, experts, path=path, config=dcfg)
                assert rel(out, ref) < (1e-3 if dtype == torch.float32 else TOL), (t, path, dcfg, rel(out, ref))
                if t > 1:
                    assert float(out[t // 2].float().abs().max()) == 0.0
    assert int(experts.topk_counters.abs().sum()) == 0  # the fused top-k sum re-arms its counters


@pytest.mark.parametrize("t", [1, 4, 37, 600])
def test_fused_moe_cuda_graph_replay(t: int) -> None:
    """Captured once, replayed on new inputs (same shapes): the graph's fixed grid and buffers (incl. the
    fused top-k sum's counters and the sorted path's alignment) give the right result every time."""
    c = config("122B")
    h, inter, k, e = c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok, c.num_experts
    experts = MoEWeights(random_nvfp4(e, 2 * inter, h), random_nvfp4(e, h, inter), topk_counters(h, DEV))
    x = torch.randn(t, h, device=DEV, dtype=BF16)
    w, ids = route_ref(torch.randn(t, e, device=DEV), k)
    fused_moe_launch(x, w, ids, experts)  # warm-up: compiles
    outs: list[torch.Tensor] = []
    g = capture_graph(lambda: outs.append(fused_moe_launch(x, w, ids, experts)))
    out = outs[-1]  # the captured call's output buffer, rewritten by each replay
    for _ in range(3):
        x.copy_(torch.randn(t, h, device=DEV, dtype=BF16))
        w2, ids2 = route_ref(torch.randn(t, e, device=DEV), k)
        ids2[0, -1] = -1
        w.copy_(w2)
        ids.copy_(ids2)
        g.replay()
        torch.cuda.synchronize()
        assert rel(out, fused_moe_ref(x.float(), w, ids, experts)) < TOL


def _replayed(launches: list[Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
    """The outputs of `launches` captured in one CUDA graph, poisoned with NaN, then rewritten by one replay
    (copies, so they outlive the graph): a call that reads stale inputs or skips its output shows."""
    outs: list[torch.Tensor] = []

    def run() -> None:
        outs[:] = [f() for f in launches]

    g = capture_graph(run)
    for o in outs:
        o.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    return [o.clone() for o in outs]


@pytest.mark.parametrize("t", [1, 6, 64, 300])
def test_fused_moe_pdl_matches_plain_launches(t: int) -> None:
    """PDL launches, L2 prefetch and register caps change timing only: bitwise the same outputs as plain launches, for
    calls back to back whose inputs change in between (a missing or misplaced wait would read the previous
    call's activations), eagerly and replayed from a CUDA graph."""
    if torch.cuda.get_device_capability() >= (9, 0):
        assert pdl_supported(torch.device(DEV))
    c = config("122B")
    h, inter, k, e = c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok, c.num_experts
    experts = MoEWeights(random_nvfp4(e, 2 * inter, h), random_nvfp4(e, h, inter), topk_counters(h, DEV))
    calls = []
    for _ in range(4):
        w, ids = route_ref(torch.randn(t, e, device=DEV), k)
        calls.append((torch.randn(t, h, device=DEV, dtype=BF16), w, ids))
    variants = ({"pdl": True, "gu_prefetch": True, "dn_prefetch": True}, {"pdl": True, "dn_prefetch": False},
                {"pdl": False, "gu_prefetch": True}, {"pdl": True, "gu_maxnreg": 80, "dn_maxnreg": 80})
    for path in ("gemv", "sorted", "mixed"):
        extra = MIXED if path == "mixed" else {}
        path = "sorted" if path == "mixed" else path
        plain = [fused_moe_launch(*a, experts, path=path, config={"pdl": False, "dn_prefetch": False, **extra})
                 for a in calls]
        for (x, w, ids), p in zip(calls, plain):
            assert rel(p, fused_moe_ref(x.float(), w, ids, experts)) < TOL, (path, "plain")
        for cfg in variants:
            cfg = {**cfg, **extra}
            eager = [fused_moe_launch(*a, experts, path=path, config=cfg) for a in calls]
            outs = _replayed([partial(fused_moe_launch, *a, experts, path=path, config=cfg) for a in calls])
            for i, p in enumerate(plain):
                assert torch.equal(eager[i], p), (path, cfg, i, "eager")
                assert torch.equal(outs[i], p), (path, cfg, i, "graph")


@pytest.mark.parametrize("t", [1, 2, 6])
def test_moe_pdl_entry_behind_route(t: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`pdl_entry` and the router's `pdl`: the router starts behind the kernel that writes its logits and lets
    the MoE's first kernel (stage_x or gate_up) start behind it, down / the reduce let the next call's start
    early. Each call's logits and activations are written by the kernel right ahead of the chain, so a wait
    placed after a read, or a trigger before a wait that a later kernel relies on, would read the previous
    call's ids or activations: the outputs must equal the plain launches' bitwise, eagerly and from a graph."""
    import nibble.kernels.moe_route as moe_route

    if not pdl_supported(torch.device(DEV)):
        pytest.skip("PDL needs sm_90+ and a Triton with launch_pdl")
    c = config("122B")
    h, inter, k, e = c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok, c.num_experts
    experts = MoEWeights(random_nvfp4(e, 2 * inter, h), random_nvfp4(e, h, inter), topk_counters(h, DEV))
    srcs = [(torch.randn(t, e, device=DEV), torch.randn(t, h, device=DEV, dtype=BF16)) for _ in range(4)]

    def chain(logits_src: torch.Tensor, x_src: torch.Tensor, cfg: dict) -> torch.Tensor:
        logits, x = logits_src * 1.0, x_src * 1.0
        w, ids = route(logits, k)
        return fused_moe_launch(x, w, ids, experts, path="gemv", config=cfg)

    for base in ({"cvt_decode": False}, {"cvt_decode": True}, {"cvt_decode": True, "dn_mode": "reduce"},
                 {"cvt_decode": False, "dn_mode": "fused"}):
        with monkeypatch.context() as m:
            m.setattr(moe_route, "lookup", lambda *_a: {"pdl": False})  # whatever this GPU's table says
            plain = [chain(*a, {**base, "pdl": False}) for a in srcs]
        for (ls, xs), p in zip(srcs, plain):
            w, ids = route_ref(ls, k)
            assert rel(p, fused_moe_ref(xs.float(), w, ids, experts)) < TOL, (base, "plain")
        with monkeypatch.context() as m:
            m.setattr(moe_route, "lookup", lambda *_a: {"pdl": True})
            cfg = {**base, "pdl_entry": True}
            eager = [chain(*a, cfg) for a in srcs]
            outs = _replayed([partial(chain, *a, cfg) for a in srcs])
        for i, p in enumerate(plain):
            assert torch.equal(eager[i], p), (cfg, i, "eager")
            assert torch.equal(outs[i], p), (cfg, i, "graph")


@pytest.mark.parametrize("name", ["122B", "397B"])
@pytest.mark.parametrize("t", [1, 6, 64, 300])
def test_fused_moe_tma_matches_pointer_loads(name: str, t: int) -> None:
    """Weight tiles by TMA (tuning fields `gu_tma`, `dn_tma`: units, or units and scales) change how the
    bytes arrive, not what is computed: bitwise the outputs of pointer loads on every path of the table,
    eagerly and from a CUDA graph (the descriptors travel by value in the captured launches)."""
    c = config(name)
    h, inter, k, e = c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok, c.num_experts
    experts = MoEWeights(random_nvfp4(e, 2 * inter, h), random_nvfp4(e, h, inter), topk_counters(h, DEV))
    x = torch.randn(t, h, device=DEV, dtype=BF16)
    w, ids = route_ref(torch.randn(t, e, device=DEV), k)
    if t > 1:
        ids[t // 2, 0] = -1
    for path, extra in (("auto", {}), ("gemv", {}), ("sorted", {}), ("sorted", MIXED)):
        plain = fused_moe_launch(x, w, ids, experts, path=path, config=extra)
        assert rel(plain, fused_moe_ref(x.float(), w, ids, experts)) < TOL
        for level in (1, 2):
            cfg = {**extra, **{f"{lg}{op}_tma": level for lg in ("", "lg_") for op in ("gu", "dn")}}
            assert torch.equal(fused_moe_launch(x, w, ids, experts, path=path, config=cfg), plain), (path, level)
            (out,) = _replayed([partial(fused_moe_launch, x, w, ids, experts, path=path, config=cfg)])
            assert torch.equal(out, plain), (path, level, "graph")


@pytest.mark.parametrize("n,k", [(2048, 3072), (4096, 4096), (16384, 4096), (3072, 1024)])
def test_nvfp4_linear(n: int, k: int) -> None:
    """The weight-stationary kernel in each token layout (incl. split-K and fp16 activations) and the
    first-generation kernels."""
    w = random_nvfp4(n, k)
    layouts = ({}, {"xmode": "quad", "split_k": 3}, {"xmode": "split", "slots": 16}, {"xmode": "perm", "slots": 64})
    for t in (1, 2, 16, 100, 4096):
        for dtype in (BF16, torch.float16):
            x = torch.randn(t, k, device=DEV, dtype=dtype)
            ref = nvfp4_linear_ref(x.float(), w)
            for cfg in layouts:
                assert rel(nvfp4_linear_launch(x, w, config=cfg), ref) < TOL, (t, dtype, cfg)
        for path in ("generic_auto", "generic_gemv") if t <= 2 else ("generic_auto",):
            assert rel(nvfp4_linear_launch(x, w, path=path), ref) < TOL, (t, path)


def test_select_kernels_real_122b(monkeypatch: pytest.MonkeyPatch) -> None:
    from nibble.kernels.registry import select_kernels

    c = config("122B")
    gathers = count_gathers(monkeypatch)
    kernels, report = select_kernels(c, DEV, BF16, torch.float8_e4m3fn)
    print(report.table())
    expected = {op: "triton" for op in kernels.backend_names}
    expected["gated_delta_rule"] = "fla"
    assert kernels.backend_names == expected, report.table()
    # where this GPU's table turns the FP8 scratch gather on, the self-test's long prefill went through it
    ctx = SelfTestContext(c, torch.device(DEV), BF16, torch.float8_e4m3fn, 16, torch.Generator())
    if selftest._fp8_gather_cases(ctx):
        assert gathers
