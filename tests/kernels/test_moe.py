"""Routing, expert alignment and fused MoE (Triton, interpreter, fp32) against the references: NVFP4
and dense experts, both paths, experts without tokens, token counts off the block sizes, chunking, expert id
-1 (expert-parallel slots of other ranks) skipped."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import poisoned, random_nvfp4, rel_err

from nibble.kernels.fp4_tiles import fp4_units
from nibble.kernels.fused_moe import fused_moe_launch
from nibble.kernels.moe import MoEWeights, fused_moe_ref, route_ref, topk_counters
from nibble.kernels.moe_align import moe_align, moe_align_ref, moe_align_split
from nibble.kernels.moe_route import route
from nibble.kernels.tma import w4_descriptors
from nibble.kernels.w4_stage import stage_x
from tests.helpers.moe_align_check import assert_alignment_matches

E, H, I, K = 6, 64, 48, 3
# the mixed sorted path: experts with up to 2 pairs in quad-4 blocks, the others in split-16 blocks
MIXED = {"mixed_max_pairs": 2, "lg_xmode": "split", "lg_block_t": 16, "lg_gu_block_n": 32, "lg_gu_block_k": 64,
         "lg_gu_warps": 4, "lg_gu_stages": 2, "lg_dn_block_n": 16, "lg_dn_block_k": 32, "lg_dn_warps": 4,
         "lg_dn_stages": 2}


@pytest.mark.parametrize("renorm", [True, False])
def test_route(renorm: bool) -> None:
    logits = torch.randn(19, 37)
    w, ids = route(logits, 5, renorm)
    w_ref, ids_ref = route_ref(logits, 5, renorm)
    assert torch.equal(ids, ids_ref) and rel_err(w, w_ref) < 1e-6


@pytest.mark.parametrize("num_valid", [0, 7, 19])
def test_route_leaves_padding_rows_unrouted(num_valid: int) -> None:
    """Rows from num_valid_tokens on (padding of a CUDA-graph batch) get expert -1 and weight 0; the others
    are routed as without the count."""
    logits = torch.randn(19, 37)
    count = torch.tensor([num_valid], dtype=torch.int32)
    w, ids = route(logits, 5, True, count)
    w_ref, ids_ref = route_ref(logits, 5, True, count)
    assert torch.equal(ids, ids_ref) and rel_err(w, w_ref) < 1e-6
    w_all, ids_all = route(logits, 5, True)
    assert torch.equal(ids[:num_valid], ids_all[:num_valid]) and torch.equal(w[:num_valid], w_all[:num_valid])
    assert bool((ids[num_valid:] == -1).all()) and bool((w[num_valid:] == 0).all())


def test_route_rejects_a_bad_count() -> None:
    with pytest.raises(ValueError, match="num_valid_tokens"):
        route(torch.randn(4, 8), 2, True, torch.tensor([3], dtype=torch.int64))


def test_route_strided_logits_of_fused_projection() -> None:
    """The router logits are the first columns of the MoE block's fused projection: read in place."""
    y = torch.randn(21, 37 + 2 * 10 + 1)
    logits = y[:, :37]
    w, ids = route(logits, 4, True)
    w_ref, ids_ref = route_ref(logits, 4, True)
    assert torch.equal(ids, ids_ref) and rel_err(w, w_ref) < 1e-6


@pytest.mark.parametrize("t,block_m,count_range", [(1, 16, (1, None)), (9, 4, (1, None)), (1400, 16, (1, None)),
                                                   (9, 4, (1, 3)), (9, 16, (4, None)), (1400, 4, (1, 470))])
