"""GPU evidence for ``worldfoundry.accelerate(pipe, spec)`` on diffusers' own ``WanPipeline``.

One run, Wan2.1-T2V-1.3B architecture with random seeded weights (bf16, fp32 modules kept as diffusers keeps
them), W17 (17 frames 320x576, latent 5x40x72) by default, ``--steps`` steps with CFG, text embeddings given
(512 tokens). Measured side by side, interleaved paired rounds (rotating order, warm-up excluded):

* ``vanilla``: diffusers' ``WanPipeline.__call__`` as shipped (the anchor);
* ``scope``: the pipeline with the request scope only (``easycache`` at threshold 0 - every step computed);
  goal: bitwise equal to vanilla, overhead within the noise (paired ratio ~1.00);
* ``static_kv``: ``wan_cross_kv_fusion`` (packed cross K/V + static text K/V per request and branch);
  goal: bitwise equal, hits = (steps - 1) x layers per branch, faster than vanilla;
* ``static_kv+mha``: ``wan_cross_kv_fusion`` + ``optimized_mha`` (self-attention QKV packing); goal: bitwise.

Every part runs in its own ``try``; a failing part is printed and the rest still runs. Prints a short table
last and writes ``$OUT/diffusers_pipeline.json`` (``--out``, default ``$OUT`` or ``./bench_out``).

Usage::

    python benchmarks/inference/diffusers_pipeline.py                  # H200, W17, 10 steps (about 2 min)
    python benchmarks/inference/diffusers_pipeline.py --workload W81 --steps 4
    python benchmarks/inference/diffusers_pipeline.py --smoke          # CPU, tiny shapes (seconds)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import traceback
from pathlib import Path
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

import worldfoundry
from worldfoundry.bench.microbench import WAN_1_3B, WAN_TINY, interleaved, provenance, rel_l2, sync

logger = logging.getLogger("diffusers_pipeline_bench")
SPECS: dict[str, dict[str, Any]] = {
    "scope": {"easycache": {"threshold": 0.0}},
    "static_kv": {"wan_cross_kv_fusion": {}},
    "static_kv+mha": {"wan_cross_kv_fusion": {}, "optimized_mha": {"self": {}}},
}
SHAPES = {"W17": (17, 320, 576), "W81": (81, 480, 832)}


def build_pipeline(config: dict[str, Any], device: torch.device) -> WanPipeline:
    torch.manual_seed(0)
    with torch.device(device):
        model = WanTransformer3DModel(**config)
    keep = list(getattr(type(model), "_keep_in_fp32_modules", None) or [])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(torch.float32 if any(k in name.split(".") for k in keep) else dtype)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, transformer=model.eval(), vae=None,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def make_call(pipe: WanPipeline, args: argparse.Namespace, device: torch.device, config: dict[str, Any]):
    frames, height, width = (5, 32, 32) if args.smoke else SHAPES[args.workload]
    tokens = 16 if args.smoke else 512
    g = torch.Generator().manual_seed(1)
    dtype = pipe.transformer.patch_embedding.weight.dtype
    prompt = torch.randn(1, tokens, config["text_dim"], generator=g).to(device, dtype)
    negative = torch.randn(1, tokens, config["text_dim"], generator=g).to(device, dtype)

    def call() -> torch.Tensor:
        return pipe(prompt_embeds=prompt, negative_prompt_embeds=negative, height=height, width=width,
                    num_frames=frames, num_inference_steps=args.steps, guidance_scale=5.0, output_type="latent",
                    generator=torch.Generator(device=device).manual_seed(0)).frames

    return call


def check(name: str, pipe: WanPipeline, call, reference: torch.Tensor, args: argparse.Namespace,
          results: dict[str, Any]) -> None:
    """Install, check bitwise and receipts, uninstall, check bitwise again."""
    accel = worldfoundry.accelerate(pipe, SPECS[name])
    try:
        out = call()
        receipt = accel.last_call
        counters = {p: e["model"]["counters"] for p, e in receipt.plugins.items()}
        results[name] = {"bitwise": bool(torch.equal(out, reference)), "rel_l2": rel_l2(out, reference),
                         "counters": counters, "outcome": receipt.outcome}
        if "wan_cross_kv_fusion" in counters:
            layers = len(pipe.transformer.blocks)
            kv = counters["wan_cross_kv_fusion"]
            results[name]["static_kv_hits_ok"] = all(
                kv.get(f"kv_cache_hit.{b}") == (args.steps - 1) * layers for b in ("cond", "uncond"))
    finally:
        accel.uninstall()
    results[name]["bitwise_after_uninstall"] = bool(torch.equal(call(), reference))


def time_all(pipe: WanPipeline, call, device: torch.device, args: argparse.Namespace,
             results: dict[str, Any]) -> None:
    """Interleaved paired rounds: each accelerated variant installed for its own call, uninstalled after."""

    def variant(spec: dict[str, Any]):
        def run() -> None:
            accel = worldfoundry.accelerate(pipe, spec)
            try:
                sync(device)
                call()
                sync(device)
            finally:
                accel.uninstall()

        return run

    # install/uninstall is timed with each call: it is what a user pays per clip when switching sets; report
    # the install-free call time too by timing the installed set alone below
    calls = {"vanilla": call, **{name: variant(spec) for name, spec in SPECS.items()}}
    results["timing_with_install"] = interleaved(calls, device, rounds=args.rounds, warmup=1, iters=1,
                                                 baseline="vanilla")
    installed: dict[str, Any] = {}
    for name, spec in SPECS.items():
        accel = worldfoundry.accelerate(pipe, spec)
        try:
            installed[name] = interleaved({"vanilla_alongside": call, name: call}, device, rounds=args.rounds,
                                          warmup=1, iters=1, baseline="vanilla_alongside")[name]
        finally:
            accel.uninstall()
    results["timing_installed"] = installed


def part(label: str, fn, results: dict[str, Any]) -> None:
    try:
        fn()
    except Exception as exc:  # the other parts still run
        results.setdefault("errors", {})[label] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(SHAPES), default="W17")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    config = dict(WAN_TINY, num_layers=2) if args.smoke else WAN_1_3B
    if args.smoke:  # 16 text tokens: below the default min_tokens, so let the static K/V engage anyway
        args.steps, args.rounds = min(args.steps, 3), min(args.rounds, 3)
        for spec in SPECS.values():
            if "wan_cross_kv_fusion" in spec:
                spec["wan_cross_kv_fusion"] = {"min_tokens": 0}
    results: dict[str, Any] = {"provenance": provenance(device, extra_packages=("diffusers",),
                                                        workload="smoke" if args.smoke else args.workload,
                                                        steps=args.steps, cfg=True)}
    pipe = build_pipeline(config, device)
    call = make_call(pipe, args, device, config)
    reference = call()
    for name in SPECS:
        part(f"check {name}", lambda name=name: check(name, pipe, call, reference, args, results), results)
    part("timing", lambda: time_all(pipe, call, device, args, results), results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diffusers_pipeline.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"\nWanPipeline {results['provenance']['workload']}, {args.steps} steps CFG, {device} "
          f"(random weights: timing and exactness only)")
    print(f"{'variant':<16}{'bitwise':>9}{'after':>7}{'kv hits ok':>12}{'speedup (installed)':>22}")
    for name in SPECS:
        r = results.get(name, {})
        t = results.get("timing_installed", {}).get(name, {})
        print(f"{name:<16}{str(r.get('bitwise')):>9}{str(r.get('bitwise_after_uninstall')):>7}"
              f"{str(r.get('static_kv_hits_ok', '-')):>12}{t.get('paired_speedup_median', float('nan')):>22.3f}")
    if results.get("errors"):
        print("errors:", results["errors"])


if __name__ == "__main__":
    main()
