"""W17 on one GPU, twice in one process: noise floor, CI half-width, verdict stability and the peer rows.

Run A: ``worldfoundry bench`` on ``recipes/candidates/wan2.1-1.3b-h200.json`` with ``--peers`` (eager,
regional torch.compile, FirstBlockCache; cache-dit/torchao when installed; ``--peers compile fbcache`` picks).
Run B: the same candidates again without peers (``--peers-in-b``: with run A's). Prints per candidate both
verdicts, medians and CI half-widths, then the goal checks (noise floor <= 1.02, half-width <= 2%, same
verdicts, each run within 5 minutes); writes ``$OUT/w17_stability.json`` (default
``./bench_out``) with both runs' outputs under ``$OUT/w17a`` and ``$OUT/w17b``.

    python benchmarks/bench/w17_stability.py [--time-budget 6] [--model wan2.1-t2v-1.3b]

Run A is the command line ``worldfoundry bench --model wan2.1-t2v-1.3b --random-weights --device cuda --dtype bf16
--candidates recipes/candidates/wan2.1-1.3b-h200.json --peers --max-rounds 20`` (the file sets the time budget,
6 s per candidate, the width pool, 40 s, and the run budget, 295 s: rounds past a budget and host waits stop
where the rest of the run would no longer fit).

The summary is written after each run. ``--call-limit S`` (a device call's limit, e.g. 570) skips run B when run
A leaves too little time for it. The two runs can also be made in two device calls: ``--runs a`` writes the
summary of run A only; ``--runs b --previous path/to/w17_stability.json`` runs B and compares it with the A of
that earlier summary (the comparison then spans two processes, and possibly two machines: a stricter test).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

from worldfoundry.bench.harness import BenchConfig, run_bench
from worldfoundry.bench.host_gate import describe as describe_gate
from worldfoundry.bench.host_speed import describe as describe_host
from worldfoundry.bench.peers import KNOWN_PEERS
from worldfoundry.core.model_loading.recipes import project_root

CANDIDATES = project_root() / "recipes" / "candidates" / "wan2.1-1.3b-h200.json"


def one_run(name: str, out: Path, args: argparse.Namespace, peers: list[str] | None) -> dict[str, Any] | None:
    t0 = time.perf_counter()
    try:
        results = run_bench(BenchConfig(
            model=args.model, candidates=str(CANDIDATES), out=str(out / name), device="cuda", dtype="bf16",
            random_weights=True, rounds=3, max_rounds=args.max_rounds, time_budget_s=args.time_budget,
            target_halfwidth=0.02, peers=peers, progress=False, host_hold_s=args.host_hold,
            width_pool_s=args.width_pool, run_budget_s=args.run_budget))
    except Exception:  # one failed run must not hide the other
        print(f"run {name} FAILED:\n{traceback.format_exc()}")
        return None
    results["run_wall_s"] = time.perf_counter() - t0  # the bench's own wall_s splits it into phases
    return results


def _row(c: dict[str, Any]) -> tuple[str, str, str]:
    sp = c.get("speed") or {}
    med = f"{sp['speedup']:.3f}" if sp else "-"
    hw = f"{sp['halfwidth']:.1%}/{sp['rounds']}r" if sp else "-"
    return c["verdict"], med, hw


def record(summary: dict[str, Any], tag: str, res: dict[str, Any] | None, peers: list[str] | None,
           out: Path) -> None:
    """Fold run ``tag`` into ``summary`` and write ``w17_stability.json`` (after each run: a call cut short keeps
    what finished)."""
    if not res:
        return
    summary["runs"][tag] = {"noise_floor": res["noise_floor"], "noisy_host": res.get("noisy_host"),
                            "decision_threshold": res.get("decision_threshold"),
                            "control_halfwidth": res["dense"]["control"].get("halfwidth"),
                            "wall_s": res["run_wall_s"], "phases_s": res.get("wall_s"),
                            "host_speed": res.get("host_speed"),
                            "host_gate": res.get("host_gate"), "settle": res.get("settle"),
                            "run_budget": res.get("run_budget")}
    for c in res["candidates"]:
        summary["candidates"].setdefault(c["name"], {})[tag] = _row(c)
    if peers:
        key = "peers" if tag == "a" else f"peers_{tag}"
        summary[key] = []
        for peer in res.get("peers", []):
            sp = peer.get("speed") or {}
            summary[key].append({"name": peer["name"], "status": peer.get("reason") or peer.get("error") or
                                     peer["verdict"], "median": sp.get("speedup"),
                                     "halfwidth": sp.get("halfwidth"), "warmup_s": peer.get("warmup_s"),
                                     "rel_l2": peer.get("latent_rel_l2")})
    (out / "w17_stability.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"run {tag} done in {res['run_wall_s']:.0f} s; summary written", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="wan2.1-t2v-1.3b")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds of timing per candidate (default: the candidate file's timing.time_budget_s)")
    p.add_argument("--width-pool", type=float, default=None,
                   help="seconds the run may add to decided candidates still wider than 2%% (default: the "
                        "candidate file's timing.width_pool_s)")
    p.add_argument("--run-budget", type=float, default=None,
                   help="seconds each run may take in all (default: the candidate file's timing.run_budget_s)")
    p.add_argument("--max-rounds", type=int, default=20)
    p.add_argument("--host-hold", type=float, default=None,
                   help="seconds each run may hold timed generations for a fast host phase (default: the bench's)")
    p.add_argument("--runs", default="a,b", help="which runs to make here: a (with peers), b, or a,b")
    p.add_argument("--previous", default=None, help="an earlier w17_stability.json whose runs are kept")
    p.add_argument("--call-limit", type=float, default=None,
                   help="seconds this process may take in all (a device call's limit): run B is skipped, and the "
                        "command for it printed, when run A leaves less than 1.1 x its own wall")
    p.add_argument("--no-peers", action="store_true", help="run A without the peer rows (both runs then time "
                                                            "the same candidates only)")
    p.add_argument("--peers", nargs="+", default=list(KNOWN_PEERS), choices=KNOWN_PEERS,
                   help="the peer rows of run A (default all five; the goal names compile and fbcache)")
    p.add_argument("--peers-in-b", action="store_true", help="run B with the same peer rows as run A")
    args = p.parse_args()
    out = Path(os.environ.get("OUT", "bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    runs = {tag.strip() for tag in args.runs.split(",") if tag.strip()}
    if not runs <= {"a", "b"}:
        p.error(f"--runs: expected a, b or a,b, got {args.runs!r}")
    summary: dict[str, Any] = {"candidates": {}, "peers": [], "runs": {}}
    if args.previous:
        summary = json.loads(Path(args.previous).read_text(encoding="utf-8"))
    peers = None if args.no_peers else list(args.peers)
    started = time.perf_counter()
    a = one_run("w17a", out, args, peers) if "a" in runs else None
    record(summary, "a", a, peers, out)
    left = args.call_limit - (time.perf_counter() - started) if args.call_limit else None
    if "b" in runs and a and left is not None and left < 1.1 * a["run_wall_s"]:
        print(f"run B skipped: {left:.0f} s left of --call-limit, run A "
              f"took {a['run_wall_s']:.0f} s (run B alone: --runs b --previous {out / 'w17_stability.json'})")
        runs.discard("b")
    peers_b = peers if args.peers_in_b else None
    b = one_run("w17b", out, args, peers_b) if "b" in runs else None
    record(summary, "b", b, peers_b, out)
    print(f"\n{'candidate':28} {'verdict A':26} {'med A':>7} {'hw A':>10} | {'verdict B':26} {'med B':>7} {'hw B':>10}")
    same = True
    for name, runs in summary["candidates"].items():
        ra, rb = runs.get("a", ("-",) * 3), runs.get("b", ("-",) * 3)
        same &= ra[0] == rb[0]
        print(f"{name:28} {ra[0]:26} {ra[1]:>7} {ra[2]:>10} | {rb[0]:26} {rb[1]:>7} {rb[2]:>10}")
    print("\npeers (run A):")
    for peer in summary["peers"]:
        print(f"  {peer['name']:14} {str(peer['status'])[:60]:60} median {peer['median']} hw {peer['halfwidth']} "
              f"warm-up {peer['warmup_s']} relL2 {peer['rel_l2']}")
    for tag, run in summary["runs"].items():
        print(f"run {tag}: noise floor {run['noise_floor']:.4f} (goal <= 1.02), control half-width "
              f"{run['control_halfwidth']:.2%}, wall {run['wall_s']:.0f} s, noisy: {bool(run['noisy_host'])}")
        print(f"       host speed: {describe_host(run.get('host_speed'))}")
        print(f"       host gate: {describe_gate(run.get('host_gate'))}")
    print(f"verdicts identical across runs: {same and len(summary['runs']) == 2}")
    widths = [float(row[2].split("%")[0]) / 100 for runs in summary["candidates"].values() for row in runs.values()
              if row[2] != "-"]
    print(f"candidate rows with a CI half-width <= 2%: {sum(w <= 0.02 for w in widths)} of {len(widths)}")
    walls = {tag: run["wall_s"] for tag, run in summary["runs"].items()}
    print("runs within 5 minutes: " + ", ".join(f"{tag} {wall:.0f} s {'yes' if wall <= 300 else 'no'}"
                                                 for tag, wall in walls.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
