"""StepInputs survive the trip through the int32 message rank 0 broadcasts."""

from __future__ import annotations

from nibble.engine.step_inputs import StepInputs


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
