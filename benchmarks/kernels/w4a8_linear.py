"""H200: the whole W4A8 Linear as ``svdquant`` runs it, against bf16 ``F.linear`` with bias, interleaved.

The per-Linear goal of ``svdquant`` counts everything the Linear costs: per-token INT8 quantization of the bf16
input (with smoothing), the rank-32 (``--rank``) low-rank down projection, the W4A8 GEMM with the low-rank up term and bias.
At the Wan 2.1 1.3B FFN shapes at W81 (M = 32,760 tokens; 1536 -> 8960 and 8960 -> 1536), this times:

* ``bf16_linear_bias``: ``F.linear(x, w, bias)`` (cuBLAS), the anchor;
* ``svdquant_linear``: :func:`~worldfoundry.core.acceleration.kernels.svdquant_dispatch.svdquant_linear` with
  ``backend="w4a8"``, exactly what the plugin calls (its default input side, then the persistent Gluon GEMM);
* ``svdquant_linear_fused_input``: the same with ``fused_lowrank=True`` (quantizer and low-rank in one kernel,
  the default since ``FUSED_QUANT_LOWRANK_MIN_K = 0``);
* ``svdquant_linear_two_kernels``: the same with ``fused_lowrank=False`` (quantizer and low-rank GEMM separate);
* ``svdquant_linear_unsmoothed``: the same for a Linear calibrated with ``--unsmoothed`` (no smoothing multiply
  in the quantizer);
* ``gemm_only``: the persistent GEMM with precomputed codes, scales and ``t`` (what the input side costs is the
  difference);
* for the down projection (K 8960) with its producer, as the plugin's ``fuse_gelu`` runs an FFN:
  ``bf16_gelu_linear_bias`` (torch's GELU of the up projection's output ``h``, then ``F.linear``; the anchor of
  this pair) against ``w4a8_gelu_producer`` (GELU + smoothing + INT8 + low-rank down in one kernel
  (:mod:`~worldfoundry.core.acceleration.kernels.int8_gelu_quant`), then the persistent GEMM); its ratio is to
  that anchor. ``w4a8_gelu_single_pass`` is the same pair for an unsmoothed down projection when the up GEMM has
  handed over the row maxima (the producer reads ``h`` once, two elements per bfloat16 rounding;
  ``w4a8_gelu_single_pass_unpacked``: ``packed_rounding=False``); ``gemm_only_row_max`` (up projection) is the
  GEMM alone with that epilogue (its cost is the difference to ``gemm_only``; ``..._reduced``: the maxima
  reduced from the accumulator, ``row_max_staged=False``);
* the whole FFN (``--ffn``, section ``ffn``): ``bf16_ffn`` (``F.linear`` up, torch GELU, ``F.linear`` down, with
  biases) against the plugin's fused W4A8 FFN, ``w4a8_ffn_two_pass`` (smoothed down projection: two-pass
  producer) and ``w4a8_ffn_single_pass`` (unsmoothed down projection: row maxima from the up GEMM, one-pass
  producer), each exactly as :class:`worldfoundry_svdquant.ffn_fusion_w4a8.FusedW4A8FFN` runs it, and
  ``w4a8_ffn_single_pass_earlier`` (the single pass as first timed: ``row_max_staged=False``,
  ``packed_rounding=False``).
* with ``--act-group G`` (128 or 256), the configuration whose quality is within the fixture's draft budget
  (INT8 scales per token and group of ``G`` input channels): ``svdquant_linear_act_group`` (``act_group=G``
  through the dispatch: the one-read grouped quantizer + low-rank, then the Gluon grouped GEMM of
  :mod:`~worldfoundry.core.acceleration.kernels.w4a8_gluon_grouped`), ``svdquant_linear_act_group_fma`` (the same
  with the FMA promotion, ``GroupedTile(exact=False)``), and the GEMMs alone with codes precomputed:
  ``gemm_only_act_group`` (Gluon), ``gemm_only_act_group_fma`` and ``gemm_only_act_group_triton`` (the Triton
  per-channel GEMM that scales each K step by its group, the path before the Gluon one).

GPU clocks drift within a process (power and temperature), and a ratio of two medians timed seconds apart carries
that drift. So the variants are timed in ``--blocks`` interleaved blocks (each block: every variant, ``--reps``
launches, median; the order rotates by one variant per block, since two rows of the same code differed by 5-15 %
when one always ran right after the bf16 anchor), and a variant's ratio to bf16 is taken *within* each block; the
report gives the median ratio over blocks and its range. Each sample is timed four ways side by side (``--timing``,
:data:`TIMERS`): one synchronised call (the host's launch latency before the first kernel counts: the W4A8 Linear
issues two kernels and more Python than ``F.linear``), one call replayed from a CUDA graph (no host latency, the
same idle gap), a burst of back-to-back calls (as in a device-bound forward, where the host runs ahead) and a CUDA
graph of the burst (the GPU's time alone). ``host_issue_us``: the host's time in one call (after a
synchronisation), the latency a synchronised sample carries. ``--power-probe S``: the up projection's bf16 and
W4A8 Linears run isolated and sustained for ``S`` seconds each with the SM clock and board power logged
(:mod:`power_probe`), to tell whether back-to-back bf16 GEMMs slow down because the clocks drop.

Operands: Gaussian activations and weights, random smoothing and factors (speed only; the numerics are tested in
the suite). Writes ``<out>/w4a8_linear.json`` (default ``$OUT`` or ``./bench_out``).

    python benchmarks/kernels/w4a8_linear.py --out "$OUT"      # about a minute on an H200
    python benchmarks/kernels/w4a8_linear.py --rank 64 --ffn --timing synced --out "$OUT"   # the rank of svdquant-tiny-keep2
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
from cuda_timing import host_issue_us, time_ms, time_ms_graph, time_ms_queued
from power_probe import probe

from worldfoundry.core.acceleration.kernels.int8_gelu_quant import triton_gelu_quantize_rows_int8_lowrank
from worldfoundry.core.acceleration.kernels.int8_grouped_quant_lowrank import triton_quantize_rows_int8_grouped_lowrank
from worldfoundry.core.acceleration.kernels.int8_quant_lowrank import triton_quantize_rows_int8_lowrank
from worldfoundry.core.acceleration.kernels.svdquant_dispatch import (
    BackendChoice,
    svdquant_linear,
    w4a8_gemm_from_codes,
)
from worldfoundry.core.acceleration.kernels.w4a8_gemm import triton_w4a8_gemm
from worldfoundry.core.acceleration.kernels.w4a8_gluon_grouped import GroupedTile, gluon_w4a8_grouped_gemm
from worldfoundry.core.acceleration.kernels.w4a8_gluon_persistent import gluon_w4a8_persistent_gemm
from worldfoundry.core.acceleration.quantization.int4_packing import quantize_int4_groupwise
from worldfoundry.core.acceleration.quantization.int8_activation import quantize_rows_int8
from worldfoundry.core.acceleration.quantization.svdquant_numerics import SVDQuantWeight

M_TOKENS = 32760
SHAPES = ((1536, 8960), (8960, 1536))
RANK = 32


def variants(k: int, n: int, act_group: int | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """The timed callables of one shape and what ran (backend names from the dispatch)."""
    g = torch.Generator(device="cuda").manual_seed(k)
    x = torch.randn(M_TOKENS, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    inv = (torch.rand(k, device="cuda", generator=g) + 0.5).float()
    down = (torch.randn(RANK, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    up = (torch.randn(n, RANK, device="cuda", generator=g) / RANK**0.5).to(torch.bfloat16)
    packed, scales = quantize_int4_groupwise(w, 0)
    weight = SVDQuantWeight(packed, scales, 0, inv_smooth=inv, lora_down=down, lora_up=up)
    q, s = quantize_rows_int8(x, inv)
    t = F.linear(x, down)
    ran = {"svdquant_linear": svdquant_linear(x, weight, bias, backend="w4a8")[1].backend,
           "svdquant_linear_fused_input": svdquant_linear(x, weight, bias, backend="w4a8",
                                                          fused_lowrank=True)[1].backend,
           "svdquant_linear_two_kernels": svdquant_linear(x, weight, bias, backend="w4a8",
                                                          fused_lowrank=False)[1].backend}
    fns = {"bf16_linear_bias": lambda: F.linear(x, w, bias),
           "svdquant_linear": lambda: svdquant_linear(x, weight, bias, backend="w4a8"),
           "svdquant_linear_fused_input": lambda: svdquant_linear(x, weight, bias, backend="w4a8",
                                                                  fused_lowrank=True),
           "svdquant_linear_two_kernels": lambda: svdquant_linear(x, weight, bias, backend="w4a8",
                                                                  fused_lowrank=False),
           "gemm_only": lambda: gluon_w4a8_persistent_gemm(q, s, weight, t, bias)}
    plain = SVDQuantWeight(packed, scales, 0, lora_down=down, lora_up=up)  # calibrated with --unsmoothed
    ran["svdquant_linear_unsmoothed"] = svdquant_linear(x, plain, bias, backend="w4a8")[1].backend
    fns["svdquant_linear_unsmoothed"] = lambda: svdquant_linear(x, plain, bias, backend="w4a8")
    if act_group:
        fns.update(_act_group_rows(x, weight, bias, act_group))
        ran["svdquant_linear_act_group"] = svdquant_linear(x, weight, bias, backend="w4a8",
                                                           act_group=act_group)[1].backend
    if k == 8960:
        h = (torch.randn(M_TOKENS, k, device="cuda", generator=g) * 2).to(torch.bfloat16)

        def producer() -> torch.Tensor:
            qg, sg, tg = triton_gelu_quantize_rows_int8_lowrank(h, "tanh", inv, down)
            return gluon_w4a8_persistent_gemm(qg, sg, weight, tg, bias)

        raw = SVDQuantWeight(packed, scales, 0, lora_down=down, lora_up=up)
        rm = h.amax(dim=1).float().clamp_min(0.0)

        def single_pass() -> torch.Tensor:
            qg, sg, tg = triton_gelu_quantize_rows_int8_lowrank(h, "tanh", None, down, row_max=rm)
            return gluon_w4a8_persistent_gemm(qg, sg, raw, tg, bias)

        fns["bf16_gelu_linear_bias"] = lambda: F.linear(F.gelu(h, approximate="tanh"), w, bias)
        fns["w4a8_gelu_producer"] = producer
        fns["w4a8_gelu_single_pass"] = single_pass

        def single_pass_unpacked() -> torch.Tensor:
            qg, sg, tg = triton_gelu_quantize_rows_int8_lowrank(h, "tanh", None, down, row_max=rm,
                                                                packed_rounding=False)
            return gluon_w4a8_persistent_gemm(qg, sg, raw, tg, bias)

        fns["w4a8_gelu_single_pass_unpacked"] = single_pass_unpacked
    else:
        fns["gemm_only_row_max"] = lambda: gluon_w4a8_persistent_gemm(
            q, s, weight, t, bias, row_max=torch.zeros(M_TOKENS, device="cuda"))
        fns["gemm_only_row_max_reduced"] = lambda: gluon_w4a8_persistent_gemm(
            q, s, weight, t, bias, row_max=torch.zeros(M_TOKENS, device="cuda"), row_max_staged=False)
    return fns, ran


def _act_group_rows(x: torch.Tensor, weight: SVDQuantWeight, bias: torch.Tensor,
                    group: int) -> dict[str, Any]:
    """The Linear with INT8 scales per token and group of ``group`` input channels (through the dispatch, and with
    the FMA promotion), and its GEMMs alone: Gluon grouped (exact and FMA promotion) and Triton per channel."""
    qg, sg, tg = triton_quantize_rows_int8_grouped_lowrank(x, weight.inv_smooth, weight.lora_down, group,
                                                           transposed_scales=True)
    fma = GroupedTile(exact=False)

    def linear_fma() -> torch.Tensor:
        q, s, t = triton_quantize_rows_int8_grouped_lowrank(x, weight.inv_smooth, weight.lora_down, group,
                                                            transposed_scales=True)
        return gluon_w4a8_grouped_gemm(q, s, weight, t, bias, tile=fma)

    contiguous = sg.contiguous()
    return {"svdquant_linear_act_group": lambda: svdquant_linear(x, weight, bias, backend="w4a8", act_group=group),
            "svdquant_linear_act_group_fma": linear_fma,
            "gemm_only_act_group": lambda: gluon_w4a8_grouped_gemm(qg, sg, weight, tg, bias),
            "gemm_only_act_group_fma": lambda: gluon_w4a8_grouped_gemm(qg, sg, weight, tg, bias, tile=fma),
            "gemm_only_act_group_triton": lambda: triton_w4a8_gemm(qg, contiguous, weight, tg, bias,
                                                                   out_dtype=torch.bfloat16)}


def ffn_variants(d: int = 1536, hidden: int = 8960) -> tuple[dict[str, Any], dict[str, str]]:
    """The whole FFN: bf16 against the fused W4A8 FFN with a smoothed and an unsmoothed down projection."""
    g = torch.Generator(device="cuda").manual_seed(d + hidden)
    x = torch.randn(M_TOKENS, d, device="cuda", generator=g).to(torch.bfloat16)
    w1 = (torch.randn(hidden, d, device="cuda", generator=g) / d**0.5).to(torch.bfloat16)
    w2 = (torch.randn(d, hidden, device="cuda", generator=g) / hidden**0.5).to(torch.bfloat16)
    b1 = torch.randn(hidden, device="cuda", generator=g).to(torch.bfloat16)
    b2 = torch.randn(d, device="cuda", generator=g).to(torch.bfloat16)

    def svd_weight(w: torch.Tensor, smooth: bool) -> SVDQuantWeight:
        k = w.shape[1]
        packed, scales = quantize_int4_groupwise(w, 0)
        inv = (torch.rand(k, device="cuda", generator=g) + 0.5).float() if smooth else None
        down = (torch.randn(RANK, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
        up = (torch.randn(w.shape[0], RANK, device="cuda", generator=g) / RANK**0.5).to(torch.bfloat16)
        return SVDQuantWeight(packed, scales, 0, inv_smooth=inv, lora_down=down, lora_up=up)

    up_w, down_smooth, down_raw = svd_weight(w1, True), svd_weight(w2, True), svd_weight(w2, False)

    def fused(down_w: SVDQuantWeight) -> torch.Tensor:  # FusedW4A8FFN.run without the plugin's bookkeeping
        single = down_w.inv_smooth is None
        row_max = torch.zeros(M_TOKENS, device="cuda") if single else None
        h, _ = svdquant_linear(x, up_w, b1, backend="w4a8", row_max=row_max)
        q, s, t = triton_gelu_quantize_rows_int8_lowrank(h, "tanh", down_w.inv_smooth, down_w.lora_down,
                                                         row_max=row_max)
        return w4a8_gemm_from_codes(q, s, down_w, t, b2, torch.bfloat16, BackendChoice("w4a8"))[0]

    def fused_earlier() -> torch.Tensor:  # the single pass as first timed: reduced row maxima, one rounding each
        row_max = torch.zeros(M_TOKENS, device="cuda")
        q, s, t = triton_quantize_rows_int8_lowrank(x, up_w.inv_smooth, up_w.lora_down)
        h = gluon_w4a8_persistent_gemm(q, s, up_w, t, b1, row_max=row_max, row_max_staged=False)
        q, s, t = triton_gelu_quantize_rows_int8_lowrank(h, "tanh", None, down_raw.lora_down, row_max=row_max,
                                                         packed_rounding=False)
        return gluon_w4a8_persistent_gemm(q, s, down_raw, t, b2)

    fns = {"bf16_ffn": lambda: F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2),
           "w4a8_ffn_two_pass": lambda: fused(down_smooth),
           "w4a8_ffn_single_pass": lambda: fused(down_raw),
           "w4a8_ffn_single_pass_earlier": fused_earlier}
    ran = {"w4a8_ffn_single_pass": svdquant_linear(x, up_w, b1, backend="w4a8",
                                                   row_max=torch.zeros(M_TOKENS, device="cuda"))[1].backend}
    return fns, ran


PRODUCER_ROWS = ("bf16_gelu_linear_bias", "w4a8_gelu_producer", "w4a8_gelu_single_pass",
                 "w4a8_gelu_single_pass_unpacked")


def anchor_of(name: str) -> str:
    """The bf16 row a variant's ratio is taken against."""
    if name in PRODUCER_ROWS:
        return "bf16_gelu_linear_bias"
    return "bf16_ffn" if "ffn" in name else "bf16_linear_bias"


