"""The Gluon gate_up of the MoE prefill path (moe_gluon.py, sm_90 only) on the real 122B-A10B and 397B-A17B
expert shapes, against the torch references. Run with NIBBLE_TEST_GPU=1 on an H100 / H200.

    NIBBLE_TEST_GPU=1 python -m pytest tests/gpu/test_moe_gluon_gpu.py -q
"""

from __future__ import annotations

import os

import pytest
import torch
from test_kernels_gpu import BF16, DEV, TOL, config, random_nvfp4, rel

from nibble.kernels.fp4_tiles import F16_X_SHIFT
from nibble.kernels.fused_moe import fused_moe_launch
from nibble.kernels.moe import MoEWeights, fused_moe_ref, route_ref
from nibble.kernels.moe_align import moe_align
from nibble.kernels.moe_gluon import gate_up_ref, gluon_gate_up, gluon_supported
from nibble.kernels.w4_stage import gather_chunks, gather_chunks_ref

pytestmark = pytest.mark.skipif(
    os.environ.get("NIBBLE_TEST_GPU") != "1" or not torch.cuda.is_available() or not gluon_supported(DEV),
    reason="the Gluon gate_up needs NIBBLE_TEST_GPU=1, an sm_90 GPU and Gluon's Hopper module")


def _unorder(act: torch.Tensor, perm: bool, pairs: bool) -> torch.Tensor:
    """act [P, I] written in PERM slices or DEC 4's pairs order -> natural feature order."""
    i = act.shape[1]
    n = torch.arange(i, device=act.device)
    if perm:
        col = (n % 4) * (i // 4) + n // 4
    elif pairs:
        col = (n & ~6) | ((n & 2) << 1) | ((n & 4) >> 1)
    else:
        col = n
    return act[:, col]


@pytest.mark.parametrize("name", ["122B", "397B"])
@pytest.mark.parametrize("t", [37, 1500])
def test_gather_chunks(name: str, t: int) -> None:
    c = config(name)
    x = torch.randn(t, c.hidden_size, device=DEV, dtype=BF16) * 30
    _, ids = route_ref(torch.randn(t, c.num_experts, device=DEV), c.num_experts_per_tok)
    al = moe_align(ids, c.num_experts, 64)
    out = gather_chunks(x, al.sorted_ids, al.block_expert, c.num_experts_per_tok, 64, torch.float16, F16_X_SHIFT)
    ref, written = gather_chunks_ref(x, al.sorted_ids, al.block_expert, c.num_experts_per_tok, 64, torch.float16,
                                     F16_X_SHIFT)
    assert int(written.sum()) == t * c.num_experts_per_tok
    assert torch.equal(out[written], ref[written])


@pytest.mark.parametrize("name", ["122B", "397B"])
@pytest.mark.parametrize("block_m,block_n,warps,stacked", [(16, 64, 4, False), (32, 64, 4, False), (64, 64, 4, False),
                                                           (128, 64, 4, False), (128, 128, 8, False),
                                                           (64, 64, 4, True), (128, 64, 4, True), (256, 64, 4, True)])
def test_gluon_gate_up(name: str, block_m: int, block_n: int, warps: int, stacked: bool) -> None:
    """act of every pair against silu(gate) * up on the dequantised weights, in each order the down kernel
    reads, on NaN-poisoned buffers; a slot routed to no expert here (-1) is left alone."""
    c = config(name)
    h, inter, k = c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok
    e, t = 32, 700  # fewer experts than the model: about 175 pairs each, full and ragged blocks
    w13 = random_nvfp4(e, 2 * inter, h)
    x = torch.randn(t, h, device=DEV, dtype=BF16)
    _, ids = route_ref(torch.randn(t, e, device=DEV), k)
    ids[5, 1] = -1
    ref = gate_up_ref(x.float(), w13, ids)
    al = moe_align(ids, e, block_m)
    xg = gather_chunks(x, al.sorted_ids, al.block_expert, k, 64, torch.float16, F16_X_SHIFT)
    live = ids.view(-1) >= 0
    for perm, pairs in ((False, False), (True, False), (False, True)):
        act = torch.full((t * k, inter), float("nan"), dtype=torch.float16, device=DEV)
        gluon_gate_up(xg, w13, act, al.sorted_ids, al.block_expert, block_n, 64, 3, act_perm=perm, act_pairs=pairs,
                      num_warps=warps, stacked=stacked)
        got = _unorder(act, perm, pairs).float() * 2.0 ** F16_X_SHIFT
        assert rel(got[live], ref[live]) < TOL, (perm, pairs)
        assert bool(act[~live].isnan().all())


@pytest.mark.parametrize("name", ["122B", "397B"])
@pytest.mark.parametrize("t", [700, 1500, 4096])
def test_fused_moe_with_gluon_gate_up(name: str, t: int) -> None:
    """fused_moe with the tuning field `gluon_bm` against the reference, beside the same call without it, for
    each x mode the down kernel may be in, bf16 and fp16 activations and a slot of another rank (-1)."""
    c = config(name)
    h, inter, k, e = c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok, c.num_experts
    experts = MoEWeights(random_nvfp4(e, 2 * inter, h), random_nvfp4(e, h, inter))
    w, ids = route_ref(torch.randn(t, e, device=DEV), k)
    ids[t // 2, 0] = -1
    for dtype in (BF16, torch.float16):
        x = torch.randn(t, h, device=DEV, dtype=dtype)
        ref = fused_moe_ref(x.float(), w, ids, experts)
        for extra, gluon in (({"xmode": "perm", "block_t": 64}, {"gluon_bm": 64}),
                             ({"xmode": "split", "block_t": 16}, {"gluon_bm": 64}),
                             ({"xmode": "perm", "block_t": 64}, {"gluon_bm": 128, "gluon_bn": 128}),
                             ({"xmode": "split", "block_t": 16}, {"gluon_bm": 128, "gluon_stacked": True})):
            out = fused_moe_launch(x, w, ids, experts, path="sorted", config={**extra, **gluon})
            assert rel(out, ref) < TOL, (dtype, extra, gluon, rel(out, ref))
