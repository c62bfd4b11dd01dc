"""The persistent, warp-specialised Gluon W4A8 GEMM: host-side checks on CPU, numerics on a Hopper GPU.

Gluon kernels do not run under the Triton interpreter, so on CPU only the tile arithmetic and the argument checks are
tested; on CUDA sm_90 (skipped elsewhere) the kernel is bitwise equal to ``bf16`` of the reference without the
low-rank term and bias, and within ``2**-7 * max|ref|`` with them (bfloat16 ``wgmma`` accumulated in float32).
"""

from __future__ import annotations

import pytest
import torch

from worldfoundry.core.acceleration.kernels.w4a8_gluon_gemm import HOPPER_SMEM_BYTES, w4a8_reference
from worldfoundry.core.acceleration.kernels.w4a8_gluon_kernels import GLUON_AVAILABLE
from worldfoundry.core.acceleration.kernels.w4a8_gluon_persistent import (
    DEFAULT_PERSISTENT_TILE,
    PersistentTile,
    check_persistent_operands,
    gluon_w4a8_persistent_gemm,
    row_max_smem_bytes,
)
from worldfoundry.core.acceleration.quantization.int4_packing import pack_int4, quantize_int4_groupwise
from worldfoundry.core.acceleration.quantization.svdquant_numerics import SVDQuantWeight, int4_gemm_reference
from worldfoundry.errors import QuantizationInputError

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
hopper_only = pytest.mark.skipif(not (HOPPER and GLUON_AVAILABLE), reason="needs a Hopper GPU and triton's Gluon")


