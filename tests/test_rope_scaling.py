"""YaRN (and linear) RoPE scaling for contexts past the pretraining length, against transformers.

The tables: nibble's inverse frequencies and attention factor equal transformers' `ROPE_INIT_FUNCTIONS` on the
397B model's values (the YaRN override Qwen recommends) and on variants of every field; plain RoPE is unchanged.
The model: a tiny checkpoint whose config.json asks for YaRN (original_max_position_embeddings 64, factor 4)
matches transformers' logits at positions 64..255, the scaled range, in prefill and decode; the same checkpoint
with plain RoPE in config.json serves it through `hf_overrides` (vLLM's --hf-overrides) and otherwise refuses
a context past 64 tokens.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from nibble.checkpoint.demo import resolve_model_path
from nibble.checkpoint.loader import load_model
from nibble.checkpoint.quantize import quantize_checkpoint
from nibble.engine.errors import RequestError
from nibble.engine.llm import LLM
from nibble.engine.llm_engine import DEFAULT_MAX_MODEL_LEN, check_max_model_len
from nibble.engine.sampling_params import SamplingParams
from nibble.kernels.kernel_set import KernelSet
from nibble.kernels.rope import build_cos_sin_cache, rope_inv_freq
from nibble.layers.forward_batch import ForwardBatch, ModelCaches
from nibble.models.config import (
    ConfigError,
    ModelConfig,
    RopeScaling,
    apply_hf_overrides,
    deep_merge,
    parse_hf_overrides,
)
from nibble.models.mrope import mrope_cos_sin
from tests.helpers.tiny_models import load_dequantized_reference, make_tiny_qwen35_moe

# The 397B model's text config and the override Qwen's model card gives for ~1M tokens.
QWEN_TEXT = {"head_dim": 256, "max_position_embeddings": 262144, "hidden_size": 4096, "num_attention_heads": 32}
QWEN_YARN = {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "yarn", "rope_theta": 10000000,
             "partial_rotary_factor": 0.25, "factor": 4.0, "original_max_position_embeddings": 262144}
VLLM_OVERRIDES = {"text_config": {"rope_parameters": QWEN_YARN}}

# The tiny model: 8 frequencies (head_dim 32, partial 0.5) and theta 1e4, so that YaRN's ramp over a 64-token
# pretraining length keeps some frequencies, divides others by 4 and mixes two (1/3, 2/3).
TINY_ORIGINAL = 64
TINY_ROPE = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5, "mrope_section": [3, 3, 2],
             "mrope_interleaved": True}
TINY_YARN = {**TINY_ROPE, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": TINY_ORIGINAL}
TINY_LEN = 4 * TINY_ORIGINAL
BLOCK_SIZE = 16


def _transformers() -> Any:
    if "fla" not in sys.modules:
        sys.modules["fla"] = None  # type: ignore[assignment]
    import transformers

    return transformers


def _hf_rope(text: dict[str, Any], rope: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """transformers' (inv_freq, attention factor) for a Qwen3.5 text config with these rope_parameters."""
    tf = _transformers()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = tf.Qwen3_5MoeTextConfig(**text, rope_parameters=dict(rope))
    if rope["rope_type"] == "default":
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

        return Qwen3_5MoeTextRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope["rope_type"]](config)


def _scaling(text: dict[str, Any], rope: dict[str, Any]) -> RopeScaling | None:
    return RopeScaling.from_rope_parameters(rope, text, "config.json: rope_parameters")


