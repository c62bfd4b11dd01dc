"""GPU evidence for ``easycache``: cost of a skipped step, and loop speedup against the fraction skipped.

One run does everything, on the Wan2.1-T2V-1.3B architecture with random seeded weights (bf16, fp32 modules
kept as diffusers keeps them) at W81 (latent 21x60x104, 32,760 tokens) and a flow-matching Euler loop:

1. Per-call cost (single calls, synchronised, medians): a dense forward; an EasyCache skipped step (context
   checks, error estimate with its one host transfer, ``x + Δ``); a diffusers ``FirstBlockCacheConfig`` cached
   step (first block + residual test + add); a cache-dit DBCache cached step (``Fn_compute_blocks=1``) when
   ``cache_dit`` imports. Each is reported as % of the dense forward (anchor: FirstBlockCache 3.7%).
2. Whole loops of ``--steps`` steps, interleaved paired rounds with a rotating order: dense; EasyCache at each
   ``--thresholds`` value (installed through the plugin, driven with request contexts like the native runner);
   FirstBlockCache and DBCache forced to the *same* compute/skip pattern as EasyCache at ``--match-threshold``
   (FirstBlockCache's threshold is set per step to 0 or infinity, DBCache gets the pattern as its static
   ``steps_computation_mask``). Reported: skipped fraction f, paired speedup vs dense, the ideal 1/(1-f) and
   the ratio measured/ideal (goal: within 3%).

Random weights make the skip pattern itself meaningless for quality: the thresholds here only produce some
fraction of skipped steps to time. The relative L2 against the dense loop describes these weights only. The
published quality anchor is EasyCache's Wan2.1-1.3B result (2.54x at PSNR 25.24, SSIM 0.834, LPIPS 0.095).

Usage::

    python benchmarks/kernels/easycache.py --out "$OUT"             # H200, W81, 50 steps, no CFG (under 5 min)
    python benchmarks/kernels/easycache.py --smoke --out /tmp/ec    # CPU, tiny shapes (seconds)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from diffusers import FirstBlockCacheConfig, FlowMatchEulerDiscreteScheduler

from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.guard import attach_request_guard
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.bench.microbench import WAN_1_3B, bf16_wan, sync
from worldfoundry.bench.microbench import provenance as shared_provenance
from worldfoundry.bench.microbench import WAN_TINY as WAN_TINY_BASE
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry_easycache.plugin import prepare

ROOT = Path(__file__).resolve().parents[2]
WAN_TINY = dict(WAN_TINY_BASE, num_layers=3)
RANDOM_NOTE = ("random seeded weights: the skip pattern and the relative L2 say nothing about visual quality; "
               "published anchor: EasyCache Wan2.1-1.3B 2.54x at PSNR 25.24 / SSIM 0.834 / LPIPS 0.095")
FBC_HEAD_HOOK = "fbc_leader_block_hook"


build_wan = bf16_wan


class Workload:
    """Latents, text embeddings and the flow-matching schedule shared by every method."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        frames, height, width = (3, 8, 8) if args.smoke else (21, 60, 104)
        text_len, text_dim = (8, 32) if args.smoke else (512, 4096)
        gen = torch.Generator().manual_seed(42)
        self.latents = torch.randn(1, 16, frames, height, width, generator=gen).to(device)
        self.text = {b: torch.randn(1, text_len, text_dim, generator=gen).to(device, torch.bfloat16)
                     for b in ("cond", "uncond")}
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0)
        scheduler.set_timesteps(args.steps)
        self.timesteps = [float(t) for t in scheduler.timesteps]
        self.sigmas = [float(s) for s in scheduler.sigmas]
        self.branches = ("cond", "uncond") if args.cfg else ("cond",)
        self.shape = [frames, height, width]


Call = Callable[[int, str, torch.Tensor], torch.Tensor]


