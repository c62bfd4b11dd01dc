"""H200 timing of the Gluon int8 ``wgmma`` GEMMs (W8A8, W4A8) against bf16, FP8, ``torch._int_mm`` and Triton.

For the Wan 2.1 1.3B FFN shapes at W81 (M = 32,760 tokens; K -> N = 1536 -> 8960 and 8960 -> 1536), one process:

1. ``smoke``: every Gluon variant (W8A8; W4A8 with each unpacking; low-rank + bias) at a small ragged shape against
   its torch reference (bitwise without the low-rank term, else a stated tolerance);
2. ``sweep``: Gluon tiles (block sizes, ring stages, warps, unpacking, epilogue) at both shapes, GEMM alone (no
   low-rank, no bias); the fastest per kernel and shape is kept;
3. ``table``: GEMM-only times of bf16 ``F.linear``, FP8 ``torch._scaled_mm`` (rowwise scales, fast accumulation),
   ``torch._int_mm`` (int8 -> int32), the Triton per-channel W4A8 GEMM (best of a few fixed tiles), the Gluon W8A8
   and W4A8 GEMMs at their best tiles, and the Gluon W4A8 GEMM with the fused rank-32 low-rank term and bias;
   each checked against its reference on 376 rows (the first 256 and the last 120, which include the ragged tail);
4. ``persistent``: the persistent, warp-specialised W4A8 GEMM (:mod:`...w4a8_gluon_persistent`): a sweep of its
   tiles (GEMM alone), then rows at the best tile alone and with the rank-32 low-rank term and bias, checked.

5. ``pingpong``: the ping-pong W4A8 GEMM (:mod:`...w4a8_gluon_pingpong`; compiled offline, first GPU run here):
   smoke-checked at small ragged shapes, then timed (GEMM alone and with the rank-32 low-rank term and bias) at its
   tiles beside the persistent kernel's default tile.

6. ``linear`` (with ``--kernels pingpong``): the whole Linear as the ``svdquant`` plugin runs it -- per-token INT8
   quantization of the bf16 input with smoothing, the rank-32 low-rank down projection, the W4A8 GEMM with the
   low-rank up term and bias -- beside bf16 ``F.linear(x, w, bias)``: the quantizer alone, quantizer + low-rank in
   one kernel, then each GEMM after it (persistent at its default tile, ping-pong at its fastest low-rank tile) and
   ``svdquant_linear(backend="w4a8")`` itself (what the plugin calls). Operands are random (speed only; the
   numerics are checked above and in the test suite).

``--kernels persistent`` runs only the bf16 / FP8 baselines and section 4 (a short device call);
``--kernels pingpong`` only the baselines, the ping-pong smoke checks and section 5 (with the persistent rows).

Timing: CUDA events around each launch, median of ``--reps`` (>= 20) after ``--warmup`` launches; the L2 cache is
*not* flushed between launches (weights of these shapes fit the 50 MB L2; activations and outputs do not).
Writes ``<out>/w4a8_gluon.json`` after every section (default ``./bench_out``, or ``$OUT``) and prints a table.

Usage::

    python benchmarks/kernels/w4a8_gluon.py --out "$OUT"            # H200, about 1-2 minutes
    python benchmarks/kernels/w4a8_gluon.py --smoke-only            # compile + correctness only
    python benchmarks/kernels/w4a8_gluon.py --kernels persistent    # the persistent kernel and baselines only
    python benchmarks/kernels/w4a8_gluon.py --kernels pingpong      # ping-pong vs persistent, bf16, FP8
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from cuda_timing import time_ms

from worldfoundry.core.acceleration.kernels.int8_act_quant import triton_quantize_rows_int8
from worldfoundry.core.acceleration.kernels.int8_quant_lowrank import triton_quantize_rows_int8_lowrank
from worldfoundry.core.acceleration.kernels.svdquant_dispatch import svdquant_linear
from worldfoundry.core.acceleration.kernels.w4a8_channel_gemm import CHANNEL_CONFIGS
from worldfoundry.core.acceleration.kernels.w4a8_gemm import triton_w4a8_gemm
from worldfoundry.core.acceleration.kernels.w4a8_gluon_gemm import (
    GluonTile,
    gemm_reference,
    gluon_w4a8_gemm,
    gluon_w8a8_gemm,
    w4a8_reference,
)
from worldfoundry.core.acceleration.kernels.w4a8_gluon_persistent import (
    DEFAULT_PERSISTENT_TILE,
    PersistentTile,
    gluon_w4a8_persistent_gemm,
)
from worldfoundry.core.acceleration.kernels.w4a8_gluon_pingpong import PingPongTile, gluon_w4a8_pingpong_gemm
from worldfoundry.core.acceleration.quantization.int4_packing import quantize_int4_groupwise
from worldfoundry.core.acceleration.quantization.svdquant_numerics import SVDQuantWeight, int4_gemm_reference

M_TOKENS = 32760
SHAPES = ((1536, 8960), (8960, 1536))
RANK = 32
T0 = time.monotonic()
W8A8_SWEEP = [GluonTile(128, 256, 128, 4, 8), GluonTile(128, 256, 64, 5, 8), GluonTile(128, 128, 128, 3, 8),
              GluonTile(128, 128, 128, 4, 8), GluonTile(256, 128, 128, 3, 8), GluonTile(128, 128, 128, 4, 4),
              GluonTile(128, 256, 128, 4, 8, epi_tma=False), GluonTile(128, 128, 256, 2, 8),
              GluonTile(128, 128, 64, 6, 8)]
W4A8_SWEEP = [GluonTile(128, 256, 128, 3, 8), GluonTile(128, 128, 128, 3, 8), GluonTile(128, 256, 64, 4, 8),
              GluonTile(256, 128, 128, 3, 8), GluonTile(128, 128, 128, 3, 8, unpack=1),
              GluonTile(128, 128, 128, 3, 8, unpack=0), GluonTile(128, 128, 128, 4, 4),
              GluonTile(128, 256, 128, 3, 8, epi_tma=False), GluonTile(128, 128, 128, 3, 8, pack_vec=16),
              GluonTile(128, 128, 256, 2, 8), GluonTile(128, 128, 64, 5, 8)]
PERSISTENT_SWEEP = [PersistentTile(128, 256, 64, 8, 8, group_t=1), PersistentTile(128, 256, 64, 8, 8, group_t=8),
                    PersistentTile(128, 256, 64, 6, 8, group_t=2), PersistentTile(128, 256, 128, 4, 8, group_t=1),
                    PersistentTile(256, 128, 64, 8, 8, group_t=1), PersistentTile(64, 256, 64, 8, 4, group_t=1),
                    PersistentTile(128, 256, 64, 8, 8, group_t=1, unpack=0)]
PINGPONG_SWEEP = [PingPongTile(), PingPongTile(128, 128, 64, 6, group_t=1), PingPongTile(128, 128, 64, 6, group_t=8),
                  PingPongTile(64, 256, 64, 4), PingPongTile(64, 128, 128, 4), PingPongTile(128, 128, 64, 6, unpack=0),
                  PingPongTile(turns=False), PingPongTile(64, 256, 64, 4, turns=False),
                  PingPongTile(128, 128, 64, 6, group_t=1, turns=False)]


def quantize_rows(x: torch.Tensor, qmax: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row codes and float32 scales ``[rows, 1]`` (int8: rounded; fp8: cast)."""
    amax = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-6)
    scale = amax / qmax
    y = x.float() / scale
    codes = torch.round(y).clamp(-qmax, qmax).to(dtype) if dtype == torch.int8 else y.to(dtype)
    return codes, scale


