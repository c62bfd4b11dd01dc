"""Where the first fused W17 forward's seconds go: Triton's compile stages, per thread, on a timeline.

One process per phase, each building the Wan2.1-1.3B architecture (random seeded weights, bf16), running eager
twice (CUDA, cuBLAS and cuDNN initialised), then installing ``wan_block_fusion`` and timing its first forward
with Triton's compile stages instrumented (every stage of ``CUDABackend.add_stages``, the whole
``JITFunction.compile``, the C-module builds of ``triton.runtime.build`` and the module loads of
``CompiledKernel._init_handles``; start and end per thread). Phases:

* ``cold``: an empty Triton cache directory (a machine's first run), ``kernel_compile: blocking``;
* ``cold1``: the same with one compile thread (``PRECOMPILE_WORKERS=1``): what the concurrency buys;
* ``cold-background``: an empty cache, ``kernel_compile: background`` (the default): the first call, the calls
  made while the kernels compile (the original forwards, beside the compiler threads), the seconds from the first
  call's start until the kernels are ready, and the first fused call;
* ``disk``: a new process on the cache ``cold`` filled (every later process on the machine), blocking.

Printed last: per phase the first-call seconds, the second call, the eager steady forward and the summed and
wall-clock (union over threads) time per stage; ``$OUT/first_call_cost.json`` holds the timelines.

Command (H200, about 2 minutes)::

    python benchmarks/profiling/first_call_cost.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PHASES = ("cold", "cold1", "cold-background", "disk")


def _intervals_union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


class Recorder:
    """Thread-aware start/end records of named sections (wrapped functions)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, float, float]] = []
        self.lock = threading.Lock()

    def wrap(self, label: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with self.lock:
                    self.events.append((label, threading.current_thread().name, t0, time.perf_counter()))

        return timed

    def summary(self, t0: float, t1: float) -> dict[str, Any]:
        stages: dict[str, dict[str, Any]] = {}
        for label, _, a, b in self.events:
            if b < t0 or a > t1:
                continue
            s = stages.setdefault(label, {"count": 0, "sum_s": 0.0, "spans": []})
            s["count"] += 1
            s["sum_s"] += b - a
            s["spans"].append((a, b))
        return {k: {"count": v["count"], "sum_s": round(v["sum_s"], 3),
                    "wall_s": round(_intervals_union(v["spans"]), 3)} for k, v in stages.items()}


def instrument(rec: Recorder) -> None:
    """Wrap Triton's compile stages (whatever this Triton version has)."""
    import triton.runtime.build as build
    from triton.backends.nvidia.compiler import CUDABackend
    import triton.compiler as tc
    from triton.compiler.compiler import CompiledKernel

    original_add = CUDABackend.add_stages

    def add_stages(self: Any, stages: dict[str, Any], options: Any, *rest: Any) -> Any:
        out = original_add(self, stages, options, *rest)
        for key in list(stages):
            stages[key] = rec.wrap(f"stage:{key}", stages[key])
        return out

    CUDABackend.add_stages = add_stages
    tc.compile = rec.wrap("jit.compile", tc.compile)  # JITFunction binds it lazily, from this package
    for name in ("compile_module_from_src", "compile_module_from_file", "_build"):
        if hasattr(build, name):
            setattr(build, name, rec.wrap(f"build:{name}", getattr(build, name)))
    CompiledKernel._init_handles = rec.wrap("load:_init_handles", CompiledKernel._init_handles)


def phase(name: str) -> dict[str, Any]:
    rec = Recorder()
    instrument(rec)
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
    from block_fusion import build, caller, inputs_for, registry, timed  # noqa: E402

    from worldfoundry.bench.microbench import WORKLOADS
    from worldfoundry.core.acceleration.installer import install_diffusion_accelerations

    from worldfoundry.core.fusion.compile_pool import set_default_compile_mode

    device = torch.device("cuda")
    set_default_compile_mode("background" if name == "cold-background" else "blocking")
    if name == "cold1":
        import worldfoundry.core.fusion.compile_pool as pool

        pool.compile_concurrently.__defaults__ = (1,)
    dense = build("wan", False, device)
    inputs = inputs_for(dense, "wan", WORKLOADS["W17"], device)
    eager = caller(dense, inputs)
    timed(eager, device)
    _, eager_s = timed(eager, device)
    model = build("wan", False, device)
    session = install_diffusion_accelerations(model, {"wan_block_fusion": {}}, registry=registry())
    call = caller(model, inputs, "first")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    record = session.execution_report()["plugins"]["wan_block_fusion"]["model"]["requests"]["first"]
    pending = []
    while session.handles("wan_block_fusion")["model"].kernels.pending() and len(pending) < 1000:
        pending.append(round(timed(caller(model, inputs, f"pending{len(pending)}"), device)[1], 4))
    session.wait_ready()
    t_ready = time.perf_counter()
    ready_s = t_ready - t0
    _, second_s = timed(caller(model, inputs, "second"), device)
    fused = session.execution_report()["plugins"]["wan_block_fusion"]["model"]["requests"]["second"]
    t_end = max(t1, t_ready)  # the first call, and the background compilation where it ran on
    timeline = [(label, thread, round(a - t0, 4), round(b - t0, 4)) for label, thread, a, b in rec.events
                if b >= t0 and a <= t_end]
    return {"phase": name, "first_call_s": round(t1 - t0, 3), "second_call_s": round(second_s, 4),
            "eager_steady_s": round(eager_s, 4), "stages": rec.summary(t0, t_end),
            "fallbacks": record["fallbacks"], "second_call_fallbacks": fused["fallbacks"],
            "calls_while_compiling_s": pending, "kernels_ready_after_s": round(ready_s, 3), "timeline": timeline,
            "threads": sorted({e[1] for e in timeline})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out")
    p.add_argument("--phase", choices=PHASES, help="(internal) run one phase in this process")
    args = p.parse_args()
    if args.phase:
        print("RESULT " + json.dumps(phase(args.phase)))
        return
    results = []
    cold_dir = tempfile.mkdtemp(prefix="triton_cold_")
    for name in PHASES:
        cache = cold_dir if name in ("cold", "disk") else tempfile.mkdtemp(prefix=f"triton_{name}_")
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        proc = subprocess.run([sys.executable, __file__, "--phase", name], env=env, capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            results.append({"phase": name, "error": proc.stderr[-3000:]})
            continue
        results.append(json.loads(line[-1][len("RESULT "):]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "first_call_cost.json").write_text(json.dumps(results, indent=1))
    for r in results:
        if "error" in r:
            print(f"{r['phase']}: ERROR {r['error']}")
            continue
        print(f"{r['phase']}: first call {r['first_call_s']} s, kernels ready after {r['kernels_ready_after_s']} s, "
              f"first fused call {r['second_call_s']} s (fallbacks {r['second_call_fallbacks']}), eager steady "
              f"{r['eager_steady_s']} s, calls while compiling {r['calls_while_compiling_s']}, "
              f"first-call fallbacks {r['fallbacks']}")
        for label, s in sorted(r["stages"].items(), key=lambda kv: -kv[1]["wall_s"]):
            print(f"   {label:34s} n={s['count']:3d} sum {s['sum_s']:7.3f} s  wall {s['wall_s']:7.3f} s")


if __name__ == "__main__":
    main()
