"""Hold a timed generation until the host runs at its usual speed again.

The lent GPU machines' interpreter changes speed in phases a few seconds long (up to 1.8x slower, invisible from
inside the guest: :mod:`worldfoundry.bench.host_speed`). A host-bound denoise loop timed in such a phase is slower
by up to that factor, and a pair whose arms fall in different phases is biased by it. The step floor removes
bursts that cover a few steps, not a phase that covers whole generations.

:class:`HostGate` probes the interpreter (:func:`~worldfoundry.bench.host_speed.probe_ms`, the median of
:data:`PROBES_PER_CHECK` probes) right before each timed generation and, when its budget is not 0, before each of
its denoising steps (every step ends synchronized, so a wait between steps leaves the GPU idle and is taken out of
the loop's time). When a check is more than ``tolerance`` above the run's reference (a low quantile of its recent
checks: the fast phase), the gate sleeps in
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
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from worldfoundry.bench.host_speed import SLOW_PHASE, probe_ms

#: Probes per check (their median is the check's value: one probe can be cut short by a timer tick).
PROBES_PER_CHECK: Final = 3
#: Seconds between checks while held.
POLL_S: Final = 0.05
#: Checks taken when the gate is made, to find the host's fast speed before the first generation.
CALIBRATION_CHECKS: Final = 7
#: The reference speed is this quantile of the checks so far: a low one (the fast phase), not the single fastest
#: check, which one lucky probe would set too low for the rest of the run.
REFERENCE_QUANTILE: Final = 0.1
#: Checks kept for the reference (the most recent ones).
HISTORY: Final = 512


class HostGate:
    """Waits before timed generations for a fast phase of the host (see the module docstring).

    Args:
        budget_s: seconds of waiting allowed in the whole run (0 disables waiting; probes are still taken).
        max_wait_s: seconds of waiting allowed before one generation.
        tolerance: a check this much slower than the reference (:attr:`reference_ms`) is a slow phase (default: the run summary's
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
        self._history: deque[float] = deque(maxlen=HISTORY)
        for _ in range(CALIBRATION_CHECKS):
            self.check_ms()
        self.checks = self.held = self.gave_up = 0
        self.waited_s = 0.0
        #: seconds of waiting the run can still afford (the run budget's
        #: :meth:`~worldfoundry.bench.run_budget.RunBudget.slack_s`); ``None``: only ``budget_s`` and ``max_wait_s``
        #: bound a wait. ``limited`` counts the waits it ended.
        self.limit: Callable[[], float] | None = None
        self.limited = 0

    def check_ms(self) -> float:
        """One check: the median of :data:`PROBES_PER_CHECK` probes (kept for the reference)."""
        value = statistics.median(self._probe() for _ in range(PROBES_PER_CHECK))
        self._history.append(value)
        return value

    @property
    def reference_ms(self) -> float:
        """The host's fast speed: the :data:`REFERENCE_QUANTILE` quantile of the recent checks."""
        ordered = sorted(self._history)
        return ordered[int(REFERENCE_QUANTILE * (len(ordered) - 1))]

    def slow(self, value_ms: float) -> bool:
        """Whether a check of ``value_ms`` falls in a slow phase (above the reference by more than the tolerance)."""
        return value_ms > self.reference_ms * (1.0 + self.tolerance)

    def wait(self) -> float:
        """Hold until a check is fast, the per-generation wait or the run's budget is spent; returns the last
        check's milliseconds (recorded with the generation as its host probe)."""
        self.checks += 1
        value = self.check_ms()
        if not self.slow(value) or self.budget_s <= 0:
            return value
        self.held += 1
        start = self._clock()
        allowed = own = min(self.max_wait_s, self.budget_s - self.waited_s)
        if self.limit is not None:
            allowed = min(own, self.limit())
        while self.slow(value):
            if self._clock() - start >= allowed:
                self.gave_up += 1
                self.limited += allowed < own
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
                "reference_ms": self.reference_ms, "checks": self.checks, "held": self.held,
                "waited_s": self.waited_s, "gave_up": self.gave_up, "limited": self.limited}


def describe(gate: dict[str, Any] | None) -> str:
    """One report line for :meth:`HostGate.to_json`'s mapping."""
    if not gate:
        return "off (generations timed whatever the host's speed)"
    if gate["budget_s"] <= 0:
        return "off (--host-hold 0)"
    return (f"{gate['held']} of {gate['checks']} checks (before each timed generation and each of its steps) held "
            f"for a fast host phase (check > {1 + gate['tolerance']:.2f}x the run's 10th percentile), {gate['waited_s']:.1f} s "
            f"waited of {gate['budget_s']:.0f} s allowed; {gate['gave_up']} timed while still slow"
            + (f" ({gate['limited']} of them cut short by the run budget)" if gate.get("limited") else ""))


__all__ = ["CALIBRATION_CHECKS", "HISTORY", "REFERENCE_QUANTILE", "POLL_S", "PROBES_PER_CHECK", "HostGate", "describe"]
