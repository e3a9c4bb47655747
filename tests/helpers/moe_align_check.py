"""Checking a `moe_align` result against `moe_align_ref`, up to the order of pairs inside each expert's segment
(which depends on the counting atomics)."""

from __future__ import annotations

from nibble.kernels.moe_align import MoEAlignment


def assert_alignment_matches(al: MoEAlignment, ref: MoEAlignment) -> None:
    """Counts, starts and blocks equal; each kept expert's segment (its blocks, padding included) holds the same
    entries; every entry holding no pair, past the last block too, is -1."""
    assert al.block_m == ref.block_m
    assert al.sorted_ids.shape == ref.sorted_ids.shape and al.block_expert.shape == ref.block_expert.shape
    assert al.expert_count.tolist() == ref.expert_count.tolist()
    assert al.expert_start.tolist() == ref.expert_start.tolist()
    assert al.block_expert.tolist() == ref.block_expert.tolist()
    got, want = al.sorted_ids.tolist(), ref.sorted_ids.tolist()
    blocks = ref.block_expert.tolist()
    for b0 in range(len(blocks)):
        if blocks[b0] >= 0 and (b0 == 0 or blocks[b0 - 1] != blocks[b0]):
            b1 = b0
            while b1 < len(blocks) and blocks[b1] == blocks[b0]:
                b1 += 1
            seg = slice(b0 * ref.block_m, b1 * ref.block_m)
            assert sorted(got[seg]) == sorted(want[seg]), f"expert {blocks[b0]}"
    assert sorted(got) == sorted(want)
