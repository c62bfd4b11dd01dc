"""``cuda_graph`` with real CUDA graphs on a tiny bf16 Wan: bitwise replay vs eager, composition with
``optimized_mha`` / ``wan_cross_kv_fusion`` / ``selective_fp8`` (each bitwise equal to the same stack eager),
invalidation after a weight edit, aliasing and output ownership, a failed capture, and memory freed on uninstall.

Skipped without CUDA.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from worldfoundry.base_models.diffusion_model.optimizations.plugins import (
    ExecutionLedger,
    PatchRecorder,
    PreparedAcceleration,
    RecordedHandle,
    install_diffusion_accelerations,
)
from worldfoundry.core.acceleration.cuda_graph import CudaGraphBackend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS = 3


def _fp8_ok() -> bool:
    from worldfoundry.core.acceleration.kernels.fp8_rowwise_quant import TRITON_AVAILABLE

    return torch.cuda.get_device_capability() >= (8, 9) and TRITON_AVAILABLE


def _case(tools: Any) -> Any:
    return tools.build_wan(device="cuda", dtype=torch.bfloat16, layers=3)


def _registry(tools: Any) -> Any:
    return tools.make_registry(CudaGraphBackend)


def _eager_then_graph(tools: Any, stack: dict[str, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor], Any, Any]:
    wan = _case(tools)
    registry = _registry(tools)
    eager_session = install_diffusion_accelerations(wan.model, stack, registry=registry) if stack else None
    reference = wan.run_request("eager", STEPS)
    if eager_session is not None:
        eager_session.uninstall()
    session = install_diffusion_accelerations(wan.model, {**stack, "cuda_graph": True}, registry=registry)
    first = wan.run_request("g1", STEPS)
    second = wan.run_request("g2", STEPS)
    return reference, first + second, session, wan


STACKS = [
    pytest.param({}, id="alone"),
    pytest.param({"optimized_mha": {"self": {"fusion": "qkv"}, "cross": {"fusion": "kv"}}}, id="optimized_mha"),
    pytest.param({"wan_cross_kv_fusion": {"min_tokens": 0}}, id="wan_cross_kv_fusion"),
    pytest.param({"optimized_mha": {"self": {"fusion": "qkv"}}, "wan_cross_kv_fusion": {"min_tokens": 0}},
                 id="optimized_mha+wan_cross_kv_fusion"),
    pytest.param({"selective_fp8": {"min_tokens": 1}}, id="selective_fp8",
                 marks=pytest.mark.skipif(not torch.cuda.is_available() or not _fp8_ok(), reason="needs sm_89+")),
]


@pytest.mark.parametrize("stack", STACKS)
def test_replay_is_bitwise_equal_to_the_same_stack_eager(tools: Any, stack: dict[str, Any]) -> None:
    reference, outputs, session, _ = _eager_then_graph(tools, stack)
    for i, out in enumerate(outputs):
        assert torch.equal(out, reference[i % len(reference)]), i
    report = tools.graphs(session)
    assert report["backend"] == "cuda"
    assert report["totals"]["captures"] == 1 and report["totals"]["capture_failures"] == 0, report
    assert report["pool_bytes"] > 0
    replays = tools.graph_record(session, "g2")["modules"]["<root>"]["replay"]
    assert replays == (2 * STEPS - 2 if "wan_cross_kv_fusion" in stack else 2 * STEPS)
    for name in stack:
        record = session.execution_report()["plugins"][name]["model"]["requests"]["g2"]
        assert record["claimed_not_executed"] == [], name
    session.uninstall()


def test_weight_edit_invalidates_and_replays_the_new_weights(tools: Any) -> None:
    wan = _case(tools)
    session = install_diffusion_accelerations(wan.model, {"cuda_graph": True}, registry=_registry(tools))
    wan.run_request("r1", 2)
    with torch.no_grad():
        wan.model.blocks[0].ffn.net[2].weight.mul_(0.5)
    out = wan.run_request("r2", 2)
    report = tools.graphs(session)
    assert report["totals"]["invalidations"] == 1 and report["totals"]["captures"] == 2
    session.uninstall()
    eager = [wan.call(s, b) for s in range(2) for b in ("cond", "uncond")]
    assert all(torch.equal(a, b) for a, b in zip(out, eager, strict=True))


def test_kept_outputs_and_fed_back_static_outputs(tools: Any) -> None:
    wan = _case(tools)
    registry = _registry(tools)
    session = install_diffusion_accelerations(wan.model, {"cuda_graph": True}, registry=registry)
    kept = wan.run_request("r1", 3, branches=("cond",))
    copies = [k.clone() for k in kept]
    wan.run_request("r2", 3, branches=("cond",))
    assert all(torch.equal(k, c) for k, c in zip(kept, copies, strict=True))  # replays did not overwrite them
    session.uninstall()
    session = install_diffusion_accelerations(wan.model, {"cuda_graph": {"output": "static"}}, registry=registry)
    x = wan.latents(0)
    expected = x.clone()
    t = torch.tensor([500], device="cuda")
    with torch.no_grad():
        for _ in range(4):  # the static output buffer fed back as the next input
            x = wan.model(x, t, wan.prompts["cond"], return_dict=False)[0]
        session.uninstall()
        for _ in range(4):
            expected = wan.model(expected, t, wan.prompts["cond"], return_dict=False)[0]
    assert torch.equal(x, expected)


def _syncing_plugin(model: Any, options: Any, policy: Any) -> PreparedAcceleration:
    def activate() -> RecordedHandle:
        ledger = ExecutionLedger("syncing")
        with PatchRecorder("syncing") as rec:
            def wrap(original: Any) -> Any:
                def forward(x: torch.Tensor) -> torch.Tensor:
                    if float(x.float().abs().max().item()) < 0:  # a host sync: not capturable
                        raise AssertionError
                    return original(x)
                return forward
            rec.wrap_forward(model.proj_out, wrap, name="syncing")
            handle = RecordedHandle("syncing", rec.pop_all(), ledger)
        handle.cuda_graph_safe = True  # type: ignore[attr-defined]
        return handle

    return PreparedAcceleration(name="syncing", claims=frozenset({"proj_out"}), activate=activate, exact=True)


def test_a_failed_capture_runs_eagerly_with_the_reason(tools: Any) -> None:
    wan = _case(tools)
    registry = _registry(tools)
    registry.register("syncing", _syncing_plugin)
    reference = wan.run_request("eager", 2, branches=("cond",))
    session = install_diffusion_accelerations(wan.model, {"cuda_graph": True, "syncing": True}, registry=registry)
    out = wan.run_request("r1", 2, branches=("cond",))
    assert all(torch.equal(a, b) for a, b in zip(out, reference, strict=True))
    record = tools.graph_record(session, "r1")
    assert record["counters"].get("capture_failures") == 1
    assert any(reason.startswith("capture failed") for reason in record["fallbacks"])
    session.uninstall()


def test_uninstall_frees_graph_memory(tools: Any) -> None:
    wan = _case(tools)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    session = install_diffusion_accelerations(wan.model, {"cuda_graph": True}, registry=_registry(tools))
    wan.run_request("r1", 2)
    assert tools.graphs(session)["pool_bytes"] > 0
    session.uninstall()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before + 2**20
