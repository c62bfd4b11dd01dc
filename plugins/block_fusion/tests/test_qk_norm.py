"""The ``qk_norm`` chain (Wan's across-heads Q/K RMSNorm inside the rotary launch): counted where it runs, visible
fallbacks with their reason where it cannot reproduce eager, bitwise either way."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F  # noqa: N812

from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.errors import AccelerationOptionsError
from worldfoundry_block_fusion import qk_norm
from worldfoundry_block_fusion.options import WanOptions
from worldfoundry_block_fusion.qk_norm import REASON_QK_DEVICE, norm_modules_reason

pytestmark = pytest.mark.usefixtures("kernels")


@pytest.fixture(autouse=True)
def _helpers(kit) -> None:  # noqa: ANN001
    globals().update(build_wan=kit.build_wan, wan_inputs=kit.wan_inputs, run=kit.run, record_of=kit.record_of,
                     make_registry=kit.make_registry, kit=kit)


def install(model, options=None):
    return install_diffusion_accelerations(model, {"wan_block_fusion": options or {}}, registry=make_registry())


def test_default_chains_fuse_the_norms_with_the_rotary_bitwise() -> None:
    model = build_wan()
    inputs = wan_inputs()
    dense = run(model, inputs)
    session = install(model)
    assert torch.equal(run(model, inputs, "r1"), dense)
    record = record_of(session, "r1")
    assert record["counters"]["qk_norm"] == len(model.blocks) and record["counters"]["rope"] == len(model.blocks)
    assert record["fallbacks"] == {}
    session.uninstall()


def test_the_real_cpu_rms_norm_is_another_algorithm_so_the_chain_falls_back(kernels: torch.device,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    if kernels.type != "cpu":
        pytest.skip("the CPU's RMSNorm is checked on the CPU")
    monkeypatch.setattr(F, "rms_norm", kit.TORCH_RMS_NORM)
    monkeypatch.setattr(qk_norm, "QK_NORM_DEVICES", ("cuda",))
    model = build_wan()
    inputs = wan_inputs()
    dense = run(model, inputs)
    session = install(model)
    assert torch.equal(run(model, inputs, "r1"), dense)
    record = record_of(session, "r1")
    assert record["fallbacks"] == {REASON_QK_DEVICE: len(model.blocks)}
    assert record["counters"]["rope"] == len(model.blocks) and not record["counters"].get("qk_norm")
    session.uninstall()


def test_a_hooked_norm_runs_as_its_module_and_a_changed_weight_is_rechecked() -> None:
    model = build_wan(num_layers=1)
    inputs = wan_inputs()
    session = install(model)
    fused = run(model, inputs, "r0")
    seen = []
    handle = model.blocks[0].attn1.norm_k.register_forward_hook(lambda m, a, out: seen.append(1))
    assert torch.equal(run(model, inputs, "r1"), fused)
    handle.remove()
    assert seen == [1]
    assert record_of(session, "r1")["fallbacks"] == {"qk_norm: a norm is wrapped or hooked (it runs as a module)": 1}
    norm_q = model.blocks[0].attn1.norm_q
    original = norm_q.weight
    norm_q.weight = nn.Parameter(original.detach().float(), requires_grad=False)  # another dtype: not reproducible
    out = run(model, inputs, "r2")
    assert list(record_of(session, "r2")["fallbacks"]) == ["qk_norm: weight_q not a contiguous torch.bfloat16 "
                                                           "vector of 64"]
    norm_q.weight = original
    assert torch.equal(run(model, inputs, "r3"), fused) and record_of(session, "r3")["fallbacks"] == {}
    session.uninstall()
    assert out.shape == fused.shape


def test_options_and_module_checks() -> None:
    with pytest.raises(AccelerationOptionsError, match="qk_norm needs rope"):
        WanOptions.from_mapping({"chains": ["modulate", "qk_norm"]})
    assert "qk_norm" in WanOptions.from_mapping({}).chains
    rms = nn.RMSNorm(8, eps=1e-6)
    assert norm_modules_reason(rms, nn.RMSNorm(8, eps=1e-6), 8) is None
    assert "not torch.nn.RMSNorm" in norm_modules_reason(nn.LayerNorm(8), rms, 8)
    assert "no weight or no explicit eps" in norm_modules_reason(rms, nn.RMSNorm(8), 8)
    assert "full width" in norm_modules_reason(rms, nn.RMSNorm(4, eps=1e-6), 8)
