"""Gated delta rule (the recurrence of Gated DeltaNet) over a varlen batch, with states kept in a slot
pool and updated in place; its decode step with the layer's gating (gdn_gating.py) fused in; and the
speculative-verify step, which leaves the state after each token in a slot of its own."""

from __future__ import annotations

import itertools

import torch

from nibble.kernels._triton import next_pow2, tl, triton
from nibble.kernels.conv1d import check_spec_slots
from nibble.kernels.gdn_gating import _softplus, gdn_gating_ref
from nibble.kernels.host_copy import to_device_async


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, ssm_state: torch.Tensor, cu_seqlens: torch.Tensor,
                         state_slots: torch.Tensor, cu_seqlens_cpu: list[int] | None = None) -> torch.Tensor:
    """q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g: fp32 [T, Hv] (log decay, <= 0); beta: [T, Hv];
    ssm_state: fp32 [num_slots, Hv, Dk, Dv]; cu_seqlens: int32 [B+1]; state_slots: int32 [B];
    cu_seqlens_cpu: the same offsets as a host list, if the caller has them (every backend takes it; the
    fla one needs it to plan its chunks without a device sync).

    q and k are L2-normalised and q scaled by Dk^-0.5; each k head serves Hv/Hk consecutive v heads.
    Per token: S = S*exp(g); S += k (beta (v - S^T k))^T; o = S^T q. Returns o [T, Hv, Dv] in v's dtype.
    A sequence without tokens leaves its slot unread and unwritten; rows past cu_seqlens[B] (the padding of
    a captured mixed step) belong to no sequence, and their outputs are unspecified.
    """
    num_v_heads = v.shape[1]
    rep = num_v_heads // k.shape[1]
    qf = l2norm(q.float()).repeat_interleave(rep, dim=1) * (q.shape[-1] ** -0.5)
    kf = l2norm(k.float()).repeat_interleave(rep, dim=1)
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    cu = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.tolist()
    for i, slot in enumerate(state_slots.tolist()):
        if cu[i] == cu[i + 1]:
            continue
        state = ssm_state[slot].float()
        for t in range(cu[i], cu[i + 1]):
            state = state * gf[t].exp()[:, None, None]
            kv_mem = torch.einsum("hkv,hk->hv", state, kf[t])
            delta = (vf[t] - kv_mem) * bf[t][:, None]
            state = state + kf[t][:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", state, qf[t])
        ssm_state[slot] = state.to(ssm_state.dtype)
    return out.to(v.dtype)


@triton.jit
def _gdn_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, neg_a_ptr, dt_bias_ptr, state_ptr, cu_ptr,
                          slots_ptr, spec_ptr, n_spec, out_ptr, dk, dv, rep, scale, stride_qt, stride_qh, stride_kt,
                          stride_kh, stride_vt, stride_vh, stride_gt, stride_bt, stride_s0, stride_s1, stride_s2,
                          stride_ot, stride_oh, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, GATING: tl.constexpr,
                          ONE_TOKEN: tl.constexpr, SPEC: tl.constexpr):
    # GATING: g_ptr / beta_ptr hold the projection's raw a / b columns, turned into g and beta here exactly as
    # _gdn_gating_kernel does (beta rounded to b's dtype as it would be stored); ONE_TOKEN: sequence i is
    # token i (decode), cu_ptr is not read; SPEC: sequence i is tokens i*n_spec .. i*n_spec+n_spec-1 (verify),
    # cu_ptr is not read, the state after token t goes to slot spec_ptr[t] and the start slot is not written.
    # spec_ptr / n_spec are read only under SPEC.
    seq = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // rep
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask = offs_k < dk
    vmask = offs_v < dv
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    tile = hv * stride_s1 + offs_k[:, None] * stride_s2 + offs_v[None, :]
    s_ptrs = state_ptr + slot * stride_s0 + tile
    smask = kmask[:, None] & vmask[None, :]
    if ONE_TOKEN:
        start = seq.to(tl.int64)
        end = start + 1
    elif SPEC:
        start = seq.to(tl.int64) * n_spec
        end = start + n_spec
    else:
        start = tl.load(cu_ptr + seq).to(tl.int64)
        end = tl.load(cu_ptr + seq + 1).to(tl.int64)
        # a sequence without tokens (the padding of a captured mixed step) leaves its slot alone. A mask, not
        # an early return: that would move the loop into a branch and change its code (and its rounding
        # against the decode path, which must stay bitwise equal).
        smask = smask & (end > start)
    # the state tile stays in registers across the sequence's tokens and is written back once. A snapshot
    # store into the start slot is safe: each stored column depends, through kv, on every element of that
    # column loaded here.
    state = tl.load(s_ptrs, mask=smask, other=0.0).to(tl.float32)
    for t64 in range(start, end):
        q = tl.load(q_ptr + t64 * stride_qt + hk * stride_qh + offs_k, mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t64 * stride_kt + hk * stride_kh + offs_k, mask=kmask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t64 * stride_vt + hv * stride_vh + offs_v, mask=vmask, other=0.0).to(tl.float32)
        if GATING:
            a = tl.load(g_ptr + t64 * stride_gt + hv).to(tl.float32)
            g = tl.load(neg_a_ptr + hv) * _softplus(a + tl.load(dt_bias_ptr + hv))
            b = tl.load(beta_ptr + t64 * stride_bt + hv)
            beta = tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)
        else:
            g = tl.load(g_ptr + t64 * stride_gt + hv).to(tl.float32)
            beta = tl.load(beta_ptr + t64 * stride_bt + hv).to(tl.float32)
        q = q * (tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale)
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        state = state * tl.exp(g)
        kv = tl.sum(state * k[:, None], axis=0)
        delta = (v - kv) * beta
        state = state + k[:, None] * delta[None, :]
        o = tl.sum(state * q[:, None], axis=0)
        tl.store(out_ptr + t64 * stride_ot + hv * stride_oh + offs_v, o.to(out_ptr.dtype.element_ty), mask=vmask)
        if SPEC:
            snap = tl.load(spec_ptr + t64).to(tl.int64)
            tl.store(state_ptr + snap * stride_s0 + tile, state.to(state_ptr.dtype.element_ty), mask=smask)
    if not SPEC:
        tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=smask)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           ssm_state: torch.Tensor, cu_seqlens: torch.Tensor | None, state_slots: torch.Tensor) -> None:
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"gated_delta_rule: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if hv % hk:
        raise ValueError(f"gated_delta_rule: {hv} value heads not a multiple of {hk} key heads")
    if g.shape != (t, hv) or beta.shape != (t, hv):
        raise ValueError(f"gated_delta_rule: g {tuple(g.shape)} / beta {tuple(beta.shape)} != [{t}, {hv}]")
    if ssm_state.dim() != 4 or ssm_state.shape[1:] != (hv, dk, dv) or ssm_state.stride(3) != 1:
        raise ValueError(f"gated_delta_rule: ssm_state {tuple(ssm_state.shape)} != [slots, {hv}, {dk}, {dv}]")
    if min(q.stride(2), k.stride(2), v.stride(2)) != 1 or g.stride(1) != 1 or beta.stride(1) != 1:
        raise ValueError("gated_delta_rule: the last dim of q, k, v, g, beta must be contiguous")
    b = state_slots.shape[0]
    if state_slots.dtype != torch.int32 or (cu_seqlens is not None and (cu_seqlens.shape != (b + 1,)
                                                                        or cu_seqlens.dtype != torch.int32)):
        raise ValueError("gated_delta_rule: cu_seqlens int32 [B+1] and state_slots int32 [B] expected")
    devs = {x.device for x in (q, k, v, g, beta, ssm_state, state_slots)}
    if len(devs) != 1 or (cu_seqlens is not None and cu_seqlens.device not in devs):
        raise ValueError("gated_delta_rule: tensors on different devices")


