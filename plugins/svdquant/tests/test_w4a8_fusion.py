"""``svdquant``'s W4A8 GELU producer fusion on the tiny Wan (bfloat16), with the Triton kernels on the CPU under
``TRITON_INTERPRET=1``: receipts, closeness to the per-Linear path, the visible skips, exact restore."""

from __future__ import annotations

import pytest
import torch

from worldfoundry_svdquant.ffn_fusion_w4a8 import FUSED_KIND_W4A8, SINGLE_PASS_KIND, SKIP_NOT_BF16
from worldfoundry_svdquant.plugin import prepare
from worldfoundry.base_models.diffusion_model.optimizations.plugins import install_diffusion_accelerations
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.kernels.int8_act_quant import TRITON_AVAILABLE, interpreter_enabled
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.model_loading.policy import RuntimePolicy

pytestmark = pytest.mark.skipif(not (TRITON_AVAILABLE and interpreter_enabled()),
                                reason="the W4A8 kernels run on the CPU only under TRITON_INTERPRET=1")
FFNS = ["blocks.0.ffn", "blocks.1.ffn"]


def _install(model, artifact, **options):
    reg = AccelerationRegistry(discover=False)
    reg.register("svdquant", prepare)
    return install_diffusion_accelerations(model, {"svdquant": {"artifact": str(artifact), "backend": "w4a8",
                                                                **options}}, RuntimePolicy(), registry=reg)


def _run(kit, model, session, request, dtype):
    with request_scope(RequestContext(request, branch="cond", step_index=0)):
        out = kit.run_wan(model, dtype)
    return out, session.execution_report()["plugins"]["svdquant"]["model"]["requests"][request]


@pytest.fixture
def bf16_wan(kit):
    return kit.build_wan(dtype=torch.bfloat16)


def _per_linear_then_fused(kit, model, artifact):
    """The per-Linear output, then the fused one with its receipt record; the fused session still installed."""
    session = _install(model, artifact, fuse_gelu=False)
    per_linear, _ = _run(kit, model, session, "r0", torch.bfloat16)
    session.uninstall()
    session = _install(model, artifact)
    fused, record = _run(kit, model, session, "r1", torch.bfloat16)
    return per_linear, fused, record, session


def test_fused_ffn_runs_one_producer_and_restores_exactly(kit, bf16_wan, tmp_path):
    artifact = kit.calibrate(bf16_wan, tmp_path / "bf16.json")
    before = kit.fingerprint(bf16_wan)
    per_linear, fused, record, session = _per_linear_then_fused(kit, bf16_wan, artifact)
    for ffn in FFNS:
        assert record["modules"][ffn] == {FUSED_KIND_W4A8: 1}
        assert record["modules"][f"{ffn}.net.0.proj"] == {"w4a8": 1}
        assert record["modules"][f"{ffn}.net.2"] == {"w4a8": 1}
    assert record["fallbacks"] == {} and not record.get("skipped")
    # stated tolerance: only the GELU's rounding differs from the per-Linear path (a few codes one apart)
    assert float((fused.float() - per_linear.float()).norm() / per_linear.float().norm()) < 0.01  # measured 0.0016
    session.uninstall()
    kit.assert_same(before, kit.fingerprint(bf16_wan))


def test_an_unsmoothed_down_projection_reads_the_up_output_once(kit, bf16_wan, tmp_path):
    """``net.2`` calibrated without smoothing: the up GEMM hands the row maxima to the producer, which reads ``h``
    once; the receipt says so, and the output stays as close to the per-Linear path as the two-pass producer."""
    artifact = kit.calibrate(bf16_wan, tmp_path / "bf16u.json", unsmoothed=("blocks.*.ffn.2",))
    before = kit.fingerprint(bf16_wan)
    per_linear, fused, record, session = _per_linear_then_fused(kit, bf16_wan, artifact)
    for ffn in FFNS:
        assert record["modules"][ffn] == {FUSED_KIND_W4A8: 1, SINGLE_PASS_KIND: 1}
        assert record["modules"][f"{ffn}.net.2"] == {"w4a8": 1}
    assert record["fallbacks"] == {} and not record.get("skipped")
    assert float((fused.float() - per_linear.float()).norm() / per_linear.float().norm()) < 0.01
    session.uninstall()
    kit.assert_same(before, kit.fingerprint(bf16_wan))


def test_a_float32_model_runs_per_linear_and_says_why(kit, wan, tmp_path):
    artifact = kit.calibrate(wan, tmp_path / "fp32.json")
    session = _install(wan, artifact)
    _, record = _run(kit, wan, session, "r1", torch.float32)
    assert record["skipped"] == {SKIP_NOT_BF16: 2}
    assert all(FUSED_KIND_W4A8 not in record["modules"].get(ffn, {}) for ffn in FFNS)
    assert record["modules"]["blocks.0.ffn.net.2"] == {"w4a8": 1}
    session.uninstall()
