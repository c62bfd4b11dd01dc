"""The fused Triton rowwise FP8 kernel against its torch reference, run by the Triton interpreter on the CPU.

Claim checked: FP8 bytes and scales are bitwise equal for every finite input (small shapes here; the GPU file
repeats this on CUDA with large and odd shapes). Run with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.core.acceleration.kernels.dispatch import (
    REASON_TRITON_MISSING,
    quantize_activations_rowwise_fp8,
    triton_unavailable_reason,
)
from worldfoundry.core.acceleration.kernels.fp8_rowwise_quant import (
    SINGLE_PASS_MAX_K,
    TRITON_AVAILABLE,
    interpreter_enabled,
    launch_config,
    reference_quantize_rowwise_fp8,
    triton_quantize_rowwise_fp8,
)
from worldfoundry.core.acceleration.quantization.fp8 import quantize_rowwise_fp8
from worldfoundry.errors import QuantizationInputError

pytestmark = pytest.mark.skipif(
    not (TRITON_AVAILABLE and interpreter_enabled()), reason="needs triton with TRITON_INTERPRET=1"
)


def assert_bitwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = triton_quantize_rowwise_fp8(x)
    q_ref, scale_ref = reference_quantize_rowwise_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (*x.shape[:-1], 1)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), "FP8 bytes differ from the reference"
    assert torch.equal(scale, scale_ref), "scales differ from the reference"
    return q, scale


def test_reference_is_the_quantization_module_function():
    assert reference_quantize_rowwise_fp8 is quantize_rowwise_fp8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 16), (7, 40), (3, 2, 33), (65, 24), (5, 1)])
def test_bitwise_equal_small_shapes(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    assert_bitwise((torch.randn(*shape, generator=g) * 3).to(dtype))


def test_ties_subnormals_and_signed_zero():
    # amax 448 -> scale exactly 1, so these values reach the rounding step unchanged
    row = torch.tensor([448.0, 1.3125, 42.0, 126.0, -126.0, 3 * 2.0**-10, 2.0**-10, 5 * 2.0**-11,
                        2.0**-6 - 2.0**-11, 0.0, -0.0, -2.0**-12, 447.9, 300.0, 2.0**-9, 1.0])
    q, _ = assert_bitwise(row[None, :])
    assert q.view(torch.uint8)[0, 10].item() == 0x80  # -0.0 keeps its sign, as in torch's cast
    assert q.view(torch.uint8)[0, 11].item() == 0x80  # a small negative rounds to -0.0


def test_every_bfloat16_value_in_range():
    # all bfloat16 bit patterns with |x| <= 448 (finite), in rows whose amax is exactly 448
    bits = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = bits[bits.float().abs() <= 448.0]
    values = torch.cat([values, -values])
    pad = (-values.numel()) % 1023
    values = torch.cat([values, torch.zeros(pad, dtype=torch.bfloat16)]).reshape(-1, 1023)
    rows = torch.cat([values, torch.full((values.shape[0], 1), 448.0, dtype=torch.bfloat16)], dim=1)
    assert_bitwise(rows)


def test_zero_rows_and_wide_dynamic_range():
    x = torch.randn(6, 48)
    x[0] = 0
    x[1] *= 1e-30
    x[2] *= 1e30
    x[3, ::2] *= 1e-6
    assert_bitwise(x)


def test_strided_rows_and_non_contiguous_inner_dimension():
    wide = torch.randn(9, 100)
    assert_bitwise(wide[:, 10:74])  # evenly spaced rows, row stride 100
    assert_bitwise(wide[::2, 3:51])  # every other row
    assert_bitwise(torch.randn(48, 5).t())  # inner stride != 1: one copy, same result
    assert_bitwise(torch.randn(2, 6, 40)[:, 1:5, :32])  # 3-D slice


def test_long_rows_use_two_passes_and_stay_bitwise():
    k = SINGLE_PASS_MAX_K + 40
    cfg = launch_config(k)
    assert cfg["SINGLE_PASS"] is False and cfg["BLOCK_K"] < k
    assert launch_config(1536)["SINGLE_PASS"] is True
    x = torch.randn(2, k)
    x[1, -1] = 1000.0  # the row maximum sits in the last chunk
    assert_bitwise(x)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), m=st.integers(1, 40), k=st.integers(1, 300),
       log_scale=st.floats(-20, 20), dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_bitwise_equal_random(seed, m, k, log_scale, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None] * 2.0**log_scale
    assert_bitwise(x.to(dtype))


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_clip_counter_counts_non_finite_only():
    counter = torch.zeros(1, dtype=torch.int32)
    x = torch.randn(5, 64) * 1e4
    triton_quantize_rowwise_fp8(x, clip_counter=counter)
    assert counter.item() == 0
    x[3, 7] = float("inf")
    triton_quantize_rowwise_fp8(x, clip_counter=counter)
    assert counter.item() == 1  # inf / inf is nan: one element of row 3 clips
    with pytest.raises(QuantizationInputError, match="int32"):
        triton_quantize_rowwise_fp8(x, clip_counter=torch.zeros(1, dtype=torch.int64))


def test_empty_batch():
    q, scale = triton_quantize_rowwise_fp8(torch.randn(0, 32))
    assert q.shape == (0, 32) and scale.shape == (0, 1)


def test_dispatcher_uses_the_reference_on_cpu_and_says_why():
    x = torch.randn(4, 32)
    rows = quantize_activations_rowwise_fp8(x)
    assert rows.backend == "torch" and rows.fallback_reason == "cpu tensor"
    forced = quantize_activations_rowwise_fp8(x, backend="triton")
    assert forced.backend == "triton" and forced.fallback_reason is None
    assert torch.equal(rows.q.view(torch.uint8), forced.q.view(torch.uint8))
    explicit = quantize_activations_rowwise_fp8(x, backend="torch")
    assert explicit.backend == "torch" and explicit.fallback_reason is None
    counter = torch.zeros(1, dtype=torch.int32)
    x[0, 0] = float("nan")
    quantize_activations_rowwise_fp8(x, clip_counter=counter)
    assert counter.item() == 32  # the nan row's scale is nan: every element of that row clips
    with pytest.raises(QuantizationInputError, match="unknown backend"):
        quantize_activations_rowwise_fp8(x, backend="cuda")  # type: ignore[arg-type]


def test_triton_refuses_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(2, 16)
    assert triton_unavailable_reason(x) == "cpu tensor"
    with pytest.raises(QuantizationInputError, match="CUDA device"):
        triton_quantize_rowwise_fp8(x)
    with pytest.raises(QuantizationInputError, match="cannot run here: cpu tensor"):
        quantize_activations_rowwise_fp8(x, backend="triton")
    assert REASON_TRITON_MISSING == "triton not importable"


def test_input_validation():
    with pytest.raises(QuantizationInputError, match="float32/float16/bfloat16"):
        triton_quantize_rowwise_fp8(torch.ones(2, 16, dtype=torch.float64))
    with pytest.raises(QuantizationInputError, match="empty last dimension"):
        triton_quantize_rowwise_fp8(torch.ones(2, 0))
