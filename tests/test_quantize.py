"""`nibble quantize` (nibble.checkpoint.quantize) and the safetensors pieces it is built on, checked against
NVIDIA ModelOpt: its NVFP4QTensor for every quantized tensor, and its real HF export of the same model."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from nibble.checkpoint.quantize import QuantizeError, add_cli_args, quantize_checkpoint, run_cli
from nibble.checkpoint.safetensors_io import (
    INDEX_FILE,
    CheckpointError,
    CheckpointReader,
    ShardWriter,
    iter_tensors,
    list_shards,
    parse_size,
)
from nibble.formats.nvfp4 import dequantize
from nibble.models.config import ModelConfig
from nibble.models.quant_config import QuantConfig, normalize_module_name
from tests.helpers.tiny_models import load_dequantized_reference, make_tiny_qwen35_moe

PROJS = ("gate_proj", "up_proj", "down_proj")
TOKENIZER_STUBS = {"tokenizer.json": "{}", "tokenizer_config.json": "{}", "chat_template.jinja": "{{ x }}",
                   "preprocessor_config.json": "{}"}
SOURCES = {
    "text": dict(dtype=torch.bfloat16),
    "text_fused_fp32": dict(dtype=torch.float32, fused_experts=True),
    "mm_fused_sharded": dict(dtype=torch.bfloat16, multimodal=True, fused_experts=True, max_shard_size="100KB"),
    "mm": dict(dtype=torch.bfloat16, multimodal=True),
}


@pytest.fixture(scope="module")
def Q():
    """ModelOpt's NVFP4QTensor (importing modelopt takes ~10 s, so once per module)."""
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    return qtensor.NVFP4QTensor


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("src")
    out = {}
    for name, kwargs in SOURCES.items():
        out[name] = make_tiny_qwen35_moe(root / name, **kwargs)
    for file, text in TOKENIZER_STUBS.items():
        (out["text"] / file).write_text(text)
    return out


