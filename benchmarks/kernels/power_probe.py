"""Per-call time, SM clock and board power of a GPU call run isolated or sustained (CUDA, ``nvidia-smi``).

Back-to-back bf16 GEMMs at the W81 FFN shapes ran 10-30 % slower per call on an H200 than single synchronised
ones, while the bf16 FFN (two GEMMs and a memory-bound GELU) did not. :func:`probe` tells whether the clocks
drop under sustained load: for each named call it runs, for ``seconds`` each,

* ``isolated``: one call between CUDA events, then a synchronisation (the GPU idles while the host prepares the
  next call: the duty cycle of a synchronised benchmark sample);
* ``sustained``: bursts of ``burst`` back-to-back calls between events, synchronised after each burst (the GPU
  idles only once per burst: the duty cycle of a device-bound forward),

while ``nvidia-smi --query-gpu=clocks.sm,power.draw -lms 50`` logs in the background, and reports the median
per-call milliseconds and the median SM clock (MHz) and power (W) the logger saw during each regime. Without
``nvidia-smi`` the clock and power fields say why they are missing; the times are still measured.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import torch

QUERY = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50"]


def _logged(lines: list[str]) -> dict[str, Any]:
    clocks, watts = [], []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        try:
            clocks.append(float(parts[0]))
            watts.append(float(parts[1]))
        except (IndexError, ValueError):
            continue
    if not clocks:
        return {"sm_clock_mhz": None, "power_w": None, "samples": 0}
    return {"sm_clock_mhz": statistics.median(clocks), "power_w": statistics.median(watts), "samples": len(clocks)}


def _regime(fn: Callable[[], Any], seconds: float, burst: int) -> list[float]:
    """Per-call milliseconds of the samples taken for ``seconds`` (``burst`` calls per sample, 1: isolated)."""
    samples: list[float] = []
    end_at = time.perf_counter() + seconds
    while time.perf_counter() < end_at:  # synchronised after each sample: the host never runs far ahead
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(burst):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / burst)
    return samples


def probe(calls: dict[str, Callable[[], Any]], seconds: float = 2.0, burst: int = 10) -> dict[str, Any]:
    """``{name: {regime: {"ms": median per call, "sm_clock_mhz", "power_w", "samples"}}}`` (module docstring)."""
    smi = shutil.which("nvidia-smi")
    out: dict[str, Any] = {}
    for name, fn in calls.items():
        fn()
        torch.cuda.synchronize()
        out[name] = {}
        for regime, per in (("isolated", 1), ("sustained", burst)):
            logger = subprocess.Popen(QUERY, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) \
                if smi else None
            times = _regime(fn, seconds, per)
            row: dict[str, Any] = {"ms": statistics.median(times), "calls": len(times) * per}
            if logger is not None:
                logger.terminate()
                row.update(_logged(logger.communicate(timeout=10)[0].splitlines()))
            else:
                row.update(sm_clock_mhz=None, power_w=None, samples=0, why="nvidia-smi not found")
            out[name][regime] = row
            time.sleep(0.5)  # let the board settle between regimes
    return out


__all__ = ["probe"]
