"""Timing logic with injected measurements: stopping rule, receipts bound, noisy-host rule, loop timer."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.bench.stats import decide, decision_threshold, verdict_low
from worldfoundry.bench.timing import (
    LoopTimer,
    TimingPolicy,
    WidthPool,
    bound_violation,
    ci_halfwidth,
    model_calls,
    noisy_host,
    run_rounds,
    speed_bound,
    undecided,
)


def _fake_clock(step: float):
    counter = itertools.count()
    return lambda: next(counter) * step


def test_stops_at_min_rounds_when_pairs_agree() -> None:
    out = run_rounds(lambda r: (2.0, 1.0), TimingPolicy(min_rounds=3, max_rounds=10), clock=_fake_clock(0.0))
    assert out["rounds"] == 3 and out["stopped"] == "target" and out["speedup"] == 2.0
    assert out["halfwidth"] == 0.0


def test_noisy_pairs_run_to_max_rounds() -> None:
    noisy = [(1.0, 0.5), (1.0, 2.0)] * 20
    out = run_rounds(lambda r: noisy[r], TimingPolicy(min_rounds=3, max_rounds=7, budget_s=1e9),
                     clock=_fake_clock(0.0))
    assert out["rounds"] == 7 and out["stopped"] == "max_rounds" and out["halfwidth"] > 0.02


def test_time_budget_stops_adding_rounds() -> None:
    noisy = [(1.0, 0.5), (1.0, 2.0)] * 20
    out = run_rounds(lambda r: noisy[r], TimingPolicy(min_rounds=3, max_rounds=30, budget_s=4.0),
                     clock=_fake_clock(1.0))
    assert out["stopped"] == "budget" and 3 <= out["rounds"] < 30


def test_an_undecided_candidate_gets_rounds_past_the_budget() -> None:
    # ratios 0.9 / 1.2 alternate: the CI straddles a threshold of 1.02 for as long as the rounds go on
    noisy = [(1.0, 1 / 0.9), (1.0, 1 / 1.2)] * 20
    base = TimingPolicy(min_rounds=3, max_rounds=30, budget_s=4.0, estimator="paired_median")
    plain = run_rounds(lambda r: noisy[r], base, clock=_fake_clock(1.0))
    extended = run_rounds(lambda r: noisy[r], TimingPolicy(**{**base.__dict__, "threshold": 1.02}),
                          clock=_fake_clock(1.0))
    assert plain["stopped"] == "budget" and plain["extended"] == 0
    assert extended["stopped"] == "budget" and extended["rounds"] > plain["rounds"]
    assert extended["extended"] == extended["rounds"] - plain["rounds"]
    # never past extend_factor x the budget: the clock is read once per round from the third round on, so 8
    # ticks of this 1-second clock are rounds 3..10
    assert extended["rounds"] == 10


def test_a_decided_candidate_is_not_extended() -> None:
    clearly_faster = [(1.0, 0.5), (1.0, 0.45)] * 20
    policy = TimingPolicy(min_rounds=3, max_rounds=30, budget_s=4.0, threshold=1.02, estimator="paired_median")
    out = run_rounds(lambda r: clearly_faster[r], policy, clock=_fake_clock(1.0))
    assert out["extended"] == 0 and out["stopped"] == "budget"


def test_a_decided_but_wide_candidate_draws_on_the_runs_width_pool() -> None:
    """Past its budget a decided candidate whose CI is wider than the target gets rounds while the run's pool has
    seconds left; their time is charged to the pool, and only the pool and max_rounds bound them."""
    wide = [(1.0, 0.5), (1.0, 0.45)] * 20  # clearly faster (decided), CI about 5 % wide
    pool = WidthPool(0.5)
    policy = TimingPolicy(min_rounds=3, max_rounds=30, budget_s=4.0, threshold=1.02, estimator="paired_median",
                          width_pool=pool)
    out = run_rounds(lambda r: wide[r], policy, clock=_fake_clock(1.0))
    assert out["widened"] == out["extended"] > 0 and out["stopped"] == "budget"
    assert pool.spent >= 0.5 and pool.left == 0.0
    plain = run_rounds(lambda r: wide[r], replace(policy, width_pool=None), clock=_fake_clock(1.0))
    assert plain["widened"] == 0 and out["rounds"] > plain["rounds"]
    # an empty pool extends nothing; a large one runs to max_rounds (past extend_factor x the budget)
    assert run_rounds(lambda r: wide[r], policy, clock=_fake_clock(1.0))["widened"] == 0
    big = run_rounds(lambda r: wide[r], replace(policy, width_pool=WidthPool(1e9)), clock=_fake_clock(1.0))
    assert big["rounds"] == 30 and big["stopped"] == "max_rounds" and big["widened"] > out["widened"]


def test_a_narrow_candidate_leaves_the_pool_alone() -> None:
    pool = WidthPool(10.0)
    out = run_rounds(lambda r: (2.0, 1.0), TimingPolicy(min_rounds=3, max_rounds=10, width_pool=pool),
                     clock=_fake_clock(1.0))
    assert out["stopped"] == "target" and out["widened"] == 0 and pool.spent == 0.0
    with pytest.raises(ValueError, match="width pool"):
        WidthPool(-1.0)


@pytest.mark.parametrize(("ci", "threshold", "expected"), [
    ((0.98, 1.05), 1.02, True), ((1.03, 1.05), 1.02, False), ((0.9, 1.01), 1.02, False), ((0.9, 1.1), None, False),
    ((float("nan"), 1.1), 1.02, False), ((1.02, 1.1), 1.02, True)])
def test_undecided(ci, threshold, expected) -> None:
    assert undecided({"ci95": list(ci)}, threshold) is expected


@pytest.mark.parametrize(("ci", "margin", "expected"), [
    ((1.025, 1.06), 0.01, True), ((1.025, 1.06), 0.0, False), ((1.031, 1.06), 0.01, False),
    ((0.98, 1.01), 0.01, False), ((0.98, 1.05), 0.01, True)])
def test_a_lower_bound_just_above_the_threshold_is_undecided(ci, margin, expected) -> None:
    """A CI whose lower bound clears the threshold by less than the margin gives a verdict a repeat may not."""
    assert undecided({"ci95": list(ci)}, 1.02, margin) is expected


def test_a_narrow_ci_just_above_the_threshold_gets_rounds_until_the_extended_budget() -> None:
    steady = [(1.0, 1 / 1.025)] * 40  # 1.025x every round: a CI of zero width, 0.5 % above a threshold of 1.02
    base = TimingPolicy(min_rounds=3, max_rounds=30, budget_s=4.0, threshold=1.02, estimator="paired_median")
    out = run_rounds(lambda r: steady[r], base, clock=_fake_clock(1.0))
    assert out["halfwidth"] == 0.0 and out["extended"] > 0 and out["rounds"] == 10
    plain = run_rounds(lambda r: steady[r], replace(base, verdict_margin=0.0), clock=_fake_clock(1.0))
    assert plain["rounds"] == 3 and plain["stopped"] == "target" and plain["extended"] == 0
    clear = run_rounds(lambda r: (1.0, 1 / 1.05), base, clock=_fake_clock(1.0))  # 2.9 % above: decided
    assert clear["rounds"] == 3 and clear["extended"] == 0
    with pytest.raises(ValueError, match="verdict_margin"):
        TimingPolicy(verdict_margin=1.5)


def test_extend_factor_is_validated() -> None:
    with pytest.raises(ValueError, match="extend_factor"):
        TimingPolicy(extend_factor=0.5)


def test_min_gain_sets_the_threshold_of_recommended() -> None:
    assert decision_threshold(1.004, 0.02) == pytest.approx(1.02)
    assert decision_threshold(1.05, 0.02) == pytest.approx(1.05)
    assert decision_threshold(1.0, -0.1) == 1.0
    base = dict(installed=True, finite=True, executed=True, exact_ok=True, timing_ok=True, quality_ok=True,
                speed={"ci95": [1.015, 1.15], "speedup": 1.03}, gpu_shared=False, noise_floor=1.004)
    assert decide(**base) == "recommended"  # no minimum gain: above the noise floor is enough
    assert decide(**base, min_gain=0.02) == "no_stable_gain"  # a gain the 2 % timing cannot resolve
    assert decide(**{**base, "speed": {"ci95": [1.021, 1.15], "speedup": 1.08}}, min_gain=0.02) == "recommended"


def test_a_gain_measured_against_a_slowed_dense_arm_is_not_called_stable() -> None:
    """W17 on an H200, run B3: ``mha-fused`` (0.98-0.99x on quiet hosts) read 1.067x [1.036, 1.163] against a
    dense arm 12.3 % above the run's dense floor; the candidate was host-bound, so its pair's estimate was kept."""
    base = dict(installed=True, finite=True, executed=True, exact_ok=True, timing_ok=True, quality_ok=True,
                gpu_shared=False, noise_floor=1.0, min_gain=0.02)
    slowed = {"ci95": [1.036, 1.163], "speedup": 1.067, "dense_excess": 0.123, "dense_floor_source": "pair"}
    assert decide(**base, speed=slowed) == "no_stable_gain"
    # against the run's dense floor (a device-bound candidate), or with no slowed arm, the CI stands as measured
    assert decide(**base, speed={**slowed, "dense_floor_source": "run_reference"}) == "recommended"
    assert decide(**base, speed={k: v for k, v in slowed.items() if k != "dense_floor_source"}) == "recommended"
    # a gain that clears the threshold even after the excess is taken out stays recommended
    assert decide(**base, speed={**slowed, "ci95": [1.25, 1.4], "speedup": 1.3}) == "recommended"


@settings(max_examples=60, deadline=None)
@given(st.floats(0.5, 3.0), st.floats(0.0, 1.0), st.sampled_from(["pair", "run_reference", None]))
def test_the_verdict_bound_never_exceeds_the_measured_one(low, excess, source) -> None:
    speed = {"ci95": [low, low * 1.1], "dense_excess": excess}
    if source is not None:
        speed["dense_floor_source"] = source
    bound = verdict_low(speed)
    assert bound <= low
    if source != "pair":
        assert bound == low
    assert bound == pytest.approx(low / (1.0 + excess) if source == "pair" else low)


def test_rounds_added_until_the_ci_narrows() -> None:
    # a few noisy rounds first, then steady ones: the rule must stop once the CI has narrowed, not before
    data = [(1.0, 0.5), (1.0, 1.0), (1.0, 0.8)] + [(1.0, 0.8)] * 40
    out = run_rounds(lambda r: data[r], TimingPolicy(min_rounds=3, max_rounds=40, target_halfwidth=0.02,
                                                    budget_s=1e9), clock=_fake_clock(0.0))
    assert out["stopped"] == "target" and 3 < out["rounds"] < 40
    assert ci_halfwidth(out) <= 0.02


@pytest.mark.parametrize("kwargs", [dict(min_rounds=2), dict(max_rounds=2), dict(target_halfwidth=0.0),
                                    dict(budget_s=0.0)])
def test_policy_rejects_bad_values(kwargs) -> None:
    with pytest.raises(ValueError):
        TimingPolicy(**kwargs)


def test_receipts_bound() -> None:
    calls = model_calls({"steps": 8, "guidance": 5.0})
    assert calls == 16 and model_calls({"steps": 8, "guidance": 1.0}) == 8
    bound = speed_bound({"easycache": {"steps": 6}}, calls)
    assert bound == pytest.approx(1.6)
    assert speed_bound({}, calls) is None
    assert speed_bound({"c": {"steps": 16}}, 16) == float("inf")
    # a cache that skipped nothing cannot beat the dense model (H200 W17: easycache-0.1 skipped none of its calls
    # and was timed 1.098x on a host in slow phases)
    assert speed_bound({"easycache": {}}, calls) == 1.0 == speed_bound({"easycache": {"steps": 0}}, calls)
    assert "exceeds the receipts bound" in bound_violation({"speedup": 1.098}, 1.0, 0.05)
    # with a plugin that is not a cache in the stack, n / k bounds nothing
    assert speed_bound({"easycache": {"steps": 6}}, calls, plugins={"easycache": {}}) == pytest.approx(1.6)
    assert speed_bound({"easycache": {"steps": 6}}, calls, plugins=["easycache", "cuda_graph"]) is None
    # the measured 21.1x of a cache that skipped 6 of 16 calls is impossible; 1.62x is within tolerance
    assert "exceeds the receipts bound" in bound_violation({"speedup": 21.1}, bound, 0.05)
    assert bound_violation({"speedup": 1.62}, bound, 0.05) is None
    assert bound_violation(None, bound, 0.05) is None


def test_invalid_timing_and_noisy_verdicts() -> None:
    speed = {"ci95": [1.5, 1.7], "speedup": 1.6}
    base = dict(installed=True, finite=True, executed=True, exact_ok=True, timing_ok=True, quality_ok=True,
                speed=speed, gpu_shared=False)
    assert decide(**base) == "recommended"
    assert decide(**base, bound_ok=False) == "invalid_timing"
    assert decide(**base, noisy=True) == "noisy_host"
    assert decide(**{**base, "quality_ok": False}, noisy=True) == "measured_quality_tradeoff"


def test_noisy_host_banner_states_threshold() -> None:
    policy = TimingPolicy(max_noise_floor=1.05)
    assert noisy_host(1.02, policy) is None
    banner = noisy_host(1.9, policy)
    assert "1.900" in banner and "1.050" in banner and "no speed verdicts" in banner


class _Den:
    def prepare_request_schedule(self, rid, schedule):
        return "p"

    def end_request(self, rid):
        return "e"


def test_loop_timer_restores_the_methods() -> None:
    den = _Den()
    with LoopTimer(den, torch.device("cpu")) as timer:
        assert den.prepare_request_schedule("r", None) == "p"
        assert den.end_request("r") == "e"
    assert timer.seconds is not None and timer.seconds >= 0.0
    assert "prepare_request_schedule" not in vars(den) and "end_request" not in vars(den)


@pytest.mark.parametrize(("min_rounds", "max_rounds"), [(3, 3), (3, 12), (8, 20)])
def test_control_pairs_get_more_rounds_and_time_than_candidates(min_rounds, max_rounds) -> None:
    from worldfoundry.bench.harness import CONTROL_MIN_ROUNDS, control_policy

    policy = TimingPolicy(min_rounds=min_rounds, max_rounds=max_rounds, budget_s=5.0)
    control = control_policy(policy)
    assert control.min_rounds == max(min_rounds, CONTROL_MIN_ROUNDS)
    assert control.max_rounds >= max(control.min_rounds, max_rounds)
    assert control.budget_s == 10.0
    assert control.target_halfwidth == policy.target_halfwidth / 2
    # with a steady host every control round is run: the noise floor is never the largest of 3 ratios
    ticks = itertools.count()
    out = run_rounds(lambda r: (1.0, 1.0), control, clock=lambda: float(next(ticks)))
    assert out["rounds"] >= CONTROL_MIN_ROUNDS


def test_timed_requests_run_with_the_garbage_collector_paused() -> None:
    import gc

    from worldfoundry.bench.timing import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block leaves it as it found it
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("a failing request")
    assert gc.isenabled()


class _SharedModel:
    """A model two arms share: switching costs one slow first call, which only the untimed warm-up may pay."""

    def __init__(self) -> None:
        self.state = "dense"
        self.fresh = False
        self.log: list[tuple[str, str, int]] = []

    def arm(self, name: str, seconds: float):
        from worldfoundry.bench.timing import Arm

        def activate() -> bool:
            if self.state == name:
                return False
            self.state, self.fresh = name, True
            return True

        def call(kind: str, seed: int) -> float:
            assert self.state == name
            self.log.append((kind, name, seed))
            cost = seconds + (5.0 if self.fresh else 0.0)
            self.fresh = False
            return cost

        return Arm(activate, lambda r, seed: call("timed", seed), lambda seed: call("warm", seed))


@pytest.mark.parametrize("start", ["dense", "candidate"])
def test_switching_pairs_keep_the_cost_of_a_switch_out_of_both_arms(start) -> None:
    from worldfoundry.bench.timing import switching_pairs

    model = _SharedModel()
    model.state = start
    out = switching_pairs(model.arm("dense", 2.0), model.arm("candidate", 1.0), [42, 43],
                          TimingPolicy(min_rounds=5, max_rounds=5), clock=_fake_clock(0.0))
    assert out["dense_s"] == [2.0] * 5 and out["candidate_s"] == [1.0] * 5 and out["speedup"] == 2.0
    timed = [(arm, seed) for kind, arm, seed in model.log if kind == "timed"]
    # blocks of two rounds, the first side alternating per block; the seed cycles per round; the last block is cut
    # at max_rounds
    assert timed == [("dense", 42), ("dense", 43), ("candidate", 42), ("candidate", 43),
                     ("candidate", 42), ("candidate", 43), ("dense", 42), ("dense", 43),
                     ("dense", 42), ("candidate", 42)]
    # one switch per block (plus the first one when the model started on the candidate), each warmed once
    assert out["warmups"] == 3 + (start == "candidate") and out["switch_block"] == 2
    warms = [i for i, entry in enumerate(model.log) if entry[0] == "warm"]
    assert all(model.log[i + 1][:2] == ("timed", model.log[i][1]) for i in warms)


def test_switching_pairs_start_on_the_warm_side() -> None:
    """The bench's candidates: installed and warm (their pilot ran) when their pairs start, so the candidate goes
    first and four rounds need two warm-ups, not three (and end installed: no install just to uninstall)."""
    from worldfoundry.bench.timing import switching_pairs

    model = _SharedModel()
    model.state = "candidate"
    out = switching_pairs(model.arm("dense", 2.0), model.arm("candidate", 1.0), [42],
                          TimingPolicy(min_rounds=4, max_rounds=4), clock=_fake_clock(0.0), first="candidate")
    assert out["dense_s"] == [2.0] * 4 and out["candidate_s"] == [1.0] * 4
    assert [arm for kind, arm, _ in model.log if kind == "timed"] == ["candidate"] * 2 + ["dense"] * 4 + \
        ["candidate"] * 2
    assert out["warmups"] == 2 and out["first_side"] == "candidate" and model.state == "candidate"
    with pytest.raises(ValueError, match="first must be 'dense' or 'candidate', got 'peer'"):
        switching_pairs(model.arm("dense", 2.0), model.arm("candidate", 1.0), [42], TimingPolicy(), first="peer")


@settings(max_examples=40, deadline=None)
@given(rounds=st.integers(3, 12), block=st.integers(1, 4), n_seeds=st.integers(1, 3),
       first=st.sampled_from(["dense", "candidate"]))
def test_switching_pairs_pair_each_round_on_one_seed(rounds, block, n_seeds, first) -> None:
    """Every round pairs both sides on the same seed, each side runs each round once, no round is left out."""
    from worldfoundry.bench.timing import Timed, switching_pairs

    model = _SharedModel()
    seeds = [42 + i for i in range(n_seeds)]

    def arm(name: str, seconds: float):
        base = model.arm(name, seconds)
        return base.__class__(base.activate, lambda r, seed: Timed(base.timed(r, seed), (1.0,), (r, seed)),
                              base.warm)

    out = switching_pairs(arm("dense", 2.0), arm("candidate", 1.0), seeds,
                          TimingPolicy(min_rounds=rounds, max_rounds=rounds), clock=_fake_clock(0.0), block=block,
                          first=first)
    assert out["rounds"] == rounds
    assert out["groups"] == [(r, seeds[r % n_seeds]) for r in range(rounds)]
    assert out["warmups"] <= -(-rounds // block) + 1


def test_switching_pairs_without_warmup_would_have_been_biased() -> None:
    """The same shared model timed by plain alternation: every switch's cost lands in a timed call."""
    model = _SharedModel()
    dense, cand = model.arm("dense", 2.0), model.arm("candidate", 1.0)

    def pair(r: int) -> tuple[float, float]:
        d = (dense.activate(), dense.timed(r, 42))[1]
        return d, (cand.activate(), cand.timed(r, 42))[1]

    out = run_rounds(pair, TimingPolicy(min_rounds=3, max_rounds=3), clock=_fake_clock(0.0))
    assert out["candidate_s"] == [6.0] * 3


