"""Whole-forward part of ``attention_fusion.py``: Wan2.1-1.3B forward per variant, timed against dense eager.

Per workload (W17, W81): a proof call per variant (bitwise / relative L2 vs dense, receipts, memory the variant keeps
after the call), then interleaved paired rounds (rotating order, warm-up excluded, the Python garbage collector
frozen around the timed rounds so a full collection of a large heap does not land inside one sample), and a CPU
enqueue profile: single forwards after a device synchronisation, the wall time until the Python call returns (no
synchronisation) next to the CUDA-event time of the same forward. ``cpu_enqueue ≈ gpu`` means the forward is
launch/CPU-bound; ``cpu_enqueue ≪ gpu`` means the GPU is the bottleneck.

Controls against the noise: every variant runs with a request guard attached, as the loader attaches one in real
use (the plugin variants get theirs at install); ``dense[copy]`` is a second deep copy of the dense model timed like
a variant, so its paired ratio shows how much two identical model instances differ (the noise floor of a
cross-instance ratio); and ``same_instance_ab`` times the optimized_mha model with its fused branch on and off
(``fused_projections`` toggled between samples: the off samples run the separate projections of the same module
objects and Parameters), a ratio free of instance differences.

Weight memory at install is reported three ways (``weight_memory``): the CUDA allocator's *requested* bytes (what
tensors asked for: the true figure), its *allocated* bytes (whole blocks: a 13.5 MiB packed Q/K/V weight placed in
a fresh 14 MiB segment keeps the 0.5 MiB tail, because the caching allocator does not split off remainders of
1 MiB or less, so this figure can grow although no tensor did), and the unique storage bytes of the model's
parameters and buffers (device independent).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import traceback
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import worldfoundry_optimized_mha.plugin as mha_plugin
from torch import nn
from worldfoundry_optimized_mha.plan import PROJECTION_WRAPPERS, SitePlan

from worldfoundry.bench.microbench import (
    RANDOM_NOTE,
    SMOKE_WORKLOADS,
    WAN_1_3B,
    WAN_TINY,
    WORKLOADS,
    Region,
    interleaved_samples,
    paired_summary,
    rel_l2,
    sync,
    time_calls,
)
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.guard import attach_request_guard
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.model_loading.dtypes import apply_dtype_policy
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.errors import AttentionBackendError, WorldFoundryError

WRAPPERS_VARIANT = "optimized_mha[wrappers]"
DENSE_COPY = "dense[copy]"
#: Timed at W17 only (they split optimized_mha's effect into its self- and cross-attention parts, and the noise floor).
W17_ONLY = ("optimized_mha[self]", "optimized_mha[cross]", DENSE_COPY)
#: Variants whose CUDA kernels are listed at W17 (one profiled forward each).
PROFILED = ("dense", "optimized_mha", "diffusers_fuse_qkv", "static_kv")
#: Variants with a static K/V cache: the proof runs two forwards of one request (the second serves the cache),
#: and the timed forwards of a request after its first are the steady state of a denoising step.
STATIC_VARIANTS = ("mha_self+static_kv", "static_kv", "static_kv[packed]")
FUSE_QKV = "diffusers_fuse_qkv"
#: Every variant, in timing order (``--variants`` selects a subset; ``dense`` always runs).
ALL_VARIANTS = ("optimized_mha", WRAPPERS_VARIANT, "optimized_mha[self]", "optimized_mha[cross]", FUSE_QKV,
                "static_kv", "static_kv[packed]", "mha_self+static_kv", "mha_cudnn", DENSE_COPY)


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


def _force_wrappers(plan: SitePlan, family: Any) -> None:
    """Benchmark-only: the projection-wrapper path everywhere (the path optimized_mha used before the fused branch)."""
    if plan.groups:
        plan.projection_path = PROJECTION_WRAPPERS
        plan.path_reason = "forced by the benchmark for comparison"


def install(model: nn.Module, name: str, spec: dict[str, Any], policy: RuntimePolicy,
            registry: AccelerationRegistry) -> Any:
    if name == WRAPPERS_VARIANT:
        with mock.patch.object(mha_plugin, "choose_projection_path", _force_wrappers):
            return install_diffusion_accelerations(model, spec, policy, registry=registry)
    return install_diffusion_accelerations(model, spec, policy, registry=registry)


# ---------------------------------------------------------------------------------------------- memory
def storage_bytes(model: nn.Module) -> int:
    """Bytes of the unique storages behind the model's parameters and buffers."""
    storages: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def memory_now(device: torch.device) -> dict[str, int | None]:
    if device.type != "cuda":
        return {"requested": None, "allocated": None}
    sync(device)
    stats = torch.cuda.memory_stats(device)
    return {"requested": stats.get("requested_bytes.all.current"), "allocated": stats.get("allocated_bytes.all.current")}


