#!/usr/bin/env python3
"""Can one GEMM give Q, K and V as *contiguous* tensors, bitwise equal to three separate projections?

The packed ``F.linear`` (``(M, 3N)`` output, split into strided views) is bitwise equal to the separate
projections, but Wan normalises Q and K with an RMSNorm that copies a strided input first, which costs
more than the packed GEMM saves at W17. A batched GEMM whose output is ``(3, M, N)`` yields contiguous
Q/K/V. This probe checks, per shape, whether ``torch.baddbmm`` (bias in the epilogue) on the packed weight
is bitwise equal to ``F.linear`` per projection, and times: three ``F.linear``; packed ``F.linear`` + the
two copies RMSNorm would make; ``baddbmm``.

Usage:
    python benchmarks/kernels/qkv_layout_probe.py --out "$OUT"
    python benchmarks/kernels/qkv_layout_probe.py --smoke --out /tmp/qkv
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from worldfoundry.bench.microbench import interleaved, provenance

SHAPES = {"W17 self": (3600, 1536, 1536), "W81 self": (32760, 1536, 1536), "H3 16k self": (16384, 5376, 7168)}
SMOKE_SHAPES = {"tiny": (33, 32, 16)}


def batched(x: torch.Tensor, w3t: torch.Tensor, b3: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    return torch.baddbmm(b3, x.unsqueeze(0).expand(3, m, k), w3t)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    result: dict = {"provenance": provenance(device), "shapes": {}}
    for name, (m, k, n) in (SMOKE_SHAPES if args.smoke else SHAPES).items():
        x = torch.randn(m, k, generator=g).to(device, dtype)
        w = (torch.randn(3 * n, k, generator=g) * k ** -0.5).to(device, dtype)
        b = (torch.randn(3 * n, generator=g) * 0.1).to(device, dtype)
        ws, bs = w.split(n), b.split(n)
        w3t = w.view(3, n, k).transpose(1, 2)  # (3, K, N) view of the packed weight
        b3 = b.view(3, 1, n)
        ref = [F.linear(x, wi, bi) for wi, bi in zip(ws, bs, strict=True)]
        out = batched(x, w3t, b3)
        w3c = w3t.contiguous()
        out_c = batched(x, w3c, b3)
        row = {
            "M": m, "K": k, "N": n,
            "baddbmm_bitwise": [bool(torch.equal(out[i], ref[i])) for i in range(3)],
            "baddbmm_contiguous_weight_bitwise": [bool(torch.equal(out_c[i], ref[i])) for i in range(3)],
            "packed_linear_bitwise": [bool(torch.equal(t, r)) for t, r in
                                      zip(F.linear(x, w, b).split(n, -1), ref, strict=True)],
        }
        fns = {
            "three F.linear": lambda: [F.linear(x, wi, bi) for wi, bi in zip(ws, bs, strict=True)],
            "packed F.linear + 2 copies": lambda: [t.contiguous() for t in F.linear(x, w, b).split(n, -1)[:2]],
            "baddbmm (3,M,N)": lambda: batched(x, w3t, b3),
            "baddbmm, contiguous (3,K,N) weight": lambda: batched(x, w3c, b3),
        }
        row["timing"] = interleaved(fns, device, rounds=args.rounds, warmup=2, iters=20, baseline="three F.linear")
        result["shapes"][name] = row
        print(name, {k2: v for k2, v in row.items() if k2 != "timing"})
        for label, t in row["timing"].items():
            print(f"   {label:36s} {t['median_ms']:.4f} ms")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "qkv_layout_probe.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
