"""Block fusion (``wan_block_fusion`` / ``sana_block_fusion``) vs eager vs torch.compile regional, one process.

Per workload (W17, W81: Wan2.1-1.3B architecture, random seeded weights, bf16, text 512 x 4096; SANA-Video 480p:
the default SANA-Video config at latent 21x60x104, text 300 x 2304):

* eager (diffusers as is), block fusion (a second instance, same seeded weights, plugin installed),
  torch.compile regional (a third instance with ``model.compile_repeated_blocks(fullgraph=True)``; W17 only unless ``--compile-w81``; its warm-up --
  the first two calls -- is timed and reported separately);
* proof: the block fusion output is compared bitwise with eager (compile: relative L2), and its receipts must show
  every block executed with no fallback;
* first call: seconds of the first forward after install (Triton compiles the kernels then; the on-disk Triton
  cache is pointed at an empty directory so the figure is a cold start);
* kernels per forward (torch.profiler, CUDA kernels of one forward) for eager and block fusion;
* interleaved paired rounds (>= 5, rotating order, warm-up excluded), medians and paired ratios;
* adjacent pairs (``--pairs``, default 24): single forwards of eager and of each of ``block_fusion``,
  ``block_fusion:float_carry``, ``cuda_graph``, ``block_fusion+cuda_graph`` and ``compile``, back to back in ABBA
  order, median per-pair ratio and its bootstrap 95 % CI -- the ratio on one host speed, where the rounds above
  compare samples seconds apart (this machine's host speed changes in phases of seconds:
  ``benchmarks/profiling/host_noise_probe.py``);
* ``block_fusion:normal_launch``: the same fused model with every kernel launched through Triton's normal
  ``kernel[grid](...)`` path instead of the compiled kernel's launcher (the host cost of launching);
* Wan: ``cuda_graph`` alone and ``block_fusion+cuda_graph`` (the forward replayed from one CUDA graph; bitwise
  vs eager, block fusion receipts counted per replay; W17 goal of the stack >= 1.8x); on CUDA also
  ``bare_graph`` (one plain ``torch.cuda.CUDAGraph`` of the eager forward: the replay's ceiling) and, unless
  ``--no-fa3``, FlashAttention-3 on self-attention (``attention_policy`` + ``attention_fa3``, ``min_tokens`` 2048)
  alone and under ``block_fusion`` / ``block_fusion+cuda_graph`` (rel L2 vs eager; the stacks bitwise vs ``fa3``);
* Wan, with ``--fp8``: ``selective_fp8`` on the FFN Linears (the W17 candidates file's ``fp8-ffn`` options) alone and
  under ``cuda_graph``, ``block_fusion`` and ``block_fusion+cuda_graph`` (rel L2 vs eager; the stacks bitwise vs
  ``fp8``; timed in adjacent pairs too): what FP8 saves once a graph has removed the host cost of its launches;
* Wan: ``block_fusion:float_carry`` and ``block_fusion:float_carry+cuda_graph``, the chains without ``layer_norm``
  (torch's LayerNorms fed the float32 stream the residual kernels write; bitwise vs eager);
* SANA-Video: each chain alone (``sana:<chain>``) and the CUDA kernels taking the most time in eager and with
  block fusion (``top_kernels``), to show which chain costs or gains what.

A part that fails is reported with its error and the rest still runs. The table is printed last; the full result
is written to ``$OUT/block_fusion.json`` (default ``./bench_out``).

Command (H200, about 4 minutes with the W17 compile warm-up)::

    python benchmarks/kernels/block_fusion.py               # --skip-compile, --compile-w81, --smoke (CPU)
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from worldfoundry.bench.microbench import (
    RANDOM_NOTE,
    SMOKE_WORKLOADS,
    WAN_1_3B,
    WAN_TINY,
    WORKLOADS,
    adjacent_pairs,
    interleaved,
    provenance,
    rel_l2,
    sync,
)
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.guard import attach_request_guard
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.fusion.launch import direct_launch, launch_path
from worldfoundry.core.model_loading.dtypes import apply_dtype_policy
from worldfoundry.core.fusion.compile_pool import set_default_compile_mode

#: SANA-Video 480p (81 frames 480x832 -> latent 21x60x104, 32,760 tokens) and its CPU smoke stand-in.
SANA_LATENT = (21, 60, 104)
SANA_SMOKE = dict(num_attention_heads=2, attention_head_dim=32, num_layers=2, num_cross_attention_heads=2,
                  cross_attention_head_dim=32, cross_attention_dim=64, caption_channels=32, sample_size=8,
                  rope_max_seq_len=64)
#: ``selective_fp8`` as the W17 candidates file's ``fp8-ffn`` row sets it, and the stacks it is measured in.
FP8_FFN = {"include": ["blocks.*.ffn.net.0.proj", "blocks.*.ffn.net.2"], "min_tokens": 1024}
FP8_STACKS = {"fp8": {}, "cuda_graph+fp8": {"cuda_graph": True},
              "block_fusion+fp8": {"wan_block_fusion": {}},
              "block_fusion+cuda_graph+fp8": {"wan_block_fusion": {}, "cuda_graph": True}}
GOALS = {"W17": 1.35, "W81": 1.15, "SANA480p": 1.15}
STACK_GOALS = {"W17": 1.8}
#: every chain of ``sana_block_fusion`` (``glu``: the feed-forward's gated SiLU), each also measured alone
#: ``wan_block_fusion`` without its ``layer_norm`` chain: torch's LayerNorms, fed the float32 stream the residual
#: kernels write (``float_carry``)
WAN_CARRY_CHAINS = ("modulate", "gated_residual", "cross_residual", "rope", "qk_norm", "float_carry")
SANA_CHAINS = ("modulate", "gated_residual", "cross_residual", "linear_attention", "glu")
#: characters of a kernel name kept in the top-kernels tables (enough for the template arguments)
KERNEL_NAME_CHARS = 140
FIRST_CALL_GOAL_S = 3.0


def registry() -> AccelerationRegistry:
    from worldfoundry_block_fusion import sana_plugin, wan_plugin

    reg = AccelerationRegistry(discover=False)
    reg.register("wan_block_fusion", wan_plugin.prepare)
    reg.register("sana_block_fusion", sana_plugin.prepare)
    try:
        from worldfoundry_cuda_graph.plugin import prepare as cuda_graph

        reg.register("cuda_graph", cuda_graph)
    except ImportError:  # the variants that need it report the error
        pass
    for key, module in (("attention_policy", "worldfoundry_attention_policy.plugin"),
                        ("selective_fp8", "worldfoundry_selective_fp8.plugin")):
        try:
            reg.register(key, importlib.import_module(module).prepare)
        except ImportError:  # the variants that need it report the error
            pass
    return reg


def build(family: str, smoke: bool, device: torch.device) -> nn.Module:
    from diffusers import SanaVideoTransformer3DModel, WanTransformer3DModel

    torch.manual_seed(0)
    with torch.device(device):
        if family == "wan":
            model = WanTransformer3DModel(**(WAN_TINY if smoke else WAN_1_3B))
        else:
            model = SanaVideoTransformer3DModel(**(SANA_SMOKE if smoke else {}))
    model = apply_dtype_policy(model, torch.bfloat16).eval()
    attach_request_guard(model)  # as the loader attaches one in real use
    return model


def inputs_for(model: nn.Module, family: str, latent: tuple[int, int, int], device: torch.device) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(1)
    cfg = model.config
    text, width = (512, cfg.text_dim) if family == "wan" else (300, cfg.caption_channels)
    return {"hidden_states": torch.randn(1, cfg.in_channels, *latent, device=device, generator=g).bfloat16(),
            "timestep": torch.tensor([500], device=device),
            "encoder_hidden_states": torch.randn(1, text, width, device=device, generator=g).bfloat16(),
            "return_dict": False}


def caller(model: nn.Module, inputs: dict[str, Any], request_id: str | None = None) -> Callable[[], torch.Tensor]:
    def call() -> torch.Tensor:
        with torch.inference_mode():
            if request_id is None:
                return model(**inputs)[0]
            with request_scope(RequestContext(request_id)):
                return model(**inputs)[0]

    return call


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def kernels_per_forward(fn: Callable[[], Any], device: torch.device) -> int | None:
    """CUDA kernels launched by one forward (torch.profiler), ``None`` on the CPU."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def normal_launch(call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` with the fusion kernels launched through Triton's normal path (``kernel[grid](...)``)."""

    def run() -> Any:
        with direct_launch(False):
            return call()

    return run


