"""Explicit SDPA backends: approximate receipts, the backend is really used, rejections are loud."""

from __future__ import annotations

import pytest
import torch

from worldfoundry import testing
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.prepared import ROLE_APPROXIMATE_ATTENTION
from worldfoundry.errors import AccelerationRefusedError, AttentionBackendError

CUDA = torch.cuda.is_available()


OpRecorder = testing.OpRecorder


FLASH_CPU = "aten._scaled_dot_product_flash_attention_for_cpu.default"
SOFTMAX = "aten._safe_softmax.default"


def test_math_backend_is_used_counted_and_marked_approximate(builders, registry) -> None:  # noqa: ANN001
    case = builders["wan-i2v"]()
    dense = case.run(0)
    spec = {"optimized_mha": {"self": {"fusion": "none", "sdpa_backend": "math"},
                              "cross": {"fusion": "kv", "sdpa_backend": "math"}}}
    session = install_diffusion_accelerations(case.model, spec, registry=registry)
    plugin = session.receipt.plugins[0]
    assert plugin.exact is False and session.receipt.exact is False
    assert ROLE_APPROXIMATE_ATTENTION in plugin.claims
    assert {"blocks.0.attn1", "blocks.1.attn1", "blocks.0.attn2", "blocks.1.attn2"} <= set(plugin.claims)
    assert any("math" in note for note in plugin.notes)
    with OpRecorder() as rec:
        out = case.run(0)
    # 2 self-attention calls + 2 cross-attention modules x (image + text) = 6 SDPA calls, all decomposed (math)
    assert FLASH_CPU not in rec.ops
    assert rec.ops.count(SOFTMAX) == 6
    torch.testing.assert_close(out, dense, rtol=1e-4, atol=1e-5)
    record = session.execution_report()["plugins"]["optimized_mha"]["model"]["requests"]["<no-request>"]
    assert record["modules"]["blocks.0.attn1"] == {"sdpa_math": 1}
    assert record["modules"]["blocks.0.attn2"] == {"sdpa_math": 2}
    assert record["modules"]["blocks.0.attn2.to_k"] == {"fused_kv": 1}
    assert record["counters"]["sdpa_math"] == 6
    session.uninstall()
    with OpRecorder() as rec:
        assert torch.equal(case.run(0), dense)
    assert rec.ops.count(FLASH_CPU) == 6 and SOFTMAX not in rec.ops


def test_torch_backend_keeps_pytorch_choice(wan_case, registry) -> None:  # noqa: ANN001
    install_diffusion_accelerations(wan_case.model, {"optimized_mha": {"self": {"sdpa_backend": "torch"}}},
                                    registry=registry)
    with OpRecorder() as rec:
        wan_case.run(0)
    assert rec.ops.count(FLASH_CPU) == 4  # 2 self + 2 cross, as in the dense model


@pytest.mark.skipif(CUDA, reason="CPU rejection")
@pytest.mark.filterwarnings("ignore:.*(attention|kernel)")
@pytest.mark.parametrize("backend", ["efficient", "cudnn"])
def test_backend_unavailable_on_cpu_is_refused_at_prepare(wan_case, registry, backend: str) -> None:  # noqa: ANN001
    spec = {"optimized_mha": {"self": {"fusion": "none", "sdpa_backend": backend}}}
    with pytest.raises(AccelerationRefusedError, match=f"sdpa_backend='{backend}' is not available") as info:
        install_diffusion_accelerations(wan_case.model, spec, registry=registry)
    assert isinstance(info.value.__cause__, AttentionBackendError)
    assert "forward" not in wan_case.model.blocks[0].attn1.__dict__


def test_linear_attention_refuses_an_sdpa_backend(builders, registry) -> None:  # noqa: ANN001
    case = builders["sana"]()
    with pytest.raises(AccelerationRefusedError, match="linear attention"):
        install_diffusion_accelerations(case.model, {"optimized_mha": {"self": {"sdpa_backend": "math"}}},
                                        registry=registry)
    session = install_diffusion_accelerations(case.model, {"optimized_mha": {"cross": {"sdpa_backend": "math"}}},
                                              registry=registry)
    case.run(0)
    record = session.execution_report()["plugins"]["optimized_mha"]["model"]["requests"]["<no-request>"]
    assert record["modules"]["transformer_blocks.0.attn2"] == {"sdpa_math": 1}


def test_non_native_diffusers_backend_is_refused_then_detected_at_run_time(wan_case, registry) -> None:  # noqa: ANN001
    attn = wan_case.model.blocks[1].attn1
    spec = {"optimized_mha": {"self": {"fusion": "none", "sdpa_backend": "math"}}}
    attn.set_attention_backend("_native_math")  # this processor only (no global diffusers state)
    with pytest.raises(AccelerationRefusedError, match="_native_math"):
        install_diffusion_accelerations(wan_case.model, spec, registry=registry)
    attn.processor._attention_backend = None
    session = install_diffusion_accelerations(wan_case.model, spec, registry=registry)
    attn.set_attention_backend("_native_math")  # changed behind the plugin's back
    with pytest.raises(AttentionBackendError, match="_native_math"):
        wan_case.run(0)
    attn.processor._attention_backend = None
    session.uninstall()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("backend", ["flash", "cudnn", "efficient"])
def test_cuda_backends_run_and_are_counted(builders, registry, backend: str) -> None:  # noqa: ANN001
    case = builders["wan"]()
    case.model.to("cuda", torch.bfloat16)
    make_inputs = case.make_inputs
    case.make_inputs = lambda seed: {k: (v.to("cuda", torch.bfloat16) if v.is_floating_point() else v.cuda())
                                     for k, v in make_inputs(seed).items()}
    dense = case.run(0)
    spec = {"optimized_mha": {"self": {"sdpa_backend": backend}, "cross": {"sdpa_backend": backend}}}
    try:
        session = install_diffusion_accelerations(case.model, spec, registry=registry)
    except AccelerationRefusedError as exc:
        pytest.skip(f"{backend} unavailable here: {exc}")
    out = case.run(0)
    torch.testing.assert_close(out.float(), dense.float(), rtol=5e-2, atol=5e-2)
    counters = session.execution_report()["plugins"]["optimized_mha"]["model"]["requests"]["<no-request>"]["counters"]
    assert counters[f"sdpa_{backend}"] == 4
