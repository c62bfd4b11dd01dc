"""The reproduced CUDA LayerNorm (``core/fusion/layer_norm``) against its step-by-step torch reference (CPU, Triton
interpreter, bitwise), the reference against PyTorch's CPU LayerNorm (close: another algorithm), the exact
fused multiply-add of the reference, the path conditions, and -- on a GPU -- the kernel against PyTorch's own CUDA
LayerNorm, bitwise."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.core.fusion.layer_norm import layer_norm, layer_norm_modulate, rms_norm, torch_path_reason
from worldfoundry.core.fusion.layer_norm_reference import (
    fma32,
    reference_layer_norm,
    reference_layer_norm_modulate,
    reference_rms_norm,
    reference_row_stats,
)
from worldfoundry.core.fusion.triton_support import TRITON_AVAILABLE, interpreter_enabled

needs_interpreter = pytest.mark.skipif(not (TRITON_AVAILABLE and interpreter_enabled()),
                                       reason="needs triton with TRITON_INTERPRET=1")
BF16 = torch.bfloat16


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


@needs_interpreter
@pytest.mark.parametrize("n", [12, 96, 640, 1536])
@pytest.mark.parametrize("affine", ["none", "weight", "bias", "both"])
def test_kernel_matches_the_reference_bitwise(n: int, affine: str) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(11, n, generator=g) * 3 + 0.25  # 11 rows: a partial program of 8 rows
    w = torch.randn(n, generator=g) if affine in ("weight", "both") else None
    b = torch.randn(n, generator=g) if affine in ("bias", "both") else None
    out, stats = layer_norm(x, 1e-6, w, b, stats=True)
    assert _bits_equal(out, reference_layer_norm(x, 1e-6, w, b))
    mean, rstd = reference_row_stats(x, 1e-6)
    assert _bits_equal(stats[:, 0].contiguous(), mean) and _bits_equal(stats[:, 1].contiguous(), rstd)
    cast = layer_norm(x.to(BF16), 1e-5, w, b, out_dtype=BF16)[0]  # bfloat16 read as float32, bfloat16 written
    assert _bits_equal(cast, reference_layer_norm(x.to(BF16), 1e-5, w, b, out_dtype=BF16))


@needs_interpreter
@pytest.mark.parametrize("shape,emb_shape", [((2, 16, 640), (2, 6, 640)), ((2, 12, 640), (2, 6, 640)),
                                             ((1, 20, 96), (1, 20, 6, 96))])
@pytest.mark.parametrize("limit", [2**31 - 1, 100])
def test_layer_norm_modulate_is_wans_eager_expression(shape, emb_shape, limit: int) -> None:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(*shape, generator=g) * 4).to(BF16)
    table = torch.randn(6, shape[-1], generator=g) / shape[-1] ** 0.5
    emb = torch.randn(*emb_shape, generator=g).to(BF16)
    out = layer_norm_modulate(x, 1e-6, table, emb, 3, 4, out_dtype=BF16, index_limit=limit)
    assert _bits_equal(out, reference_layer_norm_modulate(x, 1e-6, table, emb, 3, 4, out_dtype=BF16))


@needs_interpreter
@pytest.mark.parametrize("n", [12, 640, 1536])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_matches_the_reference_bitwise(n: int, dtype: torch.dtype, with_weight: bool) -> None:
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(11, n, generator=g) * 3).to(dtype)
    w = torch.randn(n, generator=g).to(dtype) if with_weight else None
    out, stats = rms_norm(x, 1e-6, w, stats=True)
    assert _bits_equal(out, reference_rms_norm(x, 1e-6, w))
    assert _bits_equal(stats[:, 1].contiguous(), reference_row_stats(x, 1e-6, rms=True)[1])
    assert bool((stats[:, 0] == 0).all())


def test_reference_rms_norm_is_an_rms_norm() -> None:
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 1536, generator=g), torch.randn(1536, generator=g)
    torch.testing.assert_close(reference_rms_norm(x, 1e-6, w), F.rms_norm(x, (1536,), w, 1e-6), rtol=1e-5, atol=1e-5)


def test_reference_is_a_layer_norm() -> None:
    g = torch.Generator().manual_seed(2)
    for n in (4, 12, 100, 1536, 5120):
        x = torch.randn(5, n, generator=g) * 2 + 1
        w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
        torch.testing.assert_close(reference_layer_norm(x, 1e-5, w, b), F.layer_norm(x, (n,), w, b, 1e-5),
                                   rtol=1e-5, atol=1e-5)


def _round_to_float32(value: Fraction) -> np.float32:
    """``value`` rounded once to float32 (nearest, ties to even), from the exact rational."""
    guess = np.float32(float(value))
    candidates = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    best = min(candidates, key=lambda c: (abs(Fraction(float(c)) - value), int(np.float32(c).view(np.int32)) & 1))
    return np.float32(best)


finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-(2.0**50), max_value=2.0**50)


@settings(max_examples=300, deadline=None)
@given(finite32, finite32, finite32)
def test_fma32_rounds_once(a: float, b: float, c: float) -> None:
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    got = fma32(torch.tensor([a]), torch.tensor([b]), torch.tensor([c]))[0].item()
    assert np.float32(got) == _round_to_float32(exact) or (exact == 0 and got == 0)


def test_fma32_where_rounding_twice_differs() -> None:
    # a*b + c lies just above a float32 tie, but the float64 sum rounds onto the tie (then to even: down)
    a, b = 1.0 + 2.0**-23, 1.0 + 2.0**-23  # a*b = 1 + 2^-22 + 2^-46
    c = 2.0**-24                            # a*b + c = 1 + 2^-22 + 2^-24 + 2^-46: just above the midpoint
    got = fma32(torch.tensor([a]), torch.tensor([b]), torch.tensor([c]))[0].item()
    assert np.float32(got) == _round_to_float32(Fraction(a) * Fraction(b) + Fraction(c))


def test_torch_path_reason_names_what_pytorch_would_do_differently() -> None:
    assert torch_path_reason(torch.randn(3, 1536)) is None
    assert torch_path_reason(torch.randn(3, 16).to(BF16), torch.randn(16).to(BF16)) is None
    assert "multiple of 4" in torch_path_reason(torch.randn(3, 1538))
    assert "float64" in torch_path_reason(torch.randn(3, 16, dtype=torch.float64))
    assert "aligned" in torch_path_reason(torch.randn(20)[1:17])  # contiguous, 4 bytes past an aligned start
    assert "weight" in torch_path_reason(torch.randn(3, 16), torch.randn(16).to(BF16))  # another dtype
    assert "bias" in torch_path_reason(torch.randn(3, 16), None, torch.randn(32)[1:17])


@pytest.mark.skipif(not (TRITON_AVAILABLE and torch.cuda.is_available()), reason="needs CUDA")
@pytest.mark.parametrize("rows,n", [(3600, 1536), (512, 5120), (300, 12), (257, 640)])
def test_kernel_is_pytorch_cuda_layer_norm_bitwise(rows: int, n: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, n, device="cuda", generator=g) * 3 + 0.5
    w, b = torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g)
    for weight, bias in ((None, None), (w, None), (w, b)):
        ref, mean, rstd = torch.native_layer_norm(x, [n], weight, bias, 1e-6)
        out, stats = layer_norm(x, 1e-6, weight, bias, stats=True)
        assert _bits_equal(out, ref)
        assert _bits_equal(stats[:, 0].contiguous(), mean.reshape(-1)) and _bits_equal(stats[:, 1].contiguous(),
                                                                                        rstd.reshape(-1))
    xb = x.reshape(1, rows, n).to(BF16)
    table, emb = torch.randn(1, 6, n, device="cuda", generator=g), torch.randn(1, 6, n, device="cuda", generator=g)
    shift, scale = (table + emb.float()).chunk(6, dim=1)[:2]
    eager = (F.layer_norm(xb.float(), (n,), eps=1e-6) * (1 + scale) + shift).type_as(xb)
    assert _bits_equal(layer_norm_modulate(xb, 1e-6, table[0], emb, 0, 1, out_dtype=BF16), eager)


@pytest.mark.skipif(not (TRITON_AVAILABLE and torch.cuda.is_available()), reason="needs CUDA")
@pytest.mark.parametrize("rows,n", [(3600, 1536), (512, 5120), (300, 12)])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_rms_norm_is_pytorchs_cuda_rms_norm_bitwise(rows: int, n: int, dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = (torch.randn(rows, n, device="cuda", generator=g) * 3).to(dtype)
    w = torch.randn(n, device="cuda", generator=g).to(dtype)
    for weight in (None, w):
        assert _bits_equal(rms_norm(x, 1e-6, weight)[0], F.rms_norm(x, (n,), weight, 1e-6))


@needs_interpreter
def test_one_geometry_with_weights_of_two_dtypes_gets_two_plans() -> None:
    from worldfoundry.core.fusion import layer_norm as module

    x = torch.randn(3, 96)
    w, b = torch.randn(96), torch.randn(96)
    module._PLANS.clear()
    first = layer_norm(x, 1e-6, w, b)[0]
    second = layer_norm(x, 1e-6, w.to(BF16), b.to(BF16))[0]
    assert len(module._PLANS) == 2
    assert _bits_equal(first, reference_layer_norm(x, 1e-6, w, b))
    assert _bits_equal(second, reference_layer_norm(x, 1e-6, w.to(BF16), b.to(BF16)))


@pytest.mark.skipif(not (TRITON_AVAILABLE and torch.cuda.is_available()), reason="needs CUDA")
def test_offsets_past_2_31_elements_take_64_bit_indexing_and_stay_bitwise() -> None:
    rows, n = 1_400_000, 1536  # 2.15e9 elements: every offset of the last rows exceeds int32
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("needs about 30 GB of device memory")
    x = torch.randn(rows, n, device="cuda", dtype=BF16)
    out = layer_norm(x, 1e-6, out_dtype=BF16)[0]
    tail = slice(rows - 4096, rows)
    ref = F.layer_norm(x[tail].float(), (n,), eps=1e-6).to(BF16)  # rows are independent: check the far end
    assert _bits_equal(out[tail].contiguous(), ref)
