"""``svdquant`` with a per-output-channel artifact (``group_size = 0``): receipts, numerics vs dense, exact restore.

The tiny Wan's ``ffn.2`` Linears have 128 input features (one per-channel packing block); ``ffn.0`` has 64 and is
left out. Under ``TRITON_INTERPRET=1`` the ``w4a8`` backend runs the per-channel Triton kernel on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.kernels.int8_act_quant import TRITON_AVAILABLE, interpreter_enabled

FFN2 = ["blocks.0.ffn.net.2", "blocks.1.ffn.net.2"]


@pytest.fixture
def channel_artifact(kit, wan, tmp_path):
    return kit.calibrate(wan, tmp_path / "channel.json", group_size=0, include=("blocks.*.ffn.2",))


@pytest.mark.parametrize("backend", ["reference", "w4a8"])
def test_per_channel_artifact_runs_and_restores_exactly(kit, wan, channel_artifact, backend):
    if backend == "w4a8" and not (TRITON_AVAILABLE and interpreter_enabled()):
        pytest.skip("the w4a8 kernel runs on the CPU only under TRITON_INTERPRET=1")
    before = kit.fingerprint(wan)
    dense = kit.run_wan(wan)
    session = kit.install(wan, channel_artifact, backend=backend)
    section = session.execution_report()["plugins"]["svdquant"]["model"]["svdquant"]
    assert section["artifact"]["group_size"] == 0 and section["artifact"]["scale_grouping"] == "per channel"
    with request_scope(RequestContext("r1", branch="cond", step_index=0)):
        out = kit.run_wan(wan)
    record = session.execution_report()["plugins"]["svdquant"]["model"]["requests"]["r1"]
    assert record["modules"] == {p: {backend: 1} for p in FFN2} and record["fallbacks"] == {}
    # stated tolerance for these random weights (rank 16, per channel, INT8 activations): relative L2 < 5 %
    assert float((out - dense).norm() / dense.norm()) < 0.05
    session.uninstall()
    kit.assert_same(before, kit.fingerprint(wan))


@pytest.mark.parametrize("backend", ["reference", "w4f8"])
def test_an_unsmoothed_artifact_runs_without_smoothing_and_restores(kit, wan, tmp_path, backend):
    """``ffn.2`` calibrated with ``unsmoothed``: no ``1/λ`` anywhere, the same receipts and tolerance."""
    artifact = kit.calibrate(wan, tmp_path / "plain.json", group_size=0, include=("blocks.*.ffn.2",),
                             unsmoothed=("blocks.*.ffn.2",))
    before = kit.fingerprint(wan)
    dense = kit.run_wan(wan)
    session = kit.install(wan, artifact, backend=backend)
    targets = next(iter(session.handles("svdquant").values())).runtime.targets
    assert all(t.weight.inv_smooth is None for t in targets.values())
    with request_scope(RequestContext("r1", branch="cond", step_index=0)):
        out = kit.run_wan(wan)
    record = session.execution_report()["plugins"]["svdquant"]["model"]["requests"]["r1"]
    ran = "reference_w4f8" if backend == "w4f8" else backend  # off CUDA, w4f8 runs its torch reference
    assert record["modules"] == {p: {ran: 1} for p in FFN2} and record["fallbacks"] == {}
    assert float((out - dense).norm() / dense.norm()) < 0.05
    session.uninstall()
    kit.assert_same(before, kit.fingerprint(wan))


def test_w4a16_asked_for_off_cuda_runs_its_own_reference_visibly(kit, wan, channel_artifact):
    """Off CUDA (no interpreter), ``backend: w4a16`` runs the torch reference of the W4A16 numerics -- bfloat16
    activations, no INT8 codes -- not the W4A8 one, and the receipts say which and why."""
    from worldfoundry.core.acceleration.quantization.svdquant_numerics import w4a16_linear_reference

    if TRITON_AVAILABLE and interpreter_enabled():
        pytest.skip("under TRITON_INTERPRET=1 w4a16 runs the Triton kernel itself")
    before = kit.fingerprint(wan)
    dense = kit.run_wan(wan)
    session = kit.install(wan, channel_artifact, backend="w4a16")
    target = next(iter(session.handles("svdquant").values())).runtime.targets[FFN2[0]]
    x = torch.randn(3, target.weight.in_features)
    assert torch.equal(target.linear(x), w4a16_linear_reference(x, target.weight, target.linear.bias))
    with request_scope(RequestContext("r1", branch="cond", step_index=0)):
        out = kit.run_wan(wan)
    record = session.execution_report()["plugins"]["svdquant"]["model"]["requests"]["r1"]
    assert record["modules"] == {p: {"reference_w4a16": 1} for p in FFN2}
    assert record["counters"]["backend_reason: cpu device"] == 2
    assert float((out - dense).norm() / dense.norm()) < 0.05
    session.uninstall()
    kit.assert_same(before, kit.fingerprint(wan))
