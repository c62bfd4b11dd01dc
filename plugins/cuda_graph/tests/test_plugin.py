"""``cuda_graph`` on a tiny Wan with the CPU replay executor: options, exact restore, receipts, conflicts, refusal
while busy, composition with the other built-in plugins (bitwise equal to the same stack eager, same receipts)."""

from __future__ import annotations

from worldfoundry.core.acceleration.guard import attach_request_guard

import inspect
from typing import Any

import pytest
import torch
from worldfoundry_cuda_graph.options import Options
from worldfoundry_cuda_graph.plugin import prepare

from worldfoundry.base_models.diffusion_model.optimizations.plugins import (
    ExecutionLedger,
    PatchRecorder,
    PreparedAcceleration,
    RecordedHandle,
    install_diffusion_accelerations,
)
from worldfoundry.base_models.diffusion_model.optimizations.refusals import CUDA_GRAPH_MARKER
from worldfoundry.core.acceleration.cuda_graph import NO_CUDA_DEVICE
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.errors import (
    AccelerationConflictError,
    AccelerationOptionsError,
    AccelerationRefusedError,
    ModelBusyError,
)

MHA = {"self": {"fusion": "qkv"}, "cross": {"fusion": "kv"}}
STACKS = [
    pytest.param({}, id="alone"),
    pytest.param({"wan_cross_kv_fusion": {"min_tokens": 0}}, id="wan_cross_kv_fusion"),
    pytest.param({"optimized_mha": MHA}, id="optimized_mha"),
    pytest.param({"optimized_mha": {"self": {"fusion": "qkv"}}, "wan_cross_kv_fusion": {"min_tokens": 0}},
                 id="optimized_mha+wan_cross_kv_fusion"),
    pytest.param({"selective_fp8": {"min_tokens": 1}}, id="selective_fp8"),
]


def test_options_are_validated_by_name(tools: Any) -> None:
    assert Options.from_mapping({}).to_json() == {"max_signatures": 4, "output": "copy", "warmup_calls": 0,
                                                  "compose_with": []}
    with pytest.raises(AccelerationOptionsError, match="unknown option"):
        Options.from_mapping({"max_graphs": 2})
    with pytest.raises(AccelerationOptionsError, match="max_signatures"):
        Options.from_mapping({"max_signatures": 0})
    with pytest.raises(AccelerationOptionsError, match="output"):
        Options.from_mapping({"output": "borrow"})
    with pytest.raises(AccelerationOptionsError, match="compose_with"):
        Options.from_mapping({"compose_with": ["a", "a"]})


def test_registered_factory_on_cpu_falls_back_visibly(tools: Any, wan: Any) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    registry = AccelerationRegistry(discover=False)
    registry.register("cuda_graph", prepare)
    dense = wan.call(0, "cond")
    session = install_diffusion_accelerations(wan.model, {"cuda_graph": True}, registry=registry)
    out = wan.run_request("r1", 2)
    assert torch.equal(out[0], dense)
    record = tools.graph_record(session, "r1")
    assert record["fallbacks"] == {NO_CUDA_DEVICE: 4} and record["modules"] == {}
    session.uninstall()


def test_install_replay_and_exact_restore(tools: Any, wan: Any, registry: AccelerationRegistry) -> None:
    model = wan.model
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = {k: id(v) for k, v in model.named_parameters()}
    signature = inspect.signature(model.forward)
    dense = [wan.call(s, b) for s in range(3) for b in ("cond", "uncond")]
    session = install_diffusion_accelerations(model, {"cuda_graph": True}, registry=registry)
    assert inspect.signature(model.forward) == signature
    assert getattr(model, CUDA_GRAPH_MARKER) is True
    out = wan.run_request("r1", 3)
    assert all(torch.equal(a, b) for a, b in zip(out, dense, strict=True))
    record = tools.graph_record(session, "r1")
    assert record["modules"] == {"<root>": {"capture": 1, "replay": 5}}  # cond and uncond share one graph
    assert record["notes"]["pool_bytes"] > 0 and record["finished"]
    assert tools.graphs(session)["totals"]["replay_divergences"] == 0
    assert session.receipt.to_json()["execution_verified"] is False and session.receipt.exact
    handle = session.handles("cuda_graph")["model"]
    session.uninstall()
    assert "forward" not in model.__dict__ and CUDA_GRAPH_MARKER not in model.__dict__
    assert {k: id(v) for k, v in model.named_parameters()} == params
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert torch.equal(wan.call(0, "cond"), dense[0])
    assert handle.runner.report()["signatures"] == [] and handle.runner.pool_bytes() == 0  # freed on uninstall