def test_align(t: int, block_m: int, count_range: tuple) -> None:
    """Blocks, starts and sorted pairs as the reference's, also for alignments keeping the experts of one
    range of pair counts (the others get no blocks and none of their pairs is placed)."""
    ids = torch.randint(0, 9, (t, K), dtype=torch.int32)
    ids[ids == 4] = 5
    ids[ids == 7] = -1
    al, ref = moe_align(ids, 10, block_m, *count_range), moe_align_ref(ids, 10, block_m, *count_range)
    assert_alignment_matches(al, ref)
    for e in range(10):
        if not count_range[0] <= int(ref.expert_count[e]) <= (count_range[1] or t * K):
            assert not bool((al.block_expert == e).any())


@pytest.mark.parametrize("t", [9, 1400])
def test_align_split(t: int) -> None:
    """One count, two alignments: the same as two separate ones over complementary count ranges."""
    ids = torch.randint(0, 9, (t, K), dtype=torch.int32)
    ids[ids == 7] = -1
    split = max(1, t * K // 12)
    for al, ref in zip(moe_align_split(ids, 10, 4, 16, split),
                       (moe_align_ref(ids, 10, 4, 1, split), moe_align_ref(ids, 10, 16, split + 1))):
        assert_alignment_matches(al, ref)


def _experts(fp4: bool) -> MoEWeights:
    w13, w2 = random_nvfp4(E, 2 * I, H), random_nvfp4(E, H, I)
    return MoEWeights(w13, w2, topk_counters(H, "cpu")) if fp4 else MoEWeights(w13.dequantize(), w2.dequantize())


@pytest.mark.parametrize("fp4", [True, False])
@pytest.mark.parametrize("path,t", [("gemv", 2), ("sorted", 7), ("generic_gemv", 2), ("generic_sorted", 7)])
def test_fused_moe(fp4: bool, path: str, t: int) -> None:
    experts = _experts(fp4)
    x = torch.randn(t, H)
    w, _ = route_ref(torch.randn(t, E), K)
    ids = torch.randint(0, E - 1, (t, K), dtype=torch.int32)  # expert E-1 gets no tokens
    out = poisoned(fused_moe_launch, [((t, H), x.dtype)], x, w, ids, experts, path=path)
    assert rel_err(out, fused_moe_ref(x, w, ids, experts)) < 1e-5


@pytest.mark.parametrize("path,cfg", [
    ("gemv", {"xmode": "quad", "dn_mode": "fused"}), ("gemv", {"xmode": "split", "dn_mode": "fused"}),
    ("gemv", {"xmode": "quad", "dn_mode": "reduce"}), ("gemv", {"dn_mode": "token"}),
    # one pair per program in 1 or 2 token slots: MMAs narrower than 8 columns, padded by Triton
    ("gemv", {"xmode": "quad", "block_t": 1, "dn_mode": "fused"}),
    ("gemv", {"xmode": "quad", "block_t": 2, "dn_mode": "reduce"}),
    ("sorted", {"xmode": "quad", "block_t": 4}), ("sorted", {"xmode": "perm", "block_t": 16}),
    ("sorted", {"xmode": "split", "block_t": 16}), ("sorted", {"xmode": "split", "block_t": 32}),
    ("generic_gemv", {"gemv_dn_pairs": False}),
    ("sorted", {"xmode": "quad", "block_t": 4, **MIXED})])
def test_fused_moe_variants(path: str, cfg: dict) -> None:
    experts = _experts(True)
    x = torch.randn(3, H)
    w, ids = route_ref(torch.randn(3, E), K)
    out = fused_moe_launch(x, w, ids, experts, path=path, config=cfg)
    assert rel_err(out, fused_moe_ref(x, w, ids, experts)) < 1e-5


@pytest.mark.parametrize("path,cfg", [
    # K tails (H = 64 and I = 48 off BLOCK_K), blocks of 16 rows > an expert's pairs, odd BLOCK_N tails
    ("sorted", {"chunk_pairs": 12, "block_t": 16, "xmode": "split", "gu_block_n": 32, "gu_block_k": 128,
                "dn_block_n": 16, "dn_block_k": 64}),
    ("gemv", {"gu_block_n": 32, "gu_block_k": 128, "dn_block_n": 16, "dn_block_k": 64}),
    ("gemv", {"gu_block_n": 16, "gu_block_k": 32, "dn_block_n": 32, "dn_block_k": 16, "dn_mode": "token"}),
    ("gemv", {"xmode": "quad", "gu_block_n": 16, "gu_block_k": 32, "dn_block_n": 32, "dn_block_k": 16,
              "dn_mode": "fused"}),
    ("sorted", {"chunk_pairs": 12, "block_t": 4, "xmode": "quad", "gu_block_n": 16, "gu_block_k": 128,
                "dn_block_n": 32, "dn_block_k": 32}),
    ("sorted", {"chunk_pairs": 12, "block_t": 16, "xmode": "perm", "gu_block_n": 16, "gu_block_k": 128,
                "dn_block_n": 32, "dn_block_k": 32}),
    ("generic_sorted", {"chunk_pairs": 12, "block_m": 4, "gu_block_n": 32, "gu_block_k": 32, "dn_block_n": 16,
                        "dn_block_k": 32}),
    ("sorted", {"chunk_pairs": 18, "block_t": 4, "xmode": "quad", "gu_block_n": 16, "gu_block_k": 32,
                "dn_block_n": 32, "dn_block_k": 32, **MIXED}),
])
def test_fused_moe_chunked_and_tiles(path: str, cfg: dict) -> None:
    experts = _experts(True)
    t = 11
    x = torch.randn(t, H)
    w, ids = route_ref(torch.randn(t, E), K)
    out = fused_moe_launch(x, w, ids, experts, path=path, config=cfg)
    assert rel_err(out, fused_moe_ref(x, w, ids, experts)) < 1e-5


@pytest.mark.parametrize("fp4,path,cfg", [
    (True, "gemv", {"xmode": "quad", "dn_mode": "fused"}), (True, "gemv", {"xmode": "split", "dn_mode": "reduce"}),
    (True, "gemv", {"dn_mode": "token"}),
    (True, "sorted", {"xmode": "quad", "block_t": 4}),
    (True, "sorted", {"xmode": "perm", "block_t": 16}), (True, "sorted", {"xmode": "split", "block_t": 16}),
    (True, "generic_gemv", {}), (True, "generic_sorted", {}), (False, "gemv", {}), (False, "sorted", {}),
    (True, "sorted", {"xmode": "quad", "block_t": 4, **MIXED})])
def test_fused_moe_skips_expert_minus_one(fp4: bool, path: str, cfg: dict) -> None:
    """Slots with id -1 contribute nothing (their weights are ignored), tokens with every slot -1 give 0,
    and the result equals the reference with those slots dropped."""
    experts = _experts(fp4)
    t = 5
    x = torch.randn(t, H)
    w, ids = route_ref(torch.randn(t, E), K)
    ids[0, 1] = -1
    ids[2, :] = -1
    ids[4, 0] = -1
    out = poisoned(fused_moe_launch, [((t, H), x.dtype)], x, w, ids, experts, path=path, config=cfg)
    ref = fused_moe_ref(x, w, ids, experts)
    assert torch.equal(out[2], torch.zeros(H))
    if experts.topk_counters is not None:
        assert int(experts.topk_counters.abs().sum()) == 0  # the fused top-k sum re-arms its counters
    assert rel_err(out, ref) < 1e-5
    w_kept = torch.where(ids >= 0, w, torch.zeros_like(w))
    ids_kept = torch.where(ids >= 0, ids, torch.zeros_like(ids))
    assert rel_err(ref, fused_moe_ref(x, w_kept, ids_kept, experts)) < 1e-6


def test_fused_moe_tile_choice_counts_pairs_over_all_ranks_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under expert parallelism a rank holds E of the router's experts and gets id -1 for the others' slots: the
    tuning key's pairs per expert is T * k over all the router's experts (what a held expert gets), not over E,
    and the result is the reference's whatever tile that picks."""
    import nibble.kernels.fused_moe as fm

    keys: list[dict] = []
    real = fm.lookup
    monkeypatch.setattr(fm, "lookup", lambda op, dev, key: keys.append(key) or real(op, dev, key))
    held = _experts(True)
    experts = MoEWeights(held.w13, held.w2, held.topk_counters, num_routed_experts=4 * E)
    t = 9
    x = torch.randn(t, H)
    w, global_ids = route_ref(torch.randn(t, 4 * E), K)
    ids = torch.where(global_ids < E, global_ids, -1).to(torch.int32)  # this rank holds experts 0..E-1
    out = fused_moe_launch(x, w, ids, experts)
    assert keys[-1]["pairs_per_expert"] == t * K / (4 * E) and keys[-1]["experts"] == E
    assert rel_err(out, fused_moe_ref(x, w, ids, experts)) < 1e-5
    assert fm.tuning_key(t, H, I, E, K, True)["pairs_per_expert"] == t * K / E


@pytest.mark.parametrize("inter,table_k,launched_k", [(128, 256, 64), (256, 256, 128), (1024, 256, 256), (128, 32, 32),
                                                     (48, 256, 64)])
def test_down_k_block_at_most_half_the_intermediate_size(inter: int, table_k: int, launched_k: int) -> None:
    """A tensor-parallel rank holds I / tp features of each expert (128 for the 397B at tp 8): down's K block is
    cut to at most half of I (but not below 64), so no K step is mostly masked and the loop has two steps to
    pipeline; full layers keep the table's block."""
    import nibble.kernels.fused_moe as fm

    cfg = fm.lookup("fused_moe", "cpu", fm.tuning_key(256, 4096, inter, 512, 10, True))
    cfg["dn_block_k"] = table_k
    assert fm._tile(cfg, "", 1, 4096, inter)["dbk"] == launched_k


def test_register_caps_reach_the_launch_only_where_ptxas_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tuning fields `gu_maxnreg` / `dn_maxnreg` (and the mixed path's `lg_` ones) become Triton's `maxnreg`
    launch option of gate_up / down; at 0 (default.json's value), or under the interpreter, no cap is passed."""
    import nibble.kernels.fused_moe as fm

    cfg = fm.lookup("fused_moe", "cpu", fm.tuning_key(2, 3072, 1024, 256, 8, True))
    cfg.update({"gu_maxnreg": 80, "lg_dn_maxnreg": 96})
    monkeypatch.setattr(fm, "interpreting", lambda: False)
    tile, large = fm._tile(cfg, "", 3, 3072, 1024), fm._tile(cfg, "lg_", 3, 3072, 1024)
    assert tile["glaunch"]["maxnreg"] == 80 and "maxnreg" not in tile["dlaunch"]
    assert large["dlaunch"]["maxnreg"] == 96 and "maxnreg" not in large["glaunch"]
    assert tile["glaunch"]["num_warps"] == cfg["gu_warps"] and tile["dlaunch"]["num_warps"] == cfg["dn_warps"]
    monkeypatch.setattr(fm, "interpreting", lambda: True)
    assert "maxnreg" not in fm._tile(cfg, "", 3, 3072, 1024)["glaunch"]


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("path,t,cfg", [
    ("gemv", 3, {"dn_mode": "fused"}), ("gemv", 2, {"xmode": "split", "dn_block_k": 128}),
    ("sorted", 9, {"xmode": "quad", "block_t": 4}), ("sorted", 9, {"xmode": "split", "block_t": 16}),
    ("sorted", 9, {"xmode": "quad", "block_t": 4, **MIXED, "lg_gu_block_k": 256, "lg_dn_block_k": 256})])
def test_fused_moe_tma_weight_tiles(level: int, path: str, t: int, cfg: dict) -> None:
    """Weight tiles loaded through TMA descriptors (units, or units and scales; the scales by pointer where a
    tile's 16-byte rows are too short for a descriptor) give the reference result; the gate_up descriptor
    stacks gate and up rows of each expert."""
    e, h, inter = 5, 512, 256  # TMA needs 16-byte aligned rows: K a multiple of 256 for the scales
    experts = MoEWeights(random_nvfp4(e, 2 * inter, h), random_nvfp4(e, h, inter))
    x = torch.randn(t, h)
    w, ids = route_ref(torch.randn(t, e), K)
    cfg = {"gu_block_n": 16, "gu_block_k": 256, "dn_block_n": 32, "dn_block_k": 256, **cfg,
           **{f"{lg}{op}_tma": level for lg in ("", "lg_") for op in ("gu", "dn")}}
    out = poisoned(fused_moe_launch, [((t, h), x.dtype)], x, w, ids, experts, path=path, config=cfg)
    assert rel_err(out, fused_moe_ref(x, w, ids, experts)) < 1e-5


def test_w4_descriptors_only_where_tma_can_address() -> None:
    w = random_nvfp4(4, 64, 512)
    units, scales = fp4_units(w.packed), w.block_scale.view(torch.uint8)
    qd, sd = w4_descriptors(units, scales, 16, 256, stacked=True)
    assert qd.shape == [4, 2, 32, 128] and qd.block_shape == [1, 2, 16, 64] and sd.block_shape == [1, 2, 16, 16]
    assert w4_descriptors(units, scales, 16, 128, stacked=False)[1] is None  # 8 scale bytes per row
    w = random_nvfp4(4, 64, 48 * 4)  # rows of 96 bytes: units fine, scales (12 bytes) not
    assert w4_descriptors(fp4_units(w.packed), w.block_scale.view(torch.uint8), 16, 64, stacked=False)[1] is None
    w = random_nvfp4(4, 64, 40)  # rows of 20 bytes
    assert w4_descriptors(fp4_units(w.packed), w.block_scale.view(torch.uint8), 16, 64, stacked=False) is None
    assert w4_descriptors(units, scales, 512, 256, stacked=False) is None  # over TMA's 256 rows per box
    with pytest.raises(ValueError, match="int16 units"):
        w4_descriptors(w.packed, w.block_scale.view(torch.uint8), 16, 64, stacked=False)


def test_fused_moe_rejects_bad_shapes() -> None:
    experts = _experts(True)
    with pytest.raises(ValueError):
        fused_moe_launch(torch.randn(2, H + 16), torch.ones(2, K), torch.zeros(2, K, dtype=torch.int32), experts)
    with pytest.raises(ValueError):
        fused_moe_launch(torch.randn(2, H), torch.ones(2, K), torch.zeros(2, K, dtype=torch.int64), experts)
    with pytest.raises(ValueError, match="dn_mode 'slices'"):
        fused_moe_launch(torch.randn(2, H), torch.ones(2, K), torch.zeros(2, K, dtype=torch.int32), experts,
                         path="gemv", config={"dn_mode": "slices"})
    args = (torch.randn(2, H), torch.ones(2, K), torch.zeros(2, K, dtype=torch.int32), experts)
    with pytest.raises(ValueError, match="xmode 'quads' is not one of"):
        fused_moe_launch(*args, path="gemv", config={"xmode": "quads"})


@pytest.mark.parametrize("order", ["natural", "permute", "pairs"])
def test_stage_x(order: str) -> None:
    """fp16 staging of activations (the e4m3-converter decode's MMA input): x * 2^-shift in fp16, values
    past the fp16 range saturating, columns in the stride-4 slice order or in DEC 4's order (bits 1 and 2
    of the position within each group of 8 swapped) on request; K off the block size."""
    t, k, shift = 3, 4 * 70, 4
    permute, pairs = order == "permute", order == "pairs"
    x = torch.randn(t, k, dtype=torch.bfloat16) * 100
    x[0, 5] = 3e6  # beyond 65504 * 2^4: saturates instead of becoming inf
    x[1, 6] = -2e5  # beyond fp16, within the staged range
    out = stage_x(x, torch.float16, shift, permute, pairs=pairs)
    ref = (x.float() / 2 ** shift).clamp(-65504, 65504).to(torch.float16)
    if permute:
        ref = ref.view(t, k // 4, 4).transpose(1, 2).reshape(t, k)
    if pairs:
        ref = ref.view(t, k // 8, 2, 2, 2).transpose(2, 3).reshape(t, k)
    assert torch.equal(out, ref)
    assert torch.equal(stage_x(x, torch.bfloat16, 0, False), x)
    into = torch.empty(t, k, dtype=torch.float16)
    assert stage_x(x, torch.float16, shift, permute, out=into, pairs=pairs) is into and torch.equal(into, out)
    with pytest.raises(ValueError, match="out must be"):
        stage_x(x, torch.float16, shift, permute, out=torch.empty(t, k, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 8"):
        stage_x(x[:, :k - 4], torch.float16, shift, False, pairs=True)


def test_fused_moe_topk_counters_are_the_callers() -> None:
    """The fused top-k sum counts in the experts' own `topk_counters` and leaves them zero; without them (or
    with too few for the call) it takes the reduce launch, with the same result; a bad buffer is an error."""
    w13, w2 = random_nvfp4(E, 2 * I, H), random_nvfp4(E, H, I)
    x = torch.randn(3, H)
    w, ids = route_ref(torch.randn(3, E), K)
    cfg = {"xmode": "quad", "dn_mode": "fused", "dn_block_n": 16}
    ref = fused_moe_ref(x, w, ids, MoEWeights(w13, w2))
    outs = []
    for counters in (topk_counters(H, "cpu"), None, torch.zeros(2, dtype=torch.int32)):
        experts = MoEWeights(w13, w2, counters)
        outs.append(fused_moe_launch(x, w, ids, experts, path="gemv", config=cfg))
        assert rel_err(outs[-1], ref) < 1e-5
        if counters is not None:
            assert int(counters.abs().sum()) == 0
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    with pytest.raises(ValueError, match="topk_counters must be contiguous int32"):
        fused_moe_launch(x, w, ids, MoEWeights(w13, w2, torch.zeros(64, dtype=torch.int64)), path="gemv", config=cfg)


def test_routed_experts_own_their_topk_counters() -> None:
    """Each MoE layer allocates its own zeroed counters (no buffer shared by layers or engines), passes them
    with its weights, and keeps them out of its state dict (they are not a checkpoint tensor)."""
    from nibble.layers.moe import RoutedExperts

    layers = [RoutedExperts(E, H, I, quantized=True, dtype=torch.float32, device="cpu") for _ in range(2)]
    a, b = (layer.weights().topk_counters for layer in layers)
    assert a is not None and b is not None and a.data_ptr() != b.data_ptr()
    assert a.dtype == torch.int32 and int(a.abs().sum()) == 0 and a.numel() >= 16 * (H // 16)
    assert all("topk_counters" not in k for k in layers[0].state_dict())


@pytest.mark.parametrize("quantized", [True, False])
def test_expert_parallel_weights_name_all_routed_experts(quantized: bool) -> None:
    """An expert-parallel rank's weights hold its share of the experts and name how many the router chooses
    among, which `fused_moe` counts pairs per expert over."""
    from nibble.layers.moe import RoutedExperts
    from nibble.layers.parallel import ParallelContext

    ep = RoutedExperts(4 * E, H, I, quantized=quantized, dtype=torch.float32, device="cpu",
                       parallel=ParallelContext(1, 4, expert_parallel=True)).weights()
    assert ep.num_experts == E and ep.num_routed_experts == ep.routed_experts == 4 * E
    whole = RoutedExperts(E, H, I, quantized=quantized, dtype=torch.float32, device="cpu").weights()
    assert whole.routed_experts == whole.num_experts == E
