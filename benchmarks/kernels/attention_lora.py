"""GPU evidence for ``attention_lora``: cost of the FP32 adapter and its accuracy against float64.

Sections (all in one process; warm-up and Triton JIT excluded from every timing):

1. ``kernels`` — the Triton kernels at the H3 block's shapes: the down step for rank 8 and for three rank-8
   adapters stacked on tile boundaries (Q/K/V with separate ``A``, read ``x`` once) against three separate
   launches; the up-and-add step for 7,168- and 5,376-wide bf16 outputs; a plain copy of the same bytes as the
   bandwidth anchor; GB/s for each; a small launch-configuration sweep. Checks: down within the FP32 bound of
   float64, stacked columns bitwise equal to separate launches, up bitwise equal to its torch reference.
2. ``h3_block`` — one full-size MiniMax-H3 block (diffusers defaults: hidden 5376, 56 heads × 128, FFN 14336,
   bf16, random weights) on a packed sequence of ``--rows`` rows (16,384: text, video and audio rows are the
   same to a block; two noise levels, three modalities in the AdaLN table). Variants: ``base`` (no adapter),
   ``ours`` (the plugin's activation path: FP32 adapter, Triton kernels, Q/K/V sharing one down step),
   ``naive_fp32`` (``x.float() @ Aᵀ @ Bᵀ`` per projection, the anchor's method) and ``peft_bf16`` (the adapter
   in bf16 as diffusers/PEFT computes it on a bf16 model). Rank 8 on q/k/v/o, scale −1. Timing: ``--pairs``
   ABBA rounds (base, variant, variant, base) per variant, interleaved; the overhead is the median of the paired
   ratios ``(B₁ + B₂) / (A₁ + A₂)``. Accuracy: per projection (Q and O at full rows) against float64 evaluation
   of the same adapter on the same bf16 base output; block output at ``--error-rows`` rows against a float64
   copy of the block with the adapter merged into its weights.
3. ``wan`` — Wan2.1-T2V-1.3B architecture (random seeded weights, bf16, fp32 modules kept as diffusers keeps
   them): W81 (latent 21×60×104 → 32,760 tokens, 512 text tokens) forward with and without a rank-8 adapter on
   every attn1/attn2 q/k/v/o (installed through the plugin), PEFT-bf16-style and naive FP32 wrappers, ABBA pairs
   as above (``--wan-pairs``, fewer when ``--budget-s`` runs short); per projection errors at W81;
   whole-forward error at W17 (3,600 tokens) against a float64 merged model.

Random weights say nothing about visual quality; they are fine for speed and arithmetic accuracy.

Usage::

    python benchmarks/kernels/attention_lora.py --out "$OUT"            # H200, ≈ 4 min (budget 330 s)
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
import torch.nn.functional as F
from torch import nn

from worldfoundry.bench.microbench import time_ms

SCALE = -1.0
H3_FULL = {"num_attention_heads": 56, "attention_head_dim": 128, "hidden_size": 5376, "ffn_dim": 14336,
           "time_embed_dim": 2688, "norm_eps": 1e-5, "qk_norm_eps": 1e-5, "rope_freq_dim": 16}
H3_SMOKE = {"num_attention_heads": 2, "attention_head_dim": 32, "hidden_size": 48, "ffn_dim": 96, "time_embed_dim": 24,
            "norm_eps": 1e-5, "qk_norm_eps": 1e-5, "rope_freq_dim": 4}
WAN_1_3B = {"patch_size": (1, 2, 2), "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16,
            "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30,
            "cross_attn_norm": True, "eps": 1e-6, "rope_max_seq_len": 1024}
WAN_SMOKE = {"num_attention_heads": 2, "attention_head_dim": 32, "in_channels": 16, "out_channels": 16, "text_dim": 32,
             "freq_dim": 32, "ffn_dim": 128, "num_layers": 2, "rope_max_seq_len": 64}


# --------------------------------------------------------------------------------------------------- timing
class Timer:
    """Milliseconds of ``fn`` per call on one device (:func:`worldfoundry.bench.microbench.time_ms`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def __call__(self, fn: Callable[[], Any], iters: int) -> float:
        return time_ms(fn, self.device, iters)


def paired_abba(variants: dict[str, tuple[Callable[[], Any], Callable[[], Any]]], run: Callable[[], Any],
                timer: Timer, pairs: int, iters: int, deadline: float | None = None,
                min_pairs: int = 3) -> dict[str, dict[str, Any]]:
    """Time ``run`` under each variant against ``variants["base"]`` in ABBA rounds.

    ``variants[name] = (attach, detach)``. Each variant is warmed once (JIT, allocator). Every round measures,
    for each non-base variant in turn, base, variant, variant, base (attaching before and detaching after each
    measurement, one untimed call after attaching); the paired ratio is ``(B₁ + B₂) / (A₁ + A₂)``, so a slow
    drift of the machine cancels within the pair. Rounds stop early (after ``min_pairs``) past ``deadline``.

    Returns:
        Per variant: ``median_ms``, ``samples_ms``; for non-base variants also ``paired_ratios``,
        ``median_paired_overhead_pct`` (the headline), its quartiles and ``pairs``.
    """
    names = list(variants)

    def measure(name: str) -> float:
        attach, detach = variants[name]
        attach()
        try:
            run()  # one untimed call after attaching
            return timer(run, iters)
        finally:
            detach()

    for name in names:
        measure(name)
    others = [n for n in names if n != "base"]
    samples: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in others}
    for r in range(pairs):
        if deadline is not None and r >= min_pairs and time.perf_counter() > deadline:
            break
        for name in others[r % len(others):] + others[:r % len(others)]:
            a1, b1, b2, a2 = measure("base"), measure(name), measure(name), measure("base")
            samples["base"] += [a1, a2]
            samples[name] += [b1, b2]
            ratios[name].append((b1 + b2) / (a1 + a2))
    out: dict[str, dict[str, Any]] = {n: {"median_ms": statistics.median(s), "samples_ms": s} for n, s in samples.items()}
    for name in others:
        pct = sorted(100.0 * (q - 1.0) for q in ratios[name])
        out[name].update({
            "pairs": len(pct),
            "paired_ratios": ratios[name],
            "median_paired_overhead_pct": statistics.median(pct),
            "paired_overhead_pct_quartiles": statistics.quantiles(pct, n=4) if len(pct) > 1 else pct * 3,
            "median_paired_overhead_ms": statistics.median(samples["base"]) * statistics.median(pct) / 100.0,
        })
    out["base"]["median_paired_overhead_pct"] = 0.0
    return out


