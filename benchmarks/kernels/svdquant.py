"""GPU evidence for ``svdquant``: W4A8 Linears at W81 FFN shapes, device bytes, the Wan W81 forward, 14B memory.

One run, each section guarded (a failure is recorded under ``errors``; the JSON is rewritten after every
section):

1. ``linear``: per FFN Linear at W81 shapes (M = 32,760 tokens; 1536 -> 8960 and 8960 -> 1536), bf16,
   rank 32, groups 64 and 128: bf16 ``F.linear`` vs the W4A8 Linear as the plugin runs it (per-token INT8
   activation quantization with smoothing + the low-rank down GEMM + the W4A8 GEMM with the fused low-rank up
   projection and bias), the W4A8 GEMM alone, the activation quantization alone, W4A8 without low-rank
   (rank 0), W4A16, and the anchor FP8 rowwise ``torch._scaled_mm`` (pre-quantized). Interleaved paired
   rounds, medians; rel L2 vs bf16 and agreement with the torch reference (within 2**-7 * max|ref|, i.e. one
   bfloat16 ulp); device bytes of the Linear dense vs SVDQuant (goal >= 3.5x smaller) and speed (goal >= 1.2x).
   Beside the autotuned GEMM (its pick is recorded), a small sweep of fixed configurations
   (:data:`GEMM_SWEEP`: tiles, orientation, stages, plain int8 unpacking; each checked against the autotuned
   output) and both activation-quantizer variants (single-pass / two-pass) are timed; the fastest GEMM is named.
2. ``forward_w81``: Wan2.1-T2V-1.3B architecture (random seeded weights, bf16) at W81: dense vs svdquant on
   the 60 FFN Linears (``blocks.*.ffn.0`` / ``ffn.2``; artifact calibrated here on random inputs at W17, rank 32,
   group 128, randomized SVD, ``keep_original: cpu``): forward ratio, latent rel L2, receipts (every Linear
   executed ``w4a8``, no fallback), device bytes of the model, exact restore after uninstall.
3. ``memory_14b``: Wan2.1-T2V-14B architecture (40 layers, dim 5120, 40 heads, FFN 13,824; random weights
   built directly on the GPU in bf16): device memory of the DiT with and without the plugin on the 80 FFN
   Linears (``keep_original: cpu``), and one W17 forward with receipts.

Random weights and random calibration inputs say nothing about visual quality: the rel L2 figures describe
these weights only.

Usage::

    python benchmarks/kernels/svdquant.py --out "$OUT"           # H200, about 4 minutes
    python benchmarks/kernels/svdquant.py --skip forward_w81 memory_14b --out "$OUT"   # per-Linear only
    python benchmarks/kernels/svdquant.py --smoke --out /tmp/sq   # CPU plumbing check (torch reference)
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


def _linear_case(device: torch.device, args: argparse.Namespace, m: int, k: int, n: int, group: int) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(k + n + group)
    w = (torch.randn(n, k, generator=g, device=device) * 0.02).to(torch.bfloat16)
    b = (torch.randn(n, generator=g, device=device) * 0.01).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
    x[:, :: max(1, k // 16)] *= 8.0  # a few outlier channels, as in real activations
    sq = pad_rank(decompose(w, rank=args.rank, group_size=group, act_absmax=x.float().abs().amax(0), svd="randomized"))
    rtn = decompose(w, rank=0, group_size=group)
    backend = "w4a8" if device.type == "cuda" else "reference"
    q, s = quantize_rows_int8(x, sq.inv_smooth) if device.type != "cuda" else triton_quantize_rows_int8(x, sq.inv_smooth)
    t = lowrank_down(x, sq)
    dense = F.linear(x, w, b)
    ref = w4a8_linear_reference(x, sq, b).float()
    out, used = svdquant_linear(x, sq, b, backend=backend)
    entry: dict[str, Any] = {
        "shape": {"M": m, "K": k, "N": n}, "group_size": group, "rank": args.rank, "backend": used.backend,
        "rel_l2_vs_bf16": {"w4a8": rel_l2(out.float(), dense.float()),
                           "w4a8_reference": rel_l2(ref, dense.float()),
                           "rtn_w4a8_reference": rel_l2(w4a8_linear_reference(x, rtn, b).float(), dense.float())},
        "max_abs_vs_reference_in_ulps_of_max": float((out.float() - ref).abs().max() / (ULP_TOL * ref.abs().max())),
    }
    entry["matches_reference"] = entry["max_abs_vs_reference_in_ulps_of_max"] <= 1.0
    dense_bytes = _bytes(w, b)
    quant_bytes = sq.nbytes + _bytes(b)
    entry["device_bytes"] = {"dense": dense_bytes, "svdquant": quant_bytes, "ratio": dense_bytes / quant_bytes}
    calls: dict[str, Callable[[], Any]] = {
        "bf16 F.linear": lambda: F.linear(x, w, b),
        "svdquant w4a8 (quant + low-rank + GEMM)": lambda: svdquant_linear(x, sq, b, backend=backend),
    }
    if device.type == "cuda":
        calls["w4a8 GEMM only"] = lambda: triton_w4a8_gemm(q, s, sq, t, b)
        calls["int8 act quant only"] = lambda: triton_quantize_rows_int8(x, sq.inv_smooth)
        calls["low-rank down x.D^T only"] = lambda: lowrank_down(x, sq)
        calls["int8 act quant two-pass"] = lambda: triton_quantize_rows_int8(x, sq.inv_smooth, single_pass=False)
        if k <= 16384:
            calls["int8 act quant single-pass"] = lambda: triton_quantize_rows_int8(x, sq.inv_smooth,
                                                                                    single_pass=True)
        calls.update(_gemm_sweep(q, s, sq, t, b, entry))
        calls["w4a8 rank 0 (quant + GEMM)"] = lambda: svdquant_linear(x, rtn, b, backend="w4a8")
        calls["svdquant w4a16"] = lambda: svdquant_linear(x, sq, b, backend="w4a16")
        try:
            from worldfoundry.core.acceleration.quantization.fp8_linear import (
                quantize_weight_rowwise_fp8,
                scaled_mm_rowwise,
            )
            from worldfoundry.core.acceleration.quantization.fp8 import quantize_rowwise_fp8

            w8 = quantize_weight_rowwise_fp8(w)
            xq8, xs8 = quantize_rowwise_fp8(x)
            calls["anchor fp8 _scaled_mm only"] = lambda: scaled_mm_rowwise(xq8, xs8, w8, b)
        except Exception as exc:  # an anchor that cannot run is recorded, not fatal
            entry["fp8_anchor_error"] = repr(exc)
    for fn in calls.values():  # compile + autotune outside the timed rounds
        fn()
    sync(device)
    entry["timing"] = interleaved(calls, device, rounds=args.rounds, warmup=args.warmup, iters=args.iters,
                                  baseline="bf16 F.linear")
    main_row = entry["timing"]["svdquant w4a8 (quant + low-rank + GEMM)"]
    entry["gemm_sweep_winner"] = _sweep_winner(entry["timing"])
    entry["goals"] = {"speed_ge_1.2x": main_row["paired_speedup_median"] >= 1.2,
                      "bytes_ge_3.5x_smaller": entry["device_bytes"]["ratio"] >= 3.5}
    return entry


#: Fixed W4A8 GEMM configurations timed beside the autotuned one (``ASM: False`` = plain int8 unpacking).
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


def _gemm_sweep(q: torch.Tensor, s: torch.Tensor, sq: Any, t: torch.Tensor, b: torch.Tensor,
                entry: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """Timed calls for :data:`GEMM_SWEEP` whose output matches the autotuned GEMM within one bf16 ulp of max.

    A configuration that fails to compile or to match is recorded in ``entry["gemm_sweep_errors"]``.
    """
    from worldfoundry.core.acceleration.kernels import w4a8_gemm

    tuned = triton_w4a8_gemm(q, s, sq, t, b).float()
    best = getattr(w4a8_gemm._w4a8_tuned, "best_config", None)
    entry["autotuned_config"] = None if best is None else {**best.kwargs, "num_warps": best.num_warps,
                                                            "num_stages": best.num_stages}
    calls: dict[str, Callable[[], Any]] = {}
    for name, cfg in GEMM_SWEEP.items():
        try:
            out = triton_w4a8_gemm(q, s, sq, t, b, config=cfg).float()
            err = float((out - tuned).abs().max() / (ULP_TOL * tuned.abs().max()))
            if err > 1.0:
                raise AssertionError(f"differs from the autotuned GEMM by {err:.2f} ulp of max")
            calls[SWEEP_PREFIX + name] = lambda cfg=cfg: triton_w4a8_gemm(q, s, sq, t, b, config=cfg)
        except Exception as exc:  # a configuration that cannot run is recorded, the rest still run
            entry.setdefault("gemm_sweep_errors", {})[name] = repr(exc)
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
    return [_linear_case(device, args, m, k, n, group) for k, n in dims for group in (64, 128)]


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


def calibrate_random(model: nn.Module, inputs: dict[str, Any], out: Path, *, group: int, rank: int) -> Path:
    """Artifact for ``model`` calibrated on one forward of random ``inputs`` (randomized SVD)."""
    selected = select_for_calibration(model, INCLUDE)
    with InputAbsmaxObserver(selected) as obs, torch.inference_mode():
        model(**inputs)
    manifest, tensors = build_svdquant_artifact(model, selected, obs.absmax, rank=rank, group_size=group,
                                                svd="randomized", include=INCLUDE, observer=obs,
                                                calibration={"inputs": "random (seeded)", "seeds": [11]})
    return save_svdquant_artifact(manifest, tensors, out)


def _group(device: torch.device) -> int:
    return 128 if device.type == "cuda" else 64  # the CPU smoke model has 64 input features


def _infer(model: nn.Module, inputs: dict[str, Any]) -> Any:
    with torch.inference_mode():
        return model(**inputs)


def _install(model: nn.Module, artifact: Path, keep: str) -> Any:
    spec = {"svdquant": {"artifact": str(artifact), "keep_original": keep}}
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


def forward_bench(device: torch.device, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    config = WAN_1_3B if device.type == "cuda" else WAN_TINY
    workloads = WORKLOADS if device.type == "cuda" else SMOKE_WORKLOADS
    dense = build_wan(config, device)
    artifact = calibrate_random(dense, wan_inputs(workloads["W17"], config["text_dim"], device, seed=11),
                                scratch / "wan13b.json", group=_group(device), rank=args.rank)
    model = copy.deepcopy(dense)
    inputs = wan_inputs(workloads["W81"], config["text_dim"], device)
    with torch.inference_mode():
        ref = dense(**inputs)[0].float()
    torch.cuda.empty_cache() if device.type == "cuda" else None
    alloc_before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    session = _install(model, artifact, "cpu")
    alloc_after = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    proof = _proof(session, model, inputs, "w81-proof")
    with torch.inference_mode():
        out = model(**inputs)[0].float()
    report = session.execution_report()["plugins"]["svdquant"]["model"]["svdquant"]
    entry: dict[str, Any] = {"workload": "W81", "latent": list(workloads["W81"]), "artifact": str(artifact),
                             "latent_rel_l2_vs_dense": rel_l2(out, ref), "execution_proof": proof,
                             "memory_report": report["memory"],
                             "device_allocated_delta_on_install_bytes": alloc_after - alloc_before}
    calls = {"dense": lambda: _infer(dense, inputs), "svdquant": lambda: _infer(model, inputs)}
    entry["timing"] = interleaved(calls, device, rounds=args.forward_rounds, warmup=1, iters=1, baseline="dense")
    session.uninstall()
    with torch.inference_mode():
        after = model(**inputs)[0].float()
    entry["restored_output_bitwise"] = bool(torch.equal(after, ref))
    entry["restored_state_bitwise"] = all(torch.equal(a, b) for a, b in zip(
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
                                scratch / "wan14b.json", group=_group(device), rank=args.rank)
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


def print_tables(data: dict[str, Any]) -> None:
    print("\n== per-Linear at W81 FFN shapes (median ms; paired speedup vs bf16 F.linear) ==")
    for case in data.get("linear", []):
        s = case["shape"]
        print(f"-- {s['K']}->{s['N']} M={s['M']} group {case['group_size']} rank {case['rank']} "
              f"backend {case['backend']}: rel L2 vs bf16 svdquant {case['rel_l2_vs_bf16']['w4a8']:.4f} "
              f"(rtn {case['rel_l2_vs_bf16']['rtn_w4a8_reference']:.4f}); vs reference "
              f"{case['max_abs_vs_reference_in_ulps_of_max']:.2f} ulp; bytes {case['device_bytes']['ratio']:.2f}x "
              f"smaller; goals {case['goals']}")
        for name, t in case["timing"].items():
            print(f"   {name:<46} {t['median_ms']:9.3f} ms  {t['paired_speedup_median']:6.3f}x")
        if case.get("gemm_sweep_winner"):
            print(f"   fastest GEMM: {case['gemm_sweep_winner']['name']} (autotuned: {case.get('autotuned_config')})"
                  f"{'; sweep errors ' + str(case['gemm_sweep_errors']) if case.get('gemm_sweep_errors') else ''}")
    fw = data.get("forward_w81")
    if fw:
        t = fw["timing"]
        print(f"\n== Wan 1.3B W81 forward: dense {t['dense']['median_ms']:.1f} ms, svdquant "
              f"{t['svdquant']['median_ms']:.1f} ms ({t['svdquant']['paired_speedup_median']:.3f}x); latent rel L2 "
              f"{fw['latent_rel_l2_vs_dense']:.4f}; proof {fw['execution_proof']['kinds']} fallbacks "
              f"{fw['execution_proof']['fallbacks']}; restored bitwise {fw['restored_output_bitwise']}")
    mem = data.get("memory_14b")
    if mem:
        gib = 2.0**30
        with_p = mem["dit_device_bytes_with_svdquant"]
        print(f"\n== Wan 14B DiT device memory: dense {mem['dit_device_bytes_dense'] / gib:.2f} GiB, with svdquant "
              f"{(with_p or 0) / gib:.2f} GiB (ratio {mem['ratio']}); proof {mem['execution_proof_w17']['kinds']}")
    if data.get("errors"):
        print(f"\nFAILED sections: {sorted(data['errors'])}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "./bench_out"), help="directory for svdquant.json")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (torch reference)")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32760)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--forward-rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--skip", nargs="*", default=[], choices=["linear", "forward_w81", "memory_14b"])
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
