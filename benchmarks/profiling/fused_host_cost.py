#!/usr/bin/env python3
"""Host (Python + launch) cost of one Wan forward, eager against ``wan_block_fusion``: where the fused forward's
host time goes.

The fused W17 forward's kernels take about 25 ms of device time, yet the forward takes 33-34 ms on a fast host:
the GPU waits for the host. For each variant (eager; ``wan_block_fusion`` with its default chains; with the
``layer_norm`` chain replaced by torch's LayerNorms and the float32 carry) this measures, per forward:

* ``host_ms``: the host time of the Python forward while the GPU is kept busy beforehand by a ``torch.cuda._sleep``
  long enough that no launch waits for the GPU (pure host cost; ``queue_full`` says when the launch queue filled
  and the figure is an upper bound);
* ``wall_ms`` / ``gpu_ms``: the forward timed normally (synchronised before and after) and its CUDA-event time;

and one forward under :mod:`cProfile`, its own time summed by *area* (diffusers' attention dispatcher, other
diffusers code, ``torch.nn`` modules and functional, torch's C operators, Triton, this project's fusion code,
the plugin, other) with the top functions. cProfile slows Python-heavy code more than C calls: the areas' shares
rank, the ``host_ms`` column measures.

    python benchmarks/profiling/fused_host_cost.py --out $OUT                 # H200, about a minute
    python benchmarks/profiling/fused_host_cost.py --smoke --out /tmp/fhc     # tiny model, CPU (fallbacks)

Writes ``$OUT/fused_host_cost.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

from block_fusion import WAN_CARRY_CHAINS, build, caller, inputs_for, registry  # noqa: E402

from worldfoundry.bench.microbench import SMOKE_WORKLOADS, WORKLOADS, provenance  # noqa: E402
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations  # noqa: E402
from worldfoundry.core.timing import Region, sync  # noqa: E402
from worldfoundry.core.fusion.compile_pool import set_default_compile_mode  # noqa: E402

#: (area, substring of the function's file or name), first match wins; C functions have the file "~"
AREAS: tuple[tuple[str, str], ...] = (
    ("diffusers attention dispatch", "attention_dispatch"),
    ("diffusers hooks", "diffusers/hooks"),
    ("diffusers other", "diffusers"),
    ("worldfoundry fusion", "worldfoundry/core/fusion"),
    ("block_fusion plugin", "worldfoundry_block_fusion"),
    ("worldfoundry other", "worldfoundry"),
    ("triton", "triton"),
    ("torch.nn modules", "torch/nn/modules"),
    ("torch.nn.functional", "torch/nn/functional"),
    ("torch other (python)", "torch/"),
)

#: GPU sleep ahead of a host-timed forward (cycles; ~1.7-2 GHz: about 0.3 s)
SLEEP_CYCLES = 600_000_000


def area(filename: str, name: str) -> str:
    if filename == "~":
        return "C functions (torch ops, launches, builtins)"
    for label, needle in AREAS:
        if needle in filename:
            return label
    return "other python"


def host_time(fn: Callable[[], Any], device: torch.device) -> tuple[float, bool]:
    """Host ms of ``fn`` with the GPU busy beforehand; ``True`` if the GPU finished before the host did."""
    sync(device)
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3, False
    done = torch.cuda.Event()
    torch.cuda._sleep(SLEEP_CYCLES)
    done.record()
    t0 = time.perf_counter()
    fn()
    host = (time.perf_counter() - t0) * 1e3
    queue_full = done.query()  # the sleep ended while the host was still enqueueing: it may have waited
    sync(device)
    return host, queue_full


def profile_areas(fn: Callable[[], Any], device: torch.device, top: int) -> dict[str, Any]:
    sync(device)
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    sync(device)
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    areas: dict[str, float] = {}
    rows = []
    for (filename, line, name), (_, ncalls, tottime, _cum, _) in stats.items():
        label = area(filename, name)
        areas[label] = areas.get(label, 0.0) + tottime
        rows.append((tottime, ncalls, f"{Path(filename).name}:{line}:{name}" if filename != "~" else name))
    rows.sort(reverse=True)
    total = sum(areas.values())
    return {"total_ms": round(total * 1e3, 2),
            "areas_ms": {k: round(v * 1e3, 2) for k, v in sorted(areas.items(), key=lambda kv: -kv[1])},
            "top": [(round(t * 1e3, 3), n, label) for t, n, label in rows[:top]]}


def measure(name: str, fn: Callable[[], Any], device: torch.device, forwards: int, top: int) -> dict[str, Any]:
    fn(), fn()
    hosts, full = [], 0
    walls, gpus = [], []
    for _ in range(forwards):
        h, q = host_time(fn, device)
        hosts.append(h)
        full += q
        with Region(device) as region:
            fn()
        walls.append(region.wall_ms)
        gpus.append(region.device_ms)
    return {"host_ms": round(statistics.median(hosts), 3), "queue_full": full,
            "wall_ms": round(statistics.median(walls), 3), "gpu_ms": round(statistics.median(gpus), 3),
            "profile": profile_areas(fn, device, top)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--workload", default="W17")
    p.add_argument("--forwards", type=int, default=10)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (the fusion falls back)")
    args = p.parse_args()
    set_default_compile_mode("blocking")  # kernels compile before a first fused call, never beside timing
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    shapes = SMOKE_WORKLOADS if args.smoke else WORKLOADS
    label = args.workload if not args.smoke else next(iter(SMOKE_WORKLOADS))
    model = build("wan", args.smoke, device)
    inputs = inputs_for(model, "wan", shapes[label], device)
    data: dict[str, Any] = {"provenance": provenance(device), "workload": label, "variants": {}}
    data["variants"]["eager"] = measure("eager", caller(model, inputs), device, args.forwards, args.top)
    for name, spec in (("block_fusion", {}), ("block_fusion:float_carry", {"chains": list(WAN_CARRY_CHAINS)})):
        session = install_diffusion_accelerations(model, {"wan_block_fusion": spec}, registry=registry())
        try:
            data["variants"][name] = measure(name, caller(model, inputs, request_id=name), device, args.forwards,
                                             args.top)
        finally:
            session.uninstall()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fused_host_cost.json").write_text(json.dumps(data, indent=1, default=str))
    print(f"{label}: {'variant':<26} {'host ms':>8} {'wall ms':>8} {'gpu ms':>8} {'queue full':>10} {'cProfile ms':>11}")
    for name, v in data["variants"].items():
        print(f"{'':5}{name:<26} {v['host_ms']:>8.2f} {v['wall_ms']:>8.2f} {v['gpu_ms']:>8.2f} "
              f"{v['queue_full']:>10} {v['profile']['total_ms']:>11.1f}")
    for name, v in data["variants"].items():
        print(f"--- {name}: own time by area (cProfile ms)")
        for k, ms in v["profile"]["areas_ms"].items():
            print(f"  {ms:9.2f}  {k}")
        print("  top functions (own ms, calls):")
        for ms, n, fn_name in v["profile"]["top"][:25]:
            print(f"  {ms:9.3f} {n:6d}  {fn_name[:100]}")


if __name__ == "__main__":
    main()
