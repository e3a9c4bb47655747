"""CUDA graphs for short prefill and mixed prefill+decode steps, captured per padded size (tokens, sequences).

An eager step of a few hundred tokens is bound by the host, not the GPU: it launches about a thousand kernels
through Python (an H200 spent 58 ms of wall time on the 13.7 ms of kernels of a 16-token 122B-A10B prefill).
A captured step replays them at once. A step of T tokens in B sequences runs the smallest captured size
(T_pad, B_pad) with T <= T_pad and B <= B_pad, where B_pad = min(max_num_seqs, T_pad // 2): B_pad stays below
T_pad so that no padded batch looks like a decode step to the kernels, which pick their decode paths by
T == B. The launch grids are those of (T_pad, B_pad), with the host ints the kernels size them by fixed:
max_seq_len = the model's longest context, and max_query_len = T_pad, or 16 in a second graph per size for
steps whose queries are all that short (many decoding sequences and a short prompt): paged attention splits
the KV range of such steps over several programs (a decode row on a 16k context took ~1 ms per layer in one
program, 35 us split), which a graph sized for T_pad-token queries cannot.

Padding: sequences B..B_pad-1 have no tokens (cu_seqlens stays at T for them), state slot 0 and block 0 (the
reserved scratch), so every kernel skips them; tokens T..T_pad-1 belong to no sequence (token id 0, position 0,
KV slot -1): the attention and Gated DeltaNet kernels leave their rows unset, so what the later layers compute
for them is unspecified (possibly not finite). No kernel mixes token rows, and only the real sequences' last
rows are read, so their garbage stays in their own rows. The MoE blocks route them to no expert (the batch's
num_valid_tokens is a view of cu_seqlens_q[B_pad], which is T): a step of 48 tokens in a 96-token graph would
otherwise run the experts for 96 tokens, 8 pairs each.

Under speculative decoding (`full_hidden`) the graph returns the hidden rows of every token instead, which the
MTP head's pass over the prefill chunks reads (eagerly, after the target's tokens are sampled).

The Gated DeltaNet layers must take a kernel that needs no host data and no sync: the recurrent one, which the
fla backend uses up to gated_delta.RECURRENT_MAX_TOKENS tokens, the largest size captured.
"""

from __future__ import annotations

import torch
from torch import nn

from nibble.engine.cuda_graphs import capture_graph
from nibble.kernels.gated_delta import RECURRENT_MAX_TOKENS
from nibble.kernels.host_copy import to_device_async
from nibble.kernels.paged_attention import SPLIT_MAX_QUERY_LEN
from nibble.layers.forward_batch import ForwardBatch, ModelCaches, flatten_step

_TOKEN_SIZES = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)

# A captured step: (T_pad, B_pad, short), short meaning every query has at most SPLIT_MAX_QUERY_LEN tokens.
GraphKey = tuple[int, int, bool]


