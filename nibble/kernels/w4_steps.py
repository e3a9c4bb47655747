"""K steps of the weight-stationary ("swap AB") NVFP4 tensor-core kernels of moe_w4.py and nvfp4_linear.py: a
unit tile of weight rows, decoded by `fp4_tiles.fp4_decode4`, is the MMA's M side, the activations the narrow N
side in one of the layouts (XMODE) moe_w4.py describes; the tile loaders and the epilogue's column pick."""

from __future__ import annotations

from nibble.kernels._triton import tl, triton
from nibble.kernels.fp4_tiles import fp4_decode4


@triton.jit
def x_split4(x):
    """Activation tile [..., M, K] (2-D or 3-D) -> (x0, x1, x2, x3), each [..., M, K // 4],
    x_t[.., m, u] = x[.., m, 4u + t] (the K order of `fp4_decode4`'s outputs)."""
    if len(x.shape) == 3:
        S: tl.constexpr = x.shape[0]
        M: tl.constexpr = x.shape[1]
        K: tl.constexpr = x.shape[2]
        a, b = tl.split(tl.reshape(x, [S, M, K // 4, 2, 2]))
    else:
        M: tl.constexpr = x.shape[0]
        K: tl.constexpr = x.shape[1]
        a, b = tl.split(tl.reshape(x, [M, K // 4, 2, 2]))
    x0, x2 = tl.split(a)
    x1, x3 = tl.split(b)
    return x0, x1, x2, x3


@triton.jit
def w4_b_quad(row_ptr, valid, k0, n_k, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Quad-mode activation tile [BLOCK_K/4, N]: B[u, col] = A[row(col), k0 + 4u + col % 4]; row_ptr,
    valid: [N] per column (token slot col // 4)."""
    N: tl.constexpr = row_ptr.shape[0]
    u = tl.arange(0, BLOCK_K // 4)
    k = k0 + 4 * u[:, None] + (tl.arange(0, N) % 4)[None, :]
    m = valid[None, :]
    if not EVEN_K:
        m = m & (k < n_k)
    return tl.load(row_ptr[None, :] + k, mask=m, other=0.0)


@triton.jit
def w4_tile(q_rows, s_rows, k0, n_k, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Packed unit tile [R, BLOCK_K/4] (int16) and its scales [R, BLOCK_K/16] (uint8) at K offset k0;
    q_rows / s_rows: [R] row pointers (units / scale bytes)."""
    u = tl.arange(0, BLOCK_K // 4)
    if EVEN_K:
        q = tl.load(q_rows[:, None] + (k0 // 4 + u)[None, :])
    else:
        q = tl.load(q_rows[:, None] + (k0 // 4 + u)[None, :], mask=(k0 // 4 + u < n_k // 4)[None, :], other=0)
    return q, w4_scale_tile(s_rows, k0, n_k, BLOCK_K, EVEN_K)


@triton.jit
def w4_scale_tile(s_rows, k0, n_k, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The block scales [R, BLOCK_K/16] (uint8) of `w4_tile`'s tile."""
    g = tl.arange(0, BLOCK_K // 16)
    if EVEN_K:
        return tl.load(s_rows[:, None] + (k0 // 16 + g)[None, :])
    else:
        return tl.load(s_rows[:, None] + (k0 // 16 + g)[None, :], mask=(k0 // 16 + g < n_k // 16)[None, :], other=0)


@triton.jit
def w4_dot(w, b, acc, DEC: tl.constexpr):
    """acc += w @ b (b [K, N]); fp32 activations (DEC 0: tests, fp32 models) in exact fp32."""
    if DEC == 0:
        return tl.dot(w, b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(w, b, acc)


@triton.jit
def w4_k_step(q, s, b_ptr, valid, k0, n_k, acc0, acc1, acc2, acc3, n_rows_perm, XMODE: tl.constexpr,
              DEC: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """One K step: decode the weight tile and accumulate it against the activations. b_ptr: [N] activation
    row pointers per MMA column (quad) or per token (perm, split). Quad mode uses the four accumulators
    (one per slice), the others only acc0. n_rows_perm: K / 4 (perm mode: distance between slices)."""
    w0, w1, w2, w3 = fp4_decode4(q, s, DEC)
    if XMODE == 0:
        b = w4_b_quad(b_ptr, valid, k0, n_k, BLOCK_K, EVEN_K)
        acc0 = w4_dot(w0, b, acc0, DEC)
        acc1 = w4_dot(w1, b, acc1, DEC)
        acc2 = w4_dot(w2, b, acc2, DEC)
        acc3 = w4_dot(w3, b, acc3, DEC)
    elif XMODE == 1:
        u = tl.arange(0, BLOCK_K // 4)
        p = b_ptr[None, :] + (k0 // 4 + u)[:, None]
        m = valid[None, :]
        if not EVEN_K:
            m = m & (k0 // 4 + u < n_k // 4)[:, None]
        acc0 = w4_dot(w0, tl.load(p, mask=m, other=0.0), acc0, DEC)
        acc0 = w4_dot(w1, tl.load(p + n_rows_perm, mask=m, other=0.0), acc0, DEC)
        acc0 = w4_dot(w2, tl.load(p + 2 * n_rows_perm, mask=m, other=0.0), acc0, DEC)
        acc0 = w4_dot(w3, tl.load(p + 3 * n_rows_perm, mask=m, other=0.0), acc0, DEC)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        m = valid[:, None]
        if not EVEN_K:
            m = m & (kk < n_k)[None, :]
        a0, a1, a2, a3 = x_split4(tl.load(b_ptr[:, None] + kk[None, :], mask=m, other=0.0))
        acc0 = w4_dot(w0, tl.trans(a0), acc0, DEC)
        acc0 = w4_dot(w1, tl.trans(a1), acc0, DEC)
        acc0 = w4_dot(w2, tl.trans(a2), acc0, DEC)
        acc0 = w4_dot(w3, tl.trans(a3), acc0, DEC)
    return acc0, acc1, acc2, acc3


@triton.jit
def w4_finish(acc0, acc1, acc2, acc3, XMODE: tl.constexpr):
    """[M, N] accumulators -> [M, token slots]: quad mode picks column 4j + t of accumulator t."""
    if XMODE == 0:
        M: tl.constexpr = acc0.shape[0]
        N: tl.constexpr = acc0.shape[1]
        c = (tl.arange(0, N) % 4)[None, :]
        acc = tl.where(c == 0, acc0, 0.0) + tl.where(c == 1, acc1, 0.0)
        acc += tl.where(c == 2, acc2, 0.0) + tl.where(c == 3, acc3, 0.0)
        return tl.sum(tl.reshape(acc, [M, N // 4, 4]), axis=2)
    else:
        return acc0