def fusion_variant(make_model: Callable[[], nn.Module], name: str, inputs: dict[str, Any], reference: torch.Tensor,
                   device: torch.device, result: dict[str, Any]) -> Callable[[], Any]:
    model = make_model()
    session = install_diffusion_accelerations(model, {name: {}}, registry=registry())
    first, first_s = timed(caller(model, inputs, "first"), device)
    record = session.execution_report()["plugins"][name]["model"]["requests"]["first"]
    blocks = len(session.handles(name)["model"].blocks)
    result["block_fusion"] = {
        "first_call_s": round(first_s, 3), "bitwise_vs_eager": bool(torch.equal(first, reference)),
        "max_abs_diff": float((first.float() - reference.float()).abs().max()),
        "fused_calls": record["counters"], "fallbacks": record["fallbacks"],
        "claimed_not_executed": record["claimed_not_executed"], "blocks": blocks}
    result["_keep"].append((model, session))
    return caller(model, inputs, "timed")


def plugin_variant(key: str, make_model: Callable[[], nn.Module], spec: dict[str, Any], inputs: dict[str, Any],
                   reference: torch.Tensor, device: torch.device, result: dict[str, Any]) -> Callable[[], Any]:
    """Another stack (``cuda_graph``, ``block_fusion+cuda_graph``, one SANA chain): bitwise check and receipts."""
    model = make_model()
    session = install_diffusion_accelerations(model, spec, registry=registry())
    call = caller(model, inputs, "first")
    first, first_s = timed(call, device)
    outs = [call() for _ in range(3)]  # the graph variants warm up and capture here, then replay
    sync(device)
    report = session.execution_report()["plugins"]
    entry: dict[str, Any] = {"first_call_s": round(first_s, 3),
                             "bitwise_vs_eager": bool(all(torch.equal(o, reference) for o in [first, *outs])),
                             "rel_l2_vs_eager": rel_l2(outs[-1], reference)}
    for base_key in ("fa3", "fp8"):  # a stack on fa3 or fp8: exact on top of it?
        base = result.get("_outs", {}).get(base_key)
        if key != base_key and base_key in key.split("+") and base is not None:
            entry[f"bitwise_vs_{base_key}"] = bool(all(torch.equal(o, base) for o in [first, *outs]))
    result.setdefault("_outs", {})[key] = outs[-1]
    for name in spec:
        rec = report[name]["model"]["requests"].get("first", {})
        entry[name] = {"counters": rec.get("counters"), "modules_executed": len(rec.get("modules", {})),
                       "fallbacks": rec.get("fallbacks"), "claimed_not_executed": rec.get("claimed_not_executed")}
    result[key] = entry
    result["_keep"].append((model, session))
    if "cuda_graph" in spec:
        result.setdefault("_graphs", {})[key] = session
    return caller(model, inputs, "timed")


