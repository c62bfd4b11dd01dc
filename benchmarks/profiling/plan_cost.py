"""Where a bench's planning time goes: ``plan_bench`` (candidate file validation, plugin discovery, peers) profiled
in a fresh interpreter, with the imports it triggers.

    python benchmarks/profiling/plan_cost.py --out "$OUT"       # W17 file on CUDA: prints the top entries

Writes ``plan_cost.json`` (wall of the project's import and of ``plan_bench``, the 30 largest cumulative entries) and
``plan_cost.txt`` (the profile, sorted by cumulative time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="./bench_out/plan_cost")
    parser.add_argument("--candidates", default="recipes/candidates/wan2.1-1.3b-h200.json")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    from worldfoundry.bench.harness import BenchConfig, plan_bench

    imported = time.perf_counter() - t0
    config = BenchConfig(model="wan2.1-t2v-1.3b", candidates=args.candidates, out=str(out / "unused"),
                         device=args.device, dtype="bf16", random_weights=True, peers=["compile", "fbcache"])
    profile = cProfile.Profile()
    t1 = time.perf_counter()
    profile.enable()
    plan_bench(config)
    profile.disable()
    planned = time.perf_counter() - t1
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text).sort_stats("cumulative")
    stats.print_stats(80)
    (out / "plan_cost.txt").write_text(text.getvalue())
    rows = sorted(((v[3], f"{k[0]}:{k[1]}({k[2]})") for k, v in stats.stats.items()), reverse=True)[:30]
    (out / "plan_cost.json").write_text(json.dumps({"import_s": imported, "plan_s": planned,
                                                    "top_cumulative": rows}, indent=1))
    print(f"import of the harness {imported:.2f} s, plan_bench {planned:.2f} s")
    for seconds, name in rows[:20]:
        print(f"{seconds:8.2f}  {name[-110:]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