def timed_median(fn: Callable[[], Any], timer: Timer, rounds: int, iters: int = 20) -> float:
    fn()
    return statistics.median(timer(fn, iters) for _ in range(rounds))


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
    on_device: dict[int, torch.Tensor] = {}  # one device copy per A object, so a shared A stays shared
    return {p: (on_device.setdefault(id(a), a.to(device)), b.to(device)) for p, (a, b) in out.items()}


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
UP_SWEEP = ((32, 256, 4), (16, 256, 4), (16, 512, 4), (16, 128, 2), (8, 256, 2), (64, 128, 4))
DOWN_SWEEP = ((64, 128, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4))


def section_kernels(device: torch.device, rows: int, rank: int, timer: Timer, rounds: int) -> dict[str, Any]:
    from worldfoundry.core.acceleration.lora import (
        lora_down_reference,
        lora_up_add_reference,
        split_bf16x3,
        stack_down_groups,
    )
    from worldfoundry.core.acceleration.lora.reference import padded_rank
    from worldfoundry.core.acceleration.lora.triton_kernels import (
        DownConfig,
        UpConfig,
        kernel_configs,
        lora_down_triton,
        lora_up_add_triton,
    )

    cuda = device.type == "cuda"
    hidden, inner = (5376, 7168) if cuda else (48, 64)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=g).to(torch.bfloat16).to(device)        # Q/K/V input
    x_o = torch.randn(rows, inner, generator=g).to(torch.bfloat16).to(device)       # O input (attention output)
    parts = [torch.randn(rank, hidden, generator=g) / hidden**0.5 for _ in range(3)]
    a = parts[0].to(device)
    a3 = split_bf16x3(a)
    (stacked, offsets), = stack_down_groups([(n, p) for n, p in zip("qkv", parts)])
    stacked = stacked.to(device)
    stacked3 = split_bf16x3(stacked)
    a_o = (torch.randn(rank, inner, generator=g) / inner**0.5).to(device)
    a_o3 = split_bf16x3(a_o)
    base = torch.randn(rows, inner, generator=g).to(torch.bfloat16).to(device)     # Q/K/V outputs (7168 wide)
    base_o = torch.randn(rows, hidden, generator=g).to(torch.bfloat16).to(device)  # O output (5376 wide)
    b = (torch.randn(rank, inner, generator=g) * 0.02).to(device).t()      # the adapter keeps Bᵀ contiguous
    b_o = (torch.randn(rank, hidden, generator=g) * 0.02).to(device).t()
    t = lora_down_triton(x, a, a3)
    t64 = x.double() @ a.double().T
    bound = hidden * 2.0**-24 * (x.double().abs() @ a.double().abs().T)
    t_stacked = lora_down_triton(x, stacked, stacked3)
    separate = [lora_down_triton(x, p.to(device), split_bf16x3(p.to(device))) for p in parts]
    check_rows = min(rows, 4096)  # the reference up step emulates FMA in FP64: keep the check short
    up_equal = {}
    for scale in (SCALE, 0.37):
        y = lora_up_add_triton(base[:check_rows], t[:check_rows], b, scale)
        y_ref = lora_up_add_reference(base[:check_rows], t[:check_rows], b, scale)
        up_equal[str(scale)] = float((y.view(torch.int16) == y_ref.view(torch.int16)).float().mean())
    res: dict[str, Any] = {
        "shapes": {"rows": rows, "hidden": hidden, "inner": inner, "rank": rank},
        "configs": kernel_configs(),
        "down_within_fp32_bound": bool(((t.double() - t64).abs() <= bound).all()),
        "down_max_err_over_bound": float(((t.double() - t64).abs() / bound.clamp_min(1e-30)).max()),
        "down_stacked_qkv_bitwise_equal_separate": all(
            torch.equal(t_stacked[:, offsets[n]:offsets[n] + rank], sep) for n, sep in zip("qkv", separate)),
        "up_bitwise_equal_fraction_vs_reference": up_equal,
        "up_check_rows": check_rows,
    }
    if not cuda:
        return res
    out = torch.empty_like(base)
    out_o = torch.empty_like(base_o)
    member_rows = [slice(offsets[n], offsets[n] + padded_rank(rank)) for n in "qkv"]
    fns: dict[str, tuple[Callable[[], Any], int]] = {  # name -> (fn, bytes moved)
        "down_rank8": (lambda: lora_down_triton(x, a, a3), x.numel() * 2),
        "down_qkv_stacked_3x8": (lambda: lora_down_triton(x, stacked, stacked3), x.numel() * 2),
        "down_qkv_separate_3x8": (lambda: [lora_down_triton(x, stacked[rows_of], stacked3[:, rows_of])
                                           for rows_of in member_rows], 3 * x.numel() * 2),
        "down_o_rank8": (lambda: lora_down_triton(x_o, a_o, a_o3), x_o.numel() * 2),
        "down_reference": (lambda: lora_down_reference(x, a), x.numel() * 2),
        "down_naive_x_float": (lambda: x.float() @ a.T, x.numel() * 2),
        "up_7168": (lambda: lora_up_add_triton(base, t, b, SCALE), base.numel() * 4),
        "up_5376": (lambda: lora_up_add_triton(base_o, t, b_o, SCALE), base_o.numel() * 4),
        "copy_7168": (lambda: out.copy_(base), base.numel() * 4),
        "copy_5376": (lambda: out_o.copy_(base_o), base_o.numel() * 4),
        "up_naive": (lambda: base + (SCALE * (t @ b.T)).to(base.dtype), base.numel() * 4),
    }
    timings: dict[str, list[float]] = {}
    for fn, _ in fns.values():  # compile / warm up
        fn()
    for _ in range(rounds):
        for name, (fn, _) in fns.items():
            timings.setdefault(name, []).append(timer(fn, 20))
    res["timings_ms"] = {k: statistics.median(v) for k, v in timings.items()}
    res["GBps"] = {k: fns[k][1] / ms / 1e6 for k, ms in res["timings_ms"].items()}
    ms = res["timings_ms"]
    res["up_over_copy"] = {"7168": ms["up_7168"] / ms["copy_7168"], "5376": ms["up_5376"] / ms["copy_5376"]}
    # what one H3 block's adapter costs in kernels alone: one Q/K/V down (shared A), one O down, four up steps
    res["block_kernel_ms"] = ms["down_rank8"] + ms["down_o_rank8"] + 3 * ms["up_7168"] + ms["up_5376"]
    res["block_copy_floor_ms"] = ms["copy_7168"] * 3 + ms["copy_5376"] + (x.numel() + x_o.numel()) * 2 / (
        res["GBps"]["copy_7168"] * 1e6)
    sweep: dict[str, Any] = {}
    for bm, bn, warps in UP_SWEEP:
        cfg_up = UpConfig(block_m=bm, block_n=bn, num_warps=warps)
        for width, (bb, bt) in (("7168", (base, b)), ("5376", (base_o, b_o))):
            key = f"up{width} bm={bm} bn={bn} w={warps}"
            try:
                sweep[key] = timed_median(lambda cfg_up=cfg_up, bb=bb, bt=bt: lora_up_add_triton(bb, t, bt, SCALE, config=cfg_up),
                                          timer, rounds)
            except Exception as exc:  # noqa: BLE001 - a configuration the compiler rejects is reported, not fatal
                sweep[key] = f"failed: {type(exc).__name__}: {exc}"[:200]
    for bm, bk, warps, stages in DOWN_SWEEP:
        cfg = DownConfig(block_m=bm, block_k=bk, num_warps=warps, num_stages=stages)
        for name, (aa, aa3) in (("rank8", (a, a3)), ("qkv_stacked", (stacked, stacked3))):
            key = f"down_{name} bm={bm} bk={bk} w={warps} s={stages}"
            try:
                sweep[key] = timed_median(lambda cfg=cfg, aa=aa, aa3=aa3: lora_down_triton(x, aa, aa3, config=cfg), timer, rounds)
            except Exception as exc:  # noqa: BLE001 - reported, not fatal
                sweep[key] = f"failed: {type(exc).__name__}: {exc}"[:200]
    res["config_sweep_ms"] = sweep
    for width in ("7168", "5376"):
        timed = {k: v for k, v in sweep.items() if k.startswith(f"up{width} ") and isinstance(v, float)}
        if timed:
            best = min(timed, key=timed.__getitem__)
            res[f"best_up{width}"] = {"config": best, "ms": timed[best],
                                      "GBps": (base if width == "7168" else base_o).numel() * 4 / timed[best] / 1e6}
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


