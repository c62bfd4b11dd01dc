"""CPU experiment: how much of the trained fixture's W4A8 error comes from the INT8 activations, and would
per-token scales over groups of input channels recover it?

The plugin's activation quantizer gives each token one INT8 scale over its whole row. A producer epilogue that
quantizes its output tile by tile would give each token one scale per tile of columns (the down projection's
input groups). This runs ``worldfoundry bench --quality-only`` on the trained tiny model (seeds 42/43, the draft
budget) with one artifact (``--artifact``, default: calibrate per channel, rank 64, GPTQ, unsmoothed into
``--out``), each time with the torch reference of the W4A8 Linear replaced in-process by a variant:

* ``per-token`` -- the shipped numerics (one scale per token), as a check that the replacement changes nothing;
* ``group-G`` -- one scale per token and group of ``G`` input channels (``G`` 256, 128, 64;
  ``w4a8_linear_reference(act_group=G)``, integer-exact per group);
* ``unquantized`` -- the INT4 residual and low-rank branch with float32 activations (the bound);
* ``rotated-B`` (``--rotated``; ``B`` 64, 128, 256) -- one INT8 scale per token of the smoothed input rotated by a
  block-diagonal Hadamard matrix (blocks of ``B`` channels: an outlier channel spreads over its block), the codes
  dequantized and rotated back in float32 before the residual GEMM: the activation error of a per-token path in
  a rotated basis, with this artifact's weights (an artifact calibrated on rotated weights would also change the
  weights' error). Fake quantization, so it is compared with ``fake-per-token`` and ``fake-group-128`` (the same
  float32 emulation without rotation): rounding order alone moves this fixture's worst SSIM by up to 0.007.

Numerics only (the torch references): no kernel computes the grouped variants yet. Prints one row per variant and writes
``act_groups.json`` under ``--out``.

    python benchmarks/inference/svdquant_act_groups.py --out /tmp/act-groups       # about 2 minutes
    python benchmarks/inference/svdquant_act_groups.py --out /tmp/act-groups --rotated
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from worldfoundry.core.acceleration.kernels import svdquant_dispatch
from worldfoundry.core.acceleration.quantization.int4_packing import dequantize_int4_groupwise
from worldfoundry.core.acceleration.quantization.int8_activation import quantize_rows_int8_grouped
from worldfoundry.core.acceleration.quantization.svdquant_numerics import (
    SVDQuantWeight,
    lowrank_reference,
    w4a8_linear_reference,
)

CALIBRATE = ["--rank", "64", "--group-size", "channel", "--unsmoothed", "blocks.*", "--rounding", "gptq"]
WORKLOAD = {"prompt": "a red square moving left", "negative_prompt": "", "frames": 9, "height": 32, "width": 32,
            "steps": 8, "guidance": 5.0, "shift": 3.0, "seeds": [42, 43]}
BUDGET = {"latent_rel_l2": 0.12, "psnr_db": 27.0, "min_ssim": 0.89}
VARIANTS = ("per-token", "group-256", "group-128", "group-64", "unquantized")
ROTATED = ("fake-per-token", "fake-group-128", "rotated-64", "rotated-128", "rotated-256")


def hadamard(n: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of order ``n`` (a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


def _blockwise(x: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K]`` times the block-diagonal matrix of ``h`` blocks (``None``: ``x``)."""
    if h is None:
        return x
    b = h.shape[0]
    return (x.reshape(x.shape[0], -1, b) @ h).reshape(x.shape)


