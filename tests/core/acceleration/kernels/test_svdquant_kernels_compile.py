"""The SVDQuant Triton kernels compile ahead of time for Hopper (sm_90) without a GPU, and the W4A8 GEMM's
integer dot products lower to ``wgmma`` with s8 operands (INT8 tensor cores) in both tile orientations.

Skipped where triton has no NVIDIA backend (ptxas ships with triton's CUDA backend) and under
``TRITON_INTERPRET=1`` (the kernels are then interpreted functions): run it as
``python -m pytest -q tests/core/acceleration/kernels/test_svdquant_kernels_compile.py``.
"""

from __future__ import annotations

import functools
import re

import pytest

triton = pytest.importorskip("triton")

from worldfoundry.core.acceleration.kernels import int8_act_quant, w4a8_gemm  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    HAS_NVIDIA = "nvidia" in triton.backends.backends
except ImportError:  # pragma: no cover - very old triton
    HAS_NVIDIA = False

pytestmark = [pytest.mark.skipif(not HAS_NVIDIA, reason="triton without the NVIDIA backend"),
              pytest.mark.skipif(int8_act_quant.interpreter_enabled(), reason="kernels are interpreted (TRITON_INTERPRET=1)")]
HOPPER = None if not HAS_NVIDIA else GPUTarget("cuda", 90, 32)
W4A8_SIGNATURE = {
    "xq_ptr": "*i8", "xs_ptr": "*fp32", "wq_ptr": "*i8", "ws_ptr": "*bf16", "t_ptr": "*bf16", "lu_ptr": "*bf16",
    "b_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", **dict.fromkeys(
        ["GROUP", "RANK", "HAS_LR", "HAS_BIAS", "SWAP_AB", "BLOCK_M", "BLOCK_N", "GROUP_M", "WIDEN", "ASM"], "constexpr"),
}
#: What the JIT assumes at run time for the W81 shapes: every pointer and M, N, K divisible by 16 (without it
#: no load is vectorized and nothing is pipelined with ``cp.async``).
ALIGNED = {(i,): [["tt.divisibility", 16]] for i in range(11)}


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("group", [64, 128])
def test_w4a8_gemm_lowers_to_pipelined_int8_wgmma_on_sm90(swap, group):
    consts = {"GROUP": group, "RANK": 32, "HAS_LR": True, "HAS_BIAS": True, "SWAP_AB": swap, "BLOCK_M": 128,
              "BLOCK_N": 128, "GROUP_M": 8, "WIDEN": False, "ASM": True}
    kernel = triton.compile(ASTSource(fn=w4a8_gemm._w4a8_kernel, signature=W4A8_SIGNATURE, constexprs=consts,
                                      attrs=ALIGNED), target=HOPPER, options={"num_warps": 8, "num_stages": 3})
    ptx = kernel.asm["ptx"]
    assert re.search(r"wgmma\.mma_async[^;]*\.s32\.s8\.s8", ptx), "INT8 dot did not lower to wgmma"
    assert not re.search(r"mma\.sync[^;]*\.s8", ptx)
    assert "cp.async" in ptx, "operand loads are not pipelined"
    assert "cvt.rn.f32.s32" not in ptx  # int32 -> float32 by the exact bit trick, not the slow conversion
    assert "0xF0F0F0F0" in ptx  # nibbles unpacked four bytes per 32-bit and


def test_w4a8_gemm_compiles_with_plain_int8_unpacking_for_sm90():
    consts = {"GROUP": 128, "RANK": 32, "HAS_LR": True, "HAS_BIAS": True, "SWAP_AB": True, "BLOCK_M": 128,
              "BLOCK_N": 128, "GROUP_M": 8, "WIDEN": False, "ASM": False}
    kernel = triton.compile(ASTSource(fn=w4a8_gemm._w4a8_kernel, signature=W4A8_SIGNATURE, constexprs=consts,
                                      attrs=ALIGNED), target=HOPPER, options={"num_warps": 8, "num_stages": 4})
    ptx = kernel.asm["ptx"]
    assert re.search(r"wgmma\.mma_async[^;]*\.s32\.s8\.s8", ptx) and "0xF0F0F0F0" not in ptx