@pytest.mark.parametrize("rope", [
    QWEN_YARN,
    {**QWEN_YARN, "truncate": False},
    {**QWEN_YARN, "beta_fast": 16, "beta_slow": 2},
    {**QWEN_YARN, "mscale": 1.0, "mscale_all_dim": 0.707},
    {**QWEN_YARN, "attention_factor": 1.25},
    {**QWEN_YARN, "factor": 2.5, "original_max_position_embeddings": 131072},
    {**QWEN_YARN, "factor": None, "original_max_position_embeddings": 65536},
    {**QWEN_YARN, "rope_type": "linear", "factor": 2.0},
], ids=["qwen-1M", "no-truncate", "betas", "mscale", "attention_factor", "factor-2.5", "factor-null", "linear"])
def test_inv_freq_and_attention_factor_match_transformers(rope: dict[str, Any]) -> None:
    scaling = _scaling(QWEN_TEXT, rope)
    assert scaling is not None and scaling.rope_type == rope["rope_type"]
    ref_inv_freq, ref_factor = _hf_rope(QWEN_TEXT, rope)
    inv_freq = rope_inv_freq(64, 1e7, scaling)
    assert inv_freq.dtype == torch.float32 and torch.equal(inv_freq, ref_inv_freq)
    assert scaling.attention_scaling == pytest.approx(ref_factor, rel=1e-12)
    positions = torch.tensor([0, 1, 70000, 262143, 262144, 270000])
    table = build_cos_sin_cache(64, 270001, 1e7, scaling=scaling)[positions]
    freqs = positions[:, None].float() * ref_inv_freq
    assert torch.equal(table, torch.cat((freqs.cos() * ref_factor, freqs.sin() * ref_factor), dim=-1))


def test_qwen_override_values() -> None:
    """Qwen's recommended override: frequencies 0..13 kept, 22.. divided by 4, cos/sin x (0.1 ln 4 + 1), and
    1048576 positions."""
    scaling = _scaling(QWEN_TEXT, QWEN_YARN)
    assert scaling == RopeScaling("yarn", 4.0, 262144)
    assert scaling.correction_range(64, 1e7) == (14, 22)
    assert scaling.attention_scaling == pytest.approx(0.1 * math.log(4) + 1)
    assert scaling.max_context_len == 1048576
    plain = rope_inv_freq(64, 1e7)
    scaled = rope_inv_freq(64, 1e7, scaling)
    assert torch.equal(scaled[:15], plain[:15]) and torch.allclose(scaled[22:], plain[22:] / 4, rtol=1e-6)


def test_plain_rope_table_is_unchanged() -> None:
    """Without scaling: the table as nibble always built it, bit for bit, and transformers' default frequencies."""
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    freqs = torch.outer(torch.arange(4096, dtype=torch.float32), inv_freq)
    assert torch.equal(build_cos_sin_cache(64, 4096, 1e7), torch.cat((freqs.cos(), freqs.sin()), dim=-1))
    default = {**QWEN_YARN, "rope_type": "default"}
    assert _scaling(QWEN_TEXT, default) is None
    assert torch.equal(rope_inv_freq(64, 1e7), _hf_rope(QWEN_TEXT, default)[0])


def test_mrope_table_matches_transformers_with_yarn() -> None:
    """Image prompts: the 3-D positions pick their frequencies from the scaled table, as transformers' M-RoPE
    does from its YaRN frequencies, past the pretraining length too."""
    tf = _transformers()
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    text = {"head_dim": 128, "max_position_embeddings": 4096}
    rope = {**QWEN_YARN, "rope_theta": 1e4, "mrope_section": [6, 5, 5], "original_max_position_embeddings": 1024}
    gen = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 4096, (3, 40), generator=gen)
    rotary = Qwen3_5MoeTextRotaryEmbedding(tf.Qwen3_5MoeTextConfig(**text, rope_parameters=dict(rope)))
    ref_cos, ref_sin = rotary(torch.zeros(1, dtype=torch.float32), pos[:, None, :])
    cache = build_cos_sin_cache(32, 4096, 1e4, scaling=_scaling(text, rope))
    table = mrope_cos_sin(pos, cache, (6, 5, 5))
    assert torch.equal(torch.cat([table[:, :16]] * 2, dim=-1), ref_cos[0])
    assert torch.equal(torch.cat([table[:, 16:]] * 2, dim=-1), ref_sin[0])