def memory_delta(before: dict[str, int | None], after: dict[str, int | None]) -> dict[str, int | None]:
    return {f"{k}_bytes": (None if before[k] is None or after[k] is None else after[k] - before[k]) for k in before}


# ---------------------------------------------------------------------------------------------- timing
def _time_sample(fn: Callable[[], Any], device: torch.device, iters: int) -> tuple[float, float]:
    """``(device ms, CPU enqueue ms)`` per call over ``iters`` back-to-back calls; on the CPU both are wall time."""
    region = time_calls(fn, device, iters)
    return region.device_ms / iters, region.enqueue_ms / iters


def paired_rounds(calls: dict[str, Callable[[], Any]], device: torch.device, *, rounds: int, warmup: int,
                  iters: int, baseline: str) -> dict[str, Any]:
    """Interleaved rounds in rotating order; per call the median ms, per-round paired ratios against ``baseline``
    (> 1: faster) and the CPU enqueue time of the same samples (back to back, so a GPU-bound forward can also
    wait on a full launch queue)."""
    samples = interleaved_samples(calls, device, rounds=rounds, warmup=warmup, iters=iters, freeze_gc=True)
    out: dict[str, Any] = paired_summary(samples.device_ms, baseline)
    for name, entry in out.items():
        entry["paired_ratios"] = [b / c for b, c in zip(samples.device_ms[baseline], samples.device_ms[name],
                                                        strict=True)]
        entry["cpu_enqueue_back_to_back_median_ms"] = statistics.median(samples.enqueue_ms[name])
    out["_meta"] = {"rounds": rounds, "iters_per_sample": iters, "warmup_rounds": warmup, "baseline": baseline,
                    "gc": "collected, then frozen during the timed rounds",
                    "gc_collections_during_timing": samples.gc_collections}
    return out


def enqueue_profile(calls: dict[str, Callable[[], Any]], device: torch.device, samples: int) -> dict[str, Any]:
    """Single forwards, each after a synchronisation: CPU time until the call returns vs the forward's GPU time."""
    names = list(calls)
    cpu: dict[str, list[float]] = {n: [] for n in names}
    gpu: dict[str, list[float]] = {n: [] for n in names}
    for i in range(samples):
        for name in names[i % len(names):] + names[: i % len(names)]:
            with Region(device) as region:
                calls[name]()
            cpu[name].append(region.enqueue_ms)
            if device.type == "cuda":
                gpu[name].append(region.device_ms)
    out: dict[str, Any] = {}
    for name in names:
        c = statistics.median(cpu[name])
        g = statistics.median(gpu[name]) if gpu[name] else None
        out[name] = {"cpu_enqueue_median_ms": c, "gpu_median_ms": g, "cpu_over_gpu": (c / g) if g else None,
                     "cpu_enqueue_ms": cpu[name], "gpu_ms": gpu[name] or None,
                     "launch_bound": (c / g > 0.9) if g else None}
    return out


# ---------------------------------------------------------------------------------------------- the bench
def _record(session: Any, plugin: str, request_id: str) -> dict[str, Any]:
    reports = session.execution_report()["plugins"][plugin]["model"]
    record = reports["requests"].get(request_id, {})
    return {"counters": record.get("counters", {}), "fallbacks": record.get("fallbacks", {}),
            "claimed_not_executed": record.get("claimed_not_executed", []),
            "projection_paths": reports.get("projection_paths"),
            "bitwise_checks": {k: v.get("bitwise_checks") for k, v in reports.get("packed_groups", {}).items()
                               if k.startswith("blocks.0.")},
            # wan_cross_kv_fusion: its derived packed K/V copy is built on the first call, after install
            "derived_weight_bytes": reports.get("derived_weight_bytes"),
            "kv_cache_bytes": reports.get("kv_cache", {}).get("bytes")}