def _operands(m: int, k: int, n: int, rank: int = 32, device: str = "cpu", seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    codes = torch.randint(-8, 8, (n, k), dtype=torch.int8, device=device, generator=g)
    scales = (torch.rand(1, n, device=device, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    up = torch.randn(n, rank, device=device, generator=g).to(torch.bfloat16) if rank else None
    return {
        "q": torch.randint(-127, 128, (m, k), dtype=torch.int8, device=device, generator=g),
        "s": torch.rand(m, 1, device=device, generator=g) * 0.01 + 1e-3,
        "w": SVDQuantWeight(pack_int4(codes, 0), scales, 0, lora_up=up),
        "bare": SVDQuantWeight(pack_int4(codes, 0), scales, 0),
        "t": torch.randn(m, rank, device=device, generator=g).to(torch.bfloat16) if rank else None,
        "bias": torch.randn(n, device=device, generator=g).to(torch.bfloat16),
    }


# --- CPU: tiles and argument checks ----------------------------------------------------------------------


def test_tile_arithmetic() -> None:
    tile = PersistentTile()
    assert tile.instr_n() == 128 and tile.lowrank_chunk(32) == 32 and tile.lowrank_chunk(48) == 16
    assert tile.smem_bytes() <= HOPPER_SMEM_BYTES and DEFAULT_PERSISTENT_TILE.smem_bytes() <= HOPPER_SMEM_BYTES
    assert tile.smem_bytes() == 4 * (256 * 128 + 128 * 64) + 2 * 256 * 128 + 64
    assert PersistentTile(64, 256, 128, 4, 4).instr_n() == 128
    assert PersistentTile(128, 96, 128).instr_n() == 96
    assert PersistentTile(block_k=256).lowrank_chunk(64) == 64 and PersistentTile(block_k=64).lowrank_chunk(32) == 16
    assert tile.to_json()["block_t"] == 256


@pytest.mark.parametrize("kwargs", [dict(block_w=32), dict(block_k=96), dict(block_t=250), dict(block_t=512),
                                    dict(warps=2), dict(stages=1), dict(group_t=0), dict(unpack=2),
                                    dict(block_w=64, warps=8), dict(block_w=256, block_t=256)])
def test_bad_tile_raises(kwargs) -> None:
    with pytest.raises(QuantizationInputError, match="PersistentTile"):
        PersistentTile(**kwargs)


def test_checks_accept_valid_operands() -> None:
    ops = _operands(70, 256, 96)
    assert check_persistent_operands(ops["q"], ops["s"], ops["w"], ops["t"], ops["bias"],
                                     DEFAULT_PERSISTENT_TILE) == (70, 96, 256, 32)
    assert check_persistent_operands(ops["q"], ops["s"], ops["bare"], None, None,
                                     DEFAULT_PERSISTENT_TILE) == (70, 96, 256, 0)


def test_checks_raise_typed_errors() -> None:
    ops = _operands(70, 256, 96)
    assert check_persistent_operands(ops["q"], ops["s"], ops["w"], ops["t"], None, PersistentTile(block_k=64))[3] == 32
    odd = _operands(9, 128, 100, rank=0)
    with pytest.raises(QuantizationInputError, match="multiple of 8"):
        check_persistent_operands(odd["q"], odd["s"], odd["w"], None, None, DEFAULT_PERSISTENT_TILE)
    k384 = _operands(9, 384, 64)
    with pytest.raises(QuantizationInputError, match="multiple of block_k"):
        check_persistent_operands(k384["q"], k384["s"], k384["w"], k384["t"], None, PersistentTile(block_k=256,
                                                                                                    stages=2))
    with pytest.raises(QuantizationInputError, match="both t"):
        check_persistent_operands(ops["q"], ops["s"], ops["bare"], ops["t"], None, DEFAULT_PERSISTENT_TILE)
    with pytest.raises(QuantizationInputError, match="shared memory"):
        check_persistent_operands(ops["q"], ops["s"], ops["w"], ops["t"], None, PersistentTile(stages=8))
    packed, scales = quantize_int4_groupwise(torch.randn(96, 256), 64)
    with pytest.raises(QuantizationInputError, match="group_size 64"):
        check_persistent_operands(ops["q"], ops["s"], SVDQuantWeight(packed, scales, 64), None, None,
                                  DEFAULT_PERSISTENT_TILE)


def test_refuses_cpu_and_the_interpreter(monkeypatch) -> None:
    ops = _operands(8, 128, 64, rank=0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(QuantizationInputError, match="Gluon GEMM"):
        gluon_w4a8_persistent_gemm(ops["q"], ops["s"], ops["w"])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if GLUON_AVAILABLE:
        with pytest.raises(QuantizationInputError, match="TRITON_INTERPRET"):
            gluon_w4a8_persistent_gemm(ops["q"], ops["s"], ops["w"])


# --- CUDA sm_90: the kernel -------------------------------------------------------------------------------


def _assert_close_to(out: torch.Tensor, ref: torch.Tensor, bitwise: bool) -> None:
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    if bitwise:
        assert torch.equal(out, ref.to(torch.bfloat16)), int((out != ref.to(torch.bfloat16)).sum())
    else:
        assert float((out.float() - ref).abs().max()) <= 2.0**-7 * float(ref.abs().max())


def _kernel_matches(m: int, k: int, n: int, tile: PersistentTile) -> None:
    if k % tile.block_k:
        pytest.skip("K is not a multiple of the tile's block_k")
    ops = _operands(m, k, n, device="cuda")
    q, s = ops["q"], ops["s"]
    _assert_close_to(gluon_w4a8_persistent_gemm(q, s, ops["bare"], tile=tile), int4_gemm_reference(q, s, ops["bare"]),
                     True)
    _assert_close_to(gluon_w4a8_persistent_gemm(q, s, ops["w"], ops["t"], ops["bias"], tile=tile),
                     w4a8_reference(q, s, ops["w"], ops["t"], ops["bias"]), False)


TILES = [DEFAULT_PERSISTENT_TILE, PersistentTile(), PersistentTile(256, 128, 128, 4, 8),
         PersistentTile(64, 256, 128, 4, 4, unpack=0)]
SMALL = [(1, 128, 64), (77, 384, 136), (1000, 512, 384), (300, 1536, 8960)]


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("tile", TILES, ids=lambda t: "x".join(map(str, t.to_json().values())))
@pytest.mark.parametrize("mkn", SMALL)
def test_kernel_small(mkn, tile) -> None:
    _kernel_matches(*mkn, tile)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("kn", [(1536, 8960), (8960, 1536)])
def test_kernel_w81_shapes(kn) -> None:
    """The Wan 1.3B FFN shapes with a ragged token count (4,100 = 16 * 256 + 4)."""
    _kernel_matches(4100, *kn, DEFAULT_PERSISTENT_TILE)


def test_row_max_output_is_checked_before_any_launch() -> None:
    ops = _operands(8, 128, 64, rank=0)
    for bad in (torch.zeros(7), torch.zeros(8, dtype=torch.float64), torch.zeros(16)[::2]):
        with pytest.raises(QuantizationInputError, match=r"row_max must be a contiguous float32 \[8\]"):
            gluon_w4a8_persistent_gemm(ops["q"], ops["s"], ops["w"], row_max=bad)
    full = PersistentTile(128, 256, 128, 4, 8)  # 229,440 bytes: no room for the reduction's 8,192 (+ slack)
    assert full.smem_bytes() + row_max_smem_bytes(full) > HOPPER_SMEM_BYTES
    with pytest.raises(QuantizationInputError, match="row_max needs 10240 more bytes of shared memory"):
        gluon_w4a8_persistent_gemm(ops["q"], ops["s"], ops["w"], tile=full, row_max=torch.zeros(8),
                                   row_max_staged=False)
    # the default reads the maxima from the tile staged for the store: no scratch, so no such limit
    if not torch.cuda.is_available():
        with pytest.raises(QuantizationInputError) as err:
            gluon_w4a8_persistent_gemm(ops["q"], ops["s"], ops["w"], tile=full, row_max=torch.zeros(8))
        assert "shared memory" not in str(err.value)
    assert DEFAULT_PERSISTENT_TILE.smem_bytes() + row_max_smem_bytes(DEFAULT_PERSISTENT_TILE) <= HOPPER_SMEM_BYTES


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("tile", [t for t in TILES if t.smem_bytes() + row_max_smem_bytes(t) <= HOPPER_SMEM_BYTES],
                         ids=lambda t: "x".join(map(str, t.to_json().values())))
@pytest.mark.parametrize("mkn", [(77, 384, 136), (4100, 1536, 8960)])
@pytest.mark.parametrize("staged", [False, True])
def test_row_max_epilogue(mkn, tile, staged) -> None:
    """The epilogue merges each row's largest bfloat16 output (floored at 0) into ``row_max``: equal to a reduction
    of the output, the same on every run, larger values already there kept; the output is unchanged by it (from
    the accumulator or, ``staged``, from the tile staged for the store)."""
    m, k, n = mkn
    if k % tile.block_k:
        pytest.skip("K is not a multiple of the tile's block_k")
    ops = _operands(m, k, n, device="cuda", seed=4)
    plain = gluon_w4a8_persistent_gemm(ops["q"], ops["s"], ops["w"], ops["t"], ops["bias"], tile=tile)
    expected = plain.amax(dim=1).float().clamp_min(0.0)
    for _ in range(3):
        row_max = torch.zeros(m, device="cuda")
        row_max[0] = 1e30
        out = gluon_w4a8_persistent_gemm(ops["q"], ops["s"], ops["w"], ops["t"], ops["bias"], tile=tile,
                                         row_max=row_max, row_max_staged=staged)
        assert torch.equal(out, plain)
        assert float(row_max[0]) == float(torch.tensor(1e30)) and torch.equal(row_max[1:], expected[1:])
