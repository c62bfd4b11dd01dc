"""Wan2.1-1.3B forward: eager vs ``cuda_graph`` vs torch.compile regional, and ``cuda_graph`` over the static K/V
of ``wan_cross_kv_fusion``, in one process.

Per workload (W17: latent 1x16x5x40x72; W81: 1x16x21x60x104; text 1x512x4096; random seeded weights, bf16 with
diffusers' fp32 modules kept): every variant is a deep copy of one dense model with its request guard, called inside
one open request (so the static K/V variants serve their cache after the first call: the steady state of a denoising
step; the dense template itself is never guarded or called). A proof phase times the first calls (capture, compile warm-up), checks each variant against its anchor
(``cuda_graph`` bitwise vs eager, ``cuda_graph+static_kv`` bitwise vs ``static_kv`` eager and vs eager, compile by
relative L2) and records the device memory each variant added and the graph pool bytes; then interleaved paired
rounds (rotating order, warm-up excluded, the garbage collector frozen) give median times and paired ratios vs
eager. W81 runs eager and ``cuda_graph`` only (GPU-bound: ~1.0x expected).

Goals checked at the end: W17 ``cuda_graph`` >= 1.30x eager, bitwise; capture <= 2 s per signature.

Usage (H200)::

    python benchmarks/kernels/cuda_graph.py                 # W17 + W81, torch.compile included (~4 min)
    python benchmarks/kernels/cuda_graph.py --skip-compile  # without the compile anchor (~1 min)
    python benchmarks/kernels/cuda_graph.py --smoke         # CPU, tiny model, the CPU replay executor

Writes ``$OUT/cuda_graph.json`` (``$OUT`` defaults to ``./bench_out``) and prints a table last.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn
from worldfoundry_cuda_graph.plugin import make_prepare
from worldfoundry_wan_cross_kv_fusion.plugin import prepare as static_kv_prepare

from worldfoundry.bench.microbench import (
    RANDOM_NOTE,
    SMOKE_WORKLOADS,
    WAN_1_3B,
    WAN_TINY,
    WORKLOADS,
    interleaved,
    provenance,
    rel_l2,
    sync,
)
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.cuda_graph import CudaGraphBackend, EagerReplayBackend
from worldfoundry.core.acceleration.guard import attach_request_guard, get_request_guard
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.model_loading.dtypes import apply_dtype_policy

TEXT_TOKENS = 512
SPECS: dict[str, dict[str, Any]] = {
    "cuda_graph": {"cuda_graph": {}},
    "static_kv": {"wan_cross_kv_fusion": {}},
    "cuda_graph+static_kv": {"cuda_graph": {}, "wan_cross_kv_fusion": {}},
}
#: variant -> the variant it must equal bitwise
ANCHORS = {"cuda_graph": "eager", "static_kv": "eager", "cuda_graph+static_kv": "static_kv"}
GOAL_SPEEDUP = 1.30
GOAL_CAPTURE_S = 2.0


def build_wan(config: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    with torch.device(device):
        model = WanTransformer3DModel(**config)
    return apply_dtype_policy(model, dtype).eval()


def make_inputs(latent: tuple[int, int, int], text_dim: int, device: torch.device, dtype: torch.dtype,
                text_tokens: int) -> dict[str, Any]:
    g = torch.Generator(device="cpu").manual_seed(1)
    return {"hidden_states": torch.randn(1, 16, *latent, generator=g).to(device, dtype),
            "timestep": torch.tensor([500.0], device=device),
            "encoder_hidden_states": torch.randn(1, text_tokens, text_dim, generator=g).to(device, dtype),
            "return_dict": False}


class Variant:
    """One model copy called inside one open request."""

    def __init__(self, name: str, model: nn.Module, inputs: dict[str, Any]) -> None:
        self.name = name
        self.model = model
        self.inputs = inputs
        self.guard = get_request_guard(model) or attach_request_guard(model)
        self.request_id = f"bench-{name}"
        self.guard.begin_request(self.request_id)
        self.ctx = RequestContext(self.request_id, "cond", 0, 500.0)

    def __call__(self) -> torch.Tensor:
        with request_scope(self.ctx):
            return self.model(**self.inputs)[0]

    def close(self) -> None:
        if self.request_id in self.guard.active_request_ids():
            self.guard.end_request(self.request_id)


def graph_report(model: nn.Module) -> dict[str, Any] | None:
    session = getattr(model, "_worldfoundry_accelerations", None)
    if session is None or "cuda_graph" not in session.names:
        return None
    return session.execution_report()["plugins"]["cuda_graph"]["model"]["graphs"]


def build_variants(workload: str, dense: nn.Module, inputs: dict[str, Any], registry: AccelerationRegistry,
                   args: argparse.Namespace, failures: list[str]) -> dict[str, Variant]:
    names = ["cuda_graph"] if workload == "W81" else ["static_kv", "cuda_graph", "cuda_graph+static_kv"]
    variants = {"eager": Variant("eager", copy.deepcopy(dense), inputs)}
    for name in names:
        try:
            model = copy.deepcopy(dense)
            spec = dict(SPECS[name])
            if args.smoke and "wan_cross_kv_fusion" in spec:  # the smoke prompt is shorter than min_tokens
                spec["wan_cross_kv_fusion"] = {"min_tokens": 0}
            install_diffusion_accelerations(model, spec, registry=registry)
            variants[name] = Variant(name, model, inputs)
        except Exception as exc:  # one variant failing must not stop the others
            failures.append(f"{workload} {name}: install failed: {type(exc).__name__}: {exc}")
            traceback.print_exc()
    if workload == "W17" and not args.skip_compile:
        try:
            model = copy.deepcopy(dense)
            model.compile_repeated_blocks(fullgraph=True)
            variants["compile_regional"] = Variant("compile_regional", model, inputs)
        except Exception as exc:
            failures.append(f"{workload} compile_regional: {type(exc).__name__}: {exc}")
            traceback.print_exc()
    return variants


def host_checks_us(variant: Variant, n: int = 200) -> dict[str, float]:
    """Microseconds per call of the graph runner's per-call checks on this model (the state watch, the signature)."""
    from worldfoundry.core.acceleration.cuda_graph import call_signature

    runner = variant.model._worldfoundry_accelerations.handles("cuda_graph")["model"].runner
    out: dict[str, float] = {}
    if runner._watch is not None:
        start = time.perf_counter()
        for _ in range(n):
            runner._watch.check()
        out["state_watch"] = (time.perf_counter() - start) / n * 1e6
    start = time.perf_counter()
    for _ in range(n):
        call_signature((), variant.inputs)
    out["signature"] = (time.perf_counter() - start) / n * 1e6
    return out


