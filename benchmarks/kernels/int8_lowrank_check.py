"""Correctness grid of the fused INT8 quantizer + low-rank down projection at the W81 FFN widths (CUDA).

For K 1,536 and 8,960 (M 32,760 tokens, rank 32, smoothing) and every launch shape ``block_m`` in 16/32/64,
``block_k`` in 64/128/256 and 4/8 warps of the two-pass form (and the single pass where rows fit), checks the codes
and scales bitwise against the torch reference quantizer and ``t`` against ``F.linear(x, D)`` (bfloat16 GEMM):
the largest difference relative to ``max |t|``, the number of ``t`` elements more than 2^-7 of it off, and the
rows (modulo ``block_m``) and rank columns where they sit. Writes ``<out>/int8_lowrank_check.json``.

    python benchmarks/kernels/int8_lowrank_check.py --out "$OUT"     # under a minute on an H200
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from worldfoundry.core.acceleration.kernels.int8_act_quant import triton_quantize_rows_int8
from worldfoundry.core.acceleration.kernels.int8_quant_lowrank import (
    SINGLE_PASS_MAX_K,
    triton_quantize_rows_int8_lowrank,
)

M_TOKENS = 32760
RANK = 32


def check(x, inv, down, q_ref, s_ref, t_ref, **launch) -> dict[str, Any]:
    try:
        q, s, t = triton_quantize_rows_int8_lowrank(x, inv, down, **launch)
    except Exception as e:  # noqa: BLE001 - recorded, the grid goes on
        return {"launch": launch, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    torch.cuda.synchronize()
    diff = (t.float() - t_ref).abs()
    bad = diff > 2**-7 * t_ref.abs().max()
    rows, cols = bad.nonzero(as_tuple=True)
    bm = launch.get("block_m") or 16
    return {"launch": launch, "bitwise_codes": bool(torch.equal(q, q_ref) and torch.equal(s, s_ref)),
            "t_max_rel": float(diff.max() / t_ref.abs().max()), "t_bad": int(bad.sum()),
            "bad_rows_mod_block": sorted({int(r) % bm for r in rows[:4096].tolist()}),
            "bad_cols": sorted({int(c) for c in cols[:4096].tolist()}),
            "first_bad_rows": rows[:8].tolist()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    args = p.parse_args()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "widths": {}}
    for k in (1536, 8960):
        g = torch.Generator(device="cuda").manual_seed(k)
        x = torch.randn(M_TOKENS, k, generator=g, device="cuda").to(torch.bfloat16)
        inv = torch.rand(k, generator=g, device="cuda") + 0.5
        down = (torch.randn(RANK, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
        q_ref, s_ref = triton_quantize_rows_int8(x, inv)
        t_ref = F.linear(x, down).float()
        rows = []
        for bm in (16, 32, 64):
            for bk in (64, 128, 256):
                for warps in (4, 8):
                    rows.append(check(x, inv, down, q_ref, s_ref, t_ref, block_m=bm, block_k=bk, num_warps=warps,
                                      single_pass=False))
            if k <= SINGLE_PASS_MAX_K:
                rows.append(check(x, inv, down, q_ref, s_ref, t_ref, block_m=bm, single_pass=True))
        rows.append(check(x, inv, down, q_ref, s_ref, t_ref))
        result["widths"][str(k)] = rows
        for r in rows:
            print(k, r["launch"], {key: r.get(key) for key in ("bitwise_codes", "t_max_rel", "t_bad", "error")},
                  r.get("bad_rows_mod_block", "")[:8], r.get("bad_cols", "")[:8], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "int8_lowrank_check.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
