"""GPU evidence for ``svdquant``: W4A8 Linears at W81 FFN shapes, device bytes, the Wan W81 forward, 14B memory.

One run, each section guarded (a failure is recorded under ``errors``; the JSON is rewritten after every
section):

1. ``linear``: per FFN Linear at W81 shapes (M = 32,760 tokens; 1536 -> 8960 and 8960 -> 1536), bf16, rank 32,
   for each residual scale grouping (``--modes``: ``channel`` -- one scale per output channel, one int32
   accumulation over K --, ``g128``, ``g64``): bf16 ``F.linear`` vs the W4A8 Linear as the plugin runs it (per-token
   INT8 activation quantization with smoothing + the low-rank down GEMM + the W4A8 GEMM with the fused low-rank
   up projection and bias) and its parts (GEMM alone, quantizer alone -- both variants once per shape --, low-rank
   down alone), W4A8 without low-rank (rank 0), optionally W4A16, and the anchor FP8 rowwise ``torch._scaled_mm``
   (pre-quantized). Interleaved paired rounds, medians; rel L2 vs bf16 (and plain INT4 RTN's at the same
   grouping) and agreement with the torch reference (within 2**-7 * max|ref|, one bfloat16 ulp); device bytes
   dense vs SVDQuant (goal >= 3.5x smaller) and speed (goal >= 1.2x). The GEMM's tile as chosen
   (``worldfoundry.core.acceleration.kernels.w4a8_tuning``: committed table, else interleaved timing) is
   recorded beside every per-channel candidate tile timed in the same rounds (``--grouped-sweep`` adds fixed
   tiles of the group-scale GEMM); ``chosen_within_3pct_of_fastest`` checks the choice, and the fastest tile is
   the entry to commit to ``MEASURED_CONFIGS``.
2. ``forward_w81``: Wan2.1-T2V-1.3B architecture (random seeded weights, bf16) at W81: dense vs svdquant on
   the 60 FFN Linears (``blocks.*.ffn.0`` / ``ffn.2``; artifact calibrated here on random inputs at W17, rank 32,
   grouping ``--forward-mode`` (default per channel), randomized SVD, ``keep_original: cpu``), one model per
   ``--forward-variants`` entry (``smoothed``; ``unsmoothed-ffn2``: ``ffn.2`` calibrated without smoothing;
   ``unsmoothed``: both; the ``-one-launch`` variants add ``one_launch_operand: true``; ``unsmoothed-ffn2-w4a8``
   runs INT8 activations, ``backend: w4a8``; ``unsmoothed-w4a8``: both unsmoothed with INT8 activations, the
   configuration of the shipped ``svdquant-tiny-keep2`` artifact at ``--rank 64``), all
   timed in the same interleaved rounds against dense: forward ratio, latent rel L2,
   receipts (kernels run, no fallback), device bytes, exact restore after uninstall.
3. ``memory_14b``: Wan2.1-T2V-14B architecture (40 layers, dim 5120, 40 heads, FFN 13,824; random weights
   built directly on the GPU in bf16): device memory of the DiT with and without the plugin on the 80 FFN
   Linears (``keep_original: cpu``), and one W17 forward with receipts.

Random weights and random calibration inputs say nothing about visual quality: the rel L2 figures describe
these weights only.

Usage::

    python benchmarks/kernels/svdquant.py --skip forward_w81 memory_14b --out "$OUT"   # per-Linear, H200 <= 4 min
    python benchmarks/kernels/svdquant.py --out "$OUT"           # + W81 forward and 14B memory
    python benchmarks/kernels/svdquant.py --smoke --out /tmp/sq   # CPU plumbing check (torch reference)
    TRITON_INTERPRET=1 python benchmarks/kernels/svdquant.py --smoke --interpret --skip forward_w81 memory_14b \
        --out /tmp/sq                                             # the kernel rows under the interpreter
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from worldfoundry.base_models.diffusion_model.optimizations.plugins import install_diffusion_accelerations
from worldfoundry.base_models.diffusion_model.svdquant_calibration import (
    InputAbsmaxObserver,
    build_svdquant_artifact,
    select_for_calibration,
)
from worldfoundry.bench.microbench import RANDOM_NOTE, WAN_1_3B, WAN_TINY, WORKLOADS, SMOKE_WORKLOADS
from worldfoundry.bench.microbench import interleaved, rel_l2, sync
from worldfoundry.bench.microbench import provenance as shared_provenance
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.kernels.int8_act_quant import triton_quantize_rows_int8
from worldfoundry.core.acceleration.kernels.svdquant_dispatch import lowrank_down, pad_rank, svdquant_linear
from worldfoundry.core.acceleration.kernels.w4a8_gemm import triton_w4a8_gemm
from worldfoundry.core.acceleration.quantization.int8_activation import quantize_rows_int8
from worldfoundry.core.acceleration.quantization.svdquant_artifact import save_svdquant_artifact
from worldfoundry.core.acceleration.quantization.svdquant_numerics import decompose, w4a8_linear_reference
from worldfoundry.core.model_loading.policy import RuntimePolicy

WAN_14B: dict[str, Any] = dict(WAN_1_3B, num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40)
INCLUDE = ("blocks.*.ffn.0", "blocks.*.ffn.2")
ULP_TOL = 2.0**-7


def _bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


#: Residual scale groupings measured per Linear: name -> ``group_size`` (0 = one scale per output channel).
MODES: dict[str, int] = {"channel": 0, "g128": 128, "g64": 64}


def _linear_inputs(device: torch.device, m: int, k: int, n: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=device).manual_seed(k + n)
    w = (torch.randn(n, k, generator=g, device=device) * 0.02).to(torch.bfloat16)
    b = (torch.randn(n, generator=g, device=device) * 0.01).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
    x[:, :: max(1, k // 16)] *= 8.0  # a few outlier channels, as in real activations
    return w, b, x


def _accuracy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, sq: Any, rtn: Any, out: torch.Tensor,
              entry: dict[str, Any]) -> None:
    dense = F.linear(x, w, b).float()
    ref = w4a8_linear_reference(x, sq, b).float()
    entry["rel_l2_vs_bf16"] = {"w4a8": rel_l2(out.float(), dense), "w4a8_reference": rel_l2(ref, dense),
                               "rtn_w4a8_reference": rel_l2(w4a8_linear_reference(x, rtn, b).float(), dense)}
    entry["max_abs_vs_reference_in_ulps_of_max"] = float((out.float() - ref).abs().max() / (ULP_TOL * ref.abs().max()))
    entry["matches_reference"] = entry["max_abs_vs_reference_in_ulps_of_max"] <= 1.0


def _fp8_anchor(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, entry: dict[str, Any]) -> dict[str, Callable]:
    try:
        from worldfoundry.core.acceleration.quantization.fp8 import quantize_rowwise_fp8
        from worldfoundry.core.acceleration.quantization.fp8_linear import (
            quantize_weight_rowwise_fp8,
            scaled_mm_rowwise,
        )

        w8 = quantize_weight_rowwise_fp8(w)
        xq8, xs8 = quantize_rowwise_fp8(x)
        return {"anchor fp8 _scaled_mm only": lambda: scaled_mm_rowwise(xq8, xs8, w8, b)}
    except Exception as exc:  # an anchor that cannot run is recorded, not fatal
        entry["fp8_anchor_error"] = repr(exc)
        return {}


def _linear_case(device: torch.device, args: argparse.Namespace, m: int, k: int, n: int, mode: str) -> dict[str, Any]:
    group = MODES[mode]
    w, b, x = _linear_inputs(device, m, k, n)
    sq = pad_rank(decompose(w, rank=args.rank, group_size=group, act_absmax=x.float().abs().amax(0), svd="randomized"))
    rtn = decompose(w, rank=0, group_size=group)
    kernels = device.type == "cuda" or args.interpret
    backend = "w4a8" if kernels else "reference"
    q, s = triton_quantize_rows_int8(x, sq.inv_smooth) if kernels else quantize_rows_int8(x, sq.inv_smooth)
    t = lowrank_down(x, sq)
    out, used = svdquant_linear(x, sq, b, backend=backend)
    entry: dict[str, Any] = {"shape": {"M": m, "K": k, "N": n}, "mode": mode, "group_size": group, "rank": args.rank,
                             "backend": used.backend}
    _accuracy(x, w, b, sq, rtn, out, entry)
    dense_bytes = _bytes(w, b)
    entry["device_bytes"] = {"dense": dense_bytes, "svdquant": sq.nbytes + _bytes(b),
                             "ratio": dense_bytes / (sq.nbytes + _bytes(b))}
    calls: dict[str, Callable[[], Any]] = {
        "bf16 F.linear": lambda: F.linear(x, w, b),
        TOTAL: lambda: svdquant_linear(x, sq, b, backend=backend),
    }
    if kernels:
        calls["w4a8 GEMM only"] = lambda: triton_w4a8_gemm(q, s, sq, t, b)
        calls["int8 act quant only"] = lambda: triton_quantize_rows_int8(x, sq.inv_smooth)
        calls["low-rank down x.D^T only"] = lambda: lowrank_down(x, sq)
        # rank 0 (plain RTN codes) on the tile chosen for the rank-32 GEMM: no second tile search
        calls["w4a8 rank 0 (quant + GEMM)"] = lambda: triton_w4a8_gemm(
            *triton_quantize_rows_int8(x, None), rtn, None, b, config=entry.get("chosen_config"))
        calls[TOTAL_SEPARATE] = lambda: svdquant_linear(x, sq, b, backend="w4a8", fused_lowrank=False)
        calls[TOTAL_FUSED] = lambda: svdquant_linear(x, sq, b, backend="w4a8", fused_lowrank=True)
        if mode == args.modes[0]:  # the quantizers do not depend on the mode: their variants timed once per shape
            calls.update(_quantizer_variants(x, sq, q, s, entry))
        calls.update(_gemm_sweep(q, s, sq, t, b, entry, args))
        if args.with_w4a16:
            calls["svdquant w4a16"] = lambda: svdquant_linear(x, sq, b, backend="w4a16")
        calls.update(_fp8_anchor(x, w, b, entry))
    for fn in calls.values():  # compile + tile choice outside the timed rounds
        fn()
    sync(device)
    entry["timing"] = interleaved(calls, device, rounds=args.rounds, warmup=args.warmup, iters=args.iters,
                                  baseline="bf16 F.linear")
    _summarize(entry)
    return entry


TOTAL = "svdquant w4a8 (quant + low-rank + GEMM)"
TOTAL_SEPARATE = "w4a8 total, separate quant + low-rank"
TOTAL_FUSED = "w4a8 total, fused quant + low-rank"
FUSED_PREFIX = "fused quant + low-rank down only, rows "


def _quantizer_variants(x: torch.Tensor, sq: Any, q: torch.Tensor, s: torch.Tensor,
                        entry: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """Both passes of the INT8 quantizer and the fused quantizer + low-rank down at 16/32/64 rows per program
    (codes checked bitwise against the two-pass quantizer's, ``t`` within one bf16 ulp of max of the GEMM's)."""
    from worldfoundry.core.acceleration.kernels.int8_quant_lowrank import triton_quantize_rows_int8_lowrank

    k = x.shape[1]
    calls: dict[str, Callable[[], Any]] = {
        "int8 act quant two-pass": lambda: triton_quantize_rows_int8(x, sq.inv_smooth, single_pass=False)}
    if k <= 16384:
        calls["int8 act quant single-pass"] = lambda: triton_quantize_rows_int8(x, sq.inv_smooth, single_pass=True)
    t_ref = lowrank_down(x, sq).float()
    checks = {}
    for rows in (16, 32, 64):
        qf, sf, tf = triton_quantize_rows_int8_lowrank(x, sq.inv_smooth, sq.lora_down, block_m=rows)
        checks[rows] = {"codes_bitwise": bool(torch.equal(qf, q) and torch.equal(sf, s)),
                        "t_max_abs_in_ulps_of_max": float((tf.float() - t_ref).abs().max()
                                                          / (ULP_TOL * t_ref.abs().max()))}
        calls[f"{FUSED_PREFIX}{rows}"] = lambda rows=rows: triton_quantize_rows_int8_lowrank(
            x, sq.inv_smooth, sq.lora_down, block_m=rows)
    entry["fused_quant_lowrank_checks"] = checks
    return calls


def _summarize(entry: dict[str, Any]) -> None:
    timing = entry["timing"]
    entry["gemm_sweep_winner"] = _sweep_winner(timing)
    winner, chosen = entry["gemm_sweep_winner"], timing.get("w4a8 GEMM only")
    if winner and chosen:
        entry["chosen_within_3pct_of_fastest"] = chosen["median_ms"] <= 1.03 * winner["median_ms"]
    if TOTAL_SEPARATE in timing and TOTAL_FUSED in timing:
        entry["fused_quant_lowrank_faster"] = timing[TOTAL_FUSED]["median_ms"] < timing[TOTAL_SEPARATE]["median_ms"]
    entry["goals"] = {"speed_ge_1.2x": timing[TOTAL]["paired_speedup_median"] >= 1.2,
                      "bytes_ge_3.5x_smaller": entry["device_bytes"]["ratio"] >= 3.5}


#: Fixed group-scale W4A8 GEMM tiles timed with ``--grouped-sweep`` (``ASM: False`` = plain int8 unpacking).
GEMM_SWEEP: dict[str, dict[str, Any]] = {
    name: {"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8, "SWAP_AB": swap, "num_warps": warps, "num_stages": stages,
           **({"ASM": False} if "int8-unpack" in name else {})}
    for name, (bm, bn, swap, warps, stages) in {
        "128x128 w8 s3": (128, 128, False, 8, 3),
        "swap 128x128 w8 s4": (128, 128, True, 8, 4),
        "swap 64x128 w4 s4": (64, 128, True, 4, 4),
        "swap 128x64 w4 s4": (128, 64, True, 4, 4),
        "swap 64x64 w4 s4": (64, 64, True, 4, 4),
        "swap 128x128 w8 s4 int8-unpack": (128, 128, True, 8, 4),
    }.items()
}
SWEEP_PREFIX = "w4a8 GEMM cfg "


def _cfg_name(cfg: dict[str, Any]) -> str:
    return (f"{'swap ' if cfg.get('SWAP_AB') else ''}{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} "
            f"s{cfg['num_stages']}" + (f" k{cfg['BLOCK_K']}" if "BLOCK_K" in cfg else ""))


def _gemm_sweep(q: torch.Tensor, s: torch.Tensor, sq: Any, t: torch.Tensor, b: torch.Tensor,
                entry: dict[str, Any], args: argparse.Namespace) -> dict[str, Callable[[], Any]]:
    """Timed calls for the sweep -- every per-channel candidate, or :data:`GEMM_SWEEP` with ``--grouped-sweep`` --
    whose output matches the chosen tile's within one bf16 ulp of max; failures go to ``gemm_sweep_errors``."""
    from worldfoundry.core.acceleration.kernels.w4a8_channel_gemm import channel_candidates
    from worldfoundry.core.acceleration.kernels.w4a8_gemm import tile_key
    from worldfoundry.core.acceleration.kernels.w4a8_tuning import chosen_config

    tuned = triton_w4a8_gemm(q, s, sq, t, b).float()
    entry["chosen_config"] = chosen_config(q.device, tile_key(sq, t is not None, True, True), q.shape[0])
    if sq.group_size == 0:
        sweep = {_cfg_name(c): c for c in channel_candidates(sq.in_features)}
    else:
        sweep = GEMM_SWEEP if args.grouped_sweep else {}
    calls: dict[str, Callable[[], Any]] = {}
    for name, cfg in sweep.items():
        try:
            out = triton_w4a8_gemm(q, s, sq, t, b, config=cfg).float()
            err = float((out - tuned).abs().max() / (ULP_TOL * tuned.abs().max()))
            if err > 1.0:
                raise AssertionError(f"differs from the chosen tile's output by {err:.2f} ulp of max")
            calls[SWEEP_PREFIX + name] = lambda cfg=cfg: triton_w4a8_gemm(q, s, sq, t, b, config=cfg)
        except Exception as exc:  # a configuration that cannot run is recorded, the rest still run
            entry.setdefault("gemm_sweep_errors", {})[name] = repr(exc)
    entry["sweep_configs"] = {SWEEP_PREFIX + k: v for k, v in sweep.items()}
    return calls


