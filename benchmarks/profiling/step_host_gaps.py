#!/usr/bin/env python3
"""Where a denoising step of the bench's W17 generation waits for the host, per candidate.

``worldfoundry bench`` times the 10-step CFG denoising loop of Wan2.1-1.3B (random weights, bf16, 17 frames
320x576). With a CUDA graph replaying each forward, a step is two replays (about 26 ms each fused) plus what the
host does between them; the step time above twice the replay is host time the GPU waited for. This script runs the
bench's own pipeline and request for each variant (dense, ``cuda_graph``, ``wan_block_fusion`` + ``cuda_graph``)
and reports, per step:

* ``step_ms``: the runner's step time (it synchronises at the end of every step);
* ``gpu_busy_ms``: the CUDA kernels' time inside the step (torch.profiler, one profiled generation), and
  ``idle_ms`` = step - busy: the time the GPU waited;
* the largest idle gaps with the host functions that ran during them (cProfile of the same steps, own time,
  top entries).

    python benchmarks/profiling/step_host_gaps.py --out $OUT          # H200, about a minute
    python benchmarks/profiling/step_host_gaps.py --smoke --out /tmp  # tiny model, CPU (the host side only)

Writes ``$OUT/step_host_gaps.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
from pathlib import Path
from typing import Any

import torch

from worldfoundry.base_models.diffusion_model.pipeline import NativeDiffusionPipeline
from worldfoundry.base_models.diffusion_model.request import DiffusionRequest
from worldfoundry.bench.microbench import provenance
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.core.fusion.compile_pool import set_default_compile_mode

VARIANTS: dict[str, dict[str, Any]] = {
    "dense": {},
    "cuda_graph": {"cuda_graph": {}},
    "block_fusion+cuda_graph": {"wan_block_fusion": {}, "cuda_graph": {}},
}


def request(args: argparse.Namespace, tag: str) -> DiffusionRequest:
    return DiffusionRequest(prompt="a red square moving left across a blue background",
                            negative_prompt="low quality, blurry", num_frames=args.frames, height=args.height,
                            width=args.width, num_inference_steps=args.steps, guidance_scale=5.0, flow_shift=3.0,
                            seed=42, request_id=tag, output_type="latent", progress=False)


def kernel_busy_ms(prof: Any) -> float:
    """Device time of the profiled CUDA kernels, merged where they overlap (ms)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy / 1e3


def top_host(profile: cProfile.Profile, n: int = 25) -> list[tuple[float, int, str]]:
    st = pstats.Stats(profile)
    rows = []
    for (file, line, name), (_, ncalls, tottime, _, _) in st.stats.items():  # type: ignore[attr-defined]
        rows.append((round(tottime * 1e3, 3), ncalls, f"{os.path.basename(file)}:{line}:{name}"))
    return sorted(rows, reverse=True)[:n]


def measure(pipe: NativeDiffusionPipeline, args: argparse.Namespace, name: str) -> dict[str, Any]:
    for i in range(2):  # warm-up: capture, compilation
        pipe.generate(request(args, f"{name}-warm{i}"))
    steps = [pipe.generate(request(args, f"{name}-t{i}")).timings["steps_s"] for i in range(args.repeats)]
    step_ms = [1e3 * statistics.median(col) for col in zip(*steps, strict=True)]
    out: dict[str, Any] = {"step_ms": step_ms, "step_median_ms": statistics.median(step_ms)}
    if torch.cuda.is_available():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            res = pipe.generate(request(args, f"{name}-prof"))
        busy = kernel_busy_ms(prof)
        out["profiled_loop_ms"] = 1e3 * res.timings["denoise_s"]
        out["gpu_busy_ms_per_step"] = busy / args.steps
        out["idle_ms_per_step"] = (1e3 * res.timings["denoise_s"] - busy) / args.steps
    profile = cProfile.Profile()
    profile.enable()
    res = pipe.generate(request(args, f"{name}-cprof"))
    profile.disable()
    out["cprofile_loop_ms"] = 1e3 * res.timings["denoise_s"]
    out["top_host"] = top_host(profile)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    set_default_compile_mode("blocking")  # kernels compile before a first fused call, never beside timing
    cuda = torch.cuda.is_available() and not args.smoke
    model = "wan2.1-t2v-1.3b" if cuda else "tiny-wan2.1"
    args.frames, args.height, args.width, args.steps = (17, 320, 576, 10) if cuda else (5, 32, 32, 4)
    policy = RuntimePolicy(device="cuda" if cuda else "cpu", dtype="bf16" if cuda else "fp32")
    pipe = NativeDiffusionPipeline.from_pretrained(model, policy=policy, random_weights=cuda)
    result: dict[str, Any] = {"provenance": provenance(torch.device("cuda" if cuda else "cpu")), "model": model,
                              "variants": {}}
    den = pipe.components.denoiser
    for name, spec in VARIANTS.items():
        session = den.install(spec, policy) if spec else None
        try:
            result["variants"][name] = measure(pipe, args, name)
        except Exception as exc:  # noqa: BLE001 - report and go on
            result["variants"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            if session is not None:
                session.uninstall()
    pipe.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_host_gaps.json").write_text(json.dumps(result, indent=1, default=str))
    print("| variant | step ms (median) | GPU busy ms/step | GPU idle ms/step | cProfile loop ms |")
    print("|---|---|---|---|---|")
    for name, r in result["variants"].items():
        if "error" in r:
            print(f"| {name} | {r['error']} | | | |")
            continue
        print(f"| {name} | {r['step_median_ms']:.2f} | {r.get('gpu_busy_ms_per_step', float('nan')):.2f} | "
              f"{r.get('idle_ms_per_step', float('nan')):.2f} | {r['cprofile_loop_ms']:.1f} |")
    for name, r in result["variants"].items():
        print(f"{name}: top host functions (own ms over {args.steps} steps, calls)")
        for ms, calls, fn in r.get("top_host", [])[:15]:
            print(f"    {ms:9.3f}  x{calls:<6d} {fn}")


if __name__ == "__main__":
    main()
