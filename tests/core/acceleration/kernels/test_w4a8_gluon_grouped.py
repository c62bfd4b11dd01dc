"""The Gluon W4A8 GEMM with activation scales per token and K group: host-side checks on CPU, numerics on a
Hopper GPU.

Gluon kernels do not run under the Triton interpreter, so on CPU only the tile arithmetic, the scale layout and the
argument checks are tested; on CUDA sm_90 (skipped elsewhere) the kernel is bitwise ``bf16`` of
``int4_gemm_reference_grouped`` without the low-rank term and bias (``exact`` tiles), within ``2**-7 * max|ref|``
with them or with the FMA promotion, the same on every run, for group counts that take every path of the main loop
(one group; odd and even counts).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.core.acceleration.kernels.w4a8_gluon_gemm import HOPPER_SMEM_BYTES
from worldfoundry.core.acceleration.kernels.w4a8_gluon_grouped import (
    DEFAULT_GROUPED_TILE,
    GroupedTile,
    check_grouped_operands,
    gluon_w4a8_grouped_gemm,
    transposed_scales,
)
from worldfoundry.core.acceleration.kernels.w4a8_gluon_kernels import GLUON_AVAILABLE
from worldfoundry.core.acceleration.quantization.int4_packing import pack_int4, quantize_int4_groupwise
from worldfoundry.core.acceleration.quantization.svdquant_numerics import (
    SVDQuantWeight,
    int4_gemm_reference_grouped,
)
from worldfoundry.errors import QuantizationInputError

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
hopper_only = pytest.mark.skipif(not (HOPPER and GLUON_AVAILABLE), reason="needs a Hopper GPU and triton's Gluon")


def _operands(m: int, k: int, n: int, group: int, rank: int = 32, device: str = "cpu", seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    codes = torch.randint(-8, 8, (n, k), dtype=torch.int8, device=device, generator=g)
    scales = (torch.rand(1, n, device=device, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    up = torch.randn(n, rank, device=device, generator=g).to(torch.bfloat16) if rank else None
    # scales spanning three decades per token and group, as outlier channels give them
    s = torch.rand(m, k // group, device=device, generator=g) * 0.01 * 10 ** torch.randint(
        -1, 2, (m, k // group), device=device, generator=g).float() + 1e-4
    return {
        "q": torch.randint(-127, 128, (m, k), dtype=torch.int8, device=device, generator=g), "s": s,
        "w": SVDQuantWeight(pack_int4(codes, 0), scales, 0, lora_up=up),
        "bare": SVDQuantWeight(pack_int4(codes, 0), scales, 0),
        "t": torch.randn(m, rank, device=device, generator=g).to(torch.bfloat16) if rank else None,
        "bias": torch.randn(n, device=device, generator=g).to(torch.bfloat16),
    }


# --- CPU: tiles, scale layout, argument checks ----------------------------------------------------------------


def test_tile_arithmetic() -> None:
    tile = DEFAULT_GROUPED_TILE
    assert tile.instr_n() == 128 and tile.smem_bytes() <= HOPPER_SMEM_BYTES
    assert tile.smem_bytes() == 6 * (128 * 64 + 128 * 32 + 4 * 128) + 2 * 128 * 128 + 96
    assert GroupedTile(64, 128, 64, 6, 4).smem_bytes() < tile.smem_bytes()


@pytest.mark.parametrize("kwargs", [dict(block_w=32), dict(block_k=96), dict(block_t=250), dict(warps=2),
                                    dict(stages=1), dict(unpack=2), dict(exact=1), dict(block_w=64, warps=8),
                                    dict(block_t=256)])
def test_bad_tile_raises(kwargs) -> None:
    with pytest.raises(QuantizationInputError, match="GroupedTile"):
        GroupedTile(**kwargs)


def test_transposed_scales_in_place_or_copied() -> None:
    buf = torch.arange(12.0).reshape(3, 4)  # [G, P]: a group-major buffer with a 4-token pitch
    view = buf[:, :3].t()
    assert transposed_scales(view).data_ptr() == buf.data_ptr()
    plain = torch.rand(5, 3)  # [M, G] token-major: copied into a padded group-major buffer
    rows = transposed_scales(plain)
    assert torch.equal(rows, plain.t()) and rows.stride() == (8, 1)
    odd = torch.rand(6, 3)[:, :2]  # neither layout
    assert torch.equal(transposed_scales(odd), odd.t()) and transposed_scales(odd).stride(0) % 4 == 0


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 40), groups=st.integers(1, 6),
       layout=st.sampled_from(["rows", "columns", "sliced", "offset"]))
def test_transposed_scales_are_the_values_at_an_aligned_pitch(m, groups, layout) -> None:
    """Whatever the layout of ``scale [M, G]``, the kernel's view is ``scale.t()`` value for value, unit stride
    along the tokens and a row pitch of a multiple of 4 tokens (a 16-byte TMA pitch)."""
    values = torch.arange(m * groups, dtype=torch.float32).reshape(m, groups)
    if layout == "columns":  # group-major storage with a pitch of M (aligned or not)
        values = values.t().contiguous().t()
    elif layout == "sliced":
        values = torch.cat([values, values], 1)[:, :groups]
    elif layout == "offset":  # group-major with an aligned pitch, but starting one token in (4 bytes off)
        pad = torch.zeros(groups, (4 - (m + 1) % 4) % 4)  # the pitch, 1 + m + pad, a multiple of 4
        values = torch.cat([torch.zeros(groups, 1), values.t(), pad], 1)[:, 1:m + 1].t()
    rows = transposed_scales(values)
    assert torch.equal(rows, values.t()) and rows.stride(1) == 1 and rows.stride(0) % 4 == 0
    assert rows.data_ptr() % 16 == 0


def test_checks_accept_valid_operands() -> None:
    ops = _operands(70, 512, 96, 128)
    assert check_grouped_operands(ops["q"], ops["s"], ops["w"], ops["t"], ops["bias"],
                                  DEFAULT_GROUPED_TILE) == (70, 96, 512, 32, 128)
    ops = _operands(9, 512, 96, 256, rank=0)
    assert check_grouped_operands(ops["q"], ops["s"], ops["bare"], None, None, DEFAULT_GROUPED_TILE)[4] == 256


def test_checks_raise_typed_errors() -> None:
    ops = _operands(70, 512, 96, 128)
    q, s, w = ops["q"], ops["s"], ops["w"]
    with pytest.raises(QuantizationInputError, match="activation groups of 32 input features"):
        check_grouped_operands(q, torch.rand(70, 16), w, None, None, DEFAULT_GROUPED_TILE)
    with pytest.raises(QuantizationInputError, match="multiples of block_k 128"):
        check_grouped_operands(q, torch.rand(70, 8), w, None, None, GroupedTile(block_k=128, stages=4))
    with pytest.raises(QuantizationInputError, match="scale must be float32"):
        check_grouped_operands(q, s.double(), w, None, None, DEFAULT_GROUPED_TILE)
    with pytest.raises(QuantizationInputError, match=r"scale must have shape \[70\]"):
        check_grouped_operands(q, s[:9], w, None, None, DEFAULT_GROUPED_TILE)
    with pytest.raises(QuantizationInputError, match="tile must be a GroupedTile"):
        check_grouped_operands(q, s, w, None, None, object())
    odd = _operands(9, 256, 100, 128, rank=0)
    with pytest.raises(QuantizationInputError, match="multiple of 8"):
        check_grouped_operands(odd["q"], odd["s"], odd["w"], None, None, DEFAULT_GROUPED_TILE)
    packed, scales = quantize_int4_groupwise(torch.randn(96, 512), 64)
    with pytest.raises(QuantizationInputError, match="group_size 64 is not 0"):
        check_grouped_operands(q, s, SVDQuantWeight(packed, scales, 64), None, None, DEFAULT_GROUPED_TILE)


def test_refuses_cpu_and_the_interpreter(monkeypatch) -> None:
    ops = _operands(8, 256, 64, 128, rank=0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(QuantizationInputError, match="Gluon GEMM"):
        gluon_w4a8_grouped_gemm(ops["q"], ops["s"], ops["w"])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if GLUON_AVAILABLE:
        with pytest.raises(QuantizationInputError, match="TRITON_INTERPRET"):
            gluon_w4a8_grouped_gemm(ops["q"], ops["s"], ops["w"])


# --- CUDA sm_90: the kernel -------------------------------------------------------------------------------


def _matches(m: int, k: int, n: int, group: int, tile: GroupedTile, transposed: bool = False) -> None:
    ops = _operands(m, k, n, group, device="cuda", seed=m + k)
    q, s = ops["q"], ops["s"]
    if transposed:  # the quantizer's layout: read in place
        s = transposed_scales(s).t()
    ref = int4_gemm_reference_grouped(q, ops["s"], ops["bare"])
    out = gluon_w4a8_grouped_gemm(q, s, ops["bare"], tile=tile)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    if tile.exact:
        assert torch.equal(out, ref.to(torch.bfloat16)), int((out != ref.to(torch.bfloat16)).sum())
    else:
        assert float((out.float() - ref).abs().max()) <= 2.0**-7 * float(ref.abs().max())
    assert torch.equal(gluon_w4a8_grouped_gemm(q, s, ops["bare"], tile=tile), out)  # the same on every run
    full = gluon_w4a8_grouped_gemm(q, s, ops["w"], ops["t"], ops["bias"], tile=tile)
    full_ref = ref + ops["t"].float() @ ops["w"].lora_up.float().t() + ops["bias"].float()
    assert float((full.float() - full_ref).abs().max()) <= 2.0**-7 * float(full_ref.abs().max())


TILES = [DEFAULT_GROUPED_TILE, GroupedTile(exact=False), GroupedTile(64, 128, 64, 6, 4),
         GroupedTile(128, 64, 64, 8, 8, unpack=0)]


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("tile", TILES, ids=lambda t: "x".join(map(str, t.to_json().values())))
@pytest.mark.parametrize("mkng", [(1, 128, 64, 128), (77, 256, 136, 128), (300, 384, 384, 128), (129, 640, 256, 64),
                                  (1000, 1024, 512, 256), (70, 1536, 1024, 128)])
def test_kernel_small(mkng, tile) -> None:
    """One group (K 128), two (256), three (384), ten of 64 (640), four of 256, twelve (K 1536)."""
    _matches(*mkng, tile)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("kn", [(1536, 8960), (8960, 1536)])
def test_kernel_w81_shapes(kn) -> None:
    """The Wan 1.3B FFN shapes with a ragged token count, scales as the quantizer writes them."""
    _matches(4100, *kn, 128, DEFAULT_GROUPED_TILE, transposed=True)
