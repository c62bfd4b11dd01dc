"""Rotary kernels (Wan Q/K, SANA-Video linear attention) vs their torch references, bitwise (interpreter on CPU).

The references are diffusers 0.42's processor code; ``plugins/block_fusion/tests`` compares whole processors.
"""

from __future__ import annotations

import pytest
import torch

from worldfoundry.core.fusion import rope
from worldfoundry.core.fusion.triton_support import TRITON_AVAILABLE, interpreter_enabled

pytestmark = pytest.mark.skipif(not (TRITON_AVAILABLE and interpreter_enabled()),
                                reason="needs triton with TRITON_INTERPRET=1")


def _freqs(s: int, d: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    cos, sin = get_1d_rotary_pos_embed(d, s, 10000.0, use_real=True, repeat_interleave_real=True,
                                       freqs_dtype=torch.float64)
    return cos.reshape(1, s, 1, d).to(dtype), sin.reshape(1, s, 1, d).to(dtype)


@pytest.mark.parametrize("freq_dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [2**31 - 1, 7])
def test_rope_qk_bitwise_on_packed_qkv(freq_dtype: torch.dtype, limit: int) -> None:
    """Q and K as chunks of one packed [B, S, 3 * H * D] projection (reachable range 3x the output)."""
    b, s, h, d = 2, 9, 3, 16
    g = torch.Generator().manual_seed(1)
    qkv = (torch.randn(b, s, 3 * h * d, generator=g) * 3).to(torch.bfloat16)
    q, k, _ = (t.unflatten(2, (h, d)) for t in qkv.chunk(3, dim=-1))
    cos, sin = _freqs(s, d, freq_dtype)
    out_q, out_k = rope.rope_qk(q, k, cos, sin, index_limit=limit)
    ref_q, ref_k = rope.reference_rope_qk(q, k, cos, sin)
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    assert out_q.stride() == ref_q.stride() and out_q.dtype == torch.bfloat16


def test_rope_float32_queries_with_float64_frequencies() -> None:
    q = torch.randn(1, 5, 2, 8)
    k = torch.randn(1, 5, 2, 8)
    cos, sin = _freqs(5, 8, torch.float64)
    out_q, out_k = rope.rope_qk(q, k, cos, sin)
    assert torch.equal(out_q, rope.reference_rope(q, cos, sin)) and torch.equal(out_k, rope.reference_rope(k, cos, sin))


@pytest.mark.parametrize("limit", [2**31 - 1, 5])
def test_sana_relu_rope_and_normalize_bitwise(limit: int) -> None:
    b, n, h, d = 1, 12, 2, 16
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(b, n, h, d, generator=g).to(torch.bfloat16) for _ in range(3))
    cos, sin = _freqs(n, d, torch.bfloat16)
    out = rope.sana_relu_rope(q, k, v, cos, sin, index_limit=limit)
    ref = rope.reference_sana_relu_rope(q, k, v, cos, sin)
    for a, r in zip(out, ref, strict=True):
        assert torch.equal(a, r) and a.stride() == r.stride()
    no_value = rope.sana_relu_rope(q, k, None, cos, sin)
    assert no_value[4] is None and torch.equal(no_value[2], ref[2])
    hidden = torch.randn(b, h, d, n, generator=g)
    for denom in (torch.rand(b, h, 1, n, generator=g), torch.rand(b, h, 1, n, generator=g).to(torch.bfloat16)):
        got = rope.sana_normalize(hidden, denom, torch.bfloat16, index_limit=limit)
        assert torch.equal(got, rope.reference_sana_normalize(hidden, denom, torch.bfloat16))


def test_relu_keeps_nan_and_zeroes_negative_zero() -> None:
    q = torch.tensor([[[[float("nan"), -0.0, -1.0, 2.0]]]], dtype=torch.bfloat16)
    cos, sin = torch.ones(1, 1, 1, 4, dtype=torch.bfloat16), torch.zeros(1, 1, 1, 4, dtype=torch.bfloat16)
    rq, _, _, _, _ = rope.sana_relu_rope(q, q.clone(), None, cos, sin)
    ref = torch.relu(q)
    assert torch.isnan(rq[0, 0, 0, 0]) and torch.equal(rq[..., 1:], ref[..., 1:])
    assert not torch.signbit(rq[0, 0, 0, 1])


def test_mismatched_frequency_layouts_are_refused() -> None:
    q = torch.randn(1, 4, 1, 8)
    cos, sin = _freqs(4, 8, torch.float64)
    with pytest.raises(ValueError, match="freqs_cos and freqs_sin"):
        rope.rope_qk(q, q, cos, sin.transpose(1, 3).contiguous().transpose(1, 3))


@pytest.fixture
def pair_variant_only():
    """Run the element-pair variant (any strides) on operands the row-contiguous variant would take."""
    rope._STRIDED_ONLY[0] = True
    try:
        yield
    finally:
        rope._STRIDED_ONLY[0] = False


def _variant(q: torch.Tensor) -> bool:
    """ROW_CONTIGUOUS of the plan the last launch on ``q``'s geometry used."""
    plans = [plan for key, plan in rope._PLANS.items() if key[1] == q.shape and key[2] == q.stride()]
    return bool(plans[-1]._kwargs["ROW_CONTIGUOUS"])


@pytest.mark.parametrize("freq_dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_row_contiguous_and_pair_variants_are_bitwise_equal(freq_dtype: torch.dtype, request) -> None:
    """Whole-row loads split in registers compute the very values the element-pair loads compute (Wan and SANA)."""
    b, s, h, d = 2, 7, 3, 24  # D = 24: 12 pairs in a block of 16 (masked lanes)
    g = torch.Generator().manual_seed(5)
    q, k, v = ((torch.randn(b, s, h, d, generator=g) * 3).to(torch.bfloat16) for _ in range(3))
    cos, sin = _freqs(s, d, freq_dtype)
    rows = rope.rope_qk(q, k, cos, sin)
    assert _variant(q) is True
    sana_rows = rope.sana_relu_rope(q, k, v, cos.to(torch.bfloat16), sin.to(torch.bfloat16))
    request.getfixturevalue("pair_variant_only")
    pairs = rope.rope_qk(q, k, cos, sin)
    assert _variant(q) is False
    sana_pairs = rope.sana_relu_rope(q, k, v, cos.to(torch.bfloat16), sin.to(torch.bfloat16))
    assert all(torch.equal(a, c) for a, c in zip(rows, pairs, strict=True))
    assert all(torch.equal(a, c) for a, c in zip(sana_rows, sana_pairs, strict=True))
    ref = rope.reference_rope_qk(q, k, cos, sin)
    assert all(torch.equal(a, r) for a, r in zip(rows, ref, strict=True))


def test_strided_head_elements_take_the_pair_variant() -> None:
    """A view whose D elements are not contiguous (every other element of a wider tensor) is still exact."""
    g = torch.Generator().manual_seed(6)
    wide = torch.randn(1, 5, 2, 32, generator=g).to(torch.bfloat16)
    q = wide[..., ::2]
    assert not rope.row_contiguous(q) and rope.row_contiguous(q.contiguous())
    cos, sin = _freqs(5, 16, torch.float64)
    out_q, out_k = rope.rope_qk(q, q, cos, sin)
    assert _variant(q) is False
    assert torch.equal(out_q, rope.reference_rope(q, cos, sin)) and torch.equal(out_k, out_q)


def test_a_row_variant_that_fails_on_first_launch_falls_back_to_pairs(monkeypatch, caplog) -> None:
    """Fault injection: the first launch of a row-contiguous plan raises (as a compiler error would)."""
    from worldfoundry.core.fusion.launch import KernelLauncher

    original = KernelLauncher.__call__

    def failing(self, *args, **kwargs):
        if self._kwargs.get("ROW_CONTIGUOUS"):
            raise RuntimeError("injected compile failure")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(KernelLauncher, "__call__", failing)
    monkeypatch.setattr(rope, "_STRIDED_ONLY", [False])
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 6, 2, 16, generator=g).to(torch.bfloat16)
    cos, sin = _freqs(6, 16, torch.float64)
    with caplog.at_level("WARNING", logger="worldfoundry.core.fusion.rope"):
        out_q, _ = rope.rope_qk(q, q, cos, sin)
    assert torch.equal(out_q, rope.reference_rope(q, cos, sin))
    assert rope._STRIDED_ONLY == [True] and "row-contiguous variant failed" in caplog.text
