"""CUDA-graph capture and cold-cache timing for the GPU benchmark scripts and GPU tests."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch


def capture_graph(fn: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one call of fn. fn runs once on a side stream first, as torch requires before capture
    (lazy allocations and cuBLAS workspaces happen outside the graph)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def stream_us(fns: list[Callable[[], Any]], rounds: int, reps: int, flush: torch.Tensor | None = None) -> float:
    """Microseconds per call of one CUDA graph running every fn in turn, `rounds` times in a row (like
    consecutive layers), median over `reps` replays; `flush` (a buffer larger than the L2), if given, is zeroed
    before each replay."""

    def all_calls() -> None:
        for _ in range(rounds):
            for f in fns:
                f()

    graph = capture_graph(all_calls)
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        times.append(replay_us(graph, rounds * len(fns)))
    return statistics.median(times)


def replay_us(graph: torch.cuda.CUDAGraph, calls: int) -> float:
    """Microseconds per call of one replay of `graph`, which holds `calls` calls (waits for the replay)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def cold_ms(run: Callable[[], Any], reps: int, flush: torch.Tensor) -> float:
    """Median milliseconds of run() over reps calls, `flush` (a buffer larger than the L2) zeroed before each
    call so that every call starts with a cold cache."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        flush.zero_()
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
