"""Fault injection for the reliability tests: make one request's row of a real batch non-finite.

`PoisonRow` wraps the engine's model (the runner calls `model(batch, caches)` and `model.compute_logits`)
and, at the one step where the chosen request has produced exactly `after_tokens` tokens, writes NaN or
Inf into that request's rows only. `where="logits"` poisons the request's last hidden row after the whole
forward, so exactly its logits row becomes non-finite; `where="layer"` poisons the outputs of one decoder
layer for the request's tokens, so the NaN flows through the rest of the model (attention, GDN, MoE and
the caches) together with the other rows of the batch. Everything else runs unmodified.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from nibble.engine.llm_engine import LLMEngine
from nibble.engine.request import Request
from nibble.layers.moe import MoEOutput


class PoisonRow:
    """See the module docstring. `fired` records (engine step, batch size, number of tokens) when it fires."""

    def __init__(self, engine: LLMEngine, target: Callable[[Request], bool], after_tokens: int, *,
                 where: str = "logits", value: float = float("nan"), layer: int = 1) -> None:
        self.engine = engine
        self.target = target
        self.after_tokens = after_tokens
        self.where = where
        self.value = value
        self.fired: list[tuple[int, int, int]] = []
        self.model = engine.runner.model
        if where == "layer":
            self.model.layers[layer].register_forward_hook(self._layer_hook)
        elif where != "logits":
            raise ValueError(f"where must be 'logits' or 'layer', got {where!r}")
        engine.runner.model = self  # type: ignore[assignment]

    def _victim(self, batch: Any) -> int | None:
        """Position in the batch of the target request at the step it must be poisoned, else None."""
        if self.fired:
            return None
        slots = batch.state_slots.tolist()
        for req in list(self.engine.requests.values()):
            # tokens of a step still in flight (overlapped scheduling) count: they precede this step's
            produced = req.num_output_tokens + req.num_pending_tokens
            if req.state_slot in slots and self.target(req) and produced == self.after_tokens:
                # Only the step that completes the prompt (or decodes) produces the token we count from.
                pos = slots.index(req.state_slot)
                if req.num_computed_tokens + batch.cu_seqlens_q_cpu[pos + 1] - batch.cu_seqlens_q_cpu[pos] \
                        == req.num_tokens:
                    return pos
        return None

    def _fire(self, batch: Any) -> None:
        self.fired.append((self.engine.num_steps, batch.num_seqs, batch.num_tokens))

    def _layer_hook(self, _module: Any, args: tuple[Any, ...], output: tuple[Any, torch.Tensor]) -> Any:
        batch = args[2]
        pos = self._victim(batch)
        if pos is None:
            return output
        self._fire(batch)
        hidden, residual = output
        start, end = batch.cu_seqlens_q_cpu[pos], batch.cu_seqlens_q_cpu[pos + 1]
        if isinstance(hidden, MoEOutput):  # uncombined: poisoning the routed part poisons the sum
            routed = hidden.routed.clone()
            routed[start:end] = self.value
            return dataclasses.replace(hidden, routed=routed), residual
        hidden = hidden.clone()
        hidden[start:end] = self.value
        return hidden, residual

    def __call__(self, batch: Any, caches: Any) -> torch.Tensor:
        hidden = self.model(batch, caches)
        if self.where == "logits":
            pos = self._victim(batch)
            if pos is not None:
                self._fire(batch)
                hidden = hidden.clone()
                hidden[int(batch.logits_indices[pos])] = self.value
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def poison_free_cache_memory(engine: LLMEngine) -> int:
    """Fill every free KV block and free GDN state slot (scratch block/slot 0 included) with NaN, as a
    failed request could leave them; returns the number of blocks poisoned."""
    blocks = [0, *engine.blocks.free_blocks]
    slots = [0, *engine.blocks.free_slots]
    caches = engine.runner.caches
    with torch.no_grad():
        for kv in caches.kv:
            if kv is not None:
                kv.k[blocks] = float("nan")
                kv.v[blocks] = float("nan")
        for state in caches.gdn:
            if state is not None:
                state.conv[slots] = float("nan")
                state.ssm[slots] = float("nan")
    return len(blocks)
