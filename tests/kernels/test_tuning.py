"""Tuning tables: every default entry is complete and device tables only override known fields."""

from __future__ import annotations

import json

import pytest

from nibble.kernels import tuning_tables
from nibble.kernels.tuning_tables import TUNING_DIR, lookup

# the fields of each op's lookup key, as its wrapper builds it (fused_moe.py, nvfp4_linear.py, paged_attention.py)
KEY_FIELDS = {
    "fused_moe": {"tokens", "fp4", "hidden", "inter", "experts", "top_k", "pairs_per_expert"},
    "nvfp4_linear": {"tokens", "n", "k"},
    "paged_attention": {"head_dim", "decode", "group"},
}
KEY_FIELDS["fused_moe_dense"] = KEY_FIELDS["fused_moe"]
KEY_FIELDS["nvfp4_linear_generic"] = KEY_FIELDS["nvfp4_linear"]


def test_device_tables_override_known_fields() -> None:
    default = json.loads((TUNING_DIR / "default.json").read_text())
    for path in TUNING_DIR.glob("*.json"):
        table = json.loads(path.read_text())
        for op, entries in table.items():
            assert op in default, (path.name, op)
            known = set().union(*(e["config"] for e in default[op]))
            for e in entries:
                assert set(e["config"]) <= known, (path.name, op, set(e["config"]) - known)
        for op, entries in default.items():
            fields = [set(e["config"]) for e in entries]
            assert all(f == fields[0] for f in fields), op
            assert entries[-1]["when"] == {}, op


def test_lookup_ranges() -> None:
    assert lookup("fused_moe", "cpu", {"tokens": 1, "fp4": True})["path"] == "gemv"
    assert lookup("fused_moe", "cpu", {"tokens": 5000, "fp4": True})["path"] == "sorted"
    assert lookup("paged_attention", "cpu", {"decode": True, "head_dim": 256})["max_splits"] >= 1


def test_when_fields_are_lookup_fields() -> None:
    for path in TUNING_DIR.glob("*.json"):
        for op in json.loads(path.read_text()):
            tuning_tables._check_fields(path.stem, op, frozenset(KEY_FIELDS[op]))


def test_misspelt_when_field_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    table = {"fused_moe": [{"when": {"min_hiden": 3072}, "config": {"path": "sorted"}}]}
    monkeypatch.setattr(tuning_tables, "_table", lambda name: table if name == "cpu" else json.loads(
        (TUNING_DIR / f"{name}.json").read_text()))
    monkeypatch.setattr(tuning_tables, "_check_fields", tuning_tables._check_fields.__wrapped__)
    with pytest.raises(ValueError, match=r"cpu\.json: entry 0 of 'fused_moe' tests 'min_hiden'"):
        lookup("fused_moe", "cpu", {"tokens": 8, "fp4": True, "hidden": 3072})
