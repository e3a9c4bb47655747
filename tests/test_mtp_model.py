"""The MTP head (nibble/models/qwen3_5_mtp.py): loading it from tiny multimodal checkpoints (per-expert and
fused experts, BF16 and after `nibble quantize`), its output against transformers' decoder layer with the
head's definition around it (tests/helpers/tiny_models.MTPReference) on a batched prefill and decode steps,
the same split over 2 gloo ranks (tensor and expert parallel), dummy weights, and the errors for
checkpoints or configs without an MTP head."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file

from nibble.checkpoint.loader import load_model
from nibble.checkpoint.quantize import quantize_checkpoint
from nibble.checkpoint.safetensors_io import CheckpointError, iter_tensors, list_shards
from nibble.kernels.kernel_set import KernelSet
from nibble.layers.forward_batch import ForwardBatch, ModelCaches
from nibble.layers.linear import WeightLoadError
from nibble.layers.parallel import ParallelContext
from nibble.models.config import ConfigError, ModelConfig
from nibble.models.quant_config import QuantConfig
from nibble.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
from tests.helpers.tiny_models import MTPReference, make_tiny_qwen35_moe

PROMPT_LENS = [9, 3, 17, 1]
DRAFT_STEPS = 3
BLOCK_SIZE = 4
TINY = dict(multimodal=True, seed=5)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp")
    out = {"per-expert": make_tiny_qwen35_moe(root / "per-expert", **TINY),
           "fused": make_tiny_qwen35_moe(root / "fused", fused_experts=True, **TINY)}
    quantize_checkpoint(out["fused"], root / "nvfp4", progress=False)
    out["nvfp4"] = root / "nvfp4"
    return out


def _load(model_dir: Path, kernels: KernelSet | None = None, **kwargs: object) -> Qwen3_5MoeForCausalLM:
    config = ModelConfig.from_pretrained(model_dir)
    model = load_model(model_dir, config, kernels or KernelSet.reference(), dtype=torch.float32, device="cpu",
                       **kwargs)
    assert isinstance(model, Qwen3_5MoeForCausalLM)
    return model


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    return {name: t for name, t, _ in iter_tensors(list_shards(model_dir))}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_mtp_parameters_equal_checkpoint(checkpoints: dict[str, Path], layout: str,
                                         caplog: pytest.LogCaptureFixture) -> None:
    model_dir = checkpoints[layout]
    ckpt = _tensors(model_dir)
    model = _load(model_dir, num_mtp_layers=1)
    mtp = model.mtp
    assert mtp is not None and model.num_mtp_layers == 1
    config = model.config
    assert torch.equal(mtp.fc.weight, ckpt["mtp.fc.weight"]) and not mtp.fc.quantized
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        assert torch.equal(getattr(mtp, norm).weight, ckpt[f"mtp.{norm}.weight"])
    layer = mtp.layers[0]
    assert layer.layer_id == config.num_hidden_layers and layer.is_full_attention and layer.prefix == "mtp.layers.0"
    p = "mtp.layers.0"
    for norm in ("input_layernorm", "post_attention_layernorm"):
        assert torch.equal(getattr(layer, norm).weight, ckpt[f"{p}.{norm}.weight"])
    attn = layer.self_attn
    for proj in ("q_proj", "k_proj", "v_proj"):
        lin, shard = attn.qkv.locate(proj)
        assert torch.equal(lin.weight[lin.shard_rows(shard)], ckpt[f"{p}.self_attn.{proj}.weight"])
    assert torch.equal(attn.o_proj.weight, ckpt[f"{p}.self_attn.o_proj.weight"])
    assert torch.equal(attn.q_norm.weight, ckpt[f"{p}.self_attn.q_norm.weight"])
    assert torch.equal(attn.k_norm.weight, ckpt[f"{p}.self_attn.k_norm.weight"])
    mlp = layer.mlp
    for proj in ("gate", "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert_gate"):
        lin, shard = mlp.in_proj.locate(proj)
        assert torch.equal(lin.weight[lin.shard_rows(shard)], ckpt[f"{p}.mlp.{proj}.weight"])
    assert torch.equal(mlp.shared_down.weight, ckpt[f"{p}.mlp.shared_expert.down_proj.weight"])
    experts = mlp.experts
    assert not experts.quantized
    if layout == "fused":
        assert torch.equal(experts.w13, ckpt[f"{p}.mlp.experts.gate_up_proj"])
        assert torch.equal(experts.w2, ckpt[f"{p}.mlp.experts.down_proj"])
    else:
        i = config.moe_intermediate_size
        for e in range(config.num_experts):
            assert torch.equal(experts.w13[e, :i], ckpt[f"{p}.mlp.experts.{e}.gate_proj.weight"])
            assert torch.equal(experts.w13[e, i:], ckpt[f"{p}.mlp.experts.{e}.up_proj.weight"])
            assert torch.equal(experts.w2[e], ckpt[f"{p}.mlp.experts.{e}.down_proj.weight"])
    # the MTP layer is not a copy of the model's full-attention layer (the helper draws new values)
    assert not torch.equal(attn.o_proj.weight, model.layers[3].self_attn.o_proj.weight)
    assert set(model.kv_scales()) == {*config.full_attention_layers, config.num_hidden_layers}
    assert {n for n in model.expected_tensor_names() if n.startswith("mtp.")} <= {
        n for n in ckpt if n.startswith("mtp.")}

    with caplog.at_level(logging.INFO, logger="nibble.checkpoint"):
        plain = _load(model_dir)
    assert plain.mtp is None and plain.num_mtp_layers == 0
    assert set(plain.kv_scales()) == set(config.full_attention_layers)
    assert not any(n.startswith("mtp.") for n, _ in plain.named_parameters())
    assert "MTP head" in caplog.text


def _triton_kernels() -> KernelSet:
    """The reference set with the Triton kernels (interpreter on a CPU) of every op the MTP head calls but
    the dense linears and the experts."""
    from nibble.kernels import activation, attention, moe_route, norm, paged_attention, rope

    return replace(KernelSet.reference(), rms_norm=norm.rms_norm, rms_norm_moe=norm.rms_norm_moe,
                   qk_rms_norm=norm.qk_rms_norm, rope=rope.rope, store_kv=attention.store_kv,
                   paged_attention=paged_attention.paged_attention, sigmoid_mul=activation.sigmoid_mul,
                   route=moe_route.route, silu_and_mul=activation.silu_and_mul,
                   moe_combine=activation.moe_combine)


@torch.inference_mode()
@pytest.mark.parametrize(("layout", "kernels"), [("per-expert", "reference"), ("fused", "reference"),
                                                 ("nvfp4", "reference"), ("fused", "triton")])
def test_mtp_forward_matches_transformers(checkpoints: dict[str, Path], layout: str, kernels: str) -> None:
    """Prefill of 4 sequences (each row t reading prompt token t+1, the last the token sampled after the
    prompt, with the target's hidden state at t), then DRAFT_STEPS batched draft steps, each feeding the
    arg-max draft and the head's own previous output at the next position and attending to the cached MTP KV.
    """
    model_dir = checkpoints[layout]
    model = _load(model_dir, _triton_kernels() if kernels == "triton" else None, num_mtp_layers=1)
    reference = MTPReference(model_dir)
    config = model.config
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    sampled = torch.randint(0, config.vocab_size, (len(prompts),), generator=gen).tolist()
    blocks_per_seq = -(-(max(PROMPT_LENS) + DRAFT_STEPS) // BLOCK_SIZE)
    block_tables = [[1 + i + j * len(prompts) for j in range(blocks_per_seq)] for i in range(len(prompts))]
    caches = ModelCaches.allocate(config, 1 + blocks_per_seq * len(prompts), BLOCK_SIZE, len(prompts) + 1,
                                  torch.float32, torch.float32, "cpu", num_mtp_layers=1)
    slots = [4, 2, 1, 3]
    batch = ForwardBatch.build(prompts, [0] * len(prompts), block_tables, slots, BLOCK_SIZE)
    target_hidden = model(batch, caches)
    target_kv = [caches.kv[i].k.clone() for i in config.full_attention_layers]

    mtp_ids = [[*p[1:], s] for p, s in zip(prompts, sampled)]
    out = model.mtp_forward(torch.tensor([t for ids in mtp_ids for t in ids]), target_hidden, batch, caches)
    assert out.shape == target_hidden.shape
    hidden_in = list(target_hidden.split(PROMPT_LENS))
    outs = list(out.split(PROMPT_LENS))
    for i in range(len(prompts)):
        ref = reference(torch.tensor(mtp_ids[i]), hidden_in[i])
        assert _rel_err(outs[i], ref) < 1e-4, f"prefill, sequence {i}"

    context = list(PROMPT_LENS)
    for step in range(1, DRAFT_STEPS + 1):
        last = torch.stack([o[-1] for o in outs])
        drafts = model.compute_logits(last).argmax(-1)
        batch = ForwardBatch.build([[int(d)] for d in drafts], context, block_tables, slots, BLOCK_SIZE)
        got = model.mtp_forward(drafts, last, batch, caches, step=step)
        for i in range(len(prompts)):
            mtp_ids[i].append(int(drafts[i]))
            hidden_in[i] = torch.cat([hidden_in[i], last[i:i + 1]])
            ref = reference(torch.tensor(mtp_ids[i]), hidden_in[i])[-1]
            assert _rel_err(got[i], ref) < 1e-4, f"draft step {step}, sequence {i}"
            outs[i] = torch.cat([outs[i], got[i:i + 1]])
            context[i] += 1
    for i, k in zip(config.full_attention_layers, target_kv):
        assert torch.equal(caches.kv[i].k, k), f"the MTP head wrote layer {i}'s KV cache"


def test_nvfp4_checkpoint_keeps_mtp_dense(checkpoints: dict[str, Path]) -> None:
    model_dir = checkpoints["nvfp4"]
    hf_quant = json.loads((model_dir / "hf_quant_config.json").read_text())["quantization"]
    assert "mtp*" in hf_quant["exclude_modules"]
    ckpt = _tensors(model_dir)
    mtp_names = [n for n in ckpt if n.startswith("mtp.")]
    assert mtp_names and all(ckpt[n].dtype == torch.float32 for n in mtp_names)
    src = _tensors(checkpoints["fused"])
    assert all(torch.equal(ckpt[n], src[n]) for n in mtp_names)

    model = _load(model_dir, num_mtp_layers=1)
    assert model.mtp is not None
    experts = model.mtp.layers[0].mlp.experts
    assert not experts.quantized and experts.w13.dtype == torch.float32
    assert all(layer.mlp.experts.quantized for layer in model.layers)
    assert not model.mtp.fc.quantized and model.mtp.fc.weight.dtype == torch.float32


def test_fc_follows_checkpoint_when_exclude_list_misses_it(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """nvidia/Qwen3.5-397B-A17B-NVFP4 excludes only `mtp.layers.0*`, which does not cover the BF16
    `mtp.fc`: the head must still load it dense."""
    model_dir = tmp_path / "nvfp4"
    model_dir.mkdir()
    for f in checkpoints["nvfp4"].iterdir():
        (model_dir / f.name).write_bytes(f.read_bytes())
    path = model_dir / "hf_quant_config.json"
    raw = json.loads(path.read_text())
    raw["quantization"]["exclude_modules"] = [e for e in raw["quantization"]["exclude_modules"] if e != "mtp*"]
    path.write_text(json.dumps(raw))
    config = ModelConfig.from_pretrained(model_dir)
    assert config.quant is not None and config.quant.is_quantized("mtp.fc")
    model = _load(model_dir, num_mtp_layers=1)
    assert model.mtp is not None and not model.mtp.fc.quantized
    assert torch.equal(model.mtp.fc.weight, _tensors(model_dir)["mtp.fc.weight"])
    assert not model.mtp.layers[0].mlp.experts.quantized

    # a config that quantizes the whole head: fc is built NVFP4 and turns dense on meeting a BF16 weight
    everything = replace(config, quant=QuantConfig("NVFP4", 16, exclude_modules=()))
    model = Qwen3_5MoeForCausalLM(everything, KernelSet.reference(), torch.float32, "cpu", num_mtp_layers=1)
    assert model.mtp is not None and model.mtp.fc.quantized
    fc = torch.randn(config.hidden_size, 2 * config.hidden_size)
    model.load_weights([("mtp.fc.weight", fc)])
    assert not model.mtp.fc.quantized and torch.equal(model.mtp.fc.weight, fc)
    assert "mtp.fc.weight" in model.expected_tensor_names()
    with pytest.raises(WeightLoadError, match=r"'mtp\.fc\.weight_scale_2': NVFP4 tensor.*dense"):
        model.load_weights([("mtp.fc.weight_scale_2", torch.tensor(1.0))])


def test_model_mtp_prefix_is_read_as_mtp(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    src = checkpoints["per-expert"]
    dst = tmp_path / "renamed"
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = {("model." + n if n.startswith("mtp.") else n): t.contiguous() for n, t in _tensors(src).items()}
    save_file(tensors, str(dst / "model.safetensors"))
    model = _load(dst, num_mtp_layers=1)
    assert model.mtp is not None
    assert torch.equal(model.mtp.norm.weight, tensors["model.mtp.norm.weight"])


def test_missing_mtp_tensor_is_reported(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    src = checkpoints["per-expert"]
    dst = tmp_path / "incomplete"
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    dropped = ("mtp.norm.weight", "mtp.layers.0.mlp.experts.3.up_proj.weight")
    save_file({n: t.contiguous() for n, t in _tensors(src).items() if n not in dropped},
              str(dst / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"mtp\.norm\.weight.*mtp\.layers\.0\.mlp\.experts\.3\.up_proj"):
        _load(dst, num_mtp_layers=1)
    assert _load(dst).mtp is None


@torch.inference_mode()
def test_dummy_weights_fill_the_mtp_head(checkpoints: dict[str, Path]) -> None:
    model = _load(checkpoints["nvfp4"], num_mtp_layers=1, load_format="dummy")
    assert model.mtp is not None
    for name, p in model.mtp.named_parameters():
        assert torch.isfinite(p.float()).all(), name
        if p.dim() >= 2:
            assert p.float().abs().sum() > 0, name
    config = model.config
    caches = ModelCaches.allocate(config, 4, BLOCK_SIZE, 2, torch.float32, torch.float32, "cpu", num_mtp_layers=1)
    batch = ForwardBatch.build([[1, 2, 3]], [0], [[1]], [1], BLOCK_SIZE)
    hidden = model(batch, caches)
    out = model.mtp_forward(torch.tensor([2, 3, 4]), hidden, batch, caches)
    assert out.shape == (3, config.hidden_size) and torch.isfinite(out).all()


def test_checkpoint_without_mtp_tensors_is_refused(tmp_path: Path) -> None:
    model_dir = make_tiny_qwen35_moe(tmp_path / "text", config_overrides={"mtp_num_hidden_layers": 1})
    assert ModelConfig.from_pretrained(model_dir).mtp_num_hidden_layers == 1
    with pytest.raises(CheckpointError, match=r"text.*no 'mtp\.\*' tensors.*speculative decoding with MTP"):
        _load(model_dir, num_mtp_layers=1)


def test_config_without_mtp_layers_is_refused(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    text_only = make_tiny_qwen35_moe(tmp_path / "text")
    assert ModelConfig.from_pretrained(text_only).mtp_num_hidden_layers == 0
    with pytest.raises(ConfigError, match=r"config\.json.*mtp_num_hidden_layers is 0"):
        _load(text_only, num_mtp_layers=1)
    with pytest.raises(ConfigError, match=r"2 MTP layer.*mtp_num_hidden_layers is 1"):
        _load(checkpoints["per-expert"], num_mtp_layers=2)


def test_mtp_without_head(checkpoints: dict[str, Path]) -> None:
    model = _load(checkpoints["per-expert"])
    with pytest.raises(RuntimeError, match="without an MTP head"):
        model.mtp_forward(torch.tensor([1]), torch.zeros(1, model.config.hidden_size), None, None)  # type: ignore[arg-type]
    with pytest.raises(WeightLoadError, match=r"'mtp\.norm\.weight'.*num_mtp_layers=0"):
        model.load_weights([("mtp.norm.weight", torch.zeros(model.config.hidden_size))])


@torch.inference_mode()
def _draft_run(model: Qwen3_5MoeForCausalLM) -> dict[str, torch.Tensor]:
    """Target prefill, MTP prefill and DRAFT_STEPS batched draft steps: {'hidden': the head's outputs
    [T + num_seqs * DRAFT_STEPS, H], 'drafts': int64 [DRAFT_STEPS, num_seqs]}."""
    config = model.config
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    blocks_per_seq = -(-(max(PROMPT_LENS) + DRAFT_STEPS) // BLOCK_SIZE)
    block_tables = [[1 + i + j * len(prompts) for j in range(blocks_per_seq)] for i in range(len(prompts))]
    caches = ModelCaches.allocate(config, 1 + blocks_per_seq * len(prompts), BLOCK_SIZE, len(prompts) + 1,
                                  torch.float32, torch.float32, "cpu", **model.cache_dims(), num_mtp_layers=1)
    batch = ForwardBatch.build(prompts, [0] * len(prompts), block_tables, [1, 2, 3, 4], BLOCK_SIZE)
    hidden = model(batch, caches)
    sampled = model.compute_logits(hidden[batch.logits_indices]).argmax(-1)
    ids = [t for p, s in zip(prompts, sampled.tolist()) for t in (*p[1:], s)]
    out = model.mtp_forward(torch.tensor(ids), hidden, batch, caches)
    outs, drafts = [out], []
    last, context = out[batch.logits_indices], list(PROMPT_LENS)
    for step in range(1, DRAFT_STEPS + 1):
        draft = model.compute_logits(last).argmax(-1)
        batch = ForwardBatch.build([[int(d)] for d in draft], context, block_tables, [1, 2, 3, 4], BLOCK_SIZE)
        last = model.mtp_forward(draft, last, batch, caches, step=step)
        outs.append(last)
        drafts.append(draft)
        context = [c + 1 for c in context]
    return {"hidden": torch.cat(outs), "drafts": torch.stack(drafts)}


def _tp_rank(rank: int, world: int, port: int, cases: list[tuple[str, str, bool]], out: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    results = {}
    for name, model_dir, expert_parallel in cases:
        parallel = ParallelContext(tp_rank=rank, tp_size=world, expert_parallel=expert_parallel,
                                   group=dist.group.WORLD, cpu_group=dist.group.WORLD)
        results[name] = _draft_run(_load(Path(model_dir), parallel=parallel, num_mtp_layers=1))
    if rank == 0:
        torch.save(results, out)
    dist.barrier()  # both ranks leave together (see tests/parallel/rank_main.py)
    dist.destroy_process_group()


def test_mtp_tensor_parallel_matches_single_process(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    world = 2
    cases = [(f"{layout}-{mode}", str(checkpoints[layout]), mode == "ep")
             for layout in ("fused", "nvfp4") for mode in ("tp", "ep")]
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    mp.spawn(_tp_rank, args=(world, store.port, cases, str(tmp_path / "out.pt")), nprocs=world)
    results = torch.load(tmp_path / "out.pt")
    for layout in ("fused", "nvfp4"):
        ref = _draft_run(_load(checkpoints[layout], num_mtp_layers=1))
        for mode in ("tp", "ep"):
            got = results[f"{layout}-{mode}"]
            assert torch.equal(got["drafts"], ref["drafts"]), f"{layout}-{mode}: drafts differ"
            err = float((got["hidden"] - ref["hidden"]).abs().max())
            assert err < 1e-5, f"{layout}-{mode}: MTP outputs differ by {err:.2e}"
