#!/usr/bin/env python3
"""Host time per attention call, layer by layer: where the microseconds of a routed call go.

At a tiny shape (B1 H12 S256 D128 bf16: microseconds of device work) a loop of calls is bound by the host, so
wall time per call is host cost. Rows: PyTorch SDPA; FlashAttention-3 through ``flash_attn_func`` (its autograd
function and ``torch.library`` custom op) and the compiled op called directly (the ``fa3`` provider's path);
the provider callable (layout adaptation); diffusers' ``dispatch_attention_fn`` (native backend) plain, with
``attention_policy``'s pass-through and nothing pending, and inside an :class:`SdpaInterception` routing the call to
the provider. Each row: median over rounds of the mean of ``--iters`` back-to-back calls (one synchronize per
sample), interleaved.

    python benchmarks/profiling/attention_host_cost.py            # on a Hopper GPU with fa3-fwd installed

Writes ``$OUT/attention_host_cost.json`` (default ``./bench_out``) and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models import attention_dispatch

from worldfoundry.bench.microbench import provenance
from worldfoundry.core.attention.provider_dispatch import AttentionRoute, SdpaInterception


def _per_call_us(fn: Callable[[], Any], iters: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def rows(shape: tuple[int, int, int, int]) -> dict[str, Callable[[], Any]]:
    from fa3_fwd_interface import flash_attn_func
    from worldfoundry_attention_fa3 import provider as fa3
    from worldfoundry_attention_policy import narrowing

    b, h, s, d = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    tok = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
    heads = [t.transpose(1, 2) for t in tok]
    prov = fa3.fa3_provider()
    route = AttentionRoute("self", prov)
    op = fa3._direct_op()
    passthrough = narrowing._pass_through(attention_dispatch.dispatch_attention_fn)

    def routed() -> Any:
        with SdpaInterception([route], None, lambda r, why: None):
            return attention_dispatch.dispatch_attention_fn(*tok)

    out: dict[str, Callable[[], Any]] = {
        "sdpa (B,H,S,D)": lambda: F.scaled_dot_product_attention(*heads),
        "fa3 flash_attn_func": lambda: flash_attn_func(*tok),
        "fa3 provider": lambda: prov.attention(*heads),
        "dispatcher (native, SDPA)": lambda: attention_dispatch.dispatch_attention_fn(*tok),
        "dispatcher via pass-through, nothing pending": lambda: passthrough(*tok),
        "dispatcher routed to fa3 (interception)": routed,
    }
    if op is not None:
        out["fa3 compiled op, direct"] = lambda: fa3._fwd_direct(op, *tok, None, False)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--tokens", type=int, default=256)
    args = p.parse_args()
    table = rows((1, 12, args.tokens, 128))
    samples: dict[str, list[float]] = {name: [] for name in table}
    with torch.no_grad():
        for fn in table.values():
            _per_call_us(fn, 20)
        for _ in range(args.rounds):
            for name, fn in table.items():
                samples[name].append(_per_call_us(fn, args.iters))
    result = {name: {"median_us": statistics.median(v), "min_us": min(v)} for name, v in samples.items()}
    out = Path(os.environ.get("OUT", "bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    record = {"provenance": provenance(torch.device("cuda"), extra_packages=("fa3-fwd",)), "tokens": args.tokens,
              "rows": result}
    (out / "attention_host_cost.json").write_text(json.dumps(record, indent=2))
    print(f"| call (B1 H12 S{args.tokens} D128 bf16) | host µs per call, median | min |\n|---|---|---|")
    for name, r in result.items():
        print(f"| {name} | {r['median_us']:.1f} | {r['min_us']:.1f} |")


if __name__ == "__main__":
    main()