def gated_delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, ssm_state: torch.Tensor, cu_seqlens: torch.Tensor,
                               state_slots: torch.Tensor, cu_seqlens_cpu: list[int] | None = None) -> torch.Tensor:
    """Triton `gated_delta_rule_ref`, token by token: one program per (sequence, v head, Dv block) keeps
    its [Dk, BLOCK_V] state tile in registers and reads/writes `ssm_state[state_slots[i]]` in place
    (no gather or scatter copies). L2 norm, scaling and GVA are fused. The decode path; also correct
    (but serial in time) for prefill."""
    _check(q, k, v, g, beta, ssm_state, cu_seqlens, state_slots)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if q.shape[0] == 0 or state_slots.shape[0] == 0:
        return out
    _launch_recurrent(q, k, v, g, beta, g, g, ssm_state, cu_seqlens, state_slots, out, gating=False,
                      one_token=False)
    return out


def _launch_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      neg_a: torch.Tensor, dt_bias: torch.Tensor, ssm_state: torch.Tensor, cu_seqlens: torch.Tensor,
                      state_slots: torch.Tensor, out: torch.Tensor, gating: bool, one_token: bool,
                      spec_slots: torch.Tensor | None = None) -> None:
    """spec_slots: contiguous int32 [B, n] for the verify step (SPEC), else None."""
    hk, dk = q.shape[1:]
    hv, dv = v.shape[1:]
    block_k = next_pow2(dk)
    block_v = max(1, min(next_pow2(dv), 4096 // block_k, 32))
    spec = spec_slots is not None
    # outside SPEC the kernel reads neither: state_slots stands in for the pointer
    spec_ptr, n_spec = (spec_slots, spec_slots.shape[1]) if spec else (state_slots, 1)
    _gdn_recurrent_kernel[(state_slots.shape[0], hv, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, neg_a, dt_bias, ssm_state, cu_seqlens, state_slots, spec_ptr, n_spec, out, dk, dv,
        hv // hk, dk ** -0.5, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), out.stride(0),
        out.stride(1), BLOCK_K=block_k, BLOCK_V=block_v, GATING=gating, ONE_TOKEN=one_token, SPEC=spec,
        num_warps=4)


def gated_delta_rule_decode_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                                b: torch.Tensor, neg_A: torch.Tensor, dt_bias: torch.Tensor, ssm_state: torch.Tensor,
                                state_slots: torch.Tensor) -> torch.Tensor:
    """One decode step of Gated DeltaNet, every sequence one token (token i belongs to sequence i):
    `gdn_gating_ref(a, b, neg_A, dt_bias)` then `gated_delta_rule_ref`. q, k: [B, Hk, Dk]; v: [B, Hv, Dv];
    a, b: [B, Hv] (any row stride); neg_A, dt_bias: fp32 [Hv]; ssm_state: fp32 [num_slots, Hv, Dk, Dv],
    updated in place; state_slots: int32 [B]. Returns o [B, Hv, Dv] in v's dtype."""
    g, beta = gdn_gating_ref(a, b, neg_A, dt_bias)
    num = state_slots.shape[0]
    cu = torch.arange(num + 1, dtype=torch.int32, device=q.device)
    return gated_delta_rule_ref(q, k, v, g, beta, ssm_state, cu, state_slots, cu_seqlens_cpu=list(range(num + 1)))


def _check_gating(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  neg_A: torch.Tensor, dt_bias: torch.Tensor, ssm_state: torch.Tensor,
                  state_slots: torch.Tensor) -> None:
    """`_check` for the ops with the gating fused in (a and b in place of g and beta)."""
    if neg_A.shape != (a.shape[-1],) or dt_bias.shape != neg_A.shape or neg_A.dtype != torch.float32 \
            or dt_bias.dtype != torch.float32:
        raise ValueError(f"{op}: neg_A {tuple(neg_A.shape)} {neg_A.dtype} / dt_bias "
                         f"{tuple(dt_bias.shape)} {dt_bias.dtype} must be fp32 [{a.shape[-1]}]")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError(f"{op}: the last dim of a and b must be contiguous")
    _check(q, k, v, a, b, ssm_state, None, state_slots)
    if neg_A.device != q.device or dt_bias.device != q.device:
        raise ValueError(f"{op}: tensors on different devices")


def gated_delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                            neg_A: torch.Tensor, dt_bias: torch.Tensor, ssm_state: torch.Tensor,
                            state_slots: torch.Tensor) -> torch.Tensor:
    """Triton `gated_delta_rule_decode_ref`: the recurrent kernel with the gating computed per (token, head)
    in place of the separate gdn_gating launch (one launch fewer per GDN layer and decode step)."""
    num = state_slots.shape[0]
    if q.shape[0] != num or a.shape != (num, v.shape[1]) or b.shape != a.shape:
        raise ValueError(f"gated_delta_rule_decode: one token per sequence expected: q {tuple(q.shape)}, "
                         f"a {tuple(a.shape)}, b {tuple(b.shape)}, {num} state slots")
    _check_gating("gated_delta_rule_decode", q, k, v, a, b, neg_A, dt_bias, ssm_state, state_slots)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if num:
        # ONE_TOKEN never reads the offsets: state_slots stands in for the pointer
        _launch_recurrent(q, k, v, a, b, neg_A.contiguous(), dt_bias.contiguous(), ssm_state, state_slots,
                          state_slots, out, gating=True, one_token=True)
    return out


def gated_delta_rule_spec_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                              neg_A: torch.Tensor, dt_bias: torch.Tensor, ssm_state: torch.Tensor,
                              state_slots: torch.Tensor, spec_slots: torch.Tensor) -> torch.Tensor:
    """The speculative-verify step of Gated DeltaNet: every sequence has n tokens (its last sampled token
    and n-1 drafts). q, k: [B*n, Hk, Dk]; v: [B*n, Hv, Dv]; a, b: [B*n, Hv] (any row stride); neg_A,
    dt_bias: fp32 [Hv]; ssm_state: fp32 [num_slots, Hv, Dk, Dv]; state_slots: int32 [B]; spec_slots: int32
    [B, n].

    Sequence i owns tokens i*n .. i*n+n-1, starts from ssm_state[state_slots[i]] and leaves the state after
    its j-th token in ssm_state[spec_slots[i, j]] (the state cannot be rewound: the engine keeps the
    snapshot of the accepted drafts): `gated_delta_rule_decode_ref` token by token. ssm_state[state_slots[i]]
    is written only where spec_slots lists it. Returns o [B*n, Hv, Dv] in v's dtype.
    """
    num, n = spec_slots.shape
    # the running states, one per sequence, apart from the pool: their own slots are not to be written
    work = ssm_state.index_select(0, state_slots.long())
    rows = torch.arange(num, dtype=torch.int32, device=q.device)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for j in range(n):
        out[j::n] = gated_delta_rule_decode_ref(q[j::n], k[j::n], v[j::n], a[j::n], b[j::n], neg_A, dt_bias, work,
                                                rows)
        ssm_state[spec_slots[:, j].long()] = work
    return out