def test_timing_policy_names_a_bad_estimator() -> None:
    with pytest.raises(ValueError, match="estimator: expected one of step_floor, paired_median"):
        TimingPolicy(estimator="mean")


def _steps(seconds: float, n: int = 4):
    from worldfoundry.bench.timing import Timed

    return Timed(seconds * n, (seconds,) * n, 42)


def test_dense_floor_reference_keeps_per_seed_step_minima() -> None:
    from worldfoundry.bench.floor import DenseFloorReference

    ref = DenseFloorReference()
    assert ref.floor([42]) is None
    ref.update([[0.08, 0.09], [0.09, 0.07], [0.05]], [42, 42, 42])  # the one-step round cannot line up: ignored
    assert ref.floor([42]) == pytest.approx(0.15)
    assert ref.floor([42, 43]) is None
    ref.update([[1.0, 1.0]], [43])
    assert ref.floor([42, 43, 42]) == pytest.approx(2.15)
    assert ref.to_json() == {"42": pytest.approx(0.15), "43": pytest.approx(2.0)}


def test_a_pair_timed_in_a_slow_phase_gets_more_rounds() -> None:
    from worldfoundry.bench.floor import DenseFloorReference

    ref = DenseFloorReference()
    ref.update([[0.080] * 4], [42])
    # the host is 10 % slower for the first three rounds on both arms (a narrow CI, but an inflated dense floor),
    # then back to normal: the rule keeps timing until the dense floor is back within 2 % of the reference
    samples = [(_steps(0.088), _steps(0.0704))] * 3 + [(_steps(0.080), _steps(0.064))] * 10
    policy = TimingPolicy(min_rounds=3, max_rounds=12, budget_s=100.0, dense_reference=ref)
    out = run_rounds(lambda r: samples[r], policy, clock=_fake_clock(1.0))
    assert out["rounds"] == 4 and out["extended"] == 1 and out["stopped"] == "target"
    assert out["dense_excess"] == pytest.approx(0.0)
    plain = run_rounds(lambda r: samples[r], TimingPolicy(min_rounds=3, max_rounds=12, budget_s=100.0),
                       clock=_fake_clock(1.0))
    assert plain["rounds"] == 3 and plain["dense_excess"] is None