@pytest.fixture(scope="module")
def quantized(sources, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nvfp4")
    out = {}
    for name, src in sources.items():
        quantize_checkpoint(src, root / name, max_shard_size="150KB", progress=name == "mm")
        out[name] = root / name
    return out


def read_all(model_dir: Path) -> dict[str, torch.Tensor]:
    return {name: t for name, t, _ in iter_tensors(list_shards(model_dir))}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def source_experts(src: dict[str, torch.Tensor], base: str, expert: int) -> dict[str, torch.Tensor]:
    """The source weights of one expert, from either per-expert or fused tensors."""
    if f"{base}.gate_up_proj" in src:
        gate_up = src[f"{base}.gate_up_proj"][expert]
        inter = gate_up.shape[0] // 2
        return {"gate_proj": gate_up[:inter], "up_proj": gate_up[inter:], "down_proj": src[f"{base}.down_proj"][expert]}
    return {p: src[f"{base}.{expert}.{p}.weight"] for p in PROJS}


def expert_bases(config: ModelConfig) -> list[str]:
    return [f"{config.checkpoint_prefix}layers.{i}.mlp.experts" for i in range(config.num_hidden_layers)]


def is_expert_source(name: str) -> bool:
    return ".mlp.experts." in name and not name.startswith("mtp.")


@pytest.mark.parametrize("name", list(SOURCES))
def test_expert_tensors_bit_identical_to_modelopt(Q, sources, quantized, name):
    src, dst = read_all(sources[name]), read_all(quantized[name])
    config = ModelConfig.from_pretrained(sources[name])
    for base in expert_bases(config):
        for e in range(config.num_experts):
            weights = source_experts(src, base, e)
            shared = Q.get_weights_scaling_factor_2(torch.cat([weights["gate_proj"], weights["up_proj"]]))
            for proj in PROJS:
                module = f"{base}.{e}.{proj}"
                scale_2 = shared if proj != "down_proj" else None
                ref_q, ref_scale, ref_scale_2 = Q.quantize(weights[proj].clone(), 16, weights_scaling_factor_2=scale_2)
                assert torch.equal(dst[f"{module}.weight"], ref_q._quantized_data), module
                assert dst[f"{module}.weight_scale"].dtype == torch.float8_e4m3fn
                assert torch.equal(bits(dst[f"{module}.weight_scale"]), bits(ref_scale)), module
                assert dst[f"{module}.weight_scale_2"].shape == () and dst[f"{module}.input_scale"].shape == ()
                assert torch.equal(bits(dst[f"{module}.weight_scale_2"]), bits(ref_scale_2.reshape(()))), module
                assert float(dst[f"{module}.input_scale"]) == 1.0


@pytest.mark.parametrize("name", list(SOURCES))
def test_other_tensors_copied_unchanged_and_nothing_else_written(sources, quantized, name):
    src, dst = read_all(sources[name]), read_all(quantized[name])
    config = ModelConfig.from_pretrained(sources[name])
    expected = {n for n in src if not is_expert_source(n)}
    for base in expert_bases(config):
        for e in range(config.num_experts):
            for proj in PROJS:
                expected |= {f"{base}.{e}.{proj}.{s}"
                             for s in ("weight", "weight_scale", "weight_scale_2", "input_scale")}
    assert set(dst) == expected
    for n, t in src.items():
        if not is_expert_source(n):
            assert dst[n].dtype == t.dtype and torch.equal(bits(dst[n]), bits(t)), n


@pytest.mark.parametrize("name", list(SOURCES))
def test_exclude_list_agrees_with_tensors_and_configs(sources, quantized, name):
    """Every 2-D weight is NVFP4 exactly when the written exclude list says so (lm_head, embeddings, routers,
    vision tower and MTP included), and config.json carries the same list."""
    dst = read_all(quantized[name])
    hf_quant = json.loads((quantized[name] / "hf_quant_config.json").read_text())["quantization"]
    assert hf_quant["quant_algo"] == "NVFP4" and hf_quant["group_size"] == 16
    rules = QuantConfig.from_model_dir(quantized[name], {})
    for n, t in dst.items():
        if n.endswith(".weight") and (t.ndim == 2):
            assert rules.is_quantized(n[: -len(".weight")]) == (t.dtype == torch.uint8), n
    src_config = json.loads((sources[name] / "config.json").read_text())
    dst_config = json.loads((quantized[name] / "config.json").read_text())
    qc = dst_config.pop("quantization_config")
    assert dst_config == src_config
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4"
    assert qc["ignore"] == hf_quant["exclude_modules"]
    loaded = ModelConfig.from_pretrained(quantized[name])
    assert loaded.quant is not None and loaded.quant.exclude_modules == tuple(hf_quant["exclude_modules"])
    if SOURCES[name].get("multimodal"):
        assert {"model.visual*", "mtp*", "mtp.layers.0*"} <= set(hf_quant["exclude_modules"])


@pytest.mark.parametrize("name", list(SOURCES))
def test_index_and_shards_consistent(quantized, name):
    dst = quantized[name]
    index = json.loads((dst / INDEX_FILE).read_text())
    files = sorted(p.name for p in dst.glob("*.safetensors"))
    assert files == sorted(set(index["weight_map"].values()))
    assert all(f == f"model-{i:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files, 1))
    assert not list(dst.glob("*.partial"))
    total = 0
    for name_, t, path in iter_tensors(list_shards(dst)):
        assert index["weight_map"][name_] == path.name
        total += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == total == sum(
        t.numel() * t.element_size() for t in read_all(dst).values())
    assert len(files) > 1


def test_tokenizer_files_copied(sources, quantized):
    for file, text in TOKENIZER_STUBS.items():
        assert (quantized["text"] / file).read_text() == text
    assert (quantized["text"] / "generation_config.json").is_file()


def test_matches_modelopt_hf_export(sources, quantized, tmp_path):
    """ModelOpt's own experts-only NVFP4 export of the same model gives the same tensors and exclude list
    (input_scale aside: ModelOpt calibrates it, nibble writes 1.0)."""
    mtq = pytest.importorskip("modelopt.torch.quantization")
    export = pytest.importorskip("modelopt.torch.export")
    import transformers

    model = transformers.Qwen3_5MoeForCausalLM.from_pretrained(sources["text"], dtype=torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    model = mtq.quantize(model, mtq.NVFP4_EXPERTS_ONLY_CFG, lambda m: m(ids))
    export.export_hf_checkpoint(model, export_dir=tmp_path / "modelopt")
    ref = {normalize_module_name(n): t for n, t in read_all(tmp_path / "modelopt").items()}
    ours = {normalize_module_name(n): t for n, t in read_all(quantized["text"]).items()}
    assert set(ref) == set(ours)
    for n, t in ref.items():
        if not n.endswith(".input_scale"):
            assert ours[n].dtype == t.dtype and torch.equal(bits(ours[n]), bits(t)), n
    ref_exclude = json.loads((tmp_path / "modelopt" / "hf_quant_config.json").read_text())["quantization"]
    our_exclude = json.loads((quantized["text"] / "hf_quant_config.json").read_text())["quantization"]
    assert sorted(map(normalize_module_name, ref_exclude["exclude_modules"])) == sorted(
        map(normalize_module_name, our_exclude["exclude_modules"]))


def test_custom_exclude_quantizes_attention_and_gdn(Q, sources, tmp_path):
    dst = tmp_path / "all"
    quantize_checkpoint(sources["mm"], dst, exclude=["lm_head", "*.linear_attn.in_proj_b"], progress=False)
    src, out = read_all(sources["mm"]), read_all(dst)
    layer = "model.language_model.layers"
    groups = [[f"{layer}.3.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")],
              [f"{layer}.0.linear_attn.{p}" for p in ("in_proj_qkv", "in_proj_z", "in_proj_a")],
              [f"{layer}.1.mlp.shared_expert.gate_proj", f"{layer}.1.mlp.shared_expert.up_proj",
               f"{layer}.1.mlp.shared_expert_gate"],
              [f"{layer}.3.self_attn.o_proj"], [f"{layer}.2.linear_attn.out_proj"]]
    for group in groups:
        shared = Q.get_weights_scaling_factor_2(torch.cat([src[f"{m}.weight"] for m in group]))
        for m in group:
            ref_q, ref_scale, ref_scale_2 = Q.quantize(src[f"{m}.weight"].clone(), 16, weights_scaling_factor_2=shared)
            assert torch.equal(out[f"{m}.weight"], ref_q._quantized_data), m
            assert torch.equal(bits(out[f"{m}.weight_scale"]), bits(ref_scale)), m
            assert torch.equal(bits(out[f"{m}.weight_scale_2"]), bits(ref_scale_2.reshape(()))), m
    for kept in (f"{layer}.0.linear_attn.in_proj_b.weight", f"{layer}.0.mlp.gate.weight", "lm_head.weight",
                 "mtp.layers.0.self_attn.q_proj.weight", "model.visual.merger.linear_fc2.weight"):
        assert torch.equal(bits(out[kept]), bits(src[kept])), kept
    exclude = json.loads((dst / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    assert {"lm_head", "*.linear_attn.in_proj_b", f"{layer}.0.mlp.gate", "model.visual*", "mtp*"} <= set(exclude)
    assert not any("self_attn" in e or "shared_expert" in e for e in exclude)


def test_k_not_multiple_of_16_stays_unquantized(tmp_path, caplog):
    src = make_tiny_qwen35_moe(tmp_path / "src", moe_intermediate_size=24, dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="nibble.quantize"):
        quantize_checkpoint(src, tmp_path / "dst", progress=False)
    out = read_all(tmp_path / "dst")
    assert out["model.layers.0.mlp.experts.3.down_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.0.mlp.experts.3.down_proj.weight_scale" not in out
    assert out["model.layers.0.mlp.experts.3.up_proj.weight"].dtype == torch.uint8
    rules = QuantConfig.from_model_dir(tmp_path / "dst", {})
    assert "model.layers.2.mlp.experts.*.down_proj" in rules.exclude_modules
    assert not rules.is_quantized("model.layers.2.mlp.experts.5.down_proj")
    assert "in_features 24 is not a multiple of 16" in caplog.text


def test_dequantized_reference_model(sources, quantized):
    """The transformers reference built from the NVFP4 checkpoint holds exactly the dequantized experts and
    the source's other weights, and stays close to the BF16 model's logits."""
    ref = load_dequantized_reference(quantized["mm_fused_sharded"])
    params = dict(ref.named_parameters())
    out = read_all(quantized["mm_fused_sharded"])
    m = "model.language_model.layers.2.mlp.experts.5.up_proj"
    up = dequantize(out[f"{m}.weight"], out[f"{m}.weight_scale"], out[f"{m}.weight_scale_2"])
    assert torch.equal(params["model.layers.2.mlp.experts.gate_up_proj"][5, 32:], up)
    src = read_all(sources["mm_fused_sharded"])
    assert torch.equal(params["model.layers.0.linear_attn.in_proj_qkv.weight"],
                       src["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"].float())
    bf16 = load_dequantized_reference(sources["mm_fused_sharded"])
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ref(ids).logits, bf16(ids).logits
    assert 0 < (a - b).abs().max() < 0.25 * b.abs().max()


def test_cli(sources, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([str(sources["text"]), str(tmp_path / "out"), "--exclude", "lm_head", "*self_attn*",
                              "--exclude", "*linear_attn*", "--max-shard-size", "100KB", "--no-progress"])
    assert run_cli(args) == 0
    out = read_all(tmp_path / "out")
    assert out["model.layers.0.mlp.shared_expert.down_proj.weight"].dtype == torch.uint8
    assert out["model.layers.3.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 1
    assert run_cli(parser.parse_args([str(sources["text"]), str(tmp_path / "out"), "--no-progress"])) == 1
    assert "not empty" in capsys.readouterr().err
    args = parser.parse_args([str(sources["text"]), str(tmp_path / "out"), "--overwrite", "--no-progress"])
    assert run_cli(args) == 0
    assert len(list((tmp_path / "out").glob("*.safetensors"))) == 1, "stale shards of the first run survived"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bad_sources(sources, quantized, tmp_path):
    with pytest.raises(QuantizeError, match="not a directory"):
        quantize_checkpoint(tmp_path / "missing", tmp_path / "o1", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(QuantizeError, match=r"no config\.json"):
        quantize_checkpoint(tmp_path / "empty", tmp_path / "o2", progress=False)
    llama = _copy(sources["text"], tmp_path / "llama")
    (llama / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(QuantizeError, match=r"not a Qwen3\.5-MoE config"):
        quantize_checkpoint(llama, tmp_path / "o3", progress=False)
    with pytest.raises(QuantizeError, match="already quantized"):
        quantize_checkpoint(quantized["text"], tmp_path / "o4", progress=False)
    wrong = _copy(sources["text_fused_fp32"], tmp_path / "wrong")
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 16}))
    with pytest.raises(QuantizeError, match=r"experts\.down_proj' has shape \(8, 64, 32\), expected \(8, 64, 16\)"):
        quantize_checkpoint(wrong, tmp_path / "o5", progress=False)
    with pytest.raises(QuantizeError, match="exclude must be a list"):
        quantize_checkpoint(sources["text"], tmp_path / "o6", exclude="lm_head", progress=False)
    mixed = _copy(sources["text"], tmp_path / "mixed")
    shutil.copy(sources["mm"] / "config.json", mixed / "config.json")
    with pytest.raises(QuantizeError, match=r"no tensor is named 'model\.language_model\.layers\.\*'"):
        quantize_checkpoint(mixed, tmp_path / "o8", progress=False)
    lacking = tmp_path / "lacking"
    with ShardWriter(lacking) as writer:
        for n, t in read_all(sources["text"]).items():
            if n != "model.layers.2.mlp.experts.5.down_proj.weight":
                writer.add(n, t)
    shutil.copy(sources["text"] / "config.json", lacking / "config.json")
    with pytest.raises(QuantizeError, match=r"no source tensor for 'model\.layers\.2\.mlp\.experts\.5\.down_proj'"):
        quantize_checkpoint(lacking, tmp_path / "o9", progress=False)
    (tmp_path / "o7").mkdir()
    (tmp_path / "o7" / "keep.txt").write_text("x")
    with pytest.raises(QuantizeError, match="not empty"):
        quantize_checkpoint(sources["text"], tmp_path / "o7", progress=False)


def test_bad_shards(sources, tmp_path):
    sharded = sources["mm_fused_sharded"]
    shards = list_shards(sharded)
    missing = _copy(sharded, tmp_path / "missing")
    (missing / shards[1].name).unlink()
    with pytest.raises(QuantizeError, match=f"names shard '{shards[1].name}', which does not exist"):
        quantize_checkpoint(missing, tmp_path / "o1", progress=False)
    truncated = _copy(sharded, tmp_path / "truncated")
    data = (truncated / shards[2].name).read_bytes()
    (truncated / shards[2].name).write_bytes(data[: len(data) - 100])
    with pytest.raises(QuantizeError, match=f"{shards[2].name}: not a readable safetensors file"):
        quantize_checkpoint(truncated, tmp_path / "o2", progress=False)
    absent = _copy(sharded, tmp_path / "absent")
    index = json.loads((absent / INDEX_FILE).read_text())
    index["weight_map"]["model.language_model.layers.9.mlp.gate.weight"] = shards[0].name
    (absent / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"layers\.9\.mlp\.gate\.weight' is named in .* but absent"):
        list_shards(absent)


def test_shard_writer_and_reader(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(10, 100, generator=g) for i in range(7)}  # 4000 bytes each
    tensors["big"] = torch.randn(3000, generator=g)  # 12000 bytes: a shard of its own
    fused = torch.randn(4, 6, 8, generator=g)
    with ShardWriter(tmp_path, max_shard_size="10KB") as writer:
        for n, t in tensors.items():
            writer.add(n, t)
        writer.add("view", fused[1, 2:4])  # a view into a larger storage is written as just its elements
    assert writer.total_size == 7 * 4000 + 12000 + 64
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    # t0 t1 | t2 t3 | t4 t5 | t6 | big | view: a shard is flushed before the tensor that would overflow it.
    assert files == [f"model-{i:05d}-of-00006.safetensors" for i in range(1, 7)]
    assert CheckpointReader(tmp_path).shard_of("big").name == files[4]
    assert all(p.stat().st_size < 10_000 + 1000 for p in tmp_path.glob("*.safetensors") if p.name != files[4])
    reader = CheckpointReader(tmp_path)
    assert reader.names == [*tensors, "view"]
    for n, t in tensors.items():
        assert torch.equal(reader.get(n), t)
    assert torch.equal(reader.get("view"), fused[1, 2:4])
    assert reader.shape("t3") == (10, 100) and reader.dtype("t3") == torch.float32
    assert torch.equal(reader.get_slice("t5", 4), tensors["t5"][4])
    with pytest.raises(CheckpointError, match="has no entry 10"):
        reader.get_slice("t5", 10)
    with pytest.raises(CheckpointError, match="written twice"):
        w = ShardWriter(tmp_path / "dup")
        w.add("a", torch.ones(1))
        w.add("a", torch.ones(1))
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(123) == 123
    with pytest.raises(ValueError, match="cannot parse size"):
        parse_size("five")