def gated_delta_rule_spec(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                          neg_A: torch.Tensor, dt_bias: torch.Tensor, ssm_state: torch.Tensor,
                          state_slots: torch.Tensor, spec_slots: torch.Tensor) -> torch.Tensor:
    """Triton `gated_delta_rule_spec_ref`: the recurrent kernel with the gating fused (as in
    `gated_delta_rule_decode`), each program running its sequence's n tokens and storing its state tile
    after each of them into that token's snapshot slot."""
    op = "gated_delta_rule_spec"
    t = q.shape[0]
    check_spec_slots(op, t, state_slots, spec_slots)
    if v.dim() != 3 or a.shape != (t, v.shape[1]) or b.shape != a.shape:
        raise ValueError(f"{op}: a {tuple(a.shape)} and b {tuple(b.shape)} must be [{t}, Hv] for v [{t}, Hv, Dv], "
                         f"got v {tuple(v.shape)}")
    _check_gating(op, q, k, v, a, b, neg_A, dt_bias, ssm_state, state_slots)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if t:
        _launch_recurrent(q, k, v, a, b, neg_A.contiguous(), dt_bias.contiguous(), ssm_state, state_slots,
                          state_slots, out, gating=True, one_token=False, spec_slots=spec_slots.contiguous())
    return out


