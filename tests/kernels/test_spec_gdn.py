"""The GDN layer's speculative-verify ops (Triton, interpreter, fp32): every sequence runs n tokens and leaves
its state after each in a snapshot slot. Triton against the references, the references against n one-token
steps of the decode references, the starting slot reused for the first snapshot, strided inputs, and
nothing written outside the snapshot slots."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import poisoned, rel_err

from nibble.kernels.conv1d import causal_conv1d, causal_conv1d_ref, causal_conv1d_spec, causal_conv1d_spec_ref
from nibble.kernels.gated_delta import (
    gated_delta_rule_decode,
    gated_delta_rule_decode_ref,
    gated_delta_rule_spec,
    gated_delta_rule_spec_ref,
)
from nibble.kernels.selftest import SELF_TESTS, SelfTestContext, SelfTestFailure
from nibble.models.config import ModelConfig

HK, HV, DK, DV = 2, 6, 24, 40
C, W = 37, 4


def _slots(b: int, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(state_slots int32 [b], spec_slots int32 [b, n], pool size): distinct slots in random order, except
    that sequence 0's first snapshot goes to its own starting slot; two slots of the pool are in neither."""
    num = b * (n + 1) + 2
    perm = torch.randperm(num)
    state = perm[:b]
    spec = perm[b:b + b * n].view(b, n).clone()
    spec[0, 0] = state[0]
    return state.to(torch.int32), spec.to(torch.int32), num


def _poison_snapshots(pool: torch.Tensor, state_slots: torch.Tensor, spec_slots: torch.Tensor) -> torch.Tensor:
    """NaN into the snapshot slots that no sequence starts from, so that one left unwritten shows."""
    fresh = sorted(set(spec_slots.flatten().tolist()) - set(state_slots.tolist()))
    pool[fresh] = float("nan")
    return pool


def _check_pool(pool: torch.Tensor, expected: torch.Tensor, before: torch.Tensor, spec_slots: torch.Tensor,
                tol: float) -> None:
    written = sorted(set(spec_slots.flatten().tolist()))
    others = [i for i in range(pool.shape[0]) if i not in written]
    assert torch.equal(pool[others], before[others]), "wrote outside the snapshot slots"
    assert rel_err(pool[written], expected[written]) <= tol


def _gdn_inputs(t: int) -> tuple[torch.Tensor, ...]:
    """q, k, v as head views of one mixed row (the conv output), a and b as strided columns of in_proj's."""
    mixed = torch.randn(t, 2 * HK * DK + HV * DV)
    q = mixed[:, :HK * DK].view(t, HK, DK)
    k = mixed[:, HK * DK:2 * HK * DK].view(t, HK, DK)
    v = mixed[:, 2 * HK * DK:].view(t, HV, DV)
    proj = torch.randn(t, 2 * HV + 3) * 12
    b, a = proj[:, :HV], proj[:, HV + 3:]
    neg_a, dt_bias = -torch.empty(HV).uniform_(1.0, 16.0), torch.randn(HV)
    return q, k, v, a, b, neg_a, dt_bias


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("b", [1, 3])
def test_gated_delta_rule_spec(b: int, n: int) -> None:
    torch.manual_seed(100 * b + n)
    state_slots, spec_slots, num = _slots(b, n)
    q, k, v, a, bb, neg_a, dt_bias = _gdn_inputs(b * n)
    before = _poison_snapshots(torch.randn(num, HV, DK, DV) * 0.1, state_slots, spec_slots)

    pool_ref = before.clone()
    ref = gated_delta_rule_spec_ref(q, k, v, a, bb, neg_a, dt_bias, pool_ref, state_slots, spec_slots)

    # n one-token decode steps on a working copy of the pool, the state copied out after each
    work, expected = before.clone(), before.clone()
    steps = torch.empty_like(ref)
    for j in range(n):
        steps[j::n] = gated_delta_rule_decode_ref(q[j::n], k[j::n], v[j::n], a[j::n], bb[j::n], neg_a, dt_bias,
                                                  work, state_slots)
        expected[spec_slots[:, j].long()] = work[state_slots.long()]
    assert torch.equal(ref, steps)
    _check_pool(pool_ref, expected, before, spec_slots, 0.0)

    pool = before.clone()
    out = poisoned(gated_delta_rule_spec, [(tuple(v.shape), v.dtype)], q, k, v, a, bb, neg_a, dt_bias, pool,
                   state_slots, spec_slots)
    assert rel_err(out, ref) < 1e-5
    _check_pool(pool, expected, before, spec_slots, 1e-5)


