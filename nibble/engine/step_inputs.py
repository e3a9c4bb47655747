"""The host-side description of one engine step, independent of `Request` objects so that tensor-parallel
rank 0 can send it to the other ranks: which tokens each sequence feeds, where its KV blocks and GDN slot
are, which GDN states and KV blocks to copy and which slots to zero first (in that order), and which rows
to sample.
Positions, slot mapping and cu_seqlens follow from these on every rank (`ForwardBatch.build`), so they are
not sent.

On the wire a step is one int32 tensor:
[num_seqs, num_new_slots, num_sample_rows, num_state_copies, num_block_copies, spec_width, has_next_ids,
 num_prompt_logprob_rows, has_offsets, has_mm, num_image_rows, image_width, query_lens (num_seqs),
 context_lens (num_seqs), block_table_lens (num_seqs), state_slots (num_seqs), new_state_slots, sample_rows,
 state copies and block copies (source, destination pairs), token ids (all sequences), block ids (all
 sequences), spec_slots (num_seqs x spec_width), next_token_ids (num_seqs if has_next_ids),
 prompt_logprob_rows, prompt_logprob_next, prompt_logprob_counts, position_offsets (num_seqs if has_offsets),
 the image step's 3-D positions (3 x all tokens, if has_mm) and its placeholder indices (num_image_rows)].
The vision rows themselves (num_image_rows x image_width, on the device) follow over the model's group
(`parallel.StepChannel`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate, chain

import numpy as np
import torch

from nibble.engine.scheduler import ScheduledBatch
from nibble.models.multimodal import MultimodalStep


@dataclass
class StepInputs:
    """One step. token_ids[i]: the tokens sequence i feeds; context_lens[i]: its tokens already cached;
    block_tables[i]: its KV block ids (enough for context + new tokens); state_slots[i]: its GDN slot;
    new_state_slots: slots to zero before the step; sample_rows: sequences whose logits are wanted (those
    whose prefill reaches the end of their known tokens); prompt_logprob_rows: sequences whose chunk covers
    prompt positions that want log-probabilities (`SamplingParams.prompt_logprobs`), prompt_logprob_next[j]:
    the prompt token after row prompt_logprob_rows[j]'s chunk (-1 past the prompt), prompt_logprob_counts[j]:
    how many of the chunk's first positions predict a prompt token (all, unless the chunk reaches past the
    prompt: a request recomputed after preemption). position_offsets[i]: added to sequence i's rotary
    positions (an image request's M-RoPE delta; [] when all are 0); mm: the step's image inputs
    (image_steps.py), whose device rows `pack` leaves to the caller."""

    token_ids: list[list[int]]
    context_lens: list[int]
    block_tables: list[list[int]]
    state_slots: list[int]
    new_state_slots: list[int]
    sample_rows: list[int]
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    spec_slots: list[list[int]] = field(default_factory=list)
    next_token_ids: list[int] = field(default_factory=list)
    prompt_logprob_rows: list[int] = field(default_factory=list)
    prompt_logprob_next: list[int] = field(default_factory=list)
    prompt_logprob_counts: list[int] = field(default_factory=list)
    position_offsets: list[int] = field(default_factory=list)
    mm: MultimodalStep | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        return all(len(t) == 1 for t in self.token_ids)

    @classmethod
    def from_schedule(cls, sched: ScheduledBatch, speculative: bool = False) -> StepInputs:
        reqs = sched.requests
        if sched.spec_verify:
            return cls(
                token_ids=[r.token_slice(r.num_computed_tokens, r.num_computed_tokens + 1) + r.draft_token_ids
                           for r in reqs],
                context_lens=[r.num_computed_tokens for r in reqs],
                block_tables=[r.block_ids for r in reqs],
                state_slots=[r.state_slot for r in reqs],  # type: ignore[misc]
                new_state_slots=list(sched.new_state_slots),
                sample_rows=list(range(len(reqs))),
                state_copies=list(sched.state_copies),
                block_copies=list(sched.block_copies),
                spec_slots=[[r.state_slot, *r.spec_slots] for r in reqs],  # type: ignore[list-item]
            )
        plp_rows, plp_next, plp_counts = [], [], []
        for i, (r, n) in enumerate(zip(reqs, sched.num_new_tokens)):
            # positions c..c+n-1 predict tokens c+1..c+n: wanted while c+1 is still a prompt token
            c, p = r.num_computed_tokens, r.num_prompt_tokens
            if r.sampling_params.prompt_logprobs is not None and c + 1 < p:
                plp_rows.append(i)
                plp_next.append(r.prompt_token_ids[c + n] if c + n < p else -1)
                plp_counts.append(min(n, p - 1 - c))
        next_ids = []
        if speculative:
            for r, n in zip(reqs, sched.num_new_tokens):
                end = r.num_computed_tokens + n
                next_ids.append(r.token_slice(end, end + 1)[0] if end < r.num_tokens else -1)
        return cls(
            token_ids=[r.token_slice(r.num_computed_tokens, r.num_computed_tokens + n)
                       for r, n in zip(reqs, sched.num_new_tokens)],
            context_lens=[r.num_computed_tokens for r in reqs],
            block_tables=[r.block_ids for r in reqs],
            state_slots=[r.state_slot for r in reqs],  # type: ignore[misc]
            new_state_slots=list(sched.new_state_slots),
            sample_rows=[i for i, (r, n) in enumerate(zip(reqs, sched.num_new_tokens))
                         if r.num_computed_tokens + n == r.num_tokens],
            state_copies=list(sched.state_copies),
            block_copies=list(sched.block_copies),
            next_token_ids=next_ids,
            prompt_logprob_rows=plp_rows,
            prompt_logprob_next=plp_next,
            prompt_logprob_counts=plp_counts,
        )

    @property
    def is_speculative(self) -> bool:
        """A step of speculative decoding: a verify step (spec_slots) or a prefill step (next_token_ids)."""
        return bool(self.spec_slots or self.next_token_ids)

    def pack(self) -> torch.Tensor:
        """int32 [message length] (layout in the module docstring)."""
        n = self.num_seqs
        if self.position_offsets and len(self.position_offsets) != n:
            raise ValueError("position_offsets must have one entry per sequence")
        mm = self.mm
        num_tokens = sum(len(t) for t in self.token_ids)
        if mm is not None and tuple(mm.positions.shape) != (3, num_tokens):
            raise ValueError(f"image positions must be [3, {num_tokens}], got {list(mm.positions.shape)}")
        mm_rows = int(mm.token_index.numel()) if mm is not None else 0
        mm_width = int(mm.embeds.shape[-1]) if mm is not None and mm_rows else 0
        width = len(self.spec_slots[0]) if self.spec_slots else 0
        if (self.spec_slots and len(self.spec_slots) != n) or any(len(r) != width for r in self.spec_slots) \
                or (self.next_token_ids and len(self.next_token_ids) != n):
            raise ValueError("spec_slots / next_token_ids must have one row per sequence, spec_slots rows equal")
        if not len(self.prompt_logprob_next) == len(self.prompt_logprob_counts) == len(self.prompt_logprob_rows):
            raise ValueError("prompt_logprob_next / _counts must have one entry per prompt_logprob_rows entry")
        head = [n, len(self.new_state_slots), len(self.sample_rows), len(self.state_copies), len(self.block_copies),
                width, int(bool(self.next_token_ids)), len(self.prompt_logprob_rows), int(bool(self.position_offsets)),
                int(mm is not None), mm_rows, mm_width]
        flat = chain(head, (len(t) for t in self.token_ids), self.context_lens,
                     (len(b) for b in self.block_tables), self.state_slots, self.new_state_slots,
                     self.sample_rows, chain.from_iterable(self.state_copies), chain.from_iterable(self.block_copies),
                     chain.from_iterable(self.token_ids), chain.from_iterable(self.block_tables),
                     chain.from_iterable(self.spec_slots), self.next_token_ids, self.prompt_logprob_rows,
                     self.prompt_logprob_next, self.prompt_logprob_counts, self.position_offsets,
                     mm.positions.reshape(-1).tolist() if mm is not None else (),
                     mm.token_index.tolist() if mm is not None else ())
        count = (len(head) + 4 * n + len(self.new_state_slots) + len(self.sample_rows) + 2 * len(self.state_copies)
                 + 2 * len(self.block_copies) + n * width + len(self.next_token_ids)
                 + 3 * len(self.prompt_logprob_rows) + len(self.position_offsets)
                 + (3 * num_tokens if mm is not None else 0) + mm_rows)
        count += sum(len(t) for t in self.token_ids) + sum(len(b) for b in self.block_tables)
        # np.fromiter with a known count is several times faster than torch.tensor(list) on long block tables.
        return torch.from_numpy(np.fromiter(flat, dtype=np.int32, count=count))

    @staticmethod
    def image_rows(message: torch.Tensor) -> tuple[int, int]:
        """(rows, width) of the vision rows that follow a packed step over the model's group; (0, 0) for none."""
        return int(message[10]), int(message[11])

    @classmethod
    def unpack(cls, message: torch.Tensor, image_embeds: torch.Tensor | None = None) -> StepInputs:
        """The step `pack` wrote; image_embeds: its vision rows [image_rows, image_width], received apart."""
        v = message.numpy().tolist()
        n, n_new, n_sample, n_copies, n_block_copies, width, has_next, n_plp, has_offsets, has_mm, n_mm, _ = v[:12]
        pos = 12

        def take(count: int) -> list[int]:
            nonlocal pos
            out = v[pos:pos + count]
            pos += count
            return out

        query_lens, context_lens, table_lens, state_slots = take(n), take(n), take(n), take(n)
        new_state_slots, sample_rows = take(n_new), take(n_sample)
        copies = take(2 * n_copies)
        block_copies = take(2 * n_block_copies)
        tokens = take(sum(query_lens))
        blocks = take(sum(table_lens))
        spec = take(n * width)
        next_ids = take(n) if has_next else []
        plp_rows, plp_next, plp_counts = take(n_plp), take(n_plp), take(n_plp)
        offsets = take(n) if has_offsets else []
        mm = None
        if has_mm:
            positions = torch.tensor(take(3 * len(tokens)), dtype=torch.int64).reshape(3, len(tokens))
            index = torch.tensor(take(n_mm), dtype=torch.int64)
            if n_mm and (image_embeds is None or image_embeds.shape[0] != n_mm):
                raise ValueError(f"the step has {n_mm} image rows; got "
                                 f"{None if image_embeds is None else list(image_embeds.shape)}")
            mm = MultimodalStep(positions, index, image_embeds if n_mm else torch.empty(0))
        tok_cu = [0, *accumulate(query_lens)]
        blk_cu = [0, *accumulate(table_lens)]
        return cls(
            token_ids=[tokens[tok_cu[i]:tok_cu[i + 1]] for i in range(n)],
            context_lens=context_lens,
            block_tables=[blocks[blk_cu[i]:blk_cu[i + 1]] for i in range(n)],
            state_slots=state_slots,
            new_state_slots=new_state_slots,
            sample_rows=sample_rows,
            state_copies=list(zip(copies[::2], copies[1::2])),
            block_copies=list(zip(block_copies[::2], block_copies[1::2])),
            spec_slots=[spec[i * width:(i + 1) * width] for i in range(n)] if width else [],
            next_token_ids=next_ids,
            prompt_logprob_rows=plp_rows,
            prompt_logprob_next=plp_next,
            prompt_logprob_counts=plp_counts,
            position_offsets=offsets,
            mm=mm,
        )
