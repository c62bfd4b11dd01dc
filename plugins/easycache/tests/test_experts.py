"""Wan2.2-style routed experts: per-expert phases, warm-up and final gates, and every schedule error."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.schedule import RequestSchedule, SchedulePhase
from worldfoundry.errors import RequestError

HUGE = 1e30


def _install(experts, registry, **options):
    spec = {"easycache": {"threshold": HUGE, "warmup_steps": 2, "final_dense_steps": 1, **options}}
    return install_diffusion_accelerations(experts, spec, registry=registry)


def _summary(session, expert, request_id):
    return session.execution_report()["plugins"]["easycache"][expert]["requests"][request_id]["notes"]["easycache"]


def _expected(length, warmup, final):
    return "".join("C" if i < max(warmup, 2) or i >= length - final else "S" for i in range(length))


@pytest.fixture
def experts(helpers):
    return {"high": helpers.tiny_wan(0), "low": helpers.tiny_wan(1)}


def test_threshold_zero_is_bitwise_dense_for_routed_experts(helpers, registry, experts):
    loop = helpers.loop(experts)
    schedule = helpers.split_schedule(6, 3)
    dense = loop.run("dense", helpers.inputs(), 6, schedule=schedule)
    session = install_diffusion_accelerations(experts, {"easycache": {"threshold": 0.0}}, registry=registry)
    cached = loop.run("r1", helpers.inputs(), 6, schedule=schedule)
    assert torch.equal(cached.latents, dense.latents)
    assert _summary(session, "high", "r1")["branches"]["cond"]["pattern"] == "CCC"
    assert _summary(session, "low", "r1")["phase"] == {"expert": "low", "start": 3, "length": 3}
    session.uninstall()


def test_each_expert_gates_within_its_own_phase(helpers, registry, experts):
    loop = helpers.loop(experts)
    session = _install(experts, registry, warmup_steps=2, final_dense_steps=1)
    loop.run("r1", helpers.inputs(), 10, schedule=helpers.split_schedule(10, 4))
    high = _summary(session, "high", "r1")
    low = _summary(session, "low", "r1")
    assert high["phase"] == {"expert": "high", "start": 0, "length": 4}
    assert low["phase"] == {"expert": "low", "start": 4, "length": 6}
    # the low-noise expert starts from zero: its own warm-up, its own final dense step
    assert high["branches"]["cond"]["pattern"] == "CCSC"
    assert low["branches"]["cond"]["pattern"] == "CCSSSC"
    assert high["branches"]["uncond"]["pattern"] == "CCSC"
    assert high["outcome"] == low["outcome"] == "completed"
    for expert in ("high", "low"):
        handle = session.handles("easycache")[expert]
        assert handle.held_tensors() == [] and handle.active_requests() == ()
    session.uninstall()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    steps=st.integers(min_value=2, max_value=10),
    split=st.floats(min_value=0.0, max_value=1.0),
    warmup=st.integers(min_value=0, max_value=4),
    final=st.integers(min_value=0, max_value=3),
    decision=st.sampled_from(["cond", "separate"]),
)
def test_gate_positions_for_any_split(helpers, registry, experts, steps, split, warmup, final, decision):
    high_steps = min(max(1, round(split * steps)), steps - 1)
    session = _install(experts, registry, warmup_steps=warmup, final_dense_steps=final, branch_decision=decision)
    try:
        helpers.loop(experts).run("p", helpers.inputs(), steps, schedule=helpers.split_schedule(steps, high_steps))
        for expert, length in (("high", high_steps), ("low", steps - high_steps)):
            summary = _summary(session, expert, "p")
            assert summary["phase"]["length"] == length
            for branch in ("cond", "uncond"):
                assert summary["branches"][branch]["pattern"] == _expected(length, warmup, final)
    finally:
        session.uninstall()


def test_routed_experts_keep_separate_state(helpers, registry, experts):
    """The low expert's first steps never reuse a transformation of the high expert."""
    loop = helpers.loop(experts)
    session = _install(experts, registry, warmup_steps=0, final_dense_steps=0)
    loop.run("r1", helpers.inputs(), 6, schedule=helpers.split_schedule(6, 3))
    assert _summary(session, "high", "r1")["branches"]["cond"]["pattern"] == "CCS"
    assert _summary(session, "low", "r1")["branches"]["cond"]["pattern"] == "CCS"
    session.uninstall()