def test_gated_delta_rule_spec_of_one_token_into_its_own_slot_is_decode() -> None:
    """n = 1 with the snapshot in the starting slot is the decode step, bit for bit."""
    torch.manual_seed(1)
    q, k, v, a, bb, neg_a, dt_bias = _gdn_inputs(3)
    pool = torch.randn(5, HV, DK, DV) * 0.1
    slots = torch.tensor([4, 0, 2], dtype=torch.int32)
    p_spec, p_dec = pool.clone(), pool.clone()
    out = gated_delta_rule_spec(q, k, v, a, bb, neg_a, dt_bias, p_spec, slots, slots[:, None])
    dec = gated_delta_rule_decode(q, k, v, a, bb, neg_a, dt_bias, p_dec, slots)
    assert torch.equal(out, dec) and torch.equal(p_spec, p_dec)


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("b", [1, 3])
def test_causal_conv1d_spec(b: int, n: int) -> None:
    torch.manual_seed(100 * b + n)
    state_slots, spec_slots, num = _slots(b, n)
    t = b * n
    x = torch.randn(t, C + 9)[:, 5:5 + C]
    w = torch.randn(C, W)
    before = _poison_snapshots(torch.randn(num, W - 1, C), state_slots, spec_slots)

    pool_ref = before.clone()
    ref = causal_conv1d_spec_ref(x, w, pool_ref, state_slots, spec_slots)

    work, expected = before.clone(), before.clone()
    steps = torch.empty_like(ref)
    one_each = torch.arange(b + 1, dtype=torch.int32)
    for j in range(n):
        steps[j::n] = causal_conv1d_ref(x[j::n], w, work, one_each, state_slots)
        expected[spec_slots[:, j].long()] = work[state_slots.long()]
    assert torch.equal(ref, steps)
    _check_pool(pool_ref, expected, before, spec_slots, 0.0)

    pool = before.clone()
    out = poisoned(causal_conv1d_spec, [((t, C), x.dtype)], x, w, pool, state_slots, spec_slots)
    assert rel_err(out, ref) < 1e-6
    # the snapshots are the inputs themselves, moved: exact
    _check_pool(pool, expected, before, spec_slots, 0.0)


def test_causal_conv1d_spec_of_one_token_into_its_own_slot_is_decode() -> None:
    torch.manual_seed(2)
    x, w = torch.randn(3, C), torch.randn(C, W)
    pool = torch.randn(5, W - 1, C)
    slots = torch.tensor([4, 0, 2], dtype=torch.int32)
    p_spec, p_dec = pool.clone(), pool.clone()
    out = causal_conv1d_spec(x, w, p_spec, slots, slots[:, None])
    dec = causal_conv1d(x, w, p_dec, torch.arange(4, dtype=torch.int32), slots)
    assert rel_err(out, dec) < 1e-6 and torch.equal(p_spec, p_dec)


