"""fla-core's launch configurations for the GDN prefill kernels, stored per GPU like nibble's own tables.

fla-core autotunes its chunked gated-delta-rule kernels on first use: on a cold Triton cache that is most of
the start-up self-tests' time, compiling and timing every candidate configuration of every kernel (27 of the
48 s on an H100, paid by every fresh container). fla-core 0.6 can instead read the winners from JSON files,
one per kernel (`{kernel_name}.json`, entries keyed by the autotuner's key: shape constants and dtypes, never
the sequence length), from the folder `FLA_CONFIG_DIR` names, when `FLA_CACHE_MODE` says so. Nibble keeps
those files under `tuning/fla/<device>/` (device names as in `_triton.device_key`); `tuning/fla/index.json`
records for each folder the GPU's compute capability and the fla-core and Triton versions it was tuned with.
A folder serves only the fla-core version it was made with (another version may have renamed kernels or
changed their parameters) and the same Triton minor version; a GPU without a folder of its own takes the one
of the GPU `by_capability.json` names for its compute capability, else any folder of a GPU with the same
capability (same shared memory per SM, so every stored configuration fits).

`use_fla_tables` points fla-core there in "strict" mode (exact key match: shapes not stored, e.g. other
head counts under tensor parallelism, are autotuned as before). fla reads the mode once, when it is first
imported, so this runs before that import (`registry.fla_check`); settings the user made in the
environment are left as they are. `collect_fla_tables` / `write_fla_tables` / `record_fla_device` produce
the files from the autotuners of a process that has run the kernels (`benchmarks/fla_tables.py`).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from collections.abc import Iterable, MutableMapping
from pathlib import Path
from typing import Any

import torch

from nibble.kernels._triton import capability, device_key
from nibble.kernels.tuning_tables import TUNING_DIR, capability_key, capability_table

FLA_TABLE_DIR = TUNING_DIR / "fla"
INDEX_FILE = "index.json"
FLA_MODE = "strict"
_FLA_CACHE_MODULE = "fla.ops.utils.cache"


def _index(root: Path) -> dict[str, dict[str, str]]:
    path = root / INDEX_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def fla_table_candidates(key: str, cap: tuple[int, int] | None) -> list[tuple[str, dict[str, str]]]:
    """(folder name, index entry) of the stored configs device `key` (compute capability `cap`) may use,
    best first: its own, its capability's sibling's (`by_capability.json`), other GPUs of that capability."""
    index = _index(FLA_TABLE_DIR)
    cap_key = capability_key(cap)
    same_cap = sorted(n for n, meta in index.items() if cap_key is not None and meta.get("capability") == cap_key)
    return [(name, index[name]) for name in dict.fromkeys((key, capability_table(cap), *same_cap))
            if name and name in index and any((FLA_TABLE_DIR / name).glob("*.json"))]


def _minor(version: str | None) -> tuple[str, ...]:
    return tuple((version or "").split(".")[:2])


def fla_table_dir(key: str, cap: tuple[int, int] | None, versions: tuple[str | None, str | None]) -> Path | None:
    """The folder of stored configs for device `key` made with these (fla-core, Triton) versions, or None.
    fla-core must match exactly; Triton to the minor version (another Triton may use more shared memory or
    registers for the same configuration)."""
    fla_version, triton_version = versions
    for name, meta in fla_table_candidates(key, cap):
        if meta.get("fla_core") == fla_version and _minor(meta.get("triton")) == _minor(triton_version):
            return FLA_TABLE_DIR / name
    return None


def configure_fla_env(key: str, cap: tuple[int, int] | None, versions: tuple[str | None, str | None],
                      environ: MutableMapping[str, str], fla_imported: bool) -> str:
    """Set FLA_CACHE_MODE / FLA_CONFIG_DIR in `environ` for device `key` where that is possible and wanted;
    versions: the installed (fla-core, Triton). Returns what fla-core will do, as one line for the log and
    `nibble doctor`."""
    path = fla_table_dir(key, cap, versions)
    where = "" if path is None else str(path.relative_to(TUNING_DIR.parent) if path.is_relative_to(TUNING_DIR.parent)
                                        else path)
    used = f"fla-core configs from {where} ({FLA_MODE}: shapes not stored are autotuned)"
    if path is not None and environ.get("FLA_CONFIG_DIR") == str(path) and environ.get("FLA_CACHE_MODE") == FLA_MODE:
        return used  # set by an earlier call
    if "FLA_CACHE_MODE" in environ or "FLA_CONFIG_DIR" in environ:
        return (f"fla-core configs as the environment sets them (FLA_CACHE_MODE="
                f"{environ.get('FLA_CACHE_MODE', 'unset')}, FLA_CONFIG_DIR={environ.get('FLA_CONFIG_DIR', 'unset')})")
    if path is None:
        other = fla_table_candidates(key, cap)
        if other:
            name, meta = other[0]
            return (f"fla-core autotunes its kernels: the configs stored for {name} are for fla-core "
                    f"{meta.get('fla_core')} with Triton {meta.get('triton')}, "
                    f"this is {versions[0]} with {versions[1]}")
        return f"fla-core autotunes its kernels: no stored configs for {key}"
    if fla_imported:
        return f"fla-core autotunes its kernels: it was imported before nibble could point it at {where}"
    environ["FLA_CACHE_MODE"] = FLA_MODE
    environ["FLA_CONFIG_DIR"] = str(path)
    return used


def use_fla_tables(device: torch.device | str) -> str:
    """Point fla-core at the stored configs for `device` before it is imported (see the module docstring);
    returns the line `configure_fla_env` describes. Off CUDA devices nothing is set."""
    device = torch.device(device)
    if device.type != "cuda":
        return "fla-core not used off CUDA devices"
    try:
        versions = (importlib.metadata.version("fla-core"), importlib.metadata.version("triton"))
    except importlib.metadata.PackageNotFoundError as e:
        return f"fla-core autotunes its kernels if it runs: {e.name} not installed"
    return configure_fla_env(device_key(device), capability(device), versions, os.environ,
                             _FLA_CACHE_MODULE in sys.modules)


def fla_autotuners(stored_only: bool = True) -> list[Any]:
    """The Triton autotuners of fla's module-level kernels in the loaded fla modules, found under their
    `triton.heuristics` wrappers too: the config-file-aware ones (fla's `CachedAutotuner`), or with
    stored_only=False also plain `triton.autotune` ones, whose choice fla cannot read from a file."""
    cache_mod = sys.modules.get(_FLA_CACHE_MODULE)
    if cache_mod is None:
        return []
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    want = cache_mod.CachedAutotuner if stored_only else Autotuner
    found: dict[int, Any] = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("fla.") or mod is None:
            continue
        for value in list(vars(mod).values()):
            while isinstance(value, KernelInterface):
                if isinstance(value, want):
                    found[id(value)] = value
                value = getattr(value, "fn", None)
    return list(found.values())


def _config_dict(cfg: Any) -> dict[str, Any]:
    out = {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
           "num_ctas": getattr(cfg, "num_ctas", 1)}
    if getattr(cfg, "maxnreg", None) is not None:
        out["maxnreg"] = cfg.maxnreg
    return out


def collect_fla_tables(autotuners: Iterable[Any] | None = None) -> dict[str, dict[str, Any]]:
    """kernel name -> fla-core config file contents ({"kernel_name", "triton_version", "autotune_entries"})
    for every key the autotuners (default: all of fla's loaded ones) have settled. Two kernels of one name
    that settled the same key differently are an error: one file could not hold both."""
    import triton
    from fla.ops.utils.cache import AutotuneKey

    tables: dict[str, dict[str, Any]] = {}
    for tuner in autotuners if autotuners is not None else fla_autotuners():
        for key, cfg in tuner.cache.items():
            entries = tables.setdefault(tuner.kernel_name, {"kernel_name": tuner.kernel_name,
                                                             "triton_version": triton.__version__,
                                                             "autotune_entries": {}})["autotune_entries"]
            digest = AutotuneKey.key_hash(key)
            entry = {"autotune_key": AutotuneKey.normalize_autotune_key(list(key)), "config": _config_dict(cfg)}
            if entries.get(digest, entry) != entry:
                raise ValueError(f"{tuner.kernel_name}: two kernels of this name settled key {list(key)} differently")
            entries[digest] = entry
    return tables


def write_fla_tables(out_dir: Path, tables: dict[str, dict[str, Any]]) -> list[Path]:
    """Merge `tables` into the config files under `out_dir` (entries already there for other keys stay);
    returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, table in sorted(tables.items()):
        path = out_dir / f"{name}.json"
        merged = json.loads(path.read_text()) if path.is_file() else {}
        entries = {**merged.get("autotune_entries", {}), **table["autotune_entries"]}
        merged.update(table, autotune_entries=dict(sorted(entries.items())))
        path.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
        written.append(path)
    return written


def record_fla_device(root: Path, key: str, name: str, cap: tuple[int, int] | None, fla_version: str,
                      triton_version: str) -> None:
    """Note in root/index.json which GPU, capability and versions the folder root/key was tuned with."""
    index = _index(root)
    index[key] = {"name": name, "capability": capability_key(cap) or "", "fla_core": fla_version,
                  "triton": triton_version}
    (root / INDEX_FILE).write_text(json.dumps(dict(sorted(index.items())), indent=1) + "\n")