def test_routed_experts_without_schedule_use_the_context_phase(helpers, registry, experts):
    session = _install(experts, registry, warmup_steps=1, final_dense_steps=1)
    loop = helpers.loop(experts)
    schedule = helpers.split_schedule(8, 3)
    guard = loop.guard
    guard.begin_request("ctx")
    inputs = helpers.inputs()
    try:
        for i in range(8):
            place = schedule.locate(i)
            ctx = RequestContext("ctx", "cond", i, place.timestep, place.expert, 8, place.expert_step_index,
                                 place.expert_phase_length)
            with request_scope(ctx), torch.no_grad():
                experts[place.expert](hidden_states=inputs.latents * (1.0 - 0.05 * i),
                                      timestep=torch.tensor([place.timestep]),
                                      encoder_hidden_states=inputs.cond, return_dict=False)
    finally:
        guard.end_request("ctx")
    assert _summary(session, "low", "ctx")["branches"]["cond"]["pattern"] == "CCSSC"
    session.uninstall()


# ---------------------------------------------------------------------------------------------- errors
class Driver:
    """Direct calls to routed experts for the error tests."""

    def __init__(self, helpers, experts, session, schedule, request_id="e"):
        self.experts = experts
        self.schedule = schedule
        self.rid = request_id
        self.inputs = helpers.inputs()
        self.guard = helpers.loop(experts).guard
        self.guard.begin_request(request_id)
        session.prepare_request_schedule(request_id, schedule)

    def call(self, step, branch="cond", **changes):
        place = self.schedule.locate(step)
        fields = dict(request_id=self.rid, branch=branch, step_index=step, timestep=place.timestep,
                      expert=place.expert, num_steps=self.schedule.num_steps,
                      expert_step_index=place.expert_step_index, expert_phase_length=place.expert_phase_length)
        fields.update(changes)
        model = self.experts[fields.pop("model", place.expert)]
        with request_scope(RequestContext(**fields)), torch.no_grad():
            return model(hidden_states=self.inputs.latents, timestep=torch.tensor([place.timestep]),
                         encoder_hidden_states=self.inputs.cond if branch == "cond" else self.inputs.uncond,
                         return_dict=False)

    def end(self):
        self.guard.end_request(self.rid)


@pytest.fixture
def routed(helpers, registry, experts):
    session = _install(experts, registry)
    drivers = []

    def make(schedule=None, request_id="e"):
        driver = Driver(helpers, experts, session, schedule or helpers.split_schedule(6, 3), request_id)
        drivers.append(driver)
        return driver

    yield make, session
    for driver in drivers:
        if driver.rid in driver.guard.active_request_ids():
            try:
                driver.end()
            except RequestError:
                pass
    for expert in ("high", "low"):
        assert session.handles("easycache")[expert].held_tensors() == []
    session.uninstall()


def test_non_monotonic_schedules_are_rejected():
    with pytest.raises(RequestError, match="must not increase"):
        RequestSchedule.from_steps([900.0, 950.0, 100.0], ["high", "high", "low"])
    with pytest.raises(RequestError, match="high -> low noise monotonically"):
        RequestSchedule.from_steps([900.0, 500.0, 100.0], ["high", "low", "high"])
    with pytest.raises(RequestError, match="expert labels"):
        RequestSchedule.from_steps([900.0, 500.0], ["high"])


def test_malformed_schedule_objects_are_rejected(helpers, routed):
    make, session = routed
    driver = make()
    with pytest.raises(RequestError, match="already has a schedule"):
        session.prepare_request_schedule("e", helpers.split_schedule(6, 3))
    with pytest.raises(RequestError, match="never called"):  # a prepared phase that never ran is incomplete
        driver.end()
    driver.guard.begin_request("m")
    try:
        with pytest.raises(RequestError, match="malformed schedule"):
            session.prepare_request_schedule(
                "m", RequestSchedule((900.0, 500.0), ("high", "low"), (SchedulePhase("high", 0, 2),))
            )
        with pytest.raises(RequestError, match="expected a RequestSchedule"):
            session.prepare_request_schedule("m", {"timesteps": [900.0], "experts": ["high"]})
        with pytest.raises(RequestError, match="must not increase"):
            session.prepare_request_schedule("m", RequestSchedule((500.0, 900.0), ("high", "low")))
        with pytest.raises(RequestError, match=r"expert\(s\) \['mid'\]"):
            session.prepare_request_schedule("m", RequestSchedule.from_steps([900.0, 500.0], ["high", "mid"]))
    finally:
        driver.guard.end_request("m")


