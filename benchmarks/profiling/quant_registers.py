"""Registers and vector memory instructions of the FP8 activation quantizers, compiled ahead of time for sm_90.

Runs on a machine without a GPU: Triton compiles each kernel for ``GPUTarget("cuda", 90, 32)`` with the integer
and pointer arguments specialised as divisible by 16 (as a launch with the W81 shapes specialises them), and its
bundled ``ptxas -v`` reports registers and spills. Printed per variant: global loads / stores in the PTX (how many
are vector instructions), registers per thread, spill bytes -- the occupancy side of the question why smoothing
costs the 8,960-wide ``ffn.2`` rows time. The one-launch W4F8 activation operand (``w4f8_activation_codes``) is
compiled the same way at a few tiles.

Usage::

    python benchmarks/profiling/quant_registers.py [--k 8960]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from worldfoundry.core.acceleration.kernels import fp8_rowwise_quant as rowwise
from worldfoundry.core.acceleration.kernels import fp8_smoothed_quant as held
from worldfoundry.core.acceleration.kernels import w4f8_activation_codes as one

TARGET = GPUTarget("cuda", 90, 32)


def _compile(fn: Any, sig: dict[str, str], consts: dict[str, Any], divisible: tuple[str, ...], warps: int) -> Any:
    sig = {name: sig[name] for name in fn.arg_names}  # the kernel's parameter order
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible if n in sig and sig[n] != "constexpr"}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=TARGET,
                          options={"num_warps": warps})


def _stats(kernel: Any) -> str:
    ptx = kernel.asm["ptx"]
    counts = {op: (len(re.findall(rf"{op}\.global", ptx)), len(re.findall(rf"{op}\.global[^\n]*\.v[248]", ptx)))
              for op in ("ld", "st")}
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    ptxas = get_ptxas(90)
    ptxas = getattr(ptxas, "path", ptxas)
    done = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", "/dev/null"], capture_output=True,
                          text=True, check=False)
    regs = re.search(r"Used (\d+) registers", done.stderr)
    spill = re.search(r"(\d+) bytes spill stores", done.stderr)
    return (f"ld {counts['ld'][0]} ({counts['ld'][1]} vector), st {counts['st'][0]} ({counts['st'][1]} vector), "
            f"{regs.group(1) if regs else '?'} registers, {spill.group(1) if spill else '?'} bytes spilled")


def rowwise_variant(k: int, smooth: bool, activation: int, warps: int) -> str:
    p0, p1, p2 = rowwise.row_pieces(k)
    sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "clip_ptr": "*fp32", "act_ptr": "*fp8e4nv",
           "M": "i32", "K": "i32", "stride_xm": "i32", "stride_qm": "i32", "stride_am": "i32", "fp8_max": "fp32",
           "amax_floor": "fp32", "clip_threshold": "fp32", "c0": "fp32", "c1": "fp32"}
    consts: dict[str, Any] = {"BLOCK_M": 1, "P0": p0, "P1": p1, "P2": p2, "BLOCK_K": p0 + p1 + p2,
                              "SINGLE_PASS": True, "ACTIVATION": activation, "STORE_ACTIVATION": False,
                              "PORTABLE_MATH": False, "COUNT_CLIPS": False, "SOFTWARE_ROUNDING": False,
                              "HAS_SMOOTH": smooth}
    sig.update({name: "constexpr" for name in consts})
    if smooth:
        sig["smooth_ptr"] = "*fp32"
    else:
        sig["smooth_ptr"], consts["smooth_ptr"] = "constexpr", None
    divisible = ("x_ptr", "q_ptr", "scale_ptr", "clip_ptr", "act_ptr", "K", "stride_xm", "stride_qm", "stride_am",
                 "smooth_ptr")
    return _stats(_compile(rowwise._fp8_rowwise_quant_kernel, sig, consts, divisible, warps))


def held_variant(k: int, activation: int, warps: int, rows: int = 62) -> str:
    p0, p1, p2 = rowwise.row_pieces(k)
    sig = {"x_ptr": "*bf16", "inv_ptr": "*fp32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "M": "i32", "K": "i32",
           "stride_xm": "i32", "stride_qm": "i32", "amax_floor": "fp32", "c0": "fp32", "c1": "fp32"}
    consts = {"ROWS": rows, "P0": p0, "P1": p1, "P2": p2, "ACTIVATION": activation, "PORTABLE_MATH": False,
              "SOFTWARE_ROUNDING": False}
    sig.update({name: "constexpr" for name in consts})
    divisible = ("x_ptr", "inv_ptr", "q_ptr", "s_ptr", "K", "stride_xm", "stride_qm")
    return _stats(_compile(held._smoothed_fp8_kernel, sig, consts, divisible, warps))


def one_launch_variant(activation: int, smooth: bool, tile: tuple[int, int, int], rank: int = 32) -> str:
    """The one-launch W4F8 activation operand (codes + appended low-rank codes, ``tl.dot``) at ``tile``."""
    block_m, block_k, warps = tile
    sig = {"x_ptr": "*bf16", "a_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "d_ptr": "*bf16", "alpha_ptr": "*fp32",
           "M": "i32", "K": "i32", "stride_xm": "i32", "stride_a": "i32", "fp8_max": "fp32", "amax_floor": "fp32",
           "c0": "fp32", "c1": "fp32"}
    consts: dict[str, Any] = {"RANK": rank, "BLOCK_M": block_m, "BLOCK_K": block_k, "ACTIVATION": activation,
                              "PORTABLE_MATH": False, "SOFTWARE_ROUNDING": False, "HAS_SMOOTH": smooth,
                              "WIDEN": False}
    sig.update({name: "constexpr" for name in consts})
    sig["smooth_ptr"] = "*fp32"
    divisible = ("x_ptr", "a_ptr", "scale_ptr", "d_ptr", "alpha_ptr", "smooth_ptr", "K", "stride_xm", "stride_a")
    return _stats(_compile(one._quant_appended_kernel, sig, consts, divisible, warps))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=8960)
    args = ap.parse_args(argv)
    for activation, name in ((rowwise.ACTIVATION_NONE, "plain"), (rowwise.ACTIVATION_GELU_TANH, "GELU")):
        for warps in (4, 8):
            for smooth in (False, True):
                print(f"rowwise {name:5s} smooth={smooth!s:5s} 1 row, {warps:2d} warps: "
                      f"{rowwise_variant(args.k, smooth, activation, warps)}")
        for warps in (4, 8, 16):
            print(f"held    {name:5s} smooth=True  rows loop, {warps:2d} warps: {held_variant(args.k, activation, warps)}")
        for smooth in (False, True):
            for tile in ((16, 128, 4), (32, 128, 4), (64, 128, 8)):
                print(f"one-launch operand {name:5s} smooth={smooth!s:5s} {tile[0]}x{tile[1]}, {tile[2]} warps: "
                      f"{one_launch_variant(activation, smooth, tile)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