def _variant_specs(text_len: int, approx_backend: str) -> dict[str, dict[str, Any]]:
    mha = {"optimized_mha": {"self": {"fusion": "qkv"}, "cross": {"fusion": "kv"}}}
    return {
        "optimized_mha": mha,
        WRAPPERS_VARIANT: mha,
        "optimized_mha[self]": {"optimized_mha": {"self": {"fusion": "qkv"}}},
        "optimized_mha[cross]": {"optimized_mha": {"cross": {"fusion": "kv"}}},
        "mha_self+static_kv": {"optimized_mha": {"self": {"fusion": "qkv"}},
                               "wan_cross_kv_fusion": {"min_tokens": min(256, text_len)}},
        "static_kv": {"wan_cross_kv_fusion": {"min_tokens": min(256, text_len), "pack": False}},
        "static_kv[packed]": {"wan_cross_kv_fusion": {"min_tokens": min(256, text_len)}},
        f"mha_{approx_backend}": {"optimized_mha": {"self": {"fusion": "qkv", "sdpa_backend": approx_backend}}},
    }


def _chosen(variants: str | None, approx_backend: str) -> set[str]:
    """The variants ``--variants`` names (all when empty); ``mha_cudnn`` stands for the approximate backend."""
    names = set(ALL_VARIANTS) if not variants else {v.strip() for v in variants.split(",") if v.strip()}
    unknown = names - set(ALL_VARIANTS)
    if unknown:
        raise ValueError(f"unknown variant(s) {sorted(unknown)}; known: {list(ALL_VARIANTS)}")
    return {f"mha_{approx_backend}" if n == "mha_cudnn" else n for n in names}


def forward_bench(device: torch.device, dtype: torch.dtype, args: argparse.Namespace,
                  registry: AccelerationRegistry) -> dict[str, Any]:
    config = WAN_TINY if args.smoke else WAN_1_3B
    workloads = SMOKE_WORKLOADS if args.smoke else WORKLOADS
    approx_backend = "math" if device.type == "cpu" else "cudnn"
    policy = RuntimePolicy(device=device, dtype=dtype)
    dense = build_wan(config, device, dtype)
    chosen = _chosen(getattr(args, "variants", None), approx_backend)
    specs = {k: v for k, v in _variant_specs(args.text_len, approx_backend).items() if k in chosen}
    result: dict[str, Any] = {"config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()},
                              "note": RANDOM_NOTE, "weight_memory": {}, "install_receipts": {}, "failed": {},
                              "retained_after_first_forward_bytes": {}}
    extra = [n for n in (FUSE_QKV, DENSE_COPY) if n in chosen]
    copies = {name: copy.deepcopy(dense) for name in [*specs, *extra]}
    for name in extra:
        attach_request_guard(copies[name])
    attach_request_guard(dense)
    models: dict[str, nn.Module] = {"dense": dense}
    if DENSE_COPY in copies:
        models[DENSE_COPY] = copies[DENSE_COPY]
    sessions: dict[str, Any] = {}
    for name, spec in specs.items():
        model = copies[name]
        before, storage = memory_now(device), storage_bytes(model)
        try:
            sessions[name] = install(model, name, spec, policy, registry)
        except WorldFoundryError as exc:  # reported, the other variants still run
            result["failed"][name] = f"install: {type(exc).__name__}: {exc}"
            continue
        result["weight_memory"][name] = {**memory_delta(before, memory_now(device)),
                                         "parameter_storage_bytes": storage_bytes(model) - storage}
        result["install_receipts"][name] = sessions[name].receipt.to_json()
        models[name] = model
    if FUSE_QKV in copies:
        fused = copies[FUSE_QKV]
        before, storage = memory_now(device), storage_bytes(fused)
        fused.fuse_qkv_projections()
        result["weight_memory"][FUSE_QKV] = {**memory_delta(before, memory_now(device)),
                                             "parameter_storage_bytes": storage_bytes(fused) - storage}
        models[FUSE_QKV] = fused
    del copies
    order = [n for n in ("dense", *ALL_VARIANTS[:-2], f"mha_{approx_backend}", DENSE_COPY) if n in models]
    for wname, latent in workloads.items():
        try:
            result[wname] = _workload(wname, latent, config, models, sessions, order, device, dtype, args, result)
        except Exception as exc:  # noqa: BLE001 - a failure (e.g. out of memory at W81) must not lose the others
            result["failed"][wname] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            result["failed"][f"{wname}_traceback"] = traceback.format_exc()[-4000:]
    try:
        result["restore"] = _restore(dense, models, sessions, make_inputs(config, workloads["W17"], args.text_len,
                                                                           device, dtype))
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON
        result["failed"]["restore"] = f"{type(exc).__name__}: {exc}"
    return result


