"""Bitwise output vs the resident model, transfer counts, slot order and resident indices (emulated mode)."""

from __future__ import annotations

import pytest
import torch

from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.offload.estimator import uniform_resident_indices

N = 4  # blocks of the tiny Wan model (conftest.TINY_WAN)
H3_N = 3  # blocks of the tiny MiniMax-H3 model (conftest.TINY_H3)


@pytest.mark.parametrize("contiguous", [False, True])
@pytest.mark.parametrize("r", [0, 1, N - 1, N])
def test_bitwise_equal_to_resident_and_n_minus_r_transfers(tiny, registry, r: int, contiguous: bool) -> None:
    model = tiny.make_tiny_wan()
    reference = tiny.wan_forward(model)
    session = install_diffusion_accelerations(
        model, {"resident_blocks": {"offload_resident_blocks": r, "cpu_offload_block_contiguous": contiguous}},
        registry=registry,
    )
    outputs = tiny.run_request(model, "r1", steps=2)
    for out in outputs:
        assert torch.equal(out, reference)
    receipt = session.handles("resident_blocks")["model"].receipts["r1"]
    assert receipt.emulated is True
    assert receipt.num_blocks == N and receipt.resident_count == r
    assert receipt.resident_indices == tuple(uniform_resident_indices(N, r))
    assert receipt.forwards == 4
    assert receipt.transfers_per_forward == (N - r,) * 4
    assert receipt.transfers == 4 * (N - r)
    assert receipt.misses == 0 and receipt.discarded == 0
    assert receipt.resident_builds == (1 if r else 0)
    assert receipt.layout == ("contiguous" if contiguous else "per_tensor")
    per_load = 1 if contiguous else len(list(model.blocks[0].parameters()))
    assert receipt.copy_calls == receipt.transfers * per_load
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    assert receipt.bytes_copied >= receipt.transfers * block_bytes
    assert receipt.resident_bytes >= r * block_bytes
    assert (receipt.slot_bytes > 0) == (r < N)
    session.uninstall()
    assert torch.equal(tiny.wan_forward(model), reference)


def test_slots_follow_the_transfer_order_not_the_block_index(tiny, registry) -> None:
    """With blocks 0 and 2 resident, the streamed blocks 1 and 3 go to slots 0 and 1 in turn (index % 2
    would put both into slot 1)."""
    model = tiny.make_tiny_wan()
    session = install_diffusion_accelerations(
        model, {"resident_blocks": {"resident_block_indices": [0, 2]}}, registry=registry
    )
    tiny.run_request(model, "order", steps=1, branches=("cond",))
    receipt = session.handles("resident_blocks")["model"].receipts["order"]
    assert receipt.first_forward_transfers == ((1, 0), (3, 1))
    session.uninstall()

    session = install_diffusion_accelerations(model, {"resident_blocks": {"offload_resident_blocks": 0}},
                                              registry=registry)
    tiny.run_request(model, "r0", steps=1, branches=("cond",))
    receipt = session.handles("resident_blocks")["model"].receipts["r0"]
    assert receipt.first_forward_transfers == ((0, 0), (1, 1), (2, 0), (3, 1))
    session.uninstall()


def test_ledger_shows_every_block_executed_with_its_kind(tiny, registry) -> None:
    model = tiny.make_tiny_wan()
    session = install_diffusion_accelerations(model, {"resident_blocks": {"offload_resident_blocks": 2}},
                                              registry=registry)
    tiny.run_request(model, "led", steps=3)
    report = session.execution_report()["plugins"]["resident_blocks"]["model"]
    record = report["requests"]["led"]
    indices = uniform_resident_indices(N, 2)
    for i in range(N):
        kind = "resident" if i in indices else "streamed"
        assert record["modules"][f"blocks.{i}"] == {kind: 6}
    assert record["counters"]["transfers"] == 6 * (N - 2)
    assert record["counters"]["forwards"] == 6
    assert record["notes"]["offload"]["transfers_per_forward"] == [N - 2] * 6
    assert record["notes"]["offload"]["emulated"] is True
    assert record["finished"] is True
    session.uninstall()


@pytest.mark.parametrize("r", [0, 2, H3_N])
def test_minimax_h3_bitwise(tiny, registry, r: int) -> None:
    model = tiny.make_tiny_h3()
    reference = tiny.h3_forward(model)
    session = install_diffusion_accelerations(
        model, {"resident_blocks": {"offload_resident_blocks": r, "cpu_offload_block_contiguous": True}},
        registry=registry,
    )
    for out in tiny.run_request(model, "h3", steps=2, forward=tiny.h3_forward):
        assert torch.equal(out, reference)
    receipt = session.handles("resident_blocks")["model"].receipts["h3"]
    assert receipt.transfers_per_forward == (H3_N - r,) * 4
    session.uninstall()
    assert torch.equal(tiny.h3_forward(model), reference)