def test_bad_shapes_are_refused() -> None:
    q, k, v, a, bb, neg_a, dt_bias = _gdn_inputs(6)
    ssm = torch.zeros(9, HV, DK, DV)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    spec = torch.tensor([[2, 3, 4], [5, 6, 7]], dtype=torch.int32)
    gdn = (q, k, v, a, bb, neg_a, dt_bias, ssm)
    with pytest.raises(ValueError, match=r"6 tokens, expected B \* n = 2 \* 2 = 4"):
        gated_delta_rule_spec(*gdn, slots, spec[:, :2])
    with pytest.raises(ValueError, match=r"spec_slots must be int32 \[B=2, n >= 1\]"):
        gated_delta_rule_spec(*gdn, slots, spec.long())
    with pytest.raises(ValueError, match=r"spec_slots must be int32 \[B=2"):
        gated_delta_rule_spec(*gdn, slots, spec[:1])
    with pytest.raises(ValueError, match="state_slots must be int32"):
        gated_delta_rule_spec(*gdn, slots[:, None], spec)
    with pytest.raises(ValueError, match=r"a \(6, 5\) and b \(6, 6\) must be \[6, Hv\]"):
        gated_delta_rule_spec(q, k, v, a[:, :5], bb, neg_a, dt_bias, ssm, slots, spec)
    with pytest.raises(ValueError, match="neg_A"):
        gated_delta_rule_spec(q, k, v, a, bb, neg_a.double(), dt_bias, ssm, slots, spec)
    with pytest.raises(ValueError, match="ssm_state"):
        gated_delta_rule_spec(q, k, v, a, bb, neg_a, dt_bias, ssm[:, :, :8], slots, spec)

    x, w, conv = torch.randn(6, C), torch.randn(C, W), torch.zeros(9, W - 1, C)
    with pytest.raises(ValueError, match=r"causal_conv1d_spec: 6 tokens, expected B \* n = 2 \* 2 = 4"):
        causal_conv1d_spec(x, w, conv, slots, spec[:, :2])
    with pytest.raises(ValueError, match="causal_conv1d_spec: spec_slots must be int32"):
        causal_conv1d_spec(x, w, conv, slots, spec.long())
    with pytest.raises(ValueError, match=r"causal_conv1d_spec: conv_state \(9, 2, 37\) must be \[slots, 3, 37\]"):
        causal_conv1d_spec(x, w, conv[:, 1:], slots, spec)
    with pytest.raises(ValueError, match="causal_conv1d_spec: x must be"):
        causal_conv1d_spec(x.t(), w, conv, slots, spec)


def _writes_back_the_last_state(fn):
    def wrapped(*args):
        out = fn(*args)
        pool, state_slots, spec_slots = args[-3:]
        pool[state_slots.long()] = pool[spec_slots[:, -1].long()]
        return out
    return wrapped


def _skips_the_last_snapshot(fn):
    def wrapped(*args):
        pool, state_slots, spec_slots = args[-3:]
        scratch = pool.clone()
        out = fn(*args[:-3], scratch, state_slots, spec_slots)
        kept = spec_slots[:, :-1].flatten().long()
        pool[kept] = scratch[kept]
        return out
    return wrapped


@pytest.mark.parametrize("op, ref", [("gated_delta_rule_spec", gated_delta_rule_spec_ref),
                                     ("causal_conv1d_spec", causal_conv1d_spec_ref)])
def test_self_tests_check_the_snapshot_slots(op: str, ref) -> None:
    """The start-up self-tests pass the reference and the Triton kernel, and fail a kernel that also writes
    its final state to the starting slot (a decode kernel's habit) or leaves a snapshot unwritten."""
    cfg = ModelConfig.from_dict({
        "architectures": ["Qwen3_5MoeForCausalLM"], "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": HK,
        "linear_num_value_heads": HV, "linear_key_head_dim": DK, "linear_value_head_dim": DV,
        "linear_conv_kernel_dim": W, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32})
    gen = torch.Generator().manual_seed(0)
    ctx = SelfTestContext(cfg, torch.device("cpu"), torch.float32, torch.float32, 16, gen)
    test = SELF_TESTS[op]
    triton_fn = gated_delta_rule_spec if op == "gated_delta_rule_spec" else causal_conv1d_spec
    assert test(ref, ctx) == 0.0
    assert test(triton_fn, ctx) < 1e-5
    with pytest.raises(SelfTestFailure, match="wrote outside the snapshot slots"):
        test(_writes_back_the_last_state(ref), ctx)
    with pytest.raises(SelfTestFailure, match="non-finite"):
        test(_skips_the_last_snapshot(ref), ctx)
