"""What one model step needs to know about its batch, and the caches it reads and writes.

Tokens of all sequences are flattened into one dimension (varlen, as in vLLM/SGLang): sequence `i` owns
tokens `cu_seqlens_q[i]:cu_seqlens_q[i+1]`. A decode step is the case where every query length is 1.

Full-attention layers keep K/V in a paged cache: token `t` is written to slot `slot_mapping[t]`
(= block_id * block_size + offset, -1 for padding that must not be written), and sequence `i` reads its
context through `block_table[i]`. Gated DeltaNet layers keep one conv state and one recurrent state per
sequence in a slot pool, addressed by `state_slots[i]`; the engine zeroes a slot before a sequence's first
step, so kernels always start from the slot's contents.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nibble.kernels.host_copy import to_device_async


@dataclass
class ForwardBatch:
    """One step's batch.

    input_ids: int64 [num_tokens]; positions: int64 [num_tokens];
    cu_seqlens_q: int32 [num_seqs + 1]; seq_lens: int32 [num_seqs] (context incl. this step's tokens);
    block_table: int32 [num_seqs, max_num_blocks_per_seq]; slot_mapping: int64 [num_tokens];
    state_slots: int32 [num_seqs]; logits_indices: int64 [num_seqs] (last token of each sequence).
    max_query_len / max_seq_len are host ints so kernels can pick launch shapes without a device sync.
    `cu_seqlens_q_cpu` and `seq_lens_cpu` are host copies for the same reason (fla's varlen chunking).
    spec_slots: int32 [num_seqs, n] for a speculative verify step, where every sequence feeds the same n
    tokens (its last token and n - 1 draft tokens): the GDN layers start from `state_slots[i]` and leave
    their state after the sequence's j-th token in slot `spec_slots[i, j]`, so that the engine can keep
    the state of however many draft tokens were accepted (None otherwise).
    Image input (nibble/models/multimodal.py): rope_cos_sin fp32 [num_tokens, rotary_dim], per-token rotary
    rows that replace the 1-D cos/sin cache (positions are then arange(num_tokens), indexing it), for steps
    with 3-D positions; mm_token_index int64 [n] and mm_embeds [n, hidden]: tokens whose embeddings are
    replaced by the vision tower's rows (None otherwise).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    state_slots: torch.Tensor
    logits_indices: torch.Tensor
    max_query_len: int
    max_seq_len: int
    cu_seqlens_q_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    spec_slots: torch.Tensor | None = None
    rope_cos_sin: torch.Tensor | None = None
    mm_token_index: torch.Tensor | None = None
    mm_embeds: torch.Tensor | None = None
    # int32 [1]: tokens from this index on are padding of a CUDA-graph batch, which the MoE blocks route
    # nowhere (None: every token is real)
    num_valid_tokens: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def build(cls, seqs_token_ids: list[list[int]], context_lens: list[int], block_tables: list[list[int]],
              state_slots: list[int], block_size: int, device: torch.device | str = "cpu",
              max_num_blocks: int | None = None, position_offsets: list[int] | None = None) -> ForwardBatch:
        """Host-side construction from per-sequence lists.

        seqs_token_ids[i]: the tokens sequence i feeds this step; context_lens[i]: tokens already cached
        for it; block_tables[i]: its physical block ids (enough for context + new tokens);
        position_offsets[i]: added to its rotary positions (an image request's M-RoPE delta; None: zeros).
        """
        if any(not toks for toks in seqs_token_ids):
            raise ValueError("every sequence in a batch needs at least one token")
        input_ids, positions, slot_mapping, cu, seq_lens = flatten_step(seqs_token_ids, context_lens, block_tables,
                                                                        block_size, position_offsets)
        # Rounded up to a multiple of 16: the row stride is a kernel argument, and Triton compiles a new
        # variant for each of its divisibility classes (1, 16k, other) on first use in a step.
        width = max_num_blocks or -(-max((len(b) for b in block_tables), default=1) // 16) * 16 or 16
        table = [x for b in block_tables for x in (*b, *([0] * (width - len(b))))]
        logits_indices = [c - 1 for c in cu[1:]]
        # one host buffer per dtype, one asynchronous copy each (segments 32-byte aligned for the kernels)
        ids_, pos_, slots_, logits_ = _packed([input_ids, positions, slot_mapping, logits_indices], torch.int64,
                                              device)
        cu_, lens_, states_, table_ = _packed([cu, seq_lens, state_slots, table], torch.int32, device)
        return cls(
            input_ids=ids_,
            positions=pos_,
            cu_seqlens_q=cu_,
            seq_lens=lens_,
            block_table=table_.view(len(block_tables), width),
            slot_mapping=slots_,
            state_slots=states_,
            logits_indices=logits_,
            max_query_len=max(len(s) for s in seqs_token_ids),
            max_seq_len=max(seq_lens),
            cu_seqlens_q_cpu=cu,
            seq_lens_cpu=seq_lens,
        )


def flatten_step(seqs_token_ids: list[list[int]], context_lens: list[int], block_tables: list[list[int]],
                 block_size: int, position_offsets: list[int] | None = None
                 ) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """A step's per-sequence lists as the flat host lists the kernels take: (input_ids, positions,
    slot_mapping, cu_seqlens_q, seq_lens); see `ForwardBatch.build` for the arguments."""
    offsets = position_offsets or [0] * len(seqs_token_ids)
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    cu = [0]
    seq_lens: list[int] = []
    for toks, ctx, blocks, off in zip(seqs_token_ids, context_lens, block_tables, offsets, strict=True):
        n = len(toks)
        input_ids.extend(toks)
        for p in range(ctx, ctx + n):
            positions.append(p + off)
            slot_mapping.append(blocks[p // block_size] * block_size + p % block_size)
        cu.append(cu[-1] + n)
        seq_lens.append(ctx + n)
    return input_ids, positions, slot_mapping, cu, seq_lens


def _ordered_batches(pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """(source, destination) copies cut into runs that can each be done as one gather and one scatter with
    the effect of doing them in order: a run ends before a pair that reads an earlier pair's destination
    (a prefix-cache entry made in the same step as a request that starts from it)."""
    runs: list[list[tuple[int, int]]] = []
    written: set[int] = set()
    for src, dst in pairs:
        if not runs or src in written or dst in written:
            runs.append([])
            written = set()
        runs[-1].append((src, dst))
        written.add(dst)
    return runs


def _copy_rows(tensors: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """tensors[k][dst] = tensors[k][src] for each (src, dst) pair, in order (`_ordered_batches`): one gather
    and one scatter per tensor and run, the indices sent to the device once per run."""
    if not tensors:
        return
    for run in _ordered_batches(pairs):
        idx = to_device_async(torch.tensor(run, dtype=torch.long).t().contiguous(), tensors[0].device)
        for t in tensors:
            # byte view for 1-byte types: index_copy has no float8 kernels
            raw = t.view(torch.uint8) if t.element_size() == 1 else t
            raw.index_copy_(0, idx[1], raw.index_select(0, idx[0]))


def _packed(parts: list[list[int]], dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
    """parts as views of one device buffer of `dtype`, each starting 32 bytes after an aligned start."""
    align = 32 // dtype.itemsize
    starts, flat = [], []
    for part in parts:
        starts.append(len(flat))
        flat.extend(part)
        flat.extend([0] * (-len(flat) % align))
    buf = to_device_async(torch.tensor(flat, dtype=dtype), device)
    return [buf[a:a + len(p)] for a, p in zip(starts, parts)]


@dataclass
class KVCache:
    """Paged K/V of one full-attention layer.

    k, v: [num_blocks, block_size, num_kv_heads, head_dim] in the model dtype or float8_e4m3fn.
    k_scale / v_scale: dequantization scales of an FP8 cache (1.0 otherwise).
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def block_size(self) -> int:
        return int(self.k.shape[1])


@dataclass
class GDNState:
    """Per-sequence state of one Gated DeltaNet layer, in a slot pool.

    conv: [num_slots, conv_kernel - 1, conv_dim] (model dtype; channels contiguous so a decode step
    reads them coalesced); ssm: fp32 [num_slots, num_v_heads,
    key_head_dim, value_head_dim].
    """

    conv: torch.Tensor
    ssm: torch.Tensor


@dataclass
class ModelCaches:
    """Caches of every layer, indexed by layer id (None where the layer has no such cache)."""

    kv: list[KVCache | None]
    gdn: list[GDNState | None]

    def copy_state_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Copy GDN states (conv and recurrent) from slot to slot, for each (source, destination) pair, with
        the effect of copying them one after the other (a pair may read what an earlier one wrote)."""
        _copy_rows([t for st in self.gdn if st is not None for t in (st.conv, st.ssm)], pairs)

    def copy_kv_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the K/V of whole blocks, every full-attention layer, for each (source, destination) pair, one
        pair after the other as `copy_state_slots` does."""
        _copy_rows([t for c in self.kv if c is not None for t in (c.k, c.v)], pairs)

    def reset_state_slots(self, slots: list[int] | torch.Tensor) -> None:
        """Zero the GDN states of freshly assigned slots."""
        if isinstance(slots, list):
            if not slots:
                return
            slots = torch.tensor(slots, dtype=torch.long)
        idx = None
        for st in self.gdn:
            if st is None:
                continue
            if idx is None:
                idx = to_device_async(slots.to(torch.long), st.conv.device)
            st.conv.index_fill_(0, idx, 0)
            st.ssm.index_fill_(0, idx, 0)

    @classmethod
    def allocate(cls, config: object, num_blocks: int, block_size: int, num_state_slots: int,
                 dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device | str,
                 num_kv_heads: int | None = None, num_v_heads: int | None = None,
                 conv_dim: int | None = None, num_mtp_layers: int = 0) -> ModelCaches:
        """Allocate caches for a `ModelConfig`; the `num_*`/`conv_dim` overrides give a tensor-parallel
        rank's share of heads. num_mtp_layers: full-attention KV caches appended after the model's layers
        (ids num_hidden_layers, ...) for the MTP draft head's layers."""
        from nibble.models.config import FULL_ATTENTION, ModelConfig

        assert isinstance(config, ModelConfig)
        kvh = num_kv_heads or config.num_key_value_heads
        vh = num_v_heads or config.linear_num_value_heads
        cd = conv_dim or config.linear_conv_dim
        kv: list[KVCache | None] = []
        gdn: list[GDNState | None] = []
        for t in [*config.layer_types, *([FULL_ATTENTION] * num_mtp_layers)]:
            if t == FULL_ATTENTION:
                shape = (num_blocks, block_size, kvh, config.head_dim)
                kv.append(KVCache(torch.zeros(shape, dtype=kv_dtype, device=device),
                                  torch.zeros(shape, dtype=kv_dtype, device=device)))
                gdn.append(None)
            else:
                kv.append(None)
                conv = torch.zeros((num_state_slots, config.linear_conv_kernel_dim - 1, cd),
                                   dtype=dtype, device=device)
                ssm = torch.zeros((num_state_slots, vh, config.linear_key_head_dim,
                                   config.linear_value_head_dim), dtype=torch.float32, device=device)
                gdn.append(GDNState(conv, ssm))
        return cls(kv=kv, gdn=gdn)
