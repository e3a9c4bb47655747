"""Launch configurations from the JSON tables in `nibble/kernels/tuning/`.

`default.json` holds a complete configuration for every case; `<device>.json` (device names normalised
by `_triton.device_key`, e.g. `nvidia_h200.json`) overrides fields for that GPU. A GPU without a table of its
own takes the one `by_capability.json` names for its compute capability, the table of a GPU of the same
architecture (same shared memory per SM, same instructions: an H100 takes the H200's), said once in the log;
otherwise default.json alone. Each op maps to a list of
entries `{"when": {...}, "config": {...}}`; the first entry whose `when` matches the lookup key wins in
each table, and the device's fields are laid over the default's. In `when`, `"min_X"`/`"max_X"` bound
the key's numeric field `X` (inclusive); any other field must equal the key's. A `when` field that names no
field of the op's lookup key (a typo would make its entry silently never match) is an error at the first lookup.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

import torch

from nibble.kernels._triton import capability, device_key

TUNING_DIR = Path(__file__).with_name("tuning")
CAPABILITY_FILE = "by_capability"
logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=32)
def _table(name: str) -> dict[str, list[dict[str, Any]]]:
    path = TUNING_DIR / f"{name}.json"
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def _matches(when: dict[str, Any], key: dict[str, Any]) -> bool:
    for field, want in when.items():
        if field.startswith(("min_", "max_")) and field[4:] in key:
            have = key[field[4:]]
            if (field.startswith("min_") and have < want) or (field.startswith("max_") and have > want):
                return False
        elif key.get(field) != want:
            return False
    return True


@functools.lru_cache(maxsize=64)
def _check_fields(name: str, op: str, fields: frozenset[str]) -> None:
    """Raise if an entry of `op` in table `name` tests a field the op's lookup key does not have."""
    for i, entry in enumerate(_table(name).get(op, [])):
        for field in entry.get("when", {}):
            base = field[4:] if field.startswith(("min_", "max_")) else field
            if base not in fields:
                raise ValueError(f"tuning/{name}.json: entry {i} of {op!r} tests {field!r}, but {op} lookups have "
                                 f"only the fields {sorted(fields)}")


def _first(table: dict[str, list[dict[str, Any]]], op: str, key: dict[str, Any]) -> dict[str, Any]:
    for entry in table.get(op, []):
        if _matches(entry.get("when", {}), key):
            return dict(entry["config"])
    return {}


def table_names() -> list[str]:
    """The tables in TUNING_DIR ('default' first), without the capability map."""
    return sorted((p.stem for p in TUNING_DIR.glob("*.json") if p.stem != CAPABILITY_FILE),
                  key=lambda n: (n != "default", n))


def device_table(device: torch.device | str) -> str:
    """Name of the table that overrides default.json on `device` (see the module docstring); a name without a
    file (no table) leaves default.json alone."""
    return _resolve(device_key(device), capability(device))


@functools.lru_cache(maxsize=16)
def _resolve(name: str, cap: tuple[int, int] | None) -> str:
    if (TUNING_DIR / f"{name}.json").is_file() or cap is None:
        return name
    other = _table(CAPABILITY_FILE).get(f"{cap[0]}.{cap[1]}")
    if other is None:
        return name
    logger.info("tuning: no table for %s; using %s.json, tuned on a GPU of the same compute capability %d.%d",
                name, other, *cap)
    return other


def lookup(op: str, device: torch.device | str, key: dict[str, Any]) -> dict[str, Any]:
    """Configuration of `op` for a shape `key` on `device` (a fresh dict the caller may modify)."""
    table_name = device_table(device)
    fields = frozenset(key)
    _check_fields("default", op, fields)
    _check_fields(table_name, op, fields)
    cfg = _first(_table("default"), op, key)
    if not cfg:
        raise KeyError(f"tuning/default.json has no entry for {op} matching {key}")
    cfg.update(_first(_table(table_name), op, key))
    return cfg
