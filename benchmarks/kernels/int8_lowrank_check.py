"""Correctness and time of the fused INT8 quantizer + low-rank kernels' launch shapes at the W81 FFN widths (CUDA).

Four kernels: the quantizer + low-rank down projection (:mod:`...int8_quant_lowrank`, the up projection's input),
the GELU producer (:mod:`...int8_gelu_quant`, the down projection's input) and its single pass with given row maxima
(``gelu_single_pass``: no smoothing, ``row_max`` of the input, every shape with ``packed_rounding`` on and off)
and, with ``--kernels grouped_quant_lowrank``, the one-read quantizer with a scale per token and group of 128
(:mod:`...int8_grouped_quant_lowrank`; codes and scales against ``quantize_rows_int8_grouped``, its own grid of
rows per program and warps) beside ``grouped_torch``, the torch quantizer and bfloat16 GEMM it replaces
(``--kernels`` picks). For K 1,536 and 8,960 (M 32,760 tokens, rank 32, smoothing except for the single pass)
and every launch shape ``block_m`` 16/32/64 x ``block_k`` 64/128/256 x 4/8 warps (and the default), each shape
runs ``--repeats`` times:

* codes and scales bitwise against the torch reference quantizer (the quantizer kernel only: the producer does not
  return its GELU output);
* ``t`` against ``F.linear`` of the same operand (torch's GELU for the producer): the largest difference relative to
  ``max |t|``, the number of elements more than 2^-7 of it off, the rows modulo ``block_m`` and rank columns where
  they sit;
* every repeat bitwise equal to the first (a launch shape with a race differs between runs).

``--stages 2 4`` also runs the quantizer's shapes at those pipelining depths, ``--programs 132 264`` with that
many programs walking the row blocks; ``--widths 1536`` one width; ``--block-m 16 --block-k 512 1024`` another grid
(with ``--programs 132 264`` and ``--stages 2 3``: a few programs whose rows stay in L2 between the two passes, with
enough bytes in flight to keep the memory busy).
Then the shape is timed (CUDA events, median): ``ms`` one synchronised call per sample (the host's launch
latency included), ``ms_graph`` a CUDA graph of ten calls (the GPU's time alone).
Writes ``<out>/int8_lowrank_check.json``.

    python benchmarks/kernels/int8_lowrank_check.py --out "$OUT"     # about two minutes on an H200
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from cuda_timing import time_ms, time_ms_graph

from worldfoundry.core.acceleration.kernels.int8_act_quant import triton_quantize_rows_int8
from worldfoundry.core.acceleration.kernels.int8_gelu_quant import triton_gelu_quantize_rows_int8_lowrank
from worldfoundry.core.acceleration.kernels.int8_grouped_quant_lowrank import triton_quantize_rows_int8_grouped_lowrank
from worldfoundry.core.acceleration.kernels.int8_quant_lowrank import triton_quantize_rows_int8_lowrank
from worldfoundry.core.acceleration.quantization.int8_activation import quantize_rows_int8_grouped

M_TOKENS = 32760
RANK = 32
SHAPES = [dict(block_m=bm, block_k=bk, num_warps=w) for bm in (16, 32, 64) for bk in (64, 128, 256) for w in (4, 8)]
#: The grouped quantizer's activation group and launch shapes.
GROUP = 128
GROUPED_SHAPES = [dict(block_m=bm, num_warps=w) for bm in (16, 32, 64, 128) for w in (4, 8)]


def shapes(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The launch-shape grid: :data:`SHAPES`, or ``--block-m`` x ``--block-k`` x 4/8 warps where either is given."""
    if not (args.block_m or args.block_k):
        return SHAPES
    return [dict(block_m=bm, block_k=bk, num_warps=w) for bm in (args.block_m or (16, 32, 64))
            for bk in (args.block_k or (64, 128, 256)) for w in (4, 8)]


def t_errors(t: torch.Tensor, t_ref: torch.Tensor, block_m: int) -> dict[str, Any]:
    diff = (t.float() - t_ref).abs()
    bad = diff > 2**-7 * t_ref.abs().max()
    rows, cols = bad.nonzero(as_tuple=True)
    return {"t_max_rel": float(diff.max() / t_ref.abs().max()), "t_bad": int(bad.sum()),
            "bad_rows_mod_block": sorted({int(r) % block_m for r in rows[:4096].tolist()}),
            "bad_cols": sorted({int(c) for c in cols[:4096].tolist()})}


