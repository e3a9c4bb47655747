"""Tuning tables: every default entry is complete and device tables only override known fields."""

from __future__ import annotations

import json

import pytest

from nibble.kernels import tuning_tables
from nibble.kernels.fused_moe import DN_MODES, tuning_key
from nibble.kernels.tuning_tables import TUNING_DIR, lookup

# the fields of each op's lookup key, as its wrapper builds it (fused_moe.py, nvfp4_linear.py, paged_attention.py)
KEY_FIELDS = {
    "fused_moe": {"tokens", "fp4", "hidden", "inter", "experts", "top_k", "pairs_per_expert"},
    "nvfp4_linear": {"tokens", "n", "k"},
    "paged_attention": {"head_dim", "decode", "group", "query_len"},
    "route": {"tokens", "experts"},
}
KEY_FIELDS["fused_moe_dense"] = KEY_FIELDS["fused_moe"]
KEY_FIELDS["nvfp4_linear_generic"] = KEY_FIELDS["nvfp4_linear"]
KEY_FIELDS["dense_linear"] = KEY_FIELDS["nvfp4_linear"]


def test_device_tables_override_known_fields() -> None:
    default = json.loads((TUNING_DIR / "default.json").read_text())
    for name in tuning_tables.table_names():
        path = TUNING_DIR / f"{name}.json"
        table = json.loads(path.read_text())
        for op, entries in table.items():
            assert op in default, (path.name, op)
            known = set().union(*(e["config"] for e in default[op]))
            for e in entries:
                assert set(e["config"]) <= known, (path.name, op, set(e["config"]) - known)
                assert e["config"].get("dn_mode", "reduce") in DN_MODES, (path.name, op, e["config"]["dn_mode"])
        for op, entries in default.items():
            fields = [set(e["config"]) for e in entries]
            assert all(f == fields[0] for f in fields), op
            assert entries[-1]["when"] == {}, op


def test_same_capability_takes_a_sibling_table(monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """A GPU without a table of its own (a GH200) takes the table of its compute capability (the H200's), with a
    log line; one of another capability, or unknown to by_capability.json, gets default.json alone."""
    by_cap = json.loads((TUNING_DIR / f"{tuning_tables.CAPABILITY_FILE}.json").read_text())
    assert by_cap and all((TUNING_DIR / f"{name}.json").is_file() for name in by_cap.values())
    key = {"head_dim": 256, "decode": False, "group": 16, "query_len": 8192}
    h200 = lookup("paged_attention", "cpu", key) | tuning_tables._first(tuning_tables._table("nvidia_h200"),
                                                                        "paged_attention", key)
    default = lookup("paged_attention", "cpu", key)
    assert h200 != default
    for name, cap, want in (("nvidia_gh200_480gb", (9, 0), h200), ("nvidia_h200", (9, 0), h200),
                            ("nvidia_a100_sxm4_80gb", (8, 0), default), ("nvidia_b200", (10, 0), default)):
        monkeypatch.setattr(tuning_tables, "device_key", lambda _d, n=name: n)
        monkeypatch.setattr(tuning_tables, "capability", lambda _d, c=cap: c)
        tuning_tables.named_tables.cache_clear()
        with caplog.at_level("INFO", logger=tuning_tables.__name__):
            assert lookup("paged_attention", "cuda:0", key) == want, name
    tuning_tables.named_tables.cache_clear()
    assert "no table for nvidia_gh200_480gb; using nvidia_h200.json" in caplog.text
    assert "nvidia_a100" not in caplog.text


def test_lookup_ranges() -> None:
    assert lookup("fused_moe", "cpu", tuning_key(1, 3072, 1024, 256, 8, True))["path"] == "gemv"
    assert lookup("fused_moe", "cpu", tuning_key(5000, 3072, 1024, 256, 8, True))["path"] == "sorted"
    # past 512 tokens the sorted blocks follow the pairs per expert (T * k / experts)
    blocks = [lookup("fused_moe", "cpu", tuning_key(t, 3072, 1024, 256, 8, True))["block_t"] for t in (512, 576, 1024)]
    assert blocks == [16, 32, 64]
    assert lookup("paged_attention", "cpu", {"decode": True, "head_dim": 256})["max_splits"] >= 1


def test_own_table_over_the_capability_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU with a table of its own and a sibling of the same capability: its own entries first, the sibling's
    fields where it has none, default.json under both."""
    own = {"dense_linear": [{"when": {"tokens": 1, "n": 3072, "k": 8192},
                             "config": {"path": "gemv", "block_n": 4}}]}
    real = tuning_tables._table
    monkeypatch.setattr(tuning_tables, "_table", lambda name: own if name == "nvidia_h100_80gb_hbm3" else real(name))
    monkeypatch.setattr(tuning_tables, "device_key", lambda _d: "nvidia_h100_80gb_hbm3")
    monkeypatch.setattr(tuning_tables, "capability", lambda _d: (9, 0))
    tuning_tables.named_tables.cache_clear()
    try:
        assert tuning_tables.device_tables("cuda:0") == ("nvidia_h200", "nvidia_h100_80gb_hbm3")
        key = {"head_dim": 256, "decode": False, "group": 16, "query_len": 8192}
        h200 = lookup("paged_attention", "cpu", key) | tuning_tables._first(real("nvidia_h200"), "paged_attention",
                                                                            key)
        assert lookup("paged_attention", "cuda:0", key) == h200
        cfg = lookup("dense_linear", "cuda:0", {"tokens": 1, "n": 3072, "k": 8192})
        assert cfg["path"] == "gemv" and cfg["block_n"] == 4
        assert cfg["block_k"] == lookup("dense_linear", "cpu", {"tokens": 1, "n": 3072, "k": 8192})["block_k"]
        k2 = {"tokens": 2, "n": 3072, "k": 8192}
        assert lookup("dense_linear", "cuda:0", k2) == lookup("dense_linear", "cpu", k2) | tuning_tables._first(
            real("nvidia_h200"), "dense_linear", k2)
    finally:
        tuning_tables.named_tables.cache_clear()


def test_when_fields_are_lookup_fields() -> None:
    for name in tuning_tables.table_names():
        for op in tuning_tables._table(name):
            tuning_tables._check_fields(name, op, frozenset(KEY_FIELDS[op]))


def test_misspelt_when_field_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    table = {"fused_moe": [{"when": {"min_hiden": 3072}, "config": {"path": "sorted"}}]}
    monkeypatch.setattr(tuning_tables, "_table", lambda name: table if name == "cpu" else json.loads(
        (TUNING_DIR / f"{name}.json").read_text()))
    monkeypatch.setattr(tuning_tables, "_check_fields", tuning_tables._check_fields.__wrapped__)
    # an earlier lookup on "cpu" (no table of its own) may have cached that it takes none
    tuning_tables.named_tables.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"cpu\.json: entry 0 of 'fused_moe' tests 'min_hiden'"):
            lookup("fused_moe", "cpu", tuning_key(8, 3072, 1024, 256, 8, True))
    finally:
        tuning_tables.named_tables.cache_clear()
