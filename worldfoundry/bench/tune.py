"""``worldfoundry tune``: search for the fastest acceleration configuration within a quality budget.

Coarse to fine, and cheap passes first:

1. **coarse** (quality only): every plugin's choices alone; EasyCache on a geometric threshold grid per warm-up.
2. **refine** (quality only): per EasyCache warm-up, bisect between the largest passing and the smallest failing
   threshold.
3. **stacks** (quality only): pairs of passing non-cache choices of different plugins, then every larger set
   whose pairs all passed; the best cache setting with each passing choice and each of those stacks.
4. **timing**: only the survivors (ranked by the receipts bound ``n / k`` and the stacks) are timed in
   interleaved pairs; the fastest one within budget is written as a candidate file (``tuned.json``) with a
   report (``tune_report.md``) and the full trace (``tune.json``).

Every pass is an ordinary ``worldfoundry bench`` run (its outputs under ``passes/<name>/``), so the numbers are
the harness's numbers. A search space names plugins and ranges (see :data:`DEFAULT_SPACE`); plugins that are
not installed (or need CUDA on a CPU run) are left out and listed in the trace.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from worldfoundry.bench.candidates import DEFAULT_BUDGET
from worldfoundry.bench.harness import DEFAULT_MODEL, BenchConfig, run_bench
from worldfoundry.core.acceleration.registry import AccelerationRegistry, diffusion_acceleration_registry

logger = logging.getLogger(__name__)

CACHE_PLUGIN = "easycache"
#: The default search space. ``easycache``: a threshold range ``[low, high]`` searched on a grid then bisected,
#: per warm-up; other plugins: a list of option sets (``choices``). ``cuda_only`` plugins are skipped on the CPU.
DEFAULT_SPACE: dict[str, Any] = {
    "easycache": {"threshold": [0.02, 0.4], "warmup_steps": [1, 2], "final_dense_steps": 1, "grid": 4},
    "selective_fp8": {"cuda_only": True, "choices": [
        {"include": ["blocks.*.ffn.net.0.proj", "blocks.*.ffn.net.2"], "min_tokens": 1024},
        {"include": ["blocks.*.ffn.net.0.proj", "blocks.*.ffn.net.2", "blocks.*.attn1.to_out.0"],
         "min_tokens": 1024}]},
    "attention_policy": {"cuda_only": True, "choices": [
        {"self": {"backend": "fa3", "min_tokens": 8192}},
        {"self": {"backend": "sage", "min_tokens": 8192}}]},
    "wan_cross_kv_fusion": {"choices": [{"min_tokens": 0}]},
    "optimized_mha": {"choices": [{"self": {"fusion": "qkv"}, "cross": {"fusion": "kv"}},
                                  {"self": {"fusion": "qkv"}}]},
    "wan_block_fusion": {"cuda_only": True, "choices": [
        {}, {"chains": ["modulate", "gated_residual", "cross_residual", "rope", "qk_norm", "float_carry"]}]},
    "cuda_graph": {"cuda_only": True, "choices": [{}]},
}
DEFAULT_WORKLOAD: dict[str, Any] = {"prompt": "a red square moving left", "negative_prompt": "", "frames": 9,
                                    "height": 32, "width": 32, "steps": 8, "guidance": 5.0, "shift": 3.0,
                                    "seeds": [42]}
DEFAULT_TUNE_BUDGET: dict[str, float] = {"latent_rel_l2": 0.03, "psnr_db": 33.0, "min_ssim": 0.98}
INVALID_PREFIXES = ("invalid", "rejected", "refused")
#: Longest generated candidate name (the candidate-file rule allows 128 characters).
MAX_NAME = 96
#: At most this many sets of three or more non-cache choices are checked in the ``stacks`` pass (largest first).
MAX_SETS = 16


class TuneSpaceError(ValueError):
    """The search space is malformed (names the key)."""


@dataclass
class TuneConfig:
    """What to tune and how.

    Args:
        model: recipe name (default the shipped trained tiny model).
        workload: the candidate-file workload (prompts, frames, steps, seeds ...).
        budget: quality budget (``latent_rel_l2``, ``psnr_db``, ``min_ssim``).
        space: plugin -> ranges (default :data:`DEFAULT_SPACE`).
        survivors: how many quality survivors are timed (stacks come on top).
        refine: bisection passes of the cache threshold.
    """

    model: str | None = None
    workload: dict[str, Any] | None = None
    budget: dict[str, float] | None = None
    space: dict[str, Any] | None = None
    out: str = "tune_out"
    device: str = "cpu"
    dtype: str = "float32"
    checkpoint_dir: str | None = None
    random_weights: bool = False
    rounds: int = 3
    survivors: int = 3
    refine: int = 2
    time_budget_s: float = 30.0
    target_halfwidth: float = 0.02
    max_noise_floor: float = 1.05
    estimator: str = "step_floor"
    progress: bool = True
    trace: list[dict[str, Any]] = field(default_factory=list)


def _check_space(space: Any) -> dict[str, Any]:
    if not isinstance(space, dict):
        raise TuneSpaceError("space: expected an object plugin -> ranges")
    for plugin, ranges in space.items():
        if not isinstance(ranges, dict):
            raise TuneSpaceError(f"space.{plugin}: expected an object")
        if plugin == CACHE_PLUGIN:
            thr = ranges.get("threshold")
            if not (isinstance(thr, list) and len(thr) == 2 and all(isinstance(t, int | float) for t in thr)
                    and 0 < thr[0] < thr[1]):
                raise TuneSpaceError(f"space.{plugin}.threshold: expected [low, high] with 0 < low < high")
            warm = ranges.get("warmup_steps", [2])
            if not (isinstance(warm, list) and warm and all(isinstance(w, int) and w >= 0 for w in warm)):
                raise TuneSpaceError(f"space.{plugin}.warmup_steps: expected a non-empty list of integers >= 0")
        else:
            choices = ranges.get("choices")
            if not (isinstance(choices, list) and choices and all(isinstance(c, dict) for c in choices)):
                raise TuneSpaceError(f"space.{plugin}.choices: expected a non-empty list of option objects")
    return space


def usable_space(space: dict[str, Any], registry: AccelerationRegistry, device: str) -> tuple[dict[str, Any],
                                                                                                 dict[str, str]]:
    """The part of ``space`` that can run here, and why each other plugin was left out."""
    known = set(registry.names())
    usable, left_out = {}, {}
    for plugin, ranges in space.items():
        if plugin not in known:
            left_out[plugin] = "not installed"
        elif ranges.get("cuda_only") and not device.startswith("cuda"):
            left_out[plugin] = "needs CUDA"
        else:
            usable[plugin] = ranges
    return usable, left_out


def threshold_grid(low: float, high: float, n: int) -> list[float]:
    """``n`` geometrically spaced thresholds from ``low`` to ``high`` (rounded to 4 significant digits)."""
    if n <= 1:
        return [float(high)]
    ratio = (high / low) ** (1.0 / (n - 1))
    return [float(f"{low * ratio**i:.4g}") for i in range(n)]


def _cache_opts(ranges: dict[str, Any], threshold: float, warmup: int) -> dict[str, Any]:
    return {"threshold": float(threshold), "warmup_steps": int(warmup),
            "final_dense_steps": int(ranges.get("final_dense_steps", 1))}


def _option_tokens(opts: dict[str, Any], prefix: str = "") -> list[str]:
    """``key=value`` tokens of (nested) options: ``self.fusion=qkv``, ``include=blocks.*.ffn.net.2,...``."""
    tokens: list[str] = []
    for key, value in opts.items():
        if isinstance(value, dict):
            tokens += _option_tokens(value, f"{prefix}{key}.")
        elif isinstance(value, (list, tuple)):
            tokens.append(f"{prefix}{key}=" + ",".join(str(v) for v in value))
        else:
            tokens.append(f"{prefix}{key}={value:g}" if isinstance(value, float) else f"{prefix}{key}={value}")
    return tokens


def _name(spec: dict[str, dict[str, Any]]) -> str:
    """A candidate name for ``spec`` that the candidate-file rules accept (``CANDIDATE_NAME``), unique per spec."""
    parts = []
    for plugin, opts in spec.items():
        if plugin == CACHE_PLUGIN:
            per = ",".join(f"{label}={o['threshold']:g}" for label, o in (opts.get("per_expert") or {}).items())
            parts.append(f"ec{opts['threshold']:g}w{opts['warmup_steps']}" + (f"@{per}" if per else ""))
        else:
            parts.append("-".join([plugin, *_option_tokens(opts)]))
    name = re.sub(r"[^A-Za-z0-9._+=@,:\-]", "_", "+".join(parts))
    if len(name) > MAX_NAME:  # shortened names stay distinct: a digest of the whole spec ends them
        digest = hashlib.sha1(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:10]
        name = f"{name[:MAX_NAME - 11]}-{digest}"
    return name


def _ok(record: dict[str, Any]) -> bool:
    return (not record["verdict"].startswith(INVALID_PREFIXES) and bool(record.get("executed"))
            and all((record.get("within_budget") or {"x": False}).values()))


def _skipped(record: dict[str, Any]) -> int:
    return int((record.get("skipped") or {}).get(CACHE_PLUGIN, {}).get("steps", 0))


class _Search:
    def __init__(self, config: TuneConfig, registry: AccelerationRegistry) -> None:
        self.config = config
        self.registry = registry
        self.out = Path(config.out)
        self.workload = dict(config.workload or DEFAULT_WORKLOAD)
        self.budget = {**DEFAULT_BUDGET, **(config.budget or DEFAULT_TUNE_BUDGET)}
        self.model = config.model or DEFAULT_MODEL
        self.passes: list[dict[str, Any]] = []
        self.bar: Any = None

    def bench(self, name: str, specs: list[dict[str, dict[str, Any]]], *, timed: bool) -> list[dict[str, Any]]:
        """One harness run over ``specs``; returns its candidate records (names deduplicated)."""
        unique: dict[str, dict[str, dict[str, Any]]] = {}
        for spec in specs:
            unique.setdefault(_name(spec), spec)
        if not unique:
            return []
        c = self.config
        pass_dir = self.out / "passes" / name
        pass_dir.mkdir(parents=True, exist_ok=True)
        cfile = {"model": self.model, "workload": self.workload, "quality_budget": self.budget,
                 "timing": {"rounds": max(3, c.rounds)},
                 "candidates": [{"name": n, "accelerations": s} for n, s in unique.items()]}
        path = pass_dir / "candidates.json"
        path.write_text(json.dumps(cfile, indent=2))
        results = run_bench(BenchConfig(
            model=self.model, candidates=str(path), out=str(pass_dir), checkpoint_dir=c.checkpoint_dir,
            device=c.device, dtype=c.dtype, rounds=max(3, c.rounds), quality_only=not timed,
            random_weights=c.random_weights, progress=False, target_halfwidth=c.target_halfwidth,
            time_budget_s=c.time_budget_s, max_noise_floor=c.max_noise_floor, estimator=c.estimator),
            registry=self.registry)
        self.passes.append({"pass": name, "timed": timed, "noise_floor": results.get("noise_floor"),
                            "noisy_host": results.get("noisy_host"),
                            "rows": [_summary(r) for r in results["candidates"]]})
        if self.bar is not None:
            self.bar.update(1)
        return results["candidates"]


def _summary(record: dict[str, Any]) -> dict[str, Any]:
    speed = record.get("speed") or {}
    return {"name": record["name"], "accelerations": record["accelerations"], "verdict": record["verdict"],
            "within_budget": record.get("within_budget"), "worst": (record.get("quality") or {}).get("worst"),
            "skipped": record.get("skipped"), "speedup": speed.get("speedup"),
            "ci95": speed.get("ci95"), "error": record.get("error")}


def _coarse(search: _Search, space: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Pass 1: returns (cache records, other records)."""
    specs: list[dict[str, dict[str, Any]]] = []
    cache = space.get(CACHE_PLUGIN)
    if cache:
        low, high = cache["threshold"]
        for warmup in cache.get("warmup_steps", [2]):
            for thr in threshold_grid(low, high, int(cache.get("grid", 4))):
                specs.append({CACHE_PLUGIN: _cache_opts(cache, thr, warmup)})
    for plugin, ranges in space.items():
        if plugin != CACHE_PLUGIN:
            specs += [{plugin: dict(choice)} for choice in ranges["choices"]]
    records = search.bench("coarse", specs, timed=False)
    return ([r for r in records if CACHE_PLUGIN in r["accelerations"]],
            [r for r in records if CACHE_PLUGIN not in r["accelerations"]])


