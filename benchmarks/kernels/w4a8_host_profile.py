"""H200: where the host time of one W4A8 Linear goes (the latency a synchronised call carries before its kernels).

``w4a8_linear.py`` reports ``host_issue_us``: the host's time in one ``svdquant_linear`` call. On a slow host it
was 523 us for the up projection against 117 us for bf16 ``F.linear``, and the synchronised ratio fell from 1.47x
(the GPU's time, a CUDA graph of one call) to 1.01x. This script splits that time: each piece of the call is timed
alone (:func:`cuda_timing.host_issue_us`: median over ``--reps`` host timings, the GPU drained before each) and
the whole call is profiled with ``cProfile`` (top functions by own time). Pieces, at the W81 FFN up projection (M 32,760, 1536 -> 8960,
``--rank``, unsmoothed):

* ``whole_call``: :func:`svdquant_linear` with ``backend="w4a8"``;
* ``quantizer_launch``: the fused quantizer + low-rank down kernel (outputs allocated inside);
* ``gemm_call``: :func:`gluon_w4a8_persistent_gemm` with precomputed codes;
* ``gemm_checks``: its operand checks; ``descriptors``: the five TMA descriptors; ``empty``: the output allocation;
* ``bf16_linear``: ``F.linear`` with bias (the anchor's host time).

Writes ``<out>/w4a8_host_profile.json`` and ``<out>/w4a8_host_profile.txt`` (the profile).

    python benchmarks/kernels/w4a8_host_profile.py --out "$OUT"     # about 20 s on an H200
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from cuda_timing import host_issue_us

from worldfoundry.core.acceleration.kernels.int8_quant_lowrank import triton_quantize_rows_int8_lowrank
from worldfoundry.core.acceleration.kernels.svdquant_dispatch import svdquant_linear
from worldfoundry.core.acceleration.kernels.w4a8_gluon_gemm import tma_descriptor
from worldfoundry.core.acceleration.kernels.w4a8_gluon_persistent import (
    DEFAULT_PERSISTENT_TILE,
    check_persistent_operands,
    gluon_w4a8_persistent_gemm,
)
from worldfoundry.core.acceleration.quantization.int4_packing import quantize_int4_groupwise
from worldfoundry.core.acceleration.quantization.svdquant_numerics import SVDQuantWeight

M_TOKENS, K, N = 32760, 1536, 8960


def operands(rank: int) -> dict[str, Any]:
    """The up projection's operands (Gaussian; speed only)."""
    g = torch.Generator(device="cuda").manual_seed(K)
    x = torch.randn(M_TOKENS, K, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, device="cuda", generator=g) / K**0.5).to(torch.bfloat16)
    bias = torch.randn(N, device="cuda", generator=g).to(torch.bfloat16)
    down = (torch.randn(rank, K, device="cuda", generator=g) / K**0.5).to(torch.bfloat16)
    up = (torch.randn(N, rank, device="cuda", generator=g) / rank**0.5).to(torch.bfloat16)
    packed, scales = quantize_int4_groupwise(w, 0)
    weight = SVDQuantWeight(packed, scales, 0, lora_down=down, lora_up=up)
    q, s, t = triton_quantize_rows_int8_lowrank(x, None, down)
    return {"x": x, "w": w, "bias": bias, "weight": weight, "q": q, "s": s, "t": t}


def pieces(ops: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """The timed pieces of one call."""
    x, weight, bias, q, s, t = (ops[k] for k in ("x", "weight", "bias", "q", "s", "t"))
    tile = DEFAULT_PERSISTENT_TILE
    chunk = tile.lowrank_chunk(weight.rank)
    out = torch.empty((M_TOKENS, N), dtype=torch.bfloat16, device="cuda")

    def descriptors() -> None:
        tma_descriptor(q, [tile.block_t, tile.block_k])
        tma_descriptor(weight.qweight, [tile.block_w, tile.block_k // 2])
        tma_descriptor(out, [tile.block_t, tile.block_w])
        tma_descriptor(t, [tile.block_t, chunk])
        tma_descriptor(weight.lora_up, [tile.block_w, chunk])

    return {"whole_call": lambda: svdquant_linear(x, weight, bias, backend="w4a8"),
            "quantizer_launch": lambda: triton_quantize_rows_int8_lowrank(x, None, weight.lora_down),
            "gemm_call": lambda: gluon_w4a8_persistent_gemm(q, s, weight, t, bias),
            "gemm_checks": lambda: check_persistent_operands(q, s, weight, t, bias, tile),
            "descriptors": descriptors,
            "empty": lambda: torch.empty((M_TOKENS, N), dtype=torch.bfloat16, device="cuda"),
            "bf16_linear": lambda: F.linear(x, ops["w"], bias)}


def profile_text(fn: Callable[[], Any], calls: int) -> str:
    """``cProfile`` of ``calls`` calls of ``fn``: the top 40 functions by own time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
    return buf.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "./bench_out"))
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    ops = operands(args.rank)
    timed = pieces(ops)
    for fn in timed.values():  # compile, allocator, caches
        fn()
        fn()
    result = {name: round(host_issue_us(fn, args.reps), 1) for name, fn in timed.items()}
    text = profile_text(timed["whole_call"], args.reps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"commit": os.environ.get("COMMIT"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "rank": args.rank, "reps": args.reps, "host_us": result}
    (out / "w4a8_host_profile.json").write_text(json.dumps(meta, indent=2) + "\n")
    (out / "w4a8_host_profile.txt").write_text(text)
    print(json.dumps(result, indent=1))
    print(text[:6000])


if __name__ == "__main__":
    main()
