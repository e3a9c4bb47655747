"""NVFP4 MoE gate_up for prefill blocks on Hopper (sm_90), written in Triton's Gluon dialect.

The Triton sorted-path tiles (moe_w4.py) gather each block's activation rows with per-thread loads and store
them to shared memory around every wgmma group, so their K loop waits on barriers and fences; on an H100 the
Gluon probe doing the same product with the activations by TMA took 1005 us where the Triton gate_up took 1520
(122B-A10B gate_up at 4096 tokens, docs/benchmarks.md, thirty-seventh session). Here:
- `gather_chunks` (w4_stage.py) first copies each sorted pair's token row into a [blocks * BM, H] buffer, fp16
  times 2^-F16_X_SHIFT, each BK chunk in the decode's slice order;
- `moe_gluon_gate_up_kernel`: one program per (BN features, block of BM pairs of one expert). The NVFP4 gate
  and up rows are decoded in registers (the e4m3-converter decode, fp4_tiles.DECODE_F16_CVT: one int16 unit of
  4 codes and its block scale -> four fp16 weights, one per K slice) straight into the A operand of async
  wgmma; the activation tiles arrive by TMA in a STAGES-deep mbarrier ring. Every step's wgmma are waited for
  before the next decode: the decode would otherwise rewrite the packed A registers of wgmma still running
  (the race of the thirty-seventh session's V1, which gave wrong tiles), and waiting costs nothing measurable
  since the SM's other programs fill the wait.
- The epilogue multiplies in the global scales, applies SiLU(gate) * up and writes act[pair, :] in the layout
  the Triton down kernel of the same call reads (natural, PERM slices, or DEC 4's pairs order).

Capability: sm_90 exactly (wgmma; Blackwell has tcgen05 instead), a Triton whose Gluon has the Hopper module,
not the interpreter. The torch reference is `gate_up_ref`.
"""

from __future__ import annotations

import functools

import torch

from nibble.formats.nvfp4 import NVFP4Tensor
from nibble.kernels._triton import capability, interpreting
from nibble.kernels.fp4_tiles import DECODE_F16_CVT, F16_X_SHIFT, fp4_units

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAVE_GLUON = True
except ImportError:  # no triton, or a Triton whose Gluon lacks the Hopper pieces
    HAVE_GLUON = False


def gluon_supported(device: torch.device | str) -> bool:
    """Whether `gluon_gate_up` can run on `device`: an sm_90 GPU, Gluon's Hopper module, no interpreter."""
    return HAVE_GLUON and not interpreting() and capability(device) == (9, 0)


def gluon_shapes_ok(hidden: int, inter: int, block_n: int, block_k: int, stages: int) -> bool:
    """Whether a layer of hidden size H and intermediate size I fits the tile: I a multiple of BN, H of BK (BK a
    multiple of 64: slices of 16+ fp16 columns), at least STAGES K steps."""
    return inter % block_n == 0 and block_k % 64 == 0 and hidden % block_k == 0 and hidden // block_k >= stages


