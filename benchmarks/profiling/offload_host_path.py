#!/usr/bin/env python3
"""Host time the ``resident_blocks`` engine spends per streamed block, apart from the block's own work.

Installs ``resident_blocks`` (r = ``--r``, both host layouts) on the Wan2.1-T2V-1.3B architecture (random seeded
weights, bf16) and drives its engine directly inside a request: ``begin_forward``, ``run_block(i, call)`` for every
streamed block with a ``call`` that does nothing, ``end_forward``. The copies and events are the real ones; only
the block's kernels are missing, so the host time per ``run_block`` is what streaming adds on the host to every
streamed block of a real forward (slot choice, event waits, parameter swap, copy launch, receipts). Variants:

* ``full``: as installed;
* ``untimed_waits``: the compute stream's waits without the copy-wait timing events (what the receipts' copy-wait
  figure costs).

Medians over ``--trials`` forwards, microseconds per streamed block. Also a cProfile listing of one forward.

Usage:
    python benchmarks/profiling/offload_host_path.py --out "$OUT"            # H200, about 30 s
    python benchmarks/profiling/offload_host_path.py --smoke --out /tmp/ohp  # tiny model, emulated (CPU)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "offload"))

from resident_blocks import WAN_RECIPE, WAN_SMOKE_RECIPE, install, materialize, twin  # benchmark helpers


def _handle(model: torch.nn.Module) -> Any:
    from worldfoundry.core.acceleration.session import get_session

    return get_session(model).handles("resident_blocks")["model"]


def _streamed(handle: Any) -> list[tuple[int, str]]:
    engine = handle.engine
    return [(i, engine.block_paths[i]) for i in range(engine.num_blocks) if not engine.is_resident(i)]


def per_block_us(handle: Any, trials: int, device: torch.device) -> list[float]:
    """The plugin's own per-block path (``handle.run_block``: engine + batched execution counts)."""
    streamed = _streamed(handle)
    samples = []
    for _ in range(trials):
        handle.on_forward_start(None, ())
        t0 = time.perf_counter()
        for i, path in streamed:
            handle.run_block(i, path, lambda: None)
        samples.append((time.perf_counter() - t0) * 1e6 / max(len(streamed), 1))
        handle.on_forward_end(None, (), True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return samples


def profile_once(handle: Any) -> list[str]:
    streamed = _streamed(handle)
    prof = cProfile.Profile()
    handle.on_forward_start(None, ())
    prof.enable()
    for i, path in streamed:
        handle.run_block(i, path, lambda: None)
    prof.disable()
    handle.on_forward_end(None, (), True)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
    return [line for line in text.getvalue().splitlines() if line.strip()][:32]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--r", type=int, default=9)
    p.add_argument("--trials", type=int, default=40)
    args = p.parse_args(argv)
    from diffusers import WanTransformer3DModel

    from worldfoundry.core.acceleration.guard import get_request_guard
    from worldfoundry.core.offload.block_probe import resolve_dit_source

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    source = resolve_dit_source(WAN_SMOKE_RECIPE if device.type == "cpu" else WAN_RECIPE)
    config = dict(source.config)
    base = materialize(WanTransformer3DModel, config, device, dtype, seed=0)
    r = min(args.r, len(base.blocks) - 1)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "r": r, "num_blocks": len(base.blocks), "layouts": {}}
    for contiguous in (False, True):
        model = twin(base, WanTransformer3DModel, config)
        install(model, r, contiguous)
        handle = _handle(model)
        guard = get_request_guard(model)
        guard.begin_request(f"probe-{contiguous}")
        try:
            per_block_us(handle, 3, device)  # warm-up: slot buffers, views, slot parameters
            full = per_block_us(handle, args.trials, device)
            backend = handle.engine.backend
            timed = backend.timed_wait
            backend.timed_wait = backend.wait
            try:
                untimed = per_block_us(handle, args.trials, device)
            finally:
                del backend.timed_wait
                assert backend.timed_wait == timed
            profile = profile_once(handle)
        finally:
            guard.end_request(f"probe-{contiguous}")
        layout = "contiguous" if contiguous else "per_tensor"
        result["layouts"][layout] = {
            "full_us_per_block": round(statistics.median(full), 2),
            "untimed_waits_us_per_block": round(statistics.median(untimed), 2),
            "full_samples_us": [round(x, 2) for x in full], "profile": profile,
        }
        print(f"{layout:11s} r={r}: {statistics.median(full):7.1f} us per streamed block "
              f"({statistics.median(untimed):7.1f} without copy-wait timing)")
        del model, handle
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "offload_host_path.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
