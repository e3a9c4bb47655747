"""Where the time of a small-T NVFP4 MoE layer goes (one CUDA GPU): probes that separate the memory side,
the kernels' instruction latency and the launch chain.

    python benchmarks/moe_probe.py [--models 122B,397B] [--tokens 1,2,4]

- `stream`: the layer as `moe_bench.py` times it (LAYERS expert stacks in a row, weights cold in L2);
- `l2`: the same launches with every (token, expert) pair routed to one expert of one stack, so the weights
  come from L2: the kernels' own latency with the DRAM taken out;
- `kernels`: per-kernel device times of one eager call (torch profiler);
- `read:*`: a streaming kernel that reads the bytes of the T = 1 gate_up / down weight tiles the way the
  kernels do (one dot per K step against a constant tile, so Triton pipelines the loads the same way), with
  rows `BLOCK_K/2` bytes apart as in the checkpoint ("rows") or with each program's K step stored as one
  contiguous tile ("tiled"), at the kernels' program count and at 2x / 4x more programs (split K);
- `read:pair`: the T = 1 and T = 2 layers' gate_up and down bytes (each pair a distinct expert) by two
  launches in a row and by one launch reading both at once (how much the boundary between the two kernels
  costs the memory side).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.moe_bench import LAYERS, MODELS, Timer, kernel_times, random_experts
from nibble.bench.latency import measure_copy_bandwidth
from nibble.kernels._triton import tl, triton
from nibble.kernels.fused_moe import fused_moe_launch
from nibble.kernels.moe_route import route


@triton.jit
def _read_rows(q_ptr, out_ptr, pid, k_units, ROWS: tl.constexpr, BU: tl.constexpr, TILED: tl.constexpr):
    """Program pid reads rows [pid * ROWS, (pid + 1) * ROWS) of q (int16 units [*, k_units]) in BU-unit K steps."""
    r = tl.arange(0, ROWS)
    u = tl.arange(0, BU)
    base = pid.to(tl.int64) * ROWS * k_units
    b = tl.full([BU, 16], 1.0, tl.float16)
    acc = tl.zeros([ROWS, 16], tl.float32)
    for k in range(0, k_units, BU):
        if TILED:
            off = base + k * ROWS + r[:, None] * BU + u[None, :]
        else:
            off = base + r[:, None] * k_units + k + u[None, :]
        w = tl.load(q_ptr + off).to(tl.float16, bitcast=True)
        acc = tl.dot(w, b, acc)
    tl.store(out_ptr + pid * ROWS * 16 + r[:, None] * 16 + tl.arange(0, 16)[None, :], acc)


@triton.jit
def _read_kernel(q_ptr, out_ptr, k_units, ROWS: tl.constexpr, BU: tl.constexpr, TILED: tl.constexpr):
    _read_rows(q_ptr, out_ptr, tl.program_id(0), k_units, ROWS, BU, TILED)


@triton.jit
def _read_pair_kernel(q1_ptr, q2_ptr, out_ptr, n1, k1, k2, ROWS: tl.constexpr, BU: tl.constexpr):
    """Programs [0, n1) read q1's rows as `_read_rows` does, programs n1 + p q2's rows of program p: both
    weight sets of a layer in one launch, so that down's bytes stream while gate_up's do."""
    pid = tl.program_id(0)
    if pid < n1:
        _read_rows(q1_ptr, out_ptr, pid, k1, ROWS, BU, False)
    else:
        _read_rows(q2_ptr, out_ptr + n1 * ROWS * 16, pid - n1, k2, ROWS, BU, False)


def _read_two(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, n1: int, n2: int, k1: int, k2: int,
              kw: dict) -> None:
    # the pair kernel for both launches, so that they run the one launch's code and differ only by the boundary
    _read_pair_kernel[(n1,)](a, b, out, n1, k1, k2, **kw)
    _read_pair_kernel[(n2,)](b, b, out, 0, k2, k2, **kw)


def read_pair_probe(timer: Timer, ceil: float) -> None:
    """The T = 1 and T = 2 layers' gate_up and down bytes read by two launches in a row (the kernels' structure: down
    starts after gate_up) and by one launch doing both at once: the memory side's floor with and without
    the boundary between the two kernels."""
    dev = torch.device("cuda")
    rpp, bu = 32, 32
    for t, model in itertools.product((1, 2), ("122B", "397B")):
        m = MODELS[model]
        name, experts, h, inter = f"{model} T={t}", t * m["top_k"], m["hidden"], m["inter"]
        r1, k1, r2, k2 = experts * 2 * inter, h // 4, experts * h, inter // 4
        sets = [(torch.randint(-2**15, 2**15, (r1, k1), dtype=torch.int16, device=dev),
                 torch.randint(-2**15, 2**15, (r2, k2), dtype=torch.int16, device=dev)) for _ in range(LAYERS)]
        nbytes = (r1 * k1 + r2 * k2) * 2
        n1, n2 = r1 // rpp, r2 // rpp
        out = torch.empty((n1 + n2) * rpp * 16, dtype=torch.float32, device=dev)
        kw = {"ROWS": rpp, "BU": bu, "num_warps": 2, "num_stages": 4}

        for label, fns in (("two launches", [partial(_read_two, a, b, out, n1, n2, k1, k2, kw) for a, b in sets]),
                           ("one launch", [partial(_read_pair_kernel[(n1 + n2,)], a, b, out, n1, k1, k2, **kw)
                                           for a, b in sets])):
            us = timer.stream_us(fns, flush=False)
            tb = nbytes / (us * 1e-6) / 1e12
            print(f"read:pair {name} {label:12} {n1 + n2:6d} programs {us:7.2f} us  {tb:5.2f} TB/s  "
                  f"{100 * tb / ceil:4.0f}%", flush=True)


def read_probe(timer: Timer, ceil: float) -> None:
    dev = torch.device("cuda")
    # (name, rows of all programs, K units, rows per program, units per step, warps, stages)
    shapes = [("gate_up 122B T=1", 8 * 2048, 3072 // 4, 32, 64, 2, 4),
              ("down 122B T=1", 8 * 3072, 1024 // 4, 32, 32, 2, 6)]
    for name, rows, ku, rpp, bu, warps, stages in shapes:
        bufs = [torch.randint(-2**15, 2**15, (rows, ku), dtype=torch.int16, device=dev) for _ in range(LAYERS)]
        nbytes = rows * ku * 2
        for tiled in (False, True):
            for split in (1, 2, 4):
                # split K: the same bytes as `split` times more programs with 1/split of K each
                r2, k2 = rows * split, ku // split
                views = [q.view(r2, k2) if tiled else q.view(rows, split, k2).transpose(0, 1).reshape(r2, k2)
                         for q in bufs]
                out = torch.empty(r2 // rpp * rpp * 16, dtype=torch.float32, device=dev)
                fns = [partial(_read_kernel[(r2 // rpp,)], v, out, k2, ROWS=rpp, BU=bu, TILED=tiled,
                               num_warps=warps, num_stages=stages) for v in views]
                us = timer.stream_us(fns, flush=False)
                tb = nbytes / (us * 1e-6) / 1e12
                print(f"read:{'tiled' if tiled else 'rows '} {name:18} split {split}  {r2 // rpp:6d} programs "
                      f"{us:7.2f} us  {tb:5.2f} TB/s  {100 * tb / ceil:4.0f}%", flush=True)


def layer_probe(timer: Timer, models: list[str], tokens: list[int], ceil: float) -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(dev)
    gen.manual_seed(0)
    for model in models:
        m = MODELS[model]
        h, e, k = m["hidden"], m["experts"], m["top_k"]
        stacks = [random_experts(model, dev, gen) for _ in range(LAYERS)]
        per_expert = (stacks[0].w13.nbytes() + stacks[0].w2.nbytes()) / e
        for t in tokens:
            x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=gen)
            w, ids = route(torch.randn(t, e, device=dev, generator=gen), k)
            nbytes = int(torch.unique(ids).numel()) * per_expert
            fns = [partial(fused_moe_launch, x, w, ids, s) for s in stacks]
            us = timer.stream_us(fns)
            one = torch.zeros_like(ids)
            l2 = timer.stream_us([partial(fused_moe_launch, x, w, one, stacks[0])] * LAYERS, flush=False)
            print(f"{model} T={t}: stream {us:7.1f} us ({100 * nbytes / (us * 1e-6) / 1e12 / ceil:4.0f}% of copy)  "
                  f"l2 (one expert) {l2:7.1f} us", flush=True)
            for kname, kus in kernel_times(fns[0]).items():
                print(f"      {kus:8.1f} us  {kname}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="122B,397B")
    ap.add_argument("--tokens", default="1,2,4")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/moe_probe.py needs a CUDA GPU")
    ceil = measure_copy_bandwidth(torch.device("cuda"), 1 << 30) / 1e12
    print(f"copy ceiling {ceil:.2f} TB/s", flush=True)
    timer = Timer(10)
    read_probe(timer, ceil)
    read_pair_probe(timer, ceil)
    layer_probe(timer, args.models.split(","), [int(t) for t in args.tokens.split(",")], ceil)


if __name__ == "__main__":
    main()