def fake_quantized_reference(block: int | None, group: int | None = None):  # noqa: ANN201 - a drop-in
    """The W4A8 reference Linear with the activation error emulated in float32: the smoothed rows rotated by a
    block-diagonal Hadamard matrix of ``block`` channels (``None``: not rotated), INT8 codes per token (or per
    token and ``group``), dequantized and rotated back, then the residual GEMM, low-rank branch and bias."""

    def linear(x: torch.Tensor, weight: SVDQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        k = weight.in_features
        x2d = x.reshape(-1, k)
        xs = x2d.float() if weight.inv_smooth is None else x2d.float() * weight.inv_smooth.float()
        h = hadamard(min(block, k)) if block else None
        g = min(group or k, k)
        q, s = quantize_rows_int8_grouped(_blockwise(xs, h), None, g)
        deq = (q.float().reshape(-1, k // g, g) * s[..., None]).reshape(-1, k)
        deq = _blockwise(deq, None if h is None else h.t())
        out = deq @ dequantize_int4_groupwise(weight.qweight, weight.scales, weight.group_size).float().t()
        low = lowrank_reference(x2d, weight)
        out = out if low is None else out + low
        out = out if bias is None else out + bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], weight.out_features)

    return linear


def grouped_reference(group: int | None):  # noqa: ANN201 - a drop-in for w4a8_linear_reference
    """The W4A8 reference Linear with activation scales per token and group of ``group`` channels
    (``w4a8_linear_reference(act_group=...)``), or (``None``) with float32 activations."""

    def linear(x: torch.Tensor, weight: SVDQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if group is not None:
            return w4a8_linear_reference(x, weight, bias, act_group=min(group, weight.in_features))
        x2d = x.reshape(-1, weight.in_features)
        xs = x2d.float() if weight.inv_smooth is None else x2d.float() * weight.inv_smooth.float()
        out = xs @ dequantize_int4_groupwise(weight.qweight, weight.scales, weight.group_size).t()
        low = lowrank_reference(x2d, weight)
        out = out if low is None else out + low
        out = out if bias is None else out + bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], weight.out_features)

    return linear


def run_variant(name: str, artifact: Path, out: Path) -> dict:
    from worldfoundry.bench.harness import BenchConfig, run_bench

    if name == "per-token":
        svdquant_dispatch.w4a8_linear_reference = w4a8_linear_reference
    elif name in ROTATED:
        block = int(name.split("-")[1]) if name.startswith("rotated-") else None
        svdquant_dispatch.w4a8_linear_reference = fake_quantized_reference(block, 128 if "group" in name else None)
    else:
        group = int(name.split("-")[1]) if name.startswith("group-") else None
        svdquant_dispatch.w4a8_linear_reference = grouped_reference(group)
    cands = {"model": "tiny-wan2.1-trained", "workload": WORKLOAD, "quality_budget": BUDGET, "timing": {"rounds": 3},
             "candidates": [{"name": name, "accelerations": {"svdquant": {"artifact": str(artifact),
                                                                          "backend": "reference"}}}]}
    path = out / f"{name}.candidates.json"
    path.write_text(json.dumps(cands))
    try:
        results = run_bench(BenchConfig(model="tiny-wan2.1-trained", candidates=str(path), out=str(out / name),
                                        quality_only=True, progress=False))
    finally:
        svdquant_dispatch.w4a8_linear_reference = w4a8_linear_reference
    worst = results["candidates"][0]["quality"]["worst"]
    return {k: worst[k] for k in ("latent_rel_l2", "psnr_db", "min_ssim")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="./bench_out/act-groups")
    parser.add_argument("--artifact", default=None, help="an svdquant artifact of the trained tiny model")
    parser.add_argument("--rotated", action="store_true", help="the block-Hadamard rows and their float32 "
                        "controls instead of the grouped ones")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    artifact = Path(args.artifact) if args.artifact else out / "ch-r64-gptq.json"
    if not artifact.exists():
        cmd = ["worldfoundry", "calibrate", "svdquant", "--recipe", "tiny-wan2.1-trained", "--include",
               "blocks.*.ffn.0", "blocks.*.ffn.2", *CALIBRATE, "--out", str(artifact)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"calibration failed: {done.stderr.strip()[-400:]}", file=sys.stderr)
            return 1
    rows = {name: run_variant(name, artifact, out) for name in (ROTATED if args.rotated else VARIANTS)}
    print(f"{'activations':18s} {'rel L2':>8s} {'PSNR dB':>8s} {'min SSIM':>9s}  within draft budget")
    for name, q in rows.items():
        ok = q["latent_rel_l2"] <= BUDGET["latent_rel_l2"] and q["psnr_db"] >= BUDGET["psnr_db"] and \
            q["min_ssim"] >= BUDGET["min_ssim"]
        print(f"{name:18s} {q['latent_rel_l2']:8.4f} {q['psnr_db']:8.2f} {q['min_ssim']:9.4f}  {ok}")
    summary = {"artifact": str(artifact), "budget": BUDGET, "rows": rows}
    (out / ("rotated.json" if args.rotated else "act_groups.json")).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
