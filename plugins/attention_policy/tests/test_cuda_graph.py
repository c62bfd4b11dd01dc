"""attention_policy beside cuda_graph: captured once per provider choice, replays equal to the policy run eagerly,
every replayed call counted (CPU: the graph runner on its eager-replay backend)."""

from __future__ import annotations

import torch
from worldfoundry_cuda_graph.plugin import make_prepare as graph_prepare

from worldfoundry import testing
from worldfoundry.core.acceleration.cuda_graph import EagerReplayBackend
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations

TEST_PROVIDER = "chunked_softmax"


def _drive(case, request_id: str, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    prompts = {b: torch.randn(1, 24, 32, generator=g) for b in ("cond", "uncond")}

    def call(step: int, branch: str) -> torch.Tensor:
        kwargs = case.inputs(step)
        kwargs["encoder_hidden_states"] = prompts[branch]
        with torch.no_grad():
            return case.model(**kwargs, return_dict=False)[0]

    return testing.run_request(case.model, request_id, call, steps=steps)


def _report(session, plugin: str) -> dict:
    return session.execution_report()["plugins"][plugin]["model"]


def test_policy_composes_with_the_graph_and_counts_every_replayed_call(wan_case, registry) -> None:
    registry.register("cuda_graph", graph_prepare(EagerReplayBackend))
    policy = {"attention_policy": {"self": TEST_PROVIDER}}
    alone = install_diffusion_accelerations(wan_case.model, policy, registry=registry)
    expected = _drive(wan_case, "eager", 3)
    alone.uninstall()
    session = install_diffusion_accelerations(wan_case.model, {**policy, "cuda_graph": True}, registry=registry)
    got = _drive(wan_case, "graph", 3)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    graph = _report(session, "cuda_graph")["requests"]["graph"]
    assert graph["modules"]["<root>"] == {"capture": 1, "replay": 5} and not graph.get("fallbacks")
    routed = _report(session, "attention_policy")
    # 2 self-attention modules x 6 model calls, whether the call was captured or replayed
    assert routed["requests"]["graph"]["counters"] == {TEST_PROVIDER: 12}
    assert routed["interception"]["dispatcher_only"] == 12
    session.uninstall()


def test_a_step_range_is_part_of_the_graph_key(wan_case, registry) -> None:
    registry.register("cuda_graph", graph_prepare(EagerReplayBackend))
    policy = {"attention_policy": {"self": {"backend": TEST_PROVIDER, "dense_first_steps": 1}}}
    alone = install_diffusion_accelerations(wan_case.model, policy, registry=registry)
    expected = _drive(wan_case, "eager", 3)
    eager_counts = _report(alone, "attention_policy")["requests"]["eager"]["counters"]
    alone.uninstall()
    session = install_diffusion_accelerations(wan_case.model, {**policy, "cuda_graph": True}, registry=registry)
    got = _drive(wan_case, "graph", 3)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    # step 0 runs SDPA, steps 1-2 the provider: two captured paths
    assert _report(session, "cuda_graph")["requests"]["graph"]["modules"]["<root>"] == {"capture": 2, "replay": 4}
    request = _report(session, "attention_policy")["requests"]["graph"]
    assert request["counters"] == eager_counts == {TEST_PROVIDER: 8, "dense_fallback": 4}
    session.uninstall()