def test_a_slow_dense_arm_is_not_timed_again_when_the_verdict_cannot_change() -> None:
    """A dense arm in a slow phase inflates the speedup; a CI whose upper bound is under the threshold even so gives
    ``no_stable_gain`` either way, so no rounds are added for it."""
    from worldfoundry.bench.floor import DenseFloorReference

    ref = DenseFloorReference()
    ref.update([[0.080] * 4], [42])
    samples = [(_steps(0.088), _steps(0.0880))] * 3 + [(_steps(0.080), _steps(0.0800))] * 10  # 1.0x throughout
    policy = TimingPolicy(min_rounds=3, max_rounds=12, budget_s=100.0, dense_reference=ref, threshold=1.02)
    out = run_rounds(lambda r: samples[r], policy, clock=_fake_clock(1.0))
    assert out["rounds"] == 3 and out["extended"] == 0 and out["dense_excess"] == pytest.approx(0.1)
    # the same slow phase under a candidate that could reach the threshold: timed until the phase has passed
    gaining = [(_steps(0.088), _steps(0.0704))] * 3 + [(_steps(0.080), _steps(0.064))] * 10
    assert run_rounds(lambda r: gaining[r], policy, clock=_fake_clock(1.0))["extended"] == 1


def test_a_slow_phase_that_never_ends_stops_at_the_extended_budget() -> None:
    from worldfoundry.bench.floor import DenseFloorReference

    ref = DenseFloorReference()
    ref.update([[0.080] * 4], [42])
    policy = TimingPolicy(min_rounds=3, max_rounds=50, budget_s=4.0, dense_reference=ref)
    out = run_rounds(lambda r: (_steps(0.1), _steps(0.08)), policy, clock=_fake_clock(1.0))
    assert out["stopped"] == "target" and out["rounds"] == 10 and out["dense_excess"] == pytest.approx(0.25)
    # the dense arm never left the slow phase, but nothing says the candidate was bound by the device (no host
    # times recorded): the pair's own estimate stands
    assert out["dense_floor_source"] == "pair" and out["candidate_host_share"] is None
    assert out["speedup"] == pytest.approx(1.25) == out["pair_estimate"]["speedup"]


