"""Sorting (token, expert) pairs by expert for the grouped MoE GEMMs, on the GPU and without a host sync.

Pair p = t * top_k + j routes token t to expert topk_ids[t, j]. The pairs of each expert are laid out
contiguously in `sorted_ids`, each expert's segment starting at a multiple of BLOCK_M, so that every
BLOCK_M-row block of the grouped GEMM belongs to one expert (`block_expert`, -1 past the end). Buffers are
sized for the worst case (every expert hit leaves a partly filled block), so the host never needs the
counts. Every entry that holds no pair is -1, the padding inside an expert's last block in particular (so one
read of `sorted_ids` tells a block's pairs from its padding): the buffer is filled with -1 in coalesced stores
before the pairs are scattered into it (writing each expert's padding rows from the scan instead meant one
scattered store per row, 10-40 us of one program at prefill sizes). Order inside an expert segment depends on
atomics, which is harmless: each pair's result lands in its own row, so outputs do not depend on it. The
counting atomics are relaxed: Triton's default (acq_rel) fences every one, and a thread's atomics then ran one
after another (H100, the one-program alignment at 2048-4096 pairs: 13-23 us before both changes, 8-14 us after).

An alignment may keep only the experts whose pair count lies in [min_count, max_count]: the others get no
blocks and their pairs are not placed, so two alignments with complementary ranges split the experts
between two kernels with different block shapes (fused_moe's "mixed" sorted path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nibble.kernels._triton import cdiv, next_pow2, tl, triton

# the one program's counting and placing grow with the pairs; past ~2048 the four launches of the multi-program
# path were shorter (H100: 6.7-7.4 us + a 1.1 us memset against 9.4-11.9 us at 2560-4096 pairs)
SMALL_PAIRS = 2048


@dataclass
class MoEAlignment:
    """sorted_ids: int32 [max_padded] pair ids by expert; block_expert: int32 [max_blocks];
    expert_start / expert_count: int32 [E] (start -1 for an expert with pairs outside the alignment's count
    range; counts of all experts); block_m: rows per block."""

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    expert_start: torch.Tensor
    expert_count: torch.Tensor
    block_m: int

    @property
    def max_blocks(self) -> int:
        return int(self.block_expert.shape[0])


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    return cdiv(num_pairs + min(num_pairs, num_experts) * (block_m - 1), block_m) * block_m


@triton.jit
def _experts(ids_ptr, offs, mask):
    """(expert [BLOCK_P], live [BLOCK_P]) of pairs offs: id -1 is a slot of another expert-parallel rank, in
    no block."""
    e = tl.load(ids_ptr + offs, mask=mask, other=-1)
    return e, mask & (e >= 0)


@triton.jit
def _rank(counts_ptr, e, live):
    """Rank [BLOCK_P] of each live pair inside its expert: the old value of the expert's counter. Nothing is
    ordered against these atomics but by the barrier or kernel boundary after them."""
    return tl.atomic_add(counts_ptr + e, 1, mask=live, sem="relaxed")


@triton.jit
def _fill(ptr, first, n, step, value, FILL: tl.constexpr):
    """ptr[i] = value for i in [first, n), FILL entries every `step`."""
    f = tl.arange(0, FILL)
    for i0 in range(first, n, step):
        tl.store(ptr + i0 + f, tl.full([FILL], value, tl.int32), mask=i0 + f < n)


@triton.jit
def _load_counts(counts_ptr, n_exp, BLOCK_E: tl.constexpr):
    e = tl.arange(0, BLOCK_E)
    # .cg: the counts were just written by atomics in L2 (L1 could hold nothing fresher)
    return tl.load(counts_ptr + e, mask=e < n_exp, other=0, cache_modifier=".cg")


@triton.jit
def _scan(c_all, start_ptr, block_expert_ptr, n_exp, max_blocks, min_count, max_count, BLOCK_M: tl.constexpr,
          BLOCK_E: tl.constexpr, FILL: tl.constexpr):
    """Starts and block experts of one alignment from the pair counts c_all [BLOCK_E]."""
    e = tl.arange(0, BLOCK_E)
    emask = e < n_exp
    kept = (c_all >= min_count) & (c_all <= max_count)
    c = tl.where(kept, c_all, 0)
    nblk = tl.cdiv(c, BLOCK_M)
    end_blk = tl.cumsum(nblk, axis=0)
    start_blk = end_blk - nblk
    # start -1: an expert with pairs outside the count range, whose pairs `_place` then does not place
    tl.store(start_ptr + e, tl.where(kept | (c_all == 0), start_blk * BLOCK_M, -1), mask=emask)
    for i in range(0, tl.max(nblk, axis=0)):
        tl.store(block_expert_ptr + start_blk + i, e, mask=emask & (i < nblk))
    _fill(block_expert_ptr, tl.sum(nblk, axis=0), max_blocks, FILL, -1, FILL)


@triton.jit
def _place(start_ptr, sorted_ptr, e, r, offs, live):
    """sorted_ids[start[e] + r] = pair offs, for the live pairs of experts the alignment keeps."""
    s = tl.load(start_ptr + e, mask=live, other=-1, cache_modifier=".cg")
    tl.store(sorted_ptr + s + r, offs, mask=live & (s >= 0))


@triton.jit(do_not_specialize=["n_pairs", "max_blocks", "min_count", "max_count", "max_blocks2", "min_count2",
                                "max_count2", "n_sorted"])
def _align_small_kernel(ids_ptr, counts_ptr, start_ptr, block_expert_ptr, sorted_ptr, n_pairs, n_exp, max_blocks,
                        min_count, max_count, start2_ptr, block_expert2_ptr, sorted2_ptr, max_blocks2, min_count2,
                        max_count2, n_sorted, BLOCK_M: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_P: tl.constexpr, FILL: tl.constexpr, TWO: tl.constexpr):
    """Everything in one program (decode sizes); TWO: a second alignment (the *2 arguments) from the same
    counts. sorted_ptr: n_sorted entries holding both alignments' sorted_ids (sorted2_ptr points into them).
    Each pair's expert and rank stay in registers from the count to the placing: no rank buffer, no reloads."""
    offs = tl.arange(0, BLOCK_P)
    e, live = _experts(ids_ptr, offs, offs < n_pairs)
    ex = tl.arange(0, BLOCK_E)
    tl.store(counts_ptr + ex, tl.zeros([BLOCK_E], tl.int32), mask=ex < n_exp)
    _fill(sorted_ptr, 0, n_sorted, FILL, -1, FILL)
    tl.debug_barrier()
    r = _rank(counts_ptr, e, live)
    tl.debug_barrier()
    c_all = _load_counts(counts_ptr, n_exp, BLOCK_E)
    _scan(c_all, start_ptr, block_expert_ptr, n_exp, max_blocks, min_count, max_count, BLOCK_M, BLOCK_E, FILL)
    if TWO:
        _scan(c_all, start2_ptr, block_expert2_ptr, n_exp, max_blocks2, min_count2, max_count2, BLOCK_M2, BLOCK_E,
              FILL)
    tl.debug_barrier()
    _place(start_ptr, sorted_ptr, e, r, offs, live)
    if TWO:
        _place(start2_ptr, sorted2_ptr, e, r, offs, live)


