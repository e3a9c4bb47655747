"""Weight-tile loaders and K steps shared by the NVFP4 (and 16-bit) GEMM/GEMV kernels of nvfp4_linear and MoE.

An NVFP4 weight row n holds K/2 bytes (low nibble = even element) and K/16 e4m3 block scales. Tiles are
dequantised in registers with the block scale only (exact in bf16/fp16: e2m1 x e4m3 needs 6 significant
bits); callers apply the fp32 per-row global scale to their fp32 accumulators. A K tile of BLOCK_K
elements is split into its even and odd elements, so no nibble interleaving is needed: the even values
meet the even activations in one dot (or FMA) and the odd values the odd ones.
"""

from __future__ import annotations

import torch

from nibble.kernels._triton import e4m3_to_f32, fp4_unpack, fp8_native, interpreting, tl, triton


@triton.jit
def fp4_tile_kn(q_ptr, s_ptr, rows, nmask, k0, n_k, stride_qn, stride_sn, GROUPS: tl.constexpr,
                BLOCK_N: tl.constexpr, dtype: tl.constexpr):
    """Dot B operands (even, odd), each [GROUPS*8, BLOCK_N] in `dtype`: W[rows, k0 + 2i] and
    W[rows, k0 + 2i + 1] for i < GROUPS*8 (a BLOCK_K = GROUPS*16 slice of K); rows: int64 [BLOCK_N] row
    indices, masked rows and groups past n_k read as 0."""
    g = tl.arange(0, GROUPS)
    j = tl.arange(0, 8)
    kg = k0 // 16 + g
    gmask = kg < n_k // 16
    b = tl.load(q_ptr + rows[None, None, :] * stride_qn + (kg * 8)[:, None, None] + j[None, :, None],
                mask=gmask[:, None, None] & nmask[None, None, :], other=0)
    s = tl.load(s_ptr + rows[None, :] * stride_sn + kg[:, None], mask=gmask[:, None] & nmask[None, :], other=0)
    sf = (e4m3_to_f32(s) * 16384.0)[:, None, :]
    lo, hi = fp4_unpack(b)
    we = tl.reshape(lo.to(tl.float32) * sf, [GROUPS * 8, BLOCK_N]).to(dtype)
    wo = tl.reshape(hi.to(tl.float32) * sf, [GROUPS * 8, BLOCK_N]).to(dtype)
    return we, wo


@triton.jit
def x_even_odd(x_rows, rmask, k0, n_k, HALF: tl.constexpr):
    """Activation tiles (even, odd) [BLOCK_M, HALF] matching `fp4_tile_kn`; x_rows: row pointers [BLOCK_M]."""
    kk = k0 + 2 * tl.arange(0, HALF)
    m = rmask[:, None] & (kk[None, :] < n_k)
    xe = tl.load(x_rows[:, None] + kk[None, :], mask=m, other=0.0)
    xo = tl.load(x_rows[:, None] + kk[None, :] + 1, mask=m, other=0.0)
    return xe, xo


@triton.jit
def dense_tile_kn(w_ptr, rows, nmask, k0, n_k, stride_wn, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """Dot B operand [BLOCK_K, BLOCK_N] of a 16/32-bit weight: W[rows, k0 + i]."""
    kk = k0 + tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + rows[None, :] * stride_wn + kk[:, None], mask=(kk[:, None] < n_k) & nmask[None, :],
                other=0.0)
    return w.to(dtype)


@triton.jit
def fp4_gemv_tile(q_ptr, s_ptr, rows, nmask, x_ptr, k0, n_k, stride_qn, stride_sn, GROUPS: tl.constexpr):
    """Partial products of one K slice for a GEMV: fp32 [BLOCK_N, GROUPS], entry (n, g) being
    sum over group g of W[rows[n], k] * x[k] (block scale applied); x_ptr: the activation row."""
    g = tl.arange(0, GROUPS)
    j = tl.arange(0, 8)
    kg = k0 // 16 + g
    gmask = kg < n_k // 16
    b = tl.load(q_ptr + rows[:, None, None] * stride_qn + (kg * 8)[None, :, None] + j[None, None, :],
                mask=nmask[:, None, None] & gmask[None, :, None], other=0)
    kk = (kg * 16)[:, None] + 2 * j[None, :]
    xm = gmask[:, None] & (j[None, :] < 8)
    xe = tl.load(x_ptr + kk, mask=xm, other=0.0).to(tl.float32)
    xo = tl.load(x_ptr + kk + 1, mask=xm, other=0.0).to(tl.float32)
    lo, hi = fp4_unpack(b)
    part = tl.sum(lo.to(tl.float32) * xe[None, :, :] + hi.to(tl.float32) * xo[None, :, :], axis=2)
    s = tl.load(s_ptr + rows[:, None] * stride_sn + kg[None, :], mask=nmask[:, None] & gmask[None, :], other=0)
    return part * (e4m3_to_f32(s) * 16384.0)