def make_operands(m: int, k: int, n: int, seed: int = 0) -> dict[str, Any]:
    """Random bf16 activations / weights and every quantized form the kernels take."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    q, s = quantize_rows(x, 127.0, torch.int8)
    w8, ws8 = quantize_rows(w, 127.0, torch.int8)
    packed, scales4 = quantize_int4_groupwise(w, 0)
    t = (torch.randn(m, RANK, device="cuda", generator=g)).to(torch.bfloat16)
    up = (torch.randn(n, RANK, device="cuda", generator=g) / RANK**0.5).to(torch.bfloat16)
    return {"x": x, "w": w, "q": q, "s": s, "w8": w8, "ws8": ws8.reshape(-1).contiguous(),
            "w4": SVDQuantWeight(packed, scales4, 0), "w4lr": SVDQuantWeight(packed, scales4, 0, lora_up=up),
            "t": t, "up": up, "bias": torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)}


def check_rows(m: int) -> torch.Tensor:
    """Rows compared with the references: the first 256 and the last 120 (ragged last tile)."""
    return torch.cat([torch.arange(0, min(256, m)), torch.arange(max(256, m - 120), m)]).cuda()


def compare(out: torch.Tensor, ref: torch.Tensor, bitwise: bool) -> dict[str, Any]:
    """Bitwise equality with ``bf16(ref)`` or the largest difference relative to ``max|ref|``."""
    diff = (out.float() - ref.to(out.dtype).float()).abs()
    rel = float(diff.max() / ref.abs().max().clamp_min(1e-30))
    result = {"mismatches": int((diff != 0).sum()), "max_rel_diff": rel}
    result["ok"] = result["mismatches"] == 0 if bitwise else rel <= 2.0**-7
    result["check"] = "bitwise bf16(ref)" if bitwise else "max|diff| <= 2**-7 max|ref|"
    return result


def gluon_checks(o: dict[str, Any], rows: torch.Tensor, tile8: GluonTile, tile4: GluonTile) -> dict[str, Any]:
    """The Gluon kernels against their references on ``rows``."""
    q, s = o["q"], o["s"]
    sub = q[rows], s[rows]
    out = {}
    ref8 = gemm_reference(*sub, o["w8"], o["ws8"])
    out["gluon_w8a8"] = compare(gluon_w8a8_gemm(q, s, o["w8"], o["ws8"], tile=tile8)[rows], ref8, True)
    ref4 = int4_gemm_reference(*sub, o["w4"])
    out["gluon_w4a8"] = compare(gluon_w4a8_gemm(q, s, o["w4"], tile=tile4)[rows], ref4, True)
    ref4lr = w4a8_reference(*sub, o["w4lr"], o["t"][rows], o["bias"])
    got = gluon_w4a8_gemm(q, s, o["w4lr"], o["t"], o["bias"], tile=tile4)[rows]
    out["gluon_w4a8_lowrank_bias"] = compare(got, ref4lr, False)
    ref8lr = gemm_reference(*sub, o["w8"], o["ws8"], o["t"][rows], o["up"], o["bias"])
    got = gluon_w8a8_gemm(q, s, o["w8"], o["ws8"], t=o["t"], lora_up=o["up"], bias=o["bias"], tile=tile8)[rows]
    out["gluon_w8a8_lowrank_bias"] = compare(got, ref8lr, False)
    return out


def smoke(report: dict[str, Any]) -> None:
    """Every Gluon variant at a small ragged shape (M = 1000, K = 512, N = 384)."""
    o = make_operands(1000, 512, 384, seed=1)
    rows = torch.arange(1000).cuda()
    variants = {"u2_128x128": GluonTile(128, 128, 128, 3, 8),
                "u1_64x128_w4_plainstore": GluonTile(64, 128, 64, 3, 4, unpack=1, epi_tma=False),
                "u0_128x256_vec16": GluonTile(128, 256, 128, 3, 8, unpack=0, pack_vec=16)}
    for name, tile in variants.items():
        try:
            report["smoke"][name] = gluon_checks(o, rows, tile, tile)
        except Exception as e:  # noqa: BLE001 - recorded, the run continues
            report["smoke"][name] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
        print(f"smoke {name} ({time.monotonic() - T0:.0f} s)", json.dumps(report["smoke"][name]), flush=True)


def sweep(o: dict[str, Any], args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """Time every tile of both Gluon kernels (GEMM alone); errors and skipped tiles are recorded."""
    q, s = o["q"], o["s"]
    kernels = {"gluon_w8a8": (W8A8_SWEEP, lambda c: gluon_w8a8_gemm(q, s, o["w8"], o["ws8"], tile=c)),
               "gluon_w4a8": (W4A8_SWEEP, lambda c: gluon_w4a8_gemm(q, s, o["w4"], tile=c))}
    result: dict[str, Any] = {}
    for name, (tiles, run) in kernels.items():
        rows = []
        for tile in tiles:
            row: dict[str, Any] = {"tile": tile.to_json()}
            if time.monotonic() > deadline:
                row["skipped"] = "time budget"
            else:
                try:
                    row["ms"] = time_ms(lambda t=tile: run(t), args.warmup, args.reps)
                except Exception as e:  # noqa: BLE001 - a tile that fails to compile or launch is recorded
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
        timed = [r for r in rows if "ms" in r]
        best = min(timed, key=lambda r: r["ms"]) if timed else None
        result[name] = {"tiles": rows, "best": best}
    return result


def baselines(o: dict[str, Any], args: argparse.Namespace) -> dict[str, Callable[[], Any]]:
    """The non-Gluon launches of the table (operands prepared outside the timed region)."""
    x, w = o["x"], o["w"]
    xf8, sxf8 = quantize_rows(x, 448.0, torch.float8_e4m3fn)
    wf8, swf8 = quantize_rows(w, 448.0, torch.float8_e4m3fn)
    w8t = o["w8"].t()
    swf8t = swf8.reshape(1, -1).contiguous()
    o.update(xf8=xf8, sxf8=sxf8, wf8=wf8, swf8=swf8t)
    return {
        "bf16_linear": lambda: F.linear(x, w),
        "fp8_scaled_mm_rowwise": lambda: torch._scaled_mm(xf8, wf8.t(), scale_a=sxf8, scale_b=swf8t,
                                                          out_dtype=torch.bfloat16, use_fast_accum=True),
        "int_mm_int8_int32": lambda: torch._int_mm(o["q"], w8t),
    }


def baseline_checks(o: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    """bf16 / FP8 against float32 products of the same operands; ``_int_mm`` bitwise against float64."""
    x, w = o["x"][rows], o["w"]
    out = {"bf16_linear": compare(F.linear(o["x"], w)[rows], x.float() @ w.float().t(), False)}
    fp8 = torch._scaled_mm(o["xf8"], o["wf8"].t(), scale_a=o["sxf8"], scale_b=o["swf8"], out_dtype=torch.bfloat16,
                           use_fast_accum=True)[rows]
    ref = (o["xf8"][rows].float() * o["sxf8"][rows]) @ (o["wf8"].float() * o["swf8"].reshape(-1, 1)).t()
    out["fp8_scaled_mm_rowwise"] = compare(fp8, ref, False)
    exact = (o["q"][rows].double() @ o["w8"].double().t())
    got = torch._int_mm(o["q"], o["w8"].t())[rows].double()
    out["int_mm_int8_int32"] = {"mismatches": int((got != exact).sum()), "check": "int32 exact vs float64",
                                "ok": bool((got == exact).all())}
    return out


def triton_channel(o: dict[str, Any], rows: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """The existing Triton per-channel W4A8 GEMM: best of its first tiles, checked bitwise."""
    q, s = o["q"], o["s"]
    timed = []
    for cfg in CHANNEL_CONFIGS[:2]:
        try:
            timed.append((time_ms(lambda c=cfg: triton_w4a8_gemm(q, s, o["w4"], None, None, config=c),
                                  args.warmup, args.reps), cfg))
        except Exception as e:  # noqa: BLE001
            print("triton tile failed", cfg, type(e).__name__, str(e)[:200], flush=True)
    ms, cfg = min(timed, key=lambda r: r[0])
    got = triton_w4a8_gemm(q, s, o["w4"], None, None, config=cfg)[rows]
    check = compare(got, int4_gemm_reference(q[rows], s[rows], o["w4"]), True)
    return {"ms": ms, "config": cfg, "correct": check, "tiles_timed": len(timed)}


def guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()``, or ``{"error": ...}`` when it raises (the run goes on)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - recorded in the JSON
        print("error:", type(e).__name__, str(e)[:500], flush=True)
        return {"error": f"{type(e).__name__}: {str(e)[:1500]}"}


def baseline_rows(o: dict[str, Any], rows: torch.Tensor, args: argparse.Namespace, with_triton: bool = True
                  ) -> dict[str, Any]:
    """bf16, FP8, ``_int_mm`` and (``with_triton``) the Triton per-channel GEMM rows of one shape."""
    fns = baselines(o, args)
    checks = guarded(lambda: baseline_checks(o, rows))
    out = {}
    for name, fn in fns.items():
        out[name] = guarded(lambda f=fn: {"ms": time_ms(f, args.warmup, args.reps)})
        out[name]["correct"] = checks.get(name, checks)
    if with_triton:
        out["triton_w4a8_channel"] = guarded(lambda: triton_channel(o, rows, args))
    return out


def gluon_rows(o: dict[str, Any], rows: torch.Tensor, best: dict[str, GluonTile], args: argparse.Namespace
               ) -> dict[str, Any]:
    """The Gluon rows at the best tiles of the sweep, with their checks."""
    tile8, tile4 = best.get("gluon_w8a8", W8A8_SWEEP[0]), best.get("gluon_w4a8", W4A8_SWEEP[0])
    gchecks = guarded(lambda: gluon_checks(o, rows, tile8, tile4))
    q, s = o["q"], o["s"]
    gl_fns = {"gluon_w8a8": (tile8, lambda: gluon_w8a8_gemm(q, s, o["w8"], o["ws8"], tile=tile8)),
              "gluon_w4a8": (tile4, lambda: gluon_w4a8_gemm(q, s, o["w4"], tile=tile4)),
              "gluon_w4a8_lowrank_bias": (tile4, lambda: gluon_w4a8_gemm(q, s, o["w4lr"], o["t"], o["bias"],
                                                                         tile=tile4))}
    out = {}
    for name, (tile, fn) in gl_fns.items():
        out[name] = guarded(lambda f=fn: {"ms": time_ms(f, args.warmup, args.reps)})
        out[name].update(tile=tile.to_json(), correct=gchecks.get(name, gchecks))
    return out


def persistent_checks(o: dict[str, Any], rows: torch.Tensor, tile: PersistentTile, lr_tile: PersistentTile
                      ) -> dict[str, Any]:
    """The persistent W4A8 GEMM against its references on ``rows`` (bitwise alone; tolerance with low-rank + bias)."""
    q, s = o["q"], o["s"]
    out = {"gluon_w4a8_persistent": compare(gluon_w4a8_persistent_gemm(q, s, o["w4"], tile=tile)[rows],
                                            int4_gemm_reference(q[rows], s[rows], o["w4"]), True)}
    ref = w4a8_reference(q[rows], s[rows], o["w4lr"], o["t"][rows], o["bias"])
    got = gluon_w4a8_persistent_gemm(q, s, o["w4lr"], o["t"], o["bias"], tile=lr_tile)[rows]
    out["gluon_w4a8_persistent_lowrank_bias"] = compare(got, ref, False)
    return out


def persistent_smoke(report: dict[str, Any]) -> None:
    """The persistent kernel at small ragged shapes (odd and even K-step counts), every sweep tile."""
    for m, k, n in ((1000, 512, 384), (77, 384, 136)):
        o = make_operands(m, k, n, seed=2)
        rows = torch.arange(m).cuda()
        for tile in PERSISTENT_SWEEP:
            name = f"persistent_{m}x{k}x{n}_" + "_".join(str(v) for v in tile.to_json().values())
            report["smoke"][name] = guarded(lambda t=tile: persistent_checks(o, rows, t, t))
            print(f"smoke {name} ({time.monotonic() - T0:.0f} s)", json.dumps(report["smoke"][name]), flush=True)


def persistent_rows(o: dict[str, Any], rows: torch.Tensor, args: argparse.Namespace, deadline: float
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Sweep of the persistent tiles (GEMM alone), then its rows alone and with low-rank + bias at the best tiles."""
    q, s = o["q"], o["s"]
    timed = []
    for tile in PERSISTENT_SWEEP:
        row: dict[str, Any] = {"tile": tile.to_json()}
        if time.monotonic() > deadline:
            row["skipped"] = "time budget"
        else:
            row.update(guarded(lambda t=tile: {"ms": time_ms(lambda: gluon_w4a8_persistent_gemm(q, s, o["w4"], tile=t),
                                                             args.warmup, args.reps)}))
        timed.append(row)
    ok = sorted((r for r in timed if "ms" in r), key=lambda r: r["ms"])
    if not ok:
        return {}, {"tiles": timed, "best": None}
    best = PersistentTile(**ok[0]["tile"])
    lr_tiles = [PersistentTile(**r["tile"]) for r in ok[:3]]
    lr_times = [(time_ms(lambda t=t: gluon_w4a8_persistent_gemm(q, s, o["w4lr"], o["t"], o["bias"], tile=t),
                         args.warmup, args.reps), t) for t in lr_tiles]
    lr_ms, lr_tile = min(lr_times, key=lambda r: r[0]) if lr_times else (None, PERSISTENT_SWEEP[0])
    checks = guarded(lambda: persistent_checks(o, rows, best, lr_tile))
    out = {"gluon_w4a8_persistent": {"ms": ok[0]["ms"], "tile": best.to_json(),
                                     "correct": checks.get("gluon_w4a8_persistent", checks)},
           "gluon_w4a8_persistent_lowrank_bias": {"ms": lr_ms, "tile": lr_tile.to_json(),
                                                  "lowrank_tiles_timed": [[ms, t.to_json()] for ms, t in lr_times],
                                                  "correct": checks.get("gluon_w4a8_persistent_lowrank_bias", checks)}}
    return out, {"tiles": timed, "best": ok[0]}