def check_shape(run, q_ref, s_ref, t_ref, launch: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    row: dict[str, Any] = {"launch": launch}
    try:
        first = run(**launch)
        torch.cuda.synchronize()
        row["bitwise_codes"] = q_ref is None or bool(torch.equal(first[0], q_ref) and torch.equal(first[1], s_ref))
        row.update(t_errors(first[2], t_ref, launch.get("block_m") or 64))
        row["repeats_equal"] = all(all(torch.equal(a, b) for a, b in zip(run(**launch), first))
                                   for _ in range(args.repeats - 1))
        row["ms"] = time_ms(lambda: run(**launch), args.warmup, args.reps)
        row["ms_graph"] = time_ms_graph(lambda: run(**launch), args.warmup, 5, 10)
    except Exception as e:  # noqa: BLE001 - recorded, the grid goes on
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def width_section(k: int, args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    g = torch.Generator(device="cuda").manual_seed(k)
    x = torch.randn(M_TOKENS, k, generator=g, device="cuda").to(torch.bfloat16)
    inv = torch.rand(k, generator=g, device="cuda") + 0.5
    down = (torch.randn(RANK, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    q_ref, s_ref = triton_quantize_rows_int8(x, inv)
    qg_ref, sg_ref = quantize_rows_int8_grouped(x, inv, GROUP)
    rm = x.amax(dim=1).float().clamp_min(0.0)
    kernels = {
        "quant_lowrank": (lambda **kw: triton_quantize_rows_int8_lowrank(x, inv, down, single_pass=False, **kw),
                          q_ref, s_ref, F.linear(x, down).float()),
        # the producer's GELU output is not returned: t against F.linear of torch's GELU (a few ulps apart)
        "gelu_quant_lowrank": (lambda **kw: triton_gelu_quantize_rows_int8_lowrank(x, "tanh", inv, down, **kw),
                               None, None, F.linear(F.gelu(x, approximate="tanh"), down).float()),
        # one scale per token and group of 128 channels: codes, scales and t from one read of x
        "grouped_quant_lowrank": (lambda **kw: triton_quantize_rows_int8_grouped_lowrank(x, inv, down, GROUP, **kw),
                                  qg_ref, sg_ref, F.linear(x, down).float()),
        # what ran before it: the torch grouped quantizer and a bfloat16 GEMM for t (several kernels)
        "grouped_torch": (lambda **kw: (*quantize_rows_int8_grouped(x, inv, GROUP), F.linear(x, down)),
                          qg_ref, sg_ref, F.linear(x, down).float()),
        "gelu_single_pass": (lambda **kw: triton_gelu_quantize_rows_int8_lowrank(x, "tanh", None, down, row_max=rm,
                                                                                 **kw),
                             None, None, F.linear(F.gelu(x, approximate="tanh"), down).float()),
    }
    out: dict[str, list[dict[str, Any]]] = {}
    for name, (run, q, s, t_ref) in kernels.items():
        if name not in args.kernels:
            continue
        grid = shapes(args)
        launches = grid + [{}]
        if name == "grouped_quant_lowrank":  # rows per program and warps only: a chunk is one group
            launches = GROUPED_SHAPES + [{}]
        if name == "grouped_torch":
            launches = [{}]
        if name == "gelu_single_pass":  # each shape both ways: two elements per bfloat16 conversion, and one
            launches = [dict(launch, packed_rounding=packed) for packed in (True, False) for launch in launches]
        if name == "quant_lowrank" and args.stages:  # and each shape at other pipelining depths
            launches += [dict(launch, num_stages=st) for st in args.stages for launch in grid]
        if name == "quant_lowrank" and args.programs:  # and each shape with fewer programs walking row blocks
            launches += [dict(launch, programs=n) for n in args.programs for launch in grid]
        rows = [check_shape(run, q, s, t_ref, launch, args) for launch in launches]
        for r in rows:
            print(k, name, r["launch"], {key: r.get(key) for key in
                                         ("bitwise_codes", "repeats_equal", "t_max_rel", "t_bad", "ms", "ms_graph",
                                          "error")},
                  flush=True)
        out[name] = rows
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--kernels", nargs="+", default=["quant_lowrank", "gelu_quant_lowrank", "gelu_single_pass"],
                   choices=["quant_lowrank", "gelu_quant_lowrank", "gelu_single_pass", "grouped_quant_lowrank",
                            "grouped_torch"])
    p.add_argument("--stages", nargs="*", type=int, default=[],
                   help="quant_lowrank: also every shape at these num_stages (triton's default is 3)")
    p.add_argument("--widths", nargs="+", type=int, default=[1536, 8960], help="row widths K (default both)")
    p.add_argument("--block-m", nargs="*", type=int, default=[], help="rows per program of the grid (default 16 32 64)")
    p.add_argument("--block-k", nargs="*", type=int, default=[],
                   help="chunk widths of the grid (default 64 128 256; wider chunks put more bytes in flight per "
                        "program, which a few persistent programs whose rows stay in L2 for the second pass need)")
    p.add_argument("--programs", nargs="*", type=int, default=[],
                   help="quant_lowrank: also every shape with this many programs walking the row blocks "
                        "(e.g. 132 264: one or two per H200 SM)")
    args = p.parse_args()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "widths": {}}
    for k in args.widths:
        result["widths"][str(k)] = width_section(k, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "int8_lowrank_check.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
