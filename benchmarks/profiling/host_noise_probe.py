#!/usr/bin/env python3
"""Where a slow phase of the host comes from: eager W17 forwards next to the machine's own counters.

The W17 forward (Wan2.1-1.3B architecture, random weights, bf16) is bound by the host on the H200 machines, and
the same forward takes 38-90 ms from one phase to the next. This probe times forwards back to back and, around
each one, reads what the kernel says about the host:

* ``loop_ms``: the bench's host probe (:func:`~worldfoundry.bench.host_speed.probe_ms`, a fixed pure-Python loop,
  no GPU) at 100,000 iterations: the speed of the interpreter's core at that moment;
* ``steal`` / ``user`` / ``system`` / ``idle``: the machine's ``/proc/stat`` jiffies during the forward (``steal``:
  time a hypervisor gave this machine's vCPUs to someone else);
* ``cpu``: the core the main thread last ran on, ``mhz`` its clock where ``/sys`` shows it;
* ``ctx_vol`` / ``ctx_invol``: the main thread's voluntary and involuntary context switches during the forward;

in three phases: as the process starts (``free``), with the process pinned to one core and torch's CPU threads
set to 1 (``pinned``), and free again (``free_again``, to see drift). Prints per phase the median and 90th
percentile of the forward and of the loop, the correlation between them, and the counters of the slowest tenth of
forwards against the rest.

    python benchmarks/profiling/host_noise_probe.py --out $OUT              # H200, about 1.5 minutes
    python benchmarks/profiling/host_noise_probe.py --smoke --out /tmp/hn   # tiny model, CPU

Writes ``$OUT/host_noise_probe.json``.
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
from worldfoundry.core.timing import sync  # noqa: E402
from worldfoundry.core.fusion.compile_pool import set_default_compile_mode  # noqa: E402

#: iterations of the bench's host probe loop per sample (five of the bench's probes; `11b3738` timed its own
#: ``acc += i % 7`` loop of 100,000 iterations instead: absolute figures differ, phases show the same way)
LOOPS = 100_000
STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_jiffies() -> dict[str, int]:
    try:
        with open("/proc/stat", encoding="ascii") as f:
            parts = f.readline().split()[1:1 + len(STAT_FIELDS)]
        return {k: int(v) for k, v in zip(STAT_FIELDS, parts)}
    except OSError:
        return {}


def thread_state() -> tuple[int, int, int]:
    """(last cpu, voluntary, involuntary context switches) of the calling thread (-1 where unknown)."""
    cpu = vol = invol = -1
    try:
        with open(f"/proc/self/task/{os.getpid()}/stat", encoding="ascii") as f:
            cpu = int(f.read().rsplit(")", 1)[1].split()[36])
        with open(f"/proc/self/task/{os.getpid()}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches"):
                    vol = int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    invol = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return cpu, vol, invol


def core_mhz(cpu: int) -> float | None:
    try:
        return int(Path(f"/sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_cur_freq").read_text()) / 1e3
    except (OSError, ValueError):
        return None


def one(fn: Any, device: torch.device) -> dict[str, Any]:
    loop = probe_ms(LOOPS)
    sync(device)
    j0, (_, v0, i0) = cpu_jiffies(), thread_state()
    t0 = time.perf_counter()
    fn()
    sync(device)
    ms = (time.perf_counter() - t0) * 1e3
    j1, (cpu, v1, i1) = cpu_jiffies(), thread_state()
    row = {"forward_ms": ms, "loop_ms": loop, "cpu": cpu, "mhz": core_mhz(cpu), "ctx_vol": v1 - v0,
           "ctx_invol": i1 - i0}
    row.update({k: j1.get(k, 0) - j0.get(k, 0) for k in ("user", "system", "idle", "steal", "iowait")})
    return row


def corr(xs: list[float], ys: list[float]) -> float | None:
    try:
        return round(statistics.correlation(xs, ys), 3)
    except (statistics.StatisticsError, ValueError):
        return None


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    fw = [r["forward_ms"] for r in rows]
    lp = [r["loop_ms"] for r in rows]
    order = sorted(range(len(rows)), key=lambda i: fw[i])
    cut = max(1, len(rows) // 10)
    slow, rest = [rows[i] for i in order[-cut:]], [rows[i] for i in order[:-cut]]

    def mean(group: list[dict[str, Any]], key: str) -> float | None:
        vals = [g[key] for g in group if g.get(key) is not None]
        return round(statistics.fmean(vals), 3) if vals else None

    keys = ("forward_ms", "loop_ms", "steal", "user", "system", "idle", "ctx_vol", "ctx_invol", "mhz")
    return {"n": len(rows), "forward_median": round(statistics.median(fw), 2),
            "forward_p90": round(sorted(fw)[int(0.9 * (len(fw) - 1))], 2),
            "loop_median": round(statistics.median(lp), 3), "loop_p90": round(sorted(lp)[int(0.9 * (len(lp) - 1))], 3),
            "corr_forward_loop": corr(fw, lp), "cpus_used": sorted({r["cpu"] for r in rows}),
            "slowest_tenth": {k: mean(slow, k) for k in keys}, "rest": {k: mean(rest, k) for k in keys}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--forwards", type=int, default=120, help="forwards per phase")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    set_default_compile_mode("blocking")  # kernels compile before a first fused call, never beside timing
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    latent = (SMOKE_WORKLOADS if args.smoke else WORKLOADS)["W17" if not args.smoke else next(iter(SMOKE_WORKLOADS))]
    model = build("wan", args.smoke, device)
    fn = caller(model, inputs_for(model, "wan", latent, device))
    for _ in range(3):
        fn()
    affinity = sorted(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    phases: dict[str, list[dict[str, Any]]] = {}
    phases["free"] = [one(fn, device) for _ in range(args.forwards)]
    core = thread_state()[0] if thread_state()[0] in affinity else affinity[0]
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    try:
        phases["pinned"] = [one(fn, device) for _ in range(args.forwards)]
    finally:
        os.sched_setaffinity(0, set(affinity))
        torch.set_num_threads(threads)
    phases["free_again"] = [one(fn, device) for _ in range(args.forwards)]
    data = {"provenance": provenance(device), "affinity": affinity, "torch_threads": threads, "pinned_core": core,
            "summary": {k: summarise(v) for k, v in phases.items()}, "rows": phases}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "host_noise_probe.json").write_text(json.dumps(data, indent=1, default=str))
    print(f"cores {len(affinity)}, torch threads {threads}, pinned to core {core}")
    for name, s in data["summary"].items():
        print(f"{name:11} forward median {s['forward_median']} p90 {s['forward_p90']} | loop median "
              f"{s['loop_median']} p90 {s['loop_p90']} | corr {s['corr_forward_loop']} | cpus {s['cpus_used'][:8]}")
        print(f"{'':11} slowest tenth {s['slowest_tenth']}")
        print(f"{'':11} rest          {s['rest']}")


if __name__ == "__main__":
    main()