def test_schedule_after_the_first_call_is_rejected(helpers, routed, experts):
    make, session = routed
    guard = helpers.loop(experts).guard
    guard.begin_request("late")
    schedule = helpers.split_schedule(6, 3)
    place = schedule.locate(0)
    try:
        with request_scope(RequestContext("late", "cond", 0, place.timestep, "high", 6, 0, 3)), torch.no_grad():
            experts["high"](hidden_states=torch.randn(1, 4, 2, 4, 4), timestep=torch.tensor([place.timestep]),
                            encoder_hidden_states=torch.randn(1, 6, 16), return_dict=False)
        with pytest.raises(RequestError, match="before the first model call"):
            session.prepare_request_schedule("late", schedule)
    finally:
        with pytest.raises(RequestError, match="incomplete"):
            guard.end_request("late")


def test_timestep_differing_from_the_schedule(routed):
    make, _ = routed
    driver = make()
    driver.call(0)
    with pytest.raises(RequestError, match="differs from the schedule"):
        driver.call(1, timestep=driver.schedule.timesteps[1] + 5.0)


def test_duplicate_step_call(routed):
    make, _ = routed
    driver = make()
    driver.call(0)
    with pytest.raises(RequestError, match="called twice"):
        driver.call(0)


@pytest.mark.parametrize("first, second", [(1, None), (0, 2)])
def test_out_of_order_or_gapped_steps(routed, first, second):
    make, _ = routed
    driver = make()
    with pytest.raises(RequestError, match="consecutive|in order"):
        driver.call(first)
        if second is not None:
            driver.call(second)


def test_low_expert_before_high_phase_finished(routed):
    make, _ = routed
    driver = make()
    driver.call(0)
    driver.call(1)
    with pytest.raises(RequestError, match="before expert 'high' finished its phase"):
        driver.call(3)


def test_wrong_expert_for_a_step(routed):
    make, _ = routed
    driver = make()
    with pytest.raises(RequestError, match="belongs to expert 'high'"):
        driver.call(0, model="low")


def test_context_phase_disagreeing_with_the_schedule(routed):
    make, _ = routed
    driver = make()
    with pytest.raises(RequestError, match="expert_phase_length=5"):
        driver.call(0, expert_phase_length=5)


def test_uncond_before_cond_is_rejected(routed):
    make, _ = routed
    driver = make()
    with pytest.raises(RequestError, match="'uncond' was called before 'cond'"):
        driver.call(0, branch="uncond")


def test_phase_left_incomplete_at_end_request(routed):
    make, session = routed
    driver = make()
    for step in range(3):
        driver.call(step)
        driver.call(step, branch="uncond")
    with pytest.raises(RequestError, match=r"incomplete.*\['low'\]"):
        driver.end()
    assert _summary(session, "low", "e")["outcome"] == "incomplete"
    assert _summary(session, "high", "e")["outcome"] == "completed"


def test_missing_uncond_at_the_last_step_is_incomplete(routed):
    make, _ = routed
    driver = make(RequestSchedule.from_steps([900.0, 600.0, 300.0], ["high", "low", "low"]))
    driver.call(0)
    driver.call(0, branch="uncond")
    driver.call(1)
    driver.call(1, branch="uncond")
    driver.call(2)
    with pytest.raises(RequestError, match="branch 'uncond' stopped at phase step 0 of 2"):
        driver.end()


def test_routed_experts_without_any_phase_information(helpers, routed, experts):
    make, _ = routed
    guard = helpers.loop(experts).guard
    guard.begin_request("bare")
    try:
        with pytest.raises(RequestError, match="routed experts need a prepared request schedule"):
            with request_scope(RequestContext("bare", "cond", 0, 900.0, "high", 6)), torch.no_grad():
                experts["high"](hidden_states=torch.randn(1, 4, 2, 4, 4), timestep=torch.tensor([900.0]),
                                encoder_hidden_states=torch.randn(1, 6, 16), return_dict=False)
    finally:
        guard.end_request("bare")


def test_easycache_on_only_one_expert_is_rejected(helpers, registry, experts):
    loop = helpers.loop(experts)  # one guard over both experts, EasyCache only on "high"
    session = install_diffusion_accelerations(experts["high"], {"easycache": {"threshold": 0.1}}, registry=registry)
    loop.guard.begin_request("one")
    try:
        with pytest.raises(RequestError, match="installed on one model"):
            session.prepare_request_schedule("one", helpers.split_schedule(4, 2))
    finally:
        loop.guard.end_request("one")
        session.uninstall()
