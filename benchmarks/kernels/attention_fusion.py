"""GPU evidence for ``optimized_mha`` and ``wan_cross_kv_fusion``: fused projections, static K/V, SDPA backends.

One run does everything, in this order (each part is recorded even when a later one fails; the JSON is rewritten
after every part):

1. GEMM check at the Wan2.1-1.3B projection shapes (self Q/K/V: tokens x 1536 -> 3 x 1536; cross text K/V:
   512 x 1536 -> 2 x 1536) for W17 and W81: is one GEMM on the packed weight bitwise equal to the separate
   projections (``F.linear`` each), and how long do both take (interleaved paired rounds, medians).
2. Whole forward of the Wan2.1-T2V-1.3B architecture (random seeded weights, bf16, fp32 modules kept as diffusers
   keeps them) at W17 and W81, one model copy per variant (``attention_fusion_forward.py``): ``dense`` eager;
   ``optimized_mha`` (self qkv + cross kv, sdpa_backend torch; diffusers' fused-projection branch served from the
   packed storage); ``optimized_mha[wrappers]`` (the same packing through the projection-wrapper path, for
   comparison); diffusers ``fuse_qkv_projections()``; ``mha_self+static_kv`` (optimized_mha self-only +
   wan_cross_kv_fusion, steady state: the text K/V come from the per-request cache); ``mha_cudnn`` (self qkv with
   sdpa_backend cudnn, approximate); at W17 also ``optimized_mha[self]`` / ``optimized_mha[cross]`` (one kind
   each) and ``dense[copy]`` (a second dense instance: the cross-instance noise floor). Every variant carries a
   request guard, as in real use. W17: ``--w17-rounds`` interleaved rounds of ``--w17-iters`` forwards, paired
   ratio medians, a CPU-enqueue profile (CPU time until the forward returns vs its GPU time) telling whether the
   forward is launch-bound, a same-instance A/B (optimized_mha's fused branch on vs off in one model) and the CUDA
   kernels of one forward of dense / optimized_mha / diffusers' fusion (GEMM and copy time). Per variant: output bitwise equal to dense (or relative L2 when approximate), the
   plugins' receipts (fused / dense-fallback / cache counts, projection paths, bitwise verdicts), weight memory at
   install (requested bytes = true tensor bytes; allocated bytes = allocator blocks; parameter storage bytes),
   memory retained after the first forward, exact restore after uninstall.
3. One W81 self-attention layer (B1 H12 S32760 D128, bf16, the layout the Wan processor passes): SDPA with the
   flash, cuDNN and memory-efficient backends through ``worldfoundry.core.attention.sdpa_backends`` (a backend
   PyTorch rejects is reported, never silently replaced), relative L2 against an fp32 reference.

Random weights say nothing about visual quality; relative L2 figures only describe these weights.

Usage::

    python benchmarks/kernels/attention_fusion.py --out "$OUT"               # H200 (about 3-4 minutes)
    python benchmarks/kernels/attention_fusion.py --smoke --out /tmp/attn     # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from worldfoundry_optimized_mha.plugin import prepare as prepare_mha
from worldfoundry_wan_cross_kv_fusion.plugin import prepare as prepare_kv

from worldfoundry.bench.microbench import (
    SMOKE_WORKLOADS,
    WAN_1_3B,
    WAN_TINY,
    WORKLOADS,
    interleaved,
    rel_l2,
)
from worldfoundry.bench.microbench import provenance as shared_provenance
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.attention.fused_projection import (
    fused_linear,
    outputs_equal,
    separate_linears,
)
from worldfoundry.core.attention.sdpa_backends import scaled_dot_product_attention
from worldfoundry.errors import AttentionBackendError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_fusion_forward import (  # the sibling module of this script
    WRAPPERS_VARIANT,
    forward_bench,
)

ROOT = Path(__file__).resolve().parents[2]
TEXT_TOKENS = 512


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


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:+.1f} MiB"


def print_tables(data: dict[str, Any]) -> None:
    prov = data["provenance"]
    print(f"\n== attention fusion on {prov['gpu'] or prov['device']} (torch {prov['torch']}, diffusers "
          f"{prov['diffusers']}, {prov['dtype']}, rev {str(prov['git_revision'])[:10]}) ==")
    for name, error in data.get("errors", {}).items():
        print(f"  part {name} FAILED: {error.splitlines()[-1][:160]}")
    if "gemm" in data:
        print("GEMM: packed vs separate projections (median ms; paired speedup)")
        for row in data["gemm"]:
            t = row["timing"]
            print(f"  {row['shape']:16s} M={row['M']:6d} K={row['K']} N={row['N']}  bitwise={row['bitwise']!s:5s} "
                  f"separate {t['separate']['median_ms']:.3f}  fused {t['fused']['median_ms']:.3f} "
                  f"[{t['fused']['paired_speedup_median']:.3f}x]")
    if "forward" in data:
        _print_forward(data["forward"])
    if "sdpa" in data:
        sd = data["sdpa"]
        print(f"SDPA one self-attention layer {sd['shape']} ({sd['dtype']})")
        for name, t in sd["timing"].items():
            print(f"    {name:10s} {t['median_ms']:8.2f} ms  {t['tflops']:6.0f} TFLOP/s  "
                  f"rel L2 vs fp32 {sd['rel_l2_vs_fp32_reference'].get(name, float('nan')):.2e}")
        for name, reason in sd["rejected"].items():
            print(f"    {name:10s} rejected: {reason[:100]}")


def _print_forward(fw: dict[str, Any]) -> None:
    mem = fw["weight_memory"]
    print("forward (median ms, paired speedup vs dense: median [min..max]; bitwise / rel L2 vs dense)")
    for wname in WORKLOADS:
        e = fw.get(wname)
        if not e:
            continue
        meta = e["timing"]["_meta"]
        print(f"  {wname} ({e['tokens']} tokens; {meta['rounds']} rounds x {meta['iters_per_sample']} forwards, "
              f"gc collections while timing: {meta['gc_collections_during_timing']})")
        for name, t in e["timing"].items():
            if name.startswith("_"):
                continue
            eq = "" if name == "dense" else (" bitwise" if e["bitwise_vs_dense"][name]
                                              else f" rel L2 {e['rel_l2_vs_dense'][name]:.2e}")
            enq = e["cpu_enqueue"].get(name, {})
            gpu = enq.get("gpu_median_ms")
            enq_text = f"  enqueue {enq.get('cpu_enqueue_median_ms', float('nan')):7.2f}" + (
                f"/{gpu:.2f} ms" if gpu else " ms")
            extra = mem.get(name, {}).get("requested_bytes")
            print(f"    {name:24s} {t['median_ms']:9.2f}  {t['paired_speedup_median']:.3f}x "
                  f"[{t['paired_speedup_min']:.3f}..{t['paired_speedup_max']:.3f}]{enq_text}{eq}"
                  f"{'' if extra is None else '  weights ' + _mib(extra)}")
    print("  weight memory at install (requested = tensor bytes / allocated = allocator blocks / parameter storages):")
    for name, m in mem.items():
        print(f"    {name:24s} {_mib(m.get('requested_bytes'))} / {_mib(m.get('allocated_bytes'))} / "
              f"{_mib(m.get('parameter_storage_bytes'))}")
    retained = fw.get("retained_after_first_forward_bytes", {})
    if retained:
        print("  memory kept after the first W17 forward: " + ", ".join(f"{n} {_mib(b)}" for n, b in retained.items()))
    ab = fw.get("W17", {}).get("same_instance_ab")
    if ab and "paired_speedup_median" in ab:
        print(f"  W17 same instance, fused branch on vs off: {ab['branch_on_median_ms']:.2f} vs "
              f"{ab['branch_off_median_ms']:.2f} ms  {ab['paired_speedup_median']:.3f}x "
              f"[{ab['paired_speedup_min']:.3f}..{ab['paired_speedup_max']:.3f}]")
    kernels = fw.get("W17", {}).get("cuda_kernels", {})
    for name, k in kernels.items():
        if isinstance(k, dict) and "kernels_per_forward" in k:
            print(f"  W17 CUDA kernels {name:20s} {k['kernels_per_forward']:6.0f}/forward  "
                  f"{k['device_us_per_forward'] / 1e3:7.2f} ms  gemm {k['gemm']['kernels']:.0f} "
                  f"({k['gemm']['us'] / 1e3:.2f} ms)  copy {k['copy']['kernels']:.0f} ({k['copy']['us'] / 1e3:.2f} ms)")
        else:
            print(f"  W17 CUDA kernels {name}: {k}")
    paths = {n: r.get("optimized_mha", {}).get("projection_paths")
             for n, r in fw.get("W17", {}).get("receipts", {}).items()}
    print(f"  projection paths: {paths}")
    print(f"  restore after uninstall: {fw.get('restore')}")
    for name, reason in fw.get("failed", {}).items():
        if not name.endswith("_traceback"):
            print(f"  {name} failed: {reason[:160]}")


def _run_part(data: dict[str, Any], name: str, fn: Callable[[], Any], out: Path) -> None:
    """Run one part; a failure is recorded in the JSON instead of losing the run. The JSON is rewritten after it."""
    t0 = time.perf_counter()
    try:
        data[name] = fn()
    except Exception:  # noqa: BLE001 - recorded, the next part still runs
        data.setdefault("errors", {})[name] = traceback.format_exc()[-4000:]
    data.setdefault("part_wall_s", {})[name] = time.perf_counter() - t0
    (out / "attention_fusion.json").write_text(json.dumps(data, indent=2, default=str))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for attention_fusion.json (default $OUT)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds of the GEMM and SDPA parts")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--w17-rounds", type=int, default=15, help="interleaved rounds of whole forwards at W17")
    p.add_argument("--w17-iters", type=int, default=10, help="forwards per timed sample at W17")
    p.add_argument("--w81-rounds", type=int, default=5, help="interleaved rounds of whole forwards at W81")
    p.add_argument("--w81-iters", type=int, default=1, help="forwards per timed sample at W81")
    p.add_argument("--enqueue-samples", type=int, default=20,
                   help="single forwards per variant for the CPU-enqueue profile at W17 (W81: a sixth, at least 3)")
    p.add_argument("--gemm-iters", type=int, default=20)
    p.add_argument("--sdpa-iters", type=int, default=5)
    p.add_argument("--text-len", type=int, default=TEXT_TOKENS)
    p.add_argument("--variants", default="", help="comma-separated forward variants to time (default: all)")
    p.add_argument("--parts", default="gemm,forward,sdpa", help="comma-separated parts to run")
    args = p.parse_args(argv)
    if not args.out:
        p.error("--out is required (or set $OUT)")
    if min(args.rounds, args.w17_rounds, args.w81_rounds) < 3:
        p.error("--rounds, --w17-rounds and --w81-rounds must be at least 3")
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16
    if args.smoke:
        args.rounds = args.w17_rounds = args.w81_rounds = 3
        args.warmup, args.w17_iters, args.w81_iters, args.gemm_iters, args.sdpa_iters = 1, 1, 1, 2, 1
        args.enqueue_samples = 3
        args.text_len = min(args.text_len, 16)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"provenance": provenance(args, device, dtype), "variants_note": (
        f"{WRAPPERS_VARIANT} is optimized_mha with the projection-wrapper path forced on every site (the path "
        "used before the fused-branch path), for comparison in the same run")}
    t0 = time.perf_counter()
    parts = {part.strip() for part in args.parts.split(",")}
    if "gemm" in parts:
        _run_part(data, "gemm", lambda: gemm_check(device, dtype, args), out)
    if "forward" in parts:
        _run_part(data, "forward", lambda: forward_bench(device, dtype, args, registry()), out)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if "sdpa" in parts:
        _run_part(data, "sdpa", lambda: sdpa_bench(device, dtype, args), out)
    data["wall_s"] = time.perf_counter() - t0
    (out / "attention_fusion.json").write_text(json.dumps(data, indent=2, default=str))
    print_tables(data)
    print(f"\nwrote {out / 'attention_fusion.json'} ({data['wall_s']:.0f} s)")
    return 1 if data.get("errors") else 0


if __name__ == "__main__":
    raise SystemExit(main())