def _hosted(seconds: float, share: float, n: int = 4):
    """A sample whose steps kept the host busy for ``share`` of their time."""
    from worldfoundry.bench.timing import Timed

    return Timed(seconds * n, (seconds,) * n, 42, host_steps=(seconds * share,) * n)


def test_a_slowed_dense_arm_gives_way_to_the_reference_only_for_a_device_bound_candidate() -> None:
    from worldfoundry.bench.floor import DenseFloorReference

    ref = DenseFloorReference()
    ref.update([[0.080] * 4], [42])
    policy = TimingPolicy(min_rounds=4, max_rounds=4, budget_s=100.0, dense_reference=ref)
    # a dense arm 1 % above the reference (within the 2 % target): the pair's own floor stands, nothing recorded
    near = run_rounds(lambda r: (_hosted(0.0808, 1.0), _hosted(0.064, 0.1)), policy, clock=_fake_clock(1.0))
    assert "dense_floor_source" not in near and near["speedup"] == pytest.approx(0.0808 / 0.064)
    # a dense arm 40 % slower in every round, a candidate the host does not slow (a CUDA graph: the host busy for
    # 10 % of each step): against its own dense arm it would read 1.75x; against the run's dense floor 1.25x,
    # its CI from the candidate's rounds
    jitter = [0.064, 0.0645, 0.064, 0.0641]
    slow = run_rounds(lambda r: (_hosted(0.112, 1.0), _hosted(jitter[r], 0.1)), policy, clock=_fake_clock(1.0))
    assert slow["dense_floor_source"] == "run_reference" and slow["candidate_host_share"] == pytest.approx(0.1)
    assert slow["speedup"] == pytest.approx(0.080 / 0.064) and slow["pair_estimate"]["speedup"] == pytest.approx(1.75)
    low, high = slow["ci95"]
    assert 0.080 / 0.0645 - 1e-9 <= low <= slow["speedup"] <= high <= 0.080 / 0.064 + 1e-9
    assert slow["reference_step_floor"]["dense_floor_s"] == pytest.approx(0.32)
    # the same slow phase with a host-bound candidate (host busy the whole step): it slowed with its dense arm,
    # so the pair's own ratio stands
    bound = run_rounds(lambda r: (_hosted(0.112, 1.0), _hosted(0.0896, 0.99)), policy, clock=_fake_clock(1.0))
    assert bound["dense_floor_source"] == "pair" and bound["speedup"] == pytest.approx(1.25)
    assert bound["candidate_host_share"] == pytest.approx(0.99)