@pytest.mark.parametrize("rope,match", [
    ({"rope_type": "longrope", "factor": 4.0}, "rope_type 'longrope' is not supported"),
    ({"rope_type": "dynamic", "factor": 4.0}, "rope_type 'dynamic' is not supported"),
    ({"rope_type": "yarn"}, "missing field 'factor'"),
    ({"rope_type": "yarn", "factor": "4"}, r"rope_parameters.factor must be a number"),
    ({"rope_type": "yarn", "factor": 0.5}, r"rope_parameters.factor must be >= 1"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0},
     "original_max_position_embeddings must be a positive integer"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": "262144"},
     "original_max_position_embeddings must be a positive integer"),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": "yes"}, r"rope_parameters.truncate must be true or false"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 1, "beta_slow": 32}, "beta_fast 1 must be >= beta_slow 32"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": -1.0}, "attention_factor must be > 0"),
    ({"rope_type": "yarn", "factor": 4.0, "mscale": [1]}, r"rope_parameters.mscale must be a number"),
    ({"rope_type": "linear", "factor": None}, r"rope_parameters.factor must be a number >= 1, got null"),
])
def test_bad_rope_parameters_name_the_field(rope: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _scaling(QWEN_TEXT, rope)


def test_model_config_reads_scaling_from_either_key(tmp_path: Path) -> None:
    """config.json's rope_parameters (the published multimodal layout, under text_config) or legacy
    rope_scaling with `type`; the derived context length; the error names the file."""
    demo = json.loads((resolve_model_path("demo") / "config.json").read_text())
    text = demo.get("text_config", demo)
    raw = {**demo, "text_config": {**text, "rope_parameters": {**text.get("rope_parameters", {}), **QWEN_YARN}}}
    config = ModelConfig.from_dict(raw)
    assert config.rope_scaling == RopeScaling("yarn", 4.0, 262144) and config.max_context_len == 1048576
    legacy = {k: v for k, v in text.items() if k != "rope_parameters"}
    legacy["rope_scaling"] = {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096}
    config = ModelConfig.from_dict(legacy, source="legacy.json")
    assert config.rope_scaling == RopeScaling("yarn", 2.0, 4096) and config.max_context_len == 8192
    legacy["rope_scaling"] = {"type": "longrope"}
    with pytest.raises(ConfigError, match=r"legacy.json: rope_scaling: rope_type 'longrope' is not supported"):
        ModelConfig.from_dict(legacy, source="legacy.json")


def test_hf_overrides_deep_merge_and_errors() -> None:
    base = {"a": 1, "text_config": {"x": 1, "rope_parameters": {"rope_type": "default", "mrope_section": [1, 2]}}}
    merged = deep_merge(base, {"text_config": {"rope_parameters": {"rope_type": "yarn", "mrope_section": [3]}},
                               "b": {"c": 2}})
    assert merged == {"a": 1, "b": {"c": 2},
                      "text_config": {"x": 1, "rope_parameters": {"rope_type": "yarn", "mrope_section": [3]}}}
    assert base["text_config"]["rope_parameters"]["rope_type"] == "default"  # untouched
    assert deep_merge(base, {"text_config": None})["text_config"] is None  # a non-object replaces
    # a text-only config.json takes the text_config object at its top level
    text_only = {"max_position_embeddings": 64, "rope_parameters": {"rope_theta": 1e4}}
    assert apply_hf_overrides(text_only, {"text_config": {"rope_parameters": {"rope_type": "yarn"}}, "z": 1}) == {
        "max_position_embeddings": 64, "rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn"}, "z": 1}
    assert apply_hf_overrides(text_only, None) is text_only
    assert parse_hf_overrides(json.dumps(VLLM_OVERRIDES)) == VLLM_OVERRIDES
    for bad, match in (("{rope", "--hf-overrides is not valid JSON"), ("[1]", "--hf-overrides takes a JSON object"),
                       ('"yarn"', "--hf-overrides takes a JSON object")):
        with pytest.raises(ValueError, match=match):
            parse_hf_overrides(bad)


