"""Timing that holds: device-event time of the denoise loop, adaptive paired rounds, a receipts-derived upper
bound on each candidate's speedup, and the noisy-host rule.

* :class:`LoopTimer` times the denoise loop with CUDA events on the GPU (``perf_counter`` on the CPU), between the
  denoiser's ``prepare_request_schedule`` (the loop starts right after it) and ``end_request`` (right after the
  last step). Text encoding (``encode_s``) and decoding (``decode_s``) stay separate in the pipeline's timings.
* :func:`run_rounds` adds interleaved paired rounds until the 95% CI half-width of the speedup is at most
  ``target_halfwidth`` (relative to the estimate), or ``max_rounds`` / ``budget_s`` end. A candidate whose CI
  still straddles the policy's ``threshold`` (the value its lower bound must exceed for ``recommended``), or clears
  it by no more than ``verdict_margin``, when ``budget_s`` ends or its CI is narrow gets more rounds, up to
  ``extend_factor * budget_s``: time goes where the verdict is undecided or would not repeat, not to candidates
  that are clearly slower or clearly faster. So does a pair whose dense floor is more than ``target_halfwidth``
  above the run's :class:`~worldfoundry.bench.floor.DenseFloorReference` (its dense arm ran in a slow phase of the
  host; ``dense_excess`` in the summary) while its CI reaches the threshold, even when its CI is narrow. The
  estimate is the policy's ``estimator`` (:func:`~worldfoundry.bench.stats.summarize_speed`): by default the step floor
  (:mod:`worldfoundry.bench.floor`) from the per-step times each :class:`Timed` sample carries. A candidate whose
  arms ran on hosts of different speed (:func:`~worldfoundry.bench.host_speed.host_split` of the interpreter probes
  the samples carry above the policy's ``host_tolerance``) gets more rounds the same way. A pair whose dense floor is
  still that far above the reference when its rounds end, and whose candidate was bound by the device (the host
  busy for at most :data:`DEVICE_BOUND_HOST_SHARE` of its steps), is estimated against the reference instead
  (:func:`~worldfoundry.bench.floor.reference_step_floor`; ``dense_floor_source: "run_reference"``, the pair's own
  estimate kept as ``pair_estimate``): a dense arm slowed by the host would otherwise inflate the speedup of a
  candidate the host does not slow.
* :func:`switching_pairs`: paired rounds of two arms that share one model (install/uninstall, apply/undo), in
  blocks of two rounds whose first side alternates; after every switch one untimed generation of the
  switched-to arm runs first, so one-off costs of a switch (a CUDA graph
  captured again, weights built at the first call, allocator growth) stay out of both arms' timings.
* :func:`speed_bound`: a cache that ran ``k`` of ``n`` model calls cannot be faster than ``n / k`` (1 when it
  skipped none), unless other plugins share the candidate; a measured speedup above ``bound * (1 + tolerance)``
  is ``invalid_timing``.
* :func:`timed_generate` runs each timed request with Python's garbage collector paused (:func:`gc_paused`); the
  harness collects and freezes what exists once the model is loaded, so the collections between requests stay
  short. With a :class:`~worldfoundry.bench.host_gate.HostGate` on the runner, each timed request first waits
  (bounded) for a fast phase of the host; budgets are then measured on the gate's clock, which leaves the waits
  out.
* :func:`noisy_host`: the dense-vs-dense control CI's upper bound above ``max_noise_floor`` (default 1.05) means
  the host is too noisy for any speed verdict.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from worldfoundry.base_models.diffusion_model.runner import BETWEEN_STEPS
from worldfoundry.bench.floor import DenseFloorReference, reference_step_floor
from worldfoundry.bench.host_speed import host_split, probe_ms
from worldfoundry.bench.run_budget import RunBudget
from worldfoundry.bench.stats import DEFAULT_ESTIMATOR, ESTIMATORS, summarize_speed

#: Default target of the paired-speedup CI half-width, relative to the median (2%).
DEFAULT_TARGET_HALFWIDTH = 0.02
#: Control-pair CI upper bound above which no speed verdict is given.
DEFAULT_MAX_NOISE_FLOOR = 1.05
#: Slack above the receipts-derived bound before a speedup is called impossible.
DEFAULT_BOUND_TOLERANCE = 0.05
#: Budget multiple an undecided candidate (CI straddling the threshold) may use.
DEFAULT_EXTEND_FACTOR = 2.0
#: Relative difference of the two arms' median host probes above which a candidate gets more rounds.
DEFAULT_HOST_TOLERANCE = 0.15
#: How far (relative) a CI's lower bound must clear the threshold before its verdict counts as decided. At W17 on an
#: H200 one exact stack read 1.038x [0.998, 1.043] in one run and 1.040x [1.029, 1.058] in the next against a
#: threshold of 1.02: a lower bound 0.9 % above it was ``recommended`` once and not again.
DEFAULT_VERDICT_MARGIN = 0.01


class WidthPool:
    """Seconds of extra timing a run may spend on candidates whose verdict is decided but whose CI is still wider
    than the target when their budget ends (shared by every candidate of the run, first come, first served; only
    the pool and ``max_rounds`` bound these rounds, not ``extend_factor``: at W17 on an H200 a paired round with
    its switches takes 3-5 s, so twice a 6 s budget left room for one). ``spent`` accumulates what was used."""

    def __init__(self, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"width pool: seconds must be >= 0, got {seconds}")
        self.seconds = float(seconds)
        self.spent = 0.0

    @property
    def left(self) -> float:
        """Seconds not yet spent."""
        return max(0.0, self.seconds - self.spent)

    def to_json(self) -> dict[str, float]:
        return {"seconds": self.seconds, "spent": round(self.spent, 3)}


@dataclass(frozen=True)
class TimingPolicy:
    """How long to time and when to trust the result.

    Args:
        min_rounds: paired rounds always run (>= 3).
        max_rounds: rounds never exceeded.
        target_halfwidth: stop once the CI half-width / median is at most this.
        budget_s: stop adding rounds for one candidate after this many seconds of timing.
        max_noise_floor: control CI upper bound above which the host is declared noisy.
        bound_tolerance: relative slack over the receipts bound.
        estimator: ``step_floor`` (default) or ``paired_median``
            (see :func:`~worldfoundry.bench.stats.summarize_speed`).
        threshold: the decision threshold of the run (``None`` before the control pairs set it): a CI that
            straddles it, or whose lower bound clears it by at most ``verdict_margin``, is undecided when
            ``budget_s`` ends or its CI is narrow, and gets more rounds.
        verdict_margin: see ``threshold`` (relative; 0: only a straddling CI is undecided).
        extend_factor: the budget multiple an undecided candidate may use (1 = never extended).
        dense_reference: the run's dense step floors (``None``: no slow-phase check); updated by the harness as
            pairs complete.
        host_tolerance: relative difference of the arms' median host probes (:mod:`~worldfoundry.bench.host_speed`)
            above which a candidate's rounds are extended like an undecided one's.
        width_pool: the run's :class:`WidthPool` (``None``: a decided candidate stops at its budget however wide
            its CI): a decided candidate wider than ``target_halfwidth`` when its budget ends gets more rounds while
            the pool has seconds left (the rounds' time is charged to it), up to ``max_rounds``.
        run_budget: the run's :class:`~worldfoundry.bench.run_budget.RunBudget` (``None``: none): a round past the
            budget (undecided, slow, or paid by the width pool) runs only while it leaves slack; else the candidate
            stops with ``stopped="run_budget"``.
        verdict_only: every round past ``min_rounds`` is a verdict round (the bench's settling pass,
            :mod:`~worldfoundry.bench.settle`): taken only while the verdict needs it (:func:`run_rounds`' rule for
            rounds past the budget) and the run budget allows it, up to ``extend_factor * budget_s``; never paid by
            the width pool.
    """

    min_rounds: int = 3
    max_rounds: int = 12
    target_halfwidth: float = DEFAULT_TARGET_HALFWIDTH
    budget_s: float = 60.0
    max_noise_floor: float = DEFAULT_MAX_NOISE_FLOOR
    bound_tolerance: float = DEFAULT_BOUND_TOLERANCE
    estimator: str = DEFAULT_ESTIMATOR
    threshold: float | None = None
    extend_factor: float = DEFAULT_EXTEND_FACTOR
    dense_reference: DenseFloorReference | None = field(default=None, compare=False, repr=False)
    host_tolerance: float = DEFAULT_HOST_TOLERANCE
    verdict_margin: float = DEFAULT_VERDICT_MARGIN
    width_pool: WidthPool | None = field(default=None, compare=False, repr=False)
    run_budget: RunBudget | None = field(default=None, compare=False, repr=False)
    verdict_only: bool = False

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator: expected one of {', '.join(ESTIMATORS)}, got {self.estimator!r}")
        if self.min_rounds < 3:
            raise ValueError(f"min_rounds: at least 3 paired rounds are required, got {self.min_rounds}")
        if self.max_rounds < self.min_rounds:
            raise ValueError(f"max_rounds: must be >= min_rounds ({self.min_rounds}), got {self.max_rounds}")
        if not self.target_halfwidth > 0:
            raise ValueError(f"target_halfwidth: must be > 0, got {self.target_halfwidth}")
        if not self.budget_s > 0:
            raise ValueError(f"budget_s: must be > 0, got {self.budget_s}")
        if not self.extend_factor >= 1:
            raise ValueError(f"extend_factor: must be >= 1, got {self.extend_factor}")
        if not self.host_tolerance > 0:
            raise ValueError(f"host_tolerance: must be > 0, got {self.host_tolerance}")
        if not 0 <= self.verdict_margin < 1:
            raise ValueError(f"verdict_margin: must be in [0, 1), got {self.verdict_margin}")


def ci_halfwidth(summary: Mapping[str, Any]) -> float:
    """Half the 95% CI width relative to the median speedup (``inf`` when undefined)."""
    low, high = summary["ci95"]
    estimate = summary["speedup"]
    if not estimate or estimate != estimate or low != low or high != high:
        return float("inf")
    return (high - low) / 2.0 / estimate


def dense_excess(summary: Mapping[str, Any], reference: DenseFloorReference | None) -> float | None:
    """How far (relative) the pair's dense step floor sits above the run's reference (``None``: not comparable)."""
    floor = summary.get("step_floor")
    if reference is None or not floor:
        return None
    ref = reference.floor(summary.get("groups") or [])
    return floor["dense_floor_s"] / ref - 1.0 if ref else None


def undecided(summary: Mapping[str, Any], threshold: float | None, margin: float = 0.0) -> bool:
    """Whether the CI straddles ``threshold`` (lower bound at or below it, upper bound above it), or its lower bound
    clears it by no more than ``margin`` (relative): a verdict a repeat run would likely not give again."""
    if threshold is None:
        return False
    low, high = summary["ci95"]
    return bool(low == low and high == high and low <= threshold * (1.0 + margin) and high > threshold)


@dataclass(frozen=True)
class Timed:
    """One timed generation: its loop time, its per-step times, its group (the seed) and the host probe taken just
    before it (milliseconds, :func:`~worldfoundry.bench.host_speed.probe_ms`; ``None``: not probed)."""

    seconds: float
    steps: tuple[float, ...] = ()
    group: Any = None
    host_ms: float | None = None
    #: per step, the host's part of it (until the model's work was issued; empty: not recorded)
    host_steps: tuple[float, ...] = ()

    @classmethod
    def of(cls, seconds: float, phases: Mapping[str, Any], seed: int) -> Timed:
        """From :func:`timed_generate`'s seconds and phases."""
        probe = phases.get("host_probe_ms")
        return cls(float(seconds), tuple(float(x) for x in phases.get("steps_s") or ()), seed,
                   None if probe is None else float(probe), tuple(float(x) for x in phases.get("host_steps_s") or ()))


def _sample(x: float | Timed) -> Timed:
    return x if isinstance(x, Timed) else Timed(float(x))


def run_rounds(pair: Callable[[int], tuple[float | Timed, float | Timed]], policy: TimingPolicy, *,
               clock: Callable[[], float] = time.perf_counter,
               on_round: Callable[[], None] | None = None,
               prior: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Run paired rounds ``pair(r) -> (dense, candidate)`` (seconds, or :class:`Timed` samples with their steps)
    until the stopping rule holds. ``prior``: an earlier summary of this pair, whose rounds are kept and counted
    (``pair`` is called from ``r = prior["rounds"]`` on: a later pass adds rounds to the same estimate).

    Returns:
        :func:`~worldfoundry.bench.stats.summarize_speed`'s mapping plus ``rounds``, ``halfwidth``, ``stopped``
        (``"target"``, ``"max_rounds"``, ``"budget"``, or ``"run_budget"`` where the run could not afford a round
        past the budget; an undecided candidate stops at ``extend_factor`` times the budget), ``extended`` (rounds
        added after the rule would have stopped: an undecided CI past the budget, or a slow dense arm),
        ``dense_excess`` (the pair's dense floor over the policy's ``dense_reference``, minus 1; ``None`` without
        one), the samples' ``steps_s``, ``groups`` and ``host_probe_ms``, and ``host_split``
        (:func:`~worldfoundry.bench.host_speed.host_split`; rounds are extended while it exceeds the policy's
        ``host_tolerance``).
    """
    dense, cand = samples(prior) if prior is not None else ([], [])
    start = clock()
    stopped = "max_rounds"
    summary: dict[str, Any] = {}
    extended = widened = 0
    # an optional round runs since ``charged_from``, paid by the width pool (``pool_round``) or the run budget
    charged_from: float | None = None
    pool_round, budget, last_round_s = False, policy.run_budget, 0.0
    for r in range(len(dense), policy.max_rounds):
        began = clock() if budget is not None else 0.0
        d, c = pair(r)
        dense.append(_sample(d))
        cand.append(_sample(c))
        if on_round is not None:
            on_round()
        if budget is not None:
            last_round_s = clock() - began
        if charged_from is not None:
            _charge(policy, pool_round, clock() - charged_from)
            charged_from = None
        if len(dense) < policy.min_rounds:
            continue
        summary = _summarize(dense, cand, policy)
        narrow = ci_halfwidth(summary) <= policy.target_halfwidth
        elapsed = clock() - start
        if narrow or elapsed >= policy.budget_s or policy.verdict_only:
            step = _past_budget(summary, policy, narrow, elapsed, last_round_s)
            if step not in ("extend", "pool"):
                stopped = step
                break
            extended += 1
            pool_round = step == "pool"
            widened += pool_round
            if pool_round or budget is not None:
                charged_from = clock()
    if not summary:
        summary = _summarize(dense, cand, policy)
    excess = dense_excess(summary, policy.dense_reference)
    reference_fallback(summary, policy, excess)
    summary.update(rounds=len(dense), halfwidth=ci_halfwidth(summary), stopped=stopped, extended=extended,
                   widened=widened, target_halfwidth=policy.target_halfwidth, dense_excess=excess)
    return summary


def _past_budget(summary: dict[str, Any], policy: TimingPolicy, narrow: bool, elapsed: float,
                 last_round_s: float) -> str:
    """What a candidate whose CI is narrow or whose budget is spent does next: stop (``"target"``, ``"budget"``,
    ``"run_budget"``) or run one more round (``"extend"``: for the verdict's sake; ``"pool"``: paid by the width
    pool)."""
    more = _needs_more(summary, policy) and elapsed < policy.extend_factor * policy.budget_s
    wide = not (narrow or policy.verdict_only) and policy.width_pool is not None and policy.width_pool.left > 0
    if not (more or wide):
        return "target" if narrow else "budget"
    if policy.run_budget is not None and not policy.run_budget.allow(last_round_s, fair=not more):
        return "run_budget"
    return "extend" if more else "pool"


def _charge(policy: TimingPolicy, pool_round: bool, seconds: float) -> None:
    """An optional round's time: to the width pool when it paid for it, else to the run budget's ``extended_s``."""
    if pool_round:
        policy.width_pool.spent += seconds
        if policy.run_budget is not None:
            policy.run_budget.charge_fair(seconds)
    elif policy.run_budget is not None:
        policy.run_budget.extended_s += seconds


def _needs_more(summary: dict[str, Any], policy: TimingPolicy) -> bool:
    """Rounds past the budget (or past a narrow CI) for the verdict's sake: a CI that straddles the threshold or
    clears it by no more than the verdict margin, arms on hosts of different speed, or a dense arm in a slow phase
    whose speedup could still reach the threshold (a slowed dense arm only inflates the speedup: a CI whose upper
    bound is under the threshold gives the same verdict without it)."""
    threshold = policy.threshold
    excess = dense_excess(summary, policy.dense_reference)
    slow = excess is not None and excess > policy.target_halfwidth
    if slow and threshold is not None:
        high = summary["ci95"][1]
        slow = not high < threshold
    split = summary["host_split"]
    slow = slow or (split is not None and abs(split) > policy.host_tolerance)
    return slow or undecided(summary, threshold, policy.verdict_margin)


def samples(summary: Mapping[str, Any]) -> tuple[list[Timed], list[Timed]]:
    """The dense and candidate :class:`Timed` samples of a summary :func:`run_rounds` returned (the inverse of its
    per-round fields)."""
    n = len(summary["dense_s"])
    groups = summary.get("groups") or [None] * n
    out: dict[str, list[Timed]] = {}
    for side, key in (("dense", "dense_s"), ("candidate", "candidate_s")):
        steps = (summary.get("steps_s") or {}).get(side) or [[]] * n
        host = (summary.get("host_steps_s") or {}).get(side) or [[]] * n
        probes = (summary.get("host_probe_ms") or {}).get(side) or [None] * n
        out[side] = [Timed(float(s), tuple(st), g, p, tuple(h))
                     for s, st, g, p, h in zip(summary[key], steps, groups, probes, host)]
    return out["dense"], out["candidate"]


def _summarize(dense: list[Timed], cand: list[Timed], policy: TimingPolicy) -> dict[str, Any]:
    """:func:`~worldfoundry.bench.stats.summarize_speed` of the rounds so far, with their per-step and host data."""
    arms = {"dense": dense, "candidate": cand}
    steps = {k: [list(x.steps) for x in v] for k, v in arms.items()}
    groups = [x.group for x in dense]
    out = summarize_speed([x.seconds for x in dense], [x.seconds for x in cand], steps=steps, groups=groups,
                          estimator=policy.estimator)
    probes = {k: [x.host_ms for x in v] for k, v in arms.items()}
    out.update(steps_s=steps, host_steps_s={k: [list(x.host_steps) for x in v] for k, v in arms.items()},
               groups=groups, host_probe_ms=probes, host_split=host_split(probes["dense"], probes["candidate"]))
    return out


#: A candidate whose steps kept the host busy for at most this share of their time (median over its steps) was
#: bound by the device, not the host: a slow phase of the host did not lengthen them.
DEVICE_BOUND_HOST_SHARE = 0.8


def host_share(summary: Mapping[str, Any], side: str = "candidate") -> float | None:
    """Median over ``side``'s steps of the host's part of each step (``None``: not recorded or not aligned)."""
    host = (summary.get("host_steps_s") or {}).get(side) or []
    steps = (summary.get("steps_s") or {}).get(side) or []
    shares = [h / t for hs, ts in zip(host, steps) if len(hs) == len(ts) for h, t in zip(hs, ts) if t > 0]
    if not shares or len(host) != len(steps):
        return None
    return float(statistics.median(shares))


def reference_fallback(summary: dict[str, Any], policy: TimingPolicy, excess: float | None) -> None:
    """Re-estimate a pair whose dense arm stayed slower than the run's dense floor (``excess`` above the target
    half-width) against that floor (:func:`~worldfoundry.bench.floor.reference_step_floor`) when the candidate's
    steps were bound by the device (:func:`host_share` at most :data:`DEVICE_BOUND_HOST_SHARE`), so the slow
    phase that lengthened the dense arm did not lengthen them. A host-bound candidate slowed with its dense arm:
    its pair's own estimate stands (``dense_floor_source: "pair"``). The pair's own estimate is kept as
    ``pair_estimate`` either way."""
    if excess is None or excess <= policy.target_halfwidth or summary.get("estimator") != "step_floor":
        return
    share = host_share(summary)
    summary.update(pair_estimate={"speedup": summary["speedup"], "ci95": summary["ci95"]},
                   dense_floor_source="pair", candidate_host_share=share)
    if share is None or share > DEVICE_BOUND_HOST_SHARE:
        return
    alt = reference_step_floor(summary["steps_s"]["candidate"], summary["groups"], policy.dense_reference)
    if alt is None or alt["ci95"][0] != alt["ci95"][0]:
        return
    summary.update(speedup=alt["speedup"], ci95=alt["ci95"], dense_floor_source="run_reference",
                   reference_step_floor=alt)


@dataclass(frozen=True)
class Arm:
    """One side of a pair over a shared model.

    Args:
        activate: make this arm the model's current state; returns ``True`` when that changed the model.
        timed: ``(round, seed) ->`` one timed generation, seconds or a :class:`Timed` (the arm is active).
        warm: one untimed generation for ``seed`` (the arm is active).
    """

    activate: Callable[[], bool]
    timed: Callable[[int, int], float | Timed]
    warm: Callable[[int], Any]


#: Rounds per block of :func:`switching_pairs`: one switch (and one warm-up generation) per block.
SWITCH_BLOCK = 2


def switching_pairs(dense: Arm, candidate: Arm, seeds: list[int], policy: TimingPolicy, *,
                    on_round: Callable[[], None] | None = None, clock: Callable[[], float] = time.perf_counter,
                    block: int = SWITCH_BLOCK, first: str = "dense",
                    prior: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """:func:`run_rounds` over blocks of ``block`` rounds: one side's generations of the block, then the other's,
    the side that goes first alternating per block (``D D C C | C C D D | ...``: slow drifts favour neither side,
    and the model is switched once per block), the seed cycling per round. An arm whose ``activate`` changed the
    model runs one untimed ``warm`` generation first; the count is returned as ``warmups``.

    ``first``: the side of the first block's first half (``"dense"`` or ``"candidate"``). Name the side the model
    is on and warm already (the bench's candidates and peers: their pilot ran just before), and the first block
    needs no switch: four rounds then cost two warm-ups and two switches instead of three and three.

    ``prior``: an earlier summary of this pair (:func:`run_rounds`): its rounds are kept, the blocks continue from
    its round count, and ``warmups`` counts both passes. The side named ``first`` must then be active and warm."""
    if first not in ("dense", "candidate"):
        raise ValueError(f"switching_pairs: first must be 'dense' or 'candidate', got {first!r}")
    sides = (dense, candidate) if first == "dense" else (candidate, dense)
    warmups = [0]
    done: dict[int, tuple[float | Timed, float | Timed]] = {}

    def run(arm: Arm, r: int, seed: int) -> float | Timed:
        if arm.activate():
            arm.warm(seed)
            warmups[0] += 1
        return arm.timed(r, seed)

    def pair(r: int) -> tuple[float | Timed, float | Timed]:
        if r not in done:
            index = r // block
            rounds = range(r, min(r + block, policy.max_rounds))
            order = sides if index % 2 == 0 else sides[::-1]
            got = {id(arm): [run(arm, i, seeds[i % len(seeds)]) for i in rounds] for arm in order}
            for j, i in enumerate(rounds):
                done[i] = (got[id(dense)][j], got[id(candidate)][j])
        return done.pop(r)

    out = run_rounds(pair, policy, clock=clock, on_round=on_round, prior=prior)
    out["warmups"] = warmups[0] + int((prior or {}).get("warmups", 0))
    out["switch_block"] = block
    out["first_side"] = first
    return out


def model_calls(workload: Mapping[str, Any]) -> int:
    """Model calls of one request: steps x CFG branches (routed experts share these calls)."""
    steps = int(workload.get("steps") or 0)
    guidance = workload.get("guidance")
    branches = 2 if guidance is not None and float(guidance) > 1.0 else 1
    return steps * branches


def speed_bound(skipped: Mapping[str, Mapping[str, int]], calls: int,
                plugins: Collection[str] | None = None) -> float | None:
    """Upper bound ``n / k`` from the receipts' skipped model calls, for a candidate of caches only.

    A cache that ran all ``n`` calls (it reported its skipped work, and none was skipped) is bounded by 1: it
    cannot be faster than the dense model. ``None`` when no cache reported, or when ``plugins`` names a plugin that
    is not a cache (that one may make each call cheaper, so ``n / k`` does not bound the stack).

    Args:
        skipped: per cache plugin (``role:feature_cache``) ``{"steps": count}`` summed over the seeds of one pilot
            each (``{}``: nothing skipped).
        calls: model calls per request times the number of seeds summed in ``skipped``.
        plugins: the candidate's plugin names (``None``: assume only the caches in ``skipped``).
    """
    if not skipped or calls <= 0 or (plugins is not None and set(plugins) - set(skipped)):
        return None
    n_skipped = max((int(counts.get("steps", 0)) for counts in skipped.values()), default=0)
    ran = calls - n_skipped
    return float("inf") if ran <= 0 else calls / ran


def bound_violation(speed: Mapping[str, Any] | None, bound: float | None, tolerance: float) -> str | None:
    """A message when the measured speedup exceeds ``bound * (1 + tolerance)``, else ``None``."""
    if speed is None or bound is None:
        return None
    estimate = float(speed["speedup"])
    if estimate > bound * (1.0 + tolerance):
        return (f"speedup {estimate:.3g}x exceeds the receipts bound {bound:.3g}x (+{tolerance:.0%}): "
                "the timing cannot be right")
    return None


def noisy_host(noise_floor: float, policy: TimingPolicy) -> str | None:
    """The banner text when the control CI's upper bound exceeds the policy's threshold, else ``None``."""
    if noise_floor > policy.max_noise_floor:
        return (f"NOISY HOST: dense-vs-dense noise floor {noise_floor:.3f} > {policy.max_noise_floor:.3f}; "
                "no speed verdicts are given (quality and execution results stand)")
    return None


class LoopTimer:
    """Device-event time of the denoise loop of one request (CUDA events on the GPU, ``perf_counter`` else).

    The denoiser's ``prepare_request_schedule`` and ``end_request`` are shadowed on the instance for the
    duration of ``with`` and restored exactly after; the model is not touched.
    """

    def __init__(self, denoiser: Any, device: torch.device) -> None:
        self.denoiser = denoiser
        self.cuda = device.type == "cuda"
        self.seconds: float | None = None
        self._start: Any = None

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def __enter__(self) -> LoopTimer:
        den = self.denoiser
        orig_prepare, orig_end = den.prepare_request_schedule, den.end_request

        def prepare(*args: Any, **kwargs: Any) -> Any:
            out = orig_prepare(*args, **kwargs)
            self._start = self._mark()
            return out

        def end(*args: Any, **kwargs: Any) -> Any:
            stop = self._mark()
            if self.cuda:
                stop.synchronize()
                self.seconds = self._start.elapsed_time(stop) / 1e3
            else:
                self.seconds = stop - self._start
            return orig_end(*args, **kwargs)

        self._had = {k: k in vars(den) for k in ("prepare_request_schedule", "end_request")}
        den.prepare_request_schedule, den.end_request = prepare, end
        return self

    def __exit__(self, *exc: Any) -> None:
        for key, had in self._had.items():
            if not had:
                delattr(self.denoiser, key)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside the block (back on after, if it was on): a collection that
    starts inside a timed generation adds its pause to one arm of one pair only."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def timed_generate(runner: Any, seed: int, tag: str) -> tuple[Any, float, dict[str, Any]]:
    """One latent-only request, the garbage collector paused and the host probed just before it
    (:func:`~worldfoundry.bench.host_speed.probe_ms`, or the runner's ``host_gate``: a
    :class:`~worldfoundry.bench.host_gate.HostGate` that first holds for a fast phase of the host, and, when its
    budget is not 0, holds again before every step of the loop through
    :data:`~worldfoundry.base_models.diffusion_model.runner.BETWEEN_STEPS`: each step ends synchronized, so the
    GPU is idle while it waits and the waits are taken out of the loop's time); returns the result, the loop's
    device time and the per-phase timings (with ``host_probe_ms``)."""
    den = runner.pipe.components.denoiser
    gate = getattr(runner, "host_gate", None)
    holding = gate is not None and gate.budget_s > 0
    with gc_paused():
        # the host's speed right before the request, outside the timed region (a gate first waits for a fast phase)
        probe = gate.wait() if gate is not None else probe_ms()
        token = BETWEEN_STEPS.set(gate.wait if holding else None)  # and again before every step
        try:
            with LoopTimer(den, runner.pipe.policy.device) as timer:
                result = runner.generate(seed, tag)
        finally:
            BETWEEN_STEPS.reset(token)
    between = float(result.timings.get("between_steps_s") or 0.0)  # the waits: after a step's sync, GPU idle
    seconds = timer.seconds - between if timer.seconds is not None else result.timings["denoise_s"]
    phases = {"denoise_event_s": seconds, "encode_s": result.timings.get("encode_s"),
              "steps_s": list(result.timings.get("steps_s", [])),
              "host_steps_s": list(result.timings.get("host_steps_s", [])), "host_probe_ms": probe}
    return result, seconds, phases