def test_host_share_is_the_median_and_needs_aligned_times() -> None:
    from worldfoundry.bench.timing import host_share

    summary = {"steps_s": {"candidate": [[0.1, 0.1], [0.1, 0.2]]}, "host_steps_s": {"candidate": [[0.01, 0.05],
                                                                                                  [0.02, 0.2]]}}
    assert host_share(summary) == pytest.approx(0.35)  # shares 0.1, 0.5, 0.2, 1.0
    assert host_share({"steps_s": {"candidate": [[0.1]]}, "host_steps_s": {"candidate": [[]]}}) is None
    assert host_share({"steps_s": {"candidate": [[0.1]]}}) is None


@settings(max_examples=60, deadline=None)
@given(ratios=st.lists(st.floats(0.5, 2.0), min_size=3, max_size=40), threshold=st.floats(0.9, 1.2),
       budget=st.integers(1, 10), factor=st.floats(1.0, 3.0))
def test_rounds_never_pass_the_extended_budget(ratios, threshold, budget, factor) -> None:
    policy = TimingPolicy(min_rounds=3, max_rounds=40, budget_s=float(budget), threshold=threshold,
                          extend_factor=factor, estimator="paired_median")
    data = ratios + [ratios[-1]] * 40
    out = run_rounds(lambda r: (1.0, 1.0 / data[r]), policy, clock=_fake_clock(1.0))
    # the clock reads 1, 2, ... from the third round on: past factor x budget no round is added
    assert out["rounds"] <= min(40, int(factor * budget) + 3)
    assert out["extended"] <= out["rounds"] - 3


@settings(max_examples=50, deadline=None)
@given(slow=st.floats(1.0, 2.0), cand=st.lists(st.floats(0.03, 0.09), min_size=4, max_size=4))
def test_the_reference_estimate_never_raises_a_speedup(slow: float, cand: list[float]) -> None:
    from worldfoundry.bench.floor import DenseFloorReference

    ref = DenseFloorReference()
    ref.update([[0.080] * 4], [42])
    policy = TimingPolicy(min_rounds=4, max_rounds=4, budget_s=100.0, dense_reference=ref)
    out = run_rounds(lambda r: (_hosted(0.080 * slow, 1.0), _hosted(cand[r], 0.2)), policy, clock=_fake_clock(1.0))
    if "dense_floor_source" in out:
        assert slow > 1.02 and out["speedup"] <= out["pair_estimate"]["speedup"] * (1 + 1e-12)
        assert out["dense_floor_source"] == "run_reference"
    else:
        assert slow <= 1.02 + 1e-9
