#!/usr/bin/env python3
"""Is a forward bound by the host (Python + kernel launches) or by the GPU? W17 diagnostic.

For the Wan2.1-T2V-1.3B architecture (random seeded weights, bf16) at a workload (default W17, 3,600 tokens),
and for each variant (dense; ``resident_blocks`` with r = 0 / r = ``--r`` in both layouts), per forward:

* ``enqueue_ms``: host time from the call until the Python forward returns (no synchronisation inside);
* ``wall_ms``: host time until the GPU finished (synchronise after the forward);
* ``gpu_ms``: CUDA-event time of the forward.

When ``enqueue_ms`` is close to ``wall_ms`` the GPU waits for the host: Python overhead per block adds
directly to the step time. One forward per variant is also run under :mod:`cProfile`; the top functions by
own time are written out (``host_overhead.json``), so the host cost of each component is visible.

A third probe runs dense forwards while host->device copies saturate the PCIe link on another stream:
if the forward is host/launch-bound, a slowdown there is the interference a streaming offload cannot avoid.

Usage:
    python benchmarks/profiling/host_overhead.py --out "$OUT"           # H200, about 2 minutes
    python benchmarks/profiling/host_overhead.py --smoke --out /tmp/ho  # tiny model on the CPU
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from worldfoundry.bench.microbench import Region

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "offload"))

from resident_blocks import (  # benchmark helpers, same directory tree
    SMOKE_WORKLOADS,
    TEXT_TOKENS,
    WAN_RECIPE,
    WAN_SMOKE_RECIPE,
    WORKLOADS,
    forward,
    install,
    materialize,
    twin,
    wan_inputs,
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(model: torch.nn.Module, inputs: dict[str, Any], device: torch.device) -> dict[str, float]:
    with Region(device) as region:
        forward(model, inputs)
    return {"enqueue_ms": region.enqueue_ms, "wall_ms": region.wall_ms, "gpu_ms": region.device_ms}


def profile_forward(model: torch.nn.Module, inputs: dict[str, Any], device: torch.device, top: int) -> list[str]:
    _sync(device)
    prof = cProfile.Profile()
    prof.enable()
    forward(model, inputs)
    prof.disable()
    _sync(device)
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    return [line for line in buf.getvalue().splitlines() if line.strip()][:top + 12]


def trace_forward(model: torch.nn.Module, inputs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """One forward under torch.profiler: GPU busy time per stream, gaps on the busiest stream, CUDA API host time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=activities) as prof:
        forward(model, inputs)
        _sync(device)
    streams: dict[int, list[tuple[float, float, str]]] = {}
    api: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            start = ev.time_range.start
            end = ev.time_range.end
            streams.setdefault(getattr(ev, "device_resource_id", 0), []).append((start, end, ev.name))
        elif ev.name.startswith("cuda") or ev.name.startswith("cu"):
            api.setdefault(ev.name, []).append(ev.time_range.elapsed_us())
    out: dict[str, Any] = {"streams": {}, "cuda_api_host_us": {}}
    for sid, spans in streams.items():
        spans.sort()
        busy = sum(e - s for s, e, _ in spans)
        gaps = [spans[i + 1][0] - spans[i][1] for i in range(len(spans) - 1)]
        big = [g for g in gaps if g > 20]
        out["streams"][str(sid)] = {"ops": len(spans), "busy_ms": round(busy / 1e3, 3),
                                    "span_ms": round((spans[-1][1] - spans[0][0]) / 1e3, 3),
                                    "gaps_over_20us": len(big), "gap_ms_over_20us": round(sum(big) / 1e3, 3),
                                    "memcpy_ms": round(sum(e - s for s, e, n in spans if "emcpy" in n) / 1e3, 3)}
    for name, durs in sorted(api.items(), key=lambda kv: -sum(kv[1])):
        out["cuda_api_host_us"][name] = {"calls": len(durs), "total_us": round(sum(durs), 1),
                                         "max_us": round(max(durs), 1)}
    return out


def dma_probe(model: torch.nn.Module, inputs: dict[str, Any], device: torch.device, repeats: int) -> dict[str, Any]:
    """Does a host->device copy stream slow the host thread? Dense forwards and a pure-Python loop, each with and
    without pinned H2D copies running on another stream (enqueued beforehand, so no launch cost overlaps)."""
    if device.type != "cuda":
        return {}
    nbytes = 88 * 2**20
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device=device)

    def busy_copies(n: int) -> None:
        with torch.cuda.stream(stream):
            for _ in range(n):
                dev.copy_(host, non_blocking=True)

    def python_loop() -> float:
        t0 = time.perf_counter()
        acc = 0
        for i in range(200_000):
            acc += i % 7
        return (time.perf_counter() - t0) * 1e3

    def compute_stream_forward() -> tuple[float, float]:
        with Region(device, sync_before=False) as region:  # the end event: the forward only, not the copies
            forward(model, inputs)
        return region.enqueue_ms, region.device_ms

    out: dict[str, list[float]] = {k: [] for k in (
        "forward_enqueue_ms", "forward_gpu_ms", "forward_enqueue_ms_with_dma", "forward_gpu_ms_with_dma",
        "python_loop_ms", "python_loop_ms_with_dma")}
    for _ in range(repeats):
        _sync(device)
        enq, gpu = compute_stream_forward()
        out["forward_enqueue_ms"].append(enq)
        out["forward_gpu_ms"].append(gpu)
        out["python_loop_ms"].append(python_loop())
        _sync(device)
        busy_copies(80)  # ~130 ms of host->device copies at ~55 GB/s, enqueued before the forward starts
        enq, gpu = compute_stream_forward()
        out["forward_enqueue_ms_with_dma"].append(enq)
        out["forward_gpu_ms_with_dma"].append(gpu)
        out["python_loop_ms_with_dma"].append(python_loop())
        _sync(device)
    summary = {k: round(statistics.median(v), 3) for k, v in out.items()}
    summary["forward_slowdown_with_dma"] = round(summary["forward_gpu_ms_with_dma"] / summary["forward_gpu_ms"], 4)
    return summary


