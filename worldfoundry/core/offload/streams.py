"""Copy/compute stream backends for block offloading: real CUDA streams and events, or their CPU emulation.

Both backends offer the same small vocabulary (``current_stream``, ``copy_context``, ``new_event``, ``record``,
``wait``, ``order_after_copies``, ``timed_wait``), so the slot manager runs the same code on a GPU and in CI.

The emulated backend executes copies synchronously on the CPU but keeps the event discipline: waiting on an
event that was never recorded raises :class:`~worldfoundry.errors.OffloadScheduleError` (on CUDA that wait
would silently be a no-op and the compute could read a half-written slot). Copy-wait time in emulation is the
measured duration of the synchronous copies the compute waited for, and is labelled emulated.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch

from worldfoundry.core.timing import timing_events
from worldfoundry.errors import OffloadScheduleError

_MAX_PENDING_TIMERS = 8192
_MAX_POOLED_TIMERS = 1024


class EmulatedStream:
    """A named stand-in for a CUDA stream (operations run immediately, in program order)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"EmulatedStream({self.name!r})"


class EmulatedEvent:
    """A stand-in for a CUDA event: remembers the logical time and stream of its last record.

    Attributes:
        name: for error messages (``"slot0.ready"``).
        recorded_at: logical clock value of the last record, ``None`` before the first.
        copy_ms: duration of the synchronous copy this event marks the end of (ready events only).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.recorded_at: int | None = None
        self.stream: str | None = None
        self.copy_ms = 0.0

    def __repr__(self) -> str:
        return f"EmulatedEvent({self.name!r}, recorded_at={self.recorded_at})"


class EmulatedBackend:
    """CPU as host and device. Events are emulated; counts and ordering are the real ones."""

    emulated = True
    pin_memory = False

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.compute_stream = EmulatedStream("compute")
        self.copy_stream = EmulatedStream("copy")
        self._clock = itertools.count(1)
        self._on_copy_stream = False
        self._wait_ms = 0.0

    def current_stream(self) -> Any:
        return self.copy_stream if self._on_copy_stream else self.compute_stream

    @contextlib.contextmanager
    def copy_context(self) -> Iterator[None]:
        previous = self._on_copy_stream
        self._on_copy_stream = True
        try:
            yield
        finally:
            self._on_copy_stream = previous

    def new_event(self, name: str) -> EmulatedEvent:
        return EmulatedEvent(name)

    def record(self, event: EmulatedEvent, stream: EmulatedStream) -> None:
        event.recorded_at = next(self._clock)
        event.stream = stream.name

    def wait(self, stream: EmulatedStream, event: EmulatedEvent) -> None:
        """Raises :class:`OffloadScheduleError` when ``event`` was never recorded."""
        if event.recorded_at is None:
            raise OffloadScheduleError(
                f"{stream.name} stream waits on event {event.name!r} that was never recorded"
            )

    def timed_wait(self, stream: EmulatedStream, event: EmulatedEvent) -> None:
        self.wait(stream, event)
        self._wait_ms += event.copy_ms

    def order_after_copies(self, stream: EmulatedStream) -> None:
        """Copies already ran synchronously; nothing to order."""

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)

    def collect_wait_ms(self, *, synchronize: bool) -> float:
        total, self._wait_ms = self._wait_ms, 0.0
        return total


class CudaBackend:
    """A dedicated copy stream on one CUDA device; events for ordering and for copy-wait timing.

    No host synchronisation happens per block: :meth:`timed_wait` enqueues a pair of timing events around
    the compute stream's wait, and :meth:`collect_wait_ms` reads the pairs that completed (it synchronises
    only when asked to, once per request).
    """

    emulated = False
    pin_memory = True

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CudaBackend needs a CUDA device, got {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self.copy_stream = torch.cuda.Stream(device=self.device)
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        # completed timing-event pairs, reused (creating CUDA events per block costs host time)
        self._timer_pool: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._wait_ms = 0.0

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def copy_context(self) -> Any:
        """Context manager making the copy stream current (``torch.cuda.StreamContext``, no extra wrapper)."""
        return torch.cuda.stream(self.copy_stream)

    def new_event(self, name: str) -> torch.cuda.Event:
        return torch.cuda.Event()

    def record(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def timed_wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        pool = self._timer_pool
        if pool:
            start, end = pool.pop()
        else:
            start, end = timing_events()
        start.record(stream)
        stream.wait_event(event)
        end.record(stream)
        self._pending.append((start, end))
        if len(self._pending) > _MAX_PENDING_TIMERS:
            self._resolve(synchronize=False)

    def order_after_copies(self, stream: torch.cuda.Stream) -> None:
        """Make later work on ``stream`` (and frees of buffers allocated on it) wait for every issued copy."""
        stream.wait_stream(self.copy_stream)

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)

    def _resolve(self, *, synchronize: bool) -> None:
        if synchronize and self._pending:
            self._pending[-1][1].synchronize()  # earlier pairs on the same stream are complete then
            for _, end in self._pending:
                if not end.query():  # recorded on another stream
                    end.synchronize()
        keep = []
        for start, end in self._pending:
            if end.query():
                self._wait_ms += start.elapsed_time(end)
                if len(self._timer_pool) < _MAX_POOLED_TIMERS:
                    self._timer_pool.append((start, end))
            else:
                keep.append((start, end))
        self._pending = keep

    def collect_wait_ms(self, *, synchronize: bool) -> float:
        """Milliseconds the compute stream waited for copies since the last call (completed waits only,
        all of them when ``synchronize``)."""
        self._resolve(synchronize=synchronize)
        total, self._wait_ms = self._wait_ms, 0.0
        return total


OffloadBackend = EmulatedBackend | CudaBackend


def backend_for(device: torch.device) -> OffloadBackend:
    """CUDA backend for a CUDA device, emulated backend for the CPU.

    Raises:
        ValueError: any other device type.
    """
    if device.type == "cuda":
        return CudaBackend(device)
    if device.type == "cpu":
        return EmulatedBackend()
    raise ValueError(f"block offloading runs on cuda or (emulated) cpu devices, not {device.type!r}")
