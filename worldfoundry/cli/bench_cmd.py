"""``worldfoundry bench``: evaluate candidate acceleration sets for quality, proven execution and paired speed.

With no arguments it runs ``recipes/candidates/default.json`` on the default tiny model on the CPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from worldfoundry.cli.checks import (
    check_device,
    check_input_dir,
    check_input_file,
    check_output_dir,
    remove_if_created_and_empty,
    usage_error,
)
from worldfoundry.errors import CommandLineError

#: The model benchmarked when neither ``--model`` nor the candidate file names one (``harness.DEFAULT_MODEL``;
#: repeated here so ``--help`` does not import the harness).
DEFAULT_MODEL = "tiny-wan2.1-trained"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=f"recipe name (default: the candidate file's, else {DEFAULT_MODEL})")
    p.add_argument("--checkpoint-dir", default=None, help="local diffusers-format directory")
    p.add_argument("--candidates", default=None, help="candidate JSON (default recipes/candidates/default.json)")
    p.add_argument("--recipe-file", default=None, metavar="PATH",
                   help="an explicit recipe YAML file (recipes are never looked up in the working directory)")
    p.add_argument("--out", default="bench_out", help="output directory (results.json, report.md, PNG plots)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="compute dtype (float32, bf16, fp16)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved paired timing rounds (>= 3)")
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument("--quality-only", action="store_true", help="quality and execution proof only, no timing")
    p.add_argument("--random-weights", action="store_true", help="real recipe with seeded random weights")
    p.add_argument("--require-clean", action="store_true", help="refuse to run on a checkout with uncommitted changes")
    p.add_argument("--no-progress", action="store_true")
    add_timing_arguments(p)


def add_timing_arguments(p: argparse.ArgumentParser) -> None:
    """Adaptive timing and peer options of ``worldfoundry bench``."""
    p.add_argument("--target-halfwidth", type=float, default=0.02,
                   help="add paired rounds until the speedup CI half-width / estimate is at most this (default 0.02)")
    p.add_argument("--estimator", choices=("step_floor", "paired_median"), default="step_floor",
                   help="speedup estimate: per-step minimum times over rounds (default), or the median of "
                        "per-round ratios; both are written to results.json")
    p.add_argument("--max-rounds", type=int, default=None, help="never more paired rounds than this (default 4x)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds of timing per candidate after which no rounds are added (default: the candidate "
                        "file's timing.time_budget_s, else 60)")
    p.add_argument("--width-pool", type=float, default=None, metavar="SECONDS",
                   help="seconds the run may add, past their time budgets, to candidates whose verdict is decided "
                        "but whose CI is wider than --target-halfwidth (default: the candidate file's "
                        "timing.width_pool_s, else 0: none)")
    p.add_argument("--run-budget", type=float, default=None, metavar="SECONDS",
                   help="wall-clock limit for the whole run: rounds past a candidate's time budget, width-pool "
                        "rounds and host waits run only while the rest of the run still fits (default: the "
                        "candidate file's timing.run_budget_s, else none)")
    p.add_argument("--host-hold", type=float, default=None, metavar="SECONDS",
                   help="seconds a run may wait, in total, before timed generations for the host to leave a slow "
                        "phase (default 60 on a GPU, 0 = off on the CPU)")
    p.add_argument("--max-noise-floor", type=float, default=1.05,
                   help="dense-vs-dense CI upper bound above which no speed verdicts are given (default 1.05)")
    p.add_argument("--min-gain", type=float, default=None,
                   help="smallest speedup a 'recommended' verdict asserts: its CI lower bound must exceed 1 + this "
                        "and the noise floor (default: the target half-width)")
    p.add_argument("--peers", nargs="*", default=None,
                   help="reference rows: eager compile fbcache dbcache float8, separated by spaces or commas "
                        "(no names: all that apply)")


def peer_names(values: list[str] | None) -> list[str] | None:
    """``--peers`` as a list of names (commas and spaces both separate; ``[]`` means all that apply).

    Raises:
        CommandLineError: an unknown peer name (checked before any model is built).
    """
    if values is None:
        return None
    from worldfoundry.bench.peers import KNOWN_PEERS

    names = [name for value in values for name in value.split(",") if name.strip()]
    names = [name.strip() for name in names]
    unknown = sorted({name for name in names if name not in KNOWN_PEERS and name != "all"})
    if unknown:
        raise CommandLineError("--peers", f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(KNOWN_PEERS)}")
    return names or ["all"]


def _width_pool(seconds: float | None) -> float | None:
    if seconds is not None and not seconds >= 0:
        raise CommandLineError("--width-pool", f"must be >= 0 seconds, got {seconds}")
    return seconds


def _run_budget(seconds: float | None) -> float | None:
    if seconds is not None and not 0 < seconds <= 86_400:
        raise CommandLineError("--run-budget", f"expected 0 < seconds <= 86400 for the whole run, got {seconds}")
    return seconds


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="benchmark candidate accelerations (quality, execution, speed)")
    add_arguments(p)
    p.set_defaults(func=run)


def check_arguments(args: argparse.Namespace) -> None:
    """Argument mistakes, found before anything is loaded or created.

    Raises:
        CommandLineError: unusable ``--device``, ``--out`` that is a file, missing ``--candidates`` or
            ``--checkpoint-dir``.
    """
    check_device(args.device)
    check_output_dir(args.out)
    check_input_file(args.candidates, "--candidates")
    check_input_dir(args.checkpoint_dir, "--checkpoint-dir", "diffusers-format directory")
    args.peers = peer_names(args.peers)
    _width_pool(args.width_pool)
    _run_budget(args.run_budget)


def run(args: argparse.Namespace) -> int:
    try:
        check_arguments(args)
    except CommandLineError as exc:
        return usage_error("bench", exc)
    out = Path(args.out)
    existed = out.exists()
    rc = 1
    try:
        rc = _run(args)
    finally:
        if rc != 0:
            remove_if_created_and_empty(out, existed)  # a failed run leaves no empty output directory
    return rc


def _run(args: argparse.Namespace) -> int:
    from worldfoundry.bench.harness import BenchConfig, run_bench
    from worldfoundry.bench.report import render_table
    from worldfoundry.errors import WorldFoundryError

    config = BenchConfig(
        model=args.model, candidates=args.candidates, out=args.out, checkpoint_dir=args.checkpoint_dir,
        device=args.device, dtype=args.dtype, rounds=args.rounds, seeds=args.seeds, quality_only=args.quality_only,
        random_weights=args.random_weights, require_clean=args.require_clean, progress=not args.no_progress,
        recipe_file=args.recipe_file,
        target_halfwidth=args.target_halfwidth, max_rounds=args.max_rounds, time_budget_s=args.time_budget,
        max_noise_floor=args.max_noise_floor, estimator=args.estimator, min_gain=args.min_gain,
        peers=args.peers, host_hold_s=args.host_hold, width_pool_s=args.width_pool,
        run_budget_s=args.run_budget,
    )
    try:
        results = run_bench(config, announce=lambda message: print(f"worldfoundry bench: {message}", file=sys.stderr))
    except (WorldFoundryError, ValueError) as exc:
        print(f"worldfoundry bench: {exc}", file=sys.stderr)
        return 2
    print(render_table(results))
    print(f"\nwrote {args.out}/results.json, report.md, speedup.png, quality_vs_speed.png")
    if not results["dense"].get("stable_after_candidates", True):
        print("ERROR: the dense output changed during the run; results are not trustworthy", file=sys.stderr)
        return 1
    return 0
