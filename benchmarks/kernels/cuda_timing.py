"""Timing of one GPU launch sequence with CUDA events, shared by the kernel benchmarks of this folder."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch


def time_ms(fn: Callable[[], Any], warmup: int, reps: int) -> float:
    """Median milliseconds of ``reps`` calls of ``fn`` (CUDA events around each), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)