@pytest.mark.parametrize("stack", STACKS)
def test_stack_is_bitwise_and_counts_like_the_same_stack_eager(tools: Any, stack: dict[str, Any]) -> None:
    wan = tools.build_wan()
    registry = tools.make_registry()
    if stack:
        session = install_diffusion_accelerations(wan.model, stack, registry=registry)
        reference = wan.run_request("eager", 3)
        eager = session.execution_report()["plugins"]
        session.uninstall()
    else:
        reference = wan.run_request("eager", 3)
        eager = {}
    session = install_diffusion_accelerations(wan.model, {**stack, "cuda_graph": True}, registry=registry)
    first = wan.run_request("g1", 3)
    second = wan.run_request("g2", 3)
    assert all(torch.equal(a, b) for a, b in zip(reference, first, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(reference, second, strict=True))
    report = session.execution_report()["plugins"]
    for name in stack:
        expected = eager[name]["model"]["requests"]["eager"]
        for rid in ("g1", "g2"):
            got = report[name]["model"]["requests"][rid]
            assert got["modules"] == expected["modules"], (name, rid)
            assert got["claimed_not_executed"] == expected["claimed_not_executed"]
            assert got["fallbacks"] == expected["fallbacks"]
            counters = {k: v for k, v in got["counters"].items() if k != "bitwise_checks"}
            assert counters == {k: v for k, v in expected["counters"].items() if k != "bitwise_checks"}
    totals = tools.graphs(session)["totals"]
    assert totals["captures"] == 1 and totals["replay_divergences"] == 0
    if "wan_cross_kv_fusion" in stack:  # the first call of each branch fills the static K/V cache eagerly
        assert tools.graph_record(session, "g2")["modules"]["<root>"] == {"replay": 4}
        assert sum(tools.graph_record(session, "g2")["fallbacks"].values()) == 2
    else:
        assert tools.graph_record(session, "g2")["modules"]["<root>"] == {"replay": 6}
    session.uninstall()


def test_static_kv_conditioning_change_mid_request_stays_exact(tools: Any) -> None:
    wan = tools.build_wan()
    registry = tools.make_registry()
    spec = {"wan_cross_kv_fusion": {"min_tokens": 0}}
    new_prompt = torch.randn(1, 24, 32, generator=torch.Generator().manual_seed(3))

    def switch(step: int) -> None:
        if step == 2:
            wan.prompts["cond"] = new_prompt

    original = dict(wan.prompts)
    session = install_diffusion_accelerations(wan.model, spec, registry=registry)
    reference = wan.run_request("eager", 4, before_step=switch)
    session.uninstall()
    wan.prompts = dict(original)
    session = install_diffusion_accelerations(wan.model, {**spec, "cuda_graph": True}, registry=registry)
    out = wan.run_request("g", 4, before_step=switch)
    assert all(torch.equal(a, b) for a, b in zip(reference, out, strict=True))
    assert sum(tools.graph_record(session, "g")["fallbacks"].values()) == 3  # two first calls + the changed prompt
    session.uninstall()


def test_weight_edit_invalidates_and_recaptures(tools: Any, wan: Any, registry: AccelerationRegistry) -> None:
    session = install_diffusion_accelerations(wan.model, {"cuda_graph": True}, registry=registry)
    wan.run_request("r1", 1)
    with torch.no_grad():
        wan.model.proj_out.weight.mul_(0.5)
    out = wan.run_request("r2", 1)
    report = tools.graphs(session)
    assert report["totals"]["invalidations"] == 1 and report["totals"]["captures"] == 2
    assert "edited in place" in report["invalidations"][-1]
    session.uninstall()
    assert torch.equal(out[0], wan.call(0, "cond"))


def test_warmup_calls_and_lru_limit(tools: Any, wan: Any, registry: AccelerationRegistry) -> None:
    session = install_diffusion_accelerations(wan.model, {"cuda_graph": {"warmup_calls": 1, "max_signatures": 1}},
                                              registry=registry)
    wan.run_request("r1", 2, branches=("cond",))
    record = tools.graph_record(session, "r1")
    assert record["fallbacks"] == {"warming up (1 of 1 eager calls)": 1}
    assert record["modules"]["<root>"] == {"capture": 1}
    session.uninstall()


def test_resident_blocks_is_a_named_conflict(tools: Any, wan: Any, registry: AccelerationRegistry) -> None:
    with pytest.raises(AccelerationConflictError, match="resident_blocks"):
        install_diffusion_accelerations(wan.model, {"cuda_graph": True, "resident_blocks": {}}, registry=registry)
    assert "forward" not in wan.model.__dict__


def test_static_output_conflicts_with_a_feature_cache(tools: Any, wan: Any, registry: AccelerationRegistry) -> None:
    with pytest.raises(AccelerationConflictError):
        install_diffusion_accelerations(wan.model, {"cuda_graph": {"output": "static"}, "easycache": {}},
                                        registry=registry)


def test_easycache_outside_the_graph(tools: Any, wan: Any, registry: AccelerationRegistry) -> None:
    spec = {"easycache": {"threshold": 0.2, "warmup_steps": 1}}
    session = install_diffusion_accelerations(wan.model, spec, registry=registry)
    reference = wan.run_request("eager", 5)
    skipped = session.execution_report()["plugins"]["easycache"]["model"]["requests"]["eager"]["skipped"]
    session.uninstall()
    session = install_diffusion_accelerations(wan.model, {**spec, "cuda_graph": True}, registry=registry)
    out = wan.run_request("g", 5)
    assert all(torch.equal(a, b) for a, b in zip(reference, out, strict=True))
    report = session.execution_report()["plugins"]
    assert report["easycache"]["model"]["requests"]["g"]["skipped"] == skipped
    modules = tools.graph_record(session, "g")["modules"]["<root>"]
    assert modules["capture"] + modules["replay"] == 10 - skipped.get("steps", 0)
    session.uninstall()


def _stateful_plugin(declared: bool) -> Any:
    def prepare_counter(model: Any, options: Any, policy: Any) -> PreparedAcceleration:
        def activate() -> RecordedHandle:
            ledger = ExecutionLedger("counter")
            with PatchRecorder("counter") as rec:
                def wrap(original: Any) -> Any:
                    def forward(x: torch.Tensor) -> torch.Tensor:
                        ledger.executed("proj_out", "counted")
                        return original(x)
                    return forward
                rec.wrap_forward(model.proj_out, wrap, name="counter")
                handle = RecordedHandle("counter", rec.pop_all(), ledger)
            handle.cuda_graph_safe = declared  # type: ignore[attr-defined]
            return handle

        return PreparedAcceleration(name="counter", claims=frozenset({"proj_out"}), activate=activate, exact=True)

    return prepare_counter


@pytest.mark.parametrize("declared", [False, True])
def test_undeclared_plugin_runs_eagerly_declared_one_composes(tools: Any, wan: Any, declared: bool) -> None:
    registry = tools.make_registry()
    registry.register("counter", _stateful_plugin(declared))
    session = install_diffusion_accelerations(wan.model, {"cuda_graph": True, "counter": True}, registry=registry)
    wan.run_request("r1", 2)
    record = tools.graph_record(session, "r1")
    counter = session.execution_report()["plugins"]["counter"]["model"]["requests"]["r1"]
    assert counter["modules"] == {"proj_out": {"counted": 4}}  # one per model call, replayed or not
    if declared:
        assert record["modules"]["<root>"] == {"capture": 1, "replay": 3}
    else:
        assert list(record["fallbacks"]) == [
            "counter does not declare CUDA-graph support (its per-call Python would be frozen); list it in "
            "compose_with only if its forward has no per-call state"]
    session.uninstall()


def test_compose_with_lists_a_plugin(tools: Any, wan: Any) -> None:
    registry = tools.make_registry()
    registry.register("counter", _stateful_plugin(False))
    session = install_diffusion_accelerations(wan.model, {"cuda_graph": {"compose_with": ["counter"]},
                                                          "counter": True}, registry=registry)
    wan.run_request("r1", 1)
    assert tools.graph_record(session, "r1")["modules"]["<root>"] == {"capture": 1, "replay": 1}
    session.uninstall()


def test_refusals_and_busy(tools: Any, wan: Any, registry: AccelerationRegistry) -> None:
    wan.model.train()
    with pytest.raises(AccelerationRefusedError, match="training"):
        install_diffusion_accelerations(wan.model, {"cuda_graph": True}, registry=registry)
    wan.model.eval()
    setattr(wan.model, CUDA_GRAPH_MARKER, True)
    with pytest.raises(AccelerationRefusedError, match="captured in a CUDA graph"):
        install_diffusion_accelerations(wan.model, {"cuda_graph": True}, registry=registry)
    del wan.model.__dict__[CUDA_GRAPH_MARKER]
    guard = attach_request_guard(wan.model)  # as the loader does: the guard outlives the session
    session = install_diffusion_accelerations(wan.model, {"cuda_graph": True}, registry=registry)
    with guard.request("busy"):
        with pytest.raises(ModelBusyError):
            session.uninstall()
    session.uninstall()
    with guard.request("busy2"), pytest.raises(ModelBusyError):
        install_diffusion_accelerations(wan.model, {"cuda_graph": True}, registry=registry)
