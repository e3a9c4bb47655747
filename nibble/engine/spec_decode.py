"""Speculative decoding with Qwen3.5's MTP head: the device side of prefill and verify steps.

A verify step feeds every decoding sequence its last token and its k draft tokens (n = k + 1 rows each).
The target model runs them in one forward pass; its GDN layers leave the state after each row in a
separate slot (`ForwardBatch.spec_slots`), since a recurrent state cannot be rewound. Acceptance
(spec_sampler.py) says how many drafts each sequence keeps (a) and samples the token after them. Then the
MTP head drafts the next k tokens:

- one pass over all n rows of every sequence, row j reading the target's hidden state at row j and the token
  that follows it (the fed token j + 1 for j < a, the new token at j = a; rows past a are don't-cares whose
  KV the next step overwrites). This writes the head's KV for the verified positions; row a yields draft 1;
- k - 1 single-token passes, step i reading the head's own hidden state and draft i at the next position.

Prefill steps run the target eagerly, sample the rows that end their prompt, then run the head over every
chunk (the token after a chunk's last row: the next prompt token, or the sampled one) and draft from the
rows that were sampled.

The target pass and the drafting pass are each captured as CUDA graphs per padded batch size (verify
batches only); acceptance runs eagerly between them, since sampling settings vary per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nibble.engine.cuda_graphs import capture_sizes
from nibble.kernels.host_copy import to_device_async
from nibble.layers.forward_batch import ForwardBatch, ModelCaches
from nibble.models.multimodal import MultimodalStep


def _draft_tokens(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The MTP head's arg-max tokens, int64 [N], from its hidden states [N, H]."""
    return torch.argmax(model.compute_logits(hidden), dim=-1)


