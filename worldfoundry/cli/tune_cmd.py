"""``worldfoundry tune``: search the fastest acceleration configuration within a quality budget.

With no arguments it tunes EasyCache (and the other installed plugins that run here) on the shipped trained tiny
model on the CPU and writes ``tune_out/tuned.json`` (a candidate file for ``worldfoundry bench``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("tune", help="search the fastest acceleration settings within a quality budget")
    p.add_argument("--model", default=None, help="recipe name (default tiny-wan2.1-trained)")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--workload", default=None,
                   help="candidate file whose workload (prompt, frames, steps, seeds) and budget are used")
    p.add_argument("--space", default=None, help="JSON file: plugin -> ranges (default: the built-in space)")
    p.add_argument("--prompt", default=None)
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument("--max-rel-l2", type=float, default=None, help="quality budget: latent rel L2 at most")
    p.add_argument("--min-psnr", type=float, default=None, help="quality budget: decoded PSNR dB at least")
    p.add_argument("--min-ssim", type=float, default=None, help="quality budget: per-frame SSIM at least")
    p.add_argument("--out", default="tune_out")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--survivors", type=int, default=3, help="quality survivors that are timed (default 3)")
    p.add_argument("--refine", type=int, default=2, help="threshold bisection passes (default 2)")
    p.add_argument("--time-budget", type=float, default=30.0, help="seconds of timing per candidate (default 30)")
    p.add_argument("--estimator", choices=("step_floor", "paired_median"), default="step_floor",
                   help="speedup estimate of the timed passes (see worldfoundry bench --help)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def _read_json(path: str, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError as exc:
        raise ValueError(f"{what} {path} does not exist") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {path} is not valid JSON: {exc}") from exc


def _config(args: argparse.Namespace) -> Any:
    from worldfoundry.bench.tune import DEFAULT_TUNE_BUDGET, DEFAULT_WORKLOAD, TuneConfig

    workload, budget, model = dict(DEFAULT_WORKLOAD), dict(DEFAULT_TUNE_BUDGET), args.model
    if args.workload:
        data = _read_json(args.workload, "--workload")
        workload.update(data.get("workload", {}))
        budget.update(data.get("quality_budget", {}))
        model = model or data.get("model")
    if args.prompt:
        workload["prompt"] = args.prompt
    if args.seeds:
        workload["seeds"] = list(args.seeds)
    for key, value in (("latent_rel_l2", args.max_rel_l2), ("psnr_db", args.min_psnr), ("min_ssim", args.min_ssim)):
        if value is not None:
            budget[key] = value
    return TuneConfig(model=model, workload=workload, budget=budget,
                      space=_read_json(args.space, "--space") if args.space else None, out=args.out,
                      device=args.device, dtype=args.dtype, checkpoint_dir=args.checkpoint_dir,
                      random_weights=args.random_weights, survivors=args.survivors, refine=args.refine,
                      time_budget_s=args.time_budget, estimator=args.estimator, progress=not args.no_progress)


def run(args: argparse.Namespace) -> int:
    from worldfoundry.bench.tune import run_tune
    from worldfoundry.errors import WorldFoundryError

    try:
        trace = run_tune(_config(args))
    except (WorldFoundryError, ValueError) as exc:
        print(f"worldfoundry tune: {exc}", file=sys.stderr)
        return 2
    chosen = trace["chosen"]
    if chosen is None:
        print(f"no configuration within the budget; see {args.out}/tune_report.md")
        return 1
    print(f"chosen: {json.dumps(chosen['accelerations'])}  {chosen['speedup']:.3g}x "
          f"CI {chosen['ci95']}  ({chosen['verdict']})")
    print(f"wrote {args.out}/tuned.json, tune_report.md, tune.json")
    return 0
