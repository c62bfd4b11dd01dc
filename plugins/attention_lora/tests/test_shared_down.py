"""The shared down step inside the plugin: hand-over counts in receipts, own-column fallback, unchanged results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from worldfoundry_attention_lora import apply_dit_attention_lora

from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.lora import lora_linear_reference

RANK = 4


def _request(session, request_id: str) -> dict:
    return session.execution_report()["plugins"]["attention_lora"]["model"]["requests"][request_id]


def test_h3_qkv_hand_over_is_counted_per_request(h3, tools) -> None:
    adapter = tools.make_h3_adapter(h3, RANK)
    with apply_dit_attention_lora(h3, adapter.state, rank=RANK, scale=-1.0) as session:
        with request_scope(RequestContext("r1")):
            tools.run(h3, tools.h3_inputs(h3))
        counters = _request(session, "r1")["counters"]
        kernels = session.execution_report()["plugins"]["attention_lora"]["model"]["kernels"]
    # per block: to_q computes the step for Q/K/V (one shared A), to_k and to_v take it; to_out.0 reads alone
    assert counters["shared_down:group_computed"] == 2 and counters["shared_down:handed_over"] == 4
    assert not any(k.startswith("shared_down:own") or k == "shared_down:dropped_unused" for k in counters)
    assert kernels["shared_down"] == {"group_computed": 2, "handed_over": 4}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wan_stacked_groups_give_bitwise_the_separate_results(tools, dtype: torch.dtype) -> None:
    """attn1 Q/K/V (three different A, stacked on tile boundaries) and attn2 K/V share a down step; every output
    is bitwise the projection computed alone with its own A and B (the float64 bounds of the other tests hold)."""
    model = tools.build_wan(seed=5).to(dtype)
    adapter = tools.make_wan_adapter(model, RANK, magnitude=0.5)
    inputs = tools.wan_inputs(dtype=dtype)
    with apply_dit_attention_lora(model, adapter.state, rank=RANK, scale=-0.7) as session:
        recorder = tools.ProjectionRecorder(model, list(adapter.expected))
        with request_scope(RequestContext("w")):
            tools.run(model, inputs)
        recorder.remove()
        counters = _request(session, "w")["counters"]
    # per block: attn1 one step + two hand-overs, attn2 K/V one step + one hand-over (attn2 Q reads alone)
    assert counters["shared_down:group_computed"] == 4 and counters["shared_down:handed_over"] == 6
    for path, calls in recorder.calls.items():
        (x, y), = calls
        module = model.get_submodule(path)
        base = F.linear(x, module.weight, module.bias)
        alone = lora_linear_reference(x, base, *adapter.expected[path], -0.7)
        assert torch.equal(y, alone), path


def test_member_called_with_another_input_computes_its_own_columns(wan, tools) -> None:
    adapter = tools.make_wan_adapter(wan, RANK, magnitude=0.5)
    attn = wan.blocks[0].attn1
    g = torch.Generator().manual_seed(3)
    x1, x2 = torch.randn(1, 6, attn.to_q.in_features, generator=g), torch.randn(1, 6, attn.to_q.in_features, generator=g)
    with apply_dit_attention_lora(wan, adapter.state, rank=RANK, scale=0.5) as session:
        with request_scope(RequestContext("f")), torch.no_grad():
            attn.to_k(x2)           # a group step for x2; q and v still to come
            own_q = attn.to_q(x1)   # q is awaited for x2 but called with x1: its own columns only
            attn.to_v(x2)           # v and q take x2's step
            attn.to_q(x2)
            group_q = attn.to_q(x1)  # x2's step is complete: a new group step for x1
        counters = _request(session, "f")["counters"]
    assert counters["shared_down:own:other_input"] == 1
    assert counters["shared_down:group_computed"] == 2 and counters["shared_down:handed_over"] == 2
    assert "shared_down:dropped_unused" not in counters
    assert torch.equal(own_q, group_q)
    base = F.linear(x1, attn.to_q.weight, attn.to_q.bias)
    assert torch.equal(own_q, lora_linear_reference(x1, base, *adapter.expected["blocks.0.attn1.to_q"], 0.5))


def test_exception_between_members_leaves_no_stale_result(h3, tools) -> None:
    adapter = tools.make_h3_adapter(h3, RANK)
    inputs = tools.h3_inputs(h3)
    base_out = tools.run(h3, inputs)
    before = tools.state_snapshot(h3)
    with apply_dit_attention_lora(h3, adapter.state, rank=RANK, scale=-1.0) as session:
        clean = tools.run(h3, inputs)

        def fail(module, args):
            raise RuntimeError("injected failure after to_q")

        hook = h3.transformer_blocks[0].attn.to_k.register_forward_pre_hook(fail)
        with pytest.raises(RuntimeError, match="injected"):
            tools.run(h3, inputs)
        hook.remove()
        with request_scope(RequestContext("after")):
            again = tools.run(h3, inputs)
        counters = _request(session, "after")["counters"]
    assert torch.equal(again, clean)
    # the failed forward left block 0's step waiting for K and V; its input is gone, so it is dropped
    assert counters["shared_down:dropped_unused"] == 2 and counters["shared_down:group_computed"] == 2
    tools.assert_snapshot_equal(before, tools.state_snapshot(h3))
    assert torch.equal(tools.run(h3, inputs), base_out)
