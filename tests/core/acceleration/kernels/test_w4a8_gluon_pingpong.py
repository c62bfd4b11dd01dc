"""The ping-pong Gluon W4A8 GEMM: host-side checks on CPU, numerics on a Hopper GPU.

Gluon kernels do not run under the Triton interpreter, so on CPU only the tile rules and the argument checks are
tested; on CUDA sm_90 (skipped elsewhere) the kernel is bitwise equal to ``bf16`` of the reference without the
low-rank term and bias, and within ``2**-7 * max|ref|`` with them (bfloat16 ``wgmma`` accumulated in float32).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from worldfoundry.core.acceleration.kernels.w4a8_gluon_gemm import HOPPER_SMEM_BYTES, w4a8_reference
from worldfoundry.core.acceleration.kernels.w4a8_gluon_kernels import GLUON_AVAILABLE
from worldfoundry.core.acceleration.kernels.w4a8_gluon_persistent import PersistentTile
from worldfoundry.core.acceleration.kernels.w4a8_gluon_pingpong import (
    DEFAULT_PINGPONG_TILE,
    PingPongTile,
    check_pingpong_operands,
    gluon_w4a8_pingpong_gemm,
)
from worldfoundry.core.acceleration.quantization.int4_packing import pack_int4, quantize_int4_groupwise
from worldfoundry.core.acceleration.quantization.svdquant_numerics import SVDQuantWeight, int4_gemm_reference
from worldfoundry.errors import QuantizationInputError

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
hopper_only = pytest.mark.skipif(not (HOPPER and GLUON_AVAILABLE), reason="needs a Hopper GPU and triton's Gluon")
#: Set in the child process that runs the kernel tests: a wrong hand-off between the two consumers would hang, and
#: a hang must fail the suite (the child is killed at :data:`CHILD_TIMEOUT_S`), not stall it.
INNER = os.environ.get("WORLDFOUNDRY_PINGPONG_CHILD") == "1"
in_child = pytest.mark.skipif(not INNER, reason="runs inside test_kernel_tests_finish_in_a_child_process")
#: ``WORLDFOUNDRY_PINGPONG_TIMEOUT_S`` shortens it where device time is scarce.
CHILD_TIMEOUT_S = float(os.environ.get("WORLDFOUNDRY_PINGPONG_TIMEOUT_S", "600"))


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
    tile = PingPongTile()
    assert tile == DEFAULT_PINGPONG_TILE and tile.instr_n() == 128 and tile.lowrank_chunk(32) == 16
    assert tile.smem_bytes() == 2 * (6 * (128 * 64 + 128 * 32) + 2 * 128 * 128 + 8 * 6) + 16
    assert tile.smem_bytes() <= HOPPER_SMEM_BYTES
    assert PingPongTile(64, 256, 64, 4).instr_n() == 128 and PingPongTile(64, 96, 128, 4).instr_n() == 96
    assert PingPongTile(64, 128, 128, 2).lowrank_chunk(64) == 32
    assert tile.to_json()["block_t"] == 128


@pytest.mark.parametrize("kwargs", [dict(block_w=256, block_t=64), dict(block_w=32), dict(block_k=96),
                                    dict(block_t=250), dict(block_t=512), dict(stages=1), dict(stages=9),
                                    dict(group_t=0), dict(unpack=2), dict(block_w=128, block_t=256),
                                    dict(block_w=128, block_k=128), dict(block_w=64, block_k=256), dict(turns=1)])
def test_bad_tile_raises(kwargs) -> None:
    with pytest.raises(QuantizationInputError, match="PingPongTile"):
        PingPongTile(**kwargs)


def test_checks_accept_valid_operands() -> None:
    ops = _operands(70, 256, 96)
    assert check_pingpong_operands(ops["q"], ops["s"], ops["w"], ops["t"], ops["bias"],
                                   DEFAULT_PINGPONG_TILE) == (70, 96, 256, 32)
    assert check_pingpong_operands(ops["q"], ops["s"], ops["bare"], None, None, DEFAULT_PINGPONG_TILE) == (70, 96, 256,
                                                                                                         0)


def test_checks_raise_typed_errors() -> None:
    ops = _operands(70, 256, 96)
    odd = _operands(9, 128, 100, rank=0)
    with pytest.raises(QuantizationInputError, match="gluon_w4a8_pingpong_gemm: N = 100"):
        check_pingpong_operands(odd["q"], odd["s"], odd["w"], None, None, DEFAULT_PINGPONG_TILE)
    with pytest.raises(QuantizationInputError, match="both t"):
        check_pingpong_operands(ops["q"], ops["s"], ops["bare"], ops["t"], None, DEFAULT_PINGPONG_TILE)
    with pytest.raises(QuantizationInputError, match="shared memory"):
        check_pingpong_operands(ops["q"], ops["s"], ops["w"], ops["t"], None, PingPongTile(stages=8))
    with pytest.raises(QuantizationInputError, match="PingPongTile"):
        check_pingpong_operands(ops["q"], ops["s"], ops["w"], ops["t"], None, PersistentTile())
    packed, scales = quantize_int4_groupwise(torch.randn(96, 256), 64)
    with pytest.raises(QuantizationInputError, match="group_size 64"):
        check_pingpong_operands(ops["q"], ops["s"], SVDQuantWeight(packed, scales, 64), None, None,
                                DEFAULT_PINGPONG_TILE)


def test_refuses_cpu_and_the_interpreter(monkeypatch) -> None:
    ops = _operands(8, 128, 64, rank=0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(QuantizationInputError, match="Gluon GEMM"):
        gluon_w4a8_pingpong_gemm(ops["q"], ops["s"], ops["w"])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if GLUON_AVAILABLE:
        with pytest.raises(QuantizationInputError, match="TRITON_INTERPRET"):
            gluon_w4a8_pingpong_gemm(ops["q"], ops["s"], ops["w"])


# --- CUDA sm_90: the kernel -------------------------------------------------------------------------------


def _assert_close_to(out: torch.Tensor, ref: torch.Tensor, bitwise: bool) -> None:
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    if bitwise:
        assert torch.equal(out, ref.to(torch.bfloat16)), int((out != ref.to(torch.bfloat16)).sum())
    else:
        assert float((out.float() - ref).abs().max()) <= 2.0**-7 * float(ref.abs().max())


def _kernel_matches(m: int, k: int, n: int, tile: PingPongTile) -> None:
    if k % tile.block_k:
        pytest.skip("K is not a multiple of the tile's block_k")
    ops = _operands(m, k, n, device="cuda")
    q, s = ops["q"], ops["s"]
    _assert_close_to(gluon_w4a8_pingpong_gemm(q, s, ops["bare"], tile=tile), int4_gemm_reference(q, s, ops["bare"]),
                     True)
    _assert_close_to(gluon_w4a8_pingpong_gemm(q, s, ops["w"], ops["t"], ops["bias"], tile=tile),
                     w4a8_reference(q, s, ops["w"], ops["t"], ops["bias"]), False)


TILES = [DEFAULT_PINGPONG_TILE, PingPongTile(64, 256, 64, 4), PingPongTile(64, 128, 128, 4, group_t=1),
         PingPongTile(128, 128, 64, 6, unpack=0), PingPongTile(turns=False), PingPongTile(64, 256, 64, 4, turns=False)]
# K steps at block_k 64/128: 2/1, 6/3, 8/4, 24/12, 10/5; one tile (M=1), ragged M and N, more tiles
# than programs with an odd count per program
SMALL = [(1, 128, 64), (77, 384, 136), (1000, 512, 384), (300, 1536, 8960), (129, 640, 24)]


@pytest.mark.gpu
@hopper_only
@in_child
@pytest.mark.parametrize("tile", TILES, ids=lambda t: "x".join(map(str, t.to_json().values())))
@pytest.mark.parametrize("mkn", SMALL)
def test_kernel_small(mkn, tile) -> None:
    _kernel_matches(*mkn, tile)


@pytest.mark.gpu
@hopper_only
@in_child
@pytest.mark.parametrize("kn", [(1536, 8960), (8960, 1536)])
def test_kernel_w81_shapes(kn) -> None:
    """The Wan 1.3B FFN shapes with a ragged token count (4,100 = 32 * 128 + 4)."""
    _kernel_matches(4100, *kn, DEFAULT_PINGPONG_TILE)


@pytest.mark.gpu
@hopper_only
@pytest.mark.skipif(INNER, reason="the child itself")
def test_kernel_tests_finish_in_a_child_process() -> None:
    """The kernel tests above, in a child process with a time limit: a deadlock fails here instead of hanging."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", __file__, "-k",
           "kernel_small or kernel_w81"]
    try:
        done = subprocess.run(cmd, env={**os.environ, "WORLDFOUNDRY_PINGPONG_CHILD": "1"}, capture_output=True,
                              text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the ping-pong kernel tests did not finish in {CHILD_TIMEOUT_S} s (a hang?): {exc.stdout!r:.2000}")
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert " passed" in done.stdout and " skipped" not in done.stdout, done.stdout[-2000:]