@triton.jit
def dense_gemv_tile(w_ptr, rows, nmask, x_ptr, k0, n_k, stride_wn, BLOCK_K: tl.constexpr):
    """Partial products [BLOCK_N, BLOCK_K] (fp32) of a 16/32-bit weight slice with the activation row."""
    kk = k0 + tl.arange(0, BLOCK_K)
    km = kk < n_k
    w = tl.load(w_ptr + rows[:, None] * stride_wn + kk[None, :], mask=nmask[:, None] & km[None, :], other=0.0)
    x = tl.load(x_ptr + kk, mask=km, other=0.0)
    return w.to(tl.float32) * x.to(tl.float32)[None, :]


# --- 4-way unit decode (the fast W4A16 path) ------------------------------------------------------------
#
# The packed weight is read as int16 "units" of 4 codes (unit u of a row holds elements 4u..4u+3, element
# 4u in bits 0..3). Two adjacent units form one 32-bit word of 8 codes n0..n7, and code n_t and n_{t+4} sit
# exactly 16 bits apart, so one shift+mask places both into the two halves of a bf16x2 / f16x2 register at
# once: the 3 magnitude bits go to the bottom of the exponent field (then the 16-bit pattern equals
# e2m1 * 2^-126 in bf16 or e2m1 * 2^-14 in fp16, subnormal codes included, because both formats keep a 0.m
# subnormal like e2m1) and the sign to bit 15. One packed multiply by the block scale (pre-multiplied by
# 2^118 resp. 2^6) then gives e2m1 * scale * 2^-8 exactly (e2m1 x e4m3 needs 6 significant bits and the
# result stays normal, or an exact fp16 subnormal); callers multiply the fp32 accumulator by
# global_scale * 2^8. About 2.5 integer/packed ops per weight element instead of ~8 for an unpack +
# convert + fp32 multiply, which is what kept the old kernels ALU-bound far below memory bandwidth.
#
# Output t of a [R, U] unit tile is W[r, 4u + t] for u < U: four [R, U] dot operands whose K index is a
# stride-4 slice of the real K; `x_split4` cuts the activation tile the same way. Inline PTX runs only on
# the GPU (sm_80+: fma.rn.bf16x2 needs Ampere); the interpreter and fp32 activations take the pure-Triton
# decode (DEC = 0), which computes the same values in fp32.
#
# On sm_89+ DEC 3 leaves most of the work to the hardware e4m3 -> f16x2 converter (`_decode_cvt_asm`): a
# byte permute and shift+mask turn each code into an e4m3 byte, one conversion decodes two: about 2 ops per
# weight including the scale multiply. The MMA then runs in fp16, so bf16 activations are staged as
# fp16 * 2^-F16_X_SHIFT (`w4_stage.stage_x`): finite up to ~1e6 (beyond, they saturate), 11 significant bits
# from 2^-10 up (bf16 has 8), an absolute resolution of 2^-20 below.
#
# DEC 4 is DEC 3 without the byte permute (`_decode_cvt_asm(permute=False)`), one instruction fewer per 8
# weights: a register pair of output t then holds codes 2 apart within one unit, so element u of output t is
# code 8 (u // 2) + pairs_col(4 (u % 2) + t) of the row instead of code 4u + t, `w4_stage.pairs_col` swapping
# bits 1 and 2 of the position within each group of 8 (an involution). Any K order of the dot works as long as the
# activations follow it: they are staged with that swap (`w4_stage.stage_x` PAIRS, and gate_up writes act
# the same way), and then quad and split mode read them exactly as for DEC 3.


def fp4_units(q: torch.Tensor) -> torch.Tensor:
    """Packed FP4 bytes [..., K/2] (uint8, contiguous along K) as the int16 units of 4 codes [..., K/4] that
    `w4_tile` loads; copied first when a row would start off a 2-byte boundary."""
    if q.storage_offset() % 2 or any(st % 2 for st in q.stride()[:-1]) or q.shape[-1] % 2:
        q = q.contiguous()
    return q.view(torch.int16)


def tile_for_dec(dec: int, block_k: int, stages: int) -> tuple[int, int]:
    """(BLOCK_K, stages) to launch a table's tile with: the tables are tuned for 16-bit tiles, which spill
    with fp32 activations (DEC 0 on the GPU), so those get at most 64 and 2."""
    if dec == 0 and not interpreting():
        return min(block_k, 64), 2
    return block_k, stages


