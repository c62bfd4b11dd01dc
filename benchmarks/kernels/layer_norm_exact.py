#!/usr/bin/env python3
"""The reproduced LayerNorm (``worldfoundry.core.fusion.layer_norm``) against PyTorch's own, bitwise, and its speed.

1. **Exactness** (GPU): for each ``mean_order`` (which product of the Welford mean merge the CUDA build contracts)
   and many rows -- widths 12 to 5,120, Wan's 1,536 at W17/W81 row counts, several scales and offsets, eps 1e-6 and
   1e-5, no affine / weight / weight and bias, a bfloat16 input read as float32 -- the kernel's output, mean and
   rstd against ``torch.native_layer_norm`` on the same data: the count of rows whose bits differ.
2. **The AdaLN form**: ``layer_norm_modulate`` on a bfloat16 ``[1, S, 1536]`` stream against Wan's eager
   ``(norm1(x.float()) * (1 + scale) + shift).type_as(x)``, bitwise, at W17 and W81 token counts.
3. **Speed** (median of CUDA-event timings): eager (LayerNorm + PyTorch's modulate ops), the block-fusion path today
   (LayerNorm + the ``modulate`` kernel) and the fused kernel, at W17 and W81.
4. **RMSNorm** (``rms_norm``, the same kernel with PyTorch's RMS statistics) against ``F.rms_norm`` on CUDA: widths
   12 to 5,120 and Wan's ``norm_q``/``norm_k`` (3,600 and 32,760 rows of 1,536), bfloat16 and float32, with and
   without weight: rows whose bits differ.

    python benchmarks/kernels/layer_norm_exact.py --out $OUT        # H200, under a minute
    python benchmarks/kernels/layer_norm_exact.py --smoke           # CPU, TRITON_INTERPRET=1, small rows

Writes ``$OUT/layer_norm_exact.json`` (default ``./bench_out``); prints the tables last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from worldfoundry.bench.microbench import provenance
from worldfoundry.core.fusion.adaln import modulate
from worldfoundry.core.fusion.layer_norm import layer_norm, layer_norm_modulate, rms_norm
from worldfoundry.core.fusion.layer_norm_reference import reference_layer_norm, reference_rms_norm

WIDTHS = (12, 96, 128, 640, 768, 1536, 2048, 3072, 5120)
ROWS = {"W17": 3600, "W81": 32760}


def cases(smoke: bool) -> list[dict[str, Any]]:
    out = []
    for n in WIDTHS[:5] if smoke else WIDTHS:
        for scale, offset in ((1.0, 0.0), (3.0, 0.5), (0.01, 100.0)):
            for affine in ("none", "weight", "both"):
                out.append({"rows": 8 if smoke else 512, "n": n, "scale": scale, "offset": offset, "affine": affine,
                            "eps": 1e-6 if affine != "weight" else 1e-5, "bf16_input": False})
    if not smoke:
        for label, rows in ROWS.items():
            out.append({"rows": rows, "n": 1536, "scale": 4.0, "offset": 0.1, "affine": "none", "eps": 1e-6,
                        "bf16_input": True, "label": label})
            out.append({"rows": rows, "n": 1536, "scale": 4.0, "offset": 0.1, "affine": "both", "eps": 1e-6,
                        "bf16_input": False, "label": label})
    return out


def check(case: dict[str, Any], mean_order: int, device: torch.device) -> dict[str, int]:
    g = torch.Generator(device=device).manual_seed(case["n"] * 7 + case["rows"])
    x = torch.randn(case["rows"], case["n"], device=device, generator=g) * case["scale"] + case["offset"]
    if case["bf16_input"]:
        x = x.bfloat16()
    w = torch.randn(case["n"], device=device, generator=g) if case["affine"] != "none" else None
    b = torch.randn(case["n"], device=device, generator=g) if case["affine"] == "both" else None
    ref_out, ref_mean, ref_rstd = torch.native_layer_norm(x.float(), [case["n"]], w, b, case["eps"])
    out, stats = layer_norm(x, case["eps"], w, b, stats=True, mean_order=mean_order)
    rows_bad = lambda a, r: int((a.view(torch.int32) != r.view(torch.int32)).reshape(a.shape[0], -1).any(1).sum())
    result = {"out": rows_bad(out, ref_out), "mean": rows_bad(stats[:, :1].contiguous(), ref_mean.reshape(-1, 1)),
              "rstd": rows_bad(stats[:, 1:].contiguous(), ref_rstd.reshape(-1, 1))}
    if device.type == "cpu":  # the interpreter against the step-by-step reference
        ref = reference_layer_norm(x, case["eps"], w, b, mean_order=mean_order)
        result["reference"] = rows_bad(out, ref)
    return result


def rms_cases(smoke: bool) -> list[dict[str, Any]]:
    out = []
    for n in WIDTHS[:5] if smoke else WIDTHS:
        for dtype in ("bfloat16", "float32"):
            for weight in (False, True):
                out.append({"rows": 8 if smoke else 512, "n": n, "dtype": dtype, "weight": weight})
    if not smoke:
        out += [{"rows": rows, "n": 1536, "dtype": "bfloat16", "weight": True, "label": label}
                for label, rows in ROWS.items()]
    return out


def check_rms(case: dict[str, Any], device: torch.device) -> int:
    g = torch.Generator(device=device).manual_seed(case["n"] * 3 + case["rows"])
    dtype = getattr(torch, case["dtype"])
    x = (torch.randn(case["rows"], case["n"], device=device, generator=g) * 3).to(dtype)
    w = torch.randn(case["n"], device=device, generator=g).to(dtype) if case["weight"] else None
    out = rms_norm(x, 1e-6, w)[0]
    ref = F.rms_norm(x, (case["n"],), w, 1e-6) if device.type == "cuda" else reference_rms_norm(x, 1e-6, w)
    return int((out.view(torch.uint8) != ref.view(torch.uint8)).reshape(out.shape[0], -1).any(1).sum())


def eager_modulate(x: torch.Tensor, table: torch.Tensor, temb: torch.Tensor, eps: float) -> torch.Tensor:
    shift, scale = (table + temb.float()).chunk(6, dim=1)[:2]  # Wan: [1, 6, C] table + [B, 6, C] temb
    return (F.layer_norm(x.float(), (x.shape[-1],), eps=eps) * (1 + scale) + shift).type_as(x)


def median_ms(fn: Callable[[], Any], device: torch.device, iters: int = 50) -> float:
    if device.type != "cuda":
        return float("nan")
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def adaln_part(label: str, rows: int, mean_order: int, device: torch.device) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(rows)
    x = (torch.randn(1, rows, 1536, device=device, generator=g) * 4).bfloat16()
    table = torch.randn(1, 6, 1536, device=device, generator=g) / 1536 ** 0.5
    temb = torch.randn(1, 6, 1536, device=device, generator=g)
    eps = 1e-6
    ref = eager_modulate(x, table, temb, eps)
    fused = layer_norm_modulate(x, eps, table[0], temb, 0, 1, out_dtype=torch.bfloat16, mean_order=mean_order)
    equal = bool(torch.equal(ref.view(torch.int16), fused.view(torch.int16)))
    two = lambda: modulate(F.layer_norm(x.float(), (1536,), eps=eps), table[0], temb, 0, 1, out_dtype=x.dtype)[0]
    return {"label": label, "rows": rows, "bitwise": equal,
            "ms": {"eager": median_ms(lambda: eager_modulate(x, table, temb, eps), device),
                   "layer_norm + modulate kernel": median_ms(two, device),
                   "fused": median_ms(lambda: layer_norm_modulate(x, eps, table[0], temb, 0, 1,
                                                                  out_dtype=torch.bfloat16,
                                                                  mean_order=mean_order), device)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--orders", default="0,1,2", help="the mean-merge contraction orders to check (0 is the default)")
    args = p.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    data: dict[str, Any] = {"provenance": provenance(device), "exactness": {}, "adaln": []}
    for mean_order in (int(o) for o in args.orders.split(",")):
        rows = []
        for case in cases(args.smoke):
            rows.append({**case, **check(case, mean_order, device)})
        data["exactness"][mean_order] = rows
    best = min(data["exactness"], key=lambda m: sum(r["out"] + r["mean"] + r["rstd"] for r in data["exactness"][m]))
    labels = {"W17": 3600, "W81": 32760} if not args.smoke else {"smoke": 16}
    data["adaln"] = [adaln_part(label, rows, best, device) for label, rows in labels.items()]
    data["rms"] = [{**case, "rows_differing": check_rms(case, device)} for case in rms_cases(args.smoke)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "layer_norm_exact.json").write_text(json.dumps(data, indent=2, default=str))
    print("| mean_order | cases | rows checked | rows differing (out / mean / rstd) | cases all equal |")
    print("|---|---|---|---|---|")
    for m, rows in data["exactness"].items():
        bad = [sum(r[k] for r in rows) for k in ("out", "mean", "rstd")]
        ok = sum(1 for r in rows if r["out"] == r["mean"] == r["rstd"] == 0)
        print(f"| {m} | {len(rows)} | {sum(r['rows'] for r in rows)} | {bad[0]} / {bad[1]} / {bad[2]} | {ok} |"
              + (f" rows differing from the step-by-step reference: {sum(r['reference'] for r in rows)}"
                 if "reference" in rows[0] else ""))
        for r in rows:
            if r["out"] or r["mean"] or r["rstd"]:
                print(f"    differs: n={r['n']} rows={r['rows']} scale={r['scale']} offset={r['offset']} "
                      f"affine={r['affine']} bf16={r['bf16_input']}: {r['out']}/{r['mean']}/{r['rstd']}")
                break
    rms = data["rms"]
    print(f"\nRMSNorm: {len(rms)} cases, {sum(c['rows'] for c in rms)} rows, rows differing from "
          f"{'F.rms_norm' if device.type == 'cuda' else 'the reference'}: {sum(c['rows_differing'] for c in rms)}; "
          f"cases all equal: {sum(1 for c in rms if c['rows_differing'] == 0)}")
    print(f"\nAdaLN form (mean_order {best}):")
    for a in data["adaln"]:
        ms = ", ".join(f"{k} {v:.4f} ms" for k, v in a["ms"].items())
        print(f"  {a['label']} rows {a['rows']}: bitwise {a['bitwise']}; {ms}")


if __name__ == "__main__":
    main()
