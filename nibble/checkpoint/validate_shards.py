"""The index and the shards of a checkpoint as the checker sees them: `_Shards.open` opens every shard,
reads every tensor's header (shape, dtype) without its data, and reports what is wrong with the files and
the index (missing or unreadable shards, tensors stored twice, index entries that disagree with the
shards); `_Shards.read` then reads one tensor's data for the value checks.

Separate from the checks against the model (validate.py) because it is about the files alone: it needs no
config and no model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nibble.checkpoint.safetensors_io import _DTYPES as SAFETENSORS_DTYPES
from nibble.checkpoint.safetensors_io import INDEX_FILE, SINGLE_FILE, CheckpointError, open_shard, read_weight_map
from nibble.checkpoint.validate_report import ERROR, WARNING, CheckpointReport


@dataclass
class _Tensor:
    shard: Path
    shape: tuple[int, ...]
    dtype_code: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class _Shards:
    """Open shard handles and the header facts of every tensor (name -> _Tensor), in storage order."""

    def __init__(self, handles: dict[Path, Any], tensors: dict[str, _Tensor], unavailable: set[str] | None) -> None:
        """unavailable: names indexed to shards that are missing or unreadable (already reported); None when
        a shard failed and there is no index to tell which tensors it held."""
        self.handles = handles
        self.tensors = tensors
        self.unavailable = unavailable

    def read(self, name: str, report: CheckpointReport) -> torch.Tensor | None:
        info = self.tensors[name]
        try:
            return self.handles[info.shard].get_tensor(name)
        except Exception as e:  # a damaged data section: report, keep checking the rest
            report.add(ERROR, "unreadable_tensor", f"{info.shard.name}: cannot read '{name}': {e}",
                       file=info.shard.name, tensor=name)
            return None

    @classmethod
    def open(cls, model_dir: Path, report: CheckpointReport) -> _Shards | None:
        try:
            weight_map = read_weight_map(model_dir)
        except CheckpointError as e:
            report.add(ERROR, "bad_index", str(e), file=INDEX_FILE)
            weight_map = None
        if weight_map is not None:
            files = sorted(set(weight_map.values()))
        elif (model_dir / SINGLE_FILE).is_file():
            files = [SINGLE_FILE]
        else:
            files = sorted(p.name for p in model_dir.glob("*.safetensors"))
        if not files:
            report.add(ERROR, "no_weights", f"{model_dir}: no {INDEX_FILE}, {SINGLE_FILE} or other *.safetensors")
            return None
        by_file: dict[str, list[str]] = {}
        for n, f in (weight_map or {}).items():
            by_file.setdefault(f, []).append(n)
        handles: dict[Path, Any] = {}
        tensors: dict[str, _Tensor] = {}
        unavailable: set[str] | None = set()
        for file in files:
            path = model_dir / file
            named = sorted(by_file.get(file, []))
            if not path.is_file():
                if unavailable is not None:
                    unavailable.update(named)
                report.add(ERROR, "missing_shard", f"{INDEX_FILE} names shard '{file}', which does not exist "
                           f"({len(named)} tensors, e.g. '{named[0]}')", file=file)
                continue
            try:
                handles[path] = handle = open_shard(path)
                names = list(handle.keys())
            except CheckpointError as e:
                handles.pop(path, None)
                report.add(ERROR, "unreadable_shard", str(e), file=file)
                unavailable = None if weight_map is None or unavailable is None else unavailable | set(named)
                continue
            for name in names:
                sl = handle.get_slice(name)
                if name in tensors:
                    report.add(ERROR, "duplicate_tensor", f"'{name}' is stored in both {tensors[name].shard.name} "
                               f"and {file}", file=file, tensor=name)
                    continue
                tensors[name] = _Tensor(path, tuple(sl.get_shape()), sl.get_dtype())
                if weight_map is not None and weight_map.get(name) != file:
                    report.add(WARNING, "unindexed_tensor", f"{file} holds '{name}', which {INDEX_FILE} "
                               f"{'assigns to ' + weight_map[name] if name in weight_map else 'does not list'} "
                               "(it is loaded anyway)", file=file, tensor=name)
        if weight_map is not None:
            absent = cls._check_index(model_dir, weight_map, tensors, handles, report)
            unavailable = None if unavailable is None else unavailable | absent
        report.facts["num_shards"] = len(handles)
        report.facts["num_tensors"] = len(tensors)
        report.facts["total_bytes"] = sum(t.numel * _itemsize(t.dtype_code) for t in tensors.values())
        return cls(handles, tensors, unavailable)

    @staticmethod
    def _check_index(model_dir: Path, weight_map: dict[str, str], tensors: dict[str, _Tensor],
                     handles: dict[Path, Any], report: CheckpointReport) -> set[str]:
        """Report index problems; returns the indexed names absent from their (readable) shard."""
        opened = {p.name for p in handles}
        absent = {name for name, file in weight_map.items() if file in opened and name not in tensors}
        for name in sorted(absent):
            file = weight_map[name]
            report.add(ERROR, "index_tensor_absent", f"{file}: tensor '{name}' is named in {INDEX_FILE} but "
                       "absent from this shard", file=file, tensor=name)
        indexed = set(weight_map.values())
        for path in sorted(model_dir.glob("*.safetensors")):
            if path.name not in indexed:
                report.add(WARNING, "unused_shard", f"{path.name} is not named in {INDEX_FILE} and is ignored",
                           file=path.name)
        raw = json.loads((model_dir / INDEX_FILE).read_text())
        declared = (raw.get("metadata") or {}).get("total_size")
        actual = sum(t.numel * _itemsize(t.dtype_code) for t in tensors.values())
        if isinstance(declared, int) and declared != actual and len(handles) == len(indexed):
            report.add(WARNING, "index_total_size", f"{INDEX_FILE} declares metadata.total_size {declared}, the "
                       f"shards hold {actual} bytes of tensors", file=INDEX_FILE)
        return absent


def _itemsize(code: str) -> int:
    dtype = SAFETENSORS_DTYPES.get(code)
    return dtype.itemsize if dtype is not None else 1
