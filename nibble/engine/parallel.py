"""Tensor-parallel processes: one per GPU (rank r uses cuda:(base + r), base being rank 0's device index),
or per CPU "device" (gloo) for tests.

Rank 0 is the engine process. `WorkerGroup.start` hosts the rendezvous store, spawns ranks 1..N-1 as
`python -m nibble.engine.worker` subprocesses (spec pickled over their stdin, which then stays open as
a liveness pipe: a worker exits when it reads EOF, i.e. when rank 0 is gone), joins the process group and
returns; each step rank 0 broadcasts the step's `StepInputs` over a gloo group (`StepChannel`), every rank
runs the forward, and rank 0 alone samples. Under speculative decoding the MTP head's passes follow the
sampling, so rank 0 then sends what it sampled (`StepChannel.send_tokens`) and every rank drafts.
`shutdown` (also run at interpreter exit) tells the workers to leave their step loop and reaps them;
workers that never reached the loop (rank 0 failed while loading) are killed instead. A monitor thread
notices a worker that dies: it stops the others and aborts the process group, so rank 0 fails its step
instead of waiting in a collective forever. A step that fails on rank 0 itself ends the group the same way
(`WorkerGroup.fail`, called by the engine): the workers may be inside a collective rank 0 never reaches.

NVLink multicast (NVLS) is off in every rank's environment: the GPU hosts this runs on forbid it.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

from nibble.engine.config import EngineConfig, EngineConfigError
from nibble.engine.step_inputs import StepInputs
from nibble.layers.parallel import ParallelContext

logger = logging.getLogger("nibble.engine")

PARALLEL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
PG_TIMEOUT = datetime.timedelta(minutes=30)
STARTUP_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = 30.0
_MSG_STEP, _MSG_SHUTDOWN, _MSG_TOKENS = 1, 2, 3
_READY_KEY = "nibble/worker_ready/"
_SERVING_KEY = "nibble/worker_serving/"


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed to start or died."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs to build its rank: sent pickled over its stdin."""

    config: EngineConfig
    model_dir: str
    max_model_len: int
    rank: int
    world_size: int
    store_port: int
    log_level: int = logging.INFO


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The device of tensor-parallel rank `rank`: cuda:(base + rank), base = index of rank 0's device."""
    device = config.torch_device
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def init_process_group(config: EngineConfig, rank: int, store: dist.Store) -> ParallelContext:
    """Join the tensor-parallel group (every rank calls this once) and return this rank's context."""
    world = config.tensor_parallel_size
    device = rank_device(config, rank)
    for key, value in PARALLEL_ENV.items():
        os.environ.setdefault(key, value)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world, timeout=PG_TIMEOUT,
                                device_id=device)
        cpu_group = dist.new_group(backend="gloo", timeout=PG_TIMEOUT)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=PG_TIMEOUT)
        cpu_group = dist.group.WORLD
    return ParallelContext(tp_rank=rank, tp_size=world, expert_parallel=config.enable_expert_parallel,
                           group=dist.group.WORLD, cpu_group=cpu_group)


def rank_failures(parallel: ParallelContext, error: str | None) -> dict[int, str]:
    """Which ranks failed at a point every rank reaches, agreed on by all: {rank: why} for each rank whose
    `error` is not None, {} when none is, the same on every rank. One host all-reduce (MIN of an ok flag, over
    the gloo group); the reasons are gathered only when some rank failed. No collective at tensor-parallel
    size 1."""
    if not parallel.is_parallel:
        return {} if error is None else {parallel.tp_rank: error}
    if parallel.host_min(int(error is None)) == 1:
        return {}
    errors: list[str | None] = [None] * parallel.tp_size
    dist.all_gather_object(errors, error, group=parallel.cpu_group)
    return {rank: e for rank, e in enumerate(errors) if e is not None}


