"""Launch NVFP4 `fused_moe` once per given configuration on one real layer shape, for Nsight Compute:

    ncu --clock-control none --kernel-name regex:moe_ --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats python benchmarks/moe_ncu.py --model 122B --tokens 1 --configs '[{}, ["gemv", {...}]]'

Every configuration is run twice (a compile/warm-up launch, then the profiled one: use
`--launch-skip`/`--launch-count` or read the second instance of each kernel).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_bench import MODELS, random_experts

from nibble.kernels.fused_moe import fused_moe_launch
from nibble.kernels.moe_route import route


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="122B", choices=sorted(MODELS))
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--configs", default="[{}]", help="JSON list of (path, config) pairs or config dicts")
    args = ap.parse_args()
    dev = torch.device("cuda")
    m = MODELS[args.model]
    gen = torch.Generator(dev)
    gen.manual_seed(0)
    experts = random_experts(args.model, dev, gen)
    x = torch.randn(args.tokens, m["hidden"], device=dev, dtype=torch.bfloat16, generator=gen)
    w, ids = route(torch.randn(args.tokens, m["experts"], device=dev, generator=gen), m["top_k"])
    for item in json.loads(args.configs):
        path, cfg = item if isinstance(item, list) else ("auto", item)
        for _ in range(2):
            fused_moe_launch(x, w, ids, experts, path=path, config=cfg)
        torch.cuda.synchronize()
        print(f"ran {path} {cfg}", flush=True)


if __name__ == "__main__":
    main()
