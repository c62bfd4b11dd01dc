"""The host's own speed during a bench run: a fixed pure-Python loop, timed right before each timed generation.

A denoise loop that is bound by the host (Python and kernel launches: small models, short sequences, the GPU
waiting) slows down whenever the machine's CPU does. On the lent H200 virtual machines that happens in phases of
seconds to minutes in which the interpreter itself runs up to 1.8x slower, with no steal time or context switches
visible inside the guest and whatever core the process is pinned to (``benchmarks/profiling/host_noise_probe.py``:
the loop's time and the W17 forward's correlate at 0.63-0.77). Such a phase that covers one arm of a pair and not
the other biases that pair; one that covers a whole run moves every host-bound ratio.

:func:`probe_ms` times :data:`PROBE_LOOPS` iterations of an integer loop (about 1 ms on a fast core; no allocation,
no I/O). The bench runs it before each timed generation, outside the timed region, and records it with the sample
(``Timed.host_ms``). From these:

* :func:`host_split`: how much slower (positive) or faster the candidate arm's host was than the dense arm's over a
  candidate's rounds (median against median); :func:`~worldfoundry.bench.timing.run_rounds` gives a candidate whose
  split exceeds the policy's ``host_tolerance`` more rounds, as it does for a dense arm in a slow phase;
* :func:`host_speed_summary`: the run's fastest, median and slowest probe, their spread and the fraction of timed
  generations that ran in a slow phase (:data:`SLOW_PHASE` slower than the fastest probe), written to
  ``results.json`` and the report, so that a noisy run says what was noisy.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

#: Iterations of the probe loop (about 1 ms of a fast core's interpreter).
PROBE_LOOPS: Final = 20_000
#: A probe this much slower than the run's fastest one marks its generation as run in a slow phase.
SLOW_PHASE: Final = 0.25


def probe_ms(loops: int = PROBE_LOOPS, clock: Callable[[], float] = time.perf_counter) -> float:
    """Milliseconds the interpreter takes for ``loops`` iterations of a fixed integer loop.

    Args:
        loops: iterations (> 0).
        clock: seconds (``time.perf_counter``; tests pass a fake).

    Raises:
        ValueError: ``loops`` is not positive.
    """
    if loops <= 0:
        raise ValueError(f"loops: must be > 0, got {loops}")
    start = clock()
    acc = 0
    for i in range(loops):
        acc ^= i * 7
    return (clock() - start) * 1e3


def _values(samples: Iterable[float | None]) -> list[float]:
    return [float(x) for x in samples if x is not None and x == x and x > 0]


def host_split(dense: Sequence[float | None], candidate: Sequence[float | None]) -> float | None:
    """``median(candidate probes) / median(dense probes) - 1``: positive when the candidate's generations ran on a
    slower host than the dense ones (``None`` when either arm has no probe)."""
    d, c = _values(dense), _values(candidate)
    if not d or not c:
        return None
    return statistics.median(c) / statistics.median(d) - 1.0


def host_speed_summary(samples: Iterable[float | None], slow_phase: float = SLOW_PHASE) -> dict[str, Any] | None:
    """The probes of a run: ``min_ms``, ``median_ms``, ``max_ms``, ``spread`` (max / min), ``slow_fraction`` (probes
    more than ``slow_phase`` above the fastest) and their count (``None`` without probes)."""
    values = _values(samples)
    if not values:
        return None
    fastest = min(values)
    slow = sum(1 for v in values if v > fastest * (1.0 + slow_phase))
    return {"probes": len(values), "min_ms": fastest, "median_ms": statistics.median(values), "max_ms": max(values),
            "spread": max(values) / fastest, "slow_fraction": slow / len(values), "slow_phase": slow_phase}


def run_probes(results: dict[str, Any]) -> list[float]:
    """Every probe recorded in a bench run's results (control pairs, candidates, peers), in no particular order."""
    blocks = [results.get("dense", {}).get("control")]
    blocks += [c.get("speed") for c in results.get("candidates", [])]
    blocks += [p.get("speed") for p in results.get("peers", []) or []]
    out: list[float] = []
    for block in blocks:
        probes = (block or {}).get("host_probe_ms") or {}
        for side in ("dense", "candidate"):
            out.extend(_values(probes.get(side) or []))
    return out


def describe(summary: dict[str, Any] | None) -> str:
    """One report line for :func:`host_speed_summary`'s mapping."""
    if not summary:
        return "not probed"
    return (f"interpreter probe before each timed generation {summary['min_ms']:.3g}–{summary['max_ms']:.3g} ms "
            f"(median {summary['median_ms']:.3g}, spread {summary['spread']:.2f}x); "
            f"{summary['slow_fraction']:.0%} of {summary['probes']} timed generations ran in a slow phase "
            f"(probe > {1 + summary['slow_phase']:.2f}x the fastest)")


__all__ = ["PROBE_LOOPS", "SLOW_PHASE", "describe", "host_speed_summary", "host_split", "probe_ms", "run_probes"]
