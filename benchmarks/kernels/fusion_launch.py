"""Host cost of one fusion-kernel launch: the compiled kernel's launcher (direct) vs Triton's ``kernel[grid](...)``.

For the Wan gated residual (``gated_residual``, with its float32 carry) and the modulation (``modulate``) at the
W17 stream shape ``[1, 3600, 1536]`` (bf16 stream, float32 table and timestep projection), the Q/K rotary kernel
(``rope_qk``, ``[1, 3600, 12, 128]``, float64 frequencies), and the gated residual at a tiny shape ``[1, 8, 1536]``
(where the GPU work is negligible and only the launch is left), one process:

* bitwise: the direct path's outputs equal the normal path's and the torch reference's;
* host microseconds per launch: ``perf_counter`` around batches of launches (5 batches x 200 = 1,000 launches,
  synchronised between batches, not inside), for the plan call alone (``launcher(...)``, outputs preallocated)
  and for the public function (allocates its outputs, looks its plan up);
* device microseconds per launch: 200 launches captured in one CUDA graph (on a side stream, as the
  ``cuda_graph`` plugin captures -- it also proves a direct launch is captured on the current torch stream) and
  replayed, timed with CUDA events;
* which path ran (``launch_path()``), and the compiled variants each plan holds.

The table is printed last; the full result goes to ``$OUT/fusion_launch.json`` (default ``./bench_out``). A part
that fails is reported and the rest still runs.

Command (H200, under a minute)::

    python benchmarks/kernels/fusion_launch.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from worldfoundry.bench.microbench import provenance, sync
from worldfoundry.core.fusion import adaln, rope
from worldfoundry.core.fusion.launch import direct_launch, launch_path

BATCH = 200
BATCHES = 5
#: (stream tokens, channels, heads) of the W17 cases, and the CPU smoke stand-in (``--smoke``).
W17 = (3600, 1536, 12)
SMOKE = (16, 64, 2)


def host_us(fn: Callable[[], Any], device: torch.device) -> float:
    """Median over batches of host microseconds per call (``perf_counter`` around ``BATCH`` calls)."""
    fn()
    sync(device)
    per_call = []
    for _ in range(BATCHES):
        t0 = time.perf_counter()
        for _ in range(BATCH):
            fn()
        per_call.append((time.perf_counter() - t0) / BATCH * 1e6)
        sync(device)
    return statistics.median(per_call)


def graph_us(fn: Callable[[], Any], device: torch.device) -> float | None:
    """Device microseconds per call: ``BATCH`` calls captured in one CUDA graph on a side stream, replayed."""
    if device.type != "cuda":
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm on the capture stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for _ in range(BATCH):
            fn()
    graph.replay()
    sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(BATCHES):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / BATCH)
    return statistics.median(samples)


def cases(device: torch.device, shape: tuple[int, int, int]) -> dict[str, dict[str, Any]]:
    """Per case: ``public`` (the function), ``plan`` (the launcher call on preallocated outputs), ``reference``."""
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens, c, heads = shape

    def randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    out: dict[str, dict[str, Any]] = {}
    table, emb = randn(6, c, dtype=torch.float32), randn(1, 6, c, dtype=torch.float32)
    for label, s in (("gated_residual W17", tokens), ("gated_residual tiny", 8)):
        x, y = randn(1, s, c), randn(1, s, c)
        o, o32 = adaln.gated_residual(x, y, table, emb, 2, with_float=True)
        plan = adaln._PLANS[next(k for k in adaln._PLANS if k[3] == x.shape and k[0] == adaln.MODE_GATE)]
        out[label] = {
            "public": lambda x=x, y=y: adaln.gated_residual(x, y, table, emb, 2, with_float=True),
            "plan": lambda x=x, y=y, o=o, o32=o32, plan=plan: plan((o, o32, x, y, table, emb), (2, 0)),
            "launcher": plan,
            "reference": lambda x=x, y=y: adaln.reference_gated_residual(x, y, table, emb, 2, with_float=True)}
    n = randn(1, tokens, c, dtype=torch.float32)
    out["modulate W17"] = {
        "public": lambda: adaln.modulate(n, table, emb, 0, 1, out_dtype=torch.bfloat16),
        "reference": lambda: adaln.reference_modulate(n, table, emb, 0, 1, out_dtype=torch.bfloat16)}
    d = c // heads
    q, k = randn(1, tokens, heads, d), randn(1, tokens, heads, d)
    cos, sin = randn(1, tokens, 1, d, dtype=torch.float64), randn(1, tokens, 1, d, dtype=torch.float64)
    out["rope_qk W17"] = {"public": lambda: rope.rope_qk(q, k, cos, sin),
                          "reference": lambda: rope.reference_rope_qk(q, k, cos, sin)}
    return out


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return a is None and b is None


def measure(label: str, case: dict[str, Any], device: torch.device) -> dict[str, Any]:
    r: dict[str, Any] = {}
    direct = case["public"]()
    with direct_launch(False):
        normal = case["public"]()
    r["bitwise_direct_vs_normal"] = equal(direct, normal)
    r["bitwise_vs_reference"] = equal(direct, case["reference"]())
    for fn_key in ("plan", "public"):
        if fn_key not in case:
            continue
        r[f"{fn_key}_host_us_direct"] = host_us(case[fn_key], device)
        with direct_launch(False):
            r[f"{fn_key}_host_us_normal"] = host_us(case[fn_key], device)
    r["device_us_graph_direct"] = graph_us(case["public"], device)
    with direct_launch(False):
        r["device_us_graph_normal"] = graph_us(case["public"], device)
    if "launcher" in case:
        r["compiled_variants"] = case["launcher"].variants()
    return r


def table(results: dict[str, Any]) -> str:
    lines = ["| case | plan host µs direct / normal | function host µs direct / normal | device µs (graph) | "
             "bitwise direct=normal=reference |", "|---|---|---|---|---|"]

    def f(v: Any) -> str:
        return f"{v:.2f}" if isinstance(v, float) else "-"

    for label, r in results["cases"].items():
        if "error" in r:
            lines.append(f"| {label} | error: {r['error']} | | | |")
            continue
        lines.append(f"| {label} | {f(r.get('plan_host_us_direct'))} / {f(r.get('plan_host_us_normal'))} | "
                     f"{f(r.get('public_host_us_direct'))} / {f(r.get('public_host_us_normal'))} | "
                     f"{f(r.get('device_us_graph_direct'))} | "
                     f"{r['bitwise_direct_vs_normal'] and r['bitwise_vs_reference']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="directory for fusion_launch.json")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and batches on the CPU (TRITON_INTERPRET=1)")
    args = p.parse_args()
    global BATCH, BATCHES
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.smoke:
        BATCH, BATCHES = 3, 2
    results: dict[str, Any] = {"provenance": provenance(device, extra_packages=("triton",)), "cases": {},
                               "shape_tokens_channels_heads": SMOKE if args.smoke else W17,
                               "launches_per_batch": BATCH, "batches": BATCHES}
    try:
        built = cases(device, SMOKE if args.smoke else W17)
    except Exception as exc:
        traceback.print_exc()
        built = {}
        results["error"] = f"{type(exc).__name__}: {exc}"
    for label, case in built.items():
        try:
            results["cases"][label] = measure(label, case, device)
        except Exception as exc:  # one failing part must not stop the others
            traceback.print_exc()
            results["cases"][label] = {"error": f"{type(exc).__name__}: {exc}"}
    results["launch_path"] = launch_path()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fusion_launch.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"launch path: {results['launch_path']}; wrote {out / 'fusion_launch.json'}")
    print(table(results))


if __name__ == "__main__":
    main()
