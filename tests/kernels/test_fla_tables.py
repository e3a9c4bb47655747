"""fla-core's stored launch configs (nibble/kernels/fla_tables.py): files written from autotuners are read back
by fla-core's own loader, and fla is pointed at them only where that is wanted."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys

import pytest

from nibble.kernels import fla_tables
from nibble.kernels.fla_tables import (
    FLA_MODE,
    FLA_TABLE_DIR,
    collect_fla_tables,
    configure_fla_env,
    fla_table_dir,
    record_fla_device,
    write_fla_tables,
)
from nibble.kernels.tuning_tables import capability_table

triton = pytest.importorskip("triton")


def _load_fla_cache():
    """fla-core's config loader, fla/ops/utils/cache.py, loaded from its file: it needs only torch and triton,
    while importing the fla package is blocked in CPU test sessions (tests/conftest.py)."""
    try:
        path = importlib.metadata.distribution("fla-core").locate_file("fla/ops/utils/cache.py")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("fla-core not installed")
    spec = importlib.util.spec_from_file_location("fla.ops.utils.cache", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


fla_cache = sys.modules.get("fla.ops.utils.cache") or _load_fla_cache()


@pytest.fixture(autouse=True)
def _fla_cache_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla.ops.utils.cache", fla_cache)


def _tuner(name: str = "toy_kernel"):
    def body(x_ptr, n, BLOCK: triton.language.constexpr):
        pass

    body.__name__ = name
    configs = [triton.Config({"BLOCK": b}, num_warps=w, num_stages=s) for b, w, s in ((32, 2, 1), (64, 4, 3))]
    return fla_cache.fla_cache_autotune(configs=configs, key=["n"])(triton.jit(body))


KEY = (4096, "torch.bfloat16", "torch.float32")
V = ("0.6.0", "3.6.0")  # (fla-core, Triton) of a stored folder


def test_written_tables_are_read_by_fla(tmp_path, monkeypatch):
    tuned = _tuner()
    tuned.cache[KEY] = tuned.configs[1]
    write_fla_tables(tmp_path, collect_fla_tables([tuned]))
    data = json.loads((tmp_path / "toy_kernel.json").read_text())
    assert fla_cache.KernelConfigFile.from_dict(tmp_path / "toy_kernel.json", data) is not None
    monkeypatch.setattr(fla_cache, "FLA_CACHE_MODE", fla_cache.FlaCacheMode.STRICT)
    monkeypatch.setenv("FLA_CONFIG_DIR", str(tmp_path))
    fresh = _tuner()  # the next process: fla's own lookup settles the key without autotuning
    fresh.maybe_load_cached_config(key=fla_cache.AutotuneKey(KEY), nargs={}, runtime_kwargs={})
    cfg = fresh.cache[KEY]
    assert (cfg.kwargs, cfg.num_warps, cfg.num_stages) == ({"BLOCK": 64}, 4, 3)
    assert fla_cache.load_cached_config("toy_kernel", fla_cache.AutotuneKey((2048, *KEY[1:]))) is None


def test_tables_merge_and_conflicts(tmp_path):
    a, b = _tuner(), _tuner()
    a.cache[KEY] = a.configs[0]
    write_fla_tables(tmp_path, collect_fla_tables([a]))
    b.cache[(8192, *KEY[1:])] = b.configs[1]
    write_fla_tables(tmp_path, collect_fla_tables([b]))
    entries = json.loads((tmp_path / "toy_kernel.json").read_text())["autotune_entries"]
    assert sorted(e["autotune_key"][0] for e in entries.values()) == [4096, 8192]
    b.cache[KEY] = b.configs[1]
    with pytest.raises(ValueError, match="toy_kernel"):
        collect_fla_tables([a, b])


def _store(root, key: str, cap: str, fla_core: str = "0.6.0") -> None:
    (root / key).mkdir()
    (root / key / "k.json").write_text("{}")
    record_fla_device(root, key, key.upper(), tuple(int(c) for c in cap.split(".")), fla_core, "3.6.0")


def test_configure_env(tmp_path, monkeypatch):
    monkeypatch.setattr(fla_tables, "FLA_TABLE_DIR", tmp_path)
    _store(tmp_path, "gpu_a", "8.9")
    env: dict[str, str] = {}
    assert "no stored configs for gpu_b" in configure_fla_env("gpu_b", (8, 0), V, env, fla_imported=False)
    assert env == {}
    late: dict[str, str] = {}
    assert "imported before" in configure_fla_env("gpu_a", (8, 9), V, late, fla_imported=True)
    assert late == {}
    assert "for fla-core 0.6.0 with Triton 3.6.0, this is 0.7.1 with 3.6.0" in configure_fla_env(
        "gpu_a", (8, 9), ("0.7.1", "3.6.0"), late, False)
    assert "this is 0.6.0 with 3.7.1" in configure_fla_env("gpu_a", (8, 9), ("0.6.0", "3.7.1"), late, False)
    assert late == {}
    assert "configs from" in configure_fla_env("gpu_a", (8, 9), V, env, fla_imported=False)
    assert env == {"FLA_CACHE_MODE": FLA_MODE, "FLA_CONFIG_DIR": str(tmp_path / "gpu_a")}
    assert "configs from" in configure_fla_env("gpu_a", (8, 9), V, env, fla_imported=True)
    user = {"FLA_CACHE_MODE": "disabled"}
    assert "as the environment sets them" in configure_fla_env("gpu_a", (8, 9), V, user, False)
    assert user == {"FLA_CACHE_MODE": "disabled"}


def test_same_capability_fallback(tmp_path, monkeypatch):
    """Own folder first, then the capability's named sibling, then any GPU of that capability."""
    monkeypatch.setattr(fla_tables, "FLA_TABLE_DIR", tmp_path)
    sibling = capability_table((9, 0))
    assert sibling is not None
    _store(tmp_path, "other_sm90", "9.0")
    _store(tmp_path, "an_sm80", "8.0")
    assert fla_table_dir("new_sm90", (9, 0), V) == tmp_path / "other_sm90"
    assert fla_table_dir("new_sm90", (9, 0), ("0.6.0", "3.6.7")) == tmp_path / "other_sm90"
    assert fla_table_dir("new_sm89", (8, 9), V) is None
    _store(tmp_path, sibling, "9.0")
    assert fla_table_dir("new_sm90", (9, 0), V) == tmp_path / sibling
    _store(tmp_path, "new_sm90", "9.0", fla_core="0.5.0")
    assert fla_table_dir("new_sm90", (9, 0), V) == tmp_path / sibling
    assert fla_table_dir("new_sm90", (9, 0), ("0.5.0", "3.6.0")) == tmp_path / "new_sm90"


def test_shipped_tables_match_fla_keys():
    """Every stored entry sits under the hash fla computes for its key, so lookups find it."""
    files = sorted(FLA_TABLE_DIR.glob("*/*.json"))
    index = json.loads((FLA_TABLE_DIR / "index.json").read_text()) if files else {}
    assert sorted(index) == sorted({p.parent.name for p in files})
    for meta in index.values():
        assert {"name", "capability", "fla_core", "triton"} <= set(meta)
    for path in files:
        data = json.loads(path.read_text())
        assert fla_cache.KernelConfigFile.from_dict(path, data) is not None, path
        assert data["kernel_name"] == path.stem
        for digest, entry in data["autotune_entries"].items():
            assert fla_cache.AutotuneKey.key_hash(tuple(entry["autotune_key"])) == digest, (path, entry)
    assert os.path.isdir(FLA_TABLE_DIR) == bool(files)