def mixed_capture_sizes(max_tokens: int, max_num_seqs: int) -> list[tuple[int, int]]:
    """(T_pad, B_pad) of the graphs to capture for steps of up to max_tokens tokens (capped at
    RECURRENT_MAX_TOKENS); empty when max_tokens is below the smallest size."""
    limit = min(max_tokens, RECURRENT_MAX_TOKENS)
    return [(t, max(1, min(max_num_seqs, t // 2))) for t in _TOKEN_SIZES if t <= limit]


class MixedGraphs:
    """Captured prefill / mixed steps of `model`, sizes from `mixed_capture_sizes`. Without `capture()` (on the
    CPU: tests) `run` computes the same padded batch eagerly."""

    def __init__(self, model: nn.Module, caches: ModelCaches, max_tokens: int, max_num_seqs: int,
                 max_num_blocks_per_seq: int, max_seq_len: int, device: torch.device,
                 thread_local_capture: bool = False, full_hidden: bool = False) -> None:
        self.model = model
        self.full_hidden = full_hidden
        self.caches = caches
        self.sizes = mixed_capture_sizes(max_tokens, max_num_seqs)
        if not self.sizes:
            raise ValueError(f"no mixed-step graph sizes up to {max_tokens} tokens")
        self.max_seq_len = max_seq_len
        self.device = device
        self.capture_error_mode = "thread_local" if thread_local_capture else "global"
        t, b = self.sizes[-1][0], max(s[1] for s in self.sizes)
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=device)
        self.cu_seqlens_q = torch.zeros(b + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=device)
        self.state_slots = torch.zeros(b, dtype=torch.int32, device=device)
        self.logits_indices = torch.zeros(b, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(b, max_num_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        # the memory pool to capture into (e.g. the decode graphs'); the first capture makes one if None
        self.pool: tuple | None = None
        # sizes up to SPLIT_MAX_QUERY_LEN tokens have short queries only: one graph
        self.keys: list[GraphKey] = [(t, b, True) for t, b in self.sizes] + \
            [(t, b, False) for t, b in self.sizes if t > SPLIT_MAX_QUERY_LEN]

    def padded_size(self, num_tokens: int, num_seqs: int, max_query_len: int) -> GraphKey | None:
        """The graph for a step of num_tokens tokens in num_seqs sequences, the longest feeding max_query_len:
        the smallest captured (T_pad, B_pad) that holds it, in its short-query variant where that applies."""
        short = max_query_len <= SPLIT_MAX_QUERY_LEN
        return next(((t, b, short or t <= SPLIT_MAX_QUERY_LEN) for t, b in self.sizes
                     if t >= num_tokens and b >= num_seqs), None)

    def batch(self, key: GraphKey) -> ForwardBatch:
        """The padded batch of `key`, views of the static buffers."""
        t, b, short = key
        return ForwardBatch(
            input_ids=self.input_ids[:t], positions=self.positions[:t], cu_seqlens_q=self.cu_seqlens_q[: b + 1],
            seq_lens=self.seq_lens[:b], block_table=self.block_table[:b], slot_mapping=self.slot_mapping[:t],
            state_slots=self.state_slots[:b], logits_indices=self.logits_indices[:b],
            max_query_len=min(t, SPLIT_MAX_QUERY_LEN) if short else t, max_seq_len=self.max_seq_len,
            num_valid_tokens=self.cu_seqlens_q[b: b + 1])

    def load(self, key: GraphKey, token_ids: list[list[int]], context_lens: list[int],
             block_tables: list[list[int]], state_slots: list[int], block_size: int,
             pending: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Write a step's inputs, padded to `key`'s size, into the static buffers. token_ids[i]: the tokens
        sequence i feeds (at positions context_lens[i]...); pending: (flat token positions, token ids), int64
        [n] on the device, written over input_ids afterwards (tokens of the step in flight)."""
        t_pad, b_pad, short = key
        num_seqs = len(token_ids)
        ids, pos, slots, cu, seq_lens = flatten_step(token_ids, context_lens, block_tables, block_size)
        num_tokens = len(ids)
        if num_tokens > t_pad or num_seqs > b_pad or (short and max(map(len, token_ids)) > SPLIT_MAX_QUERY_LEN):
            raise ValueError(f"a step of {num_tokens} tokens in {num_seqs} sequences does not fit {key}")
        pad_t, pad_b = t_pad - num_tokens, b_pad - num_seqs
        # only as wide as the longest table: columns past a sequence's last block are never read
        width = max(map(len, block_tables))
        table = [x for blk in block_tables for x in (*blk, *([0] * (width - len(blk))))]
        tokens = torch.tensor([ids + [0] * pad_t, pos + [0] * pad_t, slots + [-1] * pad_t], dtype=torch.int64)
        seqs = torch.tensor([cu[1:] + [num_tokens] * pad_b,
                             seq_lens + [0] * pad_b,
                             state_slots + [0] * pad_b], dtype=torch.int32)
        last = torch.tensor([c - 1 for c in cu[1:]] + [0] * pad_b, dtype=torch.int64)
        tokens_d = to_device_async(tokens, self.device)
        seqs_d = to_device_async(seqs, self.device)
        self.input_ids[:t_pad].copy_(tokens_d[0])
        self.positions[:t_pad].copy_(tokens_d[1])
        self.slot_mapping[:t_pad].copy_(tokens_d[2])
        self.cu_seqlens_q[1: b_pad + 1].copy_(seqs_d[0])
        self.seq_lens[:b_pad].copy_(seqs_d[1])
        self.state_slots[:b_pad].copy_(seqs_d[2])
        self.logits_indices[:b_pad].copy_(to_device_async(last, self.device))
        self.block_table[:num_seqs, :width].copy_(
            to_device_async(torch.tensor(table, dtype=torch.int32).view(num_seqs, width), self.device))
        if pad_b:
            self.block_table[num_seqs:b_pad].zero_()
        if pending is not None:
            self.input_ids[pending[0]] = pending[1]

    def forward(self, key: GraphKey) -> torch.Tensor:
        """The model on the padded batch of `key` (as loaded): hidden [B_pad, hidden_size] at each sequence's
        last token, or [T_pad, hidden_size] for every token with full_hidden."""
        batch = self.batch(key)
        hidden = self.model(batch, self.caches)
        return hidden if self.full_hidden else hidden[batch.logits_indices]

    def capture_keys(self) -> list[GraphKey]:
        """Every graph's key, largest first: the smaller ones reuse its memory."""
        return sorted(self.keys, reverse=True)

    @torch.inference_mode()
    def capture_one(self, key: GraphKey) -> None:
        """Capture the graph of `key` into `self.pool`. The static buffers hold an empty batch meanwhile: every
        sequence has no token."""
        graph, out = capture_graph(lambda: self.forward(key), self.pool, self.capture_error_mode, self.device)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = graph
        self.outputs[key] = out

    def replays(self, key: GraphKey) -> bool:
        """Whether `run` replays a captured graph for `key` (else it computes the step eagerly)."""
        return key in self.graphs

    @torch.inference_mode()
    def run(self, key: GraphKey, num_rows: int) -> torch.Tensor:
        """Replay the loaded step: hidden [num_rows, hidden_size], num_rows being the step's sequences (their last
        tokens) or, with full_hidden, its tokens (the graph's output buffer: read it before the next replay). A
        graph not captured (`replays` False; on the CPU: tests) is computed eagerly on the same padded batch."""
        graph = self.graphs.get(key)
        if graph is None:
            return self.forward(key)[:num_rows]
        graph.replay()
        return self.outputs[key][:num_rows]
