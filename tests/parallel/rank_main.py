"""One rank of a tensor-parallel model test: `python -m tests.parallel.rank_main RANK WORLD PORT OUT CASES`.

CASES is a JSON list of [name, checkpoint dir, expert_parallel]; every rank loads its share of each model in
turn (one process group for all of them) and runs `scenario.greedy_run`; rank 0 saves the results to OUT.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
import torch.distributed as dist

from nibble.checkpoint.loader import load_model
from nibble.engine.config import EngineConfig
from nibble.engine.parallel import init_process_group
from nibble.kernels.kernel_set import KernelSet
from nibble.models.config import ModelConfig
from tests.parallel.scenario import greedy_run


def main(rank: int, world: int, port: int, out: str, cases: list[list[object]]) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False)
    config = EngineConfig(model=str(cases[0][1]), device="cpu", tensor_parallel_size=world)
    base = init_process_group(config, rank, store)
    results = {}
    for name, model_dir, expert_parallel in cases:
        parallel = dataclasses.replace(base, expert_parallel=bool(expert_parallel))
        model_config = ModelConfig.from_pretrained(str(model_dir))
        model = load_model(str(model_dir), model_config, KernelSet.reference(), dtype=torch.float32, device="cpu",
                           parallel=parallel)
        results[str(name)] = greedy_run(model, model_config)
    if rank == 0:
        torch.save(results, out)
    # both ranks leave together: tearing gloo down while the peer still talks to it aborted a rank now and then
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5]))
