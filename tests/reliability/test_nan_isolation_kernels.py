"""NaN in one row or sequence must not leak into the others through the Triton kernels that mix rows of a
batch (token grouping in the MoE, paged KV blocks, GDN state slots), and stale NaN left in free cache
memory must never be read. Runs the Triton backends under the interpreter (fp32) on a CPU, or on the GPU
with NIBBLE_TEST_GPU=1. Each poisoned run is compared with a clean run of the same shapes: the other rows
must be finite and bitwise equal."""

from __future__ import annotations

import os

import pytest
import torch

from nibble.formats.nvfp4 import NVFP4Tensor
from nibble.kernels._triton import HAVE_TRITON, interpreting
from nibble.kernels.moe import MoEWeights, topk_counters
from nibble.kernels.registry import default_backends

GPU = os.environ.get("NIBBLE_TEST_GPU") == "1" and torch.cuda.is_available()
pytestmark = [pytest.mark.skipif(not HAVE_TRITON or not (GPU or interpreting()),
                                 reason="needs Triton on a GPU or under TRITON_INTERPRET=1"),
              # the interpreter (numpy) warns about the NaN it is fed on purpose
              pytest.mark.filterwarnings("ignore::RuntimeWarning")]
DEV = torch.device("cuda" if GPU else "cpu")
NAN = float("nan")


def triton(op: str):
    return next(b for b in default_backends()[op] if b.name == "triton").load()


def gen() -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(1234)


def randn(*shape: int, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * scale).to(DEV)


def assert_isolated(clean: torch.Tensor, poisoned: torch.Tensor, keep: list[int]) -> None:
    assert torch.isfinite(poisoned[keep]).all(), "NaN leaked into other rows"
    assert torch.equal(clean[keep], poisoned[keep]), "other rows changed"


def nvfp4(e: int, n: int, k: int, g: torch.Generator) -> NVFP4Tensor:
    packed = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
    scale = (torch.rand(e, n, k // 16, generator=g) + 0.1).to(torch.float8_e4m3fn)
    return NVFP4Tensor(packed.to(DEV), scale.to(DEV), (torch.rand(e, n, generator=g) * 0.05 + 0.01).to(DEV))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_moe_row_isolation(bad: float) -> None:
    g = gen()
    e, h, inter, k, t = 8, 64, 32, 2, 7
    experts = MoEWeights(nvfp4(e, 2 * inter, h, g), nvfp4(e, h, inter, g), topk_counters(h, DEV))
    router_w, x = randn(e, h, g=g, scale=0.3), randn(t, h, g=g)
    route, moe = triton("route"), triton("fused_moe")

    def run(x: torch.Tensor) -> torch.Tensor:
        w, ids = route(x @ router_w.T, k, True)
        assert int(ids.min()) >= 0 and int(ids.max()) < e, f"expert ids out of range: {ids.tolist()}"
        return moe(x, w, ids, experts)

    poisoned = x.clone()
    poisoned[3, 5] = bad
    assert_isolated(run(x), run(poisoned), [0, 1, 2, 4, 5, 6])


def test_linear_and_norm_row_isolation() -> None:
    g = gen()
    x, w = randn(5, 64, g=g), nvfp4(1, 48, 64, g)
    lin = NVFP4Tensor(w.packed[0], w.block_scale[0], w.global_scale[0])
    poisoned = x.clone()
    poisoned[1] = NAN
    assert_isolated(triton("nvfp4_linear")(x, lin), triton("nvfp4_linear")(poisoned, lin), [0, 2, 3, 4])
    norm_w = torch.ones(64, device=DEV)
    out, _ = triton("rms_norm")(x, norm_w, 1e-6)
    out_p, _ = triton("rms_norm")(poisoned, norm_w, 1e-6)
    assert_isolated(out, out_p, [0, 2, 3, 4])


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [4, 9, 1]])
def test_paged_attention_isolation_and_stale_blocks(q_lens: list[int]) -> None:
    """Sequence 1 writes NaN K/V; every free block and the unused tail of every block start as NaN."""
    g = gen()
    heads, kv_heads, dim, bs = 4, 2, 32, 16
    ctx = [5, 20, 30]
    lens = [c + q for c, q in zip(ctx, q_lens)]
    tables = [[2, 7], [4, 9], [1, 3, 11]]
    block_table = torch.tensor([tb + [0] * (3 - len(tb)) for tb in tables], dtype=torch.int32, device=DEV)
    slots = torch.tensor([tables[s][p // bs] * bs + p % bs for s, n in enumerate(lens) for p in range(n)],
                         device=DEV)
    owner = [s for s, n in enumerate(lens) for _ in range(n)]
    k, v = randn(len(owner), kv_heads, dim, g=g), randn(len(owner), kv_heads, dim, g=g)
    q = randn(sum(q_lens), heads, dim, g=g)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    store, attend = triton("store_kv"), triton("paged_attention")

    def run(stale: float, poison_seq1: bool) -> torch.Tensor:
        kc = torch.full((12, bs, kv_heads, dim), stale, device=DEV)
        vc = torch.full_like(kc, stale)
        kk, vv = k.clone(), v.clone()
        if poison_seq1:
            rows = [i for i, s in enumerate(owner) if s == 1]
            kk[rows[-1]] = NAN
            vv[rows[-1]] = NAN
        store(kk, vv, kc, vc, slots, 1.0, 1.0)
        return attend(q, kc, vc, cu, seq_lens, block_table, dim ** -0.5, 1.0, 1.0, max(q_lens), max(lens))

    keep = [i for i, s in enumerate(t for t, n in enumerate(q_lens) for _ in range(n)) if s != 1]
    assert_isolated(run(0.0, False), run(NAN, True), keep)


def test_gdn_state_slot_isolation() -> None:
    """Sequence 1's conv and recurrent states hold NaN, and so do the slots nobody uses."""
    g = gen()
    q_lens, slots_used = [1, 6, 3], [4, 2, 6]
    t, hk, hv, dk, dv, ch, width = sum(q_lens), 2, 4, 16, 16, 24, 4
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    slots = torch.tensor(slots_used, dtype=torch.int32, device=DEV)
    x, conv_w = randn(t, ch, g=g), randn(ch, width, g=g, scale=0.5)
    q, k, v = randn(t, hk, dk, g=g), randn(t, hk, dk, g=g), randn(t, hv, dv, g=g)
    gate = -0.5 * torch.rand(t, hv, generator=g).to(DEV)
    beta = torch.rand(t, hv, generator=g).to(DEV)
    conv_state0, ssm0 = randn(8, width - 1, ch, g=g), randn(8, hv, dk, dv, g=g, scale=0.1)
    unused = [0, 1, 3, 5, 7]
    conv, gdn = triton("causal_conv1d"), triton("gated_delta_rule")

    def run(poison: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        cs, ss = conv_state0.clone(), ssm0.clone()
        if poison:
            cs[[2, *unused]] = NAN
            ss[[2, *unused]] = NAN
        return conv(x, conv_w, cs, cu, slots), gdn(q, k, v, gate, beta, ss, cu, slots), cs, ss

    clean, poisoned = run(False), run(True)
    keep_tokens = [i for i in range(t) if not q_lens[0] <= i < q_lens[0] + q_lens[1]]
    assert_isolated(clean[0], poisoned[0], keep_tokens)
    assert_isolated(clean[1], poisoned[1], keep_tokens)
    assert_isolated(clean[2], poisoned[2], [4, 6])
    assert_isolated(clean[3], poisoned[3], [4, 6])
