"""The dense decode GEMV (`dense_gemv.py`) on a CUDA GPU, bf16 and fp16, on the real 16-bit projection shapes
of Qwen3.5-122B-A10B and 397B-A17B against an fp32 GEMM, every tile configuration the benchmark sweeps,
poisoned outputs, strided activations, and CUDA-graph replay; both kernels ("gemv", "dot"). Run with NIBBLE_TEST_GPU=1.

    NIBBLE_TEST_GPU=1 python -m pytest tests/gpu/test_dense_gemv_gpu.py -q
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get("NIBBLE_TEST_GPU") != "1" or not torch.cuda.is_available(),
    reason="GPU kernel tests need NIBBLE_TEST_GPU=1 and a CUDA device")

from nibble.bench.gpu_timing import capture_graph  # noqa: E402
from nibble.kernels.dense_gemv import GEMV_MAX_TOKENS, MAX_TOKENS, dense_linear, dense_linear_launch  # noqa: E402
from nibble.kernels.selftest import dense_linear_shapes  # noqa: E402
from nibble.kernels.selftest_harness import poison  # noqa: E402
from nibble.models.config import ModelConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from dense_gemv_bench import DOT, GEMV, MODELS  # noqa: E402

DEV = torch.device("cuda")
TOL = 1e-2


def shapes(name: str) -> list[tuple[int, int]]:
    return dense_linear_shapes(ModelConfig.from_pretrained(ROOT / "benchmarks" / "models" / MODELS[name]))


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return float((out.float() - ref).norm() / ref.norm())


def cfg(bn: int, bk: int, w: int, st: int, path: str = "gemv") -> dict:
    return {"path": path, "block_n": bn, "block_k": bk, "warps": w, "stages": st}


@pytest.mark.parametrize("name", ["122B", "397B"])
def test_dense_gemv_real_shapes(name: str) -> None:
    gen = torch.Generator(DEV).manual_seed(0)
    for n, k in shapes(name):
        w = torch.randn(n, k, device=DEV, generator=gen).mul_(k ** -0.5).to(torch.bfloat16)
        for t in range(1, MAX_TOKENS + 1):
            x = torch.randn(t, k, device=DEV, generator=gen).to(torch.bfloat16)
            ref = x.float() @ w.float().T
            for c in GEMV[:: 3 if t > 1 else 1] if t <= GEMV_MAX_TOKENS else ():
                if (1 << (t - 1).bit_length()) * c[0] * c[1] // (32 * c[2]) > 128:
                    continue
                poison(DEV, ((t, n), torch.bfloat16))
                assert rel(dense_linear_launch(x, w, config=cfg(*c)), ref) < TOL, (n, k, t, c)
            for c in DOT[:: 1 if t in (4, 16) else 3]:
                poison(DEV, ((t, n), torch.bfloat16))
                assert rel(dense_linear_launch(x, w, config=cfg(*c, "dot")), ref) < TOL, (n, k, t, c, "dot")
            assert rel(dense_linear(x, w), ref) < TOL, (n, k, t, "table")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_gemv_odd_shapes_and_strides(dtype: torch.dtype) -> None:
    gen = torch.Generator(DEV).manual_seed(1)
    for t, n, k in ((1, 37, 100), (3, 2305, 3072), (7, 130, 1040), (8, 3072, 1000), (13, 2305, 1000)):
        wide = torch.randn(t, k + 24, device=DEV, generator=gen).to(dtype)
        x = wide[:, 8:8 + k]
        w = torch.randn(n, k, device=DEV, generator=gen).mul_(k ** -0.5).to(dtype)
        ref = x.float() @ w.float().T
        for c in ((8, 256, 4, 4, "gemv"), (4, 512, 2, 4, "gemv"), (16, 128, 4, 3, "gemv"), (16, 256, 1, 6, "dot"),
                  (64, 256, 4, 4, "dot")):
            if c[-1] == "gemv" and t > GEMV_MAX_TOKENS:
                continue
            poison(DEV, ((t, n), dtype))
            assert rel(dense_linear_launch(x, w, config=cfg(*c)), ref) < TOL, (t, n, k, c)


def test_dense_gemv_graph_replay() -> None:
    gen = torch.Generator(DEV).manual_seed(2)
    w = torch.randn(3072, 8192, device=DEV, generator=gen).to(torch.bfloat16)
    x = torch.randn(2, 8192, device=DEV, generator=gen).to(torch.bfloat16)
    out = {}

    def step() -> None:
        out["y"] = dense_linear_launch(x, w, config=cfg(8, 512, 4, 4))

    eager = dense_linear_launch(x, w, config=cfg(8, 512, 4, 4)).clone()
    g = capture_graph(step)
    x.copy_(torch.randn(2, 8192, device=DEV, generator=gen).to(torch.bfloat16))
    g.replay()
    torch.cuda.synchronize()
    assert not torch.equal(out["y"], eager)
    assert torch.equal(out["y"], dense_linear_launch(x, w, config=cfg(8, 512, 4, 4)))


@pytest.mark.parametrize("c", [(4, 512, 2, 4, "gemv"), (8, 256, 4, 4, "gemv"), (16, 512, 1, 3, "dot"),
                               (64, 128, 4, 3, "dot")])
def test_dense_gemv_pdl_after_norm(c: tuple) -> None:
    """Launched with PDL right behind the RMSNorm that writes its input (which lets it start early), with and
    without the L2 prefetch, eagerly and from a CUDA graph: bitwise what the plain launch gives."""
    from nibble.kernels.norm import rms_norm
    from nibble.kernels.pdl import pdl_supported

    if not pdl_supported(DEV):
        pytest.skip("PDL needs sm_90+ and a Triton with launch_pdl")
    gen = torch.Generator(DEV).manual_seed(3)
    t, n, k = (1 if c[-1] == "gemv" else 9), 3072, 8192
    w = torch.randn(n, k, device=DEV, generator=gen).mul_(k ** -0.5).to(torch.bfloat16)
    nw = torch.randn(k, device=DEV, generator=gen).to(torch.bfloat16)
    x = torch.randn(t, k, device=DEV, generator=gen).to(torch.bfloat16)
    plain = dense_linear_launch(rms_norm(x, nw, 1e-6)[0], w, config={**cfg(*c), "pdl": False})
    for extra in ({"pdl": True}, {"pdl": True, "prefetch_mib": 0}, {"pdl": True, "prefetch_mib": 64}):
        out = {}

        def step(out: dict = out, extra: dict = extra) -> None:
            out["y"] = dense_linear_launch(rms_norm(x, nw, 1e-6)[0], w, config={**cfg(*c), **extra})

        step()
        torch.cuda.synchronize()
        assert torch.equal(out["y"], plain), extra
        g = capture_graph(step)
        out["y"].fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out["y"], plain), (extra, "graph")