FLA_CHUNK = 64  # chunk_gated_delta_rule's chunk length (its default), which its chunk indices count in

# Batches of at most this many tokens take the recurrent kernel instead of fla's chunked one: a call of fla's
# costs about 1.2 ms of host time (its Python wrappers and seven launches) for 0.05-0.2 ms of GPU time, and
# short prefills are host-bound. On the H200 (docs/benchmarks.md, seventeenth session) a 122B-A10B prefill of
# 16-512 tokens took 59-75 ms this way against 96-133 ms through fla; at 1024 fla was ahead (119 vs 127 ms),
# the recurrent kernel's time growing with the longest sequence.
RECURRENT_MAX_TOKENS = 512


def fla_chunk_indices(cu_seqlens_cpu: list[int], device: torch.device) -> torch.Tensor:
    """fla's varlen chunk plan, int64 [num_chunks, 2] of (sequence, chunk within it), from host offsets: the
    same tensor as fla's `prepare_chunk_indices`, built on the host and sent by a non-blocking copy from
    pinned memory (a pageable host-to-device copy waits for the stream, fla's own way a device read)."""
    rows = [(i, j) for i, (a, b) in enumerate(itertools.pairwise(cu_seqlens_cpu))
            for j in range(-(-(b - a) // FLA_CHUNK))]
    return to_device_async(torch.tensor(rows, dtype=torch.long).reshape(-1, 2), device)


def gated_delta_rule_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, ssm_state: torch.Tensor, cu_seqlens: torch.Tensor,
                         state_slots: torch.Tensor, cu_seqlens_cpu: list[int] | None = None) -> torch.Tensor:
    """`gated_delta_rule_ref` with fla-core's chunked kernel for prefill and mixed batches (varlen,
    initial states gathered from the slots, final states scattered back), and the in-place recurrent
    kernel when every sequence has one token (T == B) or the batch is short (T <= RECURRENT_MAX_TOKENS).
    With cu_seqlens_cpu the chunk plan is built on the host and copied without blocking; without it, fla
    derives it from the device offsets, which makes the host wait for the GPU once per call (per GDN layer
    of a prefill)."""
    t = q.shape[0]
    b = state_slots.shape[0]
    if cu_seqlens_cpu is not None and (len(cu_seqlens_cpu) != b + 1 or cu_seqlens_cpu[-1] != t):
        raise ValueError(f"gated_delta_rule: cu_seqlens_cpu has {len(cu_seqlens_cpu)} offsets ending at "
                         f"{cu_seqlens_cpu[-1] if cu_seqlens_cpu else None}, expected {b + 1} ending at {t}")
    if t == b or t <= RECURRENT_MAX_TOKENS:
        return gated_delta_rule_recurrent(q, k, v, g, beta, ssm_state, cu_seqlens, state_slots)
    _check(q, k, v, g, beta, ssm_state, cu_seqlens, state_slots)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    slots = state_slots.long()
    init = ssm_state.index_select(0, slots).float()
    o, final = chunk_gated_delta_rule(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.float().unsqueeze(0), beta.unsqueeze(0),
        scale=q.shape[-1] ** -0.5, initial_state=init, output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens.long(),
        chunk_indices=None if cu_seqlens_cpu is None else fla_chunk_indices(cu_seqlens_cpu, q.device))
    ssm_state.index_copy_(0, slots, final.to(ssm_state.dtype))
    return o[0].to(v.dtype)