def euler_loop(work: Workload, call: Call, guidance: float = 5.0) -> torch.Tensor:
    """The denoising loop: one model call per step and branch, CFG in float32, Euler update."""
    x = work.latents.clone()
    for i, _ in enumerate(work.timesteps):
        outs = {b: call(i, b, x).float() for b in work.branches}
        v = outs["uncond"] + guidance * (outs["cond"] - outs["uncond"]) if "uncond" in outs else outs["cond"]
        x = x + (work.sigmas[i + 1] - work.sigmas[i]) * v
    return x


def forward(model: Any, work: Workload, i: int, branch: str, x: torch.Tensor) -> torch.Tensor:
    t = work.timesteps[i]
    with torch.no_grad():
        return model(hidden_states=x.to(torch.bfloat16), timestep=torch.tensor([t], device=x.device),
                     encoder_hidden_states=work.text[branch], return_dict=False)[0]


# ---------------------------------------------------------------------------------------------- methods
class EasyCacheRun:
    """EasyCache installed through the plugin, driven like the native runner (request id, contexts)."""

    def __init__(self, model: Any, work: Workload, threshold: float, warmup: int) -> None:
        self.model, self.work = model, work
        reg = AccelerationRegistry(discover=False)
        reg.register("easycache", prepare)
        self.session = install_diffusion_accelerations(
            model, {"easycache": {"threshold": threshold, "warmup_steps": warmup, "final_dense_steps": 1}}, registry=reg
        )
        self.guard = attach_request_guard(model)
        self.count = 0

    def loop(self) -> tuple[torch.Tensor, str]:
        self.count += 1
        rid = f"ec-{self.count}"
        steps = len(self.work.timesteps)

        def call(i: int, branch: str, x: torch.Tensor) -> torch.Tensor:
            with request_scope(RequestContext(rid, branch, i, self.work.timesteps[i], "model", steps)):
                return forward(self.model, self.work, i, branch, x)

        self.guard.begin_request(rid)
        try:
            out = euler_loop(self.work, call)
        finally:
            self.guard.end_request(rid)
        record = self.session.execution_report()["plugins"]["easycache"]["model"]["requests"][rid]
        return out, record["notes"]["easycache"]["branches"]["cond"]["pattern"]

    def close(self) -> None:
        self.session.uninstall()


def fbc_loop(model: Any, work: Workload, pattern: str) -> torch.Tensor:
    """diffusers FirstBlockCache, its decision forced to ``pattern`` ("C" compute, "S" reuse)."""
    hook = model.blocks[0]._diffusers_hook.get_hook(FBC_HEAD_HOOK)
    model._reset_stateful_cache()

    def call(i: int, branch: str, x: torch.Tensor) -> torch.Tensor:
        hook.threshold = -1.0 if pattern[i] == "C" else float("inf")
        with model.cache_context(branch):
            return forward(model, work, i, branch, x)

    return euler_loop(work, call)


def dbcache_config(pattern: str, warmup: int, cfg: bool) -> Any:
    import cache_dit

    return cache_dit.DBCacheConfig(
        Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=1e9, max_warmup_steps=warmup,
        num_inference_steps=len(pattern), enable_separate_cfg=cfg,
        steps_computation_mask=[1 if c == "C" else 0 for c in pattern], steps_computation_policy="static",
    )


def dbcache_loop(model: Any, work: Workload, pattern: str, warmup: int, cfg: bool) -> torch.Tensor:
    """cache-dit DBCache with the compute/skip pattern as its static steps_computation_mask."""
    import cache_dit

    cache_dit.refresh_context(model, cache_config=dbcache_config(pattern, warmup, cfg))
    return euler_loop(work, lambda i, b, x: forward(model, work, i, b, x))


# ---------------------------------------------------------------------------------------------- measurements
def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3, out