def _sweep_winner(timing: dict[str, Any]) -> dict[str, Any] | None:
    rows = {k: v["median_ms"] for k, v in timing.items() if k.startswith(SWEEP_PREFIX) or k == "w4a8 GEMM only"}
    if not rows:
        return None
    name = min(rows, key=rows.get)
    return {"name": name, "median_ms": rows[name]}


def linear_bench(device: torch.device, args: argparse.Namespace) -> list[dict[str, Any]]:
    m = args.tokens if device.type == "cuda" else 64
    dims = [(1536, 8960), (8960, 1536)] if device.type == "cuda" else [(128, 256), (256, 128)]
    cases = []
    for k, n in dims:
        for mode in args.modes:
            try:
                cases.append(_linear_case(device, args, m, k, n, mode))
            except Exception:  # one failing mode is recorded; the others still run
                cases.append({"shape": {"M": m, "K": k, "N": n}, "mode": mode, "error": traceback.format_exc()})
                print(f"linear {k}->{n} {mode} failed:\n{cases[-1]['error']}", file=sys.stderr)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return cases


def build_wan(config: dict[str, Any], device: torch.device, seed: int = 0) -> nn.Module:
    """Random seeded Wan transformer built directly on ``device`` in bf16 (fp32 modules as diffusers keeps them)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = WanTransformer3DModel(**config)
    finally:
        torch.set_default_dtype(previous)
    keep = list(getattr(type(model), "_keep_in_fp32_modules", None) or [])
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if tensor.is_floating_point() and any(k in name.split(".") for k in keep):
                tensor.data = tensor.data.to(torch.float32)
    return model.eval()


def wan_inputs(latent: tuple[int, int, int], text_dim: int, device: torch.device, seed: int = 7) -> dict[str, Any]:
    f, h, w = latent
    g = torch.Generator(device=device).manual_seed(seed)
    return {
        "hidden_states": torch.randn(1, 16, f, h, w, generator=g, device=device).to(torch.bfloat16),
        "timestep": torch.tensor([500], device=device),
        "encoder_hidden_states": torch.randn(1, 512, text_dim, generator=g, device=device).to(torch.bfloat16),
        "return_dict": False,
    }


def calibrate_random(model: nn.Module, inputs: dict[str, Any], out: Path, *, group: int, rank: int,
                     unsmoothed: tuple[str, ...] = ()) -> Path:
    """Artifact for ``model`` calibrated on one forward of random ``inputs`` (randomized SVD); the Linears that
    ``unsmoothed`` names are decomposed without smoothing."""
    selected = select_for_calibration(model, INCLUDE)
    with InputAbsmaxObserver(selected) as obs, torch.inference_mode():
        model(**inputs)
    manifest, tensors = build_svdquant_artifact(model, selected, obs.absmax, rank=rank, group_size=group,
                                                svd="randomized", include=INCLUDE, observer=obs,
                                                calibration={"inputs": "random (seeded)", "seeds": [11]},
                                                unsmoothed=unsmoothed)
    return save_svdquant_artifact(manifest, tensors, out)


#: ``--forward-variants``: which Linears are calibrated without smoothing in each W81 forward variant.
FORWARD_VARIANTS: dict[str, tuple[str, ...]] = {
    "smoothed": (), "unsmoothed-ffn2": ("blocks.*.ffn.2",), "unsmoothed": INCLUDE,
    "unsmoothed-ffn2-one-launch": ("blocks.*.ffn.2",), "unsmoothed-one-launch": INCLUDE,
    "unsmoothed-ffn2-w4a8": ("blocks.*.ffn.2",), "unsmoothed-w4a8": INCLUDE}
#: plugin options beyond the artifact per variant (the others take the defaults; ``-w4a8``: INT8 activations,
#: the fused FFN with the one-pass GELU producer fed by the up GEMM's row maxima)
VARIANT_OPTIONS: dict[str, dict[str, Any]] = {
    "unsmoothed-ffn2-one-launch": {"one_launch_operand": True}, "unsmoothed-one-launch": {"one_launch_operand": True},
    "unsmoothed-ffn2-w4a8": {"backend": "w4a8"}, "unsmoothed-w4a8": {"backend": "w4a8"}}


def _group(device: torch.device, args: argparse.Namespace) -> int:
    return MODES[args.forward_mode] if device.type == "cuda" else 64  # the CPU smoke model has 64 input features


def _infer(model: nn.Module, inputs: dict[str, Any]) -> Any:
    with torch.inference_mode():
        return model(**inputs)


def _install(model: nn.Module, artifact: Path, keep: str, **options: Any) -> Any:
    spec = {"svdquant": {"artifact": str(artifact), "keep_original": keep, **options}}
    return install_diffusion_accelerations(model, spec, RuntimePolicy(device=next(model.parameters()).device.type))


def _proof(session: Any, model: nn.Module, inputs: dict[str, Any], rid: str) -> dict[str, Any]:
    with request_scope(RequestContext(rid)), torch.inference_mode():
        model(**inputs)
    record = session.execution_report()["plugins"]["svdquant"]["model"]["requests"][rid]
    kinds: dict[str, int] = {}
    for per in record["modules"].values():
        for kind, n in per.items():
            kinds[kind] = kinds.get(kind, 0) + n
    return {"modules_executed": len(record["modules"]), "kinds": kinds, "fallbacks": record["fallbacks"],
            "claimed_not_executed": len(record["claimed_not_executed"]), "counters": record["counters"]}


def _param_bytes(model: nn.Module, device: torch.device) -> int:
    return sum(_bytes(p) for p in model.parameters() if p.device.type == device.type)


def _forward_variant(dense: nn.Module, name: str, device: torch.device, args: argparse.Namespace, scratch: Path,
                     calib: dict[str, Any], inputs: dict[str, Any], ref: torch.Tensor) -> tuple[nn.Module, Any, dict]:
    """One svdquant variant of ``dense``: calibrated, installed (``keep_original: cpu``), proved, its rel L2."""
    artifact = calibrate_random(dense, calib, scratch / f"wan13b-{name}.json", group=_group(device, args),
                                rank=args.rank, unsmoothed=FORWARD_VARIANTS[name])
    model = copy.deepcopy(dense)
    torch.cuda.empty_cache() if device.type == "cuda" else None
    alloc_before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    session = _install(model, artifact, "cpu", **VARIANT_OPTIONS.get(name, {}))
    alloc_after = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    proof = _proof(session, model, inputs, f"w81-proof-{name}")
    with torch.inference_mode():
        out = model(**inputs)[0].float()
    report = session.execution_report()["plugins"]["svdquant"]["model"]["svdquant"]
    return model, session, {"artifact": str(artifact), "unsmoothed": list(FORWARD_VARIANTS[name]),
                            "options": VARIANT_OPTIONS.get(name, {}),
                            "latent_rel_l2_vs_dense": rel_l2(out, ref), "execution_proof": proof,
                            "memory_report": report["memory"],
                            "device_allocated_delta_on_install_bytes": alloc_after - alloc_before}


def forward_bench(device: torch.device, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """Dense against every ``--forward-variants`` svdquant model in the same interleaved rounds."""
    config = WAN_1_3B if device.type == "cuda" else WAN_TINY
    workloads = WORKLOADS if device.type == "cuda" else SMOKE_WORKLOADS
    dense = build_wan(config, device)
    calib = wan_inputs(workloads["W17"], config["text_dim"], device, seed=11)
    inputs = wan_inputs(workloads["W81"], config["text_dim"], device)
    with torch.inference_mode():
        ref = dense(**inputs)[0].float()
    entry: dict[str, Any] = {"workload": "W81", "latent": list(workloads["W81"]), "variants": {}}
    calls = {"dense": lambda: _infer(dense, inputs)}
    installed = []
    for name in args.forward_variants:
        model, session, record = _forward_variant(dense, name, device, args, scratch, calib, inputs, ref)
        entry["variants"][name] = record
        calls[f"svdquant {name}"] = lambda model=model: _infer(model, inputs)
        installed.append((name, model, session))
    entry["timing"] = interleaved(calls, device, rounds=args.forward_rounds, warmup=1, iters=1, baseline="dense")
    for name, model, session in installed:
        session.uninstall()
        with torch.inference_mode():
            after = model(**inputs)[0].float()
        entry["variants"][name]["restored_output_bitwise"] = bool(torch.equal(after, ref))
        entry["variants"][name]["restored_state_bitwise"] = all(torch.equal(a, b) for a, b in zip(
            model.state_dict().values(), dense.state_dict().values(), strict=True))
    entry["note"] = RANDOM_NOTE
    return entry


def memory_14b(device: torch.device, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    config = WAN_14B if device.type == "cuda" else dict(WAN_TINY, num_layers=3)
    workloads = WORKLOADS if device.type == "cuda" else SMOKE_WORKLOADS
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
    model = build_wan(config, device, seed=1)
    dit_bytes = (torch.cuda.memory_allocated() - base) if device.type == "cuda" else _param_bytes(model, device)
    t0 = time.perf_counter()
    artifact = calibrate_random(model, wan_inputs(workloads["W17"], config["text_dim"], device, seed=11),
                                scratch / "wan14b.json", group=_group(device, args), rank=args.rank)
    calibrate_s = time.perf_counter() - t0
    torch.cuda.empty_cache() if device.type == "cuda" else None
    t0 = time.perf_counter()
    session = _install(model, artifact, "cpu")
    install_s = time.perf_counter() - t0
    with_plugin = (torch.cuda.memory_allocated() - base) if device.type == "cuda" else None
    proof = _proof(session, model, wan_inputs(workloads["W17"], config["text_dim"], device), "w17-14b")
    report = session.execution_report()["plugins"]["svdquant"]["model"]["svdquant"]["memory"]
    session.uninstall()
    restored = (torch.cuda.memory_allocated() - base) if device.type == "cuda" else None
    return {"config": {k: config[k] for k in ("num_layers", "num_attention_heads", "attention_head_dim", "ffn_dim")},
            "dit_device_bytes_dense": dit_bytes, "dit_device_bytes_with_svdquant": with_plugin,
            "ratio": (dit_bytes / with_plugin) if with_plugin else None,
            "dit_device_bytes_after_uninstall": restored, "plugin_memory_report": report,
            "calibrate_seconds": round(calibrate_s, 1), "install_seconds": round(install_s, 1),
            "execution_proof_w17": proof, "note": RANDOM_NOTE}


def _run_section(data: dict[str, Any], name: str, fn: Callable[[], Any], out: Path) -> None:
    start = time.perf_counter()
    try:
        data[name] = fn()
    except Exception:
        data.setdefault("errors", {})[name] = traceback.format_exc()
        print(f"section {name} failed:\n{data['errors'][name]}", file=sys.stderr)
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    data.setdefault("section_seconds", {})[name] = round(time.perf_counter() - start, 1)
    (out / "svdquant.json").write_text(json.dumps(data, indent=2, default=str))


def _row(case: dict[str, Any]) -> str:
    t = case["timing"]
    get = lambda name: t[name]["median_ms"] if name in t else float("nan")  # noqa: E731
    total = t[TOTAL]
    s = case["shape"]
    rel = case["rel_l2_vs_bf16"]
    return (f"{s['K']:>5}->{s['N']:<5} {case['mode']:<8} {get('bf16 F.linear'):7.3f} {total['median_ms']:7.3f} "
            f"{total['paired_speedup_median']:6.3f}x {get(TOTAL_SEPARATE):7.3f} {get(TOTAL_FUSED):7.3f} "
            f"{get('w4a8 GEMM only'):7.3f} {get('int8 act quant only'):7.3f} "
            f"{get('low-rank down x.D^T only'):7.3f} {get('anchor fp8 _scaled_mm only'):7.3f} "
            f"{rel['w4a8']:7.4f} ({rel['rtn_w4a8_reference']:.4f}) {case['device_bytes']['ratio']:5.2f}x "
            f"{'yes' if case['goals']['speed_ge_1.2x'] else 'no':>4}")


def print_tables(data: dict[str, Any]) -> None:
    cases = [c for c in data.get("linear", []) if "timing" in c]
    for case in cases:
        print(f"-- {case['shape']['K']}->{case['shape']['N']} {case['mode']}: chosen tile {case.get('chosen_config')}; "
              f"fastest {case.get('gemm_sweep_winner')}; vs reference {case['max_abs_vs_reference_in_ulps_of_max']:.2f} "
              f"ulp{'; sweep errors ' + str(case['gemm_sweep_errors']) if case.get('gemm_sweep_errors') else ''}")
        for name, t in case["timing"].items():
            print(f"   {name:<46} {t['median_ms']:9.3f} ms  {t['paired_speedup_median']:6.3f}x")
    for case in data.get("linear", []):
        if "error" in case:
            print(f"-- {case['shape']['K']}->{case['shape']['N']} {case['mode']}: FAILED (see JSON)")
    fw = data.get("forward_w81")
    if fw:
        t = fw["timing"]
        print(f"\n== Wan 1.3B W81 forward: dense {t['dense']['median_ms']:.1f} ms")
        for name, v in fw["variants"].items():
            tv = t[f"svdquant {name}"]
            print(f"   svdquant {name:<16} {tv['median_ms']:.1f} ms ({tv['paired_speedup_median']:.3f}x); latent rel L2 "
                  f"{v['latent_rel_l2_vs_dense']:.4f}; proof {v['execution_proof']['kinds']} fallbacks "
                  f"{v['execution_proof']['fallbacks']}; restored bitwise {v.get('restored_output_bitwise')}")
    mem = data.get("memory_14b")
    if mem:
        gib = 2.0**30
        with_p = mem["dit_device_bytes_with_svdquant"]
        print(f"\n== Wan 14B DiT device memory: dense {mem['dit_device_bytes_dense'] / gib:.2f} GiB, with svdquant "
              f"{(with_p or 0) / gib:.2f} GiB (ratio {mem['ratio']}); proof {mem['execution_proof_w17']['kinds']}")
    if data.get("errors"):
        print(f"\nFAILED sections: {sorted(data['errors'])}")
    if cases:
        print("\n== per-Linear at W81 FFN shapes, M = %d, rank %d (median ms; speedup paired vs bf16; goal >= 1.2x) =="
              % (cases[0]["shape"]["M"], cases[0]["rank"]))
        print("total = as the plugin runs it; sep / fused = quantizer and low-rank down separate / in one kernel")
        print(f"{'Linear':<11} {'mode':<8} {'bf16':>7} {'total':>7} {'speedup':>7} {'sep':>7} {'fused':>7} "
              f"{'GEMM':>7} {'quant':>7} "
              f"{'lowrank':>7} {'fp8 mm':>7} {'relL2 (RTN)':>16} {'bytes':>6} {'goal':>4}")
        for case in cases:
            print(_row(case))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "./bench_out"), help="directory for svdquant.json")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (torch reference)")
    p.add_argument("--interpret", action="store_true",
                   help="with --smoke and TRITON_INTERPRET=1: run the Triton kernels' rows on the CPU (plumbing only)")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32760)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--forward-rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--skip", nargs="*", default=[], choices=["linear", "forward_w81", "memory_14b"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                   help="residual scale groupings per Linear (channel = one scale per output channel)")
    p.add_argument("--forward-variants", nargs="+", default=["smoothed", "unsmoothed-ffn2"],
                   choices=list(FORWARD_VARIANTS), help="svdquant models timed against dense at W81 (same rounds)")
    p.add_argument("--forward-mode", default="channel", choices=list(MODES), help="grouping of the W81/14B artifacts")
    p.add_argument("--grouped-sweep", action="store_true", help="also time fixed tiles of the group-scale GEMM")
    p.add_argument("--with-w4a16", action="store_true", help="also time the W4A16 GEMM")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.smoke:
        args.rounds, args.forward_rounds, args.warmup, args.iters = 3, 3, 1, 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"provenance": shared_provenance(device, extra_packages=("triton", "diffusers"),
                                                            args=vars(args))}
    with tempfile.TemporaryDirectory(prefix="svdquant-bench-") as tmp:
        scratch = Path(tmp)
        sections = [("linear", lambda: linear_bench(device, args)),
                    ("forward_w81", lambda: forward_bench(device, args, scratch)),
                    ("memory_14b", lambda: memory_14b(device, args, scratch))]
        for name, fn in sections:
            if name not in args.skip:
                _run_section(data, name, fn, out)
    print_tables(data)
    print(f"\nwrote {out / 'svdquant.json'}")
    return 1 if data.get("errors") else 0


if __name__ == "__main__":
    raise SystemExit(main())
