#!/usr/bin/env python3
"""GPU evidence for ``resident_blocks``: fully resident vs resident_blocks vs diffusers group offloading.

Workloads (see shared GPU conventions): W17 and W81 on the Wan2.1-T2V-1.3B architecture, and MiniMax-H3
(diffusers defaults) on one packed sequence of ``--h3-rows`` rows (16,384). Random seeded weights, bf16
(fp32-kept modules stay fp32). Random weights are fine for speed and for the bitwise check.

For each Wan workload, in the same process and with interleaved rounds (the order rotates every round):

* ``resident``            the model fully on the GPU (anchor);
* ``rb_est_per_tensor``   resident_blocks with the estimator's default r (the two-slot schedule rule: the smallest r
                          with no predicted copy wait), measured here, per-tensor layout;
* ``rb_est_contiguous``   the same with one contiguous slab per block (its own estimate);
* ``rb_budget_*``         the r the same measurements give under the budget rule ``(N − r)·d ≤ N·c`` (``--rule budget``);
* ``rb_r0_per_tensor`` / ``rb_r0_contiguous``  r = 0 (two slots only);
* ``group_offload``       diffusers ``enable_group_offload(onload_device, offload_type="block_level",
                          num_blocks_per_group=1, use_stream=True)``.

Per variant: median ms per forward (steady state inside a request; the request start, where the resident
set is built, is reported separately), ratio to resident, bitwise equality to resident, device bytes held
for block weights (plugin accounting, and the measured peak above the resident run), copy-wait per forward
and host synchronisations per forward. The estimator's c, d, N, r are reported per workload and layout.
MiniMax-H3 compares r = 0 against fully resident (the plugin model shares the resident model's non-block
weights, so both fit on one H200).

Usage:
    python benchmarks/offload/resident_blocks.py --out "$OUT"            # H200, about 4-5 minutes
    python benchmarks/offload/resident_blocks.py --workloads W17 --runs 5 --skip-h3 --out "$OUT"   # 5 W17 runs
    python benchmarks/offload/resident_blocks.py --smoke --out /tmp/rb   # tiny models on the CPU (emulated)

Writes ``resident_blocks.json`` and ``resident_blocks.md`` into ``--out`` and prints a short table last.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from worldfoundry.bench.microbench import Region, count_host_syncs

WORKLOADS = {"W17": (17, 320, 576), "W81": (81, 480, 832)}
SMOKE_WORKLOADS = {"S5": (5, 32, 32), "S9": (9, 32, 48)}
WAN_RECIPE, WAN_SMOKE_RECIPE = "wan2.1-t2v-1.3b", "tiny-wan2.1"
H3_RECIPE, H3_SMOKE_RECIPE = "minimax-h3", "tiny-minimax-h3"
TEXT_TOKENS = 512


# ------------------------------------------------------------------------------------------------ timing
class Timer:
    """CUDA events on a GPU (one host sync per forward, like the native runner), perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def measure(self, sink: list[float]) -> Iterator[None]:
        with Region(self.device) as region:
            yield
        sink.append(region.device_ms)


# ------------------------------------------------------------------------------------------------ models
def materialize(cls: type, config: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int) -> nn.Module:
    """Build ``cls(config)`` directly in ``dtype`` on ``device`` (meta first, so a 60 GB model never exists
    in fp32), with seeded random weights and the rotary buffers recomputed."""
    from worldfoundry.core.model_loading.dtypes import apply_dtype_policy

    with torch.device("meta"):
        model = cls.from_config(config)
    apply_dtype_policy(model, dtype)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    _rebuild_rope(model, config, device, dtype)
    return model.eval().requires_grad_(False)