def gluon_tile(cfg: dict, device: torch.device, fp16_decode: bool, hidden: int, inter: int) -> dict | None:
    """The Gluon gate_up tile a sorted-path `fused_moe` call runs instead of the Triton gate_up, from the tuning
    fields `gluon_bm` (pairs per block, 0 or absent: off), `gluon_bn` (weight rows of each of gate and up,
    default 64; with `gluon_stacked`, of both together), `gluon_bk` (64), `gluon_stages` (3), `gluon_warps`
    (BN / 16), `gluon_stacked` (gate and up in one accumulator); None where the table asks for none or it
    cannot run here (not sm_90, no Gluon, fp16_decode False: no fp16 activations for the converter decode,
    shapes off the tile)."""
    bm = int(cfg.get("gluon_bm", 0))
    if not bm or not fp16_decode or not gluon_supported(device):
        return None
    tile = {"bm": bm, "bn": int(cfg.get("gluon_bn", 64)), "bk": int(cfg.get("gluon_bk", 64)),
            "stages": int(cfg.get("gluon_stages", 3))}
    tile["warps"] = int(cfg.get("gluon_warps", tile["bn"] // 16))
    tile["stacked"] = bool(cfg.get("gluon_stacked", False))
    features = tile["bn"] // 2 if tile["stacked"] else tile["bn"]
    if tile["bn"] % (16 * tile["warps"]) or not gluon_shapes_ok(hidden, inter, features, tile["bk"], tile["stages"]):
        return None
    return tile


if HAVE_GLUON:

    @gluon.jit
    def _decode4(q, s, DECODE: gl.constexpr):
        """Units q int16 [BN, U] and their e4m3 block scales s uint8 [BN, U] -> four fp16 [BN, U] A fragments,
        fragment t holding each unit's code t."""
        sc = s.to(gl.float8e4nv, bitcast=True).to(gl.float16)
        return gl.inline_asm_elementwise(DECODE, "=r,=r,=r,=r,r,r", [q, sc],
                                         dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True,
                                         pack=2)

    @gluon.jit
    def _mma4(w0, w1, w2, w3, a_t, acc, U: gl.constexpr):
        """acc += sum_t w_t @ slice t of the activation stage a_t [BM, 4U], four async wgmma."""
        acc = warpgroup_mma(w0, a_t.slice(0, U, 1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(w1, a_t.slice(U, U, 1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(w2, a_t.slice(2 * U, U, 1).permute((1, 0)), acc, is_async=True)
        return warpgroup_mma(w3, a_t.slice(3 * U, U, 1).permute((1, 0)), acc, is_async=True)

    @gluon.jit
    def _act_cols(n, inter, ACT_PERM: gl.constexpr, ACT_PAIRS: gl.constexpr):
        """Column of feature n in the act buffer (moe_w4._act_col / w4_stage.pairs_col)."""
        if ACT_PERM:
            return (n % 4) * (inter // 4) + n // 4
        elif ACT_PAIRS:
            return (n & ~6) | ((n & 2) << 1) | ((n & 4) >> 1)
        else:
            return n

    @gluon.jit
    def moe_gluon_gate_up_kernel(a_desc, q_ptr, s_ptr, g_ptr, act_ptr, sorted_ptr, block_expert_ptr, hidden, inter,
                                 stride_qe, stride_qn, stride_se, stride_sn, stride_at, BM: gl.constexpr,
                                 BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr,
                                 DECODE: gl.constexpr, ACT_PERM: gl.constexpr, ACT_PAIRS: gl.constexpr,
                                 X_SHIFT: gl.constexpr):
        """act[pair, n] = silu(x[tok] . w13[e, n]) * (x[tok] . w13[e, I + n]) for block program_id(1)'s BM
        pairs and features n of slice program_id(0). a_desc: TMA descriptor of the gathered rows [blocks * BM,
        H] (`gather_chunks` with chunk BK, fp16 times 2^-X_SHIFT); q_ptr: w13's int16 units [E, 2I, H/4];
        s_ptr: uint8 e4m3 block scales [E, 2I, H/16]; g_ptr: fp32 global scales [E, 2I]; act: fp16 [pairs,
        I'] written times 2^-X_SHIFT, columns by `_act_cols`."""
        U: gl.constexpr = BK // 4
        blk = gl.program_id(1)
        e = gl.load(block_expert_ptr + blk)
        if e >= 0:
            acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                            instr_shape=[16, BM, 16])
            w_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
            a_s = gl.allocate_shared_memory(gl.float16, [STAGES, BM, BK], a_desc.layout)
            bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            off_m = blk * BM
            off_n = gl.program_id(0) * BN
            n_k = hidden // BK
            for j in gl.static_range(STAGES):
                mbarrier.init(bars.index(j), count=1)
            for j in gl.static_range(STAGES - 1):
                mbarrier.expect(bars.index(j), BM * BK * 2)
                tma.async_copy_global_to_shared(a_desc, [off_m, j * BK], bars.index(j), a_s.index(j))
            e64 = e.to(gl.int64)
            rn = (off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, w_l))).to(gl.int64)
            ru = gl.arange(0, U, layout=gl.SliceLayout(0, w_l))
            qg_rows = q_ptr + e64 * stride_qe + rn[:, None] * stride_qn + ru[None, :]
            sg_rows = s_ptr + e64 * stride_se + rn[:, None] * stride_sn + (ru // 4)[None, :]
            qu_rows = qg_rows + inter * stride_qn
            su_rows = sg_rows + inter * stride_sn
            qg = gl.load(qg_rows)
            sg = gl.load(sg_rows)
            qu = gl.load(qu_rows)
            su = gl.load(su_rows)
            acc_g = gl.zeros([BN, BM], gl.float32, acc_l)
            acc_u = gl.zeros([BN, BM], gl.float32, acc_l)
            for i in range(n_k):
                st = i % STAGES
                g0, g1, g2, g3 = _decode4(qg, sg, DECODE)
                u0, u1, u2, u3 = _decode4(qu, su, DECODE)
                mbarrier.wait(bars.index(st), (i // STAGES) & 1)
                a_t = a_s.index(st)
                acc_g = _mma4(g0, g1, g2, g3, a_t, acc_g, U)
                acc_u = _mma4(u0, u1, u2, u3, a_t, acc_u, U)
                more = (ru < (hidden - (i + 1) * BK) // 4)[None, :]
                qg = gl.load(qg_rows + (i + 1) * U, mask=more, other=0)
                sg = gl.load(sg_rows + (i + 1) * (U // 4), mask=more, other=0)
                qu = gl.load(qu_rows + (i + 1) * U, mask=more, other=0)
                su = gl.load(su_rows + (i + 1) * (U // 4), mask=more, other=0)
                # every wgmma of this step done before the next decode writes its A registers (module docstring);
                # then this step's stage is free for the tile STAGES - 1 steps on
                acc_g, acc_u = warpgroup_mma_wait(0, deps=[acc_g, acc_u])
                nxt = i + STAGES - 1
                if nxt < n_k:
                    mbarrier.expect(bars.index(nxt % STAGES), BM * BK * 2)
                    tma.async_copy_global_to_shared(a_desc, [off_m, nxt * BK], bars.index(nxt % STAGES),
                                                    a_s.index(nxt % STAGES))
            for j in gl.static_range(STAGES):
                mbarrier.invalidate(bars.index(j))
            acc_scale: gl.constexpr = 64.0 * (1 << X_SHIFT)
            n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_l))
            g_row = g_ptr + e64 * 2 * inter + n
            hg = acc_g * (gl.load(g_row) * acc_scale)[:, None]
            hu = acc_u * (gl.load(g_row + inter) * acc_scale)[:, None]
            act = hg / (1.0 + gl.exp(-hg)) * hu
            if X_SHIFT != 0:
                act = gl.minimum(gl.maximum(act * (1.0 / (1 << X_SHIFT)), -65504.0), 65504.0)
            m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(0, acc_l))
            pr = gl.load(sorted_ptr + m)
            ok = pr >= 0
            col = _act_cols(n, inter, ACT_PERM, ACT_PAIRS)
            gl.store(act_ptr + gl.where(ok, pr, 0).to(gl.int64)[None, :] * stride_at + col[:, None],
                     act.to(gl.float16), mask=ok[None, :])


    @gluon.jit
    def moe_gluon_gate_up_stacked_kernel(a_desc, q_ptr, s_ptr, g_ptr, act_ptr, sorted_ptr, block_expert_ptr, hidden,
                                         inter, stride_qe, stride_qn, stride_se, stride_sn, stride_at,
                                         BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                                         WARPS: gl.constexpr, DECODE: gl.constexpr, ACT_PERM: gl.constexpr,
                                         ACT_PAIRS: gl.constexpr, X_SHIFT: gl.constexpr):
        """`moe_gluon_gate_up_kernel` with gate and up in ONE accumulator: tile rows 0..BN/2-1 are gate rows of
        features off_n.., rows BN/2.. their up rows, so a program holds one [BN, BM] accumulator (half the
        registers of two, so BM = 128 fits with room for three programs per SM) and covers BN/2 features; the
        epilogue pairs row r with row r + BN/2 through a layout conversion (shared memory)."""
        U: gl.constexpr = BK // 4
        HALF: gl.constexpr = BN // 2
        blk = gl.program_id(1)
        e = gl.load(block_expert_ptr + blk)
        if e >= 0:
            acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                            instr_shape=[16, BM, 16])
            w_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
            a_s = gl.allocate_shared_memory(gl.float16, [STAGES, BM, BK], a_desc.layout)
            bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            off_m = blk * BM
            off_f = gl.program_id(0) * HALF
            n_k = hidden // BK
            for j in gl.static_range(STAGES):
                mbarrier.init(bars.index(j), count=1)
            for j in gl.static_range(STAGES - 1):
                mbarrier.expect(bars.index(j), BM * BK * 2)
                tma.async_copy_global_to_shared(a_desc, [off_m, j * BK], bars.index(j), a_s.index(j))
            e64 = e.to(gl.int64)
            r = gl.arange(0, BN, layout=gl.SliceLayout(1, w_l))
            rows = (off_f + r % HALF + (r // HALF) * inter).to(gl.int64)
            ru = gl.arange(0, U, layout=gl.SliceLayout(0, w_l))
            q_rows = q_ptr + e64 * stride_qe + rows[:, None] * stride_qn + ru[None, :]
            s_rows = s_ptr + e64 * stride_se + rows[:, None] * stride_sn + (ru // 4)[None, :]
            q = gl.load(q_rows)
            s = gl.load(s_rows)
            acc = gl.zeros([BN, BM], gl.float32, acc_l)
            for i in range(n_k):
                st = i % STAGES
                w0, w1, w2, w3 = _decode4(q, s, DECODE)
                mbarrier.wait(bars.index(st), (i // STAGES) & 1)
                acc = _mma4(w0, w1, w2, w3, a_s.index(st), acc, U)
                more = (ru < (hidden - (i + 1) * BK) // 4)[None, :]
                q = gl.load(q_rows + (i + 1) * U, mask=more, other=0)
                s = gl.load(s_rows + (i + 1) * (U // 4), mask=more, other=0)
                acc = warpgroup_mma_wait(0, deps=[acc])
                nxt = i + STAGES - 1
                if nxt < n_k:
                    mbarrier.expect(bars.index(nxt % STAGES), BM * BK * 2)
                    tma.async_copy_global_to_shared(a_desc, [off_m, nxt * BK], bars.index(nxt % STAGES),
                                                    a_s.index(nxt % STAGES))
            for j in gl.static_range(STAGES):
                mbarrier.invalidate(bars.index(j))
            acc_scale: gl.constexpr = 64.0 * (1 << X_SHIFT)
            ra = gl.arange(0, BN, layout=gl.SliceLayout(1, acc_l))
            h = acc * (gl.load(g_ptr + e64 * 2 * inter + off_f + ra % HALF + (ra // HALF) * inter) * acc_scale)[:, None]
            pair_l: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, 32, 1], [1, WARPS, 1], [2, 1, 0])
            h3 = gl.convert_layout(gl.permute(gl.reshape(h, [2, HALF, BM]), (1, 2, 0)), pair_l)
            hg, hu = gl.split(h3)
            act = hg / (1.0 + gl.exp(-hg)) * hu
            if X_SHIFT != 0:
                act = gl.minimum(gl.maximum(act * (1.0 / (1 << X_SHIFT)), -65504.0), 65504.0)
            out_l: gl.constexpr = hg.type.layout
            n = off_f + gl.arange(0, HALF, layout=gl.SliceLayout(1, out_l))
            m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(0, out_l))
            pr = gl.load(sorted_ptr + m)
            ok = pr >= 0
            col = _act_cols(n, inter, ACT_PERM, ACT_PAIRS)
            gl.store(act_ptr + gl.where(ok, pr, 0).to(gl.int64)[None, :] * stride_at + col[:, None],
                     act.to(gl.float16), mask=ok[None, :])


@functools.lru_cache(maxsize=32)
def _a_layout(block_m: int, block_k: int):
    return gl.NVMMASharedLayout.get_default_for([block_m, block_k], gl.float16)


def gluon_gate_up(xg: torch.Tensor, w13: NVFP4Tensor, act: torch.Tensor, sorted_ids: torch.Tensor,
                  block_expert: torch.Tensor, block_n: int = 64, block_k: int = 64, stages: int = 3,
                  act_perm: bool = False, act_pairs: bool = False, x_shift: int = F16_X_SHIFT,
                  num_warps: int = 4, stacked: bool = False) -> None:
    """Fill act fp16 [pairs, I] for the pairs of an alignment (sorted_ids int32 [R], block_expert int32 [R / BM])
    from xg fp16 [R, H] (`gather_chunks(x, sorted_ids, block_expert, top_k, block_k, fp16, x_shift)`) and the
    NVFP4 experts w13 [E, 2I, H] (rows I.. are up). act_perm / act_pairs: write act in PERM-mode slices or in
    DEC 4's pairs order (what the down kernel reading it wants). Rows of act that no pair of the alignment
    names are left alone. stacked: `moe_gluon_gate_up_stacked_kernel`, whose block_n weight rows are block_n / 2
    features' gate and up rows."""
    if not HAVE_GLUON:
        raise RuntimeError("gluon_gate_up: this Triton has no Gluon with the Hopper module")
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    r = sorted_ids.shape[0]
    block_m = r // max(1, block_expert.shape[0])
    if xg.dtype != torch.float16 or act.dtype != torch.float16 or xg.shape != (r, hidden) or xg.stride(1) != 1:
        raise ValueError(f"gluon_gate_up: xg must be fp16 [{r}, {hidden}] and act fp16, got {xg.dtype} "
                         f"{tuple(xg.shape)} and {act.dtype}")
    if act.shape[1] != inter or act.stride(1) != 1 or (act_perm and act_pairs):
        raise ValueError(f"gluon_gate_up: act must have {inter} contiguous columns in one order, got "
                         f"{tuple(act.shape)}")
    if block_m * block_expert.shape[0] != r or block_m not in (16, 32, 64, 128, 256):
        raise ValueError(f"gluon_gate_up: {r} sorted entries in {block_expert.shape[0]} blocks is not a block of "
                         f"16-256 rows")
    if (not gluon_shapes_ok(hidden, inter, block_n // 2 if stacked else block_n, block_k, stages)
            or block_n % (16 * num_warps)):
        raise ValueError(f"gluon_gate_up: H = {hidden}, I = {inter} do not fit a {block_n}x{block_k} tile with "
                         f"{stages} stages and {num_warps} warps (16 weight rows each)")
    units = fp4_units(w13.packed)
    scales = w13.block_scale.view(torch.uint8)
    gscale = w13.global_scale.float().reshape(num_experts, two_inter).contiguous()
    if units.stride(2) != 1 or scales.stride(2) != 1:
        raise ValueError("gluon_gate_up: w13's packed values and block scales need contiguous rows")
    if r == 0:
        return
    desc = TensorDescriptor.from_tensor(xg, [block_m, block_k], _a_layout(block_m, block_k))
    # the feature slices of a block run side by side, so its gathered rows come from HBM once and then from L2
    # (blocks first, each block's rows were re-read once per slice: 20-90% slower than the Triton tiles)
    kernel = moe_gluon_gate_up_stacked_kernel if stacked else moe_gluon_gate_up_kernel
    kernel[(inter // (block_n // 2 if stacked else block_n), block_expert.shape[0])](
        desc, units, scales, gscale, act, sorted_ids, block_expert, hidden, inter, units.stride(0),
        units.stride(1), scales.stride(0), scales.stride(1), act.stride(0), BM=block_m, BN=block_n, BK=block_k,
        STAGES=stages, WARPS=num_warps, DECODE=DECODE_F16_CVT.value, ACT_PERM=act_perm, ACT_PAIRS=act_pairs,
        X_SHIFT=x_shift, num_warps=num_warps)


def gate_up_ref(x: torch.Tensor, w13: NVFP4Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H], topk_ids int32 [T, k] -> fp32 [T * k, I]: row p = silu(x[p // k] W_gate^T) * (x[p // k] W_up^T)
    of expert topk_ids.view(-1)[p] (zeros for id -1), the act of `fused_moe_ref` before down."""
    top_k = topk_ids.shape[1]
    inter = w13.shape[1] // 2
    ids = topk_ids.reshape(-1).long()
    out = torch.zeros(ids.numel(), inter, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        p = torch.nonzero(ids == e).flatten()
        h = x[p // top_k].float() @ w13.select(e).dequantize().float().T
        out[p] = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
    return out