def pingpong_smoke(report: dict[str, Any]) -> None:
    """The ping-pong kernel at small ragged shapes (odd and even K-step counts), every sweep tile, both checks."""
    for m, k, n in ((1000, 512, 384), (77, 384, 136), (129, 1536, 24)):
        o = make_operands(m, k, n, seed=3)
        rows = torch.arange(m).cuda()
        for tile in PINGPONG_SWEEP:
            name = f"pingpong_{m}x{k}x{n}_" + "_".join(str(v) for v in tile.to_json().values())
            report["smoke"][name] = guarded(lambda t=tile: pingpong_checks(o, rows, t))
            print(f"smoke {name} ({time.monotonic() - T0:.0f} s)", json.dumps(report["smoke"][name]), flush=True)


def pingpong_checks(o: dict[str, Any], rows: torch.Tensor, tile: PingPongTile) -> dict[str, Any]:
    """The ping-pong W4A8 GEMM against its references on ``rows`` (bitwise alone; tolerance with low-rank + bias)."""
    q, s = o["q"], o["s"]
    out = {"gluon_w4a8_pingpong": compare(gluon_w4a8_pingpong_gemm(q, s, o["w4"], tile=tile)[rows],
                                          int4_gemm_reference(q[rows], s[rows], o["w4"]), True)}
    ref = w4a8_reference(q[rows], s[rows], o["w4lr"], o["t"][rows], o["bias"])
    got = gluon_w4a8_pingpong_gemm(q, s, o["w4lr"], o["t"], o["bias"], tile=tile)[rows]
    out["gluon_w4a8_pingpong_lowrank_bias"] = compare(got, ref, False)
    return out