def test_int8_activation_kernel_compiles_single_pass_for_sm90():
    sig = {"x_ptr": "*bf16", "inv_ptr": "*fp32", "q_ptr": "*i8", "s_ptr": "*fp32", "M": "i32", "K": "i32",
           "stride_xm": "i32", **dict.fromkeys(["HAS_SMOOTH", "BLOCK_M", "BLOCK_K", "SINGLE_PASS", "P0", "P1", "P2"],
                                               "constexpr")}
    meta = int8_act_quant._launch_shape(8960, single_pass=True)
    assert (meta["P0"], meta["P1"], meta["P2"]) == (8192, 512, 256)  # no padded lanes
    consts = {"HAS_SMOOTH": True, **{k: v for k, v in meta.items() if k != "num_warps"}}
    kernel = triton.compile(ASTSource(fn=int8_act_quant._int8_rows_kernel, signature=sig, constexprs=consts),
                            target=HOPPER, options={"num_warps": meta["num_warps"], "enable_fp_fusion": False})
    assert "fma.rn.f32" not in kernel.asm["ptx"]  # x * rcp is rounded before the rounding addition


def test_the_automatic_choice_reads_wide_rows_in_two_passes(monkeypatch):
    """Rows wider than AUTO_SINGLE_PASS_MAX_K take two passes unless forced (both variants give the same bytes)."""
    monkeypatch.setattr(int8_act_quant, "interpreter_enabled", lambda: False)
    assert int8_act_quant._launch_shape(1536)["SINGLE_PASS"] is True
    assert int8_act_quant._launch_shape(8960)["SINGLE_PASS"] is False
    assert int8_act_quant._launch_shape(8960, single_pass=True)["SINGLE_PASS"] is True


CHANNEL_SIGNATURE = {k: v for k, v in W4A8_SIGNATURE.items() if k != "GROUP"} | {"BLOCK_K": "constexpr",
                                                                                 "ACT_GROUPS": "constexpr"}


def _loop_body(ttgir: str) -> list[str]:
    lines = ttgir.splitlines()
    start = next(i for i, line in enumerate(lines) if "scf.for" in line)
    end = next(i for i in range(start, len(lines)) if "scf.yield" in lines[i])
    return lines[start:end]


@pytest.mark.parametrize("swap,block_k", [(True, 128), (False, 128), (True, 256)])
def test_per_channel_w4a8_main_loop_is_int8_wgmma_without_float_work_on_sm90(swap, block_k):
    from worldfoundry.core.acceleration.kernels import w4a8_channel_gemm

    consts = {"RANK": 32, "HAS_LR": True, "HAS_BIAS": True, "SWAP_AB": swap, "BLOCK_M": 128, "BLOCK_N": 128,
              "GROUP_M": 8, "WIDEN": False, "ASM": True, "BLOCK_K": block_k, "ACT_GROUPS": 0}
    kernel = triton.compile(ASTSource(fn=w4a8_channel_gemm._w4a8_channel_kernel, signature=CHANNEL_SIGNATURE,
                                      constexprs=consts, attrs=ALIGNED),
                            target=HOPPER, options={"num_warps": 8, "num_stages": 3})
    ptx = kernel.asm["ptx"]
    assert re.search(r"wgmma\.mma_async[^;]*\.s32\.s8\.s8", ptx) and "cp.async" in ptx and "0xF0F0F0F0" in ptx
    body = "\n".join(_loop_body(kernel.asm["ttgir"]))
    assert "warp_group_dot" in body and "xi32" in body
    assert not re.search(r"arith\.(mulf|addf|sitofp)", body)  # no float work in the main loop
    assert body.count("ttng.warp_group_dot ") == 1  # one dot per K step (paired codes interleaved by join)
    assert "convert_layout" not in body  # the interleave moves no data


