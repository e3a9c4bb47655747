"""Each rank's share of the weights, checked in one process (no process group is needed to load): a rank
reads only its part of every split tensor, the parts of all ranks cover each tensor exactly once, other
ranks' experts are not read at all, and shapes that cannot be split fail with a clear message."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch

from nibble.checkpoint import loader
from nibble.checkpoint.loader import load_model
from nibble.kernels.kernel_set import KernelSet
from nibble.layers.moe import RoutedExperts
from nibble.layers.parallel import ParallelContext, ParallelError, Partition, read_partition
from nibble.models.config import ModelConfig

SPLIT = ("experts", "embed_tokens", "lm_head", "q_proj", "in_proj_qkv", "in_proj_z", "o_proj", "out_proj",
         "conv1d", "A_log", "dt_bias", "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj")

_ORIGINAL_GET, _ORIGINAL_LOAD = loader.ShardTensor.__getitem__, loader.ShardTensor.load


def _load_counting(model_dir: Path, parallel: ParallelContext, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Load one rank's model; returns elements read per checkpoint tensor name."""
    read: dict[str, int] = defaultdict(int)
    get, load = _ORIGINAL_GET, _ORIGINAL_LOAD

    def counting_get(self: loader.ShardTensor, index: tuple[slice, ...]) -> torch.Tensor:
        t = get(self, index)
        read[self.name] += t.numel()
        return t

    def counting_load(self: loader.ShardTensor) -> torch.Tensor:
        t = load(self)
        read[self.name] += t.numel()
        return t

    monkeypatch.setattr(loader.ShardTensor, "__getitem__", counting_get)
    monkeypatch.setattr(loader.ShardTensor, "load", counting_load)
    config = ModelConfig.from_pretrained(model_dir)
    load_model(model_dir, config, KernelSet.reference(), dtype=torch.float32, device="cpu", parallel=parallel)
    return read


