"""Timing one block: compute time c and host-to-device transfer time d (device events, medians).

Both functions run 3 warm-ups and 10 timed samples by default and report the median. On CUDA the compute
timing first keeps the device busy for :data:`SETTLE_SECONDS` (untimed), so samples see working clocks. On CUDA every sample
is bracketed by CUDA events (no host synchronisation between samples; one at the end). On the CPU
(emulated mode) ``time.perf_counter`` is used and the result is marked emulated by the caller.

Compute samples call ``make_inputs()`` before the start event of each sample, so resetting the inputs
(cloning the hidden states) is not part of the timed region. A compute sample is the mean of a few
back-to-back calls, the way blocks follow each other in a forward. On CUDA the device is first kept busy
(``torch.cuda._sleep``, about four times the host's enqueue time of one sample, plus 2 ms) before the start event, so all calls
of the sample are queued when the timed region begins: c is the block's device time, not the pace at which
the host launches kernels (which varies between hosts and between moments on one host, and which made c
bimodal on launch-bound workloads).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from worldfoundry.core.offload.host_storage import HostBlockStorage
from worldfoundry.core.offload.streams import backend_for
from worldfoundry.core.timing import timing_events

DEFAULT_WARMUP = 3
DEFAULT_SAMPLES = 10
#: Back-to-back block calls per compute sample (see :func:`time_block_compute`).
DEFAULT_CALLS_PER_SAMPLE = 4


@dataclass(frozen=True)
class TimingSamples:
    """Timed samples in milliseconds; :attr:`median_ms` is the figure used."""

    samples_ms: tuple[float, ...]
    warmup: int
    timer: str  # "cuda_events_primed" | "cuda_events" | "perf_counter"

    @property
    def median_ms(self) -> float:
        return float(statistics.median(self.samples_ms))

    def to_json(self) -> dict[str, Any]:
        return {
            "median_ms": round(self.median_ms, 4),
            "min_ms": round(min(self.samples_ms), 4),
            "max_ms": round(max(self.samples_ms), 4),
            "samples_ms": [round(s, 4) for s in self.samples_ms],
            "warmup": self.warmup,
            "timer": self.timer,
        }


def _check_counts(warmup: int, samples: int) -> None:
    if warmup < 0 or samples < 1:
        raise ValueError(f"need warmup >= 0 and samples >= 1, got warmup={warmup}, samples={samples}")


def time_block_compute(block: nn.Module, make_inputs: Callable[[], Mapping[str, Any]], *, device: torch.device,
                       warmup: int = DEFAULT_WARMUP, samples: int = DEFAULT_SAMPLES,
                       calls_per_sample: int = DEFAULT_CALLS_PER_SAMPLE) -> TimingSamples:
    """Median forward time of ``block(**make_inputs())``, as the block runs inside a model forward.

    Each sample times ``calls_per_sample`` back-to-back calls (inputs made beforehand, outside the timed
    region) and reports their mean. Inside a model, blocks follow each other without a gap, so the launch
    ramp and the drain of the GPU queue are paid once per forward, not once per block; a sample of one
    isolated call would add them to every block (on a launch-bound workload that overstates c by half).

    Args:
        block: the block, with its weights on ``device``.
        make_inputs: returns fresh keyword inputs (called outside the timed region).
        device: where the block runs.
        warmup / samples: untimed calls and timed samples.
        calls_per_sample: block calls per timed sample (the sample is their mean).

    Returns:
        The samples (milliseconds per call).
    """
    _check_counts(warmup, samples)
    if calls_per_sample < 1:
        raise ValueError(f"calls_per_sample must be >= 1, got {calls_per_sample}")
    device = torch.device(device)
    k = calls_per_sample
    with torch.no_grad():
        if device.type == "cuda":
            _settle_clocks(block, make_inputs, device)
        for _ in range(warmup):
            block(**make_inputs())
        if device.type == "cuda":
            cycles = _priming_cycles(block, make_inputs, device, k)
            pairs = []
            stream = torch.cuda.current_stream(device)
            for _ in range(samples):
                batch = [make_inputs() for _ in range(k)]
                if cycles:
                    torch.cuda._sleep(cycles)  # the device spins while the host queues the whole sample
                start, end = timing_events()
                start.record(stream)
                for inputs in batch:
                    block(**inputs)
                end.record(stream)
                pairs.append((start, end))
                del batch
            torch.cuda.synchronize(device)
            timer = "cuda_events_primed" if cycles else "cuda_events"
            return TimingSamples(tuple(s.elapsed_time(e) / k for s, e in pairs), warmup, timer)
        values = []
        for _ in range(samples):
            batch = [make_inputs() for _ in range(k)]
            t0 = time.perf_counter()
            for inputs in batch:
                block(**inputs)
            values.append((time.perf_counter() - t0) * 1000.0 / k)
        return TimingSamples(tuple(values), warmup, "perf_counter")


#: Seconds of back-to-back block calls before the warm-ups, so the GPU runs at its working clocks.
SETTLE_SECONDS = 0.3


def _settle_clocks(block: nn.Module, make_inputs: Callable[[], Mapping[str, Any]], device: torch.device,
                   seconds: float = SETTLE_SECONDS) -> None:
    """Keep the device busy for ``seconds`` (an idle GPU clocks down; a one-block sample right after loading
    would measure the clock ramp, not the block). Nothing is timed or kept."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        block(**make_inputs())
        torch.cuda.synchronize(device)


