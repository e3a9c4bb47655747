"""Tenth session probe (ran as benchmarks/tmp_probe/split_check.py, split_k_experiment.diff applied): which part of
the split-K experiment fails at large T on the GPU."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
from moe_bench import random_experts

from nibble.kernels.fused_moe import fused_moe_launch
from nibble.kernels.moe import fused_moe_ref, route_ref

h, inter, e, k = 3072, 1024, 256, 8
torch.manual_seed(0)
ex = random_experts("122B", torch.device("cuda"), torch.Generator("cuda").manual_seed(0))
for t in (1, 6, 16, 33, 64, 300):
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    w, ids = route_ref(torch.randn(t, e, device="cuda"), k)
    ref = fused_moe_ref(x.float(), w, ids, ex)
    for name, cfg in (("table", {}), ("fused", {"dn_mode": "fused"}),
                      ("fused-q", {"dn_mode": "fused", "xmode": "quad"}),
                      ("gsk2", {"gu_split_k": 2}), ("gsk2-q", {"gu_split_k": 2, "xmode": "quad"}),
                      ("dsk2", {"dn_mode": "fused", "dn_split_k": 2}),
                      ("gsk2-dsk2", {"gu_split_k": 2, "dn_mode": "fused", "dn_split_k": 2})):
        try:
            out = fused_moe_launch(x, w, ids, ex, path="gemv", config=cfg)
            torch.cuda.synchronize()
            err = float((out.float() - ref).norm() / ref.norm())
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"[:200]
        print(f"T={t:4d} {name:10s} {err}", flush=True)
