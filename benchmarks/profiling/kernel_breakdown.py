#!/usr/bin/env python3
"""Where the device time of one Wan forward goes, by kernel class: eager against ``wan_block_fusion``.

For the Wan2.1-T2V-1.3B architecture (random seeded weights, bf16) at W17 and/or W81, one forward of each variant
runs under ``torch.profiler`` (after two warm-up forwards) and every CUDA kernel is put in a class by its name:
GEMM, attention, LayerNorm, RMSNorm, the fusion kernels (Triton), PyTorch elementwise, copies, reductions, other.
Per class: kernels and device ms per forward. The GEMMs and the attention kernels are the same in both variants
(the fusion is bitwise: it replaces pointwise chains only), so this shows how much device time an exact pointwise
fusion can still remove -- the floor of any bitwise replay of the fused forward (``cuda_graph`` on top of it).

    python benchmarks/profiling/kernel_breakdown.py --workloads W17 --out $OUT     # H200, about a minute
    python benchmarks/profiling/kernel_breakdown.py --smoke                          # tiny model, CPU: classes empty

Writes ``$OUT/kernel_breakdown.json`` (default ``./bench_out``) and prints one table per workload last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

from block_fusion import build, caller, inputs_for, registry  # benchmark helpers, same tree  # noqa: E402

from worldfoundry.bench.microbench import SMOKE_WORKLOADS, WORKLOADS, provenance  # noqa: E402
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations  # noqa: E402
from worldfoundry.core.fusion.compile_pool import set_default_compile_mode  # noqa: E402

#: (class, pattern on the lower-cased kernel name), first match wins
CLASSES: tuple[tuple[str, str], ...] = (
    ("attention", r"flash|fmha|sdpa|attention|cudnn"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|sm90_|splitk"),
    ("layer_norm", r"layer_norm|layernorm"),
    ("rms_norm", r"rms_norm|rmsnorm|fused_rms"),
    ("fusion (triton)", r"^_|triton"),
    ("copy", r"copy|memcpy|memset|cat_"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise"),
    ("reduction", r"reduce"),
)


def kernel_class(name: str) -> str:
    lowered = name.lower()
    for label, pattern in CLASSES:
        if re.search(pattern, lowered):
            return label
    return "other"


def profile_kernels(fn: Callable[[], Any], device: torch.device) -> list[tuple[str, int, float]]:
    """``(name, count, device ms)`` of every CUDA kernel of one call of ``fn`` (after two warm-up calls)."""
    if device.type != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    fn(), fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    return [(e.key, e.count, e.device_time_total / 1e3) for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def by_class(rows: list[tuple[str, int, float]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, count, ms in rows:
        entry = out.setdefault(kernel_class(name), {"kernels": 0, "ms": 0.0})
        entry["kernels"] += count
        entry["ms"] += ms
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["ms"]))


def one_workload(label: str, latent: tuple[int, int, int], smoke: bool, device: torch.device) -> dict[str, Any]:
    model = build("wan", smoke, device)
    inputs = inputs_for(model, "wan", latent, device)
    result: dict[str, Any] = {"latent": list(latent)}
    eager = profile_kernels(caller(model, inputs), device)
    session = install_diffusion_accelerations(model, {"wan_block_fusion": {}}, registry=registry())
    try:
        fused = profile_kernels(caller(model, inputs, request_id="profile"), device)
    finally:
        session.uninstall()
    for name, rows in (("eager", eager), ("block_fusion", fused)):
        result[name] = {"total_ms": sum(r[2] for r in rows), "kernels": sum(r[1] for r in rows),
                        "classes": by_class(rows),
                        "top": [(n[:140], c, ms) for n, c, ms in sorted(rows, key=lambda r: -r[2])[:25]]}
    return result


def table(label: str, result: dict[str, Any]) -> str:
    classes = list(dict.fromkeys([*result["eager"]["classes"], *result["block_fusion"]["classes"]]))
    lines = [f"{label} (latent {result['latent']})", "| class | eager kernels | eager ms | fused kernels | fused ms |",
             "|---|---|---|---|---|"]
    for c in classes:
        e = result["eager"]["classes"].get(c, {"kernels": 0, "ms": 0.0})
        f = result["block_fusion"]["classes"].get(c, {"kernels": 0, "ms": 0.0})
        lines.append(f"| {c} | {e['kernels']} | {e['ms']:.2f} | {f['kernels']} | {f['ms']:.2f} |")
    lines.append(f"| **total** | {result['eager']['kernels']} | {result['eager']['total_ms']:.2f} | "
                 f"{result['block_fusion']['kernels']} | {result['block_fusion']['total_ms']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--workloads", default="W17")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (no CUDA kernels to classify)")
    args = p.parse_args()
    set_default_compile_mode("blocking")  # kernels compile before a first fused call, never beside timing
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    shapes = SMOKE_WORKLOADS if args.smoke else WORKLOADS
    data: dict[str, Any] = {"provenance": provenance(device), "workloads": {}}
    for label in args.workloads.split(","):
        data["workloads"][label] = one_workload(label, shapes[label], args.smoke, device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_breakdown.json").write_text(json.dumps(data, indent=2, default=str))
    for label, result in data["workloads"].items():
        print(table(label, result))
        print("top fused kernels:")
        for name, count, ms in result["block_fusion"]["top"][:15]:
            print(f"  {ms:8.3f} ms  {count:5d}x  {name[:110]}")


if __name__ == "__main__":
    main()
