"""Fused MoE experts (Triton): NVFP4 (W4A16) or 16/32-bit expert weights; the contract and the torch
reference are `moe.fused_moe_ref` (expert id -1 = a slot of another expert-parallel rank, skipped).

Two paths, picked per call from the token count and pairs per expert (tuning tables `fused_moe` for NVFP4 experts,
`fused_moe_dense` otherwise; host ints only, no sync, a fixed grid per T: CUDA-graph safe):
- `gemv` (small decode batches): one block per (token, expert) pair, no sorting launch;
- `sorted` (larger batches, prefill): pairs sorted by expert (moe_align.py) into blocks of one expert;
  with `mixed_max_pairs` = m > 0 ("mixed"), experts with up to m pairs run the table's tile and those with
  more the `lg_*` one (quad-4 for the first, split-16 for the second on the H200: one decode of an expert's
  weights for up to 16 tokens, where quad-4 decodes them once per 4): one alignment launch for both, two
  launches per GEMM.
NVFP4 experts run the weight-stationary tensor-core kernels of moe_w4.py: gate_up with SiLU*up fused, down with the
routing weight fused, then the top-k sum in a fixed order (tuning field `dn_mode`: "reduce" = one small extra launch;
"fused" = done by the down kernel's last program per token and slice, `gemv` path only, counting in the
experts' `topk_counters` (`moe.topk_counters`; without them the reduce launch); "token" = a per-token down
kernel that loops over the k experts). `xmode` picks how the activations meet the weights' stride-4 K slices
("split", "quad", "perm": see moe_w4.py), `block_t` the token slots per block of the sorted path (and in quad mode of
the `gemv` path, whose one pair per program fills slot 0: up to 4, fewer slots make narrower MMAs), `cvt_decode`
(default on; the H100 table turns it off at one token of hidden sizes up to 3072, where the shift decode without
the staging launch is 4-6% faster) whether sm_89+ GPUs decode through the e4m3 converter in fp16 (fp4_tiles.py,
DEC 3; DEC 4, without its byte permute, in quad and split mode: `pair_decode`). Dense experts run the older
per-pair GEMV (moe_gemv.py) and grouped GEMM (moe_gemm.py) kernels, which `generic_gemv` / `generic_sorted` also
select for NVFP4 (the pre-moe_w4 baseline, kept for comparison). Very large batches run in token chunks to bound
the [pairs, H] intermediate.

Measured on one H200 (benchmarks/moe_bench.py, back-to-back layers, copy ceiling 4.18-4.27 TB/s;
docs/benchmarks.md), with the H200 table's choices, the converter decode (DEC 4 in quad and split mode), PDL
and the L2 prefetch of down's weights: 122B-A10B layer T=1 21.6 us (first generation: 50.5), T=8 95.4 (372),
T=32 279 (917), T=128 498-504 with the mixed tiles (2202), T=256 520-534, T=2048 1.77 ms (8.6 ms, before
DEC 4); 397B-A17B T=4-128 70-83% of copy bandwidth (537 us at T=32). The per-pair path with 2 token slots
(MMAs 8 columns wide) beats the sorted quad-4 tiles up to 16 tokens (122B), 20 (397B), 24 (35B): 4-14%.
The split-16 down tile has 128 rows and 8 warps: half the L2 re-reads of each block's activations of a 64-row
tile, 2-5% faster at 128-512 tokens.
The kernels' K loops are short (2-16 steps: H / 256 for gate_up, I / BLOCK_K for down), so the table keeps
their software pipelines shallow (3-4 stages): 0.4-4% faster than 4-6 at 1-512 tokens (35B T=1 unchanged).
Tuning fields `gu_tma` / `dn_tma` (per tile, `lg_` for the mixed path's second) load the weight tiles through
Hopper tensor descriptors (tma.py): on the H200 in the split-16 gate_up (1-4.5% less time at 256-512 tokens) and
the prefill tiles (11-17% less at 1024-8192, 122B T=2048 1.50 ms), not in the per-pair and quad-4 gate_up tiles
(3-13% slower); down's units also in the 4-warp split-16 / 32-slot tiles and the 122B's mixed quad-4 entry, whose
pointer loads left down waiting on memory (on an H100: 3-9% less layer time at 128-512 tokens).
Past 512 tokens the block size follows the pairs per expert, not the token count (default.json too): 64-slot
prefill blocks run one-third to half full at 12-28 pairs per expert, so split-16 blocks take up to 16 and split-32
up to 28, the latter with a 256-row down tile (on an H100: 13-25% faster at 576-896 tokens of the 122B and 35B
layers, 23-34% at 576-1280 of the 397B, whose 576 tokens took 2.44 ms and take 1.62). From 1280 tokens at hidden
3072+ (4096 at 2048) the prefill tile's down has 256 rows too, half the L2 re-reads of each block's
activations: 1.4-8% faster at 1536-8192 tokens (and for hidden 2048 at 192-512 tokens, 2.6-6.2%).
"""

