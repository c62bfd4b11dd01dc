"""H200 launch sweep of the W4A8 Linear's input side: per-token INT8 quantization and the low-rank down projection.

At the Wan 2.1 1.3B FFN shapes at W81 (M = 32,760 tokens, K = 1536 and 8960, rank 32, with smoothing), one process
times (CUDA events, median of ``--reps`` after ``--warmup``; L2 not flushed; ``ms`` one synchronised call per
sample, the host's launch latency included, and ``ms_graph`` a CUDA graph of ten calls, the GPU's time alone):

* memory references: ``x.clone()`` (read and write 2 bytes per element) and ``x.to(torch.int8)`` (the quantizer's
  own traffic: read 2, write 1);
* the quantizer alone (:mod:`...int8_act_quant`) at launch shapes around its default, single pass and two passes;
* the low-rank down projection as one bf16 GEMM (``F.linear(x, D)``);
* quantizer + low-rank in one kernel (:mod:`...int8_quant_lowrank`): the two-pass form at several chunkings and
  the single-pass form (rows up to ``SINGLE_PASS_MAX_K``) at several row counts and warps;
* the whole Linear with the fastest input side and the persistent Gluon GEMM (low-rank up term and bias), beside
  bf16 ``F.linear(x, w, bias)``.

Every timed quantizer configuration is checked bitwise against the torch reference (codes and scales) on the
whole tensor. Writes ``<out>/int8_quant_sweep.json`` (``--out``, default ``$OUT`` or ``./bench_out``).

    python benchmarks/kernels/int8_quant_sweep.py --out "$OUT"     # about a minute on an H200
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
from cuda_timing import time_ms, time_ms_graph

from worldfoundry.core.acceleration.kernels.fp8_rowwise_quant import row_pieces
from worldfoundry.core.acceleration.kernels.int8_act_quant import _int8_rows_kernel, triton_quantize_rows_int8
from worldfoundry.core.acceleration.kernels.int8_quant_lowrank import (
    SINGLE_PASS_MAX_K,
    triton_quantize_rows_int8_lowrank,
)
from worldfoundry.core.acceleration.kernels.w4a8_gluon_persistent import gluon_w4a8_persistent_gemm
from worldfoundry.core.acceleration.quantization.int4_packing import quantize_int4_groupwise
from worldfoundry.core.acceleration.quantization.int8_activation import quantize_rows_int8
from worldfoundry.core.acceleration.quantization.svdquant_numerics import SVDQuantWeight

M_TOKENS = 32760
SHAPES = ((1536, 8960), (8960, 1536))
RANK = 32


def quant_launch(x: torch.Tensor, inv: torch.Tensor, meta: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantizer kernel at an explicit launch shape."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    _int8_rows_kernel[(triton.cdiv(m, meta["BLOCK_M"]),)](x, inv, q, s, m, k, x.stride(0), HAS_SMOOTH=True,
                                                         enable_fp_fusion=False, **meta)
    return q, s


def quant_metas(k: int) -> list[dict[str, Any]]:
    """Launch shapes of the quantizer: single pass (rows up to 16K) and two passes."""
    metas = []
    p0, p1, p2 = row_pieces(k)
    for block_m in (1, 2, 4, 8):
        for warps in (2, 4, 8):
            if block_m * (p0 + p1 + p2) <= 32768:
                metas.append({"BLOCK_M": block_m, "BLOCK_K": p0 + p1 + p2, "SINGLE_PASS": True, "P0": p0, "P1": p1,
                              "P2": p2, "num_warps": warps})
    for block_m, block_k, warps in ((4, 1024, 4), (8, 1024, 8), (16, 512, 8), (2, 2048, 4)):
        metas.append({"BLOCK_M": block_m, "BLOCK_K": block_k, "SINGLE_PASS": False, "num_warps": warps})
    return metas


def fused_configs(k: int) -> list[dict[str, Any]]:
    """``triton_quantize_rows_int8_lowrank`` keyword sets: two passes at several chunkings, single pass at <= 4K."""
    out = [{"single_pass": False, "block_m": bm, "block_k": bk, "num_warps": w}
           for bm, bk, w in ((16, 256, 4), (32, 256, 8), (16, 512, 8), (64, 128, 8), (32, 128, 4))]
    if k <= SINGLE_PASS_MAX_K:
        out += [{"single_pass": True, "block_m": bm, "num_warps": w} for bm in (16, 32) for w in (4, 8)]
    return out


def guarded(fn) -> dict[str, Any]:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        return {"error": f"{type(e).__name__}: {str(e)[:400]}"}


def shape_section(k: int, n: int, args: argparse.Namespace) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(k)
    x = torch.randn(M_TOKENS, k, device="cuda", generator=g).to(torch.bfloat16)
    inv = (torch.rand(k, device="cuda", generator=g) + 0.5).float()
    down = (torch.randn(RANK, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    packed, scales = quantize_int4_groupwise(w, 0)
    up = (torch.randn(n, RANK, device="cuda", generator=g) / RANK**0.5).to(torch.bfloat16)
    weight = SVDQuantWeight(packed, scales, 0, inv_smooth=inv, lora_down=down, lora_up=up)
    q_ref, s_ref = quantize_rows_int8(x, inv)
    t_ref = F.linear(x, down).float()

    def timed(fn, check=None) -> dict[str, Any]:
        row: dict[str, Any] = {"ms": time_ms(fn, args.warmup, args.reps),
                               "ms_graph": time_ms_graph(fn, args.warmup, 5, 10)}  # the GPU's time alone
        if check is not None:
            row.update(check(fn()))
        return row

    def codes_ok(out) -> dict[str, Any]:
        ok = torch.equal(out[0], q_ref) and torch.equal(out[1], s_ref)
        if len(out) == 3:
            rel = float((out[2].float() - t_ref).abs().max() / t_ref.abs().max())
            return {"bitwise_codes": ok, "t_max_rel": rel}
        return {"bitwise_codes": ok}

    sec: dict[str, Any] = {"M": M_TOKENS, "K": k, "N": n, "memory": {}, "quant": [], "fused": []}
    sec["memory"]["clone_bf16"] = guarded(lambda: timed(lambda: x.clone()))
    sec["memory"]["to_int8"] = guarded(lambda: timed(lambda: x.to(torch.int8)))
    sec["quant_default"] = guarded(lambda: timed(lambda: triton_quantize_rows_int8(x, inv), codes_ok))
    for meta in quant_metas(k):
        sec["quant"].append({"meta": meta, **guarded(lambda m=meta: timed(lambda: quant_launch(x, inv, m), codes_ok))})
    sec["lowrank_down_bf16_gemm"] = guarded(lambda: timed(lambda: F.linear(x, down)))
    for cfg in fused_configs(k):
        sec["fused"].append({"config": cfg, **guarded(lambda c=cfg: timed(
            lambda: triton_quantize_rows_int8_lowrank(x, inv, down, **c), codes_ok))})
    best_q = min((r for r in sec["quant"] if r.get("bitwise_codes")), key=lambda r: r["ms"], default=None)
    best_f = min((r for r in sec["fused"] if r.get("bitwise_codes")), key=lambda r: r["ms"], default=None)
    sec["best_quant"], sec["best_fused"] = best_q, best_f
    lowrank_ms = sec["lowrank_down_bf16_gemm"].get("ms")
    separate = (best_q["ms"] + lowrank_ms) if best_q and lowrank_ms else None
    sec["input_side_ms"] = {"fused": best_f["ms"] if best_f else None, "quant_plus_bf16_lowrank": separate}

    def linear_fused() -> torch.Tensor:
        q, s, t = triton_quantize_rows_int8_lowrank(x, inv, down, **best_f["config"])
        return gluon_w4a8_persistent_gemm(q, s, weight, t, bias)

    def linear_separate() -> torch.Tensor:
        t = F.linear(x, down)
        q, s = quant_launch(x, inv, best_q["meta"])
        return gluon_w4a8_persistent_gemm(q, s, weight, t, bias)

    sec["linear"] = {"bf16_linear_bias": guarded(lambda: timed(lambda: F.linear(x, w, bias)))}
    if best_f:
        sec["linear"]["w4a8_fused_input"] = guarded(lambda: timed(linear_fused))
    if best_q:
        sec["linear"]["w4a8_separate_input"] = guarded(lambda: timed(linear_separate))
    q, s = quantize_rows_int8(x, inv)
    sec["linear"]["gemm_only"] = guarded(lambda: timed(lambda: gluon_w4a8_persistent_gemm(q, s, weight, t_ref.to(
        torch.bfloat16), bias)))
    ref = sec["linear"]["bf16_linear_bias"].get("ms")
    for row in sec["linear"].values():
        if ref and row.get("ms"):
            row["speedup_vs_bf16"] = ref / row["ms"]
    return sec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "./bench_out"))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "triton": triton.__version__, "shapes": {}, "errors": {}}
    t0 = time.monotonic()
    for k, n in SHAPES:
        key = f"{k}->{n}"
        try:
            report["shapes"][key] = shape_section(k, n, args)
        except Exception:  # noqa: BLE001 - recorded; the other shape still runs
            report["errors"][key] = traceback.format_exc()[-3000:]
        (out / "int8_quant_sweep.json").write_text(json.dumps(report, indent=1, default=str))
        sec = report["shapes"].get(key, {})
        print(f"{key} ({time.monotonic() - t0:.0f} s): memory {json.dumps(sec.get('memory'))}", flush=True)
        print(f"  quant default {sec.get('quant_default')}, best {sec.get('best_quant')}", flush=True)
        print(f"  lowrank {sec.get('lowrank_down_bf16_gemm')}; best fused {sec.get('best_fused')}", flush=True)
        print(f"  input side {sec.get('input_side_ms')}; linear {json.dumps(sec.get('linear'))}", flush=True)
    for key, err in report["errors"].items():
        print(key, err)


if __name__ == "__main__":
    main()
