"""Launch configurations from the JSON tables in `nibble/kernels/tuning/`.

`default.json` holds a complete configuration for every case; `<device>.json` (device names normalised
by `_triton.device_key`, e.g. `nvidia_h200.json`) overrides fields for that GPU. `by_capability.json` names,
per compute capability, the table of a GPU of that architecture (same shared memory per SM, same
instructions: sm_90 -> the H200's); a GPU of that capability takes it under its own table, so an H100 runs
with the H200's fields where `nvidia_h100_80gb_hbm3.json` has no entry of its own, or with them alone where
it has no table (said once in the log). Other GPUs get default.json alone. Each op maps to a list of
entries `{"when": {...}, "config": {...}}`; the first entry whose `when` matches the lookup key wins in
each table, and the tables' fields are laid over the default's, the device's own last. In `when`,
`"min_X"`/`"max_X"` bound the key's numeric field `X` (inclusive); any other field must equal the key's. A
`when` field that names no field of the op's lookup key (a typo would make its entry silently never match)
is an error at the first lookup.
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


def device_tables(device: torch.device | str) -> tuple[str, ...]:
    """Names of the tables laid over default.json on `device`, the device's own last (see the module
    docstring); empty: default.json alone."""
    return named_tables(device_key(device), capability(device))


def capability_key(cap: tuple[int, int] | None) -> str | None:
    """Compute capability `cap` as the tables write it ("9.0"), None for None."""
    return None if cap is None else f"{cap[0]}.{cap[1]}"


def capability_table(cap: tuple[int, int] | None) -> str | None:
    """The device name `by_capability.json` gives for compute capability `cap` (None: none given)."""
    return _table(CAPABILITY_FILE).get(capability_key(cap)) if cap is not None else None


@functools.lru_cache(maxsize=16)
def named_tables(name: str, cap: tuple[int, int] | None) -> tuple[str, ...]:
    """`device_tables` of a GPU whose table is named `name` (a `device_key`) and whose compute capability is
    `cap`; needs no such GPU present (offline tools call it too). Cached, so the fallback is logged once."""
    own = bool(_table(name))
    sibling = capability_table(cap)
    if sibling is None or sibling == name or not _table(sibling):
        return (name,) if own else ()
    if not own:
        logger.info("tuning: no table for %s; using %s.json, tuned on a GPU of the same compute capability %d.%d",
                    name, sibling, *cap)
        return (sibling,)
    return (sibling, name)


def lookup(op: str, device: torch.device | str, key: dict[str, Any]) -> dict[str, Any]:
    """Configuration of `op` for a shape `key` on `device` (a fresh dict the caller may modify)."""
    return lookup_tables(op, device_tables(device), key)


def lookup_tables(op: str, tables: tuple[str, ...], key: dict[str, Any]) -> dict[str, Any]:
    """`lookup` with the tables laid over default.json named (`device_tables`, `named_tables`)."""
    fields = frozenset(key)
    for name in ("default", *tables):
        _check_fields(name, op, fields)
    cfg = _first(_table("default"), op, key)
    if not cfg:
        raise KeyError(f"tuning/default.json has no entry for {op} matching {key}")
    for name in tables:
        cfg.update(_first(_table(name), op, key))
    return cfg
