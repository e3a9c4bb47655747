"""StepInputs survive the trip through the int32 message rank 0 broadcasts."""

from __future__ import annotations

import pytest
import torch

from nibble.engine.step_inputs import StepInputs
from nibble.models.multimodal import MultimodalStep


def test_pack_unpack_round_trip() -> None:
    steps = [
        StepInputs([[5, 6, 7], [8]], [0, 12], [[3], [1, 2, 9, 4]], [2, 1], [2], [0, 1]),
        StepInputs([[1]] * 3, [4, 5, 6], [[7, 8]] * 3, [1, 2, 3], [], [0, 1, 2]),
        StepInputs([list(range(40))], [100], [list(range(35))], [7], [7], []),
        StepInputs([[3, 4], [9]], [64, 7], [[1, 2, 5, 6, 8], [4]], [3, 5], [5], [0, 1], [(9, 3), (3, 10)]),
        StepInputs([[3]], [70], [[1, 2, 5]], [3], [], [0], [(9, 3)], [(12, 5), (7, 6)]),
        # speculative decoding: a verify step (three tokens per sequence, a snapshot slot each), a prefill step
        StepInputs([[3, 8, 9], [4, 1, 2]], [10, 20], [[1], [2, 3]], [4, 6], [], [0, 1], spec_slots=[[4, 7, 8],
                                                                                                      [6, 9, 10]]),
        StepInputs([[3, 8], [4]], [0, 5], [[1], [2]], [4, 6], [4], [1], next_token_ids=[11, -1]),
        StepInputs([[3, 8, 2], [4]], [0, 5], [[1], [2]], [4, 6], [4], [1], prompt_logprob_rows=[0],
                   prompt_logprob_next=[7], prompt_logprob_counts=[3]),
    ]
    for step in steps:
        message = step.pack()
        assert message.dtype.itemsize == 4 and message.dim() == 1
        assert StepInputs.unpack(message) == step


def test_pack_unpack_image_steps() -> None:
    """Decode offsets and an image step's positions and placeholder indices travel in the message; the vision
    rows travel apart (StepChannel) and are handed to unpack."""
    offsets_only = StepInputs([[3], [4]], [30, 7], [[1, 2], [3]], [1, 2], [], [0, 1], position_offsets=[-5, 0])
    got = StepInputs.unpack(offsets_only.pack())
    assert got == offsets_only and StepInputs.image_rows(offsets_only.pack()) == (0, 0)

    positions = torch.tensor([[0, 1, 2, 2, 3], [0, 1, 2, 3, 3], [0, 1, 2, 2, 4]])
    rows = torch.randn(2, 6)
    mm = MultimodalStep(positions, torch.tensor([2, 3]), rows)
    step = StepInputs([[1, 9, 9], [5, 6]], [0, 40], [[1], [2, 3, 4]], [1, 2], [1], [1], position_offsets=[0, -3],
                      mm=mm)
    message = step.pack()
    assert StepInputs.image_rows(message) == (2, 6)
    got = StepInputs.unpack(message, rows.clone())
    assert got.position_offsets == [0, -3] and got.mm is not None
    assert torch.equal(got.mm.positions, positions) and torch.equal(got.mm.token_index, torch.tensor([2, 3]))
    assert torch.equal(got.mm.embeds, rows)
    with pytest.raises(ValueError, match="2 image rows"):
        StepInputs.unpack(message)
    # positions of a prompt chunk without placeholders (the part after an image): no rows to send
    plain = StepInputs([[5, 6]], [10], [[1, 2, 3]], [1], [], [0],
                       mm=MultimodalStep(torch.zeros(3, 2, dtype=torch.int64), torch.empty(0, dtype=torch.int64),
                                         torch.empty(0)))
    assert StepInputs.image_rows(plain.pack()) == (0, 0) and StepInputs.unpack(plain.pack()).mm is not None