@pytest.mark.parametrize("swap", [True, False])
def test_per_channel_w4a8_with_activation_groups_keeps_int8_wgmma_on_sm90(swap):
    """With one activation scale per K step the step's int32 sum is scaled in the loop: still an int8 ``wgmma``."""
    from worldfoundry.core.acceleration.kernels import w4a8_channel_gemm

    consts = {"RANK": 32, "HAS_LR": True, "HAS_BIAS": True, "SWAP_AB": swap, "BLOCK_M": 128, "BLOCK_N": 128,
              "GROUP_M": 8, "WIDEN": False, "ASM": True, "BLOCK_K": 128, "ACT_GROUPS": 70}
    kernel = triton.compile(ASTSource(fn=w4a8_channel_gemm._w4a8_channel_kernel, signature=CHANNEL_SIGNATURE,
                                      constexprs=consts, attrs=ALIGNED),
                            target=HOPPER, options={"num_warps": 8, "num_stages": 3})
    body = "\n".join(_loop_body(kernel.asm["ttgir"]))
    assert re.search(r"wgmma\.mma_async[^;]*\.s32\.s8\.s8", kernel.asm["ptx"])
    assert "warp_group_dot" in body and re.search(r"arith\.(mulf|sitofp)", body)  # the per-step scaling


def _quant_lowrank_kernel(block_m: int, persistent: bool = False, **options):
    from worldfoundry.core.acceleration.kernels import int8_quant_lowrank

    sig = {"x_ptr": "*bf16", "inv_ptr": "*fp32", "d_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*fp32", "t_ptr": "*bf16",
           "M": "i32", "K": "i32", "stride_xm": "i32",
           **dict.fromkeys(["RANK", "HAS_SMOOTH", "BLOCK_M", "BLOCK_K", "WIDEN", "PERSISTENT"], "constexpr")}
    consts = {"RANK": 32, "HAS_SMOOTH": True, "BLOCK_M": block_m, "BLOCK_K": 256, "WIDEN": False,
              "PERSISTENT": persistent}
    return triton.compile(ASTSource(fn=int8_quant_lowrank._int8_lowrank_kernel, signature=sig, constexprs=consts,
                                    attrs={(i,): [["tt.divisibility", 16]] for i in range(9)}),
                          target=HOPPER, options={"num_warps": 8, "enable_fp_fusion": False, **options})


def test_fused_quant_lowrank_stages_trade_shared_memory_for_depth():
    """``num_stages`` reaches the chunk loop: fewer stages, less shared memory per program (more programs per SM),
    the loads still asynchronous."""
    two, three = _quant_lowrank_kernel(64, num_stages=2), _quant_lowrank_kernel(64)
    assert two.metadata.shared < three.metadata.shared
    assert "cp.async" in two.asm["ptx"]


@pytest.mark.parametrize("block_m,persistent", [(16, False), (32, False), (64, False), (16, True), (64, True)])
def test_fused_quant_lowrank_kernel_compiles_for_sm90_without_fma(block_m, persistent):
    ptx = _quant_lowrank_kernel(block_m, persistent).asm["ptx"]
    assert "cp.async" in ptx  # the chunk loads pipelined, also inside the walk over row blocks
    assert "fma.rn.f32" not in ptx  # x * rcp rounds before the rounding addition
    assert re.search(r"(wgmma\.mma_async|mma\.sync)[^;]*bf16", ptx)  # the low-rank dot on tensor cores
    assert not re.search(r"cvt\.rzi\.s(8|16|32)\.f32", ptx)  # codes from the float's bits, no conversion