def call_costs(models: dict[str, Any], work: Workload, args: argparse.Namespace,
               device: torch.device) -> dict[str, Any]:
    """Median wall time of single synchronised calls: dense, EasyCache skipped, FBC cached, DBCache cached."""
    n = args.calls
    x = work.latents
    dense = [timed(lambda: forward(models["dense"], work, 1, "cond", x), device)[0] for _ in range(max(3, n // 6))]
    out: dict[str, Any] = {"dense_ms": statistics.median(dense)}

    # EasyCache: two computed steps give the rate, then every call is a skipped step
    steps = 2 + n
    run = EasyCacheRun(models["dense"], work, 1e30, 2)
    run.guard.begin_request("cost")
    skipped = []
    try:
        xi = x
        for i in range(steps):
            ctx = RequestContext("cost", "cond", i, work.timesteps[i % len(work.timesteps)], "model", steps)
            ms, v = timed(partial(_ctx_call, ctx, models["dense"], work, min(i, len(work.timesteps) - 1), xi), device)
            if i >= 2:
                skipped.append(ms)
            xi = xi - 0.01 * v.float()
    finally:
        run.guard.end_request("cost")
        run.close()
    out["easycache_skip_ms"] = statistics.median(skipped)

    for peer, measure in (("fbc", _fbc_cached_ms), ("dbcache", _dbcache_cached_ms)):
        if peer in models:
            try:
                out[f"{peer}_cached_ms"] = measure(models[peer], work, n, device)
            except Exception as exc:  # an optional peer that fails is dropped and reported, the run goes on
                models.pop(peer)
                out[f"{peer}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    for key in ("easycache_skip_ms", "fbc_cached_ms", "dbcache_cached_ms"):
        if key in out:
            out[key.replace("_ms", "_pct_of_dense")] = 100.0 * out[key] / out["dense_ms"]
    return out


def _fbc_cached_ms(fbc: Any, work: Workload, n: int, device: torch.device) -> float:
    hook = fbc.blocks[0]._diffusers_hook.get_hook(FBC_HEAD_HOOK)
    fbc._reset_stateful_cache()
    cached = []
    for c in "C" + "S" * n:
        hook.threshold = -1.0 if c == "C" else float("inf")
        with fbc.cache_context("cond"):
            ms, _ = timed(partial(forward, fbc, work, 1, "cond", work.latents), device)
        if c == "S":
            cached.append(ms)
    return statistics.median(cached)


def _dbcache_cached_ms(dbc: Any, work: Workload, n: int, device: torch.device) -> float:
    import cache_dit

    cache_dit.refresh_context(dbc, cache_config=dbcache_config("C" + "S" * n, 1, False))
    cached = [timed(partial(forward, dbc, work, 1, "cond", work.latents), device)[0] for _ in range(n + 1)][1:]
    return statistics.median(cached)


def _ctx_call(ctx: RequestContext, model: Any, work: Workload, i: int, x: torch.Tensor) -> torch.Tensor:
    with request_scope(ctx):
        return forward(model, work, i, "cond", x)


def loops(models: dict[str, Any], work: Workload, args: argparse.Namespace, device: torch.device,
          skip_cost: float) -> dict[str, Any]:
    """Interleaved paired loop rounds; ``skip_cost`` (a skipped call / a dense call) gives the cost model."""
    thresholds = [float(t) for t in args.thresholds.split(",")]
    match = args.match_threshold if args.match_threshold is not None else max(thresholds)
    runs = {f"easycache@{t:g}": t for t in thresholds}
    # warm-up (untimed): JIT/autotune, and the EasyCache pattern the peers are forced to
    warm = EasyCacheRun(models["dense"], work, match, args.warmup_steps)
    _, pattern = warm.loop()
    warm.close()
    dense_model = models["dense"]
    # name -> (setup, timed loop, teardown); install/uninstall stay outside the timed section
    candidates: dict[str, tuple[Callable[[], Any], Callable[[Any], tuple[torch.Tensor, str]], Callable[[Any], None]]]
    candidates = {
        "dense": (lambda: None,
                  lambda _: (euler_loop(work, lambda i, b, x: forward(dense_model, work, i, b, x)), "C" * len(pattern)),
                  lambda _: None),
    }
    for name, threshold in runs.items():
        candidates[name] = (lambda t=threshold: EasyCacheRun(dense_model, work, t, args.warmup_steps),
                            lambda run: run.loop(), lambda run: run.close())
    if "fbc" in models:
        candidates["fbc_forced"] = (lambda: None, lambda _: (fbc_loop(models["fbc"], work, pattern), pattern),
                                    lambda _: None)
    if "dbcache" in models:
        candidates["dbcache_forced"] = (
            lambda: None,
            lambda _: (dbcache_loop(models["dbcache"], work, pattern, args.warmup_steps, args.cfg), pattern),
            lambda _: None,
        )
    names = list(candidates)
    samples: dict[str, list[float]] = {n: [] for n in names}
    patterns: dict[str, str] = {}
    finals: dict[str, torch.Tensor] = {}
    failed: dict[str, str] = {}
    started = time.perf_counter()
    round_s = 0.0
    for r in range(args.rounds):
        if r >= 1 and time.perf_counter() - started + round_s > args.budget_s:
            break
        t_round = time.perf_counter()
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            if name in failed:
                continue
            setup, run, teardown = candidates[name]
            state = setup()
            try:
                ms, (final, pat) = timed(partial(run, state), device)
            except Exception as exc:
                if not name.endswith("_forced"):
                    raise
                failed[name] = f"{type(exc).__name__}: {exc}"[:300]  # an optional peer: drop it, go on
                continue
            finally:
                teardown(state)
            samples[name].append(ms)
            patterns[name] = pat
            finals.setdefault(name, final.detach().float().cpu())
        round_s = time.perf_counter() - t_round
    dense = finals["dense"].double()
    out: dict[str, Any] = {"rounds_done": len(samples["dense"]), "match_pattern": pattern, "methods": {},
                           "failed": failed}
    for name in names:
        if name in failed:
            continue
        f = patterns[name].count("S") / len(patterns[name])
        ratios = [b / c for b, c in zip(samples["dense"], samples[name], strict=True)]
        ideal = 1.0 / (1.0 - f) if f < 1 else float("inf")
        paired = statistics.median(ratios)
        out["methods"][name] = {
            "median_ms": statistics.median(samples[name]), "rounds_ms": samples[name], "skipped_fraction": f,
            "pattern": patterns[name], "paired_speedup": paired, "ideal_speedup": ideal,
            "measured_over_ideal": paired / ideal, "within_3pct_of_ideal": abs(paired / ideal - 1.0) <= 0.03,
            "predicted_with_skip_cost": 1.0 / ((1.0 - f) + f * skip_cost),
            "rel_l2_vs_dense": float((finals[name].double() - dense).norm() / dense.norm()),
        }
    return out


# ---------------------------------------------------------------------------------------------- report
def provenance(args: argparse.Namespace, device: torch.device, work: Workload) -> dict[str, Any]:
    return shared_provenance(device, extra_packages=("cache-dit",), dtype="bfloat16", latent=work.shape,
                             workload="smoke" if args.smoke else "W81", config=vars(args), note=RANDOM_NOTE)


def print_tables(data: dict[str, Any]) -> None:
    c = data["call_costs"]
    print(f"\nEasyCache evidence ({data['provenance']['workload']}, {data['provenance']['gpu'] or 'cpu'}); "
          f"{RANDOM_NOTE}")
    print(f"\nper call             ms        % of dense   (dense {c['dense_ms']:.2f} ms; "
          "goal <= 0.5%, FBC anchor 3.7%)")
    for key, label in (("easycache_skip", "easycache skipped"), ("fbc_cached", "FBC cached"),
                       ("dbcache_cached", "DBCache cached")):
        if f"{key}_ms" in c:
            print(f"{label:<20} {c[f'{key}_ms']:9.3f}  {c[f'{key}_pct_of_dense']:9.3f}%")
    lp = data["loops"]
    print(f"\nloop ({data['provenance']['config']['steps']} steps, {lp['rounds_done']} paired rounds)   "
          "f skipped   speedup   ideal 1/(1-f)   measured/ideal   relL2")
    print("(fbc_forced / dbcache_forced run EasyCache's pattern at --match-threshold: same skipped fraction)")
    for name, m in lp["methods"].items():
        print(f"{name:<24} {m['skipped_fraction']:8.3f}  {m['paired_speedup']:8.3f}  {m['ideal_speedup']:12.3f}  "
              f"{m['measured_over_ideal']:14.3f}  {m['rel_l2_vs_dense']:7.4f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for easycache.json (default $OUT)")
    p.add_argument("--smoke", action="store_true", help="tiny model and latent on the CPU")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (50; smoke 12)")
    p.add_argument("--cfg", action="store_true", help="two calls per step (cond, uncond); doubles the loop time")
    p.add_argument("--rounds", type=int, default=3, help="paired rounds (stops early past --budget-s)")
    p.add_argument("--budget-s", type=float, default=250.0,
                   help="a new loop round starts only if it should end within this many seconds of the first")
    p.add_argument("--thresholds", default="0.1,1e9", help="EasyCache thresholds (1e9: reuse whenever allowed)")
    p.add_argument("--match-threshold", type=float, default=None, help="pattern the peers are forced to (max)")
    p.add_argument("--warmup-steps", type=int, default=None, help="EasyCache warm-up steps (10; smoke 2)")
    p.add_argument("--calls", type=int, default=30, help="calls per per-call cost sample set")
    p.add_argument("--no-peers", action="store_true", help="skip FirstBlockCache and cache-dit")
    args = p.parse_args()
    args.steps = args.steps or (12 if args.smoke else 50)
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (2 if args.smoke else 10)
    if args.smoke:
        args.calls = min(args.calls, 6)
        args.rounds = min(args.rounds, 2)
        torch.set_num_threads(1)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    work = Workload(args, device)
    models: dict[str, Any] = {"dense": build_wan(WAN_TINY if args.smoke else WAN_1_3B, device)}
    peers: dict[str, str] = {}
    if not args.no_peers:
        models["fbc"] = copy.deepcopy(models["dense"])
        models["fbc"].enable_cache(FirstBlockCacheConfig(threshold=0.0))
        try:
            import cache_dit

            models["dbcache"] = copy.deepcopy(models["dense"])
            cache_dit.enable_cache(models["dbcache"], cache_config=dbcache_config("C" * args.steps, 1, args.cfg))
            peers["cache_dit"] = cache_dit.__version__
        except Exception as exc:  # optional peer: record why it is missing and go on
            models.pop("dbcache", None)
            peers["cache_dit"] = f"skipped: {type(exc).__name__}: {exc}"[:300]
    data: dict[str, Any] = {"provenance": provenance(args, device, work), "peers": peers}
    t0 = time.perf_counter()
    data["call_costs"] = call_costs(models, work, args, device)
    costs = data["call_costs"]
    data["loops"] = loops(models, work, args, device, costs["easycache_skip_ms"] / costs["dense_ms"])
    data["goals"] = {
        "skip_cost_le_0.5pct": costs["easycache_skip_pct_of_dense"] <= 0.5,
        "easycache_within_3pct_of_ideal": {n: m["within_3pct_of_ideal"] for n, m in data["loops"]["methods"].items()
                                           if n.startswith("easycache")},
    }
    data["elapsed_s"] = time.perf_counter() - t0
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "easycache.json").write_text(json.dumps(data, indent=1))
    print_tables(data)


if __name__ == "__main__":
    main()