def _workload(wname: str, latent: tuple[int, int, int], config: dict[str, Any], models: dict[str, nn.Module],
              sessions: dict[str, Any], order: list[str], device: torch.device, dtype: torch.dtype,
              args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    inputs = make_inputs(config, latent, args.text_len, device, dtype)
    f, h, w = latent
    entry: dict[str, Any] = {"latent": list(latent), "tokens": f * (h // 2) * (w // 2), "text_tokens": args.text_len}

    def call(name: str, request_id: str) -> Callable[[], Any]:
        model = models[name]

        def run() -> Any:
            with request_scope(RequestContext(request_id, "cond", 0)):
                return model(**inputs)[0]

        return run

    w17 = wname == "W17"
    order = [n for n in order if w17 or n not in W17_ONLY]
    with torch.no_grad():
        outputs = {}
        for name in list(order):
            rid = f"{wname}-proof"
            before = memory_now(device)
            try:
                outputs[name] = call(name, rid)()
                if name in STATIC_VARIANTS:  # second call: the text K/V now come from the cache
                    outputs[name] = call(name, rid)()
            except AttentionBackendError as exc:  # a backend PyTorch rejects for these shapes: reported
                result["failed"][f"{name}@{wname}"] = str(exc)
                order.remove(name)
                continue
            after = memory_now(device)
            if wname == "W17" and before["requested"] is not None:
                out = outputs[name]
                result["retained_after_first_forward_bytes"][name] = (
                    after["requested"] - before["requested"] - out.numel() * out.element_size())
        ref = outputs["dense"]
        entry["bitwise_vs_dense"] = {n: bool(torch.equal(o, ref)) for n, o in outputs.items() if n != "dense"}
        entry["rel_l2_vs_dense"] = {n: rel_l2(o, ref) for n, o in outputs.items() if n != "dense"}
        entry["finite"] = {n: bool(torch.isfinite(o).all()) for n, o in outputs.items()}
        entry["receipts"] = {n: {p: _record(s, p, f"{wname}-proof") for p in s.names} for n, s in sessions.items()
                             if n in order}
        del outputs, ref
        calls = {n: call(n, f"{wname}-timing") for n in order}
        rounds, iters = (args.w17_rounds, args.w17_iters) if w17 else (args.w81_rounds, args.w81_iters)
        entry["timing"] = paired_rounds(calls, device, rounds=rounds, warmup=args.warmup, iters=iters,
                                        baseline="dense")
        samples = args.enqueue_samples if w17 else max(3, args.enqueue_samples // 6)
        entry["cpu_enqueue"] = enqueue_profile(calls, device, samples)
        if w17 and "optimized_mha" in calls:
            entry["same_instance_ab"] = same_instance_ab(models["optimized_mha"], calls["optimized_mha"], device,
                                                         rounds=rounds, iters=iters)
        if w17 and device.type == "cuda":
            try:
                entry["cuda_kernels"] = {n: kernel_profile(calls[n]) for n in PROFILED if n in calls}
            except Exception as exc:  # noqa: BLE001 - the profile is optional evidence; recorded, never fatal
                entry["cuda_kernels"] = {"failed": f"{type(exc).__name__}: {exc}"}
    return entry


def kernel_profile(fn: Callable[[], Any], forwards: int = 2, top: int = 25) -> dict[str, Any]:
    """CUDA kernels of ``forwards`` forwards (torch.profiler): count and device time per kernel name, the
    totals, and how much went to copy kernels (e.g. a norm making a non-contiguous Q/K chunk contiguous)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(forwards):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    rows = sorted(({"name": e.key[:160], "count": e.count / forwards,
                    "us_per_forward": e.self_device_time_total / forwards} for e in kernels),
                  key=lambda r: -r["us_per_forward"])

    def share(words: tuple[str, ...]) -> dict[str, float]:
        picked = [r for r in rows if any(w in r["name"].lower() for w in words)]
        return {"kernels": sum(r["count"] for r in picked), "us": sum(r["us_per_forward"] for r in picked)}

    return {"forwards": forwards, "kernels_per_forward": sum(r["count"] for r in rows),
            "device_us_per_forward": sum(r["us_per_forward"] for r in rows),
            "gemm": share(("gemm", "cutlass", "nvjet", "xmma", "cublas")), "copy": share(("copy",)),
            "top": rows[:top]}


def same_instance_ab(model: nn.Module, fn: Callable[[], Any], device: torch.device, *, rounds: int,
                     iters: int) -> dict[str, Any]:
    """The optimized_mha model with its fused branch on vs off (``fused_projections`` toggled between samples,
    alternating which goes first), paired per round: a speed ratio free of model-instance differences."""
    sites = [m for m in model.modules() if m.__dict__.get("fused_projections") is True]
    if not sites:
        return {"skipped": "no module uses the fused branch"}

    def set_branch(on: bool) -> None:
        for m in sites:
            m.__dict__["fused_projections"] = on

    samples: dict[str, list[float]] = {"branch_on": [], "branch_off": []}
    cpu: dict[str, list[float]] = {"branch_on": [], "branch_off": []}
    try:
        for state in (True, False):
            set_branch(state)
            fn()
        for r in range(rounds):
            for state in ((True, False) if r % 2 == 0 else (False, True)):
                set_branch(state)
                dev, enq = _time_sample(fn, device, iters)
                samples["branch_on" if state else "branch_off"].append(dev)
                cpu["branch_on" if state else "branch_off"].append(enq)
    finally:
        set_branch(True)
    ratios = [off / on for on, off in zip(samples["branch_on"], samples["branch_off"], strict=True)]
    return {"sites": len(sites), "rounds": rounds, "iters_per_sample": iters,
            "branch_on_median_ms": statistics.median(samples["branch_on"]),
            "branch_off_median_ms": statistics.median(samples["branch_off"]),
            "paired_speedup_median": statistics.median(ratios), "paired_speedup_min": min(ratios),
            "paired_speedup_max": max(ratios), "paired_ratios": ratios,
            "cpu_enqueue_back_to_back_median_ms": {k: statistics.median(v) for k, v in cpu.items()},
            "note": "branch_off runs the separate projections of the same modules and Parameters (row views of the "
                    "packed storage); speedup = off / on"}


def _restore(dense: nn.Module, models: dict[str, nn.Module], sessions: dict[str, Any],
             inputs: dict[str, Any]) -> dict[str, Any]:
    """After uninstall every plugin copy equals the dense model again (output, state dict, separate storages)."""
    restore = {}
    with torch.no_grad():
        ref = dense(**inputs)[0]
        for name, session in sessions.items():
            session.uninstall()
            model = models[name]
            sd_a, sd_b = dense.state_dict(), model.state_dict()
            storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
            attrs = [n for n, m in model.named_modules() if m.__dict__.get("fused_projections", False)
                     or any(a in m.__dict__ for a in ("to_qkv", "to_kv", "to_added_kv"))]
            restore[name] = {"output_bitwise": bool(torch.equal(model(**inputs)[0], ref)),
                             "state_dict_bitwise": list(sd_a) == list(sd_b)
                             and all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a),
                             "separate_storages": len(storages) == len(list(model.parameters())),
                             "fused_branch_attributes_left": attrs[:4]}
    return restore