def section_h3_block(device: torch.device, rows: int, error_rows: int, rank: int, timer: Timer, pairs: int,
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
    timing = paired_abba(variants, run, timer, pairs, iters)
    for t in timing.values():
        t["overhead_pct"] = t["median_paired_overhead_pct"]

    # what ran in one forward with the adapter: kernels (no reference fallback) and the Q/K/V hand-over
    handle = attach_ours(block, adapters, device, group)
    run()
    executed = handle.stats.to_json()
    handle.deactivate()

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
        "config": cfg, "rows": rows, "error_rows": error_rows, "rank": rank, "scale": SCALE, "pairs": pairs,
        "iters_per_sample": iters, "timing": timing, "executed_per_forward": executed,
        "projection_errors": per_projection, "block_output_rel_l2_vs_float64": block_errors,
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


def section_wan(device: torch.device, rank: int, timer: Timer, pairs: int, smoke: bool,
                deadline: float | None = None) -> dict[str, Any]:
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
    timing = paired_abba(variants, run, timer, pairs, 1, deadline=deadline)
    for t in timing.values():
        t["overhead_pct"] = t["median_paired_overhead_pct"]

    # per projection errors at W81 (first and last block)
    probe = [f"blocks.{i}.{p}" for i in (0, cfg["num_layers"] - 1) for p in ("attn1.to_q", "attn2.to_k", "attn1.to_out.0")]
    captured: dict[str, torch.Tensor] = {}
    hooks = [model.get_submodule(p).register_forward_pre_hook(lambda m, args, p=p: captured.__setitem__(p, args[0]))
             for p in probe]
    run()
    for h in hooks:
        h.remove()
    session = install_diffusion_accelerations(model, spec, policy, registry=registry)
    run()  # one forward: what ran (kernels, fallbacks, Q/K/V and K/V hand-overs)
    kernels = session.execution_report()["plugins"]["attention_lora"]["model"]["kernels"]
    per_projection = projection_errors(model, adapters, captured, lambda p, x: model.get_submodule(p)(x))
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
        "adapted_projections": len(paths), "pairs_requested": pairs, "timing": timing,
        "projection_errors_w81": per_projection, "forward_rel_l2_vs_float64_w17": forward_errors,
        "ours_executed_per_forward": kernels,
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
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=False)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True, timeout=10, check=False)
        info["git_revision"] = rev.stdout.strip() or None
        info["git_dirty"] = bool(dirty.stdout.strip()) if rev.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        info["git_revision"] = None
    return info