from __future__ import annotations

from typing import Any

import torch

from nibble.formats.nvfp4 import NVFP4Tensor
from nibble.kernels._triton import cdiv, interpreting, triton
from nibble.kernels.fp4_tiles import F16_X_SHIFT, decode_mode, fp4_units, tile_for_dec
from nibble.kernels.moe import MoEWeights
from nibble.kernels.moe_align import moe_align, moe_align_split
from nibble.kernels.moe_gemm import moe_reduce_kernel
from nibble.kernels.moe_generic import generic_experts
from nibble.kernels.moe_w4 import (
    PERM,
    QUAD,
    SPLIT,
    XMODES,
    moe_w4_down_kernel,
    moe_w4_down_token_kernel,
    moe_w4_gate_up_kernel,
)
from nibble.kernels.pdl import pdl_launch, pdl_supported, prefetch_ok
from nibble.kernels.tma import tma_supported, w4_descriptors
from nibble.kernels.tuning_tables import lookup
from nibble.kernels.w4_stage import stage_x

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DN_MODES = ("reduce", "fused", "token")  # the pairs path's down + top-k sum (module docstring)


def _weight_args(w: torch.Tensor | NVFP4Tensor, n: int, k: int, num_experts: int, name: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int, int, int]]:
    """(values, block scales as uint8, global scales, (stride_qe, stride_qn, stride_se, stride_sn))."""
    if isinstance(w, NVFP4Tensor):
        q, s, g = w.packed, w.block_scale, w.global_scale
        if q.shape != (num_experts, n, k // 2) or s.shape != (num_experts, n, k // 16) or g.shape != (num_experts, n):
            raise ValueError(f"fused_moe: {name} NVFP4 shapes {tuple(q.shape)}/{tuple(s.shape)}/{tuple(g.shape)} "
                             f"for [{num_experts}, {n}, {k}]")
        if q.dtype != torch.uint8 or s.dtype != torch.float8_e4m3fn or g.dtype != torch.float32:
            raise ValueError(f"fused_moe: {name} NVFP4 dtypes {q.dtype}/{s.dtype}/{g.dtype}")
        if q.stride(2) != 1 or s.stride(2) != 1 or not g.is_contiguous():
            raise ValueError(f"fused_moe: {name} NVFP4 tensors must be contiguous along K")
        s = s.view(torch.uint8)
        return q, s, g, (q.stride(0), q.stride(1), s.stride(0), s.stride(1))
    if w.shape != (num_experts, n, k) or w.stride(2) != 1 or w.dtype not in ACT_DTYPES:
        raise ValueError(f"fused_moe: {name} {w.dtype} {tuple(w.shape)} (strides {w.stride()}) for "
                         f"[{num_experts}, {n}, {k}] contiguous along K")
    return w, w, w, (w.stride(0), w.stride(1), 0, 0)


def fused_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              experts: MoEWeights) -> torch.Tensor:
    """Triton `fused_moe_ref`: x [T, H], topk_weights fp32 [T, k], topk_ids int32 [T, k] -> [T, H]."""
    return fused_moe_launch(x, topk_weights, topk_ids, experts)


def fused_moe_generic(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      experts: MoEWeights) -> torch.Tensor:
    """The first-generation kernels (per-pair GEMV / grouped GEMM, FP4 decoded by table): slower than
    `fused_moe`, but a separate code path, so the registry can fall back to it if `fused_moe` fails its
    self-test on some GPU/Triton combination."""
    return fused_moe_launch(x, topk_weights, topk_ids, experts, path="generic_auto")


def tuning_key(tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, fp4: bool,
               num_routed_experts: int | None = None) -> dict[str, Any]:
    """The fields a `fused_moe` call looks its tuning-table entry up by (benchmarks/moe_winners.py writes entries
    for them): the shapes of the experts held here (num_experts of them), and the pairs each gets, counted over
    the num_routed_experts the router chooses among (default num_experts; more under expert parallelism)."""
    return {"tokens": tokens, "fp4": fp4, "hidden": hidden, "inter": inter, "experts": num_experts, "top_k": top_k,
            "pairs_per_expert": tokens * top_k / (num_routed_experts or num_experts)}


