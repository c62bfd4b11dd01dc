"""On a GPU: the built-in PyTorch SDPA providers routed per attention type on a bf16 Wan model, counted, and
within bf16 rounding of the dense forward."""

from __future__ import annotations

import pytest
import torch

from worldfoundry import testing
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.attention.provider_registry import AttentionProviderRegistry
from worldfoundry.core.attention.providers import relative_l2

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("backend", ["sdpa_flash", "sdpa_cudnn", "sdpa_efficient"])
def test_builtin_backend_routes_and_counts(backend: str) -> None:
    from worldfoundry_attention_policy.options import Options
    from worldfoundry_attention_policy.plugin import make_prepare

    registry = AccelerationRegistry(discover=False)  # the built-in providers only: no entry point needed
    registry.register("attention_policy", make_prepare(AttentionProviderRegistry(discover=False)), options=Options)

    model = testing.tiny_wan(0, weight_scale=None, attention_head_dim=128, text_dim=64, ffn_dim=256)
    model = model.to("cuda", torch.bfloat16)
    inputs = {**testing.wan_inputs(model, frames=4, height=16, width=16, text_tokens=64, dtype=torch.bfloat16,
                                   device="cuda"), "return_dict": False}
    with torch.no_grad():
        dense = model(**inputs)[0]
    spec = {"attention_policy": {"self": backend, "text_cross": {"backend": backend, "min_tokens": 128},
                                 "on_unavailable": "fallback"}}
    session = install_diffusion_accelerations(model, spec, registry=registry)
    with request_scope(RequestContext("r1")), torch.no_grad():
        out = model(**inputs)[0]
    record = session.execution_report()["plugins"]["attention_policy"]["model"]["requests"]["r1"]
    if session.receipt.plugins[0].exact:  # the backend is not available on this GPU: every call fell back
        assert record["counters"] == {"dense_fallback": 4}
    else:
        assert record["counters"] == {backend: 2, "dense_fallback": 2}  # 64 text tokens < 128
        assert record["fallbacks"] == {"text_cross: below min_tokens": 2}
    assert relative_l2(out, dense) < 0.02
    session.uninstall()
    with torch.no_grad():
        assert torch.equal(model(**inputs)[0], dense)
