"""A tensor-parallel rank other than 0: `python -m nibble.engine.worker`, spawned by `WorkerGroup.start`
with a `WorkerSpec` on stdin.

The worker builds the same kernels, model share and ModelRunner as rank 0 does in LLMEngine (in the same
order, since both take part in the same collectives: cache sizing, CUDA graph capture), then runs every
step rank 0 broadcasts until told to stop. It has no scheduler, tokenizer or sampler: its logits are
dropped. It exits when rank 0 closes its stdin (rank 0 died) without waiting in a collective.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import torch
import torch.distributed as dist

from nibble.checkpoint.loader import has_vision_config, load_model
from nibble.engine.kernels import select_engine_kernels
from nibble.engine.model_runner import ModelRunner, num_mtp_layers
from nibble.engine.parallel import (
    StepChannel,
    WorkerSpec,
    init_process_group,
    mark_ready,
    mark_serving,
    rank_device,
    read_spec,
)
from nibble.models.config import ModelConfig
from nibble.models.mrope import MRopeParams

logger = logging.getLogger("nibble.engine")


def run_worker(spec: WorkerSpec) -> None:
    """Build rank `spec.rank` and serve steps until rank 0 shuts the group down."""
    device = rank_device(spec.config, spec.rank)
    config = spec.config.replace(device=str(device))
    if device.type == "cpu":
        # CPU ranks (tests) share the host's cores: do not oversubscribe them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    store = dist.TCPStore("127.0.0.1", spec.store_port, spec.world_size, is_master=False)
    mark_ready(store, spec.rank)
    parallel = init_process_group(config, spec.rank, store)
    model_config = ModelConfig.from_pretrained(spec.model_dir, config.hf_overrides)
    kernels, _ = select_engine_kernels(config, model_config)
    model = load_model(spec.model_dir, model_config, kernels, dtype=config.torch_dtype, device=device,
                       load_format=config.load_format,
                       max_positions=spec.max_model_len + 2 * config.num_speculative_tokens, seed=config.seed,
                       parallel=parallel, num_mtp_layers=num_mtp_layers(config, model_config))
    channel = StepChannel(parallel, device, config.torch_dtype)
    runner = ModelRunner(config, model_config, model, spec.max_model_len, parallel=parallel,
                         recv_tokens=channel.recv_tokens)
    if has_vision_config(spec.model_dir):
        # rank 0 alone runs the vision tower; image steps reach this rank with its rows and 3-D positions
        runner.mrope = MRopeParams.from_model_dir(spec.model_dir, config.hf_overrides)
    mark_serving(store, spec.rank)
    logger.info("rank %d ready on %s", spec.rank, device)
    while (step := channel.recv()) is not None:
        if step.is_speculative:
            runner.follow_spec(step)
        else:
            runner.run(step)
    dist.destroy_process_group()


def _exit_when_parent_dies(fd: int) -> None:
    """Block on the liveness pipe (raw fd reads: no lock that interpreter shutdown would wait for); EOF
    means rank 0 is gone, and then so is this process, even if the main thread is waiting in a
    collective."""
    try:
        while os.read(fd, 4096):
            pass
    finally:
        os._exit(0)


def main() -> int:
    stdin = sys.stdin.fileno()
    spec = read_spec(stdin)
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s %(levelname)s %(name)s [tp rank {spec.rank}]: %(message)s")
    threading.Thread(target=_exit_when_parent_dies, args=(stdin,), daemon=True, name="nibble-parent-watch").start()
    try:
        run_worker(spec)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", spec.rank)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
