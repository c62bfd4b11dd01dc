#!/usr/bin/env python3
"""Where the host time of one ``selective_fp8`` FFN goes, at W17 shapes (the row the W17 bench finds host-bound).

At W17 on an H200 the ``fp8-ffn`` candidate's denoising steps took 85-155 ms against 79-80 ms for dense ones,
with the host busy through nearly all of each step and the interpreter probe not slow. This script splits the host
time of one diffusers ``FeedForward`` (1,536 -> 8,960 -> 1,536, GELU tanh, 3,600 tokens: one W17 block's FFN)
with the plugin installed, each piece timed alone (median over ``--reps`` host timings, the device drained before
each), and profiles the whole call with ``cProfile`` (top functions by own time):

* ``dense_ffn``: the FFN before installation (bf16 eager: two ``F.linear`` and the GELU);
* ``fp8_ffn``: the same FFN with ``selective_fp8`` installed on both Linears (the fused GELU producer, the guard,
  the receipts: what the bench's candidate runs);
* ``quantize``: the Triton rowwise FP8 activation quantization of the up projection's input;
* ``gelu_quantize``: the fused GELU + quantization of the down projection's input;
* ``scaled_mm``: ``torch._scaled_mm`` of the up projection with its bias;
* ``bf16_linear``: ``F.linear`` of the up projection (the anchor's host time);
* ``fp8_ffn_normal_launch``: ``fp8_ffn`` with every Triton launch through Triton's normal path
  (``direct_launch(False)``; the default launches a known specialization through its compiled launcher);
* ``fused_run``: the fused FFN's body alone (no call-time checks); ``gate``: the call-time checks alone
  (guards, fallback reasons, hooks); ``receipts``: the three receipt records of one fused call;
* ``kernels_chain``: the four launches of one fused FFN (quantize, ``_scaled_mm``, GELU + quantize,
  ``_scaled_mm``) without the plugin.

Each FFN row also gets ``queued_us``: the host time per call of ``--reps`` calls issued back to back without
draining the device in between (the regime of a forward, where the host runs ahead of the device).

It also gives each FFN's device time (CUDA events around ``--reps`` back-to-back calls, per call), so host and
device can be compared: a piece whose host time exceeds the device time of what it launches leaves the GPU idle.

    python benchmarks/kernels/fp8_host_profile.py --out "$OUT"        # H200, about 20 s
    python benchmarks/kernels/fp8_host_profile.py --smoke --out /tmp/f8   # CPU, tiny shapes (FP8 on the CPU's
                                                                          # torch._scaled_mm where the build has it)

Writes ``<out>/fp8_host_profile.json`` and ``<out>/fp8_host_profile.txt`` (the profile).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.models.attention import FeedForward
from worldfoundry_selective_fp8.ffn_fusion import FusedFFN, plan_ffn_fusion
from worldfoundry_selective_fp8.plugin import prepare

from worldfoundry.base_models.diffusion_model.optimizations.plugins import install_diffusion_accelerations
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.kernels.dispatch import (
    gelu_quantize_activations_rowwise_fp8,
    quantize_activations_rowwise_fp8,
)
from worldfoundry.core.acceleration.quantization.fp8_linear import scaled_mm_rowwise
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.fusion.launch import direct_launch, launch_path
from worldfoundry.core.model_loading.policy import RuntimePolicy

#: W17 (latent 5 x 40 x 72, patch 1 x 2 x 2): tokens, model width, FFN width.
SHAPES = {"full": (3600, 1536, 8960), "smoke": (64, 64, 128)}


class Block(nn.Module):
    """One block's FFN under the path ``ffn`` (the plugin's include patterns match ``ffn.net.*``)."""

    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.ffn = FeedForward(dim, inner_dim=inner, activation_fn="gelu-approximate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn(x)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_us(fn: Callable[[], Any], reps: int, device: torch.device) -> float:
    """Median microseconds the host spends in one call of ``fn``, the device drained before each."""
    samples = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    sync(device)
    return statistics.median(samples)


def queued_us(fn: Callable[[], Any], reps: int, device: torch.device) -> float:
    """Host microseconds per call of ``reps`` calls issued back to back (the device drained once, before)."""
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - start) * 1e6 / reps
    sync(device)
    return host


def device_us(fn: Callable[[], Any], reps: int, device: torch.device) -> float | None:
    """Microseconds of device time per call over ``reps`` back-to-back calls (``None`` off CUDA)."""
    if device.type != "cuda":
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sync(device)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def timings(fn: Callable[[], Any], reps: int, device: torch.device) -> dict[str, float | None]:
    return {"host_us": host_us(fn, reps, device), "queued_us": queued_us(fn, reps, device),
            "device_us": device_us(fn, reps, device)}


def install(block: Block, device: torch.device) -> tuple[Any, Any]:
    reg = AccelerationRegistry(discover=False)
    reg.register("selective_fp8", prepare)
    options = {"include": ["ffn.net.0.proj", "ffn.net.2"], "min_tokens": 1}
    session = install_diffusion_accelerations(block, {"selective_fp8": options}, RuntimePolicy(dtype="bf16"),
                                              registry=reg)
    handle = session.handles("selective_fp8")["model"]
    if device.type == "cpu" and handle.runtime.allow_device(device) is not None:
        session.uninstall()
        raise SystemExit("this CPU build of torch has no rowwise torch._scaled_mm: nothing to profile")
    return session, handle


def pieces(block: Block, x: torch.Tensor, handle: Any, plan: Any) -> dict[str, Callable[[], Any]]:
    up, down = block.ffn.net[0].proj, block.ffn.net[2]
    rows = x.reshape(-1, x.shape[-1])
    weight = handle.runtime.targets["ffn.net.0.proj"].weight
    q = quantize_activations_rowwise_fp8(rows)
    h = F.linear(rows, up.weight, up.bias)
    runtime = handle.runtime
    fused = FusedFFN(runtime, plan)
    ledger = runtime.ledger

    def normal_launch() -> Any:
        with direct_launch(False):
            return block(x)

    def receipts() -> None:
        ledger.executed("ffn.net.0.proj", "fp8_gemm")
        ledger.executed("ffn.net.2", "fp8_gemm")
        ledger.executed("ffn", "fp8_gelu_fused")

    def kernels_chain() -> Any:
        a = quantize_activations_rowwise_fp8(rows)
        hidden = scaled_mm_rowwise(a.q, a.scale, weight, up.bias)
        g = gelu_quantize_activations_rowwise_fp8(hidden, "tanh")
        return scaled_mm_rowwise(g.q, g.scale, runtime.targets["ffn.net.2"].weight, down.bias)

    return {"fp8_ffn": lambda: block(x),
            "fp8_ffn_normal_launch": normal_launch,
            "fused_run": lambda: fused.run(x),
            "gate": lambda: fused.skip_reason(x, (), {}),
            "receipts": receipts,
            "kernels_chain": kernels_chain,
            "quantize": lambda: quantize_activations_rowwise_fp8(rows),
            "gelu_quantize": lambda: gelu_quantize_activations_rowwise_fp8(h, "tanh"),
            "scaled_mm": lambda: scaled_mm_rowwise(q.q, q.scale, weight, up.bias),
            "bf16_linear": lambda: F.linear(rows, up.weight, up.bias),
            "bf16_down": lambda: F.linear(F.gelu(h, approximate="tanh"), down.weight, down.bias)}


def profile_text(fn: Callable[[], Any], calls: int, device: torch.device) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    sync(device)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
    return buf.getvalue()


def measure(args: argparse.Namespace, device: torch.device) -> tuple[dict[str, Any], str]:
    tokens, dim, inner = SHAPES["smoke" if args.smoke else "full"]
    torch.manual_seed(0)
    block = Block(dim, inner).to(device=device, dtype=torch.bfloat16).eval()
    x = torch.randn(1, tokens, dim, device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        dense = lambda: block(x)  # noqa: E731
        for _ in range(3):
            dense()
        result = {"dense_ffn": timings(dense, args.reps, device)}
    plan = plan_ffn_fusion(block, ["ffn.net.0.proj", "ffn.net.2"])[0][0]  # before the forward is replaced
    session, handle = install(block, device)
    try:
        with torch.inference_mode(), request_scope(RequestContext("fp8-host-profile")):
            timed = pieces(block, x, handle, plan)
            for fn in timed.values():  # compile, allocator, caches
                fn()
                fn()
            for name, fn in timed.items():
                result[name] = timings(fn, args.reps, device)
            text = profile_text(timed["fp8_ffn"], args.reps, device)
        report = session.execution_report()["plugins"]["selective_fp8"]["model"]
    finally:
        session.uninstall()
    return {"shape": {"tokens": tokens, "dim": dim, "inner": inner}, "pieces": result,
            "receipts": report.get("requests", {}).get("fp8-host-profile")}, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "./bench_out"))
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    data, text = measure(args, device)
    data.update(commit=os.environ.get("COMMIT"), torch=torch.__version__, reps=args.reps, launch_path=launch_path(),
                device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_host_profile.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    (out / "fp8_host_profile.txt").write_text(text)
    for name, row in data["pieces"].items():
        dev = row["device_us"]
        print(f"{name:22} host {row['host_us']:9.1f} us   queued {row['queued_us']:9.1f} us"
              + ("" if dev is None else f"   device {dev:9.1f} us"))
    print(text[:4000])


if __name__ == "__main__":
    main()
