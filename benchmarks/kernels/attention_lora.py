"""GPU evidence for ``attention_lora``: cost of the FP32 adapter and its accuracy against float64.

Sections (all in one process, every timing interleaved over ≥ 3 paired rounds, medians, warm-up and Triton JIT
excluded):

1. ``kernels`` — the two Triton kernels at the H3 block's shapes (down: x ``rows × 5376`` bf16 → rank 8;
   up-and-add: base ``rows × 7168``), effective bandwidth, a small launch-configuration sweep, and a check of
   the bfloat16×3 tensor-core path against float64.
2. ``h3_block`` — one full-size MiniMax-H3 block (diffusers defaults: hidden 5376, 56 heads × 128, FFN 14336,
   bf16, random weights) on a packed sequence of ``--rows`` rows (16,384: text, video and audio rows are the
   same to a block; two noise levels, three modalities in the AdaLN table). Variants: ``base`` (no adapter),
   ``ours`` (the plugin's activation path: FP32 adapter, Triton kernels, Q/K/V sharing one down step),
   ``naive_fp32`` (``x.float() @ Aᵀ @ Bᵀ`` per projection, the anchor's method) and ``peft_bf16`` (the adapter
   in bf16 as diffusers/PEFT computes it on a bf16 model). Rank 8 on q/k/v/o, scale −1.
   Accuracy: per projection (Q and O at full rows) against float64 evaluation of the same adapter on the same
   bf16 base output; block output at ``--error-rows`` rows against a float64 copy of the block with the
   adapter merged into its weights.
3. ``wan`` — Wan2.1-T2V-1.3B architecture (random seeded weights, bf16, fp32 modules kept as diffusers keeps
   them): W81 (latent 21×60×104 → 32,760 tokens, 512 text tokens) forward with and without a rank-8 adapter on
   every attn1/attn2 q/k/v/o (installed through the plugin), PEFT-bf16-style and naive FP32 wrappers; per
   projection errors at W81; whole-forward error at W17 (3,600 tokens) against a float64 merged model.

Random weights say nothing about visual quality; they are fine for speed and arithmetic accuracy.

Usage::

    python benchmarks/kernels/attention_lora.py --out "$OUT"            # H200, ≈ 3 min
    python benchmarks/kernels/attention_lora.py --smoke --out /tmp/al    # CPU, tiny shapes, < 1 min
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

SCALE = -1.0
H3_FULL = dict(num_attention_heads=56, attention_head_dim=128, hidden_size=5376, ffn_dim=14336,
               time_embed_dim=2688, norm_eps=1e-5, qk_norm_eps=1e-5, rope_freq_dim=16)
H3_SMOKE = dict(num_attention_heads=2, attention_head_dim=32, hidden_size=48, ffn_dim=96, time_embed_dim=24,
                norm_eps=1e-5, qk_norm_eps=1e-5, rope_freq_dim=4)
WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                eps=1e-6, rope_max_seq_len=1024)
WAN_SMOKE = dict(num_attention_heads=2, attention_head_dim=32, in_channels=16, out_channels=16, text_dim=32,
                 freq_dim=32, ffn_dim=128, num_layers=2, rope_max_seq_len=64)


# --------------------------------------------------------------------------------------------------- timing
class Timer:
    """Wall time of ``fn`` per call: CUDA events on the GPU, ``perf_counter`` on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], Any], iters: int) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters


def interleaved(variants: dict[str, tuple[Callable[[], Any], Callable[[], Any]]], run: Callable[[], Any],
                timer: Timer, rounds: int, iters: int) -> dict[str, dict[str, Any]]:
    """Time ``run`` under each variant, attaching/detaching around each measurement, rounds interleaved.

    ``variants[name] = (attach, detach)``. Each variant is warmed once (JIT, allocator) before the rounds.
    """
    names = list(variants)
    for name in names:
        attach, detach = variants[name]
        attach()
        run()
        detach()
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            attach, detach = variants[name]
            attach()
            run()  # one untimed call after attaching
            samples[name].append(timer(run, iters))
            detach()
    return {n: {"median_ms": statistics.median(s), "samples_ms": s} for n, s in samples.items()}


