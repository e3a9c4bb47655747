"""nibble.models.mrope against transformers' Qwen3.5: `get_rope_index` positions and decode deltas of prompts
with 0, 1 and 2 images (tiny random `Qwen3_5MoeModel`), the interleaved rotary embedding and its application
to q/k, and text-only M-RoPE equal to nibble's 1-D rope (reference and Triton kernel)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from nibble.kernels.rope import build_cos_sin_cache, rope, rope_ref
from nibble.models.mrope import (
    MRopeParams,
    mrope_axis,
    mrope_cos_sin,
    mrope_decode_positions,
    mrope_positions,
    mrope_ref,
)

IMAGE, START, END = 248056, 248053, 248054
MERGE = 2
SHARED_CONFIG = Path("/work/shared/models/qwen3.5/Qwen3.5-397B-A17B/config.json")


def _transformers() -> Any:
    sys.modules.setdefault("fla", None)  # type: ignore[arg-type]
    import transformers

    return transformers


@pytest.fixture(scope="module")
def hf_model() -> Any:
    """A tiny `Qwen3_5MoeModel`: get_rope_index needs only its config (and one layer keeps it cheap)."""
    tf = _transformers()
    config = tf.Qwen3_5MoeConfig(
        text_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
                         shared_expert_intermediate_size=8, vocab_size=64, linear_num_key_heads=1,
                         linear_num_value_heads=1, linear_key_head_dim=8, linear_value_head_dim=8,
                         layer_types=["full_attention"]),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
                           patch_size=16, temporal_patch_size=2, spatial_merge_size=MERGE),
        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END)
    with torch.random.fork_rng(devices=[]):
        return tf.Qwen3_5MoeModel(config).eval()


def _prompt(parts: list[int | tuple[int, int]]) -> tuple[list[int], list[list[int]]]:
    """ints: that many text tokens; (h, w): an image of h x w patches between vision start/end tokens."""
    ids: list[int] = []
    grids: list[list[int]] = []
    for part in parts:
        if isinstance(part, int):
            ids += [(7 * len(ids) + 3) % 1000 for _ in range(part)]
        else:
            h, w = part
            ids += [START] + [IMAGE] * (h * w // MERGE**2) + [END]
            grids.append([1, h, w])
    return ids, grids


PROMPTS = {
    "text-only": [13],
    "one-image": [5, (4, 6), 3],
    "image-first-and-last": [(2, 2)],
    "two-images": [4, (6, 2), 2, (2, 10), 5],
    "wide-and-tall": [1, (2, 40), (36, 4), 1],
    "image-at-end": [3, (8, 8)],
}


@pytest.mark.parametrize("name", list(PROMPTS))
def test_positions_and_decode_match_get_rope_index(hf_model: Any, name: str) -> None:
    ids, grids = _prompt(PROMPTS[name])
    input_ids = torch.tensor([ids])
    grid_thw = torch.tensor(grids, dtype=torch.long) if grids else None
    ref_pos, ref_delta = hf_model.get_rope_index(input_ids, mm_token_type_ids=(input_ids == IMAGE).int(),
                                                 image_grid_thw=grid_thw)
    pos, delta = mrope_positions(ids, grids, IMAGE, MERGE)
    assert pos.shape == (3, len(ids)) and pos.dtype == torch.int64
    assert torch.equal(pos, ref_pos[:, 0])
    assert delta == int(ref_delta)
    assert bool((pos <= torch.arange(len(ids))).all())  # a 1-D table sized for the context covers M-RoPE

    # Decoding: transformers' cached path adds the stored delta to the cache position.
    hf_model.rope_deltas = ref_delta
    cache = SimpleNamespace(get_seq_length=lambda: len(ids) + 2)
    ref_decode = hf_model.compute_3d_position_ids(None, torch.zeros(1, 3, 32), cache=cache)
    assert torch.equal(mrope_decode_positions(len(ids) + 2, 3, delta), ref_decode[:, 0])


def test_adjacent_images_share_a_run_and_bad_placeholders_are_refused() -> None:
    ids = [1, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE, 2]
    pos, delta = mrope_positions(ids, [[1, 2, 2], [1, 2, 8]], IMAGE, MERGE)
    assert pos.tolist() == [[0, 1, 2, 2, 2, 2, 6], [0, 1, 2, 2, 2, 2, 6], [0, 1, 2, 3, 4, 5, 6]]
    assert delta == 0
    with pytest.raises(ValueError, match="needs 4 placeholders"):
        mrope_positions([1, IMAGE, IMAGE, 2], [[1, 4, 4]], IMAGE, MERGE)
    with pytest.raises(ValueError, match="only 1 image grids"):
        mrope_positions([IMAGE, 2, IMAGE], [[1, 2, 2]], IMAGE, MERGE)
    with pytest.raises(ValueError, match="placeholders for 1"):
        mrope_positions([IMAGE, 2], [[1, 2, 2], [1, 2, 2]], IMAGE, MERGE)
    assert mrope_positions([], [], IMAGE)[0].shape == (3, 0)
    text_pos, text_delta = mrope_positions(torch.tensor([5, 6, 7]), None, IMAGE)
    assert torch.equal(text_pos, torch.arange(3).expand(3, -1)) and text_delta == 0


def _rotary(tf: Any, head_dim: int, section: list[int], theta: float) -> Any:
    config = tf.Qwen3_5MoeTextConfig(
        head_dim=head_dim, rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25,
                                            "mrope_section": section, "mrope_interleaved": True})
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    return Qwen3_5MoeTextRotaryEmbedding(config)


@pytest.mark.parametrize("head_dim,section,theta", [(256, [11, 11, 10], 10_000_000), (128, [6, 5, 5], 1e4)])
def test_cos_sin_and_applied_qk_match_transformers(head_dim: int, section: list[int], theta: float) -> None:
    tf = _transformers()
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import apply_rotary_pos_emb

    ids, grids = _prompt([3, (6, 4), 2, (2, 8), 4])
    pos, _ = mrope_positions(ids, grids, IMAGE, MERGE)
    pos = torch.cat([pos, pos + 5000], dim=1)  # far positions too: the frequencies must stay aligned
    t = pos.shape[1]
    rot = head_dim // 4
    q = torch.randn(t, 4, head_dim, generator=torch.Generator().manual_seed(0))
    k = torch.randn(t, 2, head_dim, generator=torch.Generator().manual_seed(1))

    ref_cos, ref_sin = _rotary(tf, head_dim, section, theta)(q, pos[:, None, :])
    table = mrope_cos_sin(pos, build_cos_sin_cache(rot, int(pos.max()) + 1, theta), section)
    assert table.shape == (t, rot)
    cos = torch.cat([table[:, : rot // 2]] * 2, dim=-1)
    sin = torch.cat([table[:, rot // 2:]] * 2, dim=-1)
    assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])

    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], ref_cos, ref_sin)
    got_q, got_k = mrope_ref(q, k, pos, build_cos_sin_cache(rot, int(pos.max()) + 1, theta), section)
    err = max(float((got_q - ref_q[0].transpose(0, 1)).abs().max()),
              float((got_k - ref_k[0].transpose(0, 1)).abs().max()))
    assert err < 1e-6, err


def test_interleaved_axis_layout() -> None:
    axis = mrope_axis(32, (11, 11, 10)).tolist()
    assert axis == [0, 1, 2] * 10 + [0, 1]
    assert [axis.count(a) for a in range(3)] == [11, 11, 10]


def test_text_only_equals_1d_rope() -> None:
    gen = torch.Generator().manual_seed(2)
    cache = build_cos_sin_cache(64, 4096, 1e7)
    p = torch.randint(0, 4096, (9,), generator=gen)
    q, k = torch.randn(9, 4, 256, generator=gen), torch.randn(9, 2, 256, generator=gen)
    ref_q, ref_k = rope_ref(q, k, p, cache)
    got_q, got_k = mrope_ref(q, k, p.expand(3, -1), cache)
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)
    assert torch.equal(mrope_cos_sin(p.expand(3, -1), cache), cache[p])


def test_triton_rope_kernel_takes_the_per_token_table() -> None:
    """How the engine can apply M-RoPE without a new kernel: rows = arange(T), table = mrope_cos_sin."""
    ids, grids = _prompt([2, (4, 4), 3])
    pos, _ = mrope_positions(ids, grids, IMAGE, MERGE)
    cache = build_cos_sin_cache(16, 64, 1e4)
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(len(ids), 3, 32, generator=gen), torch.randn(len(ids), 1, 32, generator=gen)
    ref_q, ref_k = mrope_ref(q, k, pos, cache)
    got_q, got_k = rope(q.clone(), k.clone(), torch.arange(len(ids)), mrope_cos_sin(pos, cache))
    assert float((got_q - ref_q).abs().max()) < 1e-6 and float((got_k - ref_k).abs().max()) < 1e-6


def test_params_from_config(tmp_path: Path) -> None:
    """The published 397B config.json when present (else its relevant fields)."""
    dst = tmp_path / "config.json"
    if SHARED_CONFIG.is_file():
        shutil.copy(SHARED_CONFIG, dst)
    else:
        dst.write_text(json.dumps({"image_token_id": IMAGE, "video_token_id": IMAGE + 1,
                                   "vision_config": {"spatial_merge_size": 2},
                                   "text_config": {"rope_parameters": {"mrope_section": [11, 11, 10]}}}))
    assert MRopeParams.from_model_dir(tmp_path) == MRopeParams(IMAGE, 2, (11, 11, 10), IMAGE + 1)
    with pytest.raises(ValueError, match="image_token_id"):
        MRopeParams.from_config_dict({"text_config": {}})
