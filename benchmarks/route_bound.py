"""The most a fused router could save end to end: `nibble bench latency` with the router's kernel taken out of
the captured decode graphs.

`route` is wrapped so that eager calls (self-tests, prefill, the eager run that precedes each graph capture)
route as usual and keep their output per shape, and calls made while a CUDA graph is being captured return
the output kept for that shape instead of launching the kernel. The graphs then replay the layers with the
routing of their warm-up step, which reads the same number of distinct experts per layer: the decode steps'
time without the router is the bound on what folding it into the MoE's first kernel can gain.

    python benchmarks/route_bound.py --model benchmarks/models/Qwen3.5-35B-A3B-NVFP4 --load-format dummy \
        --batch-sizes 1,4,8 --input-len 1024 --output-len 64 --output-json out/route_bound.json

Every argument goes to `nibble bench latency`. The generated tokens are not those of a normal run (the
routing is frozen), so this measures time only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

import nibble.kernels.moe_route as moe_route
from nibble.cli import main


def frozen_route(route: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Callable[..., Any]:
    """`route` whose calls during a CUDA-graph capture return the last eager output of the same shape."""
    kept: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
    frozen = [0]

    def call(router_logits: torch.Tensor, top_k: int, renormalize: bool = True,
             num_valid_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        key = (tuple(router_logits.shape), top_k, router_logits.device)
        if router_logits.is_cuda and torch.cuda.is_current_stream_capturing() and key in kept:
            frozen[0] += 1
            return kept[key]
        out = route(router_logits, top_k, renormalize, num_valid_tokens)
        if router_logits.is_cuda and not torch.cuda.is_current_stream_capturing():
            kept[key] = (out[0].clone(), out[1].clone())
        return out

    call.frozen_calls = frozen  # type: ignore[attr-defined]
    return call


if __name__ == "__main__":
    moe_route.route = frozen_route(moe_route.route)
    rc = main(["bench", "latency", *sys.argv[1:]])
    print(f"route_bound: {moe_route.route.frozen_calls[0]} router calls left out of captured graphs", flush=True)
    sys.exit(rc)
