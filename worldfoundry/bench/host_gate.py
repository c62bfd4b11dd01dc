"""Hold a timed generation until the host runs at its usual speed again.

The lent GPU machines' interpreter changes speed in phases a few seconds long (up to 1.8x slower, invisible from
inside the guest: :mod:`worldfoundry.bench.host_speed`). A host-bound denoise loop timed in such a phase is slower
by up to that factor, and a pair whose arms fall in different phases is biased by it. The step floor removes
bursts that cover a few steps, not a phase that covers whole generations.

:class:`HostGate` probes the interpreter (:func:`~worldfoundry.bench.host_speed.probe_ms`, the median of
:data:`PROBES_PER_CHECK` probes) right before each timed generation and, when its budget is not 0, before each of
its denoising steps (every step ends synchronized, so a wait between steps leaves the GPU idle and is taken out of
the loop's time). When a check is more than ``tolerance`` above the fastest check of the run, the gate sleeps in
short steps and checks again, for at most ``max_wait_s`` per check and ``budget_s`` in the whole run; then the
step or generation runs either way (``gave_up`` counts those). Both arms of every pair go through the same gate, so
it favours neither; waiting is outside the timed region and, through :meth:`HostGate.clock`, outside every
candidate's timing budget.

Example::

    gate = HostGate(budget_s=60.0)
    probe = gate.wait()        # milliseconds of the probe the generation starts after
    gate.to_json()             # {"held": ..., "waited_s": ..., "gave_up": ..., ...}
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, Final

from worldfoundry.bench.host_speed import SLOW_PHASE, probe_ms

#: Probes per check (their median is the check's value: one probe can be cut short by a timer tick).
PROBES_PER_CHECK: Final = 3
#: Seconds between checks while held.
POLL_S: Final = 0.05
#: Probes taken when the gate is made, to find the host's fast speed before the first generation.
CALIBRATION_PROBES: Final = 20


class HostGate:
    """Waits before timed generations for a fast phase of the host (see the module docstring).

    Args:
        budget_s: seconds of waiting allowed in the whole run (0 disables waiting; probes are still taken).
        max_wait_s: seconds of waiting allowed before one generation.
        tolerance: a check this much slower than the fastest one seen is a slow phase (default: the run summary's
            :data:`~worldfoundry.bench.host_speed.SLOW_PHASE`).
        probe: milliseconds of one probe (tests pass a fake).
        sleep, clock: ``time.sleep`` / ``time.perf_counter`` (tests pass fakes).

    Raises:
        ValueError: a negative budget or wait, or a tolerance that is not positive.
    """

    def __init__(self, budget_s: float = 60.0, *, max_wait_s: float = 3.0, tolerance: float = SLOW_PHASE,
                 probe: Callable[[], float] = probe_ms, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not budget_s >= 0:
            raise ValueError(f"host gate budget_s: must be >= 0 seconds, got {budget_s}")
        if not max_wait_s >= 0:
            raise ValueError(f"host gate max_wait_s: must be >= 0 seconds, got {max_wait_s}")
        if not tolerance > 0:
            raise ValueError(f"host gate tolerance: must be > 0, got {tolerance}")
        self.budget_s, self.max_wait_s, self.tolerance = float(budget_s), float(max_wait_s), float(tolerance)
        self._probe, self._sleep, self._clock = probe, sleep, clock
        self.fastest_ms = min(probe() for _ in range(CALIBRATION_PROBES))
        self.checks = self.held = self.gave_up = 0
        self.waited_s = 0.0

    def check_ms(self) -> float:
        """One check: the median of :data:`PROBES_PER_CHECK` probes (the fastest seen is updated)."""
        value = statistics.median(self._probe() for _ in range(PROBES_PER_CHECK))
        self.fastest_ms = min(self.fastest_ms, value)
        return value

    def slow(self, value_ms: float) -> bool:
        """Whether a check of ``value_ms`` falls in a slow phase."""
        return value_ms > self.fastest_ms * (1.0 + self.tolerance)

    def wait(self) -> float:
        """Hold until a check is fast, the per-generation wait or the run's budget is spent; returns the last
        check's milliseconds (recorded with the generation as its host probe)."""
        self.checks += 1
        value = self.check_ms()
        if not self.slow(value) or self.budget_s <= 0:
            return value
        self.held += 1
        start = self._clock()
        while self.slow(value):
            spent = self._clock() - start
            if spent >= self.max_wait_s or self.waited_s + spent >= self.budget_s:
                self.gave_up += 1
                break
            self._sleep(POLL_S)
            value = self.check_ms()
        self.waited_s += self._clock() - start
        return value

    def clock(self) -> float:
        """Seconds like ``time.perf_counter`` minus the time spent waiting: a timing budget measured with it
        counts only the time spent timing."""
        return self._clock() - self.waited_s

    def to_json(self) -> dict[str, Any]:
        """What the gate did: checks, generations held, seconds waited, generations timed still slow."""
        return {"budget_s": self.budget_s, "max_wait_s": self.max_wait_s, "tolerance": self.tolerance,
                "fastest_ms": self.fastest_ms, "checks": self.checks, "held": self.held,
                "waited_s": self.waited_s, "gave_up": self.gave_up}


def describe(gate: dict[str, Any] | None) -> str:
    """One report line for :meth:`HostGate.to_json`'s mapping."""
    if not gate:
        return "off (generations timed whatever the host's speed)"
    if gate["budget_s"] <= 0:
        return "off (--host-hold 0)"
    return (f"{gate['held']} of {gate['checks']} checks (before each timed generation and each of its steps) held "
            f"for a fast host phase (probe > {1 + gate['tolerance']:.2f}x the fastest), {gate['waited_s']:.1f} s "
            f"waited of {gate['budget_s']:.0f} s allowed; {gate['gave_up']} timed while still slow")


__all__ = ["CALIBRATION_PROBES", "POLL_S", "PROBES_PER_CHECK", "HostGate", "describe"]
