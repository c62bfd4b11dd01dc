"""GPU evidence for ``optimized_mha`` and ``wan_cross_kv_fusion``: fused projections, static K/V, SDPA backends.

One run does everything, in this order:

1. GEMM check at the Wan2.1-1.3B projection shapes (self Q/K/V: tokens x 1536 -> 3 x 1536; cross text K/V:
   512 x 1536 -> 2 x 1536) for W17 and W81: is one GEMM on the packed weight bitwise equal to the separate
   projections (``F.linear`` each), and how long do both take (interleaved paired rounds, medians).
2. Whole forward of the Wan2.1-T2V-1.3B architecture (random seeded weights, bf16, fp32 modules kept as diffusers
   keeps them) at W17 and W81, one model copy per variant, interleaved paired rounds, medians:
   ``dense`` eager; ``optimized_mha`` (self qkv + cross kv, sdpa_backend torch); diffusers
   ``fuse_qkv_projections()``; ``mha_self+static_kv`` (optimized_mha self-only + wan_cross_kv_fusion, steady
   state: the text K/V come from the per-request cache); ``mha_cudnn`` (self qkv with sdpa_backend cudnn,
   approximate). Per variant: output bitwise equal to dense (or relative L2 when approximate), the plugins'
   receipts (fused / dense-fallback / cache counts, bitwise verdicts), weight memory delta at install
   (``torch.cuda.memory_allocated`` before/after), exact restore after uninstall.
3. One W81 self-attention layer (B1 H12 S32760 D128, bf16, the layout the Wan processor passes): SDPA with the
   flash, cuDNN and memory-efficient backends through ``worldfoundry.core.attention.sdpa_backends`` (a backend
   PyTorch rejects is reported, never silently replaced), relative L2 against an fp32 reference.

Random weights say nothing about visual quality; relative L2 figures only describe these weights.

Usage::

    python benchmarks/kernels/attention_fusion.py --out "$OUT"               # H200 (about 2 minutes)
    python benchmarks/kernels/attention_fusion.py --smoke --out /tmp/attn     # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from worldfoundry_optimized_mha.plugin import prepare as prepare_mha
from worldfoundry_wan_cross_kv_fusion.plugin import prepare as prepare_kv

from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.attention.fused_projection import fused_linear, outputs_equal, separate_linears
from worldfoundry.core.attention.sdpa_backends import scaled_dot_product_attention
from worldfoundry.core.model_loading.dtypes import apply_dtype_policy
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.bench.microbench import provenance as shared_provenance
from worldfoundry.bench.microbench import (  # noqa: E402 - shared benchmark helpers
    RANDOM_NOTE,
    SMOKE_WORKLOADS,
    WAN_1_3B,
    WAN_TINY,
    WORKLOADS,
    interleaved,
    rel_l2,
    sync,
)
from worldfoundry.errors import AttentionBackendError, WorldFoundryError

ROOT = Path(__file__).resolve().parents[2]
TEXT_TOKENS = 512


# ---------------------------------------------------------------------------------------------- models
def build_wan(config: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    with torch.device(device):
        model = WanTransformer3DModel(**config)
    return apply_dtype_policy(model, dtype).eval()


def make_inputs(config: dict[str, Any], latent: tuple[int, int, int], text_len: int, device: torch.device,
                dtype: torch.dtype, seed: int = 7) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(seed)
    f, h, w = latent
    return {"hidden_states": torch.randn(1, 16, f, h, w, generator=g, device=device).to(dtype),
            "timestep": torch.tensor([500], device=device),
            "encoder_hidden_states": torch.randn(1, text_len, config["text_dim"], generator=g, device=device).to(dtype),
            "return_dict": False}


def allocated(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    sync(device)
    return torch.cuda.memory_allocated(device)


def registry() -> AccelerationRegistry:
    reg = AccelerationRegistry(discover=False)
    reg.register("optimized_mha", prepare_mha)
    reg.register("wan_cross_kv_fusion", prepare_kv)
    return reg


# ---------------------------------------------------------------------------------------------- 1. GEMMs
def gemm_check(device: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> list[dict[str, Any]]:
    config = WAN_TINY if args.smoke else WAN_1_3B
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    workloads = SMOKE_WORKLOADS if args.smoke else WORKLOADS
    shapes = [(f"{w} self qkv", f * (h // 2) * (wd // 2), 3) for w, (f, h, wd) in workloads.items()]
    shapes.append(("cross text kv", args.text_len, 2))
    rows = []
    g = torch.Generator(device=device).manual_seed(3)
    for name, tokens, parts in shapes:
        weights = [torch.randn(dim, dim, generator=g, device=device).mul_(dim ** -0.5).to(dtype) for _ in range(parts)]
        biases = [torch.randn(dim, generator=g, device=device).mul_(0.02).to(dtype) for _ in range(parts)]
        packed_w, packed_b = torch.cat(weights), torch.cat(biases)
        x = torch.randn(1, tokens, dim, generator=g, device=device).to(dtype)
        splits = [dim] * parts

        def separate(x: torch.Tensor = x, weights: list[torch.Tensor] = weights,
                     biases: list[torch.Tensor] = biases) -> tuple[torch.Tensor, ...]:
            return separate_linears(x, weights, biases)

        def fused(x: torch.Tensor = x, w: torch.Tensor = packed_w, b: torch.Tensor = packed_b,
                  splits: list[int] = splits) -> tuple[torch.Tensor, ...]:
            return fused_linear(x, w, b, splits)

        with torch.no_grad():
            bitwise = outputs_equal(fused(), separate())
            timing = interleaved({"separate": separate, "fused": fused},
                                 device, rounds=args.rounds, warmup=args.warmup, iters=args.gemm_iters,
                                 baseline="separate")
        rows.append({"shape": name, "M": tokens, "K": dim, "N": parts * dim, "bitwise": bitwise, "timing": timing})
    return rows


# ---------------------------------------------------------------------------------------------- 2. forward
def _record(session: Any, plugin: str, request_id: str) -> dict[str, Any]:
    reports = session.execution_report()["plugins"][plugin]["model"]
    record = reports["requests"].get(request_id, {})
    return {"counters": record.get("counters", {}), "fallbacks": record.get("fallbacks", {}),
            "claimed_not_executed": record.get("claimed_not_executed", []),
            "bitwise_checks": {k: v.get("bitwise_checks") for k, v in reports.get("packed_groups", {}).items()
                               if k.startswith("blocks.0.")}}


def forward_bench(device: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> dict[str, Any]:
    config = WAN_TINY if args.smoke else WAN_1_3B
    workloads = SMOKE_WORKLOADS if args.smoke else WORKLOADS
    approx_backend = "math" if device.type == "cpu" else "cudnn"
    policy = RuntimePolicy(device=device, dtype=dtype)
    reg = registry()
    dense = build_wan(config, device, dtype)
    specs: dict[str, dict[str, Any]] = {
        "optimized_mha": {"optimized_mha": {"self": {"fusion": "qkv"}, "cross": {"fusion": "kv"}}},
        "mha_self+static_kv": {"optimized_mha": {"self": {"fusion": "qkv"}},
                               "wan_cross_kv_fusion": {"min_tokens": min(256, args.text_len)}},
        f"mha_{approx_backend}": {"optimized_mha": {"self": {"fusion": "qkv", "sdpa_backend": approx_backend}}},
    }
    models: dict[str, nn.Module] = {"dense": dense}
    sessions: dict[str, Any] = {}
    result: dict[str, Any] = {"config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()},
                              "note": RANDOM_NOTE, "weight_memory_delta_bytes": {}, "install_receipts": {}}
    copies = {name: copy.deepcopy(dense) for name in [*specs, "diffusers_fuse_qkv"]}
    result["failed"] = {}
    for name, spec in specs.items():
        before = allocated(device)
        try:
            sessions[name] = install_diffusion_accelerations(copies[name], spec, policy, registry=reg)
        except WorldFoundryError as exc:  # reported, the other variants still run
            result["failed"][name] = f"install: {type(exc).__name__}: {exc}"
            continue
        after = allocated(device)
        result["weight_memory_delta_bytes"][name] = None if before is None else after - before
        result["install_receipts"][name] = sessions[name].receipt.to_json()
        models[name] = copies[name]
    before = allocated(device)
    copies["diffusers_fuse_qkv"].fuse_qkv_projections()
    after = allocated(device)
    result["weight_memory_delta_bytes"]["diffusers_fuse_qkv"] = None if before is None else after - before
    models["diffusers_fuse_qkv"] = copies["diffusers_fuse_qkv"]
    order = [n for n in ("dense", "optimized_mha", "diffusers_fuse_qkv", "mha_self+static_kv",
                         f"mha_{approx_backend}") if n in models]

    for wname, latent in workloads.items():
        inputs = make_inputs(config, latent, args.text_len, device, dtype)
        f, h, w = latent
        entry: dict[str, Any] = {"latent": list(latent), "tokens": f * (h // 2) * (w // 2),
                                 "text_tokens": args.text_len}

        def call(name: str, request_id: str, inputs: dict[str, Any] = inputs) -> Callable[[], Any]:
            model = models[name]

            def run() -> Any:
                with request_scope(RequestContext(request_id, "cond", 0)):
                    return model(**inputs)[0]

            return run

        with torch.no_grad():
            outputs = {}
            for name in list(order):
                rid = f"{wname}-proof"
                try:
                    outputs[name] = call(name, rid)()
                    if name == "mha_self+static_kv":  # second call: the text K/V now come from the cache
                        outputs[name] = call(name, rid)()
                except AttentionBackendError as exc:  # a backend PyTorch rejects for these shapes: reported
                    result["failed"][f"{name}@{wname}"] = str(exc)
                    order.remove(name)
            ref = outputs["dense"]
            entry["bitwise_vs_dense"] = {n: bool(torch.equal(o, ref)) for n, o in outputs.items() if n != "dense"}
            entry["rel_l2_vs_dense"] = {n: rel_l2(o, ref) for n, o in outputs.items() if n != "dense"}
            entry["finite"] = {n: bool(torch.isfinite(o).all()) for n, o in outputs.items()}
            entry["receipts"] = {n: {p: _record(s, p, f"{wname}-proof") for p in s.names} for n, s in sessions.items()
                                 if n in order}
            del outputs, ref
            calls = {n: call(n, f"{wname}-timing") for n in order}
            entry["timing"] = interleaved(calls, device, rounds=args.rounds, warmup=args.warmup,
                                          iters=args.w81_iters if wname == "W81" else args.w17_iters, baseline="dense")
        result[wname] = entry

    # exact restore: after uninstall every plugin copy equals the dense model again (output and state dict)
    inputs = make_inputs(config, workloads["W17"], args.text_len, device, dtype)
    with torch.no_grad():
        ref = dense(**inputs)[0]
        restore = {}
        for name, session in sessions.items():
            session.uninstall()
            model = models[name]
            sd_a, sd_b = dense.state_dict(), model.state_dict()
            storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
            restore[name] = {"output_bitwise": bool(torch.equal(model(**inputs)[0], ref)),
                             "state_dict_bitwise": list(sd_a) == list(sd_b)
                             and all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a),
                             "separate_storages": len(storages) == len(list(model.parameters()))}
    result["restore"] = restore
    return result


# ---------------------------------------------------------------------------------------------- 3. SDPA
def sdpa_bench(device: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> dict[str, Any]:
    heads, head_dim = (2, 32) if args.smoke else (12, 128)
    tokens = 384 if args.smoke else 32760
    g = torch.Generator(device=device).manual_seed(11)
    # The Wan processor hands SDPA (B, H, S, D) views of (B, S, H, D) projections.
    q, k, v = (torch.randn(1, tokens, heads, head_dim, generator=g, device=device).to(dtype).permute(0, 2, 1, 3)
               for _ in range(3))
    backends = ["flash", "math"] if device.type == "cpu" else ["flash", "cudnn", "efficient"]
    result: dict[str, Any] = {"shape": [1, heads, tokens, head_dim], "dtype": str(dtype).removeprefix("torch."),
                              "layout": "permuted (B,S,H,D) views, as the Wan processor passes them"}
    with torch.no_grad():
        reference = scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                 backend="math" if device.type == "cpu" else "efficient")
        available, errors, quality = [], {}, {}
        outputs = {}
        for backend in backends:
            try:
                outputs[backend] = scaled_dot_product_attention(q, k, v, backend=backend)
                available.append(backend)
                quality[backend] = rel_l2(outputs[backend], reference)
            except AttentionBackendError as exc:
                errors[backend] = str(exc)
        if "flash" in outputs:
            for backend, out in outputs.items():
                if backend != "flash":
                    quality[f"{backend}_vs_flash"] = rel_l2(out, outputs["flash"])
        del outputs, reference
        calls = {b: (lambda b=b: scaled_dot_product_attention(q, k, v, backend=b)) for b in available}
        timing = interleaved(calls, device, rounds=args.rounds, warmup=args.warmup, iters=args.sdpa_iters,
                             baseline=available[0]) if available else {}
    flops = 4 * heads * tokens * tokens * head_dim
    for t in timing.values():
        t["tflops"] = flops / (t["median_ms"] * 1e-3) / 1e12
    result.update({"rel_l2_vs_fp32_reference": quality, "rejected": errors, "timing": timing})
    return result


# ---------------------------------------------------------------------------------------------- report
def provenance(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    return shared_provenance(device, dtype=str(dtype).removeprefix("torch."), args=vars(args))


def print_tables(data: dict[str, Any]) -> None:
    prov = data["provenance"]
    print(f"\n== attention fusion on {prov['gpu'] or prov['device']} (torch {prov['torch']}, diffusers "
          f"{prov['diffusers']}, {prov['dtype']}, rev {str(prov['git_revision'])[:10]}) ==")
    print("GEMM: packed vs separate projections (median ms; paired speedup)")
    for row in data["gemm"]:
        t = row["timing"]
        print(f"  {row['shape']:16s} M={row['M']:6d} K={row['K']} N={row['N']}  bitwise={row['bitwise']!s:5s} "
              f"separate {t['separate']['median_ms']:.3f}  fused {t['fused']['median_ms']:.3f} "
              f"[{t['fused']['paired_speedup_median']:.3f}x]")
    fw = data["forward"]
    mem = fw["weight_memory_delta_bytes"]
    print("forward (median ms, paired speedup vs dense [min..max]; bitwise / rel L2 vs dense)")
    for wname in WORKLOADS:
        e = fw.get(wname)
        if not e:
            continue
        print(f"  {wname} ({e['tokens']} tokens)")
        for name, t in e["timing"].items():
            eq = "" if name == "dense" else (" bitwise" if e["bitwise_vs_dense"][name]
                                              else f" rel L2 {e['rel_l2_vs_dense'][name]:.2e}")
            extra = mem.get(name)
            extra_text = "" if extra is None else f"  +{extra / 2**20:.1f} MiB weights"
            print(f"    {name:20s} {t['median_ms']:9.2f}  {t['paired_speedup_median']:.3f}x "
                  f"[{t['paired_speedup_min']:.3f}..{t['paired_speedup_max']:.3f}]{eq}{extra_text}")
    print(f"  restore after uninstall: {fw['restore']}")
    for name, reason in fw.get("failed", {}).items():
        print(f"  {name} failed: {reason[:120]}")
    sd = data["sdpa"]
    print(f"SDPA one self-attention layer {sd['shape']} ({sd['dtype']})")
    for name, t in sd["timing"].items():
        print(f"    {name:10s} {t['median_ms']:8.2f} ms  {t['tflops']:6.0f} TFLOP/s  "
              f"rel L2 vs fp32 {sd['rel_l2_vs_fp32_reference'].get(name, float('nan')):.2e}")
    for name, reason in sd["rejected"].items():
        print(f"    {name:10s} rejected: {reason[:100]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for attention_fusion.json (default $OUT)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--w17-iters", type=int, default=5, help="forwards per timed sample at W17")
    p.add_argument("--w81-iters", type=int, default=1, help="forwards per timed sample at W81")
    p.add_argument("--gemm-iters", type=int, default=20)
    p.add_argument("--sdpa-iters", type=int, default=5)
    p.add_argument("--text-len", type=int, default=TEXT_TOKENS)
    args = p.parse_args(argv)
    if not args.out:
        p.error("--out is required (or set $OUT)")
    if args.rounds < 3:
        p.error("--rounds must be at least 3")
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16
    if args.smoke:
        args.rounds, args.warmup, args.w17_iters, args.w81_iters, args.gemm_iters, args.sdpa_iters = 3, 1, 1, 1, 2, 1
        args.text_len = min(args.text_len, 16)
    data: dict[str, Any] = {"provenance": provenance(args, device, dtype)}
    t0 = time.perf_counter()
    data["gemm"] = gemm_check(device, dtype, args)
    data["forward"] = forward_bench(device, dtype, args)
    data["sdpa"] = sdpa_bench(device, dtype, args)
    data["wall_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_fusion.json").write_text(json.dumps(data, indent=2, default=str))
    print_tables(data)
    print(f"\nwrote {out / 'attention_fusion.json'} ({data['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
