"""The attention provider contract: declared capabilities, probe and per-call checks, the layout adapter,
the built-in PyTorch SDPA providers and the float32 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.core.attention.builtin_providers import DEFAULT_PROVIDER, builtin_providers
from worldfoundry.core.attention.providers import (
    APPROXIMATE,
    EXACT_EQUIVALENT,
    MASK_CAUSAL,
    AttentionProvider,
    from_tokens_major,
    reference_attention,
    relative_l2,
)


def _provider(**changes) -> AttentionProvider:  # noqa: ANN003
    base = dict(name="p", version="1", numerics=EXACT_EQUIVALENT, attention=F.scaled_dot_product_attention,
                device_types=("cpu",))
    base.update(changes)
    return AttentionProvider(**base)


@pytest.mark.parametrize(("changes", "error", "fragment"), [
    ({"name": "a b"}, TypeError, "identifier-like"),
    ({"numerics": "bitwise"}, ValueError, "numerics must be one of ['exact_equivalent', 'approximate']"),
    ({"attention": 3}, TypeError, "attention must be callable"),
    ({"masks": frozenset({"sliding"})}, ValueError, "unknown mask kinds ['sliding']"),
])
def test_contract_is_validated(changes: dict, error: type, fragment: str) -> None:
    with pytest.raises(error) as info:
        _provider(**changes)
    assert fragment in str(info.value)


def test_probe_reasons_name_the_provider_and_the_limit() -> None:
    calls = []

    def env(device, dtype, head_dim):  # noqa: ANN001, ANN202
        calls.append((device.type, dtype, head_dim))
        return "package missing" if head_dim == 128 else None

    p = _provider(dtypes=(torch.float32,), head_dims=(64, 128), probe_fn=env)
    assert p.probe("cuda", torch.float32, 64) == "p runs on ['cpu'], not cuda"
    assert p.probe("cpu", torch.bfloat16, 64) == "p supports dtypes ['float32'], not bfloat16"
    assert p.probe("cpu", torch.float32, 80) == "p supports head sizes [64, 128], not 80"
    assert p.probe("cpu", torch.float32, 64, masks=("causal",)) == "p supports masks ['none'], not ['causal']"
    assert p.probe("cpu", torch.float32, 64) is None
    assert p.probe("cpu", torch.float32, 128) == "package missing"
    assert calls == [("cpu", torch.float32, 64), ("cpu", torch.float32, 128)]  # only after the declared checks
    assert _provider().probe("cpu", torch.int8, 64) == "p needs a floating dtype, not int8"


def test_min_compute_capability_without_cuda() -> None:
    p = _provider(device_types=("cuda",), min_compute_capability=(9, 0))
    if not torch.cuda.is_available():
        assert p.probe("cuda", torch.bfloat16, 128) == "p needs CUDA, which is not available"
    assert p.to_json()["min_compute_capability"] == "9.0"


def test_check_call_declines_what_is_not_declared() -> None:
    p = _provider(head_dims=(16,))
    q, k = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 6, 16)
    assert p.check_call(q, k, k) is None
    assert p.check_call(q[0], k[0], k[0]) == "inputs are not 4-D (batch, heads, tokens, head_dim)"
    assert p.check_call(q, k.double(), k) == "query, key and value dtypes differ"
    assert p.check_call(torch.randn(1, 2, 8, 32), torch.randn(1, 2, 6, 32), torch.randn(1, 2, 6, 32)) \
        == "p supports head sizes [16], not 32"
    assert p.check_call(q, k, torch.randn(1, 2, 6, 8)) == "value head size differs from the query's"
    assert p.check_call(q, k, k, attn_mask=torch.ones(8, 6, dtype=torch.bool)) == "boolean attn_mask not supported"
    assert p.check_call(q, k, k, attn_mask=torch.zeros(8, 6)) == "additive attn_mask not supported"
    assert p.check_call(q, k, k, is_causal=True) == "is_causal not supported"
    assert _provider(masks=frozenset({MASK_CAUSAL})).check_call(q, k, k, is_causal=True) \
        == "is_causal with different query and key lengths"
    assert p.check_call(q, k, k, dropout_p=0.1) == "dropout not supported"
    assert p.check_call(q, k[:, :1], k[:, :1]) == "grouped-query attention not supported"


def _bshd_attention(q, k, v, *, scale, is_causal):  # noqa: ANN001, ANN202 - a tokens-major attention, computed directly
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).tril().logical_not(), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.float()).to(q.dtype)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 2), st.integers(1, 3), st.integers(1, 12), st.integers(1, 12), st.sampled_from([8, 16]),
       st.booleans())
def test_tokens_major_adapter_matches_sdpa(batch: int, heads: int, sq: int, sk: int, d: int, causal: bool) -> None:
    g = torch.Generator().manual_seed(sq * 100 + sk)
    q, k, v = (torch.randn(batch, heads, n, d, generator=g) for n in (sq, sk, sk))
    if causal:
        k, v = k[..., :sq, :] if sk >= sq else k, v[..., :sq, :] if sk >= sq else v
        sq = k.shape[-2]
        q = q[..., :sq, :]
    attention = from_tokens_major(_bshd_attention)
    out = attention(q, k, v, is_causal=causal, scale=0.3)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="takes no attn_mask or dropout"):
        attention(q, k, v, dropout_p=0.5)


def test_reference_attention_and_relative_l2() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=g) for _ in range(3))
    mask = torch.rand(9, 9, generator=g) > 0.2
    mask.fill_diagonal_(True)
    for kwargs in ({}, {"is_causal": True}, {"attn_mask": mask}, {"attn_mask": torch.randn(9, 9, generator=g)}):
        ref = reference_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), **kwargs)
        assert ref.dtype == torch.float32
        torch.testing.assert_close(ref, F.scaled_dot_product_attention(
            q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), **kwargs), rtol=1e-5, atol=1e-6)
    assert relative_l2(q, q) == 0.0 and abs(relative_l2(2 * q, q) - 1.0) < 1e-12


def test_builtin_providers() -> None:
    providers = {p.name: p for p in builtin_providers()}
    assert list(providers) == [DEFAULT_PROVIDER, "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math"]
    assert all(p.numerics == EXACT_EQUIVALENT and p.distribution == "torch" for p in providers.values())
    assert APPROXIMATE not in {p.numerics for p in providers.values()}
    q = torch.randn(1, 2, 8, 16)
    assert torch.equal(providers["sdpa"].attention(q, q, q), F.scaled_dot_product_attention(q, q, q))
    torch.testing.assert_close(providers["sdpa_math"].attention(q, q, q, is_causal=True),
                               F.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert providers["sdpa_math"].probe("cpu", torch.float32, 16) is None
    if not torch.cuda.is_available():
        reason = providers["sdpa_cudnn"].probe("cpu", torch.float32, 16)
        assert reason.startswith("PyTorch SDPA backend 'cudnn' is not available for torch.float32 on cpu")