def request(model: torch.nn.Module, rid: str, plugin: bool):
    if not plugin:
        import contextlib

        return contextlib.nullcontext()
    from worldfoundry.core.acceleration.guard import get_request_guard

    return get_request_guard(model).request(rid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--workload", default=None)
    parser.add_argument("--r", type=int, default=9, help="resident blocks of the r > 0 variants")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--forwards", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--no-trace", action="store_true", help="skip the torch.profiler trace per variant")
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    from diffusers import WanTransformer3DModel

    from worldfoundry.core.offload.block_probe import resolve_dit_source

    recipe = WAN_SMOKE_RECIPE if args.smoke else WAN_RECIPE
    workloads = SMOKE_WORKLOADS if args.smoke else WORKLOADS
    workload = args.workload or next(iter(workloads))
    source = resolve_dit_source(recipe)
    config = dict(source.config)
    model = materialize(WanTransformer3DModel, config, device, dtype, seed=0)
    frames, height, width = workloads[workload]
    inputs = wan_inputs(config, frames, height, width, source.text_tokens or TEXT_TOKENS, device, dtype, seed=1)
    r = min(args.r, len(model.blocks))

    variants: dict[str, tuple[torch.nn.Module, bool]] = {"dense": (model, False)}
    for name, rr, contiguous in ((f"rb_r{r}_per_tensor", r, False), (f"rb_r{r}_contiguous", r, True),
                                 ("rb_r0_per_tensor", 0, False), ("rb_r0_contiguous", 0, True)):
        clone = twin(model, WanTransformer3DModel, config)
        install(clone, rr, contiguous)
        variants[name] = (clone, True)

    rows: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    profiles: dict[str, list[str]] = {}
    traces: dict[str, Any] = {}
    for name, (m, plugin) in variants.items():  # warm-up + profile, one request each
        with request(m, f"{name}-warm", plugin):
            forward(m, inputs)
            forward(m, inputs)
            profiles[name] = profile_forward(m, inputs, device, args.top)
            if args.no_trace:
                continue
            try:
                traces[name] = trace_forward(m, inputs, device)
            except Exception as exc:  # the profiler must not cost the timing run
                traces[name] = {"error": f"{type(exc).__name__}: {exc}"}
    names = list(variants)
    for rnd in range(args.rounds):
        order = names[rnd % len(names):] + names[: rnd % len(names)]
        for name in order:
            m, plugin = variants[name]
            with request(m, f"{name}-{rnd}", plugin):
                forward(m, inputs)
                for _ in range(args.forwards):
                    rows[name].append(time_forward(m, inputs, device))
    # Controls for what the interleaved loop may hide: Python's garbage collector, and the other variants
    # running in between (each variant here runs alone, in one request, collector off).
    controls: dict[str, dict[str, float]] = {}
    gc.collect()
    gc.disable()
    try:
        for name in names:
            m, plugin = variants[name]
            with request(m, f"{name}-alone", plugin):
                forward(m, inputs)
                alone = [time_forward(m, inputs, device) for _ in range(args.rounds * args.forwards)]
            controls[name] = {k: round(statistics.median(a[k] for a in alone), 3)
                              for k in ("enqueue_ms", "wall_ms", "gpu_ms")}
    finally:
        gc.enable()
    for name in names:
        controls[name]["wall_vs_dense"] = round(controls[name]["wall_ms"] / controls["dense"]["wall_ms"], 3)

    dma = dma_probe(model, inputs, device, 5)
    summary = {}
    for name, samples in rows.items():
        summary[name] = {k: round(statistics.median(s[k] for s in samples), 3) for k in ("enqueue_ms", "wall_ms",
                                                                                        "gpu_ms")}
        summary[name]["enqueue_over_wall"] = round(summary[name]["enqueue_ms"] / summary[name]["wall_ms"], 3)
        summary[name]["wall_vs_dense"] = round(summary[name]["wall_ms"] / max(1e-9, summary["dense"]["wall_ms"]), 3)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "workload": workload, "tokens": None, "r": r,
              "summary": summary, "samples": rows, "profiles": profiles, "traces": traces, "dma_probe": dma,
              "alone_gc_off": controls}
    (out_dir / "host_overhead.json").write_text(json.dumps(result, indent=1))
    print(f"{'variant':<22} {'enqueue ms':>10} {'wall ms':>9} {'gpu ms':>8} {'enq/wall':>8} {'x dense':>8}")
    for name, s in summary.items():
        print(f"{name:<22} {s['enqueue_ms']:>10.2f} {s['wall_ms']:>9.2f} {s['gpu_ms']:>8.2f} "
              f"{s['enqueue_over_wall']:>8.3f} {s['wall_vs_dense']:>8.3f}")
    print("each variant alone, collector off:", controls)
    print("dma probe:", dma)
    for name, tr in traces.items():
        print(f"--- trace {name}")
        for sid, st in tr.get("streams", {}).items():
            print(f"  stream {sid}: {st}")
        for api_name, st in list(tr.get("cuda_api_host_us", {}).items())[:8]:
            print(f"  {api_name}: {st}")
        if "error" in tr:
            print("  ", tr["error"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
