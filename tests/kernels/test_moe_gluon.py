"""The host side of the Gluon MoE gate_up (moe_gluon.py), which itself runs on sm_90 GPUs only
(tests/gpu/test_moe_gluon_gpu.py): the pair-order gather it reads (Triton, interpreter), its reference, when a
tuning entry's `gluon_bm` is taken, and its argument checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import random_nvfp4, rel_err

from nibble.kernels import moe_gluon
from nibble.kernels.fused_moe import fused_moe_launch
from nibble.kernels.moe import MoEWeights, fused_moe_ref, route_ref
from nibble.kernels.moe_align import moe_align, moe_align_ref
from nibble.kernels.moe_gluon import gate_up_ref, gluon_gate_up, gluon_tile
from nibble.kernels.w4_stage import gather_chunks, gather_chunks_ref


@pytest.mark.parametrize("t,chunk,block_m", [(5, 64, 16), (23, 128, 32)])
def test_gather_chunks(t: int, chunk: int, block_m: int) -> None:
    """Each written row is its pair's token, scaled and saturated into fp16, every chunk in the decode's slice
    order; padding rows and blocks past the end are not written, and rows of a slot routed elsewhere (-1) are
    in no block."""
    e, k, top_k, shift = 7, 2 * chunk, 3, 4
    x = torch.randn(t, k, dtype=torch.bfloat16) * 100
    x[0, 1] = 3e6
    _, ids = route_ref(torch.randn(t, e), top_k)
    ids[t // 2, 1] = -1
    al = moe_align(ids, e, block_m)
    out = gather_chunks(x, al.sorted_ids, al.block_expert, top_k, chunk, torch.float16, shift)
    ref, written = gather_chunks_ref(x, al.sorted_ids, al.block_expert, top_k, chunk, torch.float16, shift)
    assert int(written.sum()) == t * top_k - 1
    assert torch.equal(out[written], ref[written])
    row = int(torch.nonzero(al.sorted_ids == 3).flatten()[0])  # pair 3 = token 1, slot 0
    staged = (x[1].float() / 2 ** shift).to(torch.float16).view(k // chunk, chunk // 4, 4).transpose(1, 2)
    assert torch.equal(out[row], staged.reshape(k))
    with pytest.raises(ValueError, match="multiple of the chunk"):
        gather_chunks(x[:, :k - 4], al.sorted_ids, al.block_expert, top_k, chunk, torch.float16, shift)


def test_gate_up_ref_is_fused_moe_refs_first_half() -> None:
    """gate_up_ref's act, put through down and the routing weights, gives fused_moe_ref."""
    e, h, inter, t, top_k = 5, 64, 32, 9, 2
    experts = MoEWeights(random_nvfp4(e, 2 * inter, h), random_nvfp4(e, h, inter))
    x = torch.randn(t, h)
    w, ids = route_ref(torch.randn(t, e), top_k)
    ids[2, 0] = -1
    act = gate_up_ref(x, experts.w13, ids)
    assert bool((act[2 * top_k] == 0).all())
    flat = ids.view(-1).long()
    y = torch.stack([F.linear(act[p], experts.w2.select(max(int(flat[p]), 0)).dequantize()) for p in range(t * top_k)])
    y = (y * torch.where(flat >= 0, w.view(-1), 0.0)[:, None]).view(t, top_k, h).sum(1)
    assert rel_err(y, fused_moe_ref(x, w, ids, experts)) < 1e-5


def test_gluon_tile_only_where_it_can_run(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert gluon_tile({"gluon_bm": 64}, cpu, True, 3072, 1024) is None  # no sm_90 here
    monkeypatch.setattr(moe_gluon, "gluon_supported", lambda device: True)
    assert gluon_tile({}, cpu, True, 3072, 1024) is None
    assert gluon_tile({"gluon_bm": 0}, cpu, True, 3072, 1024) is None
    assert gluon_tile({"gluon_bm": 64}, cpu, False, 3072, 1024) is None  # fp32 or shift-decode activations
    assert gluon_tile({"gluon_bm": 128, "gluon_bn": 128}, cpu, True, 3072, 1024) == {
        "bm": 128, "bn": 128, "bk": 64, "stages": 3, "warps": 8, "stacked": False}
    assert gluon_tile({"gluon_bm": 64}, cpu, True, 3072, 1000) is None  # I off the 64 features of a tile
    assert gluon_tile({"gluon_bm": 64, "gluon_bk": 128}, cpu, True, 3136, 1024) is None  # H off BK
    assert gluon_tile({"gluon_bm": 64, "gluon_warps": 8}, cpu, True, 3072, 1024) is None  # 8 warps: 128 rows


def test_fused_moe_ignores_gluon_field_where_it_cannot_run() -> None:
    """On the CPU (and any GPU but sm_90) a table entry asking for the Gluon gate_up runs the Triton tiles."""
    e, h, inter, t, top_k = 4, 64, 64, 11, 2
    experts = MoEWeights(random_nvfp4(e, 2 * inter, h), random_nvfp4(e, h, inter))
    x = torch.randn(t, h)
    w, ids = route_ref(torch.randn(t, e), top_k)
    cfg = {"xmode": "perm", "block_t": 16}
    plain = fused_moe_launch(x, w, ids, experts, path="sorted", config=cfg)
    assert torch.equal(fused_moe_launch(x, w, ids, experts, path="sorted", config={**cfg, "gluon_bm": 64}), plain)


def test_gluon_gate_up_rejects_bad_arguments() -> None:
    e, h, inter, top_k = 2, 128, 64, 2
    w13 = random_nvfp4(e, 2 * inter, h)
    al = moe_align_ref(torch.zeros(3, top_k, dtype=torch.int32), e, 64)
    r = al.sorted_ids.shape[0]
    act = torch.empty(3 * top_k, inter, dtype=torch.float16)
    if not moe_gluon.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon for Hopper")
    with pytest.raises(ValueError, match="xg must be fp16"):
        gluon_gate_up(torch.empty(r, h, dtype=torch.bfloat16), w13, act, al.sorted_ids, al.block_expert)
    with pytest.raises(ValueError, match="act must have"):
        gluon_gate_up(torch.empty(r, h, dtype=torch.float16), w13, act[:, :32], al.sorted_ids, al.block_expert)
    with pytest.raises(ValueError, match="do not fit"):
        gluon_gate_up(torch.empty(r, h, dtype=torch.float16), w13, act, al.sorted_ids, al.block_expert, stages=3,
                      block_k=128)
