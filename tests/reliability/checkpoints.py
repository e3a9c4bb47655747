"""Damaged copies of the embedded demo checkpoint, for the load-error and `nibble doctor` tests.

The copy is split into two shards with an index, so that a shard can go missing while the other stays.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nibble.checkpoint.demo import DEMO_DIR
from nibble.checkpoint.safetensors_io import INDEX_FILE

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
PREFIX = "model.language_model."
WRONG_SHAPE = PREFIX + "layers.1.linear_attn.out_proj.weight"
WRONG_DTYPE = PREFIX + "layers.0.mlp.experts.2.up_proj.weight_scale"
NAN_SCALE_2 = PREFIX + "layers.2.mlp.experts.5.down_proj.weight_scale_2"
NAN_BLOCK_SCALE = PREFIX + "layers.3.mlp.experts.7.gate_proj.weight_scale"
DROPPED = PREFIX + "layers.2.linear_attn.A_log"


def two_shard_copy(dst: Path) -> Path:
    """The demo checkpoint rewritten as two shards plus an index, in dst."""
    shutil.copytree(DEMO_DIR, dst, ignore=shutil.ignore_patterns("*.safetensors", INDEX_FILE))
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(DEMO_DIR.glob("*.safetensors")):
        tensors.update(load_file(shard))
    names = sorted(tensors)
    halves = (names[: len(names) // 2], names[len(names) // 2:])
    weight_map = {}
    for file, part in zip(SHARDS, halves):
        save_file({n: tensors[n] for n in part}, dst / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (dst / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return dst


def shard_of(model_dir: Path, name: str) -> Path:
    return model_dir / json.loads((model_dir / INDEX_FILE).read_text())["weight_map"][name]


def edit_tensors(model_dir: Path, edit: Callable[[dict[str, torch.Tensor]], None], shard: Path) -> None:
    """Rewrite one shard after `edit` changed its tensors in place (the index keeps naming it)."""
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


def flip_header(model_dir: Path) -> str:
    shard = model_dir / SHARDS[1]
    data = bytearray(shard.read_bytes())
    for i in range(108, 118):  # inside the JSON header, which starts after its 8-byte length
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))
    return SHARDS[1]


def truncate(model_dir: Path) -> str:
    shard = model_dir / SHARDS[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 4096])
    return SHARDS[0]


def drop_shard(model_dir: Path) -> str:
    (model_dir / SHARDS[1]).unlink()
    return SHARDS[1]


def wrong_shape(model_dir: Path) -> str:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t[WRONG_SHAPE] = torch.zeros(t[WRONG_SHAPE].shape[0], 100, dtype=t[WRONG_SHAPE].dtype)

    edit_tensors(model_dir, edit, shard_of(model_dir, WRONG_SHAPE))
    return WRONG_SHAPE


def wrong_dtype(model_dir: Path) -> str:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t[WRONG_DTYPE] = t[WRONG_DTYPE].float()

    edit_tensors(model_dir, edit, shard_of(model_dir, WRONG_DTYPE))
    return WRONG_DTYPE


def nan_scales(model_dir: Path) -> str:
    """NaN global scale and one NaN block scale: loads fine, would poison whatever routes there."""
    def edit2(t: dict[str, torch.Tensor]) -> None:
        t[NAN_SCALE_2] = torch.tensor(float("nan"))

    def edit_block(t: dict[str, torch.Tensor]) -> None:
        t[NAN_BLOCK_SCALE].view(torch.uint8)[0, 0] = 0x7F  # e4m3fn's NaN encoding

    edit_tensors(model_dir, edit2, shard_of(model_dir, NAN_SCALE_2))
    edit_tensors(model_dir, edit_block, shard_of(model_dir, NAN_BLOCK_SCALE))
    return NAN_SCALE_2


def drop_tensor(model_dir: Path) -> str:
    """A tensor the model needs, gone from its shard and from the index."""
    def edit(t: dict[str, torch.Tensor]) -> None:
        del t[DROPPED]

    edit_tensors(model_dir, edit, shard_of(model_dir, DROPPED))
    index = json.loads((model_dir / INDEX_FILE).read_text())
    del index["weight_map"][DROPPED]
    (model_dir / INDEX_FILE).write_text(json.dumps(index))
    return DROPPED


# Damages that make loading fail; each returns the file or tensor the error must name.
DAMAGES: dict[str, Callable[[Path], str]] = {
    "flipped-header": flip_header, "truncated": truncate, "missing-shard": drop_shard,
    "wrong-shape": wrong_shape, "wrong-dtype": wrong_dtype, "missing-tensor": drop_tensor,
}


def damaged(root: Path, kind: str) -> tuple[Path, str]:
    """A fresh damaged copy under root; returns (directory, the file or tensor the damage concerns)."""
    model_dir = two_shard_copy(root / kind)
    culprit = (DAMAGES | {"nan-scales": nan_scales})[kind](model_dir)
    return model_dir, culprit
