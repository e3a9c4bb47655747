"""Tensor-parallel ranks agree on their CUDA graph sets (`parallel.rank_failures`, `cuda_graphs.capture_set`):
over 2 gloo ranks, a failure on one rank (before a set, or at one of its sizes) makes every rank drop that set,
each logging which rank failed and why, and the ranks' later collectives still match; at size 1 nothing
communicates and the first failure drops the set, as before."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nibble.engine import cuda_graphs
from nibble.engine.config import EngineConfig
from nibble.engine.cuda_graphs import capture_set
from nibble.engine.parallel import init_process_group, rank_failures
from nibble.layers.parallel import SINGLE, ParallelContext
from tests.parallel.launch import REPO_ROOT

WORLD = 2
KEYS = [8, 4, 2, 1]


class _FakeGraphs:
    """A graph set whose capture of size k runs an all-reduce of k elements (as a size's eager run runs the
    model's collectives), then fails on this rank if k is fail_at (as a capture does after a good eager run)."""

    device = torch.device("cpu")

    def __init__(self, parallel: ParallelContext, fail_at: int | None = None) -> None:
        self.parallel = parallel
        self.fail_at = fail_at
        self.captured: list[int] = []

    def capture_keys(self) -> list[int]:
        return KEYS

    def capture_one(self, key: int) -> None:
        x = self.parallel.all_reduce(torch.ones(key))
        # another rank at another size would have reduced a tensor of another shape
        assert torch.equal(x, torch.full((key,), float(self.parallel.tp_size)))
        if key == self.fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory (fake)")
        self.captured.append(key)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _capture(parallel: ParallelContext, fail_at: int | None, log: _Records) -> dict[str, Any]:
    log.messages.clear()
    graphs = _FakeGraphs(parallel, fail_at)
    kept = capture_set(graphs, "fake steps", parallel)
    return {"kept": kept, "captured": graphs.captured, "log": list(log.messages)}


def rank_main(rank: int, port: int, out: str) -> None:
    """One rank: the agreements and captures the test checks, results to OUT/rank{rank}.json."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD + 1, is_master=False)
    parallel = init_process_group(EngineConfig(model="demo", device="cpu", tensor_parallel_size=WORLD), rank,
                                  store)
    log = _Records()
    logging.getLogger("nibble.engine").addHandler(log)
    results: dict[str, Any] = {
        "none": rank_failures(parallel, None),
        "rank1": rank_failures(parallel, "out of memory" if rank == 1 else None),
        "all": rank_failures(parallel, f"error on {rank}"),
        "capture_ok": _capture(parallel, None, log),
        "capture_rank1_fails": _capture(parallel, 4 if rank == 1 else None, log),
        # the ranks are still in step: the next set's collectives match
        "capture_after": _capture(parallel, None, log),
    }
    shortfall = "0.50 GiB free, the graphs' outputs alone take 2.00 GiB" if rank == 1 else None
    cuda_graphs._memory_shortfall = lambda device, need: shortfall  # type: ignore[assignment]
    results["capture_short_of_memory"] = _capture(parallel, None, log)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("capture_agreement")
    store = dist.TCPStore("127.0.0.1", 0, WORLD + 1, is_master=True, wait_for_workers=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH"))
                                                       if p)}
    code = "import sys; from tests.parallel.test_capture_agreement import rank_main; " \
           "rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(rank), str(store.port), str(out)], env=env,
                              cwd=REPO_ROOT) for rank in range(WORLD)]
    try:
        # a rank left waiting in a collective shows as a timeout here
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0] * WORLD, f"rank exit codes {codes}"
    return [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def test_every_rank_learns_which_ranks_failed(ranks: list[dict[str, Any]]) -> None:
    for got in ranks:
        assert got["none"] == {}
        assert got["rank1"] == {"1": "out of memory"}
        assert got["all"] == {"0": "error on 0", "1": "error on 1"}


def test_all_ranks_keep_a_set_captured_everywhere(ranks: list[dict[str, Any]]) -> None:
    for got in ranks:
        for case in ("capture_ok", "capture_after"):
            assert got[case] == {"kept": True, "captured": KEYS, "log": []}


def test_a_size_failing_on_one_rank_drops_the_set_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = (r["capture_rank1_fails"] for r in ranks)
    assert not rank0["kept"] and not rank1["kept"]
    # both stopped at the failing size: rank 0 captured it, rank 1 did not
    assert rank0["captured"] == [8, 4] and rank1["captured"] == [8]
    dropped = "CUDA graph capture of fake steps failed at size 4 on rank 1 (OutOfMemoryError: CUDA out of memory " \
              "(fake)); every rank runs them eagerly"
    assert rank0["log"] == [dropped]
    # the failing rank also logs its exception (with its traceback)
    assert rank1["log"] == ["CUDA graph capture of fake steps failed at size 4 on this rank", dropped]


def test_a_rank_short_of_memory_drops_the_set_before_any_capture(ranks: list[dict[str, Any]]) -> None:
    for got in ranks:
        assert got["capture_short_of_memory"] == {"kept": False, "captured": [], "log": [
            "CUDA graph capture of fake steps failed before the first size on rank 1 (0.50 GiB free, the graphs' "
            "outputs alone take 2.00 GiB); every rank runs them eagerly"]}


def test_single_rank_agrees_alone(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """At tensor-parallel size 1 no collective runs (no memory check either); the first failing size drops the
    set with one log line."""

    def forbidden(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("torch.distributed called at tensor-parallel size 1")

    for fn in ("all_reduce", "all_gather_object", "broadcast"):
        monkeypatch.setattr(dist, fn, forbidden)
    monkeypatch.setattr(cuda_graphs, "_memory_shortfall", forbidden)
    assert rank_failures(SINGLE, None) == {}
    assert rank_failures(SINGLE, "boom") == {0: "boom"}
    graphs = _FakeGraphs(SINGLE)
    assert capture_set(graphs, "fake steps", min_free_bytes=2**40) and graphs.captured == KEYS
    graphs = _FakeGraphs(SINGLE, fail_at=2)
    with caplog.at_level(logging.WARNING, logger="nibble.engine"):
        assert not capture_set(graphs, "fake steps")
    assert graphs.captured == [8, 4]
    # an earlier test (a CLI run) may have left the root logger at INFO: only this set's warnings count
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        "CUDA graph capture of fake steps failed at size 2 (OutOfMemoryError: CUDA out of memory (fake)); they run "
        "eagerly"]
