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