@pytest.mark.parametrize("name", ["fp32", "nvfp4"])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_each_rank_reads_only_its_share(name: str, expert_parallel: bool, checkpoints: dict[str, Path],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    tp = 4
    model_dir = checkpoints[name]
    reads = [_load_counting(model_dir, ParallelContext(r, tp, expert_parallel), monkeypatch) for r in range(tp)]
    for tensor_name, tensor, _ in _all_tensors(model_dir):
        numel = tensor.numel()
        split = any(s in tensor_name for s in SPLIT) and numel > 1
        per_rank = [r.get(tensor_name, 0) for r in reads]
        if split:
            assert sum(per_rank) == numel, f"{tensor_name}: ranks read {per_rank} of {numel} elements"
            if expert_parallel and tensor_name.split(".experts.")[-1][:1].isdigit():
                continue  # one expert's tensor: read whole, by the one rank that holds the expert
            # ceil(rows / tp) rows per rank when the split is padded (a vocabulary of 254 over 4 ranks).
            rows = tensor.shape[0]
            bound = max(-(-numel // tp), -(-rows // tp) * (numel // rows))
            assert max(per_rank) <= bound, f"{tensor_name}: a rank read {max(per_rank)} of {numel}"
    if expert_parallel and name == "nvfp4":
        # Per-expert tensors of other ranks' experts are not touched at all.
        read0 = {n for n in reads[0] if ".experts." in n}
        assert read0 and all(int(n.split(".experts.")[1].split(".")[0]) < 2 for n in read0)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_dense_linear_self_test_takes_a_ranks_shapes(tp: int, checkpoints: dict[str, Path]) -> None:
    """The dense-linear start-up self-test runs the (N, K) of the 16-bit projections one tensor-parallel rank
    holds: exactly the weights of the loaded rank's Linear layers (rows as padded for cuBLAS)."""
    from nibble.kernels.selftest import dense_linear_shapes
    from nibble.layers.linear import Linear

    model_dir = checkpoints["fp32"]
    config = ModelConfig.from_pretrained(model_dir)
    model = load_model(model_dir, config, KernelSet.reference(), dtype=torch.float32, device="cpu",
                       parallel=ParallelContext(0, tp))
    held = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, Linear) and not m.quantized}
    assert set(dense_linear_shapes(config, tp)) == held


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_attention_and_gdn_self_tests_take_a_ranks_heads(tp: int, checkpoints: dict[str, Path]) -> None:
    """The attention and Gated DeltaNet start-up self-tests run the head counts one tensor-parallel rank's
    layers hold (at tp 4 the tiny model's 2 KV heads give each rank one, replicated), not the whole model's:
    a kernel's tiles follow the query heads per KV head and the heads per program."""
    from nibble.kernels.selftest import SELF_TESTS, SelfTestContext
    from nibble.layers.attention import GatedAttention
    from nibble.layers.gdn import GatedDeltaNet

    model_dir = checkpoints["fp32"]
    config = ModelConfig.from_pretrained(model_dir)
    model = load_model(model_dir, config, KernelSet.reference(), dtype=torch.float32, device="cpu",
                       parallel=ParallelContext(0, tp))
    attention = {(m.num_heads, m.num_kv_heads) for m in model.modules() if isinstance(m, GatedAttention)}
    gdn = {(m.num_k_heads, m.num_v_heads, m.conv_dim) for m in model.modules() if isinstance(m, GatedDeltaNet)}
    assert len(attention) == 1 and len(gdn) == 1

    ref = KernelSet.reference()
    seen: dict[str, set[tuple[int, ...]]] = defaultdict(set)

    def spy(op: str, shape_of):
        def fn(*args, **kwargs):
            seen[op].add(shape_of(*args))
            return getattr(ref, op)(*args, **kwargs)
        return fn

    shapes = {
        "paged_attention": lambda q, k_cache, *_: (q.shape[1], k_cache.shape[2]),
        "store_kv": lambda k, v, k_cache, *_: (k_cache.shape[2], k.shape[1]),
        "qk_rms_norm": lambda q, k, *_: (q.shape[1], k.shape[1]),
        "rope": lambda q, k, *_: (q.shape[1], k.shape[1]),
        "gated_delta_rule": lambda q, k, v, *_: (q.shape[1], v.shape[1]),
        "gated_delta_rule_decode": lambda q, k, v, *_: (q.shape[1], v.shape[1]),
        "causal_conv1d": lambda x, *_: (x.shape[1],),
        "gdn_gating": lambda a, *_: (a.shape[1],),
    }
    ctx = SelfTestContext(config, torch.device("cpu"), torch.float32, torch.float32, 16,
                          torch.Generator().manual_seed(0), tp_size=tp)
    for op, shape_of in shapes.items():
        assert SELF_TESTS[op](spy(op, shape_of), ctx) < 1e-4
    (hq, hkv), = attention
    (hk, hv, conv_dim), = gdn
    assert all(seen[op] == {(hq, hkv)} for op in ("paged_attention", "qk_rms_norm", "rope"))
    assert seen["store_kv"] == {(hkv, hkv)}
    assert seen["gated_delta_rule"] == seen["gated_delta_rule_decode"] == {(hk, hv)}
    assert seen["causal_conv1d"] == {(conv_dim,)} and seen["gdn_gating"] == {(hv,)}


def _all_tensors(model_dir: Path) -> list[tuple[str, torch.Tensor, Path]]:
    from nibble.checkpoint.safetensors_io import iter_tensors, list_shards

    return [(n, t, p) for n, t, p in iter_tensors(list_shards(model_dir))
            if not n.startswith(("model.visual.", "mtp."))]


def test_unsplittable_shapes_fail_clearly() -> None:
    with pytest.raises(ParallelError, match=r"not a multiple of 16.*--enable-expert-parallel"):
        RoutedExperts(8, 64, 64, quantized=True, dtype=torch.float32, device="meta",
                      parallel=ParallelContext(0, 8))
    with pytest.raises(ParallelError, match=r"num_experts \(expert parallelism\) \(8\) is not divisible"):
        RoutedExperts(8, 64, 64, quantized=True, dtype=torch.float32, device="meta",
                      parallel=ParallelContext(0, 3, expert_parallel=True))


def test_read_partition_of_fused_parts() -> None:
    t = torch.arange(24).reshape(12, 2)
    part = Partition.concat([Partition(4, ((2, 4),)), Partition(4, ((2, 4),)), Partition(4, ((2, 4),))])
    assert part.ranges == ((2, 4), (6, 8), (10, 12))
    assert torch.equal(read_partition(t, (part,)), t[[2, 3, 6, 7, 10, 11]])
    assert read_partition(t, (Partition.whole(12),)) is t
    assert Partition.concat([Partition.whole(3), Partition.whole(5)]).is_whole