@triton.jit(do_not_specialize=["n_pairs", "n_sorted"])
def _count_kernel(ids_ptr, counts_ptr, rank_ptr, sorted_ptr, n_pairs, n_sorted, BLOCK_P: tl.constexpr,
                  FILL: tl.constexpr):
    """Counts and ranks of BLOCK_P pairs; the programs also fill the n_sorted entries of sorted_ptr (every
    alignment's sorted_ids) with -1, in turns of FILL entries."""
    offs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    e, live = _experts(ids_ptr, offs, offs < n_pairs)
    tl.store(rank_ptr + offs, _rank(counts_ptr, e, live), mask=live)
    _fill(sorted_ptr, tl.program_id(0) * FILL, n_sorted, tl.num_programs(0) * FILL, -1, FILL)


@triton.jit(do_not_specialize=["max_blocks", "min_count", "max_count"])
def _scan_kernel(counts_ptr, start_ptr, block_expert_ptr, n_exp, max_blocks, min_count, max_count,
                 BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, FILL: tl.constexpr):
    _scan(_load_counts(counts_ptr, n_exp, BLOCK_E), start_ptr, block_expert_ptr, n_exp, max_blocks, min_count,
          max_count, BLOCK_M, BLOCK_E, FILL)


@triton.jit(do_not_specialize=["n_pairs"])
def _scatter_kernel(ids_ptr, rank_ptr, start_ptr, sorted_ptr, n_pairs, BLOCK_P: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    e, live = _experts(ids_ptr, offs, offs < n_pairs)
    _place(start_ptr, sorted_ptr, e, tl.load(rank_ptr + offs, mask=live, other=0), offs, live)


def _buffers(n_pairs: int, num_experts: int, block_ms: list[int], dev: torch.device
             ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """(all sorted_ids in one buffer, [(sorted_ids view, block_expert, start)] per block size)."""
    for bm in block_ms:
        if bm & (bm - 1):
            raise ValueError(f"moe_align: block_m {bm} is not a power of two")
    sizes = [max_padded_pairs(n_pairs, num_experts, bm) for bm in block_ms]
    sorted_all = torch.empty(sum(sizes), dtype=torch.int32, device=dev)
    return sorted_all, [(ids, torch.empty(size // bm, dtype=torch.int32, device=dev),
                         torch.empty(num_experts, dtype=torch.int32, device=dev))
                        for ids, size, bm in zip(sorted_all.split(sizes), sizes, block_ms)]


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, min_count: int = 1,
              max_count: int | None = None) -> MoEAlignment:
    """topk_ids: int32 [T, k] (contiguous) -> MoEAlignment of the experts with min_count..max_count pairs
    (default: every expert with pairs). One single-program launch for up to SMALL_PAIRS pairs (decode),
    otherwise a zeroing memset and three kernels (count with atomics and the -1 fill, scan, scatter)."""
    return _align(topk_ids, num_experts, [(block_m, min_count, max_count)])[0]


def moe_align_split(topk_ids: torch.Tensor, num_experts: int, block_small: int, block_large: int,
                    split: int) -> tuple[MoEAlignment, MoEAlignment]:
    """Two alignments from one count: the experts with 1..split pairs in blocks of block_small, those with
    more in blocks of block_large (one launch at decode sizes instead of two)."""
    small, large = _align(topk_ids, num_experts, [(block_small, 1, split), (block_large, split + 1, None)])
    return small, large


def _align(topk_ids: torch.Tensor, num_experts: int, specs: list[tuple[int, int, int | None]]
           ) -> list[MoEAlignment]:
    if topk_ids.dim() != 2 or topk_ids.dtype != torch.int32 or not topk_ids.is_contiguous():
        raise ValueError(f"moe_align: topk_ids must be contiguous int32 [T, k], got {topk_ids.dtype} "
                         f"{tuple(topk_ids.shape)}")
    dev = topk_ids.device
    n_pairs = topk_ids.numel()
    ranges = [(max(1, lo), n_pairs if hi is None else min(hi, n_pairs)) for _, lo, hi in specs]
    sorted_all, bufs = _buffers(n_pairs, num_experts, [bm for bm, _, _ in specs], dev)
    block_e = next_pow2(num_experts)
    fill = 1024
    if n_pairs <= SMALL_PAIRS:
        counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
        (sorted_ids, block_expert, start), (lo, hi) = bufs[0], ranges[0]
        two = len(specs) == 2
        (sorted2, block_expert2, start2), (lo2, hi2) = (bufs[1], ranges[1]) if two else (bufs[0], ranges[0])
        _align_small_kernel[(1,)](
            topk_ids, counts, start, block_expert, sorted_ids, n_pairs, num_experts, block_expert.shape[0], lo, hi,
            start2, block_expert2, sorted2, block_expert2.shape[0], lo2, hi2, sorted_all.numel(),
            BLOCK_M=specs[0][0], BLOCK_M2=specs[-1][0], BLOCK_E=block_e, BLOCK_P=next_pow2(max(n_pairs, 16)),
            FILL=fill, TWO=two, num_warps=8)
    else:
        counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
        rank = torch.empty(n_pairs, dtype=torch.int32, device=dev)
        block_p = 1024
        grid = (cdiv(n_pairs, block_p),)
        _count_kernel[grid](topk_ids, counts, rank, sorted_all, n_pairs, sorted_all.numel(), BLOCK_P=block_p,
                            FILL=fill, num_warps=4)
        for (bm, _, _), (sorted_ids, block_expert, start), (lo, hi) in zip(specs, bufs, ranges):
            _scan_kernel[(1,)](counts, start, block_expert, num_experts, block_expert.shape[0], lo, hi, BLOCK_M=bm,
                               BLOCK_E=block_e, FILL=fill, num_warps=4)
            _scatter_kernel[grid](topk_ids, rank, start, sorted_ids, n_pairs, BLOCK_P=block_p, num_warps=4)
    return [MoEAlignment(sorted_ids, block_expert, start, counts, bm)
            for (bm, _, _), (sorted_ids, block_expert, start) in zip(specs, bufs)]


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int, min_count: int = 1,
                  max_count: int | None = None) -> MoEAlignment:
    """Torch version of `moe_align` (stable order inside each expert), for tests."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    n_pairs = flat.numel()
    counts = torch.bincount(flat[flat >= 0], minlength=num_experts)
    kept = (counts >= min_count) & (counts <= (n_pairs if max_count is None else max_count))
    nblk = (torch.where(kept, counts, 0) + block_m - 1) // block_m
    start = torch.where(kept | (counts == 0), (torch.cumsum(nblk, 0) - nblk) * block_m, -1)
    max_padded = max_padded_pairs(n_pairs, num_experts, block_m)
    sorted_ids = torch.full((max_padded,), -1, dtype=torch.int32, device=dev)
    block_expert = torch.full((max_padded // block_m,), -1, dtype=torch.int32, device=dev)
    for e in range(num_experts):
        if not kept[e]:
            continue
        pairs = torch.nonzero(flat == e).flatten()
        s = int(start[e])
        sorted_ids[s:s + pairs.numel()] = pairs.to(torch.int32)
        block_expert[s // block_m:s // block_m + int(nblk[e])] = e
    return MoEAlignment(sorted_ids, block_expert, start.to(torch.int32), counts.to(torch.int32), block_m)