def _compile_persistent_w4a8(row_max: int):
    """The persistent Gluon W4A8 kernel at its default tile, compiled for sm_90 from CPU tensors' descriptors."""
    import inspect

    import torch
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from worldfoundry.core.acceleration.kernels import w4a8_gluon_persistent_kernels as kernels
    from worldfoundry.core.acceleration.kernels.w4a8_gluon_gemm import tma_descriptor
    from worldfoundry.core.acceleration.kernels.w4a8_gluon_persistent import DEFAULT_PERSISTENT_TILE as tile

    m, n, k, rank = 512, 1024, 1536, 32
    chunk = tile.lowrank_chunk(rank)
    zeros = functools.partial(torch.zeros, dtype=torch.bfloat16)
    args = {"x_desc": tma_descriptor(torch.zeros(m, k, dtype=torch.int8), [tile.block_t, tile.block_k]),
            "w_desc": tma_descriptor(torch.zeros(n, k // 2, dtype=torch.int8), [tile.block_w, tile.block_k // 2]),
            "xs_ptr": torch.zeros(m), "ws_ptr": zeros(n), "b_ptr": zeros(n),
            "rm_ptr": torch.zeros(m, dtype=torch.int32),
            "t_desc": tma_descriptor(zeros(m, rank), [tile.block_t, chunk]),
            "u_desc": tma_descriptor(zeros(n, rank), [tile.block_w, chunk]),
            "out_desc": tma_descriptor(zeros(m, n), [tile.block_t, tile.block_w]), "M": m, "N": n, "K": k}
    consts = {"W_SCALE_MUL": 0.0625, "LR_STEPS": rank // chunk, "HAS_BIAS": True, "STAGES": tile.stages,
              "GROUP_T": tile.group_t, "INSTR_N": tile.instr_n(), "UNPACK": tile.unpack,
              "LOADER_REGS": kernels.LOADER_REGISTERS, "ROW_MAX": row_max, "num_warps": tile.warps}
    params = list(inspect.signature(kernels.w4a8_persistent_kernel.fn).parameters)
    sig = {p: "constexpr" if p in consts else mangle_type(args[p]) for p in params}
    src = GluonASTSource(kernels.w4a8_persistent_kernel, sig, {(params.index(p),): v for p, v in consts.items()})
    return triton.compile(src, target=HOPPER, options={"num_warps": tile.warps})


@pytest.mark.skipif(not triton.__version__.startswith("3.6"), reason="the Gluon kernels are written for triton 3.6 "
                    "(the GPU image's)")
def test_row_max_epilogue_issues_one_relaxed_atomic_per_thread_and_tile():
    """Both row-maximum forms issue one atomic per thread and tile: the accumulator form moves each token's maximum
    to one thread first (in the accumulator's slice every value sits in many threads, and an atomic from each copy
    cost 0.26 ms at 1536 -> 8960 on the H200); the staged form reads one token row per thread."""
    from worldfoundry.core.acceleration.kernels.w4a8_gluon_persistent import (
        DEFAULT_PERSISTENT_TILE,
        row_max_smem_bytes,
    )

    plain, with_max, staged = (_compile_persistent_w4a8(mode) for mode in (0, 1, 2))
    for kernel in (with_max, staged):
        atomics = [line for line in kernel.asm["ptx"].splitlines() if "atom." in line]
        assert len(atomics) == 1 and ".relaxed.max.s32" in atomics[0]
    assert "atom." not in plain.asm["ptx"]
    extra = with_max.metadata.shared - plain.metadata.shared
    assert 0 < extra <= row_max_smem_bytes(DEFAULT_PERSISTENT_TILE)
    # the staged form: no shuffles, no shared memory beyond the plain kernel's, about a quarter of the instructions
    assert "shfl.sync.bfly" not in staged.asm["ptx"] and staged.metadata.shared == plain.metadata.shared

    def count(kernel) -> int:  # noqa: ANN001 - a compiled kernel
        return sum(1 for line in kernel.asm["ptx"].splitlines() if line.strip()[:1].isalpha())

    assert count(staged) - count(plain) < (count(with_max) - count(plain)) / 2


@pytest.mark.parametrize("packed", [False, True])
def test_single_pass_gelu_producer_keeps_the_conversion_unit_to_its_transcendentals(packed):
    """The one-pass INT8 GELU producer converts no float to an int (codes from the float's bits) and, with
    ``packed_rounding``, rounds to bfloat16 two elements per ``cvt.rn.bf16x2.f32``."""
    from worldfoundry.core.acceleration.kernels import int8_gelu_quant

    sig = {"h_ptr": "*bf16", "rm_ptr": "*fp32", "d_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*fp32", "t_ptr": "*bf16",
           "M": "i32", "K": "i32", "stride_hm": "i32", "c0": "fp32", "c1": "fp32", "neg_bound": "fp32",
           **dict.fromkeys(["RANK", "BLOCK_M", "BLOCK_K", "WIDEN", "ACTIVATION", "PORTABLE_MATH", "SOFTWARE_ROUNDING",
                            "EVEN_K", "PACKED_ROUNDING"], "constexpr")}
    consts = {"RANK": 32, "BLOCK_M": 64, "BLOCK_K": 128, "WIDEN": False, "ACTIVATION": 1, "PORTABLE_MATH": False,
              "SOFTWARE_ROUNDING": False, "EVEN_K": True, "PACKED_ROUNDING": packed}
    kernel = triton.compile(ASTSource(fn=int8_gelu_quant._gelu_int8_given_max_kernel, signature=sig,
                                      constexprs=consts, attrs={(i,): [["tt.divisibility", 16]] for i in range(9)}),
                            target=HOPPER, options={"num_warps": 8, "enable_fp_fusion": False})
    ptx = kernel.asm["ptx"]
    assert not re.search(r"cvt\.rzi\.s(8|16|32)\.f32", ptx)
    singles, pairs = len(re.findall(r"cvt\.rn\.bf16\.f32", ptx)), len(re.findall(r"cvt\.rn\.bf16x2\.f32", ptx))
    # 64 x 128 elements over 256 threads: 32 roundings each (3 more for the row magnitudes)
    assert (singles <= 3 and pairs >= 16) if packed else (singles >= 32 and pairs < 16)


@pytest.mark.parametrize("group,block_m", [(64, 32), (64, 64), (128, 32), (128, 64), (64, None), (128, None),
                                           (256, None)])
def test_grouped_quant_lowrank_kernel_compiles_for_sm90_without_fma(group, block_m):
    """The one-read grouped quantizer: no FMA in the codes, the low-rank dot on tensor cores, codes from the
    float's bits (``None``: the default rows per program for that group)."""
    from worldfoundry.core.acceleration.kernels import int8_grouped_quant_lowrank

    block_m = block_m or int8_grouped_quant_lowrank.default_block_m(group)
    assert block_m == (64 if group == 256 else 128) or block_m in (32, 64)

    sig = {"x_ptr": "*bf16", "inv_ptr": "*fp32", "d_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*fp32", "t_ptr": "*bf16",
           "M": "i32", "K": "i32", "stride_xm": "i32", "stride_sm": "i32", "stride_sg": "i32",
           **dict.fromkeys(["RANK", "HAS_SMOOTH", "HAS_LR", "BLOCK_M", "GROUP", "WIDEN"], "constexpr")}
    consts = {"RANK": 32, "HAS_SMOOTH": True, "HAS_LR": True, "BLOCK_M": block_m, "GROUP": group, "WIDEN": False}
    kernel = triton.compile(ASTSource(fn=int8_grouped_quant_lowrank._int8_grouped_lowrank_kernel, signature=sig,
                                      constexprs=consts, attrs={(i,): [["tt.divisibility", 16]] for i in range(9)}),
                            target=HOPPER, options={"num_warps": 4, "enable_fp_fusion": False})
    ptx = kernel.asm["ptx"]
    assert "fma.rn.f32" not in ptx
    assert re.search(r"(wgmma\.mma_async|mma\.sync)[^;]*bf16", ptx)
    assert not re.search(r"cvt\.rzi\.s(8|16|32)\.f32", ptx)


def _compile_grouped_w4a8(exact: bool, group: int = 128):
    """The Gluon grouped W4A8 kernel at its default tile, compiled for sm_90 from CPU tensors' descriptors."""
    import inspect

    import torch
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from worldfoundry.core.acceleration.kernels import w4a8_gluon_grouped_kernels as kernels
    from worldfoundry.core.acceleration.kernels.w4a8_gluon_gemm import tma_descriptor
    from worldfoundry.core.acceleration.kernels.w4a8_gluon_grouped import DEFAULT_GROUPED_TILE as tile
    from worldfoundry.core.acceleration.kernels.w4a8_gluon_grouped import _scale_layout

    m, n, k, rank = 512, 1024, 1536, 32
    chunk = tile.lowrank_chunk(rank)
    zeros = functools.partial(torch.zeros, dtype=torch.bfloat16)
    args = {"x_desc": tma_descriptor(torch.zeros(m, k, dtype=torch.int8), [tile.block_t, tile.block_k]),
            "w_desc": tma_descriptor(torch.zeros(n, k // 2, dtype=torch.int8), [tile.block_w, tile.block_k // 2]),
            "s_desc": TensorDescriptor.from_tensor(torch.zeros(k // group, m), [1, tile.block_t], _scale_layout()),
            "ws_ptr": zeros(n), "b_ptr": zeros(n), "t_desc": tma_descriptor(zeros(m, rank), [tile.block_t, chunk]),
            "u_desc": tma_descriptor(zeros(n, rank), [tile.block_w, chunk]),
            "out_desc": tma_descriptor(zeros(m, n), [tile.block_t, tile.block_w]), "M": m, "N": n, "K": k}
    consts = {"W_SCALE_MUL": 0.0625, "LR_STEPS": rank // chunk, "HAS_BIAS": True, "STAGES": tile.stages,
              "GROUP_T": tile.group_t, "INSTR_N": tile.instr_n(), "UNPACK": tile.unpack,
              "GROUP_STEPS": group // tile.block_k, "EXACT": exact, "LOADER_REGS": kernels.GROUPED_LOADER_REGISTERS,
              "num_warps": tile.warps}
    params = list(inspect.signature(kernels.w4a8_grouped_kernel.fn).parameters)
    sig = {p: "constexpr" if p in consts else mangle_type(args[p]) for p in params}
    src = GluonASTSource(kernels.w4a8_grouped_kernel, sig, {(params.index(p),): v for p, v in consts.items()})
    return triton.compile(src, target=HOPPER, options={"num_warps": tile.warps, "enable_fp_fusion": False})


@pytest.mark.skipif(not triton.__version__.startswith("3.6"), reason="the Gluon kernels are written for triton 3.6 "
                    "(the GPU image's)")
@pytest.mark.parametrize("exact", [True, False])
def test_grouped_w4a8_keeps_int8_wgmma_asynchronous(exact, tmp_path):
    """The grouped kernel's int8 ``wgmma`` stay asynchronous (one group in flight while the other accumulator is
    promoted: ``ptxas`` does not serialise them, which it does when a non-``wgmma`` instruction writes an
    accumulator inside a pipeline stage), each group's first MMA starts from zero, no slow int -> float conversion,
    and FMAs only in the FMA variant."""
    import pathlib
    import subprocess

    kernel = _compile_grouped_w4a8(exact)
    ptx = kernel.asm["ptx"]
    assert re.search(r"wgmma\.mma_async[^;]*\.s32\.s8\.s8", ptx) and "wgmma.wait_group.sync.aligned 1" in ptx
    assert "cvt.rn.f32.s32" not in ptx
    assert ("fma.rn.f32" in ptx) != exact
    (tmp_path / "k.ptx").write_text(ptx)
    ptxas = pathlib.Path(triton.backends.nvidia.__file__).parent / "bin" / "ptxas"
    run = subprocess.run([str(ptxas), "--gpu-name", "sm_90a", "-v", str(tmp_path / "k.ptx"), "-o",
                          str(tmp_path / "k.cubin")], capture_output=True, text=True, check=True)
    assert "serialized" not in run.stdout + run.stderr, run.stdout + run.stderr
