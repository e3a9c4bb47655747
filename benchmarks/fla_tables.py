"""fla-core's launch configurations for this GPU (`nibble/kernels/fla_tables.py`): store them, and time the
start-up self-tests on a cold Triton cache with and without them.

    python benchmarks/fla_tables.py write --models 122B,35B [--tp 1,2,4,8] [--dir DIR] [--json F]
        fla autotunes (FLA_CACHE_MODE=disabled) the GDN prefill kernels on each model's real shapes (with
        --tp also on a tensor-parallel rank's share of the GDN heads, where the heads divide), through
        the self-test of `gated_delta_rule` and a two-sequence prefill of 2825 tokens; the settled configs
        are merged into DIR (default: nibble/kernels/tuning/fla/<this GPU>/), the GPU and versions noted in
        DIR/../index.json.
    python benchmarks/fla_tables.py select --model 122B [--json F]
        `select_kernels` for the model as an engine start runs it (bf16), with whatever fla settings the
        environment and the stored tables give; prints the selection table and which fla kernels autotuned.

Run each in a fresh process with a fresh TRITON_CACHE_DIR for cold figures (`gpu_session.sh flatables`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nibble.kernels._triton import capability, device_key  # noqa: E402
from nibble.kernels.fla_tables import FLA_TABLE_DIR, collect_fla_tables, fla_autotuners, use_fla_tables  # noqa: E402
from nibble.models.config import ModelConfig  # noqa: E402

MODELS = {"122B": "Qwen3.5-122B-A10B-NVFP4", "35B": "Qwen3.5-35B-A3B-NVFP4", "397B": "Qwen3.5-397B-A17B-NVFP4"}


def _config(name: str) -> ModelConfig:
    return ModelConfig.from_pretrained(ROOT / "benchmarks" / "models" / MODELS[name])


def _tuned() -> list[str]:
    """fla kernels that ran Triton's autotuning in this process ("(plain)": `triton.autotune`, not storable)."""
    stored = {id(t) for t in fla_autotuners()}
    ran = [t for t in fla_autotuners(stored_only=False) if getattr(t, "configs_timings", None) is not None]
    return sorted(t.base_fn.__name__ + ("" if id(t) in stored else " (plain)") for t in ran)


def _rank_configs(cfg: ModelConfig, tps: list[int]) -> list[tuple[int, ModelConfig]]:
    """(tp, the config with one rank's share of the GDN heads) for each tensor-parallel size dividing them."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    return [(tp, dataclasses.replace(cfg, linear_num_key_heads=hk // tp, linear_num_value_heads=hv // tp))
            for tp in tps if hk % tp == 0 and hv % tp == 0]


def write(models: list[str], tps: list[int], out_dir: Path | None) -> dict:
    os.environ["FLA_CACHE_MODE"] = "disabled"  # before fla's first import: autotune everything afresh
    import triton

    from nibble.kernels.fla_tables import record_fla_device, write_fla_tables
    from nibble.kernels.gated_delta import gated_delta_rule_fla
    from nibble.kernels.selftest import SelfTestContext
    from nibble.kernels.selftest_gdn import test_gated_delta_rule

    dev = torch.device("cuda", 0)
    out_dir = out_dir or FLA_TABLE_DIR / device_key(dev)
    res: dict = {"device": torch.cuda.get_device_name(dev), "dir": str(out_dir), "models": {}}
    for name, tp, cfg in ((m, tp, c) for m in models for tp, c in _rank_configs(_config(m), tps)):
        gen = torch.Generator(device=dev)
        gen.manual_seed(0)
        ctx = SelfTestContext(cfg, dev, torch.bfloat16, torch.bfloat16, 16, gen)
        t0 = time.perf_counter()
        err = test_gated_delta_rule(gated_delta_rule_fla, ctx)
        t1 = time.perf_counter()
        q_lens = [2048, 777]
        hk, hv, d = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim
        t = sum(q_lens)
        q, k, v = ctx.randn(t, hk, d), ctx.randn(t, hk, d), ctx.randn(t, hv, cfg.linear_value_head_dim)
        g, beta = -0.5 * ctx.rand(t, hv), ctx.rand(t, hv).to(torch.bfloat16)
        state = torch.zeros(2, hv, d, cfg.linear_value_head_dim, device=dev)
        offsets = [0, q_lens[0], t]
        cu = torch.tensor(offsets, dtype=torch.int32, device=dev)
        slots = torch.tensor([0, 1], dtype=torch.int32, device=dev)
        gated_delta_rule_fla(q, k, v, g, beta, state, cu, slots, cu_seqlens_cpu=offsets)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        res["models"][f"{name} tp{tp}"] = {"heads": [hk, hv], "selftest_s": round(t1 - t0, 2), "rel_err": err,
                                           "prefill_after_s": round(t2 - t1, 2), "autotuned": _tuned()}
        print(f"{name}, TP {tp}: GDN heads {hk}/{hv}: self-test {t1 - t0:.1f} s (rel err {err:.2e}), then a {t}-token "
              f"prefill {t2 - t1:.2f} s", flush=True)
    tables = collect_fla_tables()
    paths = write_fla_tables(out_dir, tables)
    record_fla_device(out_dir.parent, out_dir.name, torch.cuda.get_device_name(dev), capability(dev),
                      importlib.metadata.version("fla-core"), triton.__version__)
    res["files"] = {p.name: len(json.loads(p.read_text())["autotune_entries"]) for p in paths}
    print(f"wrote {len(paths)} files to {out_dir}: {res['files']}")
    return res


def select(model: str) -> dict:
    from nibble.kernels.registry import select_kernels

    dev = torch.device("cuda", 0)
    fla_line = use_fla_tables(dev)
    print(fla_line, flush=True)
    t0 = time.perf_counter()
    _, report = select_kernels(_config(model), dev, torch.bfloat16)
    wall = time.perf_counter() - t0
    print(report.table())
    tuned = _tuned()
    print(f"fla kernels autotuned: {', '.join(tuned) or 'none'}; select_kernels {wall:.1f} s")
    return {"device": torch.cuda.get_device_name(dev), "model": model, "fla": fla_line, "wall_s": round(wall, 2),
            "self_tests_s": round(report.total_seconds, 2), "autotuned": tuned,
            "first_call_s": {r.op: round(r.first_call_seconds, 2) for r in report.results if r.rel_error is not None},
            "rel_err": {r.op: r.rel_error for r in report.results if r.rel_error is not None},
            "selected": report.selected,
            "env": {k: os.environ.get(k) for k in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR", "TRITON_CACHE_DIR")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("--models", default="122B,35B")
    w.add_argument("--tp", default="1", help="tensor-parallel sizes whose per-rank GDN shapes to store too")
    w.add_argument("--dir", type=Path, default=None)
    w.add_argument("--json", type=Path, default=None)
    s = sub.add_parser("select")
    s.add_argument("--model", default="122B", choices=sorted(MODELS))
    s.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.cmd == "write":
        res = write(args.models.split(","), [int(v) for v in args.tp.split(",")], args.dir)
    else:
        res = select(args.model)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