def _rebuild_rope(model: nn.Module, config: dict[str, Any], device: torch.device, dtype: torch.dtype) -> None:
    from diffusers.models.transformers.transformer_minimax_h3 import (
        MiniMaxH3RotaryPosEmbed,
    )
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    from worldfoundry.core.model_loading.dtypes import apply_dtype_policy

    rope = model.rope
    if isinstance(rope, WanRotaryPosEmbed):
        fresh = WanRotaryPosEmbed(rope.attention_head_dim, rope.patch_size, rope.max_seq_len)
    elif isinstance(rope, MiniMaxH3RotaryPosEmbed):
        fresh = MiniMaxH3RotaryPosEmbed(rope.rope_freq_dim, float(config.get("rope_theta", 10000.0)))
    else:
        raise TypeError(f"unknown rotary module {type(rope).__name__}")
    holder = nn.Module()
    holder.rope = fresh
    apply_dtype_policy(holder, dtype, getattr(type(model), "_keep_in_fp32_modules", None) or ())
    model.rope = holder.rope.to(device)


def twin(model: nn.Module, cls: type, config: dict[str, Any]) -> nn.Module:
    """A second model object whose tensors share storage with ``model`` (no extra device memory until a
    plugin moves its block weights)."""
    with torch.device("meta"):
        other = cls.from_config(config)
    other.load_state_dict(model.state_dict(), assign=True, strict=True)
    for name, buf in model.named_buffers():
        module_path, _, attr = name.rpartition(".")
        # buffers are small: copy them, since offloading hooks move buffer data in place (a shared buffer
        # object would be moved for every twin)
        other.get_submodule(module_path)._buffers[attr] = buf.clone()
    return other.eval().requires_grad_(False)


def block_bytes(model: nn.Module, blocks_attr: str) -> int:
    return sum(p.numel() * p.element_size() for p in getattr(model, blocks_attr).parameters())