def test_rope_scaling_override_beside_rope_parameters_is_not_lost() -> None:
    """The Qwen3 docs' spelling (rope_scaling) next to a checkpoint's rope_parameters is read, as transformers v5
    folds the legacy key in; a text-model key at the top of the multimodal layout, where nothing would read it,
    and fields of the wrong type are ConfigErrors naming the place."""
    demo_dir = resolve_model_path("demo")
    yarn = {"rope_type": "yarn", "factor": 4.0}
    config = ModelConfig.from_pretrained(demo_dir, {"text_config": {"rope_scaling": yarn}})
    plain = ModelConfig.from_pretrained(demo_dir)
    assert config.rope_scaling is not None and config.rope_scaling.factor == 4.0
    assert config.max_context_len == 4 * plain.max_position_embeddings
    assert (config.rope_theta, config.partial_rotary_factor) == (plain.rope_theta, plain.partial_rotary_factor)
    raw = json.loads((demo_dir / "config.json").read_text())
    if "text_config" in raw:
        with pytest.raises(ConfigError, match='put rope_scaling under "text_config"'):
            ModelConfig.from_pretrained(demo_dir, {"rope_scaling": yarn})
    with pytest.raises(ConfigError, match="text_config must be an object"):
        ModelConfig.from_pretrained(demo_dir, {"text_config": [1]})
    with pytest.raises(ConfigError, match="invalid literal"):
        ModelConfig.from_pretrained(demo_dir, {"text_config": {"max_position_embeddings": "x"}})


def test_max_model_len_is_derived_from_the_scaling() -> None:
    demo = json.loads((resolve_model_path("demo") / "config.json").read_text())
    plain = ModelConfig.from_dict(apply_hf_overrides(demo, {"text_config": {"max_position_embeddings": 262144}}))
    yarn = ModelConfig.from_dict(apply_hf_overrides(demo, {**VLLM_OVERRIDES,
                                                           "text_config": {"max_position_embeddings": 262144,
                                                                           "rope_parameters": QWEN_YARN}}))
    assert check_max_model_len(None, plain) == check_max_model_len(None, yarn) == DEFAULT_MAX_MODEL_LEN
    assert check_max_model_len(262144, plain) == 262144
    assert check_max_model_len(1010000, yarn) == 1010000 and check_max_model_len(1048576, yarn) == 1048576
    with pytest.raises(RequestError, match=r"--max-model-len 1010000 exceeds the model's max_position_embeddings "
                                           r"262144; to go further enable YaRN"):
        check_max_model_len(1010000, plain)
    with pytest.raises(RequestError, match=r"--max-model-len 1048577 exceeds the model's context length 1048576 "
                                           r"\(yarn RoPE scaling: 262144 x factor 4\)"):
        check_max_model_len(1048577, yarn)


@pytest.fixture(scope="module")
def yarn_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    """(checkpoint whose config.json asks for YaRN, the same weights with plain RoPE in config.json,
    transformers' reference model of the first)."""
    base = tmp_path_factory.mktemp("yarn")
    src = make_tiny_qwen35_moe(base / "bf16", config_overrides={"max_position_embeddings": TINY_ORIGINAL,
                                                                "rope_parameters": dict(TINY_YARN)})
    yarn_dir = base / "nvfp4-yarn"
    quantize_checkpoint(src, yarn_dir, progress=False)
    plain_dir = base / "nvfp4-plain"
    plain_dir.mkdir()
    for f in yarn_dir.iterdir():
        if f.name != "config.json":
            (plain_dir / f.name).symlink_to(f)
    raw = json.loads((yarn_dir / "config.json").read_text())
    raw["rope_parameters"] = dict(TINY_ROPE)
    (plain_dir / "config.json").write_text(json.dumps(raw))
    return yarn_dir, plain_dir, load_dequantized_reference(yarn_dir)