def bare_graph_variant(eager: Callable[[], torch.Tensor], reference: torch.Tensor, device: torch.device,
                       result: dict[str, Any]) -> Callable[[], Any]:
    """One plain ``torch.cuda.CUDAGraph`` of the eager forward (same model and inputs): the replay's ceiling."""
    from worldfoundry.core.acceleration.cuda_graph import capture_stream

    stream = capture_stream(device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    sync(device)
    graph = torch.cuda.CUDAGraph()
    start = time.perf_counter()
    with torch.cuda.graph(graph, stream=stream):
        out = eager()
    sync(device)
    capture_s = time.perf_counter() - start

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    result["bare_graph"] = {"capture_s": round(capture_s, 3), "bitwise_vs_eager": bool(torch.equal(replay(), reference))}
    result["_keep"].append((graph, None))
    return replay


def top_kernels(fn: Callable[[], Any], device: torch.device, n: int = 12) -> list[tuple[str, int, float]] | None:
    """The ``n`` CUDA kernels of one forward with the most device time: ``(name, count, total ms)``."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    rows = [(e.key[:KERNEL_NAME_CHARS], e.count, e.device_time_total / 1e3) for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(rows, key=lambda r: -r[2])[:n]


def compile_variant(make_model: Callable[[], nn.Module], inputs: dict[str, Any], reference: torch.Tensor, device: torch.device,
                    result: dict[str, Any]) -> Callable[[], Any]:
    model = make_model()
    model.compile_repeated_blocks(fullgraph=True)
    call = caller(model, inputs)
    first, first_s = timed(call, device)
    second, second_s = timed(call, device)
    result["compile"] = {"warmup_first_two_calls_s": round(first_s + second_s, 2),
                         "rel_l2_vs_eager": rel_l2(second, reference), "bitwise_vs_eager": bool(torch.equal(second,
                                                                                                        reference))}
    result["_keep"].append((model, None))
    return call


def workload(label: str, family: str, latent: tuple[int, int, int], args: argparse.Namespace,
             device: torch.device, with_compile: bool) -> dict[str, Any]:
    result: dict[str, Any] = {"latent": list(latent), "family": family, "errors": {}, "_keep": []}
    dense = build(family, args.smoke, device)

    def make_model() -> nn.Module:  # the same seeded weights (a deep copy cannot copy the request guard)
        return build(family, args.smoke, device)

    inputs = inputs_for(dense, family, latent, device)
    result["tokens"] = latent[0] * (latent[1] // 2) * (latent[2] // 2)
    eager = caller(dense, inputs)
    reference, result["eager_first_call_s"] = timed(eager, device)
    _, steady_s = timed(eager, device)
    calls: dict[str, Callable[[], Any]] = {"eager": eager}
    name = "wan_block_fusion" if family == "wan" else "sana_block_fusion"
    variants: list[tuple[str, Callable[[], Callable[[], Any]]]] = [
        ("block_fusion", lambda: fusion_variant(make_model, name, inputs, reference, device, result))]
    stacks: list[tuple[str, dict[str, Any]]] = [("cuda_graph", {"cuda_graph": True}),
                                                ("block_fusion+cuda_graph", {name: {}, "cuda_graph": True})]
    if family == "wan":  # without the layer_norm chain: torch's LayerNorms and the float32 carry
        carry = {name: {"chains": list(WAN_CARRY_CHAINS)}}
        stacks += [("block_fusion:float_carry", carry),
                   ("block_fusion:float_carry+cuda_graph", {**carry, "cuda_graph": True})]
    if family == "wan" and device.type == "cuda":
        variants.append(("bare_graph", lambda: bare_graph_variant(eager, reference, device, result)))
        if args.fa3:  # FlashAttention-3 on self-attention (not bitwise: SDPA's accuracy class), alone and stacked
            fa3 = {"attention_policy": {"self": {"backend": "fa3", "min_tokens": 2048}}}
            stacks += [("fa3", fa3), ("block_fusion+fa3", {name: {}, **fa3}),
                       ("block_fusion+cuda_graph+fa3",
                        {name: {}, "cuda_graph": {"compose_with": ["attention_policy"]}, **fa3})]
    if family == "wan" and args.fp8:  # FP8 GEMMs on the FFN Linears (approximate), alone and stacked
        stacks += [(key, {**spec, "selective_fp8": FP8_FFN}) for key, spec in FP8_STACKS.items()]
    if family == "wan" and (device.type == "cuda" or args.smoke):  # smoke: the CPU runs them eagerly (visible)
        for key, spec in stacks:
            variants.append((key, lambda key=key, spec=spec: plugin_variant(key, make_model, spec, inputs, reference,
                                                                            device, result)))
    if family == "sana" and args.sana_chains:
        for chain in SANA_CHAINS:
            key = f"sana:{chain}"
            variants.append((key, lambda key=key, chain=chain: plugin_variant(
                key, make_model, {name: {"chains": [chain]}}, inputs, reference, device, result)))
    if with_compile:
        variants.append(("compile", lambda: compile_variant(make_model, inputs, reference, device, result)))
    for key, make in variants:
        try:
            calls[key] = make()
        except Exception as exc:  # one failing part must not stop the others
            result["errors"][key] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        if key == "block_fusion" and key in calls:  # the same fused model, every kernel through Triton's launch
            calls["block_fusion:normal_launch"] = normal_launch(calls[key])
            result["launch_path"] = launch_path()
    for key in ("eager", "block_fusion"):
        if key in calls:
            try:
                result.setdefault("kernels_per_forward", {})[key] = kernels_per_forward(calls[key], device)
            except Exception as exc:
                result["errors"][f"profile_{key}"] = f"{type(exc).__name__}: {exc}"
    if family == "sana":
        for key in ("eager", "block_fusion"):
            if key in calls:
                try:
                    result.setdefault("top_kernels", {})[key] = top_kernels(calls[key], device)
                except Exception as exc:
                    result["errors"][f"top_kernels_{key}"] = f"{type(exc).__name__}: {exc}"
    iters = max(1, int(round(args.target_ms / max(steady_s * 1e3, 1.0))))
    result["iters_per_sample"] = min(iters, 20)
    gc.collect()
    gc.freeze()
    try:
        result["timing"] = interleaved(calls, device, rounds=args.rounds, warmup=2, iters=min(iters, 20),
                                       baseline="eager")
    except Exception as exc:
        result["errors"]["timing"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    try:
        result["pairs"] = pair_ratios(calls, device, args.pairs)
    finally:
        gc.unfreeze()
    for key, session in result.pop("_graphs", {}).items():  # the timed calls replayed (captures stay at one)
        try:
            graph = session.execution_report()["plugins"]["cuda_graph"]["model"]
            result[key]["graph_totals"] = graph["graphs"]["totals"]
            result[key]["timed_request"] = graph["requests"].get("timed", {}).get("modules")
        except Exception as exc:
            result["errors"][f"graph_report_{key}"] = f"{type(exc).__name__}: {exc}"
    result.pop("_outs", None)
    for model, session in result.pop("_keep"):
        if session is not None:
            session.uninstall()
        del model
    del dense
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


#: The variants timed against eager in adjacent pairs (see the module docs).
PAIRED_VARIANTS = ("block_fusion", "block_fusion:float_carry", "cuda_graph", "block_fusion+cuda_graph", "compile",
                   "fp8", "cuda_graph+fp8", "block_fusion+fp8", "block_fusion+cuda_graph+fp8")


def pair_ratios(calls: dict[str, Callable[[], Any]], device: torch.device, pairs: int) -> dict[str, Any]:
    """Each of :data:`PAIRED_VARIANTS` present against eager in ``pairs`` adjacent ABBA pairs."""
    out: dict[str, Any] = {}
    for key in PAIRED_VARIANTS:
        if key in calls and pairs > 0:
            try:
                out[key] = adjacent_pairs(calls["eager"], calls[key], device, pairs=pairs)
            except Exception as exc:
                out[key] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def pairs_table(results: dict[str, Any]) -> str:
    lines = ["| workload | variant | eager ms | variant ms | per-pair ratio (median) | 95% CI | pairs |",
             "|---|---|---|---|---|---|---|"]
    for label, r in results.items():
        for key, p in ((r.get("pairs") or {}).items() if isinstance(r, dict) else ()):
            if "error" in p:
                lines.append(f"| {label} | {key} | {p['error']} | | | | |")
                continue
            lo, hi = p["ratio_ci95"]
            lines.append(f"| {label} | {key} | {p['baseline_median_ms']:.2f} | {p['candidate_median_ms']:.2f} | "
                         f"{p['ratio_median']:.3f} | [{lo:.3f}, {hi:.3f}] | {len(p['ratios'])} |")
    return "\n".join(lines)


def _probe(t: dict[str, Any]) -> str:
    """The median host probe before this variant's samples, and its range (the machine's speed while timed)."""
    probes = t.get("host_probe_ms") or []
    return f"{t['host_probe_median_ms']:.2f} ({min(probes):.2f}–{max(probes):.2f})" if probes else ""


def table(results: dict[str, Any]) -> str:
    lines = ["| workload | variant | median ms | vs eager (paired median) | goal | bitwise | first call s | "
             "kernels/forward | host probe ms |", "|---|---|---|---|---|---|---|---|---|"]
    for label, r in results.items():
        if not isinstance(r, dict) or "timing" not in r:
            continue
        for key, t in r["timing"].items():
            extra = r.get(key, {})
            bitwise = ("-" if key == "eager" else f"rel L2 {extra.get('rel_l2_vs_eager', float('nan')):.3g}"
                       if key == "compile" or "fa3" in key or "fp8" in key else extra.get("bitwise_vs_eager"))
            for base_key in ("fa3", "fp8"):
                if f"bitwise_vs_{base_key}" in extra:
                    bitwise = f"{bitwise}; bitwise vs {base_key} {extra[f'bitwise_vs_{base_key}']}"
            first = (round(r["eager_first_call_s"], 2) if key == "eager" else
                     f"warm-up {extra.get('warmup_first_two_calls_s')}" if key == "compile" else
                     extra.get("first_call_s"))
            goal = (f">= {GOALS.get(label)}" if key == "block_fusion" else
                    f">= {STACK_GOALS[label]}" if key == "block_fusion+cuda_graph" and label in STACK_GOALS else "")
            kernels = r.get("kernels_per_forward", {}).get(key, "")
            lines.append(f"| {label} | {key} | {t['median_ms']:.2f} | {t['speedup_vs_eager']:.3f} "
                         f"({t['paired_speedup_median']:.3f}) | {goal} | {bitwise} | {first} | {kernels} | "
                         f"{_probe(t)} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="directory for block_fusion.json")
    p.add_argument("--rounds", type=int, default=7, help="interleaved paired rounds (>= 5)")
    p.add_argument("--pairs", type=int, default=24, help="adjacent ABBA pairs per variant against eager (0: none)")
    p.add_argument("--target-ms", type=float, default=250.0, help="time per sample (iterations chosen from it)")
    p.add_argument("--skip-compile", action="store_true", help="no torch.compile regional anchor")
    p.add_argument("--compile-w81", action="store_true", help="also compile at W81 (long warm-up)")
    p.add_argument("--workloads", default="W17,W81,SANA480p", help="comma-separated subset")
    p.add_argument("--no-sana-chains", dest="sana_chains", action="store_false",
                   help="skip the SANA-Video one-chain variants")
    p.add_argument("--smoke", action="store_true", help="tiny models and latents on the CPU (TRITON_INTERPRET=1)")
    p.add_argument("--no-fa3", dest="fa3", action="store_false",
                   help="skip FlashAttention-3 on self-attention (attention_policy + attention_fa3) and its stacks")
    p.add_argument("--fp8", action="store_true",
                   help="add selective_fp8 on the FFN Linears alone and under cuda_graph / block fusion (Wan)")
    args = p.parse_args()
    set_default_compile_mode("blocking")  # kernels compile before a first fused call, never beside timing
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.smoke:
        args.rounds, args.target_ms, args.pairs = 2, 1.0, min(args.pairs, 4)
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton_cold_"))  # first call = cold start
    shapes = {**(SMOKE_WORKLOADS if args.smoke else WORKLOADS), "SANA480p": (2, 8, 8) if args.smoke else SANA_LATENT}
    results: dict[str, Any] = {"note": RANDOM_NOTE, "goals": {**GOALS, "first_call_s": FIRST_CALL_GOAL_S},
                               "provenance": provenance(device, extra_packages=("diffusers", "triton"))}
    for label in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        family = "sana" if label.startswith("SANA") else "wan"
        with_compile = not args.skip_compile and family == "wan" and (label == "W17" or args.compile_w81)
        try:
            results[label] = workload(label, family, shapes[label], args, device, with_compile)
        except Exception as exc:
            results[label] = {"errors": {"workload": f"{type(exc).__name__}: {exc}"}}
            traceback.print_exc()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "block_fusion.json").write_text(json.dumps(results, indent=1, default=str))
    for label, r in results.items():
        if isinstance(r, dict) and r.get("errors"):
            print(f"{label} errors: {r['errors']}")
        if isinstance(r, dict) and "block_fusion" in r:
            print(f"{label} block_fusion receipts: fallbacks={r['block_fusion']['fallbacks']} "
                  f"not_executed={r['block_fusion']['claimed_not_executed']}")
        for key in ("cuda_graph", "block_fusion+cuda_graph"):
            if isinstance(r, dict) and key in r:
                print(f"{label} {key}: graph totals {r[key].get('graph_totals')} timed request "
                      f"{r[key].get('timed_request')}")
    for label, r in results.items():
        for key, rows in (r.get("top_kernels") or {}).items() if isinstance(r, dict) else ():
            print(f"{label} {key} top CUDA kernels (count, ms per forward):")
            for kname, count, ms in rows or ():
                print(f"    {ms:8.2f} ms  x{count:<5d} {kname}")
    print(f"wrote {out / 'block_fusion.json'}")
    print(table(results))
    print(pairs_table(results))


if __name__ == "__main__":
    main()