def summary_table(result: dict[str, Any]) -> str:
    lines = ["", "attention_lora — rank {} scale {}".format(result["args"]["rank"], SCALE)]
    h3 = result.get("h3_block")
    if h3:
        lines.append(f"H3 block, {h3['rows']} rows, bf16, {h3['pairs']} ABBA pairs   median ms   "
                     "median paired overhead [quartiles]")
        for name, t in h3["timing"].items():
            q = t.get("paired_overhead_pct_quartiles")
            spread = f"  [{q[0]:+.2f}, {q[2]:+.2f}]" if q else ""
            lines.append(f"  {name:<32} {t['median_ms']:9.3f}   {t['overhead_pct']:+6.2f}%{spread}")
        lines.append("  anchor: block 37.0 ms, naive +2.29 ms (+6.2%), goal <= +2%")
        lines.append(f"  ours per forward: {h3['executed_per_forward']}")
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
    if k:
        lines.append(f"kernels: down within fp32 bound {k['down_within_fp32_bound']}, stacked Q/K/V bitwise = separate "
                     f"{k['down_stacked_qkv_bitwise_equal_separate']}, up bitwise = reference "
                     f"{k['up_bitwise_equal_fraction_vs_reference']}")
    if "timings_ms" in k:
        for name, ms in k["timings_ms"].items():
            lines.append(f"  {name:<28} {ms:8.4f} ms  {k['GBps'][name]:7.0f} GB/s")
        lines.append(f"  up / copy of the same bytes: {k['up_over_copy']}")
        lines.append(f"  one H3 block's adapter kernels: {k['block_kernel_ms']:.3f} ms "
                     f"(copy floor {k['block_copy_floor_ms']:.3f} ms)")
        for width in ("7168", "5376"):
            best = k.get(f"best_up{width}")
            if best:
                lines.append(f"  best swept up{width}: {best['config']} {best['ms']:.4f} ms ({best['GBps']:.0f} GB/s)")
    wan = result.get("wan")
    if wan:
        lines.append(f"Wan2.1-1.3B W81 forward ({wan['w81_tokens']} tokens, {wan['adapted_projections']} projections, "
                     f"{wan['timing']['ours'].get('pairs')} ABBA pairs)")
        for name, t in wan["timing"].items():
            lines.append(f"  {name:<32} {t['median_ms']:9.1f}   {t['overhead_pct']:+6.2f}%")
        lines.append(f"  ours per forward: {wan['ours_executed_per_forward']}")
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
    parser.add_argument("--rounds", type=int, default=5, help="kernel timing rounds (median)")
    parser.add_argument("--pairs", type=int, default=11, help="ABBA pairs per variant, H3 block")
    parser.add_argument("--iters", type=int, default=5, help="block forwards per H3 timing sample")
    parser.add_argument("--wan-pairs", type=int, default=5, help="ABBA pairs per variant, Wan W81 (at least 3)")
    parser.add_argument("--budget-s", type=float, default=330.0,
                        help="wall-clock budget: Wan pairs stop early (after 3) once it is reached")
    parser.add_argument("--skip-wan", action="store_true")
    parser.add_argument("--skip-kernels", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        device = torch.device("cpu")
        args.rows, args.error_rows, args.rounds, args.iters, args.pairs, args.wan_pairs = 64, 32, 3, 1, 3, 3
    else:
        if not torch.cuda.is_available():
            parser.error("needs CUDA (use --smoke on the CPU)")
        device = torch.device("cuda")
    timer = Timer(device)
    result: dict[str, Any] = {"args": vars(args), "provenance": provenance(device)}
    t0 = time.perf_counter()
    # the float64 W17 reference after the Wan timing takes about 40 s on the H200: stop the pairs before that
    wan_deadline = t0 + args.budget_s - (5.0 if args.smoke else 60.0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    if not args.skip_kernels and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        sections.append(("kernels", lambda: section_kernels(device, args.rows, args.rank, timer, args.rounds)))
    sections.append(("h3_block", lambda: section_h3_block(device, args.rows, args.error_rows, args.rank, timer,
                                                          args.pairs, args.iters, args.smoke)))
    if not args.skip_wan:
        sections.append(("wan", lambda: section_wan(device, args.rank, timer, max(3, args.wan_pairs), args.smoke,
                                                    deadline=wan_deadline)))
    for name, section in sections:
        started = time.perf_counter()
        try:  # one failing section must not lose the others' results
            result[name] = section()
        except Exception as exc:  # noqa: BLE001 - reported in the JSON and on stderr
            traceback.print_exc()
            result.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
        result.setdefault("section_s", {})[name] = time.perf_counter() - started
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result["elapsed_s"] = time.perf_counter() - t0
        (out / "attention_lora.json").write_text(json.dumps(result, indent=2, default=str))  # after every section
    try:
        print(summary_table(result))
    except Exception as exc:  # noqa: BLE001 - the JSON is already written
        print(f"summary failed ({type(exc).__name__}: {exc}); see the JSON")
    for name, error in result.get("errors", {}).items():
        print(f"section {name} failed: {error}")
    print(f"\nfull results: {out / 'attention_lora.json'}  ({result['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
