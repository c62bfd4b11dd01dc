"""Timing of one GPU launch sequence with CUDA events, shared by the kernel benchmarks of this folder."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def _median_per_call(run: Callable[[], Any], reps: int, calls: int) -> float:
    """Median over ``reps`` samples of the CUDA-event time of ``run`` (synchronised after each) per call it makes."""
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)


def time_ms(fn: Callable[[], Any], warmup: int, reps: int) -> float:
    """Median milliseconds of ``reps`` calls of ``fn`` (CUDA events around each), after ``warmup`` calls."""
    return time_ms_queued(fn, warmup, reps, 1)


def time_ms_queued(fn: Callable[[], Any], warmup: int, reps: int, burst: int) -> float:
    """Median milliseconds per call over ``reps`` samples of ``burst`` back-to-back calls between one pair of CUDA
    events: the host's launch latency counts once per burst instead of once per call (the GPU's queue stays full
    while the host issues the next call faster than the GPU runs one, as in a device-bound model forward)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()

    def run() -> None:
        for _ in range(burst):
            fn()

    return _median_per_call(run, reps, burst)


def time_ms_graph(fn: Callable[[], Any], warmup: int, reps: int, burst: int) -> float:
    """Median milliseconds per call of a CUDA graph holding ``burst`` calls of ``fn``, replayed ``reps`` times (the
    GPU's own time: no host work between kernels). ``fn`` is run ``warmup`` times on a side stream before the
    capture (lazy compilation, tuning and allocations happen outside the graph)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(burst):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    try:
        return _median_per_call(graph.replay, reps, burst)
    finally:
        del graph


def host_issue_us(fn: Callable[[], Any], reps: int) -> float:
    """Median microseconds the host spends in one call of ``fn`` with the GPU idle before it (synchronised first):
    the latency a synchronised sample adds before the first kernel starts, plus issuing the rest."""
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)