# --------------------------------------------------------------------------------------------------- adapters
def rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def naive_fp32(x: torch.Tensor, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """The anchor's method: ``x.float() @ Aᵀ @ Bᵀ`` added to the base output."""
    return base + (scale * (x.float() @ a.T @ b.T)).to(base.dtype)


def peft_bf16(x: torch.Tensor, base: torch.Tensor, a_lo: torch.Tensor, b_lo: torch.Tensor, scale: float) -> torch.Tensor:
    """diffusers/PEFT on a bf16 model: adapter weights in bf16, both GEMMs and the add in bf16."""
    return base + F.linear(F.linear(x, a_lo), b_lo) * scale


def wrap_all(model: nn.Module, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], kind: str):
    """Wrap projections with the naive-FP32 or PEFT-bf16 arithmetic (recorded, reversible)."""
    from worldfoundry.core.acceleration.patching import PatchRecorder

    recorder = PatchRecorder(kind)
    for path, (a, b) in adapters.items():
        module = model.get_submodule(path)
        dtype = module.weight.dtype
        if kind == "peft_bf16":
            a_use, b_use, fn = a.to(dtype), b.to(dtype), peft_bf16
        else:
            a_use, b_use, fn = a, b, naive_fp32

        def make(original, a_use=a_use, b_use=b_use, fn=fn):
            def forward(x, *args, **kwargs):
                return fn(x, original(x, *args, **kwargs), a_use, b_use, SCALE)
            return forward

        recorder.wrap_forward(module, make, name=kind)
    return recorder


