"""Tuning tables: every default entry is complete and device tables only override known fields."""

from __future__ import annotations

import json

from nibble.kernels.tuning_tables import TUNING_DIR, lookup


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