F16_X_SHIFT = 4  # DEC 3 with bf16 activations: they are staged as fp16 * 2^-4 (finite up to ~1e6)


def decode_mode(dtype: torch.dtype, device: torch.device | None = None) -> int:
    """`fp4_decode4` variant (its DEC argument) for activations of `dtype`: plain fp32 for fp32 activations
    and under the interpreter (which runs no PTX and computes 16-bit types on raw bits anyway); inline-PTX
    bf16/fp16 on the GPU; with `device` given and an sm_89+ GPU, the e4m3-converter decode (DEC 3, fp16
    tiles: the caller stages bf16 activations as fp16, see F16_X_SHIFT)."""
    if interpreting() or dtype == torch.float32:
        return 0
    if device is not None and fp8_native(device):
        return 3
    return 1 if dtype == torch.bfloat16 else 2


def _decode_asm(mag_base: int, mag_mask: int, op: str) -> str:
    """PTX for 4 outputs ($0..$3, packed 16-bit pairs) from one word of 8 codes ($4) and the packed
    block scale pair ($5): output t = (code t, code t+4) with magnitude shifted to `mag_base` and the sign
    (code bit 3) to bit 15, times $5."""
    lines = ["{", ".reg .b32 m, s, z;", "mov.b32 z, 0x80008000;"]
    for t in range(4):
        ms, ss = mag_base - 4 * t, 12 - 4 * t
        mag = f"shl.b32 m, $4, {ms};" if ms >= 0 else f"shr.b32 m, $4, {-ms};"
        sign = f"shl.b32 s, $4, {ss};" if ss else "mov.b32 s, $4;"
        lines += [mag, f"and.b32 m, m, {mag_mask:#010x};", sign, "and.b32 s, s, 0x80008000;", "or.b32 m, m, s;",
                  f"fma.rn.{op} ${t}, m, $5, z;"]
    return "\n".join([*lines, "}"])


def _decode_cvt_asm(permute: bool = True) -> str:
    """PTX (sm_89+) for the same 4 outputs as `_decode_asm`, in fp16, through the e4m3 -> f16x2 converter:
    a byte permute gathers the codes of each output pair 8 bits apart ([b0, b2, b1, b3]: low nibbles hold
    codes 0 and 2, high nibbles codes 1 and 3), and every nibble becomes an e4m3 byte, magnitude in bits
    2..4 (the bottom of the exponent: e2m1 * 2^-6 exactly, subnormal codes included) and sign in bit 7, by
    one select each (lop3 "mask ? shifted codes : sign bits"; the sign bits sit where the mask takes the
    codes or where the byte must hold the sign); one `cvt.rn.f16x2.e4m3x2` then decodes each pair. $5: the
    fp16 block scale pair; the outputs are e2m1 * scale * 2^-6 (exact, as in `_decode_asm`).

    permute=False is DEC 4: no byte permute, so each e4m3 byte holds the code its source byte held and the
    four outputs pair codes of one unit instead of codes 16 bits apart: $0 = (code 0, code 2), $1 = (code 1,
    code 3) of the word's first unit, $2 / $3 the same for its second unit (output t, element 2v + i = code
    c(t, i) of the word, c = 4 * (t // 2) + 2 * i + t % 2); the activations are staged in the matching order
    (see above)."""
    src = "p" if permute else "$4"
    lines = ["{", f".reg .b32 {'p, ' if permute else ''}s, a, e, o, r, m;", ".reg .b16 l, h;"]
    if permute:
        lines.append("prmt.b32 p, $4, $4, 0x3120;")
    lines += ["mov.b32 m, 0x1C1C1C1C;", f"and.b32 s, {src}, 0x88888888;",
              f"shr.b32 a, {src}, 2;", "lop3.b32 o, a, s, m, 0xE4;",
              f"shl.b32 a, {src}, 2;", "shl.b32 s, s, 4;", "lop3.b32 e, a, s, m, 0xE4;"]
    for word, (t_lo, t_hi) in (("e", (0, 2)), ("o", (1, 3))):
        lines.append(f"mov.b32 {{l, h}}, {word};")
        for half, t in (("l", t_lo), ("h", t_hi)):
            lines += [f"cvt.rn.f16x2.e4m3x2 r, {half};", f"mul.rn.f16x2 ${t}, r, $5;"]
    return "\n".join([*lines, "}"])


DECODE_BF16 = tl.constexpr(_decode_asm(6, 0x01C001C0, "bf16x2")) if tl is not None else None
DECODE_F16 = tl.constexpr(_decode_asm(9, 0x0E000E00, "f16x2")) if tl is not None else None
DECODE_F16_CVT = tl.constexpr(_decode_cvt_asm()) if tl is not None else None
DECODE_F16_PAIRS = tl.constexpr(_decode_cvt_asm(permute=False)) if tl is not None else None


