"""The padding of a captured mixed step (nibble/engine/mixed_graphs.py) through the Triton kernels
(interpreter, fp32): sequences without tokens and token rows past cu_seqlens[B]. The real sequences' outputs
and states must equal the reference on the unpadded batch, and a padded sequence's slot (NaN here) must not be
read into anything real and keep its contents. (That the delta-rule kernel no longer even loads and stores that
slot's state only shows in GPU timings: the value it would write back is the one it read.)"""

from __future__ import annotations

import torch
from kernel_testing import cu, rel_err

from nibble.kernels.attention import paged_attention_ref
from nibble.kernels.conv1d import causal_conv1d, causal_conv1d_ref
from nibble.kernels.gated_delta import gated_delta_rule_recurrent, gated_delta_rule_ref
from nibble.kernels.paged_attention import paged_attention_launch

LENS = [5, 1, 9]
NUM_PAD_SEQS = 2
NUM_STRAY = 7


def _padded_offsets() -> torch.Tensor:
    return cu(LENS + [0] * NUM_PAD_SEQS)


def test_gated_delta_rule_skips_empty_sequences_and_stray_tokens() -> None:
    hk, hv, dk, dv = 2, 4, 16, 24
    t = sum(LENS)
    q, k = torch.randn(t + NUM_STRAY, hk, dk), torch.randn(t + NUM_STRAY, hk, dk)
    v, g, beta = torch.randn(t + NUM_STRAY, hv, dv), -torch.rand(t + NUM_STRAY, hv), torch.rand(t + NUM_STRAY, hv)
    state = torch.randn(6, hv, dk, dv) * 0.1
    state[0] = float("nan")  # the scratch slot of the padded sequences
    s_ref, s_out = state.clone(), state.clone()
    ref = gated_delta_rule_ref(q[:t], k[:t], v[:t], g[:t], beta[:t], s_ref, cu(LENS),
                               torch.tensor([3, 5, 1], dtype=torch.int32))
    out = gated_delta_rule_recurrent(q, k, v, g, beta, s_out, _padded_offsets(),
                                     torch.tensor([3, 5, 1, 0, 0], dtype=torch.int32))
    assert rel_err(out[:t], ref) < 1e-5
    assert rel_err(s_out[1:], s_ref[1:]) < 1e-5
    assert torch.isnan(s_out[0]).all()


def test_causal_conv1d_skips_empty_sequences_and_stray_tokens() -> None:
    c, w = 19, 4
    t = sum(LENS)
    x = torch.randn(t + NUM_STRAY, c)
    weight = torch.randn(c, w)
    state = torch.randn(6, w - 1, c)
    state[0] = float("nan")
    s_ref, s_out = state.clone(), state.clone()
    ref = causal_conv1d_ref(x[:t], weight, s_ref, cu(LENS), torch.tensor([3, 5, 1], dtype=torch.int32))
    out = causal_conv1d(x, weight, s_out, _padded_offsets(), torch.tensor([3, 5, 1, 0, 0], dtype=torch.int32))
    assert rel_err(out[:t], ref) < 1e-6
    assert torch.equal(s_out[1:], s_ref[1:])
    assert torch.isnan(s_out[0]).all()


def test_causal_conv1d_stray_tokens_after_the_last_real_sequence() -> None:
    """No padded sequence: the stray rows fall into the last real sequence's offset range in the kernel's
    search, which must still leave that sequence's outputs and state exact."""
    c, w = 19, 4
    t = sum(LENS)
    x = torch.randn(t + NUM_STRAY, c)
    weight = torch.randn(c, w)
    state = torch.randn(6, w - 1, c)
    s_ref, s_out = state.clone(), state.clone()
    slots = torch.tensor([3, 5, 1], dtype=torch.int32)
    ref = causal_conv1d_ref(x[:t], weight, s_ref, cu(LENS), slots)
    out = causal_conv1d(x, weight, s_out, cu(LENS), slots)
    assert rel_err(out[:t], ref) < 1e-6
    assert torch.equal(s_out, s_ref)


def test_paged_attention_with_the_grid_of_a_larger_batch() -> None:
    page, hq, hk, d = 16, 8, 2, 32
    ctx = [0, 30, 17]
    t = sum(LENS)
    seq_lens = [a + b for a, b in zip(ctx, LENS)]
    num_blocks = sum(-(-n // page) for n in seq_lens) + 1
    kc, vc = torch.randn(num_blocks, page, hk, d), torch.randn(num_blocks, page, hk, d)
    kc[0] = float("nan")  # block 0: the padded sequences' table rows
    vc[0] = float("nan")
    table = torch.zeros(len(LENS) + NUM_PAD_SEQS, 4, dtype=torch.int32)
    nxt = 1
    for s, n in enumerate(seq_lens):
        nb = -(-n // page)
        table[s, :nb] = torch.arange(nxt, nxt + nb, dtype=torch.int32)
        nxt += nb
    q = torch.randn(t + NUM_STRAY, hq, d)
    lens = torch.tensor(seq_lens + [0] * NUM_PAD_SEQS, dtype=torch.int32)
    ref = paged_attention_ref(q[:t], kc, vc, cu(LENS), lens[:len(LENS)], table[:len(LENS)], d ** -0.5)
    for max_query_len in (16, t + NUM_STRAY):  # split-KV and plain paths, as a 16-token graph and a larger one
        out = paged_attention_launch(q, kc, vc, _padded_offsets(), lens, table, d ** -0.5,
                                     max_query_len=max_query_len, max_seq_len=4 * page)
        assert rel_err(out[:t], ref) < 1e-5