#: Calls per sample of the queued and graph timings.
BURST = 10
#: How a sample is timed (``--timing``): ``synced``, one call between CUDA events and a synchronisation (the host's
#: launch latency before the first kernel counts, once per call); ``queued``, :data:`BURST` back-to-back calls (the
#: host's latency once per burst, as in a device-bound forward); ``graph``, :data:`BURST` calls captured in one
#: CUDA graph (the GPU's time alone, as under the ``cuda_graph`` plugin); ``graph1``, one call captured in a CUDA
#: graph and each replay synchronised (the host's latency reduced to one graph launch for every variant alike, and
#: the same idle gap after each call as ``synced``: back-to-back bf16 GEMMs ran 10-30 % slower and far less steadily
#: on the H200 than single ones, so the anchor of a burst is not steady).
TIMERS = {"synced": lambda fn, reps: time_ms(fn, 2, reps),
          "queued": lambda fn, reps: time_ms_queued(fn, 2, max(3, reps // BURST), BURST),
          "graph": lambda fn, reps: time_ms_graph(fn, 2, max(3, reps // BURST), BURST),
          "graph1": lambda fn, reps: time_ms_graph(fn, 2, reps, 1)}


def _rows(per_block: dict[str, list[float]]) -> dict[str, Any]:
    rows = {}
    for name, times in per_block.items():
        anchor = anchor_of(name)
        ratios = [b / t for b, t in zip(per_block[anchor], times)]
        rows[name] = {"anchor": anchor, "ms_per_block": times, "median_ms": statistics.median(times),
                      "speedup_vs_bf16": statistics.median(ratios), "speedup_range": [min(ratios), max(ratios)]}
    return rows


def shape_section(k: int, n: int, blocks: int, reps: int, timings: list[str],
                  act_group: int | None = None) -> dict[str, Any]:
    fns, ran = variants(k, n, act_group) if k else ffn_variants()
    per_block = {method: {name: [] for name in fns} for method in timings}
    host = {name: [] for name in fns}
    names = list(fns)
    for block in range(blocks):  # the order rotates from block to block: no variant always follows the anchor
        for name in names[block % len(names):] + names[:block % len(names)]:
            for method in timings:
                per_block[method][name].append(TIMERS[method](fns[name], reps))
            host[name].append(host_issue_us(fns[name], 5))
    return {"M": M_TOKENS, "K": k, "N": n, "backend_ran": ran,
            "timing": {method: _rows(per_block[method]) for method in timings},
            "host_issue_us": {name: statistics.median(v) for name, v in host.items()}}


def set_rank(rank: int) -> None:
    """The low-rank branch's rank for every operand built after this call."""
    global RANK
    if rank < 1:
        raise SystemExit(f"--rank must be at least 1, got {rank}")
    RANK = rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "./bench_out"))
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--ffn", action="store_true", help="also time the whole FFN (section 'ffn')")
    parser.add_argument("--timing", nargs="+", choices=sorted(TIMERS), default=["synced", "graph1", "queued", "graph"],
                        help="how samples are timed (TIMERS; default all four, side by side)")
    parser.add_argument("--power-probe", type=float, default=0.0, metavar="SECONDS",
                        help="also run the up projection's bf16 and W4A8 Linears isolated and sustained for this many "
                             "seconds each, logging SM clock and power (power_probe.py; section 'power')")
    parser.add_argument("--act-group", type=int, choices=(128, 256), default=None,
                        help="also time the Linear with INT8 scales per token and group of this many input channels")
    parser.add_argument("--rank", type=int, default=RANK, help="rank of the low-rank branch (default 32)")
    args = parser.parse_args()
    set_rank(args.rank)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = {f"{k}->{n}": shape_section(k, n, args.blocks, args.reps, args.timing, args.act_group)
              for k, n in SHAPES}
    if args.ffn:
        shapes["ffn"] = shape_section(0, 0, args.blocks, args.reps, args.timing)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "blocks": args.blocks,
              "reps": args.reps, "burst": BURST, "act_group": args.act_group, "rank": RANK,
              "commit": os.environ.get("COMMIT"), "shapes": shapes}
    if args.power_probe > 0:
        fns = variants(*SHAPES[0])[0]
        report["power"] = probe({name: fns[name] for name in ("bf16_linear_bias", "svdquant_linear", "gemm_only")},
                                seconds=args.power_probe, burst=BURST)
        for name, regimes in report["power"].items():
            print("power", name, regimes)
    (out / "w4a8_linear.json").write_text(json.dumps(report, indent=1))
    for key, sec in report["shapes"].items():
        print(key, "ran:", sec["backend_ran"])
        print("  host issue time per call (us):", {n: round(v) for n, v in sec["host_issue_us"].items()})
        for method, rows in sec["timing"].items():
            print(f" timing {method}")
            for name, row in rows.items():
                lo, hi = row["speedup_range"]
                print(f"  {name:<30} {row['median_ms']:.3f} ms  {row['speedup_vs_bf16']:.3f}x {row['anchor']} "
                      f"[{lo:.3f}, {hi:.3f}]")


if __name__ == "__main__":
    main()
