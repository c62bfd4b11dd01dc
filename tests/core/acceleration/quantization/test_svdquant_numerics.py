"""SVDQuant numerics (torch references): INT4 packing, per-token INT8, smoothing, decomposition, digests.

Stated claims: packing round-trips every code (property test); group quantization error is at most half a
scale step; the decomposition's effective weight is the dense weight up to the INT4 residual error; on
activations with outlier channels and a weight with a dominant low-rank part, SVDQuant's output error is
below plain INT4 RTN's at the same bits; digests are computed once per parameter version.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.core.acceleration.quantization.int4_packing import (
    dequantize_int4_groupwise,
    pack_int4,
    quantize_int4_groupwise,
    unpack_int4,
)
from worldfoundry.core.acceleration.quantization.int8_activation import dequantize_rows_int8, quantize_rows_int8
from worldfoundry.core.acceleration.quantization.parameter_digest import (
    digest_computations,
    parameter_digest,
    tensor_sha256,
)
from worldfoundry.core.acceleration.quantization.svdquant_numerics import (
    decompose,
    smoothing_factors,
    w4a8_linear_reference,
    w4a16_linear_reference,
    weight_rel_error,
)
from worldfoundry.errors import QuantizationInputError


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.sampled_from([64, 128]), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trips_every_code(n, group, groups, seed):
    codes = torch.randint(-8, 8, (n, group * groups), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)
    packed = pack_int4(codes, group)
    assert packed.shape == (n, group * groups // 2) and packed.dtype == torch.int8
    assert torch.equal(unpack_int4(packed, group), codes)


@pytest.mark.parametrize("group", [64, 128])
def test_group_quantization_error_is_at_most_half_a_step(group):
    w = torch.randn(16, 256) * 0.1
    w[3, :group] = 0.0  # an all-zero group keeps scale 1 and codes 0
    packed, scales = quantize_int4_groupwise(w, group)
    err = (dequantize_int4_groupwise(packed, scales, group) - w).abs()
    step = scales.float().t().repeat_interleave(group, dim=1)
    assert bool((err <= step / 2 + 1e-7).all())
    assert float(scales[0, 3]) == 1.0


def test_bad_shapes_and_groups_are_typed_errors():
    with pytest.raises(QuantizationInputError, match="not a multiple of group_size"):
        quantize_int4_groupwise(torch.randn(4, 96), 64)
    with pytest.raises(QuantizationInputError, match="group_size must be 0 \(per output channel\), 64 or 128"):
        quantize_int4_groupwise(torch.randn(4, 64), 32)
    with pytest.raises(QuantizationInputError, match="rank must be an integer"):
        decompose(torch.randn(8, 64), rank=9, group_size=64)


def test_int8_rows_reconstruct_within_half_a_step():
    x = torch.randn(7, 96) * 5
    inv = torch.rand(96) + 0.5
    q, scale = quantize_rows_int8(x, inv)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert bool(((dequantize_rows_int8(q, scale) - x * inv).abs() <= scale / 2 + 1e-6).all())


def test_smoothing_moves_outlier_channels_into_the_weight():
    w = torch.full((4, 8), 0.1)
    a = torch.ones(8)
    a[2] = 100.0
    lam = smoothing_factors(a, w, alpha=0.5)
    assert float(lam[2]) == pytest.approx(10 * float(lam[0]), rel=1e-5)


def _outlier_problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, k, m = 128, 256, 64
    w = (torch.randn(n, 8, generator=g) @ torch.randn(8, k, generator=g)) * 0.05 + torch.randn(n, k, generator=g) * 0.01
    x = torch.randn(m, k, generator=g)
    x[:, torch.randperm(k, generator=g)[:6]] *= 30.0  # outlier channels, as in real activations
    return w, x


def test_svdquant_beats_rtn_at_the_same_bits_on_outlier_activations():
    w, x = _outlier_problem()
    dense = x @ w.t()
    svdq = decompose(w, rank=16, group_size=64, act_absmax=x.abs().amax(0))
    rtn = decompose(w, rank=0, group_size=64)

    def err(y):
        return float((y - dense).norm() / dense.norm())

    e_svdq, e_rtn = err(w4a8_linear_reference(x, svdq)), err(w4a8_linear_reference(x, rtn))
    assert e_svdq < 0.5 * e_rtn, (e_svdq, e_rtn)
    assert err(w4a16_linear_reference(x, svdq)) < 0.05


def test_effective_weight_and_randomized_svd():
    w, x = _outlier_problem(1)
    full = decompose(w, rank=16, group_size=128, act_absmax=x.abs().amax(0))
    rand = decompose(w, rank=16, group_size=128, act_absmax=x.abs().amax(0), svd="randomized", seed=3)
    assert weight_rel_error(w, full) < 0.05 and weight_rel_error(w, rand) < 0.05
    assert full.rank == 16 and full.lora_down.dtype == torch.bfloat16 and full.inv_smooth.dtype == torch.float32
    assert full.nbytes == (128 * 128 + 2 * 128 * 2 + 256 * 4 + 16 * (256 + 128) * 2)


def test_parameter_digest_is_cached_per_version():
    p = torch.nn.Parameter(torch.randn(32, 16))
    first = parameter_digest(p)
    count = digest_computations()
    assert parameter_digest(p) == first and digest_computations() == count
    with torch.no_grad():
        p.mul_(2.0)
    second = parameter_digest(p)
    assert second != first and second == tensor_sha256(p) and digest_computations() == count + 1
    assert tensor_sha256(p.detach().to(torch.bfloat16)) != tensor_sha256(p.detach())  # dtype is part of it


def test_int8_reference_divides_once_like_the_kernel():
    # torch evaluates ``127 / t`` as ``reciprocal(t) * 127`` (and on CUDA ``t / 127`` as ``t * (1 / 127)``);
    # the reference must use single correctly rounded divisions, as ``tl.div_rn`` in the kernel does.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2048, 1024, generator=g) * torch.logspace(-3, 3, 2048).unsqueeze(1)  # old form: a code off
    q, scale = quantize_rows_int8(x)
    amax = x.abs().amax(dim=1, keepdim=True).double()
    assert torch.equal(scale, (amax / 127.0).float())
    rcp = (127.0 / amax).float()
    assert torch.equal(q, torch.round(x * rcp).clamp(-127, 127).to(torch.int8))


def test_w4a8_kernel_unpacking_and_float_identities():
    # The GEMM feeds 16x the codes to the dot: ``b << 4`` (low nibble) and ``b & 0xF0`` (high nibble), on CUDA
    # four bytes per 32-bit ``shl``/``and``; and it converts int32 to float32 by ``bits(1.5 * 2**23) + i``.
    b = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    lo = ((b.to(torch.int16) & 0xF) ^ 8) - 8
    hi = (((b.to(torch.int16) >> 4) & 0xF) ^ 8) - 8
    assert torch.equal((b << 4).to(torch.int16), 16 * lo) and torch.equal((b & -16).to(torch.int16), 16 * hi)
    words = b.view(torch.int32)  # 64 words of four bytes
    mask = torch.tensor(0xF0F0F0F0 - 2**32, dtype=torch.int32)
    assert torch.equal(((words << 4) & mask).view(torch.int8), b << 4)
    assert torch.equal((words & mask).view(torch.int8), b & -16)
    i = torch.cat([torch.arange(-2**22, -2**22 + 1000), torch.randint(-2**22, 2**22, (100000,)),
                   torch.arange(2**22 - 1000, 2**22)]).to(torch.int32)
    exact = (i + 0x4B400000).view(torch.float32) - 12582912.0
    assert torch.equal(exact, i.float())
    assert 16 * 128 * 127 * 8 < 2**22  # |16 * partial sum| of one group of 128 stays in range