def _refine(search: _Search, cache: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pass 2: bisect the threshold per warm-up between the largest pass and the smallest fail."""
    all_records = list(records)
    for i in range(search.config.refine):
        specs = []
        for warmup in cache.get("warmup_steps", [2]):
            mine = [r for r in all_records if r["accelerations"][CACHE_PLUGIN]["warmup_steps"] == warmup]
            passing = [r["accelerations"][CACHE_PLUGIN]["threshold"] for r in mine if _ok(r)]
            failing = [r["accelerations"][CACHE_PLUGIN]["threshold"] for r in mine if not _ok(r)]
            lo = max(passing, default=cache["threshold"][0] / 2)
            hi = min([f for f in failing if f > lo], default=None)
            if hi is None or hi / lo < 1.05:
                continue  # everything passed up to the range's top, or the bracket is already tight
            specs.append({CACHE_PLUGIN: _cache_opts(cache, float(f"{math.sqrt(lo * hi):.4g}"), warmup)})
        if not specs:
            break
        all_records += search.bench(f"refine-{i + 1}", specs, timed=False)
    return all_records


def _survivors(search: _Search, caches: list[dict[str, Any]], others: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pass 3 and the timed candidates: the best caches by skipped calls, passing others, and their stacks."""
    n = max(1, search.config.survivors)
    good_caches = sorted((r for r in caches if _ok(r)), key=lambda r: (-_skipped(r),
                         r["accelerations"][CACHE_PLUGIN]["threshold"]))
    good_caches = [r for r in good_caches if _skipped(r) > 0][:n]
    good_others = [dict(r["accelerations"]) for r in others if _ok(r)]
    sets = _exact_sets(search, good_others)
    specs = [dict(r["accelerations"]) for r in good_caches] + good_others + sets
    if good_caches and good_others:
        best = good_caches[0]["accelerations"]
        stacks = [{**best, **o} for o in good_others + sets]
        checked = search.bench("stacks", stacks, timed=False)
        specs += [dict(r["accelerations"]) for r in checked if _ok(r)]
    return specs


def _exact_sets(search: _Search, singles: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stacks of passing non-cache choices (one choice per plugin) that pass together, for the timing pass.

    Pairs are checked first (a pair that conflicts or leaves the budget is out); then every larger set whose pairs
    all passed (at most :data:`MAX_SETS`, largest first). Returns every passing pair and larger set: stacking is
    not monotone in speed (a plugin that pays off alone can cost time beside another), so the timing decides.
    """
    pairs = [{**a, **b} for i, a in enumerate(singles) for b in singles[i + 1:] if not set(a) & set(b)]
    if not pairs:
        return []
    passed = [dict(r["accelerations"]) for r in search.bench("pairs", pairs, timed=False) if _ok(r)]
    keys = {_key(p) for p in passed}
    candidates = []
    for size in range(len(singles), 2, -1):
        for combo in itertools.combinations(singles, size):
            spec = _merge(combo)
            if spec is not None and all(_key({**a, **b}) in keys for a, b in itertools.combinations(combo, 2)):
                candidates.append(spec)
    larger = [dict(r["accelerations"]) for r in search.bench("sets", candidates[:MAX_SETS], timed=False) if _ok(r)]
    return passed + larger


def _merge(specs: tuple[dict[str, Any], ...]) -> dict[str, Any] | None:
    """One spec from single-plugin specs, or ``None`` when two name the same plugin."""
    merged: dict[str, Any] = {}
    for spec in specs:
        if set(spec) & set(merged):
            return None
        merged.update(spec)
    return merged


def _key(spec: dict[str, Any]) -> str:
    return json.dumps(spec, sort_keys=True)


def _pick(records: list[dict[str, Any]], noisy: bool) -> dict[str, Any] | None:
    """The fastest timed record within budget (invalid timing or verdicts excluded). On a noisy host the
    measured medians do not decide: the most skipped model calls do, then the median."""
    valid = [r for r in records if _ok(r) and r.get("speed") and r["verdict"] != "invalid_timing"]
    if noisy:
        return max(valid, key=lambda r: (_skipped(r), r["speed"]["speedup"]), default=None)
    return max(valid, key=lambda r: r["speed"]["speedup"], default=None)


def run_tune(config: TuneConfig, *, registry: AccelerationRegistry | None = None) -> dict[str, Any]:
    """Run the search; writes ``tuned.json``, ``tune_report.md`` and ``tune.json`` under ``config.out``.

    Returns:
        The trace: passes, the chosen candidate (or ``None``) and what was left out.

    Raises:
        TuneSpaceError: the search space is malformed (nothing was run).
    """
    registry = registry if registry is not None else diffusion_acceleration_registry()
    space, left_out = usable_space(_check_space(config.space or DEFAULT_SPACE), registry, config.device)
    search = _Search(config, registry)
    search.out.mkdir(parents=True, exist_ok=True)
    from worldfoundry.bench.tune_experts import per_expert_pass, recipe_experts

    routed = CACHE_PLUGIN in space and len(recipe_experts(config.model or DEFAULT_MODEL)) > 1
    total = 1 + (config.refine if CACHE_PLUGIN in space else 0) + 4 + (2 if routed else 0)
    search.bar = tqdm(total=total, desc="tune", disable=not config.progress)
    try:
        caches, others = _coarse(search, space) if space else ([], [])
        if CACHE_PLUGIN in space:
            caches = _refine(search, space[CACHE_PLUGIN], caches)
            caches += per_expert_pass(search, space[CACHE_PLUGIN], recipe_experts(search.model))
        specs = _survivors(search, caches, others)
        timed = search.bench("timing", specs, timed=True) if specs else []
    finally:
        search.bar.total = search.bar.n  # passes with nothing to check were not run
        search.bar.close()
    noisy = bool(search.passes and search.passes[-1]["timed"] and search.passes[-1].get("noisy_host"))
    best = _pick(timed, noisy)
    trace = {"schema": "worldfoundry-tune-v1", "model": search.model, "workload": search.workload,
             "budget": search.budget, "space": space, "left_out": left_out, "passes": search.passes,
             "chosen": _summary(best) if best else None, "chosen_by": "skipped model calls (noisy host)" if noisy
             else "median speedup", "config": {k: v for k, v in asdict(config).items()
                                                                      if k != "trace"}}
    (search.out / "tune.json").write_text(json.dumps(trace, indent=2, default=str))
    _write_candidate(search, best)
    (search.out / "tune_report.md").write_text(render_tune_report(trace))
    return trace


def _write_candidate(search: _Search, best: dict[str, Any] | None) -> Path | None:
    if best is None:
        return None
    path = search.out / "tuned.json"
    speed = best["speed"]
    path.write_text(json.dumps({
        "model": search.model,
        "description": f"found by worldfoundry tune: {speed['speedup']:.3g}x "
                       f"[{speed['ci95'][0]:.3g}, {speed['ci95'][1]:.3g}] within the budget",
        "workload": search.workload, "quality_budget": search.budget, "timing": {"rounds": 3},
        "candidates": [{"name": "tuned", "accelerations": best["accelerations"]}]}, indent=2))
    return path


def render_tune_report(trace: dict[str, Any]) -> str:
    """Markdown: the chosen configuration, then every pass's rows."""
    lines = [f"# Tune: {trace['model']}", "", f"- budget: {json.dumps(trace['budget'])}",
             f"- workload: {json.dumps(trace['workload'])}"]
    if trace["left_out"]:
        lines.append(f"- left out of the search: {json.dumps(trace['left_out'])}")
    chosen = trace["chosen"]
    if chosen:
        lines += ["", f"**Chosen**: `{json.dumps(chosen['accelerations'])}` — "
                  f"{chosen['speedup']:.4g}× (95% CI {chosen['ci95']}), verdict {chosen['verdict']}; "
                  f"chosen by {trace['chosen_by']}; written to `tuned.json`."]
    else:
        lines += ["", "**No configuration** within the budget was faster than dense (nothing written)."]
    for p in trace["passes"]:
        lines += ["", f"## {p['pass']} ({'timed' if p['timed'] else 'quality only'})", ""]
        if p.get("noisy_host"):
            lines += [f"> {p['noisy_host']}", ""]
        lines += ["| candidate | verdict | rel L2 | PSNR | min SSIM | skipped calls | speedup |", "|---|---|---|---|---|---|---|"]
        for r in p["rows"]:
            w = r.get("worst") or {}
            lines.append(f"| {r['name']} | {r['verdict']} | {_g(w.get('latent_rel_l2'))} | {_g(w.get('psnr_db'))} | "
                         f"{_g(w.get('min_ssim'))} | {(r.get('skipped') or {}).get(CACHE_PLUGIN, {}).get('steps', '–')} | "
                         f"{_g(r.get('speedup'))} |")
    return "\n".join(lines) + "\n"


def _g(value: Any) -> str:
    return "–" if value is None else (f"{value:.4g}" if isinstance(value, float) else str(value))
