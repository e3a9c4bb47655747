"""Paged attention for the verify step of speculative decoding (a few query tokens per sequence over a long
cached context, split-KV) on a CUDA GPU, bf16 on Qwen3.5-122B-A10B's attention shapes (32 query heads,
2 KV heads, head dim 256, 16-token blocks), against `paged_attention_ref` in fp32 on the same GPU; also
captured in a CUDA graph with max_seq_len at the model's longest context, as the engine's step graphs are.
Run with NIBBLE_TEST_GPU=1 (skipped otherwise).

    NIBBLE_TEST_GPU=1 python -m pytest tests/gpu/test_attention_verify_gpu.py -q
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get("NIBBLE_TEST_GPU") != "1" or not torch.cuda.is_available(),
    reason="GPU kernel tests need NIBBLE_TEST_GPU=1 and a CUDA device")

from nibble.bench.gpu_timing import capture_graph  # noqa: E402
from nibble.kernels import paged_attention as pa  # noqa: E402
from nibble.kernels.attention import paged_attention_ref  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
HQ, HK, D, PAGE = 32, 2, 256, 16
MAX_LEN = 32768
TOL = 2e-2


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    o, r = out.float(), ref.float()
    assert torch.isfinite(o).all(), "non-finite output"
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


def cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)


class Step:
    """A verify step's inputs: shuffled blocks with room for MAX_LEN tokens per sequence, NaN in every block
    no sequence owns (and in the slots past each sequence's end), the table's unused entries on such a
    block."""

    def __init__(self, batch: int, kv_dtype: torch.dtype = BF16) -> None:
        self.batch = batch
        self.nb = MAX_LEN // PAGE
        total = batch * self.nb + 1
        fp8 = kv_dtype == torch.float8_e4m3fn
        self.ks, self.vs = (0.02, 0.015) if fp8 else (1.0, 1.0)
        self.kc = torch.empty(total, PAGE, HK, D, device=DEV, dtype=kv_dtype)
        self.vc = torch.empty_like(self.kc)
        self.perm = torch.randperm(total - 1, device=DEV).to(torch.int32).view(batch, self.nb)
        self.spare = total - 1
        self.table = torch.empty(batch, self.nb, dtype=torch.int32, device=DEV)
        self.q = self.seq_lens = self.cu = None

    def fill(self, ctx: list[int], qlen: list[int]) -> tuple:
        """Fresh K/V/q for contexts `ctx` (cached tokens) and `qlen` query tokens per sequence, written in
        place where the shapes allow (a captured graph reads these buffers): the arguments of
        `paged_attention` after q, with max_seq_len left for the caller."""
        self.kc.view(torch.uint8).fill_(0xFF)
        self.vc.view(torch.uint8).fill_(0xFF)
        self.table.fill_(self.spare)
        lens = [a + b for a, b in zip(ctx, qlen)]
        for s, n in enumerate(lens):
            blocks = self.perm[s, :-(-n // PAGE)].long()
            self.table[s, :blocks.numel()] = self.perm[s, :blocks.numel()]
            k = torch.randn(blocks.numel() * PAGE, HK, D, device=DEV) / self.ks
            v = torch.randn(blocks.numel() * PAGE, HK, D, device=DEV) / self.vs
            k[n:], v[n:] = float("nan"), float("nan")
            self.kc[blocks] = k.view(-1, PAGE, HK, D).to(self.kc.dtype)
            self.vc[blocks] = v.view(-1, PAGE, HK, D).to(self.vc.dtype)
        q = torch.randn(sum(qlen), HQ, D, device=DEV, dtype=BF16)
        if self.q is not None and self.q.shape == q.shape:
            self.q.copy_(q)
            self.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
            self.cu.copy_(cu(qlen))
        else:
            self.q, self.seq_lens, self.cu = q, torch.tensor(lens, dtype=torch.int32, device=DEV), cu(qlen)
        return self.cu, self.seq_lens, self.table, D ** -0.5, self.ks, self.vs, max(qlen)

    def ref(self, args: tuple) -> torch.Tensor:
        kf = self.kc.float() if self.kc.dtype == BF16 else self.kc
        vf = self.vc.float() if self.vc.dtype == BF16 else self.vc
        return paged_attention_ref(self.q.float(), kf, vf, *args)


@pytest.mark.parametrize("ctx", [1024, 16384])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("n", [3, 4])
def test_verify(n: int, batch: int, ctx: int) -> None:
    step = Step(batch)
    # contexts around ctx, so that the sequences' chunks differ
    args = step.fill([ctx - 37 * s for s in range(batch)], [n] * batch)
    ref = step.ref(args)
    out = pa.paged_attention(step.q, step.kc, step.vc, *args, ctx + n)
    assert rel(out, ref) < TOL
    # the engine's step graphs pass the model's longest context, whatever the batch's
    out = pa.paged_attention(step.q, step.kc, step.vc, *args, MAX_LEN)
    assert rel(out, ref) < TOL


@pytest.mark.parametrize("kv_dtype", [BF16, torch.float8_e4m3fn])
def test_verify_mixed_query_lengths(kv_dtype: torch.dtype) -> None:
    """Sequences with 1..5 query tokens in one step, BF16 and FP8 caches."""
    step = Step(6, kv_dtype)
    args = step.fill([16000, 5, 1024, 0, 3000, 9000], [3, 5, 1, 4, 2, 3])
    out = pa.paged_attention(step.q, step.kc, step.vc, *args, MAX_LEN)
    assert rel(out, step.ref(args)) < TOL


@pytest.mark.parametrize("batch", [1, 8])
def test_verify_cuda_graph(batch: int) -> None:
    """A warmed-up call makes no host sync; captured once with max_seq_len = 32768, then replayed after the
    contexts, the queries and the cache changed in place, each replay matches the reference."""
    n = 3
    step = Step(batch)
    args = step.fill([1024] * batch, [n] * batch)
    call = lambda: pa.paged_attention(step.q, step.kc, step.vc, *args, MAX_LEN)  # noqa: E731
    call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    outs: list[torch.Tensor] = []
    graph = capture_graph(lambda: outs.append(call()))
    out = outs[-1]  # the captured call's output buffer, rewritten by each replay
    for ctx in ([16384 - 100 * s for s in range(batch)], [MAX_LEN - n] * batch, [7 + s for s in range(batch)]):
        new = step.fill(ctx, [n] * batch)
        graph.replay()
        torch.cuda.synchronize()
        assert rel(out, step.ref(new)) < TOL, ctx
