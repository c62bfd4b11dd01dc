#!/usr/bin/env python3
"""``worldfoundry tune`` against the hand-written default candidates, on the shipped trained model (CPU or CUDA).

1. ``run_tune`` on ``tiny-wan2.1-trained`` with the given quality budget (the default candidate file's workload).
2. One ``run_bench`` of the hand-written ``recipes/candidates/default.json`` candidates **and** the tuned one,
   under that same budget, timed the same way in one process (dense-vs-dense noise floor included).
3. The goal checks: the tuned configuration re-benches within the budget, and its speedup is above that of every
   hand-written candidate that is within the budget and was timed (not claimed on a noisy host); ``beyond_ci``
   says whether its CI's lower bound is above each of those speedups too.

    python benchmarks/bench/tune_vs_defaults.py                                   # the default budget
    python benchmarks/bench/tune_vs_defaults.py --max-rel-l2 0.12 --min-psnr 27 --min-ssim 0.89
    python benchmarks/bench/tune_vs_defaults.py --device cuda                     # the same model on a GPU
    python benchmarks/bench/tune_vs_defaults.py --device cuda --also recipes/candidates/wan2.1-1.3b-h200.json

Writes ``$OUT/tune_vs_defaults.json`` (default ``./bench_out``), with the tune and bench outputs under
``$OUT/tune`` and ``$OUT/rebench``, and prints a table and the checks last.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from worldfoundry.bench.harness import BenchConfig, run_bench
from worldfoundry.bench.tune import TuneConfig, run_tune
from worldfoundry.core.model_loading.recipes import project_root

DEFAULTS = project_root() / "recipes" / "candidates" / "default.json"


def rebench_file(tuned: dict[str, Any] | None, budget: dict[str, float], out: Path,
                 also: list[Path] | None = None) -> Path:
    """The default candidates (and those of the ``also`` files, under their own names) plus ``tuned`` (when tune
    chose one), with ``budget`` and the default file's workload, as one candidate file."""
    data = json.loads(DEFAULTS.read_text())
    data["quality_budget"] = budget
    names = {c["name"] for c in data["candidates"]}
    for path in also or []:
        for cand in json.loads(path.read_text())["candidates"]:
            if cand["name"] not in names and cand["name"] != "tuned":
                names.add(cand["name"])
                data["candidates"].append({"name": cand["name"], "accelerations": cand["accelerations"],
                                           "notes": f"hand-written, from {path.name}"})
    if tuned is not None:
        data["candidates"].append({"name": "tuned", "accelerations": tuned["candidates"][0]["accelerations"],
                                   "notes": tuned.get("description", "")})
    path = out / "rebench_candidates.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def checks(results: dict[str, Any]) -> dict[str, Any]:
    """Within budget on re-bench, and faster (speedup estimate; CI lower bound for ``beyond_ci``) than every timed
    hand-written candidate within budget."""
    rows = {c["name"]: c for c in results["candidates"]}
    tuned = rows.get("tuned")
    if tuned is None:
        return {"tuned": None, "within_budget": False, "faster_than_defaults": False, "beaten": []}
    within = bool(tuned.get("within_budget")) and all(tuned["within_budget"].values())
    mine = (tuned.get("speed") or {}).get("speedup")
    others = {name: (c.get("speed") or {}).get("speedup") for name, c in rows.items()
              if name != "tuned" and c.get("within_budget") and all(c["within_budget"].values()) and c.get("speed")}
    beaten = sorted(name for name, theirs in others.items() if mine is not None and mine > theirs)
    low = ((tuned.get("speed") or {}).get("ci95") or [None])[0]
    beyond = low is not None and low == low and all(low > theirs for theirs in others.values())
    return {"tuned": tuned["accelerations"], "within_budget": within, "tuned_speedup": mine, "defaults": others,
            "beyond_ci": bool(beyond and not results.get("noisy_host")),
            # on a noisy host (noise floor above the limit) estimates decide nothing
            "faster_than_defaults": (mine is not None and len(beaten) == len(others)
                                     and not results.get("noisy_host")), "beaten": beaten,
            "noisy_host": results.get("noisy_host"), "noise_floor": results.get("noise_floor")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-rel-l2", type=float, default=0.03)
    p.add_argument("--min-psnr", type=float, default=33.0)
    p.add_argument("--min-ssim", type=float, default=0.98)
    p.add_argument("--time-budget", type=float, default=20.0, help="seconds of timing per candidate")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--also", action="append", type=Path, default=[], metavar="FILE",
                   help="another hand-written candidate file whose candidates join the defaults (e.g. "
                        "recipes/candidates/wan2.1-1.3b-h200.json: the GPU exact stacks)")
    args = p.parse_args()
    out = Path(os.environ.get("OUT", "bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    budget = {"latent_rel_l2": args.max_rel_l2, "psnr_db": args.min_psnr, "min_ssim": args.min_ssim}
    workload = json.loads(DEFAULTS.read_text())["workload"]
    t0 = time.perf_counter()
    trace = run_tune(TuneConfig(workload=workload, budget=budget, out=str(out / "tune"), progress=False,
                                time_budget_s=args.time_budget, device=args.device, dtype=args.dtype))
    tune_s = time.perf_counter() - t0
    tuned_path = out / "tune" / "tuned.json"
    tuned = json.loads(tuned_path.read_text()) if trace.get("chosen") and tuned_path.exists() else None
    t1 = time.perf_counter()
    results = run_bench(BenchConfig(candidates=str(rebench_file(tuned, budget, out, args.also)), out=str(out / "rebench"),
                                    rounds=3, time_budget_s=args.time_budget, progress=False,
                                    device=args.device, dtype=args.dtype))
    summary = {"budget": budget, "also": [str(a) for a in args.also], "device": args.device, "dtype": args.dtype, "tune_s": tune_s, "rebench_s": time.perf_counter() - t1, **checks(results)}
    (out / "tune_vs_defaults.json").write_text(json.dumps(summary, indent=2, default=str))
    print("| candidate | verdict | within budget | speedup | 95% CI |\n|---|---|---|---|---|")
    for c in results["candidates"]:
        sp = c.get("speed") or {}
        ok = bool(c.get("within_budget")) and all(c["within_budget"].values())
        ci = f"[{sp['ci95'][0]:.3f}, {sp['ci95'][1]:.3f}]" if sp else "-"
        med = f"{sp['speedup']:.3f}" if sp else "-"
        print(f"| {c['name']} | {c['verdict']} | {ok} | {med} | {ci} |")
    print(f"\nbudget {budget}; tune {tune_s:.0f} s, re-bench {summary['rebench_s']:.0f} s; "
          f"noise floor {summary['noise_floor']}")
    print(f"tuned: {json.dumps(summary['tuned'])}")
    print(f"re-benches within budget: {summary['within_budget']}; faster than every hand-written candidate "
          f"within budget: {summary['faster_than_defaults']} (beats {summary['beaten']} of {sorted(summary['defaults'])}); "
          f"its CI's lower bound above all of them: {summary['beyond_ci']}")


if __name__ == "__main__":
    main()