def draft_steps(model: nn.Module, caches: ModelCaches, hidden: torch.Tensor, first: torch.Tensor,
                position: torch.Tensor, block_table: torch.Tensor, block_size: int, num_spec_tokens: int,
                max_seq_len: int, rope_offset: torch.Tensor | None = None) -> torch.Tensor:
    """Drafts 2..k after the first: hidden [B, H] is the head's output where draft 1 (`first`, int64 [B])
    was predicted, at token index `position` (int64 [B]); each step feeds (hidden, last draft) at the next
    index, writing the head's KV there through `block_table` [B, W]. rope_offset: int64 [B] added to the
    rotary positions (an image request's M-RoPE delta), None for zeros. Returns int64 [B, k] (draft 1 first).
    All on the device, no host values but the sizes: safe inside a CUDA graph."""
    num_seqs = first.shape[0]
    device = first.device
    drafts = [first]
    tok = first
    rows = torch.arange(num_seqs, device=device)
    cu = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
    for i in range(1, num_spec_tokens):
        pos = position + i
        block = block_table[rows, pos // block_size].long()
        batch = ForwardBatch(
            input_ids=tok, positions=pos if rope_offset is None else pos + rope_offset, cu_seqlens_q=cu,
            seq_lens=(pos + 1).int(), block_table=block_table,
            slot_mapping=block * block_size + pos % block_size, state_slots=cu[:num_seqs],
            logits_indices=rows, max_query_len=1, max_seq_len=max_seq_len,
            cu_seqlens_q_cpu=list(range(num_seqs + 1)))
        hidden = model.mtp_forward(tok, hidden, batch, caches, step=i)
        tok = _draft_tokens(model, hidden)
        drafts.append(tok)
    return torch.stack(drafts, dim=1)


def draft_after_verify(model: nn.Module, caches: ModelCaches, batch: ForwardBatch, hidden: torch.Tensor,
                       fed: torch.Tensor, tokens: torch.Tensor, num_accepted: torch.Tensor, block_size: int,
                       num_spec_tokens: int, max_seq_len: int) -> torch.Tensor:
    """The next drafts after a verify step: batch is the step's (n rows per sequence), hidden [B*n, H] the
    target's output, fed int64 [B, n] the tokens fed, tokens / num_accepted the acceptance (spec_sampler).
    Returns int64 [B, k]."""
    num_seqs, n = fed.shape
    cols = torch.arange(n, device=fed.device)[None, :]
    new = tokens.gather(1, num_accepted[:, None])
    shifted = torch.cat((fed[:, 1:], new), dim=1)
    following = torch.where(cols < num_accepted[:, None], shifted, new)
    out = model.mtp_forward(following.reshape(-1), hidden, batch, caches, step=0).view(num_seqs, n, -1)
    rows = torch.arange(num_seqs, device=fed.device)
    last = out[rows, num_accepted]
    first = _draft_tokens(model, last)
    # token index of each sequence's first fed row (its rotary position less an image request's delta)
    start = batch.seq_lens.long() - n
    position = start + num_accepted
    rope_offset = batch.positions.view(num_seqs, n)[:, 0] - start
    return draft_steps(model, caches, last, first, position, batch.block_table, block_size, num_spec_tokens,
                       max_seq_len, rope_offset)


def draft_after_prefill(model: nn.Module, caches: ModelCaches, batch: ForwardBatch, hidden: torch.Tensor,
                        next_token_ids: list[int], sample_rows: list[int], sampled: torch.Tensor | None,
                        block_size: int, num_spec_tokens: int, position_offsets: list[int] | None = None,
                        mm: MultimodalStep | None = None) -> torch.Tensor | None:
    """Run the MTP head over a prefill step's chunks and draft after the sampled rows. hidden [T, H]: the
    target's output; next_token_ids[i]: the known token after sequence i's chunk (-1: sampled);
    sampled: int64 [len(sample_rows)] on the device; position_offsets[i]: sequence i's rotary offset (an image
    request's M-RoPE delta; None: zeros); mm: the step's image inputs, whose vision rows the head reads where
    the following token is an image placeholder. Returns int64 [len(sample_rows), k] or None."""
    cu = batch.cu_seqlens_q_cpu
    following = torch.roll(batch.input_ids, -1)
    ends = [c - 1 for c in cu[1:]]
    known = [(ends[i], t) for i, t in enumerate(next_token_ids) if t >= 0]
    if known:
        idx = to_device_async(torch.tensor(known, dtype=torch.int64).t().contiguous(), following.device)
        following[idx[0]] = idx[1]
    if sample_rows:
        assert sampled is not None
        rows = to_device_async(torch.tensor([ends[i] for i in sample_rows], dtype=torch.int64), following.device)
        following[rows] = sampled
    out = model.mtp_forward(following, hidden, batch, caches, step=0, embeds=_following_image_rows(mm, cu))
    if not sample_rows:
        return None
    last = out[rows]
    first = _draft_tokens(model, last)
    # token index of each sampled row (batch.positions are rotary positions, or row indices for image steps)
    offsets = position_offsets or [0] * len(cu)
    host = [[batch.seq_lens_cpu[i] - 1 for i in sample_rows], [offsets[i] for i in sample_rows], sample_rows]
    host_t = to_device_async(torch.tensor(host, dtype=torch.int64), last.device)
    table = batch.block_table[host_t[2]]
    max_seq_len = max(batch.seq_lens_cpu[i] for i in sample_rows) + num_spec_tokens
    return draft_steps(model, caches, last, first, host_t[0], table, block_size, num_spec_tokens, max_seq_len,
                       host_t[1] if position_offsets else None)


def _following_image_rows(mm: MultimodalStep | None, cu: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row indices int64 [m] on the host, vision rows [m, H]) for the MTP pass over a prefill step: row q - 1
    reads the vision row of placeholder q (its following token) when both are in one sequence's chunk. A chunk's
    last row whose next token is a placeholder of the next chunk reads the placeholder's embedding instead: a
    slightly worse draft input there, never a wrong output (drafts are verified)."""
    if mm is None or not mm.token_index.numel():
        return None
    starts = set(cu[:-1])
    keep = [j for j, q in enumerate(mm.token_index.tolist()) if q not in starts]
    if not keep:
        return None
    pick = torch.tensor(keep, dtype=torch.int64)
    return mm.token_index[pick] - 1, mm.embeds[pick.to(mm.embeds.device)]


@dataclass
class _VerifyGraph:
    target: torch.cuda.CUDAGraph
    draft: torch.cuda.CUDAGraph | None
    logits: torch.Tensor
    drafts: torch.Tensor | None


class VerifyGraphs:
    """CUDA graphs of verify steps for padded batch sizes up to max_batch_size: per size a target graph
    (forward pass of n rows per sequence and their logits) and a drafting graph (`draft_after_verify`),
    sharing static inputs and one memory pool. Padded rows use block 0 and state slot 0 (scratch) and are
    routed to no expert in the target pass and the head's pass over the verified rows. With
    mtp_drafts false (n-gram drafts, found on the host) only the target graphs are captured."""

    def __init__(self, model: nn.Module, caches: ModelCaches, max_batch_size: int, num_spec_tokens: int,
                 max_num_blocks_per_seq: int, max_seq_len: int, block_size: int, device: torch.device,
                 thread_local_capture: bool = False, mtp_drafts: bool = True) -> None:
        self.model = model
        self.mtp_drafts = mtp_drafts
        # tensor-parallel ranks capture NCCL collectives: see DecodeGraphs
        self.capture_error_mode = "thread_local" if thread_local_capture else "global"
        self.caches = caches
        self.k = num_spec_tokens
        self.n = n = num_spec_tokens + 1
        self.sizes = capture_sizes(max_batch_size)
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        self.device = device
        m = self.sizes[-1]
        self.input_ids = torch.zeros(m * n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(m * n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((m * n,), -1, dtype=torch.int64, device=device)
        self.cu_seqlens_q = torch.arange(0, m * n + 1, n, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((m,), n, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(m, max_num_blocks_per_seq, dtype=torch.int32, device=device)
        self.state_slots = torch.zeros(m, dtype=torch.int32, device=device)
        self.spec_slots = torch.zeros(m, n, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(m * n, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(m, n, dtype=torch.int64, device=device)
        self.num_accepted = torch.zeros(m, dtype=torch.int64, device=device)
        self.num_valid_tokens = torch.full((1,), m * n, dtype=torch.int32, device=device)
        self.graphs: dict[int, _VerifyGraph] = {}
        self._hidden: dict[int, torch.Tensor] = {}
        self.pool: tuple | None = None

    def batch(self, bs: int) -> ForwardBatch:
        n = self.n
        return ForwardBatch(
            input_ids=self.input_ids[: bs * n], positions=self.positions[: bs * n],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1], seq_lens=self.seq_lens[:bs], block_table=self.block_table[:bs],
            slot_mapping=self.slot_mapping[: bs * n], state_slots=self.state_slots[:bs],
            logits_indices=self.logits_indices[: bs * n], max_query_len=n, max_seq_len=self.max_seq_len,
            cu_seqlens_q_cpu=list(range(0, bs * n + 1, n)), seq_lens_cpu=[n] * bs, spec_slots=self.spec_slots[:bs],
            num_valid_tokens=self.num_valid_tokens)

    def _target(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(self.batch(bs), self.caches)
        return hidden, self.model.compute_logits(hidden)

    def _draft(self, bs: int, hidden: torch.Tensor) -> torch.Tensor:
        return draft_after_verify(self.model, self.caches, self.batch(bs), hidden,
                                  self.input_ids[: bs * self.n].view(bs, self.n), self.tokens[:bs],
                                  self.num_accepted[:bs], self.block_size, self.k, self.max_seq_len)

    def capture_keys(self) -> list[int]:
        """The batch sizes, largest first: the smaller ones reuse its memory."""
        return sorted(self.sizes, reverse=True)

    @torch.inference_mode()
    def capture_one(self, bs: int) -> None:
        """Capture the target and drafting graphs of batch size bs into `self.pool` (which other graphs may
        share; the first capture makes it)."""
        hidden, _ = self._target(bs)
        if self.mtp_drafts:
            self._draft(bs, hidden)
        torch.cuda.synchronize(self.device)
        target = torch.cuda.CUDAGraph()
        with torch.cuda.graph(target, pool=self.pool, capture_error_mode=self.capture_error_mode):
            hidden, logits = self._target(bs)
        if self.pool is None:
            self.pool = target.pool()
        draft, drafts = None, None
        if self.mtp_drafts:
            draft = torch.cuda.CUDAGraph()
            with torch.cuda.graph(draft, pool=self.pool, capture_error_mode=self.capture_error_mode):
                drafts = self._draft(bs, hidden)
        self.graphs[bs] = _VerifyGraph(target, draft, logits, drafts)
        self._hidden[bs] = hidden

    def padded_size(self, num_seqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_seqs), None)

    def load(self, bs: int, token_ids: list[list[int]], context_lens: list[int], block_tables: list[list[int]],
             spec_slots: list[list[int]], position_offsets: list[int] | None = None) -> None:
        """Write one verify batch (padded to bs) into the static inputs; position_offsets[i]: added to sequence
        i's rotary positions (an image request's M-RoPE delta)."""
        n, size = self.n, self.block_size
        num_seqs = len(token_ids)
        pad = bs - num_seqs
        width = max(len(b) for b in block_tables)
        ids = [t for toks in token_ids for t in toks] + [0] * (pad * n)
        offsets = position_offsets or [0] * num_seqs
        pos = [c + o + j for c, o in zip(context_lens, offsets) for j in range(n)] + [0] * (pad * n)
        slots = [b[p // size] * size + p % size for b, c in zip(block_tables, context_lens)
                 for p in range(c, c + n)] + [-1] * (pad * n)
        table = [x for b in block_tables for x in (*b, *([0] * (width - len(b))))] + [0] * (pad * width)
        small = [c + n for c in context_lens] + [n] * pad
        spec = [s for row in spec_slots for s in row] + [0] * (pad * n)
        host = to_device_async(torch.tensor([ids, pos, slots], dtype=torch.int64), self.device)
        ints = to_device_async(torch.tensor(small + [r[0] for r in spec_slots] + [0] * pad + spec + table
                                            + [num_seqs * n], dtype=torch.int32), self.device)
        self.input_ids[: bs * n].copy_(host[0])
        self.positions[: bs * n].copy_(host[1])
        self.slot_mapping[: bs * n].copy_(host[2])
        self.seq_lens[:bs].copy_(ints[:bs])
        self.state_slots[:bs].copy_(ints[bs:2 * bs])
        self.spec_slots[:bs].copy_(ints[2 * bs:2 * bs + bs * n].view(bs, n))
        self.block_table[:bs, :width].copy_(ints[2 * bs + bs * n:-1].view(bs, width))
        self.num_valid_tokens.copy_(ints[-1:])

    def run_target(self, bs: int) -> torch.Tensor:
        """Replay the target graph of size bs; fp32 logits [bs, n, V] (the graph's own buffer)."""
        g = self.graphs[bs]
        g.target.replay()
        return g.logits.view(bs, self.n, -1)

    def run_draft(self, bs: int, tokens: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
        """Replay the drafting graph after acceptance (tokens int64 [B, n], num_accepted [B], B <= bs);
        int64 drafts [bs, k] (the graph's own buffer)."""
        b = tokens.shape[0]
        self.tokens[:b].copy_(tokens)
        self.num_accepted[:b].copy_(num_accepted)
        if b < bs:
            self.tokens[b:bs].zero_()
            self.num_accepted[b:bs].zero_()
        g = self.graphs[bs]
        if g.draft is None or g.drafts is None:
            raise RuntimeError("these verify graphs were captured without the MTP drafting pass")
        g.draft.replay()
        return g.drafts