class StepChannel:
    """Rank 0 -> every rank: one message per engine step (header int64 [kind, length], then the packed
    `StepInputs`) over the gloo group; a step with image prompt chunks then sends its vision rows (rank 0
    alone runs the vision tower) over the model's group, device to device.

    device / dtype: where a receiving rank puts those rows (its model's device and dtype)."""

    def __init__(self, parallel: ParallelContext, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.group = parallel.cpu_group
        self.device_group = parallel.group
        self.device = device
        self.dtype = dtype
        self._header = torch.zeros(2, dtype=torch.int64)

    def send(self, step: StepInputs) -> None:
        payload = step.pack()
        self._header[0], self._header[1] = _MSG_STEP, payload.numel()
        dist.broadcast(self._header, src=0, group=self.group)
        dist.broadcast(payload, src=0, group=self.group)
        if step.mm is not None and step.mm.token_index.numel():
            dist.broadcast(step.mm.embeds.contiguous(), src=0, group=self.device_group)

    def send_shutdown(self) -> None:
        self._header[0], self._header[1] = _MSG_SHUTDOWN, 0
        dist.broadcast(self._header, src=0, group=self.group)

    def recv(self) -> StepInputs | None:
        """The next step, or None when rank 0 shuts the group down."""
        dist.broadcast(self._header, src=0, group=self.group)
        kind, length = int(self._header[0]), int(self._header[1])
        if kind == _MSG_SHUTDOWN:
            return None
        if kind != _MSG_STEP:
            raise RuntimeError(f"tensor-parallel channel: expected a step, got message kind {kind}")
        payload = torch.empty(length, dtype=torch.int32)
        dist.broadcast(payload, src=0, group=self.group)
        rows, width = StepInputs.image_rows(payload)
        embeds = None
        if rows:
            if self.device is None or self.dtype is None:
                raise RuntimeError("tensor-parallel channel: a step with image rows, but no device/dtype to take them")
            embeds = torch.empty(rows, width, device=self.device, dtype=self.dtype)
            dist.broadcast(embeds, src=0, group=self.device_group)
        return StepInputs.unpack(payload, embeds)

    def send_tokens(self, tokens: torch.Tensor) -> None:
        """Token ids (any shape, int64) rank 0 sampled within a step, for the passes after the sampling."""
        flat = tokens.reshape(-1).to("cpu", torch.int64)
        self._header[0], self._header[1] = _MSG_TOKENS, flat.numel()
        dist.broadcast(self._header, src=0, group=self.group)
        dist.broadcast(flat, src=0, group=self.group)

    def recv_tokens(self) -> torch.Tensor:
        """What `send_tokens` sent: int64 [n] on the CPU."""
        dist.broadcast(self._header, src=0, group=self.group)
        kind, length = int(self._header[0]), int(self._header[1])
        if kind != _MSG_TOKENS:
            raise RuntimeError(f"tensor-parallel channel: expected sampled tokens, got message kind {kind}")
        flat = torch.empty(length, dtype=torch.int64)
        dist.broadcast(flat, src=0, group=self.group)
        return flat


class WorkerGroup:
    """Rank 0's handle on the tensor-parallel ranks 1..N-1 (see the module docstring)."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], context: ParallelContext, store: dist.Store) -> None:
        self.procs = procs
        self.context = context
        self.channel = StepChannel(context)
        self._store = store
        self._state = {"closing": False, "failed": None}
        self._monitor = threading.Thread(target=_monitor, args=(procs, self._state, context), daemon=True,
                                         name="nibble-tp-monitor")
        self._monitor.start()
        self._finalizer = weakref.finalize(self, _shutdown, procs, context, self.channel, self._state, store)

    @classmethod
    def start(cls, config: EngineConfig, model_dir: str | Path, max_model_len: int) -> WorkerGroup:
        """Spawn ranks 1..N-1 and join the group as rank 0; raises WorkerError if a worker fails to start."""
        world = config.tensor_parallel_size
        device = config.torch_device
        if device.type == "cuda" and torch.cuda.device_count() < (device.index or 0) + world:
            raise EngineConfigError(f"--tensor-parallel-size {world} needs GPUs {device.index or 0}.."
                                    f"{(device.index or 0) + world - 1}; {torch.cuda.device_count()} visible")
        if dist.is_initialized():
            raise EngineConfigError("this process already runs a tensor-parallel engine (or another torch.distributed "
                                    "group); shut it down before starting another")
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=PG_TIMEOUT, wait_for_workers=False)
        env = {**os.environ, **{k: os.environ.get(k, v) for k, v in PARALLEL_ENV.items()}}
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(1, world):
                proc = subprocess.Popen([sys.executable, "-m", "nibble.engine.worker"], stdin=subprocess.PIPE,
                                        env=env)
                procs.append(proc)
                spec = WorkerSpec(config, str(model_dir), max_model_len, rank, world, store.port,
                                  logging.getLogger("nibble").getEffectiveLevel())
                assert proc.stdin is not None
                write_spec(proc.stdin, spec)
            _wait_ready(store, procs)
            context = init_process_group(config, 0, store)
        except BaseException:
            _kill(procs)
            raise
        logger.info("tensor parallel: %d ranks (%s), workers %s", world, dist.get_backend(context.group),
                    [p.pid for p in procs])
        return cls(procs, context, store)

    def broadcast(self, step: StepInputs) -> None:
        """Send one step to ranks 1..N-1 (rank 0 then runs it too)."""
        if self._state["failed"] is not None:
            raise WorkerError(str(self._state["failed"]))
        self.channel.send(step)

    def send_tokens(self, tokens: torch.Tensor) -> None:
        """Send the tokens rank 0 sampled within a step to ranks 1..N-1 (`StepChannel.send_tokens`)."""
        if self._state["failed"] is not None:
            raise WorkerError(str(self._state["failed"]))
        self.channel.send_tokens(tokens)

    @property
    def failed(self) -> bool:
        """Whether the group can run no more steps (a worker died, or `fail` was called)."""
        return self._state["failed"] is not None

    def fail(self, reason: str) -> None:
        """Stop the workers at once, wherever they are (a step failed part way on rank 0): kill them and abort the
        process group; every later broadcast raises WorkerError(reason)."""
        if self._state["failed"] is None:
            self._state["failed"] = reason
            logger.error("%s", reason)
        self._state["closing"] = True
        _kill(self.procs)
        _abort(self.context)

    def shutdown(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        self._finalizer()


def write_spec(stream: IO[bytes], spec: WorkerSpec) -> None:
    data = pickle.dumps(spec)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def read_spec(fd: int) -> WorkerSpec:
    """Read the spec from a file descriptor, unbuffered: nothing past it is consumed."""
    (length,) = struct.unpack("<Q", _read_exact(fd, 8))
    spec = pickle.loads(_read_exact(fd, length))
    if not isinstance(spec, WorkerSpec):
        raise WorkerError(f"expected a WorkerSpec on stdin, got {type(spec).__name__}")
    return spec


def _read_exact(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise WorkerError("rank 0 closed the worker's stdin before sending its spec")
        data += chunk
    return data


def mark_ready(store: dist.Store, rank: int) -> None:
    """Worker side: reached the rendezvous."""
    store.set(f"{_READY_KEY}{rank}", "1")


def mark_serving(store: dist.Store, rank: int) -> None:
    """Worker side: built and waiting for steps (a shutdown message will reach it)."""
    store.set(f"{_SERVING_KEY}{rank}", "1")


def _wait_ready(store: dist.Store, procs: list[subprocess.Popen[bytes]]) -> None:
    """Wait until every worker reached the rendezvous, failing fast if one exits first."""
    keys = [f"{_READY_KEY}{rank}" for rank in range(1, len(procs) + 1)]
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not store.check(keys):
        for rank, proc in enumerate(procs, start=1):
            if proc.poll() is not None:
                raise WorkerError(f"tensor-parallel worker rank {rank} exited with code {proc.returncode} "
                                  "during start-up (see its log above)")
        if time.monotonic() > deadline:
            raise WorkerError(f"tensor-parallel workers did not start within {STARTUP_TIMEOUT_S:.0f} s")
        time.sleep(0.02)


def _monitor(procs: list[subprocess.Popen[bytes]], state: dict[str, Any], context: ParallelContext) -> None:
    while not state["closing"]:
        for rank, proc in enumerate(procs, start=1):
            code = proc.poll()
            if code is None or state["closing"]:
                continue
            state["failed"] = (f"tensor-parallel worker rank {rank} exited with code {code}; "
                               "the engine cannot run any more steps")
            logger.error("%s", state["failed"])
            state["closing"] = True
            _kill(procs)
            _abort(context)
            return
        time.sleep(0.5)


def _abort(context: ParallelContext) -> None:
    """Make collectives blocked on a dead peer return with an error (NCCL would otherwise wait for its
    timeout; gloo notices the closed connection by itself)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None or dist.get_backend(context.group) != "nccl":
        return
    try:
        abort(context.group)
    except Exception:  # best effort: the process group may already be gone
        logger.debug("aborting the process group failed", exc_info=True)


def _shutdown(procs: list[subprocess.Popen[bytes]], context: ParallelContext, channel: StepChannel,
              state: dict[str, Any], store: dist.Store) -> None:
    serving = state["failed"] is None and store.check([f"{_SERVING_KEY}{r}" for r in range(1, len(procs) + 1)])
    state["closing"] = True
    if serving:
        try:
            channel.send_shutdown()
        except Exception:  # a worker is already gone: reap the rest below
            logger.debug("shutdown message failed", exc_info=True)
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel worker %d did not exit; killing it", proc.pid)
    _kill(procs)
    if not serving:
        _abort(context)
    if dist.is_initialized():
        dist.destroy_process_group()


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        if proc.stdin is not None and not proc.stdin.closed:
            try:
                proc.stdin.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.error("tensor-parallel worker %d survived SIGKILL", proc.pid)
