#!/usr/bin/env python3
"""Host cost of routing attention to a provider: the interception around diffusers' dispatcher only vs around the
whole attention module (``attention_policy``'s two paths), next to the plain model, in one process.

Variants (same seeded weights): ``eager``; ``policy`` (``attention_policy`` self-attention on ``--provider``, the
interception entered around ``dispatch_attention_fn`` only, its default); ``policy:module_wide`` (the same, with
the stock processor class forced onto the module-wide interception, the path every call took before). All three
must agree: the two policy variants bitwise, and with eager bitwise when the provider is the default SDPA. Timing:
interleaved rounds of ``microbench.interleaved``; the host time per forward is the device time on the CPU and the
enqueue-bound time on a launch-bound GPU workload.

    python benchmarks/profiling/attention_interception.py                          # CPU, tiny Wan, provider sdpa_math
    python benchmarks/profiling/attention_interception.py --device cuda --workload W17 --provider fa3

Writes ``$OUT/attention_interception.json`` (default ``./bench_out``) and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from diffusers.models.transformers import transformer_wan
from worldfoundry_attention_policy import narrowing

from worldfoundry import testing
from worldfoundry.bench.microbench import WAN_1_3B, WORKLOADS, bf16_wan, interleaved, provenance
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations


def build(device: torch.device, workload: str | None) -> tuple[torch.nn.Module, dict[str, Any]]:
    if workload is None:  # tiny Wan on the CPU: host-bound by construction
        return testing.tiny_wan(0, weight_scale=None), testing.wan_inputs(None, 0, frames=2, height=16, width=16)
    model = bf16_wan(WAN_1_3B, device)
    latent = WORKLOADS[workload]
    g = torch.Generator(device="cpu").manual_seed(0)
    inputs = {"hidden_states": torch.randn(1, 16, *latent, generator=g).to(device, torch.bfloat16),
              "timestep": torch.tensor([500], device=device),
              "encoder_hidden_states": torch.randn(1, 512, 4096, generator=g).to(device, torch.bfloat16)}
    return model, inputs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--workload", default=None, help="W17 or W81 (Wan2.1-1.3B); default: tiny Wan")
    p.add_argument("--provider", default="sdpa_math")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    device = torch.device(args.device)
    models = {name: build(device, args.workload) for name in ("eager", "policy", "policy:module_wide")}
    spec = {"attention_policy": {"self": {"backend": args.provider, "min_tokens": 0}}}
    sessions = {name: install_diffusion_accelerations(models[name][0], spec) for name in ("policy", "policy:module_wide")}

    def call(name: str):
        model, inputs = models[name]

        def run() -> torch.Tensor:
            forced = name == "policy:module_wide"
            if forced:
                narrowing._UNREACHABLE.add(transformer_wan.WanAttnProcessor)
            try:
                with torch.inference_mode(), request_scope(RequestContext(f"bench-{name}")):
                    return model(**inputs, return_dict=False)[0]
            finally:
                if forced:
                    narrowing._UNREACHABLE.discard(transformer_wan.WanAttnProcessor)

        return run

    calls = {name: call(name) for name in models}
    outs = {name: fn() for name, fn in calls.items()}
    timing = interleaved(calls, device, rounds=args.rounds, warmup=2, iters=args.iters, baseline="eager")
    paths = {name: s.execution_report()["plugins"]["attention_policy"]["model"]["interception"]
             for name, s in sessions.items()}
    result = {"provenance": provenance(device), "args": vars(args), "timing": timing, "interception": paths,
              "policy_paths_bitwise": bool(torch.equal(outs["policy"], outs["policy:module_wide"])),
              "policy_bitwise_vs_eager": bool(torch.equal(outs["policy"], outs["eager"]))}
    for s in sessions.values():
        s.uninstall()
    out = Path(os.environ.get("OUT", "bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_interception.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"interception paths: {paths}; policy paths bitwise: {result['policy_paths_bitwise']}; "
          f"policy vs eager bitwise: {result['policy_bitwise_vs_eager']}")
    print("| variant | median ms | vs eager (paired median) |\n|---|---|---|")
    for name, t in timing.items():
        print(f"| {name} | {t['median_ms']:.3f} | {t['speedup_vs_eager']:.3f} ({t['paired_speedup_median']:.3f}) |")


if __name__ == "__main__":
    main()
