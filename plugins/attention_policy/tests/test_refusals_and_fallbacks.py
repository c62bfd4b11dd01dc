"""Probe failures (refused or visible fallback), unknown providers, unsupported inputs per call, non-native
diffusers backends, linear attention, and a provider that breaks the contract."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from worldfoundry import testing
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.attention.provider_registry import AttentionProviderRegistry
from worldfoundry.errors import (
    AccelerationOptionsError,
    AccelerationRefusedError,
    AttentionProviderError,
    UnknownAttentionProviderError,
)

TEST_PROVIDER = "chunked_softmax"
SELF_PATHS = ("blocks.0.attn1", "blocks.1.attn1")


def _r1(session) -> dict:
    return session.execution_report()["plugins"]["attention_policy"]["model"]["requests"]["r1"]


def test_unknown_provider_is_an_options_error_listing_the_known_ones(wan_case, registry) -> None:
    with pytest.raises(AccelerationOptionsError) as info:
        install_diffusion_accelerations(wan_case.model, {"attention_policy": {"self": "sol_attn"}}, registry=registry)
    assert info.value.path == "self.backend"
    assert "unknown attention provider 'sol_attn'" in str(info.value) and TEST_PROVIDER in str(info.value)
    assert isinstance(info.value.__cause__, UnknownAttentionProviderError)
    assert "_worldfoundry_accelerations" not in wan_case.model.__dict__


def test_provider_that_cannot_run_here_is_refused_by_default(wan_case, make_registry) -> None:
    providers = AttentionProviderRegistry(allowlist=["fa3"])  # the real fa3 distribution, on a CPU model
    with pytest.raises(AccelerationRefusedError) as info:
        install_diffusion_accelerations(wan_case.model, {"attention_policy": {"self": "fa3"}},
                                        registry=make_registry(providers))
    message = str(info.value)
    assert "self.backend='fa3' cannot run here: fa3 runs on ['cuda'], not cpu" in message
    assert "on_unavailable='fallback'" in message


def test_on_unavailable_fallback_installs_and_counts_every_call(wan_case, make_registry) -> None:
    dense = wan_case.run()
    providers = AttentionProviderRegistry(allowlist=["fa3"])
    spec = {"attention_policy": {"self": "fa3", "on_unavailable": "fallback"}}
    session = install_diffusion_accelerations(wan_case.model, spec, registry=make_registry(providers))
    record = session.receipt.plugins[0]
    assert record.exact is True  # every call runs PyTorch's own SDPA
    assert any("falls back to PyTorch SDPA on every call" in n for n in record.notes)
    with request_scope(RequestContext("r1")):
        assert torch.equal(wan_case.run(), dense)
    reason = "self: fa3 unavailable: fa3 runs on ['cuda'], not cpu"
    assert _r1(session)["module_fallbacks"] == {p: {reason: 1} for p in SELF_PATHS}
    assert _r1(session)["claimed_not_executed"] == list(SELF_PATHS)
    session.uninstall()


def test_inputs_a_provider_does_not_support_fall_back_per_call(wan_case, providers, make_registry) -> None:
    narrow = dataclasses.replace(providers.get(TEST_PROVIDER), name="chunked_hd64", head_dims=(64,))
    providers.register(narrow)
    spec = {"attention_policy": {"self": narrow.name, "on_unavailable": "fallback"}}
    session = install_diffusion_accelerations(wan_case.model, spec, registry=make_registry(providers))
    with request_scope(RequestContext("r1")):
        wan_case.run()
    assert _r1(session)["fallbacks"] == {
        "self: chunked_hd64 unavailable: chunked_hd64 supports head sizes [64], not 32": 2}
    session.uninstall()


def test_per_call_check_reason(wan_case, providers, make_registry) -> None:
    # declares float64 only: the prepare-time probe sees the float32 weights, so it is refused...
    f64 = dataclasses.replace(providers.get(TEST_PROVIDER), name="chunked_f64", dtypes=(torch.float64,))
    providers.register(f64)
    with pytest.raises(AccelerationRefusedError, match="chunked_f64 supports dtypes \\['float64'\\], not float32"):
        install_diffusion_accelerations(wan_case.model, {"attention_policy": {"self": f64.name}},
                                        registry=make_registry(providers))
    # ...and one that accepts the model but not a mask sees the call-time check decline (SDPA's additive mask)
    route = providers.get(TEST_PROVIDER)
    q = torch.randn(1, 2, 8, 16)
    assert route.check_call(q, q, q, attn_mask=torch.zeros(8, 8)) is None
    nomask = dataclasses.replace(route, name="chunked_nomask", masks=frozenset({"none"}))
    assert nomask.check_call(q, q, q, attn_mask=torch.zeros(8, 8)) == "additive attn_mask not supported"


def test_a_provider_returning_the_wrong_shape_fails_loudly(wan_case, providers, make_registry) -> None:
    def wrong(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):  # noqa: ANN001, ANN202
        return torch.zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3], dtype=query.dtype)

    providers.register(dataclasses.replace(providers.get(TEST_PROVIDER), name="transposed", attention=wrong))
    session = install_diffusion_accelerations(wan_case.model, {"attention_policy": {"self": "transposed"}},
                                              registry=make_registry(providers))
    with pytest.raises(AttentionProviderError, match="provider 'transposed': returned \\(1, 32, 2, 32\\)"):
        wan_case.run()
    session.uninstall()


def test_non_native_diffusers_backend_refused_at_prepare_and_seen_at_run_time(wan_case, registry) -> None:
    from diffusers.models.attention_dispatch import AttentionBackendName

    processor = wan_case.model.blocks[0].attn1.processor
    processor._attention_backend = AttentionBackendName._NATIVE_MATH
    try:
        with pytest.raises(AccelerationRefusedError, match="dispatches to diffusers attention backend '_native_math'"):
            install_diffusion_accelerations(wan_case.model, {"attention_policy": {"self": TEST_PROVIDER}},
                                            registry=registry)
    finally:
        del processor._attention_backend
    session = install_diffusion_accelerations(wan_case.model, {"attention_policy": {"self": TEST_PROVIDER}},
                                              registry=registry)
    processor._attention_backend = AttentionBackendName._NATIVE_MATH  # the user switches it afterwards
    try:
        with request_scope(RequestContext("r1")):
            wan_case.run()
    finally:
        del processor._attention_backend
    fallbacks = _r1(session)["module_fallbacks"]
    assert fallbacks == {"blocks.0.attn1": {"self: diffusers attention backend '_native_math' is active, not 'native'": 1}}
    assert _r1(session)["modules"] == {"blocks.1.attn1": {TEST_PROVIDER: 1}}
    session.uninstall()


def test_sana_linear_self_attention_is_refused_and_cross_is_routed(registry, providers, make_registry) -> None:
    model = testing.tiny_sana_video(0, patch_size=(1, 2, 2), rope_max_seq_len=64)
    inputs = {**testing.sana_video_inputs(model, text_tokens=12, padded_tokens=3), "return_dict": False}
    with pytest.raises(AccelerationRefusedError, match="linear attention"):
        install_diffusion_accelerations(model, {"attention_policy": {"self": TEST_PROVIDER}}, registry=registry)
    with torch.no_grad():
        dense = model(**inputs)[0]
    session = install_diffusion_accelerations(model, {"attention_policy": {"text_cross": TEST_PROVIDER}},
                                              registry=registry)
    with request_scope(RequestContext("r1")), torch.no_grad():
        out = model(**inputs)[0]
    torch.testing.assert_close(out, dense, rtol=1e-4, atol=1e-5)  # the padded text tokens are masked out
    counters = _r1(session)["counters"]
    assert counters == {TEST_PROVIDER: 2}
    session.uninstall()
    # a provider without mask support: the masked cross-attention calls fall back, call by call
    providers.register(dataclasses.replace(providers.get(TEST_PROVIDER), name="nomask", masks=frozenset({"none"})))
    session = install_diffusion_accelerations(model, {"attention_policy": {"text_cross": "nomask"}},
                                              registry=make_registry(providers))
    with request_scope(RequestContext("r1")), torch.no_grad():
        assert torch.equal(model(**inputs)[0], dense)
    (reason, n), = _r1(session)["fallbacks"].items()
    assert n == 2 and reason.startswith("text_cross: nomask: ") and reason.endswith("attn_mask not supported")
    session.uninstall()
