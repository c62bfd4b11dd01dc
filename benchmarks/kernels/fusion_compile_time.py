#!/usr/bin/env python3
"""Compile time of the fused Wan block's heaviest Triton kernels, offline for sm_90 (no GPU needed).

A first fused call waits for its kernels to compile (concurrently, ``core/fusion/launch.py:precompile``). This
compiles, with an empty Triton cache and for an H100/H200 target (``GPUTarget("cuda", 90, 64)``), the launch
plans the W17 forward of Wan2.1-1.3B uses with the default chains -- the LayerNorm with the modulation (``norm1`` /
``norm3``), the LayerNorm with ``norm2``'s affine, and the Q/K RMSNorms with the rotary (``qk_norm``) -- each
alone, then all three concurrently on a thread pool as ``precompile`` does; and the ``qk_norm`` kernel with other
column chunks (``--qk-chunks``) for comparison. The plans are the ones the plugin builds (constexprs, integer
arguments, pointer dtypes), with the GPU's settings (hardware ``rsqrt``, no software rounding).

    python benchmarks/kernels/fusion_compile_time.py --out $OUT     # any machine with Triton; a few seconds each

Seconds depend on the machine's CPU; compare rows of one run. Writes ``$OUT/fusion_compile_time.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from worldfoundry.core.fusion import layer_norm, qk_norm_rope
from worldfoundry.core.fusion.indexing import INT32_MAX

#: W17: 3,600 tokens of 1,536 channels; 12 heads of 128.
TOKENS, CHANNELS, HEADS = 3600, 1536, 12
_TYPES = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.float64: "*fp64"}


def _plans(qk_chunks: int) -> dict[str, tuple[Any, tuple[torch.Tensor, ...]]]:
    """name -> (launch plan, its pointer tensors), built as the plugin builds them (CPU tensors, nothing runs)."""
    x = torch.empty(1, TOKENS, CHANNELS, dtype=torch.bfloat16)
    table = torch.empty(6, CHANNELS)
    emb = torch.empty(1, 6, CHANNELS)
    w32 = torch.empty(CHANNELS)
    plans = {
        "layer_norm+modulate": (layer_norm._plan(("m",), layer_norm.MODE_MODULATE, x, torch.bfloat16, False, False,
                                                 table, emb, 1e-6, False, layer_norm.MEAN_FMA, INT32_MAX),
                                (x, x, x, x, x, table, emb)),
        "layer_norm+affine": (layer_norm._plan(("p",), layer_norm.MODE_PLAIN, x, torch.bfloat16, True, True, None,
                                               None, 1e-6, False, layer_norm.MEAN_FMA, INT32_MAX),
                              (x, x, x, w32, w32, x, x)),
    }
    q = torch.empty(1, TOKENS, CHANNELS, dtype=torch.bfloat16)
    w = torch.empty(CHANNELS, dtype=torch.bfloat16)
    cos = torch.empty(1, TOKENS, 1, CHANNELS // HEADS, dtype=torch.float64)
    original = qk_norm_rope.BLOCK_C
    try:
        for chunk in sorted({original, qk_chunks}):
            qk_norm_rope.BLOCK_C = chunk
            name = "qk_norm" if chunk == original else f"qk_norm ({chunk}-channel chunks)"
            plans[name] = (qk_norm_rope._plan(q, q, w, w, 1e-6, 1e-6, HEADS, cos, cos, INT32_MAX),
                           (q, q, w, w, q, q, cos, cos))
    finally:
        qk_norm_rope.BLOCK_C = original
    return plans


def _job(plan: Any, pointers: tuple[torch.Tensor, ...]) -> Any:
    """A ``triton.compile`` call for ``plan`` on an sm_90 target, with the GPU's settings."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = plan._fn
    kwargs = dict(plan._kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion") if k in kwargs}
    kwargs.update(APPROX_RSQRT=True, SOFTWARE_ROUNDING=False)
    signature: dict[str, str] = {}
    values = [*(_TYPES[t.dtype] for t in pointers), *plan._fixed]
    for name, value in zip(fn.arg_names, values, strict=False):
        signature[name] = value if isinstance(value, str) else ("fp32" if isinstance(value, float) else "i32")
    for name in fn.arg_names:  # the per-call scalars after the plan's integers (modulation rows): int32
        signature.setdefault(name, "constexpr" if name in kwargs else "i32")
    source = ASTSource(fn=fn, signature=signature, constexprs=kwargs)
    return lambda: triton.compile(source, target=GPUTarget("cuda", 90, 64), options=options)


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--qk-chunks", type=int, default=512, help="another column chunk of the qk_norm kernel to time")
    args = p.parse_args()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton_compile_time_")
    plans = _plans(args.qk_chunks)
    jobs = {name: _job(plan, pointers) for name, (plan, pointers) in plans.items()}
    result: dict[str, Any] = {"target": "cuda sm_90", "shape": [1, TOKENS, CHANNELS], "seconds": {}}
    result["first_compile_in_process_s"] = _timed(jobs.pop("layer_norm+affine"))  # Triton's one-time set-up too
    for name, job in jobs.items():
        result["seconds"][name] = _timed(job)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton_compile_time_")
    default = [n for n in plans if "-channel" not in n]
    concurrent = [_job(*plans[n]) for n in default]
    with ThreadPoolExecutor(max_workers=8) as pool:
        start = time.perf_counter()
        list(pool.map(lambda job: job(), concurrent))
        result["default_chains_concurrently_s"] = time.perf_counter() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fusion_compile_time.json").write_text(json.dumps(result, indent=1))
    print("| kernel (W17 plan, sm_90) | compile s |\n|---|---|")
    print(f"| layer_norm+affine (first compile in the process) | {result['first_compile_in_process_s']:.2f} |")
    for name, seconds in result["seconds"].items():
        print(f"| {name} | {seconds:.2f} |")
    print(f"| the three default-chain kernels above, concurrently (8 threads) | "
          f"{result['default_chains_concurrently_s']:.2f} |")


if __name__ == "__main__":
    main()
