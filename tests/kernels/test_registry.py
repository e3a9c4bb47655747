"""Backend selection: capability checks, self-tests dropping a broken backend with one log line, forced
backends, the report."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from kernel_testing import count_gathers

from nibble.kernels import paged_attention as pa
from nibble.kernels import selftest
from nibble.kernels.kernel_set import OP_NAMES
from nibble.kernels.kv_gather import gather_kv_pages
from nibble.kernels.norm import rms_norm_ref
from nibble.kernels.registry import Backend, KernelSelectionError, always, default_backends, select_kernels
from nibble.models.config import ModelConfig

TINY = {"architectures": ["Qwen3_5MoeForCausalLM"], "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "partial_rotary_factor": 0.25,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return ModelConfig.from_dict(TINY)


def _broken(x, weight, eps, residual=None):
    out, res = rms_norm_ref(x, weight, eps, residual)
    return out * 1.5, res


def _raises(*_args, **_kwargs):
    raise RuntimeError("kernel exploded")


def _table(**extra: tuple[Backend, ...]) -> dict[str, tuple[Backend, ...]]:
    """Torch-only backends (accepted without a test on the CPU) plus the given candidates."""
    table = {op: tuple(b for b in bs if b.name == "torch") for op, bs in default_backends().items()}
    table.update(extra)
    return table


def _triton(op: str) -> Backend:
    return next(b for b in default_backends()[op] if b.name == "triton")


def test_broken_backend_dropped_with_one_log_line(config: ModelConfig, caplog: pytest.LogCaptureFixture) -> None:
    torch_rms = default_backends()["rms_norm"][-1]
    table = _table(rms_norm=(Backend("broken", _broken, always), _triton("rms_norm"), torch_rms),
                   route=(Backend("boom", _raises, always), _triton("route")))
    with caplog.at_level(logging.WARNING, logger="nibble.kernels"):
        kernels, report = select_kernels(config, "cpu", torch.float32, backends=table, allow_interpreter=True)
    assert kernels.backend_names["rms_norm"] == "triton" and kernels.backend_names["route"] == "triton"
    status = {(r.op, r.backend): r for r in report.results}
    assert status[("rms_norm", "broken")].status == "failed"
    assert "relative error" in status[("rms_norm", "broken")].detail
    assert status[("route", "boom")].status == "failed" and "kernel exploded" in status[("route", "boom")].detail
    assert status[("rms_norm", "torch")].status == "skipped"
    lines = [r.getMessage() for r in caplog.records if r.name == "nibble.kernels"]
    assert len(lines) == 2
    assert any("rms_norm" in m and "broken" in m for m in lines)
    assert any("route" in m and "boom" in m and "kernel exploded" in m for m in lines)
    x, w = torch.randn(3, 64), torch.rand(64)
    assert torch.allclose(kernels.rms_norm(x, w, 1e-6)[0], rms_norm_ref(x, w, 1e-6)[0])


def test_forced_broken_backend_raises(config: ModelConfig) -> None:
    table = _table(rms_norm=(Backend("broken", _broken, always), default_backends()["rms_norm"][-1]))
    with pytest.raises(KernelSelectionError, match="broken"):
        select_kernels(config, "cpu", torch.float32, forced={"rms_norm": "broken"}, backends=table)


def test_unsupported_reason_and_forced_unsupported(config: ModelConfig) -> None:
    kernels, report = select_kernels(config, "cpu", torch.float32)
    assert set(kernels.backend_names.values()) == {"torch"}
    triton_rows = [r for r in report.results if r.backend == "triton"]
    assert triton_rows and all(r.status == "unsupported" and "interpreter" in r.detail for r in triton_rows)
    with pytest.raises(KernelSelectionError, match="unsupported"):
        select_kernels(config, "cpu", torch.float32, forced={"attention": "triton"})
    _, report = select_kernels(config, "cpu", torch.bfloat16, allow_interpreter=True, self_test=False)
    assert any("fp32 only" in r.detail for r in report.results if r.backend == "triton")


def test_forced_group_and_unknown_names(config: ModelConfig) -> None:
    kernels, _ = select_kernels(config, "cpu", torch.float32, forced={"moe": "torch", "linear": "torch"})
    assert kernels.backend_names["route"] == kernels.backend_names["fused_moe"] == "torch"
    with pytest.raises(KernelSelectionError, match="unknown op"):
        select_kernels(config, "cpu", torch.float32, forced={"mlp": "torch"})
    with pytest.raises(KernelSelectionError, match="no backend 'cutlass'"):
        select_kernels(config, "cpu", torch.float32, forced={"moe": "cutlass"})


def test_forced_group_backend_some_ops_lack(config: ModelConfig) -> None:
    """`--moe-backend triton-generic`: fused_moe has that backend, route does not and keeps its own choice."""
    _, report = select_kernels(config, "cpu", torch.float32, forced={"moe": "triton-generic", "linear": "torch"},
                               self_test=False, allow_interpreter=True)
    assert report.selected["fused_moe"] == "triton-generic"
    assert report.selected["route"] in ("triton", "torch")
    with pytest.raises(KernelSelectionError, match="no backend 'triton-generic'"):
        select_kernels(config, "cpu", torch.float32, forced={"route": "triton-generic"})


def test_report_renders(config: ModelConfig) -> None:
    table = _table(rope=(_triton("rope"), default_backends()["rope"][-1]))
    _, report = select_kernels(config, "cpu", torch.float32, backends=table, allow_interpreter=True)
    text = report.table()
    assert "rope" in text and "*triton" in text
    data = json.loads(report.to_json())
    assert data["selected"]["rope"] == "triton" and set(data["selected"]) == set(OP_NAMES)
    ok = next(r for r in data["results"] if r["op"] == "rope" and r["backend"] == "triton")
    assert ok["status"] == "ok" and ok["rel_error"] is not None and ok["seconds"] > 0


def test_moe_self_test_runs_one_ranks_share(config: ModelConfig) -> None:
    """Under tensor parallelism a rank's experts hold I / tp features (its tiles are chosen by that I), under
    expert parallelism num_experts / tp whole experts, with the slots of other ranks' experts as id -1: the
    start-up self-test runs that share, not the whole layer."""
    from nibble.kernels.moe import fused_moe_ref

    seen: list[tuple[int, int, bool]] = []

    def spy(x, w, ids, experts):
        seen.append((experts.num_experts, experts.intermediate_size, bool((ids < 0).any())))
        return fused_moe_ref(x, w, ids, experts)

    table = _table(fused_moe=(Backend("spy", spy, always),))
    for tp, ep, want in ((1, False, (8, 32)), (2, False, (8, 16)), (2, True, (4, 32)), (4, True, (2, 32))):
        seen.clear()
        _, report = select_kernels(config, "cpu", torch.float32, backends=table, allow_interpreter=True,
                                   tp_size=tp, expert_parallel=ep)
        assert report.selected["fused_moe"] == "spy" and seen
        assert {(e, i) for e, i, _ in seen} == {want}
        assert any(neg for *_, neg in seen) == ep


def test_every_op_selects_triton_under_the_interpreter() -> None:
    """The real self-tests (selftest.py) on a tiny NVFP4 config: each Triton backend passes."""
    from nibble.models.quant_config import QuantConfig

    cfg = ModelConfig.from_dict(TINY, quant=QuantConfig("NVFP4", 16, ("*self_attn*",)))
    kernels, report = select_kernels(cfg, "cpu", torch.float32, allow_interpreter=True)
    expected = {op: "triton" for op in OP_NAMES}
    assert kernels.backend_names == expected, report.table()
    assert all(r.rel_error is not None and r.rel_error < 1e-4 for r in report.results if r.status == "ok")


def test_self_test_goes_through_the_fp8_gather(config: ModelConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a GPU's table turns `fp8_gather` on (past `fp8_gather_min_seq_len` tokens), the start-up self-test of
    `paged_attention` with an FP8 cache runs a prefill that long, so a gather that writes garbage fails it."""
    real_lookup = pa.lookup

    def gather_on(op: str, device: torch.device | str, key: dict) -> dict:
        return {**real_lookup(op, device, key), "fp8_gather": True, "fp8_gather_min_seq_len": 600}

    monkeypatch.setattr(pa, "lookup", gather_on)
    ctx = selftest.SelfTestContext(config, torch.device("cpu"), torch.float32, torch.float8_e4m3fn, 16,
                                   torch.Generator().manual_seed(0))
    assert [max(a + b for a, b in zip(*c)) for c in selftest._fp8_gather_cases(ctx)] == [600]
    calls = count_gathers(monkeypatch)
    assert selftest.test_paged_attention(pa.paged_attention, ctx) < 1e-5
    assert calls == [1]

    def zeroed(*a, **k):
        k_s, v_s, table = gather_kv_pages(*a, **k)
        return k_s.zero_(), v_s, table

    monkeypatch.setattr(pa, "gather_kv_pages", zeroed)
    with pytest.raises(selftest.SelfTestFailure):
        selftest.test_paged_attention(pa.paged_attention, ctx)
