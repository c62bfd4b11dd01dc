"""A hypothesis state machine over install / uninstall / forward / blocked forward / begin / end request.

Invariants: at most one session is attached and it is the one we installed; the guard's counters match what
the machine did; handles see exactly the open requests; without a session the model is exactly as built;
busy models refuse install and uninstall; forwards without a session (or with exact plugins only) are
bitwise identical to the original model's.
"""

from __future__ import annotations

import threading

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from worldfoundry.core.acceleration.guard import attach_request_guard
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.patching import PatchRecorder
from worldfoundry.core.acceleration.prepared import ROLE_FEATURE_CACHE
from worldfoundry.core.acceleration.session import SESSION_ATTRIBUTE
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.errors import (
    AccelerationConflictError,
    ModelBusyError,
    RequestError,
    SessionAlreadyInstalledError,
)

POLICY = RuntimePolicy(device="cpu", dtype=torch.float32)
PLUGINS = ("exact_a", "scale_b", "cache_c", "clash_d")
REQUEST_IDS = ("r1", "r2", "r3")


def test_lifecycle_state_machine(make_tiny_wan, toy_kit_factory, model_fingerprint, assert_restored, run_wan):
    baseline_output = run_wan(make_tiny_wan())

    class Lifecycle(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_tiny_wan()
            self.guard = attach_request_guard(self.model)
            # A gate inside a submodule: forwards started by the worker thread stop there until released.
            self.worker: threading.Thread | None = None
            self.entered, self.release = threading.Event(), threading.Event()
            self.worker_error: list[BaseException] = []

            def make_gate(original):
                def forward(*args, **kwargs):
                    if threading.current_thread() is self.worker:
                        self.entered.set()
                        self.release.wait(timeout=30)
                    return original(*args, **kwargs)

                return forward

            self.gate = PatchRecorder("gate")
            self.gate.wrap_forward(self.model.blocks[1].norm2, make_gate, name="test-gate")
            self.baseline = model_fingerprint(self.model, forward=False)
            kit = toy_kit_factory()
            kit.add("exact_a", "blocks.0.ffn")
            kit.add("scale_b", "blocks.1.ffn")
            kit.add("cache_c", "proj_out", claims=lambda t: {ROLE_FEATURE_CACHE})
            kit.add("clash_d", "blocks.0.ffn")
            self.kit = kit
            self.session = None
            self.session_names: set[str] = set()
            self.requests: set[str] = set()

        # ------------------------------------------------------------------ helpers
        def busy(self) -> bool:
            return bool(self.requests) or self.worker is not None

        # ------------------------------------------------------------------ rules
        @rule(names=st.sets(st.sampled_from(PLUGINS), max_size=3))
        def install(self, names):
            spec = {n: ({"scale": 2.0} if n == "scale_b" else True) for n in sorted(names)}
            activations = self.kit.activations()
            try:
                session = install_diffusion_accelerations(self.model, spec, POLICY, registry=self.kit.registry)
            except ModelBusyError:
                assert self.busy()
            except SessionAlreadyInstalledError:
                assert not self.busy() and self.session is not None
            except AccelerationConflictError:
                assert {"exact_a", "clash_d"} <= names and self.session is None and not self.busy()
                assert self.kit.activations() == activations
            else:
                assert not self.busy() and self.session is None
                assert not ({"exact_a", "clash_d"} <= names)
                self.session, self.session_names = session, set(names)
                return
            assert self.kit.activations() == activations

        @rule()
        def uninstall(self):
            if self.session is None:
                return
            try:
                self.session.uninstall()
            except ModelBusyError:
                assert self.busy() and self.session.installed
            else:
                assert not self.busy()
                self.session.uninstall()  # idempotent
                self.session, self.session_names = None, set()
                assert_restored(self.baseline, model_fingerprint(self.model, forward=False))

        @precondition(lambda self: self.worker is None)
        @rule()
        def forward(self):
            out = run_wan(self.model)
            if self.session is None or "scale_b" not in self.session_names:
                assert torch.equal(out, baseline_output)
            else:
                assert not torch.equal(out, baseline_output)

        @precondition(lambda self: self.worker is None)
        @rule()
        def start_blocked_forward(self):
            self.entered.clear()
            self.release.clear()

            def work() -> None:
                try:
                    run_wan(self.model)
                except BaseException as exc:
                    self.worker_error.append(exc)

            self.worker = threading.Thread(target=work, daemon=True)
            self.worker.start()
            assert self.entered.wait(timeout=30)

        @precondition(lambda self: self.worker is not None)
        @rule()
        def finish_blocked_forward(self):
            self.release.set()
            self.worker.join(timeout=30)
            assert not self.worker.is_alive() and not self.worker_error
            self.worker = None

        @rule(request_id=st.sampled_from(REQUEST_IDS))
        def begin_request(self, request_id):
            try:
                self.guard.begin_request(request_id)
            except RequestError:
                assert request_id in self.requests
            else:
                assert request_id not in self.requests
                self.requests.add(request_id)

        @rule(request_id=st.sampled_from(REQUEST_IDS))
        def end_request(self, request_id):
            try:
                self.guard.end_request(request_id)
            except RequestError:
                assert request_id not in self.requests
            else:
                self.requests.remove(request_id)

        # ------------------------------------------------------------------ invariants
        @invariant()
        def single_session(self):
            assert self.model.__dict__.get(SESSION_ATTRIBUTE) is self.session
            if self.session is not None:
                assert self.session.installed and set(self.session.names) == self.session_names

        @invariant()
        def guard_matches(self):
            assert set(self.guard.active_request_ids()) == self.requests
            assert self.guard.active_forwards == (1 if self.worker is not None else 0)

        @invariant()
        def handles_see_open_requests(self):
            if self.session is not None:
                for name in self.session.names:
                    for handle in self.session.handles(name).values():
                        assert set(handle.requests) == self.requests

        @invariant()
        def exact_without_session(self):
            if self.session is None:
                assert_restored(self.baseline, model_fingerprint(self.model, forward=False))

        def teardown(self):
            if self.worker is not None:
                self.release.set()
                self.worker.join(timeout=30)
            for request_id in list(self.requests):
                self.guard.end_request(request_id)
            if self.session is not None:
                self.session.uninstall()
            self.gate.undo()

    run_state_machine_as_test(
        Lifecycle, settings=settings(max_examples=12, stateful_step_count=12, deadline=None, database=None)
    )
