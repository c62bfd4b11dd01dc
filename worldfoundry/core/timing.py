"""Timing of device work: CUDA events on the GPU, ``perf_counter`` on the CPU, in milliseconds.

One place for what every benchmark and measurement needs: :func:`time_ms` (mean time per call of back-to-back
calls), :class:`Region` (one timed region: device time, host enqueue time and wall time) and
:func:`timing_events` (an event pair for code that records on its own streams and resolves later).

Example:
    >>> import torch
    >>> cpu = torch.device("cpu")
    >>> time_ms(lambda: torch.ones(4).sum(), cpu, iters=3) >= 0.0
    True
    >>> with Region(cpu) as region:
    ...     _ = torch.ones(4).sum()
    >>> region.device_ms >= 0.0 and region.wall_ms >= region.enqueue_ms >= 0.0
    True
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch


def sync(device: torch.device) -> None:
    """Wait for all work queued on ``device`` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timing_events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """A ``(start, end)`` pair of CUDA events that record time (``start.elapsed_time(end)`` is milliseconds)."""
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


class Region:
    """Time one region of code on ``device``.

    On a GPU: events recorded on the current stream at entry and exit; ``device_ms`` is the device time
    between them, ``enqueue_ms`` the host time until the region's code returned, ``wall_ms`` that plus the wait
    for the end event. On the CPU all three are the wall time.

    Args:
        device: where the work runs.
        sync_before: synchronise the device at entry, so earlier work is not timed (default).
    """

    def __init__(self, device: torch.device, *, sync_before: bool = True) -> None:
        self.device = torch.device(device)
        self.sync_before = sync_before
        self.device_ms = self.enqueue_ms = self.wall_ms = 0.0
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._t0 = 0.0

    def __enter__(self) -> Region:
        if self.sync_before:
            sync(self.device)
        if self.device.type == "cuda":
            self._events = timing_events()
            self._events[0].record()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.enqueue_ms = (time.perf_counter() - self._t0) * 1e3
        if self._events is None:
            self.device_ms = self.wall_ms = self.enqueue_ms
            return
        start, end = self._events
        end.record()
        end.synchronize()
        self.wall_ms = (time.perf_counter() - self._t0) * 1e3
        self.device_ms = start.elapsed_time(end)


def time_calls(fn: Callable[[], Any], device: torch.device, iters: int) -> Region:
    """Time ``iters`` back-to-back calls of ``fn`` as one :class:`Region` (totals, not per call)."""
    with Region(device) as region:
        for _ in range(iters):
            fn()
    return region


def time_ms(fn: Callable[[], Any], device: torch.device, iters: int) -> float:
    """Mean milliseconds per call over ``iters`` back-to-back calls (CUDA events on the GPU).

    Args:
        fn: the work; its results are dropped.
        device: where it runs (synchronised first).
        iters: calls, at least 1.

    Returns:
        Device milliseconds per call (wall milliseconds on the CPU).
    """
    return time_calls(fn, device, iters).device_ms / iters


def count_host_syncs(device: torch.device, fn: Callable[[], Any]) -> int | None:
    """Synchronising CUDA calls made by ``fn`` (torch's sync debug mode warnings); ``None`` on the CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message).lower() for w in caught)


__all__ = ["Region", "count_host_syncs", "sync", "time_calls", "time_ms", "timing_events"]
