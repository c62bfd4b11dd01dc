"""``wan_block_fusion`` under ``cuda_graph``: replays are bitwise the fused eager forward and receipts stay honest.

The CPU test replays through the graph plugin's eager replay executor (the captured forward's Python runs again
and its ledger calls are compared with the capture's); the GPU test captures real CUDA graphs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.cuda_graph import CudaGraphBackend, EagerReplayBackend
from worldfoundry.core.acceleration.guard import attach_request_guard, get_request_guard
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.fusion.triton_support import TRITON_AVAILABLE

STEPS = 3
NAME = "wan_block_fusion"


def _registry(kit: Any, backend: Any) -> Any:
    from worldfoundry_cuda_graph.plugin import make_prepare

    reg = kit.make_registry()
    reg.register("cuda_graph", make_prepare(backend))
    return reg


def _drive(kit: Any, model: torch.nn.Module, request_id: str, family: str = "wan") -> list[torch.Tensor]:
    """One request: STEPS steps x two CFG branches with fixed per-step latents."""
    guard = get_request_guard(model) or attach_request_guard(model)
    make = kit.wan_inputs if family == "wan" else kit.sana_inputs
    prompts = {"cond": make(seed=1), "uncond": make(seed=2)}
    outs = []
    with guard.request(request_id):
        for step in range(STEPS):
            latents = make(seed=10 + step)["hidden_states"]
            for branch, inputs in prompts.items():
                t = 900 - 300 * step
                ctx = RequestContext(request_id, branch, step, float(t), None, STEPS)
                timestep = torch.tensor([t], device=latents.device)
                with request_scope(ctx), torch.no_grad():
                    outs.append(model(**{**inputs, "hidden_states": latents, "timestep": timestep})[0])
    return outs


def _check_stack(kit: Any, backend: Any, family: str = "wan") -> None:
    name = NAME if family == "wan" else "sana_block_fusion"
    model = kit.build_wan() if family == "wan" else kit.build_sana()
    reg = _registry(kit, backend)
    session = install_diffusion_accelerations(model, {name: {}}, registry=reg)
    reference = _drive(kit, model, "eager", family)
    expected = session.execution_report()["plugins"][name]["model"]["requests"]["eager"]
    session.uninstall()
    session = install_diffusion_accelerations(model, {name: {}, "cuda_graph": True}, registry=reg)
    first = _drive(kit, model, "g1", family)
    second = _drive(kit, model, "g2", family)
    report = session.execution_report()["plugins"]
    session.uninstall()
    for got in (first, second):
        assert len(got) == len(reference) == 2 * STEPS
        assert all(torch.equal(a, b) for a, b in zip(reference, got, strict=True))
    graph = report["cuda_graph"]["model"]
    assert graph["graphs"]["totals"]["captures"] == 1
    assert graph["graphs"]["totals"]["replay_divergences"] == 0
    assert graph["requests"]["g2"]["modules"]["<root>"] == {"replay": 2 * STEPS}
    if family == "wan":
        assert expected["fallbacks"] == {} and expected["counters"]["gated_residual"] == 2 * 2 * 2 * STEPS
    else:  # the first block's first residual reads the patch embedding's transposed view: counted, every call
        glu_on_cpu = 0 if model.device.type == "cuda" else 2 * 2 * STEPS  # the glu chain falls back on the CPU
        assert sum(expected["fallbacks"].values()) == 2 * STEPS + glu_on_cpu
        assert expected["counters"]["linear_attention"] == 2 * 2 * STEPS
        assert expected["counters"].get("glu", 0) == 2 * 2 * STEPS - glu_on_cpu
    for rid in ("g1", "g2"):  # every replayed fused call (and fallback) is counted for the request that replayed it
        got = report[name]["model"]["requests"][rid]
        assert got["modules"] == expected["modules"], rid
        assert got["counters"] == expected["counters"], rid
        assert got["fallbacks"] == expected["fallbacks"] and got["claimed_not_executed"] == []


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("family", ["wan", "sana"])
def test_replay_executor_is_bitwise_and_counts_like_eager(kit: Any, family: str) -> None:
    _check_stack(kit, EagerReplayBackend, family)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and TRITON_AVAILABLE), reason="needs CUDA + triton")
def test_cuda_graph_replay_is_bitwise_block_fusion_eager(kit: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setattr(sys.modules[kit.__name__], "DEVICE", torch.device("cuda"))
    _check_stack(kit, CudaGraphBackend, "wan")
    _check_stack(kit, CudaGraphBackend, "sana")
