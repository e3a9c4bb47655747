"""Checking a `moe_align` result against `moe_align_ref`, up to the order of pairs inside each expert's segment
(which depends on the counting atomics)."""

from __future__ import annotations

from nibble.kernels.moe_align import MoEAlignment


def assert_alignment_matches(al: MoEAlignment, ref: MoEAlignment) -> None:
    """Counts, starts and blocks equal; each kept expert's segment holds its pairs first (in any order), then -1
    up to its last block's end; every other entry, past the last block too, is -1."""
    assert al.block_m == ref.block_m
    assert al.sorted_ids.shape == ref.sorted_ids.shape and al.block_expert.shape == ref.block_expert.shape
    assert al.expert_count.tolist() == ref.expert_count.tolist()
    assert al.expert_start.tolist() == ref.expert_start.tolist()
    assert al.block_expert.tolist() == ref.block_expert.tolist()
    got, want = al.sorted_ids.tolist(), ref.sorted_ids.tolist()
    blocks = ref.block_expert.tolist()
    for e, (s, c) in enumerate(zip(ref.expert_start.tolist(), ref.expert_count.tolist())):
        end = s + blocks.count(e) * ref.block_m
        if s < 0 or end == s:
            continue
        assert sorted(got[s:s + c]) == sorted(want[s:s + c]), f"expert {e}: pairs"
        assert got[s + c:end] == [-1] * (end - s - c), f"expert {e}: padding"
    assert sorted(got) == sorted(want)
