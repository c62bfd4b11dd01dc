"""H200: where the time of the grouped-scale W4A8 GEMM goes, at the Wan 2.1 1.3B FFN shapes at W81.

The Gluon GEMM with activation scales per token and group (:mod:`~worldfoundry.core.acceleration.kernels.
w4a8_gluon_grouped`) differs from the per-token persistent one in two ways: its tile is smaller (three
accumulators must fit the registers: 128 outputs x 128 tokens instead of 128 x 256), and each group's integer sum is
scaled into a float32 accumulator on the CUDA cores. This times the GEMMs alone (codes, scales and ``t``
precomputed; rank 32 and bias), each call replayed from a CUDA graph and synchronised, in ``--blocks`` interleaved
blocks (the order rotating), and reports each row's median time and its ratio to bf16 ``F.linear`` within each
block:

* ``bf16_linear_bias``: the anchor;
* ``per_token_default``: the per-token persistent GEMM at its default tile (128 x 256 x 64);
* ``per_token_tile_128``: the same kernel at the grouped kernel's tile (128 x 128 x 64, 6 stages): the tile's cost;
* ``grouped_128`` / ``grouped_128_fma``: groups of 128, exact promotion (four operations per element and group) and
  FMA promotion (three);
* ``grouped_256``: groups of 256 (half as many promotions): with ``grouped_128`` the cost of one promotion pass.

Operands: random codes and scales (speed only; the numerics are tested in the suite). Writes
``<out>/w4a8_grouped_cost.json``.

    python benchmarks/kernels/w4a8_grouped_cost.py --out "$OUT"      # about a minute on an H200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from cuda_timing import time_ms_graph

from worldfoundry.core.acceleration.kernels.w4a8_gluon_grouped import GroupedTile, gluon_w4a8_grouped_gemm
from worldfoundry.core.acceleration.kernels.w4a8_gluon_persistent import PersistentTile, gluon_w4a8_persistent_gemm
from worldfoundry.core.acceleration.quantization.int4_packing import quantize_int4_groupwise
from worldfoundry.core.acceleration.quantization.svdquant_numerics import SVDQuantWeight

M_TOKENS = 32760
SHAPES = ((1536, 8960), (8960, 1536))
RANK = 32


def variants(k: int, n: int) -> dict[str, Any]:
    """The timed GEMMs of one shape."""
    g = torch.Generator(device="cuda").manual_seed(k)
    x = torch.randn(M_TOKENS, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    packed, scales = quantize_int4_groupwise(w, 0)
    up = (torch.randn(n, RANK, device="cuda", generator=g) / RANK**0.5).to(torch.bfloat16)
    weight = SVDQuantWeight(packed, scales, 0, lora_up=up)
    q = torch.randint(-127, 128, (M_TOKENS, k), dtype=torch.int8, device="cuda", generator=g)
    t = torch.randn(M_TOKENS, RANK, device="cuda", generator=g).to(torch.bfloat16)
    s = torch.rand(M_TOKENS, 1, device="cuda", generator=g) * 0.01 + 1e-3
    s128 = (torch.rand(M_TOKENS, k // 128, device="cuda", generator=g) * 0.01 + 1e-3).t().contiguous().t()
    s256 = (torch.rand(M_TOKENS, k // 256, device="cuda", generator=g) * 0.01 + 1e-3).t().contiguous().t()
    tile_128 = PersistentTile(128, 128, 64, 6, 8, group_t=8)
    fma = GroupedTile(exact=False)
    return {"bf16_linear_bias": lambda: F.linear(x, w, bias),
            "per_token_default": lambda: gluon_w4a8_persistent_gemm(q, s, weight, t, bias),
            "per_token_tile_128": lambda: gluon_w4a8_persistent_gemm(q, s, weight, t, bias, tile=tile_128),
            "grouped_128": lambda: gluon_w4a8_grouped_gemm(q, s128, weight, t, bias),
            "grouped_128_fma": lambda: gluon_w4a8_grouped_gemm(q, s128, weight, t, bias, tile=fma),
            "grouped_256": lambda: gluon_w4a8_grouped_gemm(q, s256, weight, t, bias)}


def shape_section(k: int, n: int, blocks: int, reps: int) -> dict[str, Any]:
    fns = variants(k, n)
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for block in range(blocks):
        for name in names[block % len(names):] + names[:block % len(names)]:
            times[name].append(time_ms_graph(fns[name], 2, reps, 1))
    rows = {}
    for name, ms in times.items():
        ratios = [b / x for b, x in zip(times["bf16_linear_bias"], ms)]
        rows[name] = {"median_ms": statistics.median(ms), "ms_per_block": ms,
                      "speedup_vs_bf16": statistics.median(ratios), "speedup_range": [min(ratios), max(ratios)]}
    return {"M": M_TOKENS, "K": k, "N": n, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "./bench_out"))
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    result = {"timing": "graph1 (one call replayed from a CUDA graph, synchronised)", "blocks": args.blocks,
              "reps": args.reps, "commit": os.environ.get("COMMIT", ""),
              "shapes": {f"{k}->{n}": shape_section(k, n, args.blocks, args.reps) for k, n in SHAPES}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "w4a8_grouped_cost.json").write_text(json.dumps(result, indent=2))
    for shape, sec in result["shapes"].items():
        print(shape)
        for name, row in sec["rows"].items():
            lo, hi = row["speedup_range"]
            print(f"  {name:22s} {row['median_ms']:.3f} ms  {row['speedup_vs_bf16']:.3f}x bf16 [{lo:.3f}, {hi:.3f}]")


if __name__ == "__main__":
    main()
