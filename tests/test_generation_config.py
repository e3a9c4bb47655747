"""Request defaults from generation config: the model's file ("auto"), none ("vllm"), another directory's file,
single fields overridden (vLLM's --generation-config / --override-generation-config), and the offline LLM's
default SamplingParams."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nibble.engine.config import EngineConfigError
from nibble.engine.generation_config import GenerationConfigError, GenerationDefaults, load_generation_defaults
from nibble.engine.llm import LLM
from nibble.engine.sampling_params import SamplingParams


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [5, 7], "do_sample": True}))
    return d


def test_sources(model_dir: Path, tmp_path: Path) -> None:
    model = GenerationDefaults.from_pretrained(model_dir)
    assert load_generation_defaults(model_dir) == model
    none = load_generation_defaults(model_dir, "vllm")
    assert none.sampling_overrides() == {} and none.eos_token_ids == (5, 7)
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 1.1, "eos_token_id": 9}))
    from_dir = load_generation_defaults(model_dir, str(other))
    assert from_dir.sampling_overrides() == {"temperature": 1.1} and from_dir.eos_token_ids == (5, 7)
    with pytest.raises(GenerationConfigError, match="--generation-config"):
        load_generation_defaults(model_dir, str(tmp_path / "missing"))


def test_override(model_dir: Path) -> None:
    out = load_generation_defaults(model_dir, override={"temperature": 0.2, "top_k": None, "max_new_tokens": 64})
    assert out.sampling_overrides() == {"temperature": 0.2, "top_p": 0.95, "max_new_tokens": 64}
    greedy = load_generation_defaults(model_dir, "vllm", override={"do_sample": False})
    assert greedy.sampling_overrides() == {"temperature": 0.0}
    with pytest.raises(GenerationConfigError, match=r"unknown field\(s\) temp;"):
        load_generation_defaults(model_dir, override={"temp": 1})
    with pytest.raises(GenerationConfigError, match="'top_k' must be an integer"):
        load_generation_defaults(model_dir, override={"top_k": 1.5})


def test_offline_llm_uses_the_defaults() -> None:
    llm = LLM(device="cpu", max_model_len=128, override_generation_config={"temperature": 0.0, "max_new_tokens": 6})
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.max_tokens, params.top_k) == (0.0, 6, 20)  # top_k: the demo model's file
    implicit = llm.generate(["Hello there"])[0].outputs[0]
    explicit = llm.generate(["Hello there"], SamplingParams(temperature=0.0, top_k=20, top_p=0.95, max_tokens=6))
    assert implicit.token_ids == explicit[0].outputs[0].token_ids and len(implicit.token_ids) == 6
    with pytest.raises(EngineConfigError, match="--override-generation-config"):
        LLM(device="cpu", max_model_len=128, override_generation_config={"top_k": "many"})
    with pytest.raises(EngineConfigError, match=r"request defaults.*top_p"):
        LLM(device="cpu", max_model_len=128, override_generation_config={"top_p": 0})
