"""The Gluon int8 ``wgmma`` GEMMs (W8A8, W4A8): host-side checks on CPU, numerics on a Hopper GPU.

Gluon kernels do not run under the Triton interpreter, so on CPU (CI, ``TRITON_INTERPRET=1``) only the argument
checks, the tile arithmetic and the torch references are tested; the kernels are tested on CUDA sm_90 (skipped
elsewhere): bitwise equal to ``bf16`` of the reference without the low-rank term and bias (the int32 sum is exact
and the epilogue multiplies in the reference's order), within ``2**-7 * max|ref|`` with them (the low-rank product
is accumulated by a bfloat16 ``wgmma`` in float32, in another order than the reference's float32 matmul).
"""

from __future__ import annotations

import pytest
import torch

from worldfoundry.core.acceleration.kernels.w4a8_gluon_gemm import (
    DEFAULT_W4A8_TILE,
    DEFAULT_W8A8_TILE,
    HOPPER_SMEM_BYTES,
    GluonTile,
    check_gluon_operands,
    gemm_reference,
    gluon_w4a8_gemm,
    gluon_w8a8_gemm,
    w4a8_reference,
)
from worldfoundry.core.acceleration.kernels.w4a8_gluon_kernels import GLUON_AVAILABLE
from worldfoundry.core.acceleration.quantization.int4_packing import pack_int4, quantize_int4_groupwise
from worldfoundry.core.acceleration.quantization.svdquant_numerics import SVDQuantWeight, int4_gemm_reference
from worldfoundry.errors import QuantizationInputError

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
hopper_only = pytest.mark.skipif(not (HOPPER and GLUON_AVAILABLE), reason="needs a Hopper GPU and triton's Gluon")