def random_adapter(model: nn.Module, paths: list[str], rank: int, device: torch.device, seed: int,
                   shared_qkv: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{path: (A, B)}`` FP32 on ``device``: A ~ N(0, 1/in), B ~ N(0, 0.05²); H3 Q/K/V share one A."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    shared: dict[str, torch.Tensor] = {}
    for path in paths:
        module = model.get_submodule(path)
        parent = path.rsplit(".", 1)[0]
        if shared_qkv and path.rsplit(".", 1)[1] in ("to_q", "to_k", "to_v"):
            a = shared.setdefault(parent, torch.randn(rank, module.in_features, generator=g) / module.in_features**0.5)
        else:
            a = torch.randn(rank, module.in_features, generator=g) / module.in_features**0.5
        b = torch.randn(module.out_features, rank, generator=g) * 0.05
        out[path] = (a, b)
    return {p: (a.to(device), b.to(device)) for p, (a, b) in out.items()}


def attach_ours(model: nn.Module, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                group_of: Callable[[str], str]):
    """The plugin's own activation path on an arbitrary module (paths relative to it)."""
    from worldfoundry_attention_lora.handle import activate_attention_lora

    from worldfoundry.base_models.diffusion_model.optimizations.attention_lora_format import (
        AdaptedProjection,
        AttentionLoraPlan,
    )

    host_a: dict[int, torch.Tensor] = {}  # one host copy per A object, so shared A stays shared
    projections = tuple(
        AdaptedProjection(p, group_of(p), host_a.setdefault(id(a), a.cpu()), b.cpu(), (p, p))
        for p, (a, b) in adapters.items()
    )
    rank = projections[0].a.shape[0]
    plan = AttentionLoraPlan("benchmark", rank, None, projections, (), 2 * len(projections), None)
    return activate_attention_lora(model, plan, SCALE, device, {"scope": "benchmark"})


def projection_errors(model: nn.Module, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]],
                      inputs: dict[str, torch.Tensor], ours_fn: Callable[[str, torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    """Relative L2 (vs float64 of the same adapter on the same bf16 base output) of ours / PEFT-bf16 / naive."""
    out: dict[str, Any] = {}
    for path, x in inputs.items():
        module = model.get_submodule(path)
        a, b = adapters[path]
        with torch.no_grad():
            base = F.linear(x, module.weight, module.bias)  # nn.Linear's own forward, whatever is wrapped around it
            update64 = SCALE * (x.double() @ a.double().T) @ b.double().T
            ref = base.double() + update64
            ours = ours_fn(path, x)
            peft = peft_bf16(x, base, a.to(x.dtype), b.to(x.dtype), SCALE)
            naive = naive_fp32(x, base, a, b, SCALE)
        norm = float(update64.norm())
        rounded = ref.to(base.dtype)  # the best any method with a bf16 output can return
        entry: dict[str, float] = {"update_over_base": norm / float(base.double().norm())}
        for name, y in (("ours", ours), ("peft_bf16", peft), ("naive_fp32", naive)):
            entry[f"{name}_rel_to_update"] = float((y.double() - ref).norm()) / norm
            entry[f"{name}_distance_to_correctly_rounded_rel_to_update"] = float((y.double() - rounded.double()).norm()) / norm
            entry[f"{name}_correctly_rounded_fraction"] = float((y == rounded).float().mean())
        out[path] = entry
    return out


# --------------------------------------------------------------------------------------------------- sections
def section_kernels(device: torch.device, rows: int, rank: int, timer: Timer, rounds: int) -> dict[str, Any]:
    from worldfoundry.core.acceleration.lora import (
        lora_down_reference,
        lora_up_add_reference,
        split_bf16x3,
    )
    from worldfoundry.core.acceleration.lora.triton_kernels import (
        DownConfig,
        UpConfig,
        lora_down_triton,
        lora_up_add_triton,
    )

    hidden, inner = (5376, 7168) if device.type == "cuda" else (48, 64)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=g).to(torch.bfloat16).to(device)
    a = (torch.randn(rank, hidden, generator=g) / hidden**0.5).to(device)
    a3 = split_bf16x3(a)
    base = torch.randn(rows, inner, generator=g).to(torch.bfloat16).to(device)
    b = (torch.randn(inner, rank, generator=g) * 0.02).to(device)
    t = lora_down_triton(x, a, a3)
    t64 = x.double() @ a.double().T
    bound = hidden * 2.0**-24 * (x.double().abs() @ a.double().abs().T)
    y = lora_up_add_triton(base, t, b, SCALE)
    y_ref = lora_up_add_reference(base, t, b, SCALE)
    res: dict[str, Any] = {
        "shapes": {"rows": rows, "hidden": hidden, "inner": inner, "rank": rank},
        "down_within_fp32_bound": bool(((t.double() - t64).abs() <= bound).all()),
        "down_max_err_over_bound": float(((t.double() - t64).abs() / bound.clamp_min(1e-30)).max()),
        "up_bitwise_equal_fraction_vs_reference": float((y == y_ref).float().mean()),
    }
    if device.type != "cuda":
        return res
    down_bytes = x.numel() * 2
    up_bytes = base.numel() * 2 * 2
    fns = {
        "down_triton": lambda: lora_down_triton(x, a, a3),
        "down_reference": lambda: lora_down_reference(x, a),
        "down_naive_x_float": lambda: x.float() @ a.T,
        "up_triton": lambda: lora_up_add_triton(base, t, b, SCALE),
        "up_reference": lambda: lora_up_add_reference(base, t, b, SCALE),
        "up_naive": lambda: base + (SCALE * (t @ b.T)).to(base.dtype),
    }
    timings: dict[str, list[float]] = {}
    for fn in fns.values():  # compile / warm up
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            timings.setdefault(name, []).append(timer(fn, 20))
    res["timings_ms"] = {k: statistics.median(v) for k, v in timings.items()}
    res["down_triton_GBps"] = down_bytes / res["timings_ms"]["down_triton"] / 1e6
    res["up_triton_GBps"] = up_bytes / res["timings_ms"]["up_triton"] / 1e6
    sweep: dict[str, float] = {}
    for bm in (32, 64, 128):
        for bk in (64, 128):
            cfg = DownConfig(block_m=bm, block_k=bk)
            try:
                lora_down_triton(x, a, a3, config=cfg)
                sweep[f"down bm={bm} bk={bk}"] = statistics.median(timer(lambda cfg=cfg: lora_down_triton(x, a, a3, config=cfg), 20)
                                                                   for _ in range(rounds))
            except Exception as exc:  # a configuration the compiler rejects is reported, not fatal
                sweep[f"down bm={bm} bk={bk}"] = f"failed: {type(exc).__name__}"  # type: ignore[assignment]
    for bm in (32, 64):
        for bn in (64, 128, 256):
            cfg_up = UpConfig(block_m=bm, block_n=bn)
            try:
                lora_up_add_triton(base, t, b, SCALE, config=cfg_up)
                sweep[f"up bm={bm} bn={bn}"] = statistics.median(
                    timer(lambda cfg_up=cfg_up: lora_up_add_triton(base, t, b, SCALE, config=cfg_up), 20)
                    for _ in range(rounds))
            except Exception as exc:
                sweep[f"up bm={bm} bn={bn}"] = f"failed: {type(exc).__name__}"  # type: ignore[assignment]
    res["config_sweep_ms"] = sweep
    return res


def _h3_block(cfg: dict[str, Any], device: torch.device, seed: int):
    from diffusers.models.transformers.transformer_minimax_h3 import (
        MiniMaxH3RotaryPosEmbed,
        MiniMaxH3TransformerBlock,
    )

    torch.manual_seed(seed)
    with torch.device(device):
        block = MiniMaxH3TransformerBlock(cfg["hidden_size"], cfg["num_attention_heads"], cfg["attention_head_dim"],
                                          cfg["ffn_dim"], cfg["time_embed_dim"], cfg["norm_eps"], cfg["qk_norm_eps"])
        rope = MiniMaxH3RotaryPosEmbed(cfg["rope_freq_dim"])
    return block.to(torch.bfloat16).eval(), rope


def _h3_inputs(cfg: dict[str, Any], rope: nn.Module, rows: int, device: torch.device, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, rows, cfg["hidden_size"], generator=g).to(dtype).to(device)
    temb = torch.randn(2, cfg["time_embed_dim"], generator=g).to(device)  # two noise levels, fp32 as in the model
    adaln = torch.randint(0, 6, (rows,), generator=g).to(device)
    pos = torch.stack([torch.arange(rows) // 1024, (torch.arange(rows) // 32) % 32, torch.arange(rows) % 32], 1)
    cos, sin = rope(pos.to(device))
    return hidden, temb.to(dtype) if dtype == torch.float64 else temb, adaln, (cos, sin)


def section_h3_block(device: torch.device, rows: int, error_rows: int, rank: int, timer: Timer, rounds: int,
                     iters: int, smoke: bool) -> dict[str, Any]:
    cfg = H3_SMOKE if smoke else H3_FULL
    block, rope = _h3_block(cfg, device, seed=0)
    paths = [f"attn.{n}" for n in ("to_q", "to_k", "to_v", "to_out.0")]
    adapters = random_adapter(block, paths, rank, device, seed=1, shared_qkv=True)

    def group(path: str) -> str:
        return path if path.endswith("to_out.0") else "attn:hidden_states"

    hidden, temb, adaln, rot = _h3_inputs(cfg, rope, rows, device, torch.bfloat16, seed=2)

    def run() -> torch.Tensor:
        with torch.no_grad():
            return block(hidden, temb, adaln, rot)

    state: dict[str, Any] = {}
    variants = {
        "base": (lambda: None, lambda: None),
        "ours": (lambda: state.update(h=attach_ours(block, adapters, device, group)), lambda: state.pop("h").deactivate()),
        "naive_fp32": (lambda: state.update(r=wrap_all(block, adapters, "naive_fp32")), lambda: state.pop("r").undo()),
        "peft_bf16": (lambda: state.update(r=wrap_all(block, adapters, "peft_bf16")), lambda: state.pop("r").undo()),
    }
    timing = interleaved(variants, run, timer, rounds, iters)
    base_ms = timing["base"]["median_ms"]
    for t in timing.values():
        t["overhead_ms"] = t["median_ms"] - base_ms
        t["overhead_pct"] = 100.0 * t["overhead_ms"] / base_ms

    # per projection accuracy at full rows: capture Q's and O's inputs from a base forward
    captured: dict[str, torch.Tensor] = {}
    hooks = [block.get_submodule(p).register_forward_pre_hook(lambda m, args, p=p: captured.__setitem__(p, args[0]))
             for p in ("attn.to_q", "attn.to_out.0")]
    run()
    for h in hooks:
        h.remove()
    handle = attach_ours(block, adapters, device, group)
    per_projection = projection_errors(block, adapters, captured,
                                       lambda p, x: block.get_submodule(p)(x))
    handle.deactivate()

    # block output vs a float64 copy with the adapter merged, at error_rows rows
    block64 = copy.deepcopy(block).double()
    with torch.no_grad():
        for p, (a, b) in adapters.items():
            block64.get_submodule(p).weight += SCALE * (b.double() @ a.double())
    h16, temb16, adaln16, rot16 = _h3_inputs(cfg, rope, error_rows, device, torch.bfloat16, seed=3)
    with torch.no_grad():
        ref = block64(h16.double(), temb16.double(), adaln16, rot16)
        outputs = {}
        for name, (attach, detach) in variants.items():
            attach()
            outputs[name] = block(h16, temb16, adaln16, rot16)
            detach()
    del block64
    block_errors = {name: rel_l2(out, ref) for name, out in outputs.items()}
    return {
        "config": cfg, "rows": rows, "error_rows": error_rows, "rank": rank, "scale": SCALE,
        "timing": timing, "projection_errors": per_projection, "block_output_rel_l2_vs_float64": block_errors,
        "anchor": {"block_ms": 37.0, "naive_overhead_ms": 2.29, "naive_overhead_pct": 6.2, "goal_pct": 2.0},
    }


def _wan(cfg: dict[str, Any], device: torch.device, seed: int) -> nn.Module:
    from diffusers import WanTransformer3DModel

    from worldfoundry.core.model_loading.dtypes import apply_dtype_policy

    torch.manual_seed(seed)
    with torch.device(device):
        model = WanTransformer3DModel(**cfg)
    return apply_dtype_policy(model, torch.bfloat16).eval()


def _wan_inputs(cfg: dict[str, Any], frames: int, h: int, w: int, text: int, device: torch.device,
                dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(1, cfg["in_channels"], frames, h, w, generator=g).to(dtype).to(device),
        "timestep": torch.tensor([500], device=device),
        "encoder_hidden_states": torch.randn(1, text, cfg["text_dim"], generator=g).to(dtype).to(device),
    }


def section_wan(device: torch.device, rank: int, timer: Timer, rounds: int, smoke: bool) -> dict[str, Any]:
    from worldfoundry_attention_lora import make_prepare
    from worldfoundry_attention_lora.source import state_dict_source

    from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
    from worldfoundry.core.acceleration.registry import AccelerationRegistry
    from worldfoundry.core.model_loading.policy import RuntimePolicy

    cfg = WAN_SMOKE if smoke else WAN_1_3B
    model = _wan(cfg, device, seed=0)
    paths = [f"blocks.{i}.{a}.{p}" for i in range(cfg["num_layers"]) for a in ("attn1", "attn2")
             for p in ("to_q", "to_k", "to_v", "to_out.0")]
    adapters = random_adapter(model, paths, rank, device, seed=1)
    state = {}
    for p, (a, b) in adapters.items():
        state[f"transformer.{p}.lora_A.weight"] = a.cpu()
        state[f"transformer.{p}.lora_B.weight"] = b.cpu()
    registry = AccelerationRegistry(discover=False)
    registry.register("attention_lora", make_prepare(state_dict_source(state)))
    policy = RuntimePolicy(device=device, dtype=torch.bfloat16)
    w81 = (2, 4, 4, 8) if smoke else (21, 60, 104, 512)
    w17 = (2, 4, 4, 8) if smoke else (5, 40, 72, 512)
    inputs = _wan_inputs(cfg, *w81, device, torch.bfloat16, seed=2)

    def run() -> torch.Tensor:
        with torch.no_grad():
            return model(**inputs, return_dict=False)[0]

    holder: dict[str, Any] = {}
    spec = {"attention_lora": {"rank": rank, "scale": SCALE}}
    variants = {
        "base": (lambda: None, lambda: None),
        "ours": (lambda: holder.update(s=install_diffusion_accelerations(model, spec, policy, registry=registry)),
                 lambda: holder.pop("s").uninstall()),
        "naive_fp32": (lambda: holder.update(r=wrap_all(model, adapters, "naive_fp32")), lambda: holder.pop("r").undo()),
        "peft_bf16": (lambda: holder.update(r=wrap_all(model, adapters, "peft_bf16")), lambda: holder.pop("r").undo()),
    }
    timing = interleaved(variants, run, timer, rounds, 1)
    base_ms = timing["base"]["median_ms"]
    for t in timing.values():
        t["overhead_pct"] = 100.0 * (t["median_ms"] - base_ms) / base_ms

    # per projection errors at W81 (first and last block)
    probe = [f"blocks.{i}.{p}" for i in (0, cfg["num_layers"] - 1) for p in ("attn1.to_q", "attn2.to_k", "attn1.to_out.0")]
    captured: dict[str, torch.Tensor] = {}
    hooks = [model.get_submodule(p).register_forward_pre_hook(lambda m, args, p=p: captured.__setitem__(p, args[0]))
             for p in probe]
    run()
    for h in hooks:
        h.remove()
    session = install_diffusion_accelerations(model, spec, policy, registry=registry)
    per_projection = projection_errors(model, adapters, captured, lambda p, x: model.get_submodule(p)(x))
    kernels = session.execution_report()["plugins"]["attention_lora"]["model"]["kernels"]
    session.uninstall()
    captured.clear()

    # whole forward at W17 vs a float64 merged copy
    inputs17 = _wan_inputs(cfg, *w17, device, torch.bfloat16, seed=3)
    model64 = _wan(cfg, device, seed=0)  # a fresh module (the installed one carries a request guard)
    model64.load_state_dict(model.state_dict())
    model64 = model64.double()
    with torch.no_grad():
        for p, (a, b) in adapters.items():
            model64.get_submodule(p).weight += SCALE * (b.double() @ a.double())
        ref = model64(**{k: v.double() if v.is_floating_point() else v for k, v in inputs17.items()},
                      return_dict=False)[0]
    del model64
    forward_errors = {}
    with torch.no_grad():
        for name, (attach, detach) in variants.items():
            attach()
            forward_errors[name] = rel_l2(model(**inputs17, return_dict=False)[0], ref)
            detach()
    def tokens(shape: tuple[int, ...]) -> int:
        return shape[0] * (shape[1] // 2) * (shape[2] // 2)

    return {
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
        "w81_latent": list(w81[:3]), "w81_tokens": tokens(w81), "w17_tokens": tokens(w17), "rank": rank,
        "adapted_projections": len(paths), "timing": timing, "projection_errors_w81": per_projection,
        "forward_rel_l2_vs_float64_w17": forward_errors, "ours_kernel_counts": kernels,
    }


# --------------------------------------------------------------------------------------------------- main
def provenance(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device)}
    for mod in ("triton", "diffusers"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        root = Path(__file__).resolve().parents[2]
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True, timeout=10)
        info["git_revision"] = rev.stdout.strip() or None
        info["git_dirty"] = bool(dirty.stdout.strip()) if rev.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        info["git_revision"] = None
    return info


def summary_table(result: dict[str, Any]) -> str:
    lines = ["", "attention_lora — rank {} scale {}".format(result["args"]["rank"], SCALE)]
    h3 = result.get("h3_block")
    if h3:
        lines.append(f"H3 block, {h3['rows']} rows, bf16          median ms   overhead")
        for name, t in h3["timing"].items():
            lines.append(f"  {name:<32} {t['median_ms']:9.3f}   {t['overhead_pct']:+6.2f}%")
        lines.append("  anchor: block 37.0 ms, naive +2.29 ms (+6.2%), goal <= +2%")
        q = h3["projection_errors"].get("attn.to_q", {})
        if q:
            lines.append(f"  Q projection error / update (vs fp64): ours {q['ours_rel_to_update']:.2e}  "
                         f"peft-bf16 {q['peft_bf16_rel_to_update']:.2e}  naive {q['naive_fp32_rel_to_update']:.2e}")
            lines.append("  Q correctly rounded bf16 fraction: " + "  ".join(
                f"{n} {q[f'{n}_correctly_rounded_fraction']:.4f}" for n in ("ours", "peft_bf16", "naive_fp32")))
        e = h3["block_output_rel_l2_vs_float64"]
        lines.append(f"  block output rel L2 vs fp64 ({h3['error_rows']} rows): " +
                     "  ".join(f"{k} {v:.2e}" for k, v in e.items()))
    k = result.get("kernels", {})
    if "timings_ms" in k:
        lines.append(f"kernels: down {k['timings_ms']['down_triton']:.3f} ms ({k['down_triton_GBps']:.0f} GB/s)  "
                     f"up {k['timings_ms']['up_triton']:.3f} ms ({k['up_triton_GBps']:.0f} GB/s)  "
                     f"down within fp32 bound: {k['down_within_fp32_bound']}")
    wan = result.get("wan")
    if wan:
        lines.append(f"Wan2.1-1.3B W81 forward ({wan['w81_tokens']} tokens, {wan['adapted_projections']} projections)")
        for name, t in wan["timing"].items():
            lines.append(f"  {name:<32} {t['median_ms']:9.1f}   {t['overhead_pct']:+6.2f}%")
        lines.append(f"  forward rel L2 vs fp64 at W17 ({wan['w17_tokens']} tokens): " +
                     "  ".join(f"{k} {v:.2e}" for k, v in wan["forward_rel_l2_vs_float64_w17"].items()))
        errs = wan["projection_errors_w81"]
        ours = statistics.median(v["ours_rel_to_update"] for v in errs.values())
        peft = statistics.median(v["peft_bf16_rel_to_update"] for v in errs.values())
        lines.append(f"  projection error / update (median of {len(errs)}): ours {ours:.2e}  peft-bf16 {peft:.2e}")
        ours_cr = statistics.median(v["ours_correctly_rounded_fraction"] for v in errs.values())
        peft_cr = statistics.median(v["peft_bf16_correctly_rounded_fraction"] for v in errs.values())
        lines.append(f"  correctly rounded bf16 fraction (median): ours {ours_cr:.4f}  peft-bf16 {peft_cr:.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (checks the script runs)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out/attention_lora"))
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--error-rows", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--skip-wan", action="store_true")
    parser.add_argument("--skip-kernels", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        device = torch.device("cpu")
        args.rows, args.error_rows, args.rounds, args.iters = 64, 32, 3, 1
    else:
        if not torch.cuda.is_available():
            parser.error("needs CUDA (use --smoke on the CPU)")
        device = torch.device("cuda")
    timer = Timer(device)
    result: dict[str, Any] = {"args": vars(args), "provenance": provenance(device)}
    t0 = time.perf_counter()
    sections: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    if not args.skip_kernels and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        sections.append(("kernels", lambda: section_kernels(device, args.rows, args.rank, timer, args.rounds)))
    sections.append(("h3_block", lambda: section_h3_block(device, args.rows, args.error_rows, args.rank, timer,
                                                          args.rounds, args.iters, args.smoke)))
    if not args.skip_wan:
        sections.append(("wan", lambda: section_wan(device, args.rank, timer, max(3, args.rounds - 2), args.smoke)))
    for name, section in sections:
        try:  # one failing section must not lose the others' results
            result[name] = section()
        except Exception as exc:  # noqa: BLE001 - reported in the JSON and on stderr
            traceback.print_exc()
            result.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["elapsed_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_lora.json").write_text(json.dumps(result, indent=2, default=str))
    print(summary_table(result))
    for name, error in result.get("errors", {}).items():
        print(f"section {name} failed: {error}")
    print(f"\nfull results: {out / 'attention_lora.json'}  ({result['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
