#!/usr/bin/env python3
"""Is a slow phase of the host the whole machine's, or some cores'? And does moving to the fastest core help?

The lent GPU machines' interpreter slows by up to 2x in phases (``host_noise_probe.py``: invisible from inside the
guest, and pinning to one core did not remove it). This probe asks whether, at one moment, every core is slow or
only some:

* ``cores`` phase: every ``--interval`` seconds for ``--seconds``, the bench's host probe
  (:func:`~worldfoundry.bench.host_speed.probe_ms`, median of three) on each core in turn (the main thread pinned
  to it). Per sample: the fastest, median and slowest core against the phase's 10th percentile of all probes.
  If slow phases were per core, the fastest core of a slow sample would be fast.
* ``forwards`` phase: eager W17 forwards (Wan2.1-1.3B architecture, random weights, bf16), alternating two
  policies forward by forward: ``stay`` (the process's own affinity, as the bench runs) and ``hop`` (before the
  forward, every core probed once and the main thread pinned to the fastest; the hop is outside the timed region).
  Per policy: median, 90th percentile and the fraction of forwards 1.25x above the fastest.

    python benchmarks/profiling/core_hop_probe.py --out $OUT               # H200, about 1.5 minutes
    python benchmarks/profiling/core_hop_probe.py --smoke --out /tmp/hop   # tiny model, CPU

Writes ``$OUT/core_hop_probe.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

from block_fusion import build, caller, inputs_for  # noqa: E402

from worldfoundry.bench.host_speed import probe_ms  # noqa: E402
from worldfoundry.bench.microbench import SMOKE_WORKLOADS, WORKLOADS, provenance  # noqa: E402
from worldfoundry.core.fusion.compile_pool import set_default_compile_mode  # noqa: E402
from worldfoundry.core.timing import sync  # noqa: E402

SLOW = 1.25


def check(core: int | None = None) -> float:
    """Median of three probes, on ``core`` when given (the calling thread is left pinned there)."""
    if core is not None:
        os.sched_setaffinity(0, {core})
    return statistics.median(probe_ms() for _ in range(3))


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def cores_phase(cores: list[int], seconds: float, interval: float) -> dict[str, Any]:
    samples = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        samples.append({str(c): check(c) for c in cores})
        time.sleep(interval)
    everything = [v for s in samples for v in s.values()]
    ref = quantile(everything, 0.1)
    rows = []
    for s in samples:
        vals = sorted(s.values())
        rows.append({"fastest": vals[0] / ref, "median": statistics.median(vals) / ref, "slowest": vals[-1] / ref})
    slow_rows = [r for r in rows if r["median"] > SLOW]
    per_core = {c: statistics.median(s[str(c)] for s in samples) / ref for c in cores}
    return {"samples": len(samples), "reference_ms": ref,
            "median_core_slow_fraction": len(slow_rows) / max(1, len(rows)),
            "fastest_core_slow_fraction": sum(r["fastest"] > SLOW for r in rows) / max(1, len(rows)),
            "slow_samples_rescued": (sum(r["fastest"] <= SLOW for r in slow_rows) / len(slow_rows)
                                     if slow_rows else None),
            "per_core_median": per_core, "rows": rows, "raw": samples}


def forwards_phase(fn: Any, device: torch.device, cores: list[int], n: int) -> dict[str, Any]:
    own = os.sched_getaffinity(0)
    times: dict[str, list[float]] = {"stay": [], "hop": []}
    chosen: list[int] = []
    for i in range(2 * n):
        policy = "hop" if i % 2 else "stay"
        if policy == "hop":
            best = min(cores, key=check)
            os.sched_setaffinity(0, {best})
            chosen.append(best)
        else:
            os.sched_setaffinity(0, own)
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times[policy].append((time.perf_counter() - t0) * 1e3)
    os.sched_setaffinity(0, own)
    fastest = min(min(v) for v in times.values())
    summary = {p: {"median_ms": statistics.median(v), "p90_ms": quantile(v, 0.9),
                   "slow_fraction": sum(x > SLOW * fastest for x in v) / len(v)} for p, v in times.items()}
    return {"summary": summary, "times_ms": times, "hop_cores": chosen}


def topology() -> dict[str, Any]:
    info: dict[str, Any] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
        info["model"] = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")),
                             None)
        info["core_ids"] = [ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("core id")]
    except OSError:
        pass
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--seconds", type=float, default=40.0, help="length of the cores phase")
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--forwards", type=int, default=150, help="forwards per policy")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    set_default_compile_mode("blocking")
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    latent = (SMOKE_WORKLOADS if args.smoke else WORKLOADS)["W17" if not args.smoke else next(iter(SMOKE_WORKLOADS))]
    cores = sorted(os.sched_getaffinity(0))
    own = set(cores)
    try:
        cores_data = cores_phase(cores, args.seconds if not args.smoke else 1.0, args.interval)
    finally:
        os.sched_setaffinity(0, own)
    model = build("wan", args.smoke, device)
    fn = caller(model, inputs_for(model, "wan", latent, device))
    for _ in range(3):
        fn()
    fw = forwards_phase(fn, device, cores, args.forwards if not args.smoke else 3)
    data = {"provenance": provenance(device), "cores": cores, "topology": topology(), "cores_phase": cores_data,
            "forwards_phase": fw}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "core_hop_probe.json").write_text(json.dumps(data, indent=1, default=str))
    c = cores_data
    print(f"{len(cores)} cores ({data['topology'].get('model')}); {c['samples']} samples, probe reference "
          f"{c['reference_ms']:.3f} ms")
    print(f"samples whose median core is slow (> {SLOW}x): {c['median_core_slow_fraction']:.1%}; whose fastest core "
          f"is slow: {c['fastest_core_slow_fraction']:.1%}; slow samples with a fast core: "
          f"{c['slow_samples_rescued']}")
    print("per-core median / reference: " + " ".join(f"{k}:{v:.2f}" for k, v in c["per_core_median"].items()))
    for policy, s in fw["summary"].items():
        print(f"forwards {policy:5}: median {s['median_ms']:.2f} ms, p90 {s['p90_ms']:.2f} ms, "
              f"slow {s['slow_fraction']:.1%}")
    print(f"hop cores: {sorted(set(fw['hop_cores']))}")


if __name__ == "__main__":
    main()
