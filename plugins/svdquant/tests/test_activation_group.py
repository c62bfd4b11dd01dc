"""``svdquant`` with ``activation_group``: INT8 activation scales per token and group of input channels on the
reference and (under ``TRITON_INTERPRET=1``) the Triton W4A8 GEMM; refusals name the option before any change."""

from __future__ import annotations

import pytest
import torch

from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.kernels.int8_act_quant import TRITON_AVAILABLE, interpreter_enabled
from worldfoundry.errors import AccelerationOptionsError

FFN2 = ["blocks.0.ffn.net.2", "blocks.1.ffn.net.2"]


def _run(kit, wan, artifact, **options):
    session = kit.install(wan, artifact, **options)
    with request_scope(RequestContext("r1", branch="cond", step_index=0)):
        out = kit.run_wan(wan)
    record = session.execution_report()["plugins"]["svdquant"]["model"]["requests"]["r1"]
    session.uninstall()
    return out, record


def test_reference_with_activation_groups_runs_changes_the_numerics_and_restores(kit, wan, tmp_path):
    artifact = kit.calibrate(wan, tmp_path / "channel.json", group_size=0, include=("blocks.*.ffn.2",))
    before = kit.fingerprint(wan)
    dense = kit.run_wan(wan)
    per_token, _ = _run(kit, wan, artifact, backend="reference")
    grouped, record = _run(kit, wan, artifact, backend="reference", activation_group=64)
    assert record["modules"] == {p: {"reference": 1} for p in FFN2} and record["fallbacks"] == {}
    assert not torch.equal(grouped, per_token)  # the option reached the Linears
    assert float((grouped - dense).norm() / dense.norm()) < 0.05  # the per-token tolerance of these weights
    kit.assert_same(before, kit.fingerprint(wan))


def test_w4a8_with_activation_groups_matches_the_reference(kit, wan, tmp_path):
    if not (TRITON_AVAILABLE and interpreter_enabled()):
        pytest.skip("the w4a8 kernel runs on the CPU only under TRITON_INTERPRET=1")
    artifact = kit.calibrate(wan, tmp_path / "g64.json", group_size=64)
    ref, _ = _run(kit, wan, artifact, backend="reference", activation_group=64)
    out, record = _run(kit, wan, artifact, backend="w4a8", activation_group=64)
    assert all(counts == {"w4a8": 1} for counts in record["modules"].values()) and len(record["modules"]) == 4
    assert float((out - ref).norm() / ref.norm()) < 1e-3  # the low-rank term's summation order only


def test_activation_groups_the_artifact_cannot_take_are_refused_before_any_change(kit, wan, tmp_path):
    channel = kit.calibrate(wan, tmp_path / "channel.json", group_size=0, include=("blocks.*.ffn.2",))
    grouped = kit.calibrate(wan, tmp_path / "g64.json", group_size=64)
    before = kit.fingerprint(wan)
    with pytest.raises(AccelerationOptionsError, match="or of 128 or 256 with a per-channel artifact"):
        kit.install(wan, channel, backend="w4a8", activation_group=64)
    with pytest.raises(AccelerationOptionsError, match="must divide the features and nest"):
        kit.install(wan, grouped, backend="reference", activation_group=256)  # ffn.0 has 64 input features
    with pytest.raises(AccelerationOptionsError, match="runs on backend reference or w4a8"):
        kit.install(wan, grouped, activation_group=64)  # backend auto
    kit.assert_same(before, kit.fingerprint(wan))


def test_w4a8_per_channel_with_activation_groups_of_128_matches_the_reference(kit, wan, tmp_path):
    if not (TRITON_AVAILABLE and interpreter_enabled()):
        pytest.skip("the w4a8 kernel runs on the CPU only under TRITON_INTERPRET=1")
    artifact = kit.calibrate(wan, tmp_path / "channel.json", group_size=0, include=("blocks.*.ffn.2",))
    ref, _ = _run(kit, wan, artifact, backend="reference", activation_group=128)
    out, record = _run(kit, wan, artifact, backend="w4a8", activation_group=128)
    assert record["modules"] == {p: {"w4a8": 1} for p in FFN2}
    assert float((out - ref).norm() / ref.norm()) < 1e-3
