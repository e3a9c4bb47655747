"""The checkpoint checker (`nibble doctor --model`): a good checkpoint passes in every layout the loader
reads, and each kind of damage is reported with its own code, naming the file and tensor, without the
checkpoint ever being loaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nibble.checkpoint.demo import DEMO_DIR
from nibble.checkpoint.loader import CheckpointError
from nibble.checkpoint.quantize import quantize_checkpoint
from nibble.checkpoint.safetensors_io import INDEX_FILE
from nibble.checkpoint.validate import validate_checkpoint
from nibble.engine.config import EngineConfig
from nibble.engine.llm_engine import LLMEngine
from tests.helpers.tiny_models import make_tiny_qwen35_moe
from tests.reliability.checkpoints import (
    NAN_BLOCK_SCALE,
    NAN_SCALE_2,
    PREFIX,
    SHARDS,
    damaged,
    edit_tensors,
    two_shard_copy,
)


def codes(report: object, severity: str) -> set[str]:
    return report.codes(severity)  # type: ignore[attr-defined]


def test_demo_checkpoint_is_clean() -> None:
    report = validate_checkpoint(DEMO_DIR)
    assert report.ok and report.num("warning") == 0, report.render()
    f = report.facts
    assert f["num_tensors"] == 901 and f["skipped"] == 69 and f["headers_checked"] == 832
    assert f["block_scales_read"] == 192 and f["scalars_read"] == 384 and not f["deep"]
    assert f["architecture"] == "Qwen3_5MoeForConditionalGeneration" and f["layout"] == "multimodal"
    max_pos = json.loads((DEMO_DIR / "config.json").read_text())["text_config"]["max_position_embeddings"]
    assert f["context"].startswith(f"{max_pos} tokens (max_position_embeddings")
    json.dumps(report.to_dict())
    assert "result: OK" in report.render()


def test_deep_and_sampled_modes() -> None:
    deep = validate_checkpoint(DEMO_DIR, deep=True)
    assert deep.ok and deep.facts["deep_tensors_read"] > 300, deep.render()
    sampled = validate_checkpoint(DEMO_DIR, sample_scales=True)
    assert sampled.ok and sampled.facts["block_scales_read"] == 4 * 3 + 0  # expert 0 of 4 layers, 3 projections


@pytest.mark.parametrize(("layout", "kwargs"), [
    ("text-only per-expert", {}),
    ("multimodal sharded", {"multimodal": True, "max_shard_size": "60KB"}),
    ("fused experts", {"fused_experts": True}),
])
def test_bf16_layouts_and_their_nvfp4_exports_are_clean(tmp_path: Path, layout: str, kwargs: dict) -> None:
    src = make_tiny_qwen35_moe(tmp_path / "bf16", **kwargs)
    report = validate_checkpoint(src, deep=True)
    assert report.ok, report.render()
    assert report.codes("warning") <= {"no_tokenizer"}
    dst = tmp_path / "nvfp4"
    quantize_checkpoint(src, dst, progress=False)
    report = validate_checkpoint(dst, deep=True)
    assert report.ok and report.facts["block_scales_read"] > 0, report.render()


def test_fused_experts_where_the_config_wants_nvfp4(tmp_path: Path) -> None:
    src = make_tiny_qwen35_moe(tmp_path / "fused", fused_experts=True)
    quant = {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}
    (src / "hf_quant_config.json").write_text(json.dumps(quant))
    report = validate_checkpoint(src)
    assert "bad_tensor" in codes(report, "error")
    assert any("fused dense experts" in f.message for f in report.findings), report.render()


@pytest.mark.parametrize(("kind", "code"), [
    ("flipped-header", "unreadable_shard"), ("truncated", "unreadable_shard"), ("missing-shard", "missing_shard"),
    ("wrong-shape", "bad_tensor"), ("wrong-dtype", "bad_tensor"), ("missing-tensor", "missing_tensor"),
])
def test_damage_codes(tmp_path: Path, kind: str, code: str) -> None:
    model_dir, culprit = damaged(tmp_path, kind)
    report = validate_checkpoint(model_dir)
    assert codes(report, "error") == {code}, report.render()
    finding = next(f for f in report.findings if f.code == code)
    assert culprit in (finding.file, finding.tensor), finding
    # A failed shard or a rejected tensor is not reported a second time as missing.
    assert report.num("error") == 1, report.render()


def test_scale_values(tmp_path: Path) -> None:
    model_dir, _ = damaged(tmp_path, "nan-scales")
    report = validate_checkpoint(model_dir)
    assert codes(report, "error") == {"bad_scale", "bad_block_scale"}, report.render()
    assert {f.tensor for f in report.findings} == {NAN_SCALE_2, NAN_BLOCK_SCALE}
    # The loader refuses the NaN global scale too, naming the tensor (NaN block scales are only found by the
    # checker: reading every block scale at load time would cost a pass over the scales).
    with pytest.raises(CheckpointError, match="weight_scale_2"):
        LLMEngine(EngineConfig(model=str(model_dir), device="cpu", max_model_len=256))


def test_scale_warnings_and_deep_findings(tmp_path: Path) -> None:
    model_dir = two_shard_copy(tmp_path / "ckpt")
    zero_scales = PREFIX + "layers.1.mlp.experts.4.up_proj.weight_scale"
    negative = PREFIX + "layers.1.mlp.experts.6.down_proj.weight_scale"
    input_scale = PREFIX + "layers.0.mlp.experts.1.gate_proj.input_scale"
    nan_weight = PREFIX + "layers.0.linear_attn.in_proj_z.weight"

    def edit(t: dict[str, torch.Tensor]) -> None:
        if zero_scales in t:
            t[zero_scales] = torch.zeros_like(t[zero_scales])
        if negative in t:
            t[negative].view(torch.uint8)[1, 1] = 0x80 | 0x30
        if input_scale in t:
            t[input_scale] = torch.tensor(0.0)
        if nan_weight in t:
            t[nan_weight][3, 4] = float("inf")

    for shard in SHARDS:
        edit_tensors(model_dir, edit, model_dir / shard)
    shallow = validate_checkpoint(model_dir)
    assert codes(shallow, "error") == {"bad_block_scale"}
    assert next(f for f in shallow.findings if f.severity == "error").tensor == negative
    assert codes(shallow, "warning") == {"zero_block_scales", "bad_scale"}, shallow.render()
    deep = validate_checkpoint(model_dir, deep=True)
    assert codes(deep, "error") == {"bad_block_scale", "non_finite_weight"}, deep.render()
    assert "zero_scale_nonzero_block" in codes(deep, "warning")
    assert any(f.tensor == nan_weight and "1 NaN/Inf" in f.message for f in deep.findings)


def test_index_and_shard_bookkeeping(tmp_path: Path) -> None:
    model_dir = two_shard_copy(tmp_path / "ckpt")
    stray = model_dir / "model-extra.safetensors"
    save_file({"unused.tensor": torch.zeros(2)}, stray)
    unknown = PREFIX + "layers.0.mlp.bogus.weight"
    shard = model_dir / SHARDS[0]
    tensors = load_file(shard)
    tensors[unknown] = torch.zeros(4, 4)
    save_file(tensors, shard, metadata={"format": "pt"})
    index = json.loads((model_dir / INDEX_FILE).read_text())
    absent = PREFIX + "layers.0.mlp.gate.weight_absent"
    index["weight_map"][absent] = SHARDS[1]
    (model_dir / INDEX_FILE).write_text(json.dumps(index))
    report = validate_checkpoint(model_dir)
    assert codes(report, "error") == {"bad_tensor", "index_tensor_absent"}, report.render()
    assert codes(report, "warning") == {"unindexed_tensor", "unused_shard", "index_total_size"}
    bad = next(f for f in report.findings if f.code == "bad_tensor")
    assert bad.tensor == unknown and bad.file == SHARDS[0]


def test_config_and_tokenizer_problems(tmp_path: Path) -> None:
    assert validate_checkpoint(tmp_path / "nope").codes() == {"not_a_directory"}
    model_dir = two_shard_copy(tmp_path / "ckpt")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    report = validate_checkpoint(model_dir)
    assert codes(report, "error") == {"config"} and "LlamaForCausalLM" in report.findings[0].message
    (model_dir / "config.json").write_text("{not json")
    assert codes(validate_checkpoint(model_dir), "error") == {"config"}

    model_dir = two_shard_copy(tmp_path / "tok")
    config["text_config"]["vocab_size"] = 512
    (model_dir / "config.json").write_text(json.dumps(config))
    report = validate_checkpoint(model_dir)
    assert "tokenizer_vocab" in codes(report, "error")
    (model_dir / "tokenizer.json").unlink()
    (model_dir / "generation_config.json").write_text('{"temperature": "hot"}')
    report = validate_checkpoint(model_dir)
    assert {"generation_config"} <= codes(report, "error") and "no_tokenizer" in codes(report, "warning")


def test_quant_config_disagreement(tmp_path: Path) -> None:
    model_dir = tmp_path / "ckpt"
    shutil.copytree(DEMO_DIR, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["lm_head"]}
    (model_dir / "config.json").write_text(json.dumps(config))
    report = validate_checkpoint(model_dir)
    assert report.ok and codes(report, "warning") == {"quant_config_mismatch"}, report.render()
