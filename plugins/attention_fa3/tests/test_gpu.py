"""FlashAttention-3 from the fa3-fwd wheel on a Hopper GPU: the probe, accuracy against an fp32 reference next to
PyTorch SDPA's, and ``attention_policy`` routing a Wan model's self-attention to it."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from worldfoundry import testing
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.attention.provider_registry import AttentionProviderRegistry
from worldfoundry.core.attention.providers import reference_attention, relative_l2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("fa3_fwd_interface") is None, reason="fa3-fwd is not installed"),
]


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.fixture
def fa3():  # noqa: ANN201
    from worldfoundry_attention_fa3.provider import fa3_provider

    return fa3_provider()


@pytest.mark.skipif(not _sm90(), reason="fa3-fwd kernels are built for sm90")
def test_probe_and_accuracy_match_sdpa(fa3) -> None:  # noqa: ANN001
    assert fa3.probe("cuda", torch.bfloat16, 128) is None
    assert "fp16" in fa3.probe("cuda", torch.float16, 128)
    g = torch.Generator(device="cuda").manual_seed(0)
    for sq, sk in ((4096, 4096), (4096, 512)):
        q = torch.randn(1, 12, sq, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(1, 12, sk, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        ref = reference_attention(q, k, v)
        out = fa3.attention(q, k, v)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        assert out.shape == sdpa.shape and out.dtype == torch.bfloat16
        assert relative_l2(out, ref) <= 1.05 * relative_l2(sdpa, ref) + 1e-4
    # tokens-major views (what diffusers' dispatcher passes) read without a copy
    base = torch.randn(1, 2048, 12, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    view = base.transpose(1, 2)
    torch.testing.assert_close(fa3.attention(view, view, view), fa3.attention(*(view.contiguous(),) * 3))


@pytest.mark.skipif(not _sm90(), reason="fa3-fwd kernels are built for sm90")
def test_attention_policy_routes_wan_self_attention_to_fa3(fa3) -> None:  # noqa: ANN001
    from worldfoundry_attention_policy.options import Options
    from worldfoundry_attention_policy.plugin import make_prepare

    model = testing.tiny_wan(0, weight_scale=None, attention_head_dim=128, text_dim=64, ffn_dim=256)
    model = model.to("cuda", torch.bfloat16)
    inputs = {**testing.wan_inputs(model, frames=4, height=32, width=32, text_tokens=64, dtype=torch.bfloat16,
                                   device="cuda"), "return_dict": False}
    with torch.no_grad():
        dense = model(**inputs)[0]
    providers = AttentionProviderRegistry(discover=False)
    providers.register(fa3)
    registry = AccelerationRegistry(discover=False)
    registry.register("attention_policy", make_prepare(providers), options=Options)
    session = install_diffusion_accelerations(model, {"attention_policy": {"self": {"backend": "fa3",
                                                                                     "min_tokens": 1024}}},
                                              registry=registry)
    with request_scope(RequestContext("r1")), torch.no_grad():
        out = model(**inputs)[0]
    r1 = session.execution_report()["plugins"]["attention_policy"]["model"]["requests"]["r1"]
    assert r1["counters"] == {"fa3": 2} and r1["claimed_not_executed"] == []
    assert relative_l2(out, dense) < 0.02  # bf16 rounding of a different kernel, random weights
    session.uninstall()
    with torch.no_grad():
        assert torch.equal(model(**inputs)[0], dense)


@pytest.mark.skipif(not _sm90(), reason="fa3-fwd kernels are built for sm90")
def test_direct_op_call_equals_flash_attn_func() -> None:
    from fa3_fwd_interface import flash_attn_func
    from worldfoundry_attention_fa3 import provider

    assert provider._direct_op() is not None, "the pinned fa3-fwd version's op signature is known"
    g = torch.Generator(device="cuda").manual_seed(1)
    for sq, sk, causal, scale in ((3600, 3600, False, None), (1000, 512, False, 0.1), (777, 777, True, None)):
        q = torch.randn(2, sq, 12, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(2, sk, 12, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        with torch.no_grad():
            direct = provider.fa3_tokens_major(q, k, v, scale=scale, is_causal=causal)
        assert torch.equal(direct, flash_attn_func(q, k, v, softmax_scale=scale, causal=causal))
    # inputs that need a gradient take flash_attn_func's autograd path (fa3-fwd has no backward: it raises there)
    q.requires_grad_(True)
    assert not provider._direct_ok(q, k, v)