@torch.inference_mode()
def test_logits_match_transformers_past_the_original_length(yarn_checkpoints: tuple[Path, Path, Any]) -> None:
    """A batched prefill of a 240-token and a 60-token prompt, then 8 batched decode steps, and each prompt
    prefilled alone: every logit row (positions 0..247, most past the pretraining length 64) as transformers'
    within 1e-4 of the largest logit; a wrong ramp or attention factor misses by 1e-2 or more."""
    yarn_dir, _, reference = yarn_checkpoints
    config = ModelConfig.from_pretrained(yarn_dir)
    assert config.rope_scaling == RopeScaling("yarn", 4.0, TINY_ORIGINAL) and config.max_context_len == TINY_LEN
    model = load_model(yarn_dir, config, KernelSet.reference(), dtype=torch.float32, device="cpu")
    assert model.rotary.cos_sin_cache.shape == (TINY_LEN, config.rotary_dim)
    gen = torch.Generator().manual_seed(0)
    prompt_lens, steps = [240, 60], 8
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in prompt_lens]
    blocks_per_seq = -(-TINY_LEN // BLOCK_SIZE)
    block_tables = [[1 + i + j * len(seqs) for j in range(blocks_per_seq)] for i in range(len(seqs))]
    caches = ModelCaches.allocate(config, 1 + blocks_per_seq * len(seqs), BLOCK_SIZE, 2 * len(seqs) + 1,
                                  torch.float32, torch.float32, "cpu")
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    feed, context = [list(s) for s in seqs], [0] * len(seqs)
    for _ in range(steps + 1):
        batch = ForwardBatch.build(feed, context, block_tables, [1, 2], BLOCK_SIZE)
        logits = model.compute_logits(model(batch, caches)[batch.logits_indices])
        for i in range(len(seqs)):
            got[i].append(logits[i])
            context[i] += len(feed[i])
            feed[i] = [int(logits[i].argmax())]
            seqs[i].append(feed[i][0])
    worst_abs = 0.0
    for i, seq in enumerate(seqs):
        ref = reference(torch.tensor([seq])).logits[0].float()
        alone = ForwardBatch.build([seq[:prompt_lens[i]]], [0], [block_tables[i]], [3 + i], BLOCK_SIZE)
        prefill = model.compute_logits(model(alone, caches))
        diff = float((prefill - ref[:prompt_lens[i]]).abs().max())
        worst_abs = max(worst_abs, diff)
        assert diff / float(ref.abs().max()) < 1e-4, f"sequence {i}, prompt rows: max abs diff {diff:.2e}"
        for step, row in enumerate(got[i]):
            expected = ref[prompt_lens[i] - 1 + step]
            diff = float((row - expected).abs().max())
            worst_abs = max(worst_abs, diff)
            assert diff / float(expected.abs().max()) < 1e-4, f"sequence {i}, step {step}: max abs diff {diff:.2e}"
    print(f"max abs logit diff vs transformers: {worst_abs:.3e}")


@torch.inference_mode()
@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_hf_overrides_enable_yarn_on_a_plain_checkpoint(yarn_checkpoints: tuple[Path, Path, Any],
                                                        tensor_parallel_size: int) -> None:
    """vLLM's override (text_config.rope_parameters, on a text-only config.json) makes the plain checkpoint the
    YaRN one, on every tensor-parallel rank: the log-probabilities of a 120-token prompt and the greedy tokens
    after it as transformers'; without it a context past 64 is refused, and with it one past 256."""
    _, plain_dir, reference = yarn_checkpoints
    overrides = {"text_config": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": TINY_ORIGINAL}}}
    assert ModelConfig.from_pretrained(plain_dir).rope_scaling is None
    with pytest.raises(RequestError, match=f"--max-model-len {TINY_LEN} exceeds the model's max_position_embeddings "
                                           f"{TINY_ORIGINAL}"):
        LLM(model=str(plain_dir), device="cpu", max_model_len=TINY_LEN)
    with pytest.raises(RequestError, match=f"--max-model-len {TINY_LEN + 1} exceeds the model's context length "
                                           f"{TINY_LEN}"):
        LLM(model=str(plain_dir), device="cpu", max_model_len=TINY_LEN + 1, hf_overrides=overrides)
    llm = LLM(model=str(plain_dir), device="cpu", block_size=BLOCK_SIZE, max_num_batched_tokens=TINY_LEN,
              max_model_len=TINY_LEN, hf_overrides=overrides, tensor_parallel_size=tensor_parallel_size)
    try:
        assert llm.engine.model_config.rope_scaling == RopeScaling("yarn", 4.0, TINY_ORIGINAL)
        prompt = torch.randint(0, llm.engine.model_config.vocab_size, (120,),
                               generator=torch.Generator().manual_seed(1)).tolist()
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                    prompt_logprobs=0))[0]
    finally:
        llm.engine.shutdown()
    ref = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()
    # greedy tokens alone would hide a rank whose heads rotate wrongly: the prompt's log-probabilities do not
    ref_logprobs = torch.log_softmax(reference(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs is not None
    for p in range(1, len(prompt)):
        entry = out.prompt_logprobs[p]
        assert entry is not None and abs(entry.logprob - float(ref_logprobs[p - 1, prompt[p]])) < 1e-4, p
