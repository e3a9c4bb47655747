"""Reading and writing Hugging Face safetensors checkpoints, one tensor at a time.

A checkpoint directory holds either `model.safetensors.index.json` (its `weight_map` names the shard of
every tensor) or a single `model.safetensors`. Reading never loads more than the tensor asked for (the
shards are memory-mapped); writing buffers at most one shard.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9

_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, written or loaded; the message names the file and the tensor."""


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as '5GB', '500MB', '2GiB' (decimal units as in HF's
    `max_shard_size`, binary ones with 'i')."""
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", size.upper())
        if m is None:
            raise ValueError(f"cannot parse size '{size}' (expected e.g. 5GB, 500MB, 2GiB or a byte count)")
        value = int(float(m.group(1)) * _SIZE_UNITS[m.group(2) or ""])
    if value <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return value


def read_weight_map(model_dir: str | Path) -> dict[str, str] | None:
    """The index's tensor name -> shard file name map, or None when the directory has no index."""
    path = Path(model_dir) / INDEX_FILE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON: {e}") from e
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{path}: expected an object with a 'weight_map' of tensor name -> file name")
    return weight_map


def open_shard(path: str | Path) -> Any:
    """Memory-map one shard (`safe_open` handle); a corrupt or truncated file raises CheckpointError."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: shard file not found")
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable safetensors file (corrupt or truncated?): {e}") from e


def list_shards(model_dir: str | Path) -> list[Path]:
    """The checkpoint's shard files in order, validated: with an index, every shard it names exists and
    holds every tensor the index assigns to it; without one, `model.safetensors` (or else every
    `*.safetensors` file) is used."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    weight_map = read_weight_map(model_dir)
    if weight_map is None:
        single = model_dir / SINGLE_FILE
        if single.is_file():
            return [single]
        shards = sorted(model_dir.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{model_dir}: no {INDEX_FILE}, {SINGLE_FILE} or other *.safetensors file")
        return shards
    expected: dict[str, set[str]] = {}
    for name, file in weight_map.items():
        expected.setdefault(file, set()).add(name)
    shards = []
    for file in sorted(expected):
        path = model_dir / file
        if not path.is_file():
            raise CheckpointError(f"{model_dir / INDEX_FILE}: names shard '{file}', which does not exist "
                                    f"(for {len(expected[file])} tensors, e.g. '{min(expected[file])}')")
        present = set(open_shard(path).keys())
        missing = sorted(expected[file] - present)
        if missing:
            raise CheckpointError(f"{path}: tensor '{missing[0]}' is named in {INDEX_FILE} but absent from "
                                    f"this shard ({len(missing)} missing in all)")
        shards.append(path)
    return shards


def iter_tensors(shards: Iterable[str | Path]) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """Yield (name, tensor, shard path) for every tensor of the shards, loading one tensor at a time."""
    for shard in shards:
        path = Path(shard)
        handle = open_shard(path)
        for name in handle.keys():
            try:
                tensor = handle.get_tensor(name)
            except Exception as e:
                raise CheckpointError(f"{path}: cannot read tensor '{name}': {e}") from e
            yield name, tensor, path


class CheckpointReader:
    """Random access to a checkpoint's tensors by name without loading anything else.

    `names` lists every tensor in storage order (shard by shard). `shape`/`dtype` read only the header;
    `get_slice(name, i)` reads the i-th entry of the leading dim (one expert of a stacked tensor).
    """

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.shards = list_shards(self.model_dir)
        self._handles: dict[Path, Any] = {}
        self._shard_of: dict[str, Path] = {}
        self.names: list[str] = []
        for path in self.shards:
            for name in self._handle(path).keys():
                if name in self._shard_of:
                    raise CheckpointError(f"{path}: tensor '{name}' is also stored in "
                                            f"{self._shard_of[name].name}")
                self._shard_of[name] = path
                self.names.append(name)

    def __contains__(self, name: str) -> bool:
        return name in self._shard_of

    def _handle(self, path: Path) -> Any:
        if path not in self._handles:
            self._handles[path] = open_shard(path)
        return self._handles[path]

    def shard_of(self, name: str) -> Path:
        if name not in self._shard_of:
            raise CheckpointError(f"{self.model_dir}: no tensor '{name}' in the checkpoint")
        return self._shard_of[name]

    def _slice(self, name: str) -> Any:
        return self._handle(self.shard_of(name)).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype | str:
        """torch dtype of the tensor, or the safetensors dtype string if torch has no equivalent."""
        code = self._slice(name).get_dtype()
        return _DTYPES.get(code, code)

    def get(self, name: str) -> torch.Tensor:
        path = self.shard_of(name)
        try:
            return self._handle(path).get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read tensor '{name}': {e}") from e

    def get_slice(self, name: str, index: int) -> torch.Tensor:
        """Entry `index` of the leading dim of tensor `name`, read without loading the rest."""
        shape = self.shape(name)
        if not shape or not 0 <= index < shape[0]:
            raise CheckpointError(f"{self.shard_of(name)}: tensor '{name}' of shape {shape} has no "
                                    f"entry {index} along its first dim")
        try:
            return self._slice(name)[index:index + 1].reshape(shape[1:])
        except Exception as e:
            raise CheckpointError(f"{self.shard_of(name)}: cannot read '{name}'[{index}]: {e}") from e


def _shard_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


class ShardWriter:
    """Write tensors into `model-0000i-of-0000N.safetensors` shards as they come, then the index.

    At most one shard (up to `max_shard_size` bytes, or a single larger tensor) is held in memory. Shards
    are written under temporary names and renamed by `close()` once their count is known; `close()` also
    writes `model.safetensors.index.json` with `metadata.total_size` and the `weight_map`.
    """

    def __init__(self, dst_dir: str | Path, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> None:
        self.dst_dir = Path(dst_dir)
        self.dst_dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_size = parse_size(max_shard_size)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_size = 0
        self._written: list[tuple[Path, list[str]]] = []
        self._names: set[str] = set()
        self.total_size = 0
        self._closed = False

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor; flushes the current shard first when the tensor would overflow it."""
        if self._closed:
            raise CheckpointError(f"{self.dst_dir}: writer is closed, cannot add '{name}'")
        if name in self._names:
            raise CheckpointError(f"{self.dst_dir}: tensor '{name}' written twice")
        t = tensor.detach().cpu()
        # Views (slices of a fused tensor) would drag their whole storage into the file, and safetensors
        # refuses tensors that share storage.
        if not t.is_contiguous() or t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.nbytes:
            t = t.clone(memory_format=torch.contiguous_format)
        size = t.numel() * t.element_size()
        if self._pending and self._pending_size + size > self.max_shard_size:
            self._flush()
        self._names.add(name)
        self._pending[name] = t
        self._pending_size += size
        self.total_size += size

    def _flush(self) -> None:
        if not self._pending:
            return
        path = self.dst_dir / f"model-{len(self._written) + 1:05d}.safetensors.partial"
        try:
            save_file(self._pending, str(path), metadata={"format": "pt"})
        except Exception as e:
            raise CheckpointError(f"{path}: cannot write shard: {e}") from e
        self._written.append((path, list(self._pending)))
        self._pending = {}
        self._pending_size = 0

    def close(self) -> dict[str, str]:
        """Write the last shard, give every shard its final name, write the index; returns the weight map."""
        if self._closed:
            raise CheckpointError(f"{self.dst_dir}: writer already closed")
        self._flush()
        self._closed = True
        count = len(self._written)
        weight_map: dict[str, str] = {}
        for i, (path, names) in enumerate(self._written, start=1):
            final = _shard_name(i, count)
            os.replace(path, self.dst_dir / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_size},
                 "weight_map": dict(sorted(weight_map.items()))}
        (self.dst_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return weight_map

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            for path, _ in self._written:
                path.unlink(missing_ok=True)