def prove(workload: str, variants: dict[str, Variant], device: torch.device,
          failures: list[str]) -> dict[str, dict[str, Any]]:
    """First calls (timed), steady-state outputs, checks against the anchors, memory."""
    proofs: dict[str, dict[str, Any]] = {}
    outputs: dict[str, torch.Tensor] = {}
    for name, variant in list(variants.items()):
        try:
            sync(device)
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            first_calls = []
            for _ in range(3):  # static K/V: fill, capture, replay; graph: capture, replay, replay
                start = time.perf_counter()
                out = variant()
                sync(device)
                first_calls.append(time.perf_counter() - start)
            outputs[name] = out.clone()
            added = (torch.cuda.memory_allocated(device) - before) if device.type == "cuda" else 0
            proofs[name] = {"first_calls_s": [round(t, 3) for t in first_calls], "device_bytes_added": added,
                            "finite": bool(torch.isfinite(out).all())}
            report = graph_report(variant.model)
            if report is not None:
                proofs[name]["graphs"] = report
                proofs[name]["host_checks_us"] = host_checks_us(variant)
        except Exception as exc:
            failures.append(f"{workload} {name}: proof failed: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            variant.close()
            del variants[name]
    for name, proof in proofs.items():
        if name not in outputs:
            continue
        anchor = ANCHORS.get(name, "eager")
        if anchor in outputs and name != anchor:
            proof["anchor"] = anchor
            proof["bitwise_vs_anchor"] = bool(torch.equal(outputs[name], outputs[anchor]))
            proof["rel_l2_vs_anchor"] = rel_l2(outputs[name], outputs[anchor])
        if "eager" in outputs and name != "eager":
            proof["bitwise_vs_eager"] = bool(torch.equal(outputs[name], outputs["eager"]))
            proof["rel_l2_vs_eager"] = rel_l2(outputs[name], outputs["eager"])
    return proofs


def run_workload(workload: str, dense: nn.Module, registry: AccelerationRegistry, device: torch.device,
                 args: argparse.Namespace, failures: list[str]) -> dict[str, Any]:
    latent = (SMOKE_WORKLOADS if args.smoke else WORKLOADS)[workload]
    text_dim = (WAN_TINY if args.smoke else WAN_1_3B)["text_dim"]
    inputs = make_inputs(latent, text_dim, device, torch.bfloat16 if device.type == "cuda" else torch.float32,
                         16 if args.smoke else TEXT_TOKENS)
    variants = build_variants(workload, dense, inputs, registry, args, failures)
    try:
        proofs = prove(workload, variants, device, failures)
        iters = args.iters if workload == "W17" else max(1, args.iters // 3)
        gc.collect()
        gc.freeze()
        try:
            timing = interleaved({n: v for n, v in variants.items()}, device, rounds=args.rounds, warmup=1,
                                 iters=iters, baseline="eager")
        finally:
            gc.unfreeze()
        for name, variant in variants.items():
            report = graph_report(variant.model)
            if report is not None:
                proofs[name]["graphs_after_timing"] = report["totals"]
        return {"latent": list(latent), "text_tokens": inputs["encoder_hidden_states"].shape[1], "iters": iters,
                "rounds": args.rounds, "proofs": proofs, "timing": timing}
    finally:
        for variant in variants.values():
            variant.close()
            session = getattr(variant.model, "_worldfoundry_accelerations", None)
            if session is not None:
                session.uninstall()
        variants.clear()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def table(results: dict[str, Any]) -> list[str]:
    rows = ["| workload | variant | median ms | vs eager (paired median [min, max]) | exact vs anchor | "
            "capture s | pool MiB | first calls s |", "|---|---|---|---|---|---|---|---|"]
    for workload, data in results["workloads"].items():
        for name, t in data.get("timing", {}).items():
            proof = data["proofs"].get(name, {})
            graphs = proof.get("graphs") or {}
            sigs = graphs.get("signatures") or []
            capture = max((s["capture_seconds"] for s in sigs), default=None)
            pool = graphs.get("pool_bytes")
            exact = ("bitwise" if proof.get("bitwise_vs_anchor") else
                     f"rel L2 {proof['rel_l2_vs_anchor']:.2e}") if "anchor" in proof else "anchor"
            exact = f"{exact} ({proof['anchor']})" if "anchor" in proof else exact
            rows.append(f"| {workload} | {name} | {t['median_ms']:.2f} | {t['speedup_vs_eager']:.3f}x "
                        f"({t['paired_speedup_median']:.3f} [{t['paired_speedup_min']:.3f}, "
                        f"{t['paired_speedup_max']:.3f}]) | {exact} | "
                        f"{'-' if capture is None else f'{capture:.3f}'} | "
                        f"{'-' if pool is None else f'{pool / 2**20:.1f}'} | {proof.get('first_calls_s')} |")
    return rows


def goals(results: dict[str, Any]) -> list[str]:
    lines = []
    w17 = results["workloads"].get("W17", {})
    t = w17.get("timing", {}).get("cuda_graph")
    p = w17.get("proofs", {}).get("cuda_graph", {})
    if t:
        ok = t["speedup_vs_eager"] >= GOAL_SPEEDUP and p.get("bitwise_vs_eager")
        lines.append(f"goal W17 cuda_graph >= {GOAL_SPEEDUP}x eager, bitwise: {t['speedup_vs_eager']:.3f}x, "
                     f"bitwise={p.get('bitwise_vs_eager')} -> {'PASS' if ok else 'FAIL'}")
    captures = [s["capture_seconds"] for w in results["workloads"].values() for pr in w.get("proofs", {}).values()
                for s in (pr.get("graphs") or {}).get("signatures", [])]
    if captures:
        lines.append(f"goal capture <= {GOAL_CAPTURE_S} s per signature: max {max(captures):.3f} s -> "
                     f"{'PASS' if max(captures) <= GOAL_CAPTURE_S else 'FAIL'}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="W17,W81")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=6, help="calls per sample at W17 (W81: a third)")
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, the CPU replay executor")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu":
        args.smoke, args.skip_compile = True, True
    backend = EagerReplayBackend if args.smoke else CudaGraphBackend
    registry = AccelerationRegistry(discover=False)
    registry.register("cuda_graph", make_prepare(backend))
    registry.register("wan_cross_kv_fusion", static_kv_prepare)
    config = WAN_TINY if args.smoke else WAN_1_3B
    failures: list[str] = []
    results: dict[str, Any] = {
        "provenance": provenance(device, extra_packages=("diffusers", "triton"), note=RANDOM_NOTE,
                                 config=config, dtype="bfloat16" if device.type == "cuda" else "float32",
                                 backend=backend.name),
        "workloads": {}, "failures": failures}
    dense = build_wan(config, device, torch.bfloat16 if device.type == "cuda" else torch.float32)  # copied per variant
    for workload in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        try:
            results["workloads"][workload] = run_workload(workload, dense, registry, device, args, failures)
        except Exception as exc:
            failures.append(f"{workload}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
    out_dir = Path(os.environ.get("OUT", "./bench_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cuda_graph.json").write_text(json.dumps(results, indent=1, default=str))
    for line in failures:
        print("FAILED:", line)
    print("\n".join(table(results)))
    if args.smoke:
        print("smoke run (CPU, tiny model, replay executor): the goals below are not measured")
    print("\n".join(goals(results)))


if __name__ == "__main__":
    main()