def pingpong_rows(o: dict[str, Any], rows: torch.Tensor, args: argparse.Namespace, deadline: float
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each ping-pong tile timed alone and with low-rank + bias; rows at the fastest of each, checked."""
    q, s = o["q"], o["s"]
    timed = []
    for tile in PINGPONG_SWEEP:
        row: dict[str, Any] = {"tile": tile.to_json()}
        if time.monotonic() > deadline:
            row["skipped"] = "time budget"
        else:
            row.update(guarded(lambda t=tile: {
                "ms": time_ms(lambda: gluon_w4a8_pingpong_gemm(q, s, o["w4"], tile=t), args.warmup, args.reps),
                "lowrank_bias_ms": time_ms(lambda: gluon_w4a8_pingpong_gemm(q, s, o["w4lr"], o["t"], o["bias"],
                                                                            tile=t), args.warmup, args.reps)}))
        timed.append(row)
    ok = [r for r in timed if "ms" in r]
    if not ok:
        return {}, {"tiles": timed, "best": None}
    best = min(ok, key=lambda r: r["ms"])
    best_lr = min(ok, key=lambda r: r["lowrank_bias_ms"])
    checks = guarded(lambda: {**pingpong_checks(o, rows, PingPongTile(**best["tile"])),
                              "lr": pingpong_checks(o, rows, PingPongTile(**best_lr["tile"]))})
    out = {"gluon_w4a8_pingpong": {"ms": best["ms"], "tile": best["tile"],
                                   "correct": checks.get("gluon_w4a8_pingpong", checks)},
           "gluon_w4a8_pingpong_lowrank_bias": {
               "ms": best_lr["lowrank_bias_ms"], "tile": best_lr["tile"],
               "correct": checks.get("lr", {}).get("gluon_w4a8_pingpong_lowrank_bias", checks)}}
    return out, {"tiles": timed, "best": best}


def persistent_default_rows(o: dict[str, Any], rows: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """The persistent kernel at its default tile, alone and with low-rank + bias (the ping-pong comparison)."""
    q, s, tile = o["q"], o["s"], DEFAULT_PERSISTENT_TILE
    checks = guarded(lambda: persistent_checks(o, rows, tile, tile))
    out = {}
    for name, fn in (("gluon_w4a8_persistent", lambda: gluon_w4a8_persistent_gemm(q, s, o["w4"], tile=tile)),
                     ("gluon_w4a8_persistent_lowrank_bias",
                      lambda: gluon_w4a8_persistent_gemm(q, s, o["w4lr"], o["t"], o["bias"], tile=tile))):
        out[name] = guarded(lambda f=fn: {"ms": time_ms(f, args.warmup, args.reps)})
        out[name].update(tile=tile.to_json(), correct=checks.get(name, checks))
    return out


def linear_rows(o: dict[str, Any], args: argparse.Namespace, pingpong_tile: dict[str, Any] | None
                ) -> dict[str, Any]:
    """The whole W4A8 Linear (quantizer, low-rank down, GEMM with up term and bias) against bf16 with bias."""
    x, k = o["x"], o["x"].shape[1]
    g = torch.Generator(device="cuda").manual_seed(5)
    inv = (torch.rand(k, device="cuda", generator=g) + 0.5).float()
    down = (torch.randn(RANK, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    w = SVDQuantWeight(o["w4lr"].qweight, o["w4lr"].scales, 0, inv_smooth=inv, lora_down=down,
                       lora_up=o["up"])
    qlr = lambda: triton_quantize_rows_int8_lowrank(x, inv, down)  # noqa: E731
    tile = PingPongTile(**pingpong_tile) if pingpong_tile else PingPongTile()

    def persistent() -> torch.Tensor:
        q, s, t = qlr()
        return gluon_w4a8_persistent_gemm(q, s, w, t, o["bias"])

    def pingpong() -> torch.Tensor:
        q, s, t = qlr()
        return gluon_w4a8_pingpong_gemm(q, s, w, t, o["bias"], tile=tile)

    fns = {"bf16_linear_bias": lambda: F.linear(x, o["w"], o["bias"]),
           "int8_quant": lambda: triton_quantize_rows_int8(x, inv),
           "int8_quant_lowrank_down": qlr,
           "linear_quant_lowrank_persistent": persistent,
           "linear_quant_lowrank_pingpong": pingpong,
           "svdquant_linear_w4a8_dispatch": lambda: svdquant_linear(x, w, o["bias"], backend="w4a8",
                                                                    fused_lowrank=True)[0]}
    out = {name: guarded(lambda f=fn: {"ms": time_ms(f, args.warmup, args.reps)}) for name, fn in fns.items()}
    out["linear_quant_lowrank_pingpong"]["tile"] = tile.to_json()
    ref = out["bf16_linear_bias"].get("ms")
    for row in out.values():
        if ref and row.get("ms"):
            row["speedup_vs_bf16_linear_bias"] = ref / row["ms"]
    return out


def shape_section(k: int, n: int, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """Baselines, Gluon sweep, then the Gluon rows with correctness, for one ``K -> N``."""
    o = make_operands(M_TOKENS, k, n)
    rows = check_rows(M_TOKENS)
    section: dict[str, Any] = {"M": M_TOKENS, "K": k, "N": n}
    persistent_only = args.kernels == "persistent"
    section["rows"] = baseline_rows(o, rows, args, with_triton=args.kernels == "all")
    print(f"{k}->{n}: baselines done at {time.monotonic() - T0:.0f} s", flush=True)
    section["sweep"] = {}
    if args.kernels == "pingpong":
        section["rows"].update(persistent_default_rows(o, rows, args))
        prow, section["sweep"]["gluon_w4a8_pingpong"] = pingpong_rows(o, rows, args, deadline)
        section["rows"].update(prow)
        print(f"{k}->{n}: ping-pong done at {time.monotonic() - T0:.0f} s", flush=True)
        best_lr = prow.get("gluon_w4a8_pingpong_lowrank_bias", {}).get("tile")
        section["linear"] = guarded(lambda: linear_rows(o, args, best_lr))
        print(f"{k}->{n}: linear", json.dumps(section["linear"]), flush=True)
        return _with_speedups(section)
    if not persistent_only:
        section["sweep"] = sweep(o, args, deadline)
        print(f"{k}->{n}: sweep done at {time.monotonic() - T0:.0f} s", flush=True)
        best = {name: GluonTile(**entry["best"]["tile"]) for name, entry in section["sweep"].items() if entry["best"]}
        section["rows"].update(gluon_rows(o, rows, best, args))
    prow, section["sweep"]["gluon_w4a8_persistent"] = persistent_rows(o, rows, args, deadline)
    section["rows"].update(prow)
    print(f"{k}->{n}: persistent done at {time.monotonic() - T0:.0f} s", flush=True)
    return _with_speedups(section)


def _with_speedups(section: dict[str, Any]) -> dict[str, Any]:
    """``section`` with ``speedup_vs_bf16`` on every timed row."""
    bf16 = section["rows"]["bf16_linear"].get("ms")
    for row in section["rows"].values():
        if bf16 and row.get("ms"):
            row["speedup_vs_bf16"] = bf16 / row["ms"]
    return section


def print_table(report: dict[str, Any]) -> None:
    """One line per kernel and shape."""
    print(f"{'shape':>12} {'kernel':<36} {'ms':>8} {'x bf16':>7} ok  tile/config")
    for key, section in report["shapes"].items():
        for name, row in section.get("rows", {}).items():
            ok = row.get("correct", {}).get("ok")
            cfg = row.get("tile") or row.get("config") or ""
            if not row.get("ms"):
                print(f"{key:>12} {name:<36} {row.get('error', '?')[:80]}")
                continue
            print(f"{key:>12} {name:<36} {row['ms']:8.3f} {row.get('speedup_vs_bf16', 0):7.2f} {ok!s:<3} {cfg}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "./bench_out"))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--budget", type=float, default=110.0, help="seconds after which the sweep skips tiles")
    parser.add_argument("--smoke-only", action="store_true")
    parser.add_argument("--kernels", choices=("all", "persistent", "pingpong"), default="all",
                        help="'persistent': only the persistent W4A8 kernel (smoke, sweep, rows) and the baselines; "
                             "'pingpong': the ping-pong kernel (smoke, tiles, rows), the persistent default tile and "
                             "the bf16 / FP8 / int_mm baselines")
    args = parser.parse_args()
    args.reps = max(args.reps, 20)
    deadline = time.monotonic() + args.budget
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "timing": f"CUDA events, median of {args.reps} after {args.warmup} warm-up, L2 not "
                                        "flushed", "smoke": {}, "shapes": {}, "errors": {}}
    try:
        import triton
        report["triton"] = triton.__version__
    except ImportError:
        pass

    def save() -> None:
        (out / "w4a8_gluon.json").write_text(json.dumps(report, indent=1, default=str))

    if args.kernels == "all":
        smoke(report)
    if args.kernels == "pingpong":
        pingpong_smoke(report)
    else:
        persistent_smoke(report)
    save()
    start = time.monotonic()
    for i, (k, n) in enumerate([] if args.smoke_only else SHAPES):
        key = f"{k}->{n}"
        try:  # the first shape's sweep may use half of the budget
            report["shapes"][key] = shape_section(k, n, args, start + (deadline - start) * (i + 1) / len(SHAPES))
        except Exception:  # noqa: BLE001 - recorded; the other shape still runs
            report["errors"][key] = traceback.format_exc()[-3000:]
            print(report["errors"][key], flush=True)
        save()
    print_table(report)
    for key, section in report["shapes"].items():
        for name, entry in section.get("sweep", {}).items():
            for row in entry["tiles"]:
                print(key, name, row.get("ms", row.get("error", row.get("skipped"))), row["tile"])


if __name__ == "__main__":
    main()