def test_mixed_dtype_blocks_stay_bitwise(tiny, registry) -> None:
    """bf16 weights with fp32-kept norms / modulation tables share one slab at aligned offsets."""
    model = tiny.make_tiny_wan()
    for name, p in model.named_parameters():
        if not any(k in name.split(".") for k in ("scale_shift_table", "norm1", "norm2", "norm3")):
            p.data = p.data.to(torch.bfloat16)
    inputs = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in tiny.wan_inputs().items()}
    reference = tiny.wan_forward(model, inputs)
    dtypes = {p.dtype for p in model.blocks[0].parameters()}
    assert dtypes == {torch.bfloat16, torch.float32}
    session = install_diffusion_accelerations(
        model, {"resident_blocks": {"offload_resident_blocks": 1, "cpu_offload_block_contiguous": True}},
        registry=registry,
    )
    for out in tiny.run_request(model, "bf16", steps=1, inputs=inputs):
        assert torch.equal(out, reference)
    session.uninstall()


def test_estimator_config_file_drives_the_plugin(tiny, registry, tmp_path) -> None:
    from worldfoundry.core.offload.estimator import estimate_residency
    from worldfoundry_resident_blocks.residency_files import write_estimate

    estimate = estimate_residency(N, compute_ms=1.0, transfer_ms=2.0, contiguous=True)  # r = N / 2
    paths = write_estimate(estimate, tmp_path)
    model = tiny.make_tiny_wan()
    reference = tiny.wan_forward(model)
    session = install_diffusion_accelerations(model, {"resident_blocks": {"config": str(paths["config"])}},
                                              registry=registry)
    record = session.receipt.plugins[0]
    assert record.options["config"] == str(paths["config"])
    assert record.options["resident_block_indices"] == list(estimate.indices) == [0, 2]
    assert record.options["cpu_offload_block_contiguous"] is True
    for out in tiny.run_request(model, "est", steps=1):
        assert torch.equal(out, reference)
    assert session.handles("resident_blocks")["model"].receipts["est"].transfers_per_forward == (N - 2,) * 2
    session.uninstall()


def test_block_counts_are_current_mid_request_and_per_implicit_request(tiny, registry) -> None:
    """Block executions are counted off the ledger on the hot path; reports still show every call."""
    from worldfoundry.core.acceleration.context import RequestContext, request_scope
    from worldfoundry.core.acceleration.guard import attach_request_guard

    model = tiny.make_tiny_wan()
    session = install_diffusion_accelerations(model, {"resident_blocks": {"offload_resident_blocks": 1}},
                                              registry=registry)
    guard = attach_request_guard(model)
    indices = uniform_resident_indices(N, 1)
    with guard.request("mid"):
        with request_scope(RequestContext("mid", "cond", 0)):
            tiny.wan_forward(model)
        mid = session.execution_report()["plugins"]["resident_blocks"]["model"]["requests"]["mid"]
        assert sum(sum(kinds.values()) for kinds in mid["modules"].values()) == N
        with request_scope(RequestContext("mid", "cond", 1)):
            tiny.wan_forward(model)
    tiny.wan_forward(model)  # outside any request: its own (implicit) request
    requests = session.execution_report()["plugins"]["resident_blocks"]["model"]["requests"]
    for i in range(N):
        kind = "resident" if i in indices else "streamed"
        assert requests["mid"]["modules"][f"blocks.{i}"] == {kind: 2}
    others = [rid for rid in requests if rid != "mid"]
    assert len(others) == 1
    assert sum(sum(kinds.values()) for kinds in requests[others[0]]["modules"].values()) == N
    session.uninstall()


def test_streamed_call_sees_slot_parameters_and_originals_come_back(tiny, registry) -> None:  # noqa: ANN001
    model = tiny.make_tiny_wan()
    reference = tiny.wan_forward(model)
    block = model.blocks[1]
    originals = {name: p for name, p in block.named_parameters()}
    seen: list[tuple[bool, bool]] = []

    def inside(module, args, kwargs):  # noqa: ANN001, ANN202 - a pre-hook of a Linear inside the streamed block
        weight = module.weight
        seen.append((weight is not originals["attn1.to_q.weight"],
                     torch.equal(weight, originals["attn1.to_q.weight"].detach())))

    spec = {"resident_blocks": {"offload_resident_blocks": 0, "cpu_offload_block_contiguous": False}}
    session = install_diffusion_accelerations(model, spec, registry=registry)
    hook = block.attn1.to_q.register_forward_pre_hook(inside, with_kwargs=True)
    outputs = tiny.run_request(model, "r", steps=1, branches=("cond",))
    hook.remove()
    assert torch.equal(outputs[0], reference)
    assert seen == [(True, True)]  # a slot parameter with the master's values, inside the call only
    assert all(p is originals[name] for name, p in block.named_parameters())
    session.uninstall()
    assert torch.equal(tiny.wan_forward(model), reference)


def test_a_parameter_shared_inside_a_block_is_swapped_everywhere(tiny, registry) -> None:  # noqa: ANN001
    model = tiny.make_tiny_wan()
    for block in model.blocks:  # tie K to Q inside every block
        block.attn1.to_k.weight = block.attn1.to_q.weight
    reference = tiny.wan_forward(model)
    spec = {"resident_blocks": {"offload_resident_blocks": 1, "cpu_offload_block_contiguous": True}}
    session = install_diffusion_accelerations(model, spec, registry=registry)
    for out in tiny.run_request(model, "r", steps=2):
        assert torch.equal(out, reference)
    assert all(b.attn1.to_k.weight is b.attn1.to_q.weight for b in model.blocks)
    session.uninstall()
    assert torch.equal(tiny.wan_forward(model), reference)
