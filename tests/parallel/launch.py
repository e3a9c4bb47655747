"""Start the ranks of a tensor-parallel model test as subprocesses (gloo on CPU) and collect rank 0's
results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_ranks(world: int, cases: list[tuple[str, Path, bool]], out: Path, timeout: float = 180.0) -> dict[str, Any]:
    """Run tests.parallel.rank_main on `world` processes; returns {case name: greedy_run result of rank 0}."""
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH"))
                                                       if p)}
    spec = json.dumps([[name, str(path), ep] for name, path, ep in cases])
    procs = [subprocess.Popen([sys.executable, "-m", "tests.parallel.rank_main", str(rank), str(world),
                               str(store.port), str(out), spec], env=env, cwd=REPO_ROOT)
             for rank in range(world)]
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0] * world, f"rank exit codes {codes}"
    return torch.load(out)
