"""The ``glu`` kernel (``h * silu(g)`` of SANA-Video's GLU feed-forward) vs eager, one process: bitwise and time.

Cases (random bf16 data, ``x * 4``; the halves are ``torch.chunk(x, 2, dim=1)``):

* ``sana480p``: ``x`` is ``[21, 11200, 30, 52]`` channels-last (the default SANA-Video feed-forward at latent
  21x60x104: 32,760 tokens, 2 x 5,600 hidden channels (mlp_ratio 2.5)), as ``conv_depth`` outputs it;
* ``sana480p_cfg``: the same with 42 frames (a batch of two: classifier-free guidance);
* ``contiguous``: ``[21, 11200, 30, 52]`` contiguous (another layout of the same tensor);
* ``fp16`` / ``fp32``: the ``sana480p`` layout at a quarter of the frames in float16 / float32;
* ``int64``: ``[2, 11200, 400, 400]`` channels-last (3.6e9 elements; each half holds 1.8e9 but reaches past
  ``2**31``: the 64-bit path).

Per case: bitwise equality with eager ``h * F.silu(g)``, equal strides, and interleaved paired timing (>= 5
rounds) of eager vs the kernel. Prints a table last; JSON to ``$OUT/glu.json`` (default ``./bench_out``).

Command (H200, about a minute)::

    python benchmarks/kernels/glu.py            # --smoke: tiny shapes on the CPU (TRITON_INTERPRET=1; bitwise
                                                # is a CUDA claim: the interpreter's exp is numpy's)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from worldfoundry.bench.microbench import interleaved, provenance, sync
from worldfoundry.core.fusion.glu import silu_gate

CASES: dict[str, tuple[tuple[int, int, int, int], torch.dtype, bool]] = {
    "sana480p": ((21, 11200, 30, 52), torch.bfloat16, True),
    "sana480p_cfg": ((42, 11200, 30, 52), torch.bfloat16, True),
    "contiguous": ((21, 11200, 30, 52), torch.bfloat16, False),
    "fp16": ((6, 11200, 30, 52), torch.float16, True),
    "fp32": ((6, 11200, 30, 52), torch.float32, True),
    "int64": ((2, 11200, 400, 400), torch.bfloat16, True),
}
SMOKE = {"sana480p": ((2, 24, 3, 5), torch.bfloat16, True), "contiguous": ((2, 24, 3, 5), torch.bfloat16, False),
         "fp32": ((2, 24, 3, 5), torch.float32, True)}


def run_case(shape: tuple[int, ...], dtype: torch.dtype, channels_last: bool, device: torch.device,
             rounds: int) -> dict[str, Any]:
    """Bitwise check and paired timing of one case."""
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(shape, device=device, generator=g) * 4).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    h, gate = torch.chunk(x, 2, dim=1)
    with torch.inference_mode():
        eager = h * F.silu(gate)
        fused = silu_gate(h, gate)
        sync(device)
        entry: dict[str, Any] = {
            "shape": list(shape), "dtype": str(dtype), "channels_last": channels_last,
            "bitwise_vs_eager": bool(torch.equal(fused, eager)), "strides_equal": fused.stride() == eager.stride(),
            "differing_elements": int((fused != eager).sum()), "elements": fused.numel()}
        del eager, fused
        calls = {"eager": lambda: h * F.silu(gate), "glu_kernel": lambda: silu_gate(h, gate)}
        iters = 1 if x.numel() > 2**31 else 5
        entry["timing"] = interleaved(calls, device, rounds=rounds, warmup=2, iters=iters, baseline="eager")
    del x, h, gate
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return entry


def table(results: dict[str, Any]) -> str:
    lines = ["| case | bitwise | strides | eager ms | glu ms | speedup (paired median) |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        if not isinstance(r, dict) or "timing" not in r:
            continue
        t = r["timing"]
        lines.append(f"| {name} | {r['bitwise_vs_eager']} | {r['strides_equal']} | {t['eager']['median_ms']:.3f} | "
                     f"{t['glu_kernel']['median_ms']:.3f} | {t['glu_kernel']['speedup_vs_eager']:.2f} "
                     f"({t['glu_kernel']['paired_speedup_median']:.2f}) |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="directory for glu.json")
    p.add_argument("--rounds", type=int, default=7, help="interleaved paired rounds (>= 5)")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated subset")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    args = p.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    cases = SMOKE if args.smoke else CASES
    results: dict[str, Any] = {"provenance": provenance(device, extra_packages=("triton",))}
    for name in [c.strip() for c in args.cases.split(",") if c.strip() in cases]:
        try:
            results[name] = run_case(*cases[name], device, 2 if args.smoke else args.rounds)
        except Exception as exc:  # one failing case must not stop the others
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "glu.json").write_text(json.dumps(results, indent=1, default=str))
    for name, r in results.items():
        if isinstance(r, dict) and "error" in r:
            print(f"{name}: {r['error']}")
        elif isinstance(r, dict) and "bitwise_vs_eager" in r:
            print(f"{name}: bitwise={r['bitwise_vs_eager']} differing={r['differing_elements']}/{r['elements']}")
    print(f"wrote {out / 'glu.json'}")
    print(table(results))


if __name__ == "__main__":
    main()
