"""Per-call routing of SDPA calls to providers: call order, declines, the step range, contract checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from worldfoundry.core.acceleration.context import RequestContext
from worldfoundry.core.attention.builtin_providers import builtin_providers
from worldfoundry.core.attention.provider_dispatch import (
    BELOW_MIN_TOKENS,
    OUTSIDE_STEP_RANGE,
    STEP_UNKNOWN,
    AttentionRoute,
    SdpaInterception,
    bind_sdpa_call,
)
from worldfoundry.errors import AttentionProviderError

MATH = {p.name: p for p in builtin_providers()}["sdpa_math"]


def _counting(provider):  # noqa: ANN001, ANN202 - the same provider, counting its calls
    import dataclasses

    calls = []

    def attention(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(args[0].shape)
        return provider.attention(*args, **kwargs)

    return dataclasses.replace(provider, name="counted", attention=attention), calls


def test_calls_are_routed_by_order_and_reported() -> None:
    provider, calls = _counting(MATH)
    seen = []
    q = torch.randn(1, 2, 8, 16)
    short = torch.randn(1, 2, 3, 16)
    routes = [AttentionRoute("image_cross", provider), None, AttentionRoute("text_cross", provider, min_tokens=4)]
    with SdpaInterception(routes, None, lambda r, why: seen.append((r.attention_type, why))) as mode:
        a = F.scaled_dot_product_attention(q, q, q)               # image_cross -> provider
        b = F.scaled_dot_product_attention(q, q, q)               # no route -> unchanged, unreported
        c = F.scaled_dot_product_attention(q, short, short)       # text_cross, 3 key tokens < 4 -> SDPA
        d = F.scaled_dot_product_attention(query=q, key=q, value=q)  # the last route serves further calls
        e = torch.matmul(q, q.transpose(-1, -2))                  # other torch functions pass through
    assert mode.calls == 4 and len(calls) == 2
    assert seen == [("image_cross", None), ("text_cross", BELOW_MIN_TOKENS), ("text_cross", None)]
    assert torch.equal(b, F.scaled_dot_product_attention(q, q, q)) and e.shape == (1, 2, 8, 8)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(d, b)
    assert torch.equal(c, F.scaled_dot_product_attention(q, short, short))


def test_unavailable_route_always_declines() -> None:
    route = AttentionRoute("self", MATH, unavailable="x unavailable: no GPU")
    q = torch.randn(1, 1, 4, 8)
    assert route.decline_before(4, None) == "x unavailable: no GPU"
    assert route.decline(bind_sdpa_call((q, q, q), {}), None) == "x unavailable: no GPU"


def test_provider_check_reason_is_prefixed_with_its_name() -> None:
    route = AttentionRoute("self", MATH)
    q = torch.randn(1, 1, 4, 8)
    call = bind_sdpa_call((q, q[:, :, :2], q[:, :, :2]), {"is_causal": True})
    assert call["scale"] is None and call["enable_gqa"] is False
    assert route.decline(call, None) == "sdpa_math: is_causal with different query and key lengths"


def test_wrong_result_breaks_the_contract() -> None:
    import dataclasses

    bad = dataclasses.replace(MATH, name="bad", attention=lambda q, k, v, **kw: q.double())
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(AttentionProviderError, match="provider 'bad': returned \\(1, 1, 4, 8\\) torch.float64"):
        with SdpaInterception([AttentionRoute("self", bad)], None, lambda r, why: None):
            F.scaled_dot_product_attention(q, q, q)


@given(st.integers(0, 6), st.integers(0, 6), st.integers(1, 12), st.integers(0, 11))
def test_step_range(first: int, last: int, total: int, step: int) -> None:
    route = AttentionRoute("self", MATH, dense_first_steps=first, dense_last_steps=last)
    ctx = RequestContext("r", step_index=step, num_steps=total)
    dense = step < first or (last > 0 and step >= total - last)
    expected = OUTSIDE_STEP_RANGE if (first or last) and dense else None
    assert route.decline_before(None, ctx) == expected
    if first or last:
        assert route.decline_before(None, None) == STEP_UNKNOWN
        assert route.decline_before(None, RequestContext("r")) == STEP_UNKNOWN
    else:
        assert route.decline_before(None, None) is None