def fused_moe_launch(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts: MoEWeights,
                     *, path: str = "auto", config: dict[str, Any] | None = None) -> torch.Tensor:
    """`fused_moe` with the path ('auto', 'gemv', 'sorted', 'generic_gemv', 'generic_sorted') and tuning
    fields overridable (tests, benchmarks)."""
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in ACT_DTYPES:
        raise ValueError(f"fused_moe: x must be [T, H] bf16/fp16/fp32 with contiguous H, got {x.dtype} "
                         f"{tuple(x.shape)}")
    t, h = x.shape
    e, inter = experts.num_experts, experts.intermediate_size
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_ids.dtype != torch.int32:
        raise ValueError(f"fused_moe: topk_ids must be int32 [T, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    top_k = topk_ids.shape[1]
    if topk_weights.shape != (t, top_k) or topk_weights.dtype != torch.float32:
        raise ValueError(f"fused_moe: topk_weights must be fp32 [T, k], got {topk_weights.dtype} "
                         f"{tuple(topk_weights.shape)}")
    if experts.hidden_size != h:
        raise ValueError(f"fused_moe: experts have hidden size {experts.hidden_size}, x has {h}")
    fp4 = experts.is_nvfp4
    if fp4 and (h % 16 or inter % 16):
        raise ValueError(f"fused_moe: NVFP4 needs H and I multiples of 16, got {h}, {inter}")
    q13, s13, g13, st13 = _weight_args(experts.w13, 2 * inter, h, e, "w13")
    q2, s2, g2, st2 = _weight_args(experts.w2, h, inter, e, "w2")
    devs = {x.device, topk_weights.device, topk_ids.device, q13.device, q2.device}
    if len(devs) != 1:
        raise ValueError("fused_moe: tensors on different devices")
    out = torch.empty_like(x)
    if t == 0:
        return out
    ids = topk_ids.contiguous()
    tw = topk_weights.contiguous()
    key = tuning_key(t, h, inter, e, top_k, fp4, experts.routed_experts)
    generic = path.startswith("generic_") or not fp4
    cfg = lookup("fused_moe" if not generic else "fused_moe_dense", x.device, key)
    cfg.update(config or {})
    if path in ("auto", "generic_auto"):
        path = cfg["path"]
    path = path.removeprefix("generic_")
    if path not in ("gemv", "sorted"):
        raise ValueError(f"fused_moe: unknown path {path!r}")
    if generic:
        generic_experts(x, tw, ids, out, e, inter, top_k, fp4, (q13, s13, g13, st13), (q2, s2, g2, st2), path,
                        cfg)
    else:
        _w4(x, tw, ids, out, e, inter, top_k, (q13, s13, g13, st13), (q2, s2, g2, st2), path, cfg, experts)
    return out


def _counters(experts: MoEWeights, device: torch.device, n: int) -> torch.Tensor | None:
    """The experts' top-k counters if they can serve a call needing n of them, else None (reduce launch)."""
    c = experts.topk_counters
    if c is None or c.numel() < n or c.device != device:
        return None
    if c.dtype != torch.int32 or not c.is_contiguous():
        raise ValueError(f"fused_moe: topk_counters must be contiguous int32, got {c.dtype} {tuple(c.shape)}")
    return c


def _w4(x: torch.Tensor, tw: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, e: int, inter: int, top_k: int,
        w13: tuple, w2: tuple, path: str, cfg: dict[str, Any], experts: MoEWeights) -> None:
    """NVFP4 experts through moe_w4.py (see the module docstring)."""
    t, h = x.shape
    q13, s13, g13, st13 = w13
    q2, s2, g2, st2 = w2
    u13, u2 = fp4_units(q13), fp4_units(q2)
    (sq13e, sq13n, _), (sq2e, sq2n, _) = u13.stride(), u2.stride()
    dec = cfg.get("dec", decode_mode(x.dtype, x.device if cfg.get("cvt_decode", True) else None))
    # DEC 3 multiplies in fp16: bf16 activations are staged as fp16 * 2^-F16_X_SHIFT (gate_up writes act
    # the same way), the kernels' epilogues multiply the shift back
    adt = torch.float16 if dec >= 3 else x.dtype
    xsh = F16_X_SHIFT if adt != x.dtype else 0
    # sm_90+: gate_up (after stage_x), down (after gate_up) and the reduce start early with PDL (tuning field
    # `pdl`, default on); `gu_prefetch` / `dn_prefetch` (default off: neutral to 10% slower on the H200) make
    # gate_up / down first pull their weight rows into L2 (pdl.py)
    can_pdl = pdl_supported(x.device)
    pdl = can_pdl and bool(cfg.get("pdl", True))
    # `pdl_entry` (pairs path): the first kernel too starts early, behind whatever kernel is ahead (the
    # router), waiting before it reads anything; down / the reduce then let the next layer's start early.
    # On the H100's table at 1-16 tokens; not at the 122B's one token, where gate_up follows down directly and
    # their grids nearly fill the SMs' registers: gate_up's early programs probably land unevenly (19% slower)
    entry = pdl and bool(cfg.get("pdl_entry", False))
    gu_pf, dn_pf = bool(cfg.get("gu_prefetch", False)), bool(cfg.get("dn_prefetch", False))
    if (gu_pf or dn_pf) and not (can_pdl and h % 256 == 0 and inter % 256 == 0 and prefetch_ok(u13, s13, u2, s2)):
        gu_pf = dn_pf = False
    staged = adt != x.dtype
    base = _tile(cfg, "", dec, h, inter)
    dpdl = {"PREFETCH": dn_pf, **pdl_launch(pdl)}  # moe_w4_down_kernel only: the token kernel has no PDL
    rkw = pdl_launch(pdl)
    if path == "gemv":
        # one pair per block: token slot 0 of 16 in split mode, of `block_t` (at most 4) in quad mode (perm needs a
        # sort anyway); Triton pads an MMA narrower than 8 columns, so 1 or 2 slots halve the MMA's columns
        mode = cfg["dn_mode"]
        if mode not in DN_MODES:
            raise ValueError(f"fused_moe: tuning field dn_mode {mode!r} is not one of {DN_MODES}")
        gbn, gbk, dbn, dbk = base["gbn"], base["gbk"], base["dbn"], base["dbk"]
        gkw = {**base["glaunch"], "PREFETCH": gu_pf, "PDL_TRIGGER": pdl}
        dkw = base["dlaunch"]
        flat = ids.view(-1)
        xmode = SPLIT if base["xmode"] == PERM else base["xmode"]
        slots = min(max(int(cfg["block_t"]), 1), 4) if xmode == QUAD else 16
        dec = _pairs_dec(dec, xmode, staged, h, inter, gbn, cfg)
        # `staged`: a stage_x launch heads the chain (else gate_up does, reading x as it is)
        xs = stage_x(x, adt, xsh, permute=False, pdl_trigger=pdl, pairs=dec == 4, pdl_wait=entry) if staged else x
        act = torch.empty((t * top_k, inter), dtype=adt, device=x.device)
        moe_w4_gate_up_kernel[(t * top_k, cdiv(inter, gbn))](
            xs, u13, s13, g13, act, flat, flat, flat, top_k, h, inter, xs.stride(0), sq13e, sq13n,
            st13[2], st13[3], act.stride(0), SORTED=False, XMODE=xmode, ACT_PERM=False, ACT_PAIRS=dec == 4,
            DEC=dec, EVEN_K=h % gbk == 0, SLOTS=slots, BLOCK_N=gbn, BLOCK_K=gbk, X_SHIFT=xsh, **gkw,
            **pdl_launch(pdl and staged), **pdl_launch(entry and not staged, "PDL_WAIT_FIRST"),
            **_tma_args(base["gtma"], u13, s13, gbn, gbk, True))
        if mode == "token":
            moe_w4_down_token_kernel[(t, cdiv(h, dbn))](
                act, u2, s2, g2, out, flat, tw, h, inter, act.stride(0), sq2e, sq2n, st2[2], st2[3],
                out.stride(0), TOP_K=top_k, DEC=dec, EVEN_K=inter % dbk == 0, BLOCK_N=dbn, BLOCK_K=dbk, X_SHIFT=xsh,
                **dkw)
            return
        tiles = cdiv(h, dbn)
        sem = _counters(experts, x.device, t * tiles) if mode == "fused" else None
        y = torch.empty((t * top_k, h), dtype=torch.float32, device=x.device)
        moe_w4_down_kernel[(t * top_k, tiles)](
            act, u2, s2, g2, y, out, y if sem is None else sem, tw, flat, flat, flat, h, inter,
            act.stride(0), sq2e, sq2n, st2[2], st2[3], y.stride(0), out.stride(0), TOP_K=top_k, SORTED=False,
            XMODE=xmode, FUSED_SUM=sem is not None, DEC=dec, EVEN_K=inter % dbk == 0, SLOTS=slots, BLOCK_N=dbn,
            BLOCK_K=dbk, X_SHIFT=xsh, PDL_TRIGGER=pdl and (sem is None or entry), **dpdl, **dkw,
            **_tma_args(base["dtma"], u2, s2, dbn, dbk, False))
        if sem is None:
            moe_reduce_kernel[(t, cdiv(h, 1024))](y, out, flat, h, y.stride(0), out.stride(0), TOP_K=top_k,
                                                  BLOCK=1024, num_warps=4, PDL_TRIGGER=entry, **rkw)
        return
    tiles = [base]
    split = int(cfg.get("mixed_max_pairs", 0))
    if split > 0:
        # experts with up to `split` pairs run the table's tile, those with more the `lg_` one (one decode of
        # the weights for all their tokens): two alignments, two launches per GEMM, one staging of x and act
        large = _tile(cfg, "lg_", dec, h, inter)
        if {tiles[0]["xmode"], large["xmode"]} <= {QUAD, SPLIT}:
            tiles.append(large)
    xmode = tiles[0]["xmode"]
    dec = min(_pairs_dec(dec, tile["xmode"], staged, h, inter, tile["gbn"], cfg) for tile in tiles)
    chunk = max(1, min(t, cfg["chunk_pairs"] // top_k))
    act = torch.empty((chunk * top_k, inter), dtype=adt, device=x.device)
    y = torch.empty((chunk * top_k, h), dtype=x.dtype, device=x.device)
    buf = torch.empty((chunk, h), dtype=adt, device=x.device) if xmode == PERM or staged else None
    for c0 in range(0, t, chunk):
        c1 = min(t, c0 + chunk)
        ids_c = ids[c0:c1]
        if len(tiles) == 2:
            als = moe_align_split(ids_c, e, tiles[0]["slots"], tiles[1]["slots"], split)
        else:
            als = (moe_align(ids_c, e, tiles[0]["slots"]),)
        flat = ids_c.view(-1)
        xs = x[c0:c1]
        if buf is not None:
            xs = stage_x(xs, adt, xsh, permute=xmode == PERM, out=buf[:c1 - c0], pdl_trigger=pdl,
                          pairs=dec == 4)
        # PDL only for the first launch of each GEMM: it follows a kernel of the chain before it
        for i, (tile, al) in enumerate(zip(tiles, als)):
            moe_w4_gate_up_kernel[(al.max_blocks, cdiv(inter, tile["gbn"]))](
                xs, u13, s13, g13, act, flat, al.sorted_ids, al.block_expert, top_k, h, inter, xs.stride(0), sq13e,
                sq13n, st13[2], st13[3], act.stride(0), SORTED=True, XMODE=tile["xmode"], ACT_PERM=xmode == PERM,
                ACT_PAIRS=dec == 4, DEC=dec, EVEN_K=h % tile["gbk"] == 0, SLOTS=tile["slots"], BLOCK_N=tile["gbn"],
                BLOCK_K=tile["gbk"], X_SHIFT=xsh, **tile["glaunch"], PREFETCH=gu_pf, PDL_TRIGGER=pdl,
                **pdl_launch(pdl and buf is not None and i == 0),
                **_tma_args(tile["gtma"], u13, s13, tile["gbn"], tile["gbk"], True))
        for i, (tile, al) in enumerate(zip(tiles, als)):
            moe_w4_down_kernel[(al.max_blocks, cdiv(h, tile["dbn"]))](
                act, u2, s2, g2, y, out, y, tw[c0:c1], flat, al.sorted_ids, al.block_expert, h, inter, act.stride(0),
                sq2e, sq2n, st2[2], st2[3], y.stride(0), out.stride(0), TOP_K=top_k, SORTED=True, XMODE=tile["xmode"],
                FUSED_SUM=False, DEC=dec, EVEN_K=inter % tile["dbk"] == 0, SLOTS=tile["slots"], BLOCK_N=tile["dbn"],
                BLOCK_K=tile["dbk"], X_SHIFT=xsh, PDL_TRIGGER=pdl, **tile["dlaunch"],
                **({"PREFETCH": dn_pf, **pdl_launch(pdl)} if i == 0 else {}),
                **_tma_args(tile["dtma"], u2, s2, tile["dbn"], tile["dbk"], False))
        moe_reduce_kernel[(c1 - c0, cdiv(h, 1024))](y, out[c0:c1], flat, h, y.stride(0), out.stride(0),
                                                    TOP_K=top_k, BLOCK=1024, num_warps=4, **rkw)


def _xmode(cfg: dict[str, Any], prefix: str) -> int:
    name = cfg[f"{prefix}xmode"]
    if name not in XMODES:
        raise ValueError(f"fused_moe: tuning field {prefix}xmode {name!r} is not one of {tuple(XMODES)}")
    return XMODES[name]


def _tile(cfg: dict[str, Any], prefix: str, dec: int, h: int, inter: int) -> dict[str, Any]:
    """The gate_up and down tiles from the tuning fields under `prefix`, with the sorted path's x mode and
    token slots per block (the MMA's token side is at least 16 columns: 4 token slots in quad mode, 16
    tokens otherwise), the TMA levels of their weight loads (`gu_tma`, `dn_tma`: 0 = off, see `_tma_args`) and their
    launch options (warps, pipeline stages, and `gu_maxnreg` / `dn_maxnreg`: a cap on registers per thread, so that
    more programs fit an SM where registers bound them; 0 = no cap)."""
    xmode = _xmode(cfg, prefix)
    if xmode == PERM and (h % 4 or inter % 4):
        xmode = SPLIT
    gbk, g_stages = tile_for_dec(dec, cfg[f"{prefix}gu_block_k"], cfg[f"{prefix}gu_stages"])
    dbk, d_stages = tile_for_dec(dec, cfg[f"{prefix}dn_block_k"], cfg[f"{prefix}dn_stages"])
    # down's K is the expert's intermediate size, I / tp on a tensor-parallel rank (128 for the 397B at tp 8):
    # a K block past it only loads masked columns, and a single K step leaves the pipeline nothing to overlap,
    # so the block is at most half of I (20-50% faster at tp 8, 4-9% at tp 4, H100; full layers unchanged)
    dbk = min(dbk, max(64, triton.next_power_of_2(inter) // 2))
    return {"xmode": xmode, "slots": max(cfg[f"{prefix}block_t"], 4 if xmode == QUAD else 16),
            "gbn": cfg[f"{prefix}gu_block_n"], "gbk": gbk, "dbn": cfg[f"{prefix}dn_block_n"], "dbk": dbk,
            "glaunch": _launch(cfg[f"{prefix}gu_warps"], g_stages, cfg[f"{prefix}gu_maxnreg"]),
            "dlaunch": _launch(cfg[f"{prefix}dn_warps"], d_stages, cfg[f"{prefix}dn_maxnreg"]),
            "gtma": int(cfg.get(f"{prefix}gu_tma", 0)), "dtma": int(cfg.get(f"{prefix}dn_tma", 0))}


def _launch(warps: int, stages: int, maxnreg: int) -> dict[str, Any]:
    """A kernel's launch options; the register cap only where ptxas compiles (not under the interpreter)."""
    cap = {"maxnreg": int(maxnreg)} if maxnreg and not interpreting() else {}
    return {"num_warps": warps, "num_stages": stages, **cap}


def _pairs_dec(dec: int, xmode: int, staged: bool, h: int, inter: int, block_n: int, cfg: dict[str, Any]) -> int:
    """DEC 4 (the converter decode without its byte permute, fp4_tiles.py) in quad and split mode where the
    activations are staged anyway (bf16 -> fp16), so can be staged in the order it needs: x by `stage_x`,
    act by gate_up's row order (tuning field `pair_decode`, default on)."""
    ok = staged and xmode in (QUAD, SPLIT) and h % 8 == 0 and inter % 8 == 0 and block_n % 8 == 0
    return 4 if dec == 3 and ok and cfg.get("pair_decode", True) else dec


def _tma_args(level: int, units: torch.Tensor, scales: torch.Tensor, rows: int, block_k: int,
              stacked: bool) -> dict[str, Any]:
    """Launch keywords that make a moe_w4 kernel load its weight units (level 1) or units and block scales
    (level 2) by TMA (tuning fields `gu_tma` / `dn_tma`, default 0), as far as the descriptors can address them
    (`tma.w4_descriptors`)."""
    on = level > 0 and tma_supported(units.device)
    descs = w4_descriptors(units, scales, rows, block_k, stacked) if on else None
    if descs is None:
        return {}
    qd, sd = descs
    return {"q_desc": qd, "s_desc": sd, "TMA": 2} if level >= 2 and sd is not None else {"q_desc": qd, "TMA": 1}