@triton.jit
def fp4_acc_scale(DEC: tl.constexpr, X_SHIFT: tl.constexpr):
    """What fp32 accumulators of `fp4_decode4` tiles are multiplied by (with the global scale): the
    decode's 2^8 (2^6 for DEC 3 and 4) times 2^X_SHIFT for activations staged * 2^-X_SHIFT."""
    if DEC >= 3:
        return 64.0 * (1 << X_SHIFT)
    else:
        return 256.0 * (1 << X_SHIFT)


@triton.jit
def _e4m3_times(u, FACTOR: tl.constexpr):
    """e4m3 bytes (uint8 tensor) -> fp32 value * FACTOR / 256 (exact; see `e4m3_to_f32`)."""
    w = u.to(tl.uint16)
    h = (((w & 0x7F) << 7) | ((w & 0x80) << 8)).to(tl.uint16)
    return h.to(tl.float16, bitcast=True).to(tl.float32) * FACTOR


@triton.jit
def _expand_scale(sc, q):
    """Block scales [..., U // 4] -> [..., U] (each repeated for the 4 units of its group of 16)."""
    if len(q.shape) == 3:
        S: tl.constexpr = q.shape[0]
        R: tl.constexpr = q.shape[1]
        U: tl.constexpr = q.shape[2]
        return tl.reshape(tl.broadcast_to(sc[:, :, :, None], [S, R, U // 4, 4]), [S, R, U])
    else:
        R: tl.constexpr = q.shape[0]
        U: tl.constexpr = q.shape[1]
        return tl.reshape(tl.broadcast_to(sc[:, :, None], [R, U // 4, 4]), [R, U])


@triton.jit
def fp4_decode4(q, s, DEC: tl.constexpr):
    """Decode a unit tile. q: int16 [..., R, U] (U a multiple of 4; 2-D or 3-D); s: uint8 e4m3 block
    scales [..., R, U // 4]. Returns (w0, w1, w2, w3), each shaped like q, w_t[.., r, u] =
    e2m1(code 4u + t) * scale[.., r, u // 4] * 2^-8, in bf16 (DEC 1, inline PTX), fp16 (DEC 2, inline PTX)
    or fp32 (DEC 0, plain Triton); DEC 3: fp16 through the e4m3 converter (sm_89+), times 2^-6; DEC 4: as
    DEC 3 without its byte permute, code 4u + t replaced by the code of DEC 4's K order (see above)."""
    if DEC == 1:
        sc = _expand_scale(_e4m3_times(s, 2.0 ** (118 + 8)).to(tl.bfloat16), q)
        w0, w1, w2, w3 = tl.inline_asm_elementwise(DECODE_BF16, "=r,=r,=r,=r,r,r", [q, sc],
                                                   dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
                                                   is_pure=True, pack=2)
    elif DEC == 2:
        sc = _expand_scale(_e4m3_times(s, 2.0 ** (6 + 8)).to(tl.float16), q)
        w0, w1, w2, w3 = tl.inline_asm_elementwise(DECODE_F16, "=r,=r,=r,=r,r,r", [q, sc],
                                                   dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                   is_pure=True, pack=2)
    elif DEC >= 3:
        sc = _expand_scale(s.to(tl.float8e4nv, bitcast=True).to(tl.float16), q)
        w0, w1, w2, w3 = tl.inline_asm_elementwise(DECODE_F16_CVT if DEC == 3 else DECODE_F16_PAIRS,
                                                   "=r,=r,=r,=r,r,r", [q, sc],
                                                   dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                   is_pure=True, pack=2)
    else:
        # fp16 pattern (e2m1 * 2^-14) -> fp32, times scale * 2^6: the same e2m1 * scale * 2^-8
        sc = _expand_scale(_e4m3_times(s, 2.0 ** (6 + 8)), q)
        b = q.to(tl.uint16, bitcast=True)
        w0 = _nibble_f32(b, 0) * sc
        w1 = _nibble_f32(b, 4) * sc
        w2 = _nibble_f32(b, 8) * sc
        w3 = _nibble_f32(b, 12) * sc
    return w0, w1, w2, w3


@triton.jit
def _nibble_f32(b, SHIFT: tl.constexpr):
    n = (b >> SHIFT) & 0xF
    h = (((n & 0x7) << 9) | ((n & 0x8) << 12)).to(tl.uint16)
    return h.to(tl.float16, bitcast=True).to(tl.float32)