def _operands(m: int, k: int, n: int, rank: int = 0, device: str = "cpu", seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    ops = {
        "q": torch.randint(-127, 128, (m, k), dtype=torch.int8, device=device, generator=g),
        "s": torch.rand(m, 1, device=device, generator=g) * 0.01 + 1e-3,
        "w8": torch.randint(-128, 128, (n, k), dtype=torch.int8, device=device, generator=g),
        "ws": (torch.rand(n, device=device, generator=g) * 0.02 + 1e-3).to(torch.bfloat16),
        "bias": torch.randn(n, device=device, generator=g).to(torch.bfloat16),
    }
    codes = torch.randint(-8, 8, (n, k), dtype=torch.int8, device=device, generator=g)
    up = torch.randn(n, rank, device=device, generator=g).to(torch.bfloat16) if rank else None
    ops["w4"] = SVDQuantWeight(pack_int4(codes, 0), ops["ws"].reshape(1, n), 0, lora_up=up)
    ops["t"] = torch.randn(m, rank, device=device, generator=g).to(torch.bfloat16) if rank else None
    ops["up"] = up
    return ops


# --- CPU: tiles, argument checks, references -------------------------------------------------------------


def test_tile_arithmetic() -> None:
    assert DEFAULT_W8A8_TILE.warps_mn() == (8, 1) and DEFAULT_W8A8_TILE.instr_n() == 128
    assert GluonTile(64, 128, 64, 3, 8).warps_mn() == (4, 2)
    assert GluonTile(64, 128, 64, 3, 8).instr_n() == 64
    assert GluonTile(128, 128, 128, 3, 4).instr_n() == 128
    assert GluonTile(128, 192, 128, 3, 8).instr_n() == 192
    for tile in (DEFAULT_W8A8_TILE, DEFAULT_W4A8_TILE):
        assert tile.smem_bytes(True, 32) <= HOPPER_SMEM_BYTES and tile.smem_bytes(False, 32) <= HOPPER_SMEM_BYTES
    assert GluonTile().to_json()["block_k"] == 128


@pytest.mark.parametrize("kwargs", [dict(block_m=32), dict(block_k=96), dict(block_n=250), dict(warps=2),
                                    dict(stages=7), dict(group_m=0), dict(unpack=3), dict(pack_vec=4)])
def test_bad_tile_raises(kwargs) -> None:
    with pytest.raises(QuantizationInputError, match="GluonTile"):
        GluonTile(**kwargs)


def _check(ops: dict, *, int4: bool = False, tile: GluonTile = DEFAULT_W8A8_TILE, **over):
    args = dict(q=ops["q"], scale=ops["s"], codes=ops["w4"].qweight if int4 else ops["w8"], w_scale=ops["ws"],
                t=ops["t"], lora_up=ops["up"], bias=None)
    args.update(over)
    return check_gluon_operands(**args, int4=int4, tile=tile)


def test_checks_accept_valid_operands() -> None:
    ops = _operands(70, 256, 96, rank=32)
    assert _check(ops) == (70, 96, 256, 32)
    assert _check(ops, int4=True, bias=ops["bias"]) == (70, 96, 256, 32)
    assert _check(_operands(5, 128, 48)) == (5, 48, 128, 0)


@pytest.mark.parametrize("case, match", [
    ("q_dtype", "q must be a 2-D int8"), ("q_strided", "not contiguous"), ("k_multiple", "multiple of block_k"),
    ("w_shape", "weight codes must be contiguous"), ("int4_shape", "packed INT4 weight"),
    ("scale_dtype", "scale must be a"), ("scale_len", "scale must have shape"), ("ws_len", "weight scale"),
    ("bias", "bias must be"), ("t_only", "both t"), ("rank", "rank 8"), ("t_dtype", "t must be a"),
    ("device", "one device"),
])
def test_checks_raise_typed_errors(case: str, match: str) -> None:
    ops = _operands(70, 256, 96, rank=32)
    bad = {
        "q_dtype": dict(q=ops["q"].float()), "q_strided": dict(q=ops["q"].t().contiguous().t()),
        "k_multiple": dict(q=ops["q"][:, :192].contiguous(), codes=ops["w8"][:, :192].contiguous()),
        "w_shape": dict(codes=ops["w8"][:, :128].contiguous()), "int4_shape": dict(codes=ops["w8"]),
        "scale_dtype": dict(scale=ops["s"].half()), "scale_len": dict(scale=ops["s"][:5]),
        "ws_len": dict(w_scale=ops["ws"][:5]), "bias": dict(bias=ops["bias"][:3]), "t_only": dict(lora_up=None),
        "rank": dict(t=ops["t"][:, :8].contiguous(), lora_up=ops["up"][:, :8].contiguous()),
        "t_dtype": dict(t=ops["t"].float()), "device": dict(bias=ops["bias"].to("meta")),
    }[case]
    with pytest.raises(QuantizationInputError, match=match):
        _check(ops, int4=case == "int4_shape", **bad)


def test_checks_refuse_tiles_beyond_shared_memory() -> None:
    with pytest.raises(QuantizationInputError, match="shared memory"):
        _check(_operands(8, 256, 64), tile=GluonTile(256, 256, 256, 6, 8))


def test_public_functions_refuse_cpu_and_grouped_weights(monkeypatch) -> None:
    ops = _operands(8, 128, 64)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(QuantizationInputError, match="Gluon GEMM"):
        gluon_w8a8_gemm(ops["q"], ops["s"], ops["w8"], ops["ws"])
    with pytest.raises(QuantizationInputError, match="Gluon GEMM"):
        gluon_w4a8_gemm(ops["q"], ops["s"], ops["w4"])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if GLUON_AVAILABLE:
        with pytest.raises(QuantizationInputError, match="TRITON_INTERPRET"):
            gluon_w8a8_gemm(ops["q"], ops["s"], ops["w8"], ops["ws"])
    packed, scales = quantize_int4_groupwise(torch.randn(64, 128), 64)
    with pytest.raises(QuantizationInputError, match="group_size 64"):
        gluon_w4a8_gemm(ops["q"], ops["s"], SVDQuantWeight(packed, scales, 64))


def test_references_agree_with_int4_gemm_reference() -> None:
    ops = _operands(33, 256, 48)
    ref = int4_gemm_reference(ops["q"], ops["s"], ops["w4"])
    assert torch.equal(w4a8_reference(ops["q"], ops["s"], ops["w4"]), ref)
    brute = ops["q"].double() @ ops["w8"].double().t()
    want = brute.float() * ops["ws"].float() * ops["s"]
    assert torch.equal(gemm_reference(ops["q"], ops["s"], ops["w8"], ops["ws"]), want)


# --- CUDA sm_90: the kernels ------------------------------------------------------------------------------


def _assert_close_to(out: torch.Tensor, ref: torch.Tensor, bitwise: bool) -> None:
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    if bitwise:
        assert torch.equal(out, ref.to(torch.bfloat16)), int((out != ref.to(torch.bfloat16)).sum())
    else:
        assert float((out.float() - ref).abs().max()) <= 2.0**-7 * float(ref.abs().max())


TILES = [DEFAULT_W8A8_TILE, GluonTile(128, 128, 128, 3, 8), GluonTile(64, 128, 64, 3, 4, unpack=1, epi_tma=False),
         GluonTile(128, 256, 128, 3, 8, unpack=0, pack_vec=16), GluonTile(256, 128, 128, 3, 8)]
SMALL = [(1, 128, 64), (77, 256, 384), (1000, 512, 200), (300, 1536, 8960)]


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("tile", TILES, ids=lambda t: "x".join(map(str, t.to_json().values())))
@pytest.mark.parametrize("mkn", SMALL)
def test_kernels_bitwise_small(mkn, tile) -> None:
    _kernels_bitwise(*mkn, tile)


def _kernels_bitwise(m: int, k: int, n: int, tile: GluonTile) -> None:
    if k % tile.block_k:
        pytest.skip("K is not a multiple of the tile's block_k")
    ops = _operands(m, k, n, rank=32, device="cuda")
    q, s = ops["q"], ops["s"]
    _assert_close_to(gluon_w8a8_gemm(q, s, ops["w8"], ops["ws"], tile=tile),
                     gemm_reference(q, s, ops["w8"], ops["ws"]), True)
    bare = SVDQuantWeight(ops["w4"].qweight, ops["w4"].scales, 0)
    _assert_close_to(gluon_w4a8_gemm(q, s, bare, tile=tile), int4_gemm_reference(q, s, bare), True)
    _assert_close_to(gluon_w4a8_gemm(q, s, ops["w4"], ops["t"], ops["bias"], tile=tile),
                     w4a8_reference(q, s, ops["w4"], ops["t"], ops["bias"]), False)
    _assert_close_to(gluon_w8a8_gemm(q, s, ops["w8"], ops["ws"], t=ops["t"], lora_up=ops["up"], bias=ops["bias"],
                                     tile=tile),
                     gemm_reference(q, s, ops["w8"], ops["ws"], ops["t"], ops["up"], ops["bias"]), False)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("kn", [(1536, 8960), (8960, 1536)])
def test_kernels_bitwise_w81_shapes(kn) -> None:
    """The Wan 1.3B FFN shapes with a ragged token count (4,100 = 32 * 128 + 4)."""
    _kernels_bitwise(4100, *kn, DEFAULT_W4A8_TILE)
    _kernels_bitwise(4100, *kn, DEFAULT_W8A8_TILE)