# ------------------------------------------------------------------------------------------------ inputs
def wan_inputs(config: dict[str, Any], frames: int, height: int, width: int, text_tokens: int,
               device: torch.device, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    lat = ((frames - 1) // 4 + 1, height // 8, width // 8)
    return {
        "hidden_states": torch.randn(1, config["in_channels"], *lat, generator=g).to(device, dtype),
        "timestep": torch.tensor([500], device=device),
        "encoder_hidden_states": torch.randn(1, text_tokens, config["text_dim"], generator=g).to(device, dtype),
    }


def h3_inputs(config: dict[str, Any], rows: int, device: torch.device, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    """One packed sequence: ``text`` text rows (timestep 0), the rest video rows on a (t, 16, w) grid."""
    g = torch.Generator().manual_seed(seed)
    text = min(TEXT_TOKENS, rows // 8)
    video = rows - text
    w = max(1, min(32, video // 16))
    t_idx = torch.arange(video) // (16 * w)
    hw = torch.arange(video) % (16 * w)
    pos = torch.cat([torch.zeros(text, 3, dtype=torch.long), torch.stack([t_idx, hw // w, hw % w], 1)])
    patch = config.get("in_channels", 24) * 4
    return {
        "hidden_states": torch.randn(1, video, patch, generator=g).to(device, dtype),
        "audio_hidden_states": torch.zeros(1, 0, config.get("audio_in_channels", 32), device=device, dtype=dtype),
        "encoder_hidden_states": torch.randn(1, text, config.get("text_dim", 5120), generator=g).to(device, dtype),
        "timestep": torch.tensor([0.0, 0.7], device=device),
        "timestep_indices": torch.cat([torch.zeros(text), torch.ones(video)]).long().to(device),
        "token_tags": torch.cat([torch.ones(text), torch.zeros(video)]).long().to(device),
        "position_ids": pos.to(device),
        "video_indices": torch.arange(text, rows, device=device),
        "audio_indices": torch.arange(0, device=device),
        "text_indices": torch.arange(text, device=device),
    }


def forward(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


# ------------------------------------------------------------------------------------------------ variants
@dataclass
class Variant:
    name: str
    model: nn.Module
    kind: str  # "resident" | "plugin" | "group"
    r: int | None = None
    layout: str | None = None
    samples: list[float] = field(default_factory=list)
    request_start_ms: list[float] = field(default_factory=list)
    receipts: list[dict[str, Any]] = field(default_factory=list)
    output: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _guarded(variant: Variant, rid: str):
    if variant.kind != "plugin":
        return contextlib.nullcontext()
    from worldfoundry.core.acceleration.guard import get_request_guard

    return get_request_guard(variant.model).request(rid)


def run_round(variant: Variant, inputs: dict[str, Any], forwards: int, timer: Timer, rid: str) -> None:
    """One request: begin (timed separately), one warm-up forward, ``forwards`` timed forwards, end."""
    start: list[float] = []
    with timer.measure(start):
        ctx = _guarded(variant, rid)
        ctx.__enter__()
    try:
        out = forward(variant.model, inputs)
        for _ in range(forwards):
            with timer.measure(variant.samples):
                out = forward(variant.model, inputs)
        if variant.output is None:
            variant.output = out.detach().clone()
    finally:
        ctx.__exit__(None, None, None)
    variant.request_start_ms.extend(start)
    if variant.kind == "plugin":
        handle = variant.model._worldfoundry_accelerations.handles("resident_blocks")["model"]
        variant.receipts.append(handle.receipts[rid].to_json())


def sync_probe(variant: Variant, inputs: dict[str, Any], rid: str) -> None:
    """One request of two forwards, nothing timed (for counting host synchronisations)."""
    with _guarded(variant, rid):
        forward(variant.model, inputs)
        forward(variant.model, inputs)


def measure_memory(variant: Variant, inputs: dict[str, Any], device: torch.device, rid: str) -> dict[str, Any]:
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with _guarded(variant, rid):
        forward(variant.model, inputs)
        torch.cuda.synchronize(device)
    return {"peak_extra_mb": round((torch.cuda.max_memory_allocated(device) - base) / 2**20, 1)}


def interleave(variants: list[Variant], inputs: dict[str, Any], rounds: int, forwards: int, timer: Timer,
               tag: str) -> None:
    for variant in variants:  # warm-up request per variant (allocator, kernels, group-offload setup)
        run_round(variant, inputs, 0, timer, f"{tag}-{variant.name}-warm")
        variant.output = None
        variant.receipts.clear()
        variant.request_start_ms.clear()
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for variant in order:
            run_round(variant, inputs, forwards, timer, f"{tag}-{variant.name}-{r}")


def summarize(variants: list[Variant], block_total: int, inputs: dict[str, Any], device: torch.device,
              tag: str) -> list[dict[str, Any]]:
    resident = variants[0]
    base_ms = statistics.median(resident.samples)
    rows = []
    mem = {v.name: measure_memory(v, inputs, device, f"{tag}-{v.name}-mem") for v in variants}
    base_peak = mem[resident.name].get("peak_extra_mb")
    for v in variants:
        med = statistics.median(v.samples)
        row: dict[str, Any] = {
            "variant": v.name, "kind": v.kind, "r": v.r, "layout": v.layout,
            "median_ms": round(med, 3), "ratio_vs_resident": round(med / base_ms, 4),
            "samples_ms": [round(s, 3) for s in v.samples],
            "request_start_ms": round(statistics.median(v.request_start_ms), 3) if v.request_start_ms else None,
            "bitwise_equal_to_resident": bool(v.output is not None and resident.output is not None
                                              and torch.equal(v.output, resident.output)),
            **mem[v.name], **v.extra,
        }
        if base_peak is not None and "peak_extra_mb" in mem[v.name]:
            row["block_mb_on_device_measured"] = round(mem[v.name]["peak_extra_mb"] - base_peak, 1) + (
                round(block_total / 2**20, 1) if v.kind == "resident" else 0.0)
        if v.kind == "resident":
            row["block_mb_on_device"] = round(block_total / 2**20, 1)
        if v.receipts:
            rec = v.receipts[-1]
            held = rec["resident_bytes"] + rec["slot_bytes"]
            row.update({
                "block_mb_on_device": round(held / 2**20, 1),
                "block_fraction_on_device": round(held / block_total, 4),
                "bound_r_plus_2_over_n": round((rec["resident_count"] + 2) / rec["num_blocks"], 4),
                "transfers_per_forward": rec["transfers_per_forward"][-1] if rec["transfers_per_forward"] else 0,
                "copy_wait_ms_per_forward": round(statistics.median(
                    r["copy_wait_ms"] / max(1, r["forwards"]) for r in v.receipts), 4),
                "resident_indices": rec["resident_indices"],
                "emulated": rec["emulated"],
            })
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------ estimator
#: Copy utilisations u reported next to the plain rule (u = 1); the u = 0.85 estimate is timed as well.
COPY_UTILISATIONS = (1.0, 0.9, 0.85, 0.8)


def run_estimator(recipe: str, frames: int, height: int, width: int, device: torch.device, dtype: str,
                  contiguous: bool, smoke: bool, rows: int | None = None) -> dict[str, Any]:
    from worldfoundry.cli.estimate_residency_cmd import measure
    from worldfoundry.core.offload.estimator import resident_count, resident_for_rule

    with tempfile.TemporaryDirectory() as tmp:
        args = argparse.Namespace(
            recipe=recipe, checkpoint_dir=None, random_weights=True, frames=frames, height=height, width=width,
            sequence_length=rows, device=str(device), dtype=dtype, contiguous=contiguous, block_index=0,
            warmup=1 if smoke else 3, samples=3 if smoke else 10, seed=0, out=tmp, copy_utilisation=1.0,
            rule="schedule",
        )
        estimate, _ = measure(args)
    report = estimate.to_report()
    keep = ("layout", "num_blocks", "compute_ms", "transfer_ms", "resident", "resident_block_indices",
            "transfer_gb_per_s", "block_bytes", "tokens", "pinned", "copies_per_block", "emulated",
            "two_slot_predicted_copy_wait_ms_per_forward", "two_slot_resident_without_waits")
    out = {k: report.get(k) for k in keep}
    out["rule"] = report.get("rule")
    out["budget_resident"] = resident_for_rule(estimate.num_blocks, estimate.compute_ms, estimate.transfer_ms,
                                               rule="budget")
    out["resident_at_utilisation"] = {  # the same measurements under the rule (N - r) * d <= u * N * c
        str(u): resident_count(estimate.num_blocks, estimate.compute_ms, estimate.transfer_ms, copy_utilisation=u)
        for u in COPY_UTILISATIONS}
    return out


# ------------------------------------------------------------------------------------------------ runs
def install(model: nn.Module, r: int, contiguous: bool) -> dict[str, Any]:
    """Install resident_blocks; returns the host-side facts (pinned bytes, pinning method, install time)."""
    from worldfoundry.core.acceleration.installer import install_diffusion_accelerations

    t0 = time.perf_counter()
    session = install_diffusion_accelerations(
        model, {"resident_blocks": {"offload_resident_blocks": r, "cpu_offload_block_contiguous": contiguous}}
    )
    report = session.handles("resident_blocks")["model"].execution_report()
    return {"install_s": round(time.perf_counter() - t0, 2),
            "host_pinned_mb": round(report["pinned_bytes"] / 2**20, 1),
            "host_master_mb": round(report["host_bytes"] / 2**20, 1), "pin_method": report["pin_method"]}


def release(variants: list[Variant]) -> None:
    for v in variants:
        session = getattr(v.model, "_worldfoundry_accelerations", None)
        if v.kind == "plugin" and session is not None:
            session.uninstall()
    variants.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_wan(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, timer: Timer) -> dict[str, Any]:
    from diffusers import WanTransformer3DModel

    from worldfoundry.core.model_loading.policy import dtype_name
    from worldfoundry.core.offload.block_probe import resolve_dit_source

    recipe = WAN_SMOKE_RECIPE if args.smoke else WAN_RECIPE
    source = resolve_dit_source(recipe)
    config = dict(source.config)
    text_tokens = source.text_tokens or TEXT_TOKENS
    model = materialize(WanTransformer3DModel, config, device, dtype, seed=0)
    total = block_bytes(model, "blocks")
    workloads = SMOKE_WORKLOADS if args.smoke else WORKLOADS
    out: dict[str, Any] = {"recipe": recipe, "block_bytes_total": total, "num_blocks": len(model.blocks),
                           "workloads": {}}
    for name in args.workloads:
        frames, height, width = workloads[name.split("#")[0]]
        t0 = time.perf_counter()
        estimates = {layout: run_estimator(recipe, frames, height, width, device, dtype_name(dtype),
                                           layout == "contiguous", args.smoke)
                     for layout in ("per_tensor", "contiguous")}
        inputs = wan_inputs(config, frames, height, width, text_tokens, device, dtype, seed=1)
        variants = [Variant("resident", model, "resident")]
        specs = [("rb_est_per_tensor", estimates["per_tensor"]["resident"], False),
                 ("rb_est_contiguous", estimates["contiguous"]["resident"], True),
                 ("rb_budget_per_tensor", estimates["per_tensor"]["budget_resident"], False),
                 ("rb_budget_contiguous", estimates["contiguous"]["budget_resident"], True),
                 ("rb_r0_per_tensor", 0, False), ("rb_r0_contiguous", 0, True)]
        if args.lean:  # repeated runs: the default-rule estimate and r = 0 only
            specs = [spec for spec in specs if not spec[0].startswith("rb_budget")]
        if args.smoke:  # tiny CPU blocks always estimate r = 0; exercise the resident path as well
            specs.append(("rb_r1_per_tensor", 1, False))
        for extra_r in args.extra_r:  # a sweep around the estimate: how the ratio falls as r grows
            for contiguous in (False, True):
                specs.append((f"rb_r{extra_r}_{'contiguous' if contiguous else 'per_tensor'}", extra_r, contiguous))
        for vname, r, contiguous in specs:
            if r == 0 and vname.startswith(("rb_est", "rb_budget")):
                continue  # the estimate is r = 0: the r0 variant of that layout is the same configuration
            if vname.startswith("rb_budget") and r == estimates["contiguous" if contiguous else "per_tensor"]["resident"]:
                continue  # both rules give the same r: rb_est is that configuration
            clone = twin(model, WanTransformer3DModel, config)
            facts = install(clone, r, contiguous)
            variants.append(Variant(vname, clone, "plugin", r, "contiguous" if contiguous else "per_tensor",
                                    extra=facts))
        group = None if args.lean else twin(model, WanTransformer3DModel, config)
        try:
            if group is None:
                raise LookupError("--lean: group offloading not timed")
            group.enable_group_offload(device, offload_device=torch.device("cpu"), offload_type="block_level",
                                       num_blocks_per_group=1, use_stream=device.type == "cuda")
            variants.append(Variant("group_offload", group, "group"))
        except LookupError:
            pass
        except Exception as exc:  # e.g. streams on the CPU smoke run
            out.setdefault("notes", []).append(f"group offloading unavailable: {type(exc).__name__}: {exc}")
        setup_s = time.perf_counter() - t0
        short = name.split("#")[0] in ("W17", "S5")
        rounds = args.rounds_w17 if short else args.rounds_w81
        forwards = args.forwards_w17 if short else 1
        interleave(variants, inputs, rounds, forwards, timer, name)
        rows = summarize(variants, total, inputs, device, name)
        syncs = {v.name: count_host_syncs(device, lambda v=v: sync_probe(v, inputs, f"{name}-{v.name}-sync"))
                 for v in variants if v.kind != "group"}
        out["workloads"][name] = {
            "frames": frames, "height": height, "width": width, "estimates": estimates, "variants": rows,
            "host_sync_warnings_per_request_of_2_forwards": syncs, "setup_s": round(setup_s, 1),
            "rounds": rounds, "forwards_per_round": forwards,
        }
        release(variants)
    del model
    gc.collect()
    return out


def run_h3(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, timer: Timer) -> dict[str, Any]:
    from diffusers import MiniMaxH3Transformer3DModel

    from worldfoundry.core.model_loading.policy import dtype_name
    from worldfoundry.core.offload.block_probe import resolve_dit_source

    recipe = H3_SMOKE_RECIPE if args.smoke else H3_RECIPE
    rows = 64 if args.smoke else args.h3_rows
    config = dict(resolve_dit_source(recipe).config)
    t0 = time.perf_counter()
    estimate = run_estimator(recipe, 17, 256, 256, device, dtype_name(dtype), False, args.smoke, rows=rows)
    model = materialize(MiniMaxH3Transformer3DModel, config, device, dtype, seed=0)
    total = block_bytes(model, "transformer_blocks")
    clone = twin(model, MiniMaxH3Transformer3DModel, config)
    facts = install(clone, 0, False)
    setup_s = time.perf_counter() - t0
    variants = [Variant("resident", model, "resident"),
                Variant("rb_r0_per_tensor", clone, "plugin", 0, "per_tensor", extra=facts)]
    inputs = h3_inputs(config, rows, device, dtype, seed=1)
    interleave(variants, inputs, args.h3_rounds, 1, timer, "H3")
    syncs = {v.name: count_host_syncs(device, lambda v=v: sync_probe(v, inputs, f"H3-{v.name}-sync"))
             for v in variants}
    result = {"recipe": recipe, "rows": rows, "num_blocks": len(model.transformer_blocks), "block_bytes_total": total,
              "estimate": estimate, "variants": summarize(variants, total, inputs, device, "H3"),
              "host_sync_warnings_per_request_of_2_forwards": syncs, "setup_s": round(setup_s, 1),
              "rounds": args.h3_rounds}
    # No uninstall here: restoring 50 blocks to the device next to the resident copy would need twice the
    # model's memory. Dropping the objects releases the pinned host memory (unregistered on collection).
    variants.clear()
    del model, clone
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


# ------------------------------------------------------------------------------------------------ report
def provenance(device: torch.device) -> dict[str, Any]:
    import diffusers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        rev, dirty = "unknown", None
    return {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__, "triton": triton_version, "diffusers": diffusers.__version__,
        "python": platform.python_version(), "git_revision": rev, "git_dirty": dirty,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def table(result: dict[str, Any]) -> str:
    lines = ["| workload | variant | r | layout | ms/forward | × resident | block MB on device | copy-wait ms/fwd "
             "| bitwise |", "|---|---|---|---|---|---|---|---|---|"]
    blocks = [(name, wl["variants"]) for name, wl in result.get("wan", {}).get("workloads", {}).items()]
    if "h3" in result:
        blocks.append((f"H3 {result['h3']['rows']} rows", result["h3"]["variants"]))
    for name, rows in blocks:
        for row in rows:
            lines.append(
                f"| {name} | {row['variant']} | {'' if row['r'] is None else row['r']} | {row['layout'] or ''} | "
                f"{row['median_ms']:.2f} | {row['ratio_vs_resident']:.3f} | {row.get('block_mb_on_device', '')} | "
                f"{row.get('copy_wait_ms_per_forward', '')} | {'yes' if row['bitwise_equal_to_resident'] else 'NO'} |"
            )
    est_lines = []
    for name, wl in result.get("wan", {}).get("workloads", {}).items():
        for layout, e in wl["estimates"].items():
            est_lines.append(f"{name} {layout}: c={e['compute_ms']:.3f} ms d={e['transfer_ms']:.3f} ms "
                             f"N={e['num_blocks']} r={e['resident']} (rule {e.get('rule')}) "
                             f"{e['resident_block_indices']}; budget-rule r={e.get('budget_resident')}; "
                             f"budget r at u = {e.get('resident_at_utilisation')}")
    if "h3" in result:
        e = result["h3"]["estimate"]
        est_lines.append(f"H3 {e['layout']}: c={e['compute_ms']:.3f} ms d={e['transfer_ms']:.3f} ms "
                         f"N={e['num_blocks']} r={e['resident']} (block {e['block_bytes'] / 1e6:.0f} MB)")
    return "\n".join(lines + [""] + est_lines + [""] + run_medians(result))


def run_medians(result: dict[str, Any]) -> list[str]:
    """Median over repeated runs (``--runs``) of each variant's ratio to resident, per workload."""
    ratios: dict[tuple[str, str], list[float]] = {}
    for name, wl in result.get("wan", {}).get("workloads", {}).items():
        for row in wl["variants"]:
            ratios.setdefault((name.split("#")[0], row["variant"]), []).append(row["ratio_vs_resident"])
    lines = []
    for (workload, variant), values in sorted(ratios.items()):
        if len(values) > 1:
            values = sorted(values)
            mid = len(values) // 2
            median = values[mid] if len(values) % 2 else 0.5 * (values[mid - 1] + values[mid])
            lines.append(f"{workload} {variant}: median × resident over {len(values)} runs {median:.3f} "
                         f"(min {values[0]:.3f}, max {values[-1]:.3f})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out/resident_blocks"))
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU (emulated mode)")
    parser.add_argument("--workloads", default=None, help="comma-separated (default W17,W81; smoke S5,S9)")
    parser.add_argument("--rounds-w17", type=int, default=5)
    parser.add_argument("--forwards-w17", type=int, default=3, help="timed forwards per W17 request")
    parser.add_argument("--rounds-w81", type=int, default=3)
    parser.add_argument("--skip-h3", action="store_true")
    parser.add_argument("--lean", action="store_true",
                        help="time only resident, the default-rule estimate and r = 0 (for repeated runs)")
    parser.add_argument("--runs", type=int, default=1,
                        help="repeat each workload this many times in the process (fresh estimates each run)")
    parser.add_argument("--extra-r", default="", help="comma-separated further r values to time, both layouts")
    parser.add_argument("--h3-rows", type=int, default=16384)
    parser.add_argument("--h3-rounds", type=int, default=3)
    parser.add_argument("--time-budget-s", type=float, default=330.0,
                        help="skip MiniMax-H3 when less than 120 s of this budget is left after Wan")
    args = parser.parse_args(argv)
    device = torch.device("cpu") if args.smoke else torch.device("cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; use --smoke for the CPU run", file=sys.stderr)
        return 2
    base = (args.workloads or ("S5,S9" if args.smoke else "W17,W81")).split(",")
    args.workloads = [w if args.runs == 1 else f"{w}#{i + 1}" for w in base for i in range(max(1, args.runs))]
    args.extra_r = [int(r) for r in args.extra_r.split(",") if r.strip()]
    if args.smoke:
        args.rounds_w17, args.rounds_w81, args.forwards_w17, args.h3_rounds = 2, 2, 1, 2
        torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    dtype = torch.float32 if args.smoke else torch.bfloat16
    timer = Timer(device)
    t0 = time.perf_counter()
    result: dict[str, Any] = {"provenance": provenance(device), "args": vars(args),
                              "weights": "random seeded (speed and bitwise only; says nothing about quality)"}
    result["wan"] = run_wan(args, device, dtype, timer)
    left = args.time_budget_s - (time.perf_counter() - t0)
    if not args.skip_h3 and left < 120.0:
        args.skip_h3 = True
        result["h3_skipped"] = f"only {left:.0f} s of the {args.time_budget_s:.0f} s budget left after Wan"
    if not args.skip_h3:
        try:
            result["h3"] = run_h3(args, device, dtype, timer)
        except torch.OutOfMemoryError as exc:
            result["h3_error"] = f"out of memory: {exc}"
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "resident_blocks.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    summary = table(result)
    (out / "resident_blocks.md").write_text(summary + "\n")
    print(json.dumps(result["provenance"]))
    print(f"wall {result['wall_s']} s; full results in {out / 'resident_blocks.json'}")
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
