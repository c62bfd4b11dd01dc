"""The host gate: timed generations held (bounded) for a fast phase of the host, waits outside every budget."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.base_models.diffusion_model.runner import BETWEEN_STEPS
from worldfoundry.bench.harness import BenchConfig, host_hold_s, plan_bench
from worldfoundry.bench.host_gate import CALIBRATION_CHECKS, POLL_S, PROBES_PER_CHECK, HostGate, describe
from worldfoundry.bench.timing import timed_generate
from worldfoundry.errors import BenchArgumentError


class FakeHost:
    """Probes read from a schedule (the last value repeats); ``sleep`` advances a fake clock."""

    def __init__(self, values: list[float]) -> None:
        self.values = list(values)
        self.now = 0.0
        self.slept = 0

    def probe(self) -> float:
        return self.values.pop(0) if len(self.values) > 1 else self.values[0]

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += 1

    def clock(self) -> float:
        return self.now


def _gate(values: list[float], **kwargs) -> tuple[HostGate, FakeHost]:
    host = FakeHost([1.0] * CALIBRATION_CHECKS * PROBES_PER_CHECK + values)
    return HostGate(probe=host.probe, sleep=host.sleep, clock=host.clock, **kwargs), host


def test_a_fast_host_is_never_held() -> None:
    gate, host = _gate([1.1, 1.0, 1.2])
    assert gate.wait() == pytest.approx(1.1)  # the median of three probes
    assert gate.to_json() == {"budget_s": 60.0, "max_wait_s": 3.0, "tolerance": 0.25, "reference_ms": 1.0,
                              "checks": 1, "held": 0, "waited_s": 0.0, "gave_up": 0, "limited": 0}
    assert host.slept == 0


def test_a_slow_phase_is_waited_out() -> None:
    # one slow check, then the host is fast again after two polls
    gate, host = _gate([1.8] * PROBES_PER_CHECK * 3 + [1.05])
    assert gate.wait() == pytest.approx(1.05)
    report = gate.to_json()
    assert report["held"] == 1 and report["gave_up"] == 0
    assert report["waited_s"] == pytest.approx(3 * POLL_S)
    assert gate.clock() == pytest.approx(host.now - report["waited_s"]) == pytest.approx(0.0)


def test_a_slow_phase_longer_than_the_wait_is_timed_anyway() -> None:
    gate, _ = _gate([1.9], max_wait_s=0.5)
    assert gate.wait() == pytest.approx(1.9)
    report = gate.to_json()
    assert report["held"] == report["gave_up"] == 1
    assert 0.5 <= report["waited_s"] <= 0.5 + POLL_S


def test_the_run_budget_bounds_all_waits() -> None:
    gate, _ = _gate([2.0], budget_s=1.0, max_wait_s=0.7)
    for _ in range(5):
        gate.wait()
    report = gate.to_json()
    assert report["checks"] == 5 and report["gave_up"] == report["held"]
    assert report["waited_s"] <= 1.0 + POLL_S
    assert "timed while still slow" in describe(report)


def test_budget_zero_probes_but_never_waits() -> None:
    gate, host = _gate([3.0], budget_s=0.0)
    assert gate.wait() == pytest.approx(3.0)
    assert host.slept == 0 and gate.to_json()["held"] == 0
    assert describe(gate.to_json()) == "off (--host-hold 0)"
    assert describe(None).startswith("off")


def test_the_reference_is_a_low_quantile_not_one_lucky_check() -> None:
    # one fast check, then the host's usual speed: seven calibration checks at 1.0, the lucky 0.5, four more at 1.0
    gate, _ = _gate([0.5] * PROBES_PER_CHECK + [1.0] * PROBES_PER_CHECK * 4 + [0.5])
    values = [gate.check_ms() for _ in range(5)]
    assert values == [0.5, 1.0, 1.0, 1.0, 1.0]
    assert gate.reference_ms == pytest.approx(1.0)  # the 10th percentile of twelve checks is the second fastest
    assert not gate.slow(1.2) and gate.slow(1.3)
    for _ in range(20):  # once the host runs faster for a while, the reference follows
        gate.check_ms()
    assert gate.reference_ms == pytest.approx(0.5)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"budget_s": -1.0}, "budget_s: must be >= 0 seconds, got -1.0"),
    ({"max_wait_s": float("nan")}, "max_wait_s: must be >= 0 seconds"),
    ({"tolerance": 0.0}, "tolerance: must be > 0, got 0.0"),
])
def test_bad_options_are_refused(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        HostGate(probe=lambda: 1.0, **kwargs)


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.floats(0.5, 3.0), min_size=1, max_size=200), budget=st.floats(0.0, 2.0),
       wait=st.floats(0.0, 1.0), calls=st.integers(1, 20))
def test_waits_never_exceed_the_budget_and_counts_are_consistent(values, budget, wait, calls) -> None:
    gate, _ = _gate(values, budget_s=budget, max_wait_s=wait)
    for _ in range(calls):
        gate.wait()
    report = gate.to_json()
    assert report["waited_s"] <= budget + POLL_S + 1e-9
    assert 0 <= report["gave_up"] <= report["held"] <= report["checks"] == calls


def test_timed_generate_goes_through_the_runner_gate() -> None:
    calls = []

    class Gate:
        budget_s = 60.0

        def wait(self) -> float:
            calls.append("wait")
            return 1.25

    class Denoiser:
        def prepare_request_schedule(self) -> None:
            return None

        def end_request(self) -> None:
            return None

    den = Denoiser()

    def generate(seed: int, tag: str):
        den.prepare_request_schedule()
        hook = BETWEEN_STEPS.get()  # the runner calls it before each step
        hook()
        time.sleep(0.02)
        den.end_request()
        calls.append(("generate", seed, tag))
        return SimpleNamespace(timings={"denoise_s": 0.5, "steps_s": [0.25, 0.25], "between_steps_s": 0.015})

    import torch

    runner = SimpleNamespace(pipe=SimpleNamespace(components=SimpleNamespace(denoiser=den),
                                                  policy=SimpleNamespace(device=torch.device("cpu"))),
                             generate=generate, host_gate=Gate())
    _, seconds, phases = timed_generate(runner, 42, "x")
    assert calls == ["wait", "wait", ("generate", 42, "x")]
    assert phases["host_probe_ms"] == 1.25
    assert 0.02 - 0.015 <= seconds < 0.02  # the loop's time without the waits between steps
    assert BETWEEN_STEPS.get() is None  # reset after the generation
    Gate.budget_s = 0.0  # a gate without budget probes before the generation but never between steps
    calls.clear()
    with pytest.raises(TypeError):
        timed_generate(runner, 42, "x")  # the fake calls the hook unconditionally: None is not callable
    assert calls == ["wait"] and BETWEEN_STEPS.get() is None


def test_default_hold_is_on_for_gpus_and_off_for_the_cpu() -> None:
    assert host_hold_s(BenchConfig(device="cuda")) == 60.0
    assert host_hold_s(BenchConfig(device="cuda:1")) == 60.0
    assert host_hold_s(BenchConfig(device="cpu")) == 0.0
    assert host_hold_s(BenchConfig(device="cpu", host_hold_s=5.0)) == 5.0


def test_a_bad_hold_is_refused_before_anything_is_built(tmp_path) -> None:
    with pytest.raises(BenchArgumentError, match="--host-hold: expected 0 to 3600 seconds"):
        plan_bench(BenchConfig(out=str(tmp_path / "out"), host_hold_s=-2.0))
    assert not (tmp_path / "out").exists()


def test_the_step_floor_times_every_candidate_at_least_four_rounds() -> None:
    from worldfoundry.bench.floor import MIN_ROUNDS
    from worldfoundry.bench.harness import _timing_policy

    assert MIN_ROUNDS == 4
    assert _timing_policy(BenchConfig(), 3, 1).min_rounds == 4
    assert _timing_policy(BenchConfig(), 3, 3).min_rounds == 6  # two per seed
    assert _timing_policy(BenchConfig(estimator="paired_median"), 3, 1).min_rounds == 3
