"""Index width from shapes and strides, and the 64-bit path on a >2**31-element reachable range (GPU)."""

from __future__ import annotations

import pytest
import torch

from worldfoundry.core.fusion.indexing import INT32_MAX, needs_int64, reachable_span


def test_reachable_span_counts_strides_not_elements() -> None:
    base = torch.empty(10, 12)
    assert reachable_span(base) == 120
    assert reachable_span(base[:, ::3]) == 9 * 12 + 9 + 1
    assert reachable_span(base.t()) == 120
    assert reachable_span(torch.empty(4, 1).expand(4, 1000)) == 4  # broadcast dims reach nothing
    assert reachable_span(torch.empty(0, 5)) == 0
    packed = torch.empty(2, 3, 3 * 8)
    q = packed.chunk(3, dim=-1)[0]
    assert q.numel() == 48 and reachable_span(q) == 2 * 3 * 24 - 16


def test_needs_int64_looks_at_every_operand_and_the_extra_count() -> None:
    small = torch.empty(4, 4)
    assert not needs_int64(small, None)
    assert needs_int64(small, small[:, ::2], limit=10)
    assert needs_int64(small, extra=INT32_MAX + 1)
    view = torch.empty(1, device="meta").as_strided((2, 2), (2**31, 1))  # reaches past int32 with 4 elements
    assert view.numel() == 4 and needs_int64(view)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
def test_gpu_strided_operands_reaching_past_int32() -> None:
    """A [1, 64, 1536] view whose rows are spread over a 2.2e9-element buffer: offsets need 64 bits."""
    from worldfoundry.core.fusion import adaln, rope

    c, rows = 1536, 1_450_000  # 63 * (rows // 64) * c + c = 2,192,377,344 reachable elements > 2**31 - 1
    big = torch.randn(rows, c, device="cuda", dtype=torch.bfloat16)
    step = rows // 64
    y = big[::step][:64].unsqueeze(0)
    assert reachable_span(y) > INT32_MAX and needs_int64(y)
    x = torch.randn(1, 64, c, device="cuda", dtype=torch.bfloat16)
    table = torch.randn(6, c, device="cuda")
    temb = torch.randn(1, 6, c, device="cuda", dtype=torch.bfloat16)
    gate = table[2] + temb[:, 2:3].float()
    assert torch.equal(adaln.gated_residual(x, y, table, temb, 2)[0], (x.float() + y * gate).type_as(x))
    q = y.unflatten(2, (12, 128))
    cos = torch.randn(1, 64, 1, 128, device="cuda", dtype=torch.float64)
    sin = torch.randn(1, 64, 1, 128, device="cuda", dtype=torch.float64)
    out_q, _ = rope.rope_qk(q, q, cos, sin)
    assert torch.equal(out_q, rope.reference_rope(q, cos, sin))


@pytest.mark.gpu
@gpu
def test_gpu_output_past_int32() -> None:
    """A residual add whose logical output has 2.15e9 elements (offsets of the output itself need 64 bits)."""
    from worldfoundry.core.fusion import adaln

    x = torch.randn(1, 1_400_000, 1536, device="cuda", dtype=torch.bfloat16)
    y = torch.randn_like(x)
    out, _ = adaln.residual_add(x, y)
    assert x.numel() > INT32_MAX
    assert torch.equal(out, x + y)
