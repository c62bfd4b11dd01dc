#!/usr/bin/env python3
"""H200, W17: how much of each denoising step the host is busy issuing work, per arm and candidate.

The bench replaces a slowed dense arm by the run's dense floor only for a device-bound candidate: one whose steps
kept the host busy for at most 0.8 of their time (median; ``worldfoundry.bench.timing.DEVICE_BOUND_HOST_SHARE``).
This runs ``worldfoundry bench`` (Wan2.1-1.3B architecture, random weights, bf16, the W17 workload of
``recipes/candidates/wan2.1-1.3b-h200.json``) on three of its candidates -- ``cuda-graph``, ``block-fusion`` and
``block-fusion+cuda-graph`` -- with a short time budget, and prints each arm's median host share and the decision
the rule would take. Writes ``host_share.json`` and the bench's files under ``$OUT``.

    OUT=$OUT python benchmarks/bench/host_share_w17.py        # about 2 minutes on an H200
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path

from worldfoundry.bench.harness import BenchConfig, run_bench
from worldfoundry.bench.timing import DEVICE_BOUND_HOST_SHARE
from worldfoundry.core.model_loading.recipes import project_root

NAMES = ("cuda-graph", "block-fusion", "block-fusion+cuda-graph")


def shares(speed: dict, side: str) -> float | None:
    host, steps = speed["host_steps_s"][side], speed["steps_s"][side]
    values = [h / t for hs, ts in zip(host, steps) for h, t in zip(hs, ts) if t > 0]
    return statistics.median(values) if values else None


def main() -> None:
    out = Path(os.environ.get("OUT", "./bench_out")) / "host_share"
    out.mkdir(parents=True, exist_ok=True)
    full = json.loads((project_root() / "recipes" / "candidates" / "wan2.1-1.3b-h200.json").read_text())
    full["candidates"] = [c for c in full["candidates"] if c["name"] in NAMES]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(full, f)
    results = run_bench(BenchConfig(model="wan2.1-t2v-1.3b", candidates=f.name, out=str(out / "bench"),
                                    device="cuda", dtype="bf16", random_weights=True, rounds=3, max_rounds=6,
                                    time_budget_s=2.0, target_halfwidth=0.02, progress=False))
    rows = {}
    for c in results["candidates"]:
        speed = c.get("speed") or {}
        if not speed.get("host_steps_s"):
            continue
        dense, cand = shares(speed, "dense"), shares(speed, "candidate")
        rows[c["name"]] = {"dense_host_share": dense, "candidate_host_share": cand, "speedup": speed["speedup"],
                           "device_bound": cand is not None and cand <= DEVICE_BOUND_HOST_SHARE,
                           "dense_floor_source": speed.get("dense_floor_source")}
        print(f"{c['name']:26s} dense {dense:.2f}  candidate {cand:.2f}  speedup {speed['speedup']:.3f}  "
              f"device-bound: {rows[c['name']]['device_bound']}")
    (out / "host_share.json").write_text(json.dumps({"threshold": DEVICE_BOUND_HOST_SHARE, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
