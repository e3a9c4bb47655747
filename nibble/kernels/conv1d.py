"""Depthwise causal conv1d with SiLU for Gated DeltaNet, continuing each sequence from its conv state; and its
speculative-verify form, which leaves the state after every token in a slot of its own."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nibble.kernels._triton import tl, triton


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                      cu_seqlens: torch.Tensor, state_slots: torch.Tensor) -> torch.Tensor:
    """x: [T, C]; weight: [C, W]; conv_state: [num_slots, W-1, C] (previous inputs, oldest first);
    cu_seqlens: int32 [B+1]; state_slots: int32 [B].

    out[t] = silu(sum_j window[t + j] * weight[:, j]) over the window [state, x]; the state of each
    sequence is replaced by its last W-1 inputs. Returns [T, C] in x's dtype.
    """
    width = weight.shape[1]
    out = torch.empty_like(x)
    cu = cu_seqlens.tolist()
    for i, slot in enumerate(state_slots.tolist()):
        start, end = cu[i], cu[i + 1]
        if end == start:
            continue
        window = torch.cat((conv_state[slot].to(x.dtype), x[start:end]), dim=0)
        y = F.conv1d(window.t().unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])
        out[start:end] = F.silu(y[0].t()).to(x.dtype)
        conv_state[slot] = window[-(width - 1):].to(conv_state.dtype)
    return out


@triton.jit
def _conv1d_decode_kernel(x_ptr, w_ptr, state_ptr, slots_ptr, out_ptr, n_ch, stride_x, stride_s0, stride_s1,
                          stride_o, WIDTH: tl.constexpr, BLOCK_C: tl.constexpr):
    seq = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = ch < n_ch
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    s_base = state_ptr + slot * stride_s0 + ch
    xv = tl.load(x_ptr + seq.to(tl.int64) * stride_x + ch, mask=cmask, other=0.0)
    acc = xv.to(tl.float32) * tl.load(w_ptr + ch * WIDTH + (WIDTH - 1), mask=cmask, other=0.0).to(tl.float32)
    for j in tl.static_range(WIDTH - 1):
        s = tl.load(s_base + j * stride_s1, mask=cmask, other=0.0).to(tl.float32)
        acc += s * tl.load(w_ptr + ch * WIDTH + j, mask=cmask, other=0.0).to(tl.float32)
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + seq.to(tl.int64) * stride_o + ch, out.to(out_ptr.dtype.element_ty), mask=cmask)
    # shift the window by one: row j takes row j+1 (read before that row is overwritten), the last row x
    for j in tl.static_range(WIDTH - 1):
        if j < WIDTH - 2:
            nxt = tl.load(s_base + (j + 1) * stride_s1, mask=cmask, other=0.0)
        else:
            nxt = xv.to(state_ptr.dtype.element_ty)
        tl.store(s_base + j * stride_s1, nxt, mask=cmask)


@triton.jit(do_not_specialize=["n_tok", "n_seq", "search_steps"])
def _conv1d_varlen_kernel(x_ptr, w_ptr, state_ptr, cu_ptr, slots_ptr, out_ptr, n_tok, n_seq, search_steps, n_ch,
                          stride_x, stride_s0, stride_s1, stride_o, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_C: tl.constexpr):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tmask = tok < n_tok
    cmask = ch < n_ch
    # sequence of each token: binary search keeping cu[lo] <= tok < cu[hi]. The step count is a runtime
    # argument (not a constexpr) so that batches of new sizes reuse the compiled kernel.
    lo = tl.zeros([BLOCK_T], dtype=tl.int32)
    hi = tl.zeros([BLOCK_T], dtype=tl.int32) + n_seq
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        right = tl.load(cu_ptr + mid) <= tok
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    start = tl.load(cu_ptr + lo)
    slot = tl.load(slots_ptr + lo).to(tl.int64)
    rel = tok - start
    m2 = tmask[:, None] & cmask[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        p = rel - (WIDTH - 1) + j
        in_x = p >= 0
        src = (tok - (WIDTH - 1) + j).to(tl.int64)
        xv = tl.load(x_ptr + src[:, None] * stride_x + ch[None, :], mask=m2 & in_x[:, None], other=0.0)
        row = tl.where(in_x, 0, p + (WIDTH - 1))
        sv = tl.load(state_ptr + slot[:, None] * stride_s0 + row[:, None] * stride_s1 + ch[None, :],
                     mask=m2 & (~in_x)[:, None], other=0.0)
        w = tl.load(w_ptr + ch * WIDTH + j, mask=cmask, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + tok.to(tl.int64)[:, None] * stride_o + ch[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m2)


@triton.jit
def _conv1d_state_kernel(x_ptr, state_ptr, cu_ptr, slots_ptr, n_ch, stride_x, stride_s0, stride_s1,
                         WIDTH: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    seq = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    r = tl.arange(0, ROWS)
    start = tl.load(cu_ptr + seq)
    n = tl.load(cu_ptr + seq + 1) - start
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    m2 = (r[:, None] < WIDTH - 1) & (ch[None, :] < n_ch)
    # new row r is window row n + r of [old state (W-1 rows); x (n rows)]
    q = n + r
    in_x = q >= WIDTH - 1
    src = (start + q - (WIDTH - 1)).to(tl.int64)
    xv = tl.load(x_ptr + src[:, None] * stride_x + ch[None, :], mask=m2 & in_x[:, None], other=0.0)
    s_ptrs = state_ptr + slot * stride_s0 + ch[None, :]
    sv = tl.load(s_ptrs + tl.where(in_x, 0, q)[:, None] * stride_s1, mask=m2 & (~in_x)[:, None], other=0.0)
    new = tl.where(in_x[:, None], xv.to(state_ptr.dtype.element_ty), sv)
    # other threads may still read the old rows this program overwrites
    tl.debug_barrier()
    tl.store(s_ptrs + r[:, None] * stride_s1, new, mask=m2 & (n > 0))


def _check_conv(op: str, x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{op}: x must be [T, C] with contiguous channels, got {tuple(x.shape)}")
    c = x.shape[1]
    if weight.dim() != 2 or weight.shape[0] != c or not weight.is_contiguous():
        raise ValueError(f"{op}: weight must be contiguous [C={c}, W], got {tuple(weight.shape)}")
    w = weight.shape[1]
    if w < 2 or conv_state.dim() != 3 or conv_state.shape[1:] != (w - 1, c) or conv_state.stride(2) != 1:
        raise ValueError(f"{op}: conv_state {tuple(conv_state.shape)} must be [slots, {w - 1}, {c}]")


def _check(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
           state_slots: torch.Tensor) -> None:
    _check_conv("causal_conv1d", x, weight, conv_state)
    b = state_slots.shape[0]
    if cu_seqlens.shape != (b + 1,) or cu_seqlens.dtype != torch.int32 or state_slots.dtype != torch.int32:
        raise ValueError("causal_conv1d: cu_seqlens int32 [B+1] and state_slots int32 [B] expected")
    if not (x.device == weight.device == conv_state.device == cu_seqlens.device == state_slots.device):
        raise ValueError("causal_conv1d: tensors on different devices")


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
                  state_slots: torch.Tensor) -> torch.Tensor:
    """Triton `causal_conv1d_ref`; conv_state is updated in place.

    Decode (T == B, every sequence one token): one kernel per (sequence, channel block) computes the
    output and shifts the state. Otherwise a varlen kernel over (token block, channel block) finds each
    token's sequence by binary search in cu_seqlens, then a second kernel writes the new states (after
    every read of the old ones).
    """
    _check(x, weight, conv_state, cu_seqlens, state_slots)
    t, c = x.shape
    width = weight.shape[1]
    b = state_slots.shape[0]
    out = torch.empty((t, c), dtype=x.dtype, device=x.device)
    if t == 0 or b == 0:
        return out
    block_c = 256
    if t == b:
        _conv1d_decode_kernel[(b, triton.cdiv(c, block_c))](
            x, weight, conv_state, state_slots, out, c, x.stride(0), conv_state.stride(0),
            conv_state.stride(1), out.stride(0), WIDTH=width, BLOCK_C=block_c, num_warps=4)
        return out
    block_t = 16
    steps = max(1, (b - 1).bit_length())
    _conv1d_varlen_kernel[(triton.cdiv(t, block_t), triton.cdiv(c, block_c))](
        x, weight, conv_state, cu_seqlens, state_slots, out, t, b, steps, c, x.stride(0), conv_state.stride(0),
        conv_state.stride(1), out.stride(0), WIDTH=width, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=4)
    rows = 1 << max(0, (width - 2).bit_length())
    _conv1d_state_kernel[(b, triton.cdiv(c, block_c))](
        x, conv_state, cu_seqlens, state_slots, c, x.stride(0), conv_state.stride(0), conv_state.stride(1),
        WIDTH=width, ROWS=rows, BLOCK_C=block_c, num_warps=4)
    return out


def check_spec_slots(op: str, tokens: int, state_slots: torch.Tensor, spec_slots: torch.Tensor) -> int:
    """The number of tokens per sequence n of a speculative-verify batch of `tokens` tokens: state_slots must be
    int32 [B], spec_slots int32 [B, n] with n >= 1 and tokens == B * n."""
    if state_slots.dim() != 1 or state_slots.dtype != torch.int32:
        raise ValueError(f"{op}: state_slots must be int32 [B], got {state_slots.dtype} {tuple(state_slots.shape)}")
    b = state_slots.shape[0]
    if spec_slots.dim() != 2 or spec_slots.shape[0] != b or spec_slots.shape[1] < 1 or spec_slots.dtype != torch.int32:
        raise ValueError(f"{op}: spec_slots must be int32 [B={b}, n >= 1], got {spec_slots.dtype} "
                         f"{tuple(spec_slots.shape)}")
    n = spec_slots.shape[1]
    if tokens != b * n:
        raise ValueError(f"{op}: {tokens} tokens, expected B * n = {b} * {n} = {b * n} (sequence-major)")
    if spec_slots.device != state_slots.device:
        raise ValueError(f"{op}: state_slots on {state_slots.device}, spec_slots on {spec_slots.device}")
    return n


def causal_conv1d_spec_ref(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                           state_slots: torch.Tensor, spec_slots: torch.Tensor) -> torch.Tensor:
    """The conv of a speculative-verify step: every sequence has n tokens. x: [B*n, C] (sequence i owns rows
    i*n .. i*n+n-1; any row stride); weight: [C, W]; conv_state: [num_slots, W-1, C]; state_slots: int32 [B];
    spec_slots: int32 [B, n].

    Sequence i starts from conv_state[state_slots[i]] and, after its j-th token, leaves its last W-1 inputs
    in conv_state[spec_slots[i, j]]: `causal_conv1d_ref` one token at a time, n times. conv_state[state_slots[i]]
    is written only where spec_slots lists it. Returns [B*n, C] in x's dtype.
    """
    num, n = spec_slots.shape
    # the running windows, one per sequence, apart from the pool: their own slots are not to be written
    work = conv_state.index_select(0, state_slots.long())
    rows = torch.arange(num, dtype=torch.int32, device=x.device)
    cu = torch.arange(num + 1, dtype=torch.int32, device=x.device)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for j in range(n):
        out[j::n] = causal_conv1d_ref(x[j::n], weight, work, cu, rows)
        conv_state[spec_slots[:, j].long()] = work
    return out


@triton.jit
def _conv1d_spec_kernel(x_ptr, w_ptr, state_ptr, slots_ptr, spec_ptr, out_ptr, n_ch, stride_x, stride_s0, stride_s1,
                        stride_o, WIDTH: tl.constexpr, N: tl.constexpr, BLOCK_C: tl.constexpr):
    seq = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = ch < n_ch
    start = seq.to(tl.int64) * N
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    # the window (the last W-1 inputs, oldest first, in the state's dtype as a decode step would read them
    # back) and the taps stay in registers as tuples of channel vectors. Every thread stores only the
    # channels it loaded, so a snapshot may overwrite the starting slot. (Tuples are concatenated: Triton's
    # compiler has no starred unpacking.)
    win = ()
    for r in tl.static_range(WIDTH - 1):
        row = tl.load(state_ptr + slot * stride_s0 + r * stride_s1 + ch, mask=cmask, other=0.0)
        win = win + (row,)  # noqa: RUF005
    taps = ()
    for m in tl.static_range(WIDTH):
        tap = tl.load(w_ptr + ch * WIDTH + m, mask=cmask, other=0.0).to(tl.float32)
        taps = taps + (tap,)  # noqa: RUF005
    for j in tl.static_range(N):
        xv = tl.load(x_ptr + (start + j) * stride_x + ch, mask=cmask, other=0.0)
        acc = xv.to(tl.float32) * taps[WIDTH - 1]
        for m in tl.static_range(WIDTH - 1):
            acc += win[m].to(tl.float32) * taps[m]
        out = acc * tl.sigmoid(acc)
        tl.store(out_ptr + (start + j) * stride_o + ch, out.to(out_ptr.dtype.element_ty), mask=cmask)
        win = win[1:] + (xv.to(state_ptr.dtype.element_ty),)  # noqa: RUF005
        snap = tl.load(spec_ptr + start + j).to(tl.int64)
        for r in tl.static_range(WIDTH - 1):
            tl.store(state_ptr + snap * stride_s0 + r * stride_s1 + ch, win[r], mask=cmask)


def causal_conv1d_spec(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor,
                       spec_slots: torch.Tensor) -> torch.Tensor:
    """Triton `causal_conv1d_spec_ref` in one launch: one program per (sequence, channel block) loads the
    sequence's state rows once, then per token (unrolled: n is a compile-time constant, one kernel per draft
    length) writes the output and the state snapshot."""
    op = "causal_conv1d_spec"
    _check_conv(op, x, weight, conv_state)
    n = check_spec_slots(op, x.shape[0], state_slots, spec_slots)
    if not (x.device == weight.device == conv_state.device == state_slots.device):
        raise ValueError(f"{op}: tensors on different devices")
    t, c = x.shape
    width = weight.shape[1]
    b = state_slots.shape[0]
    out = torch.empty((t, c), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    block_c = 256
    _conv1d_spec_kernel[(b, triton.cdiv(c, block_c))](
        x, weight, conv_state, state_slots, spec_slots.contiguous(), out, c, x.stride(0), conv_state.stride(0),
        conv_state.stride(1), out.stride(0), WIDTH=width, N=n, BLOCK_C=block_c, num_warps=4)
    return out