def _priming_cycles(block: nn.Module, make_inputs: Callable[[], Mapping[str, Any]], device: torch.device,
                    calls: int) -> int:
    """GPU spin cycles that keep the device busy for about four times the host time of queuing ``calls`` block
    calls (plus 2 ms; the spin is not part of the timed interval, and a loaded host queues some samples more slowly
    than the probe did); 0 when this PyTorch has no ``torch.cuda._sleep``."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return 0
    torch.cuda.synchronize(device)
    batch = [make_inputs() for _ in range(calls)]
    t0 = time.perf_counter()
    for inputs in batch:
        block(**inputs)
    enqueue_ms = (time.perf_counter() - t0) * 1000.0
    del batch
    probe = 10_000_000
    start, end = timing_events()
    torch.cuda.synchronize(device)
    start.record()
    sleep(probe)
    end.record()
    end.synchronize()
    cycles_per_ms = probe / max(start.elapsed_time(end), 1e-3)
    return int(cycles_per_ms * (4.0 * enqueue_ms + 2.0))


def time_block_transfer(storage: HostBlockStorage, *, device: torch.device, warmup: int = DEFAULT_WARMUP,
                        samples: int = DEFAULT_SAMPLES) -> TimingSamples:
    """Median time to copy one block from its host masters into a device buffer, in the storage's layout
    (one copy for a contiguous slab, one per tensor otherwise), on a dedicated copy stream.

    Args:
        storage: the block's host masters (pinned for a CUDA device).
        device: the destination device (``cpu`` measures the emulated copy).
        warmup / samples: untimed and timed copies.
    """
    _check_counts(warmup, samples)
    device = torch.device(device)
    backend = backend_for(device)
    buffer = backend.empty(storage.layout.nbytes)
    views = storage.layout.views(buffer)
    if device.type == "cuda":
        compute = backend.current_stream()
        with backend.copy_context():
            stream = backend.current_stream()
            stream.wait_stream(compute)  # the buffer was allocated on the compute stream
            for _ in range(warmup):
                storage.copy_to(buffer, views, non_blocking=True)
            pairs = []
            for _ in range(samples):
                start, end = timing_events()
                start.record(stream)
                storage.copy_to(buffer, views, non_blocking=True)
                end.record(stream)
                pairs.append((start, end))
        torch.cuda.synchronize(device)
        return TimingSamples(tuple(s.elapsed_time(e) for s, e in pairs), warmup, "cuda_events")
    for _ in range(warmup):
        storage.copy_to(buffer, views, non_blocking=False)
    values = []
    for _ in range(samples):
        t0 = time.perf_counter()
        storage.copy_to(buffer, views, non_blocking=False)
        values.append((time.perf_counter() - t0) * 1000.0)
    return TimingSamples(tuple(values), warmup, "perf_counter")
