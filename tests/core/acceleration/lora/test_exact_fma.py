"""``fma_fp32``: one rounding of ``a·b + c``, checked against exact rational arithmetic and Triton's FMA."""

from __future__ import annotations

import os
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.core.acceleration.lora.exact_fma import fma_fp32

FINITE_F32 = st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-(2.0**60), max_value=2.0**60)


def _round_fp32(value: Fraction) -> float:
    """Round an exact rational to the nearest FP32, ties to even (value within the finite FP32 range)."""
    guess = np.float32(float(value))
    candidates = {guess, np.nextafter(guess, np.float32(np.inf)), np.nextafter(guess, np.float32(-np.inf))}

    def key(y: np.float32) -> tuple[Fraction, int]:
        return abs(Fraction(float(y)) - value), int(np.array(y, dtype=np.float32).view(np.uint32)) & 1

    return float(min(candidates, key=key))


def _check(a: float, b: float, c: float) -> None:
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    got = fma_fp32(*(torch.tensor([v], dtype=torch.float32) for v in (a, b, c)))
    assert got.item() == _round_fp32(exact), (a, b, c)


@settings(max_examples=300, deadline=None)
@given(FINITE_F32, FINITE_F32, FINITE_F32)
def test_random_operands_round_once(a: float, b: float, c: float) -> None:
    _check(a, b, c)


@pytest.mark.parametrize(("a", "b", "c"), [
    (1 + 2**-12, 1 + 2**-12, -(2**-11)),                  # exact FP32 midpoint: ties to even
    (1 + 2**-12, 1 + 2**-12 + 2**-23, -(2**-11) - 2**-23),  # just above a midpoint that FP64 rounds onto
    (1 + 2**-12, 1 - 2**-24, -(2**-12)),                  # just below a midpoint
    # a·b + c is 2**-60 off an FP32 midpoint, so FP64 rounds onto the midpoint: the error term decides
    (-(2**-24) * (1 + 2**-18), 1 - 2**-18, 1 + 2**-23),   # just above the midpoint 1 + 2**-24 → 1 + 2**-23
    (2**-24 * (1 + 2**-18), 1 - 2**-18, 1 + 2**-23),      # just below the midpoint 1 + 3·2**-24 → 1 + 2**-23
    (3.0, 2**-140, -(2**-139)),                           # FP32 subnormal result
    (2**100, 2**27, 0.0),                                  # beyond FP32: overflows to inf like the hardware
    (1 + 2**-23, 1 + 2**-23, -(1 + 2**-22)),              # the product's lowest bits survive the cancellation
])
def test_hard_cases(a: float, b: float, c: float) -> None:
    if abs(a * b + c) > float(np.finfo(np.float32).max):
        got = fma_fp32(*(torch.tensor([v], dtype=torch.float32) for v in (a, b, c)))
        assert got.item() == float("inf")
        return
    _check(float(np.float32(a)), float(np.float32(b)), float(np.float32(c)))


def test_midpoint_cases_need_the_correction() -> None:
    """The two cases above fail a plain FP64 evaluation: the correction is exercised."""
    for a, b, c in ((-(2**-24) * (1 + 2**-18), 1 - 2**-18, 1 + 2**-23), (2**-24 * (1 + 2**-18), 1 - 2**-18, 1 + 2**-23)):
        ta, tb, tc = (torch.tensor([v], dtype=torch.float32) for v in (a, b, c))
        plain = (ta.double() * tb.double() + tc.double()).float()
        assert fma_fp32(ta, tb, tc).item() == 1 + 2**-23 != plain.item()


def test_broadcasting_dtype_and_errors() -> None:
    a = torch.randn(3, 1)
    b = torch.randn(4)
    c = torch.randn(3, 4)
    out = fma_fp32(a, b, c)
    assert out.shape == (3, 4) and out.dtype == torch.float32
    assert torch.isnan(fma_fp32(torch.tensor([float("inf")]), torch.tensor([0.0]), torch.tensor([1.0]))).all()
    with pytest.raises(ValueError, match="float32"):
        fma_fp32(a.double(), b, c)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="needs triton with CUDA, or TRITON_INTERPRET=1")
def test_equals_triton_fma() -> None:
    """The kernel side: ``tl.fma`` (``fma.rn.f32`` on the GPU) on operands built to hit rounding boundaries."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def fma_kernel(a_ptr, b_ptr, c_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tl.store(out_ptr + i, tl.fma(tl.load(a_ptr + i, mask=m), tl.load(b_ptr + i, mask=m),
                                     tl.load(c_ptr + i, mask=m)), mask=m)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    n = 1 << 15
    a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    c = -(a * b) * (1 + torch.randn(n, generator=g) * 1e-6)  # heavy cancellation
    scales = torch.exp2(torch.randint(-30, 30, (n // 2,), generator=g).float())
    c[::2] = torch.randn(n // 2, generator=g) * scales
    a, b, c = a.to(device), b.to(device), c.to(device)
    out = torch.empty_like(a)
    fma_kernel[(triton.cdiv(n, 1024),)](a, b, c, out, n, BLOCK=1024)
    assert torch.equal(out, fma_fp32(a, b, c))
    assert not torch.equal(out, a * b + c), "the operands must exercise the single rounding"
