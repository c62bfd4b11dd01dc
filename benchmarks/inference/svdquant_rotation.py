"""CPU experiment: one INT8 scale per token in a block-Hadamard basis, with the weights decomposed in that basis.

A per-token W4A8 path keeps the per-token GEMM's speed on Hopper; groups of 128 bring the trained fixture within
the draft budget but cost the GEMM its speed (``docs/performance.md``). Rotating each token's input by a
block-diagonal Hadamard matrix ``R`` (blocks of ``B`` channels) spreads an outlier channel over its block before
the token's one scale is taken, and ``x @ W.T = (x @ R) @ (W @ R).T`` since ``R`` is orthogonal. This experiment:

* calibrates the fixture (``worldfoundry calibrate svdquant``, per channel, rank 64, GPTQ, unsmoothed: the best
  artifact so far) with the decomposition run on ``W @ R`` and the GPTQ second moments of the rotated inputs,
  ``R.T @ (X.T X) @ R`` (the manifest still binds the model's own weights);
* evaluates it with ``worldfoundry bench --quality-only`` (seeds 42/43, the draft budget), the W4A8 reference
  Linear called on ``x @ R`` (integer-exact per-token INT8 of the rotated rows, the residual GEMM and the
  low-rank branch in the rotated basis);
* with the same calibration unrotated, the per-token and group-128 rows as controls.

Numerics only (torch references in-process): no kernel computes the rotated path. Prints one row per variant and
writes ``rotation.json`` under ``--out``.

    python benchmarks/inference/svdquant_rotation.py --out /tmp/rotation      # about 2 minutes
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch
from svdquant_act_groups import BUDGET, CALIBRATE, WORKLOAD, hadamard

from worldfoundry.base_models.diffusion_model import svdquant_calibration
from worldfoundry.cli.main import main as cli_main
from worldfoundry.core.acceleration.kernels import svdquant_dispatch
from worldfoundry.core.acceleration.quantization.svdquant_numerics import SVDQuantWeight, w4a8_linear_reference

VARIANTS = ("per-token", "group-128", "rotated-64", "rotated-128")


@functools.lru_cache(maxsize=16)
def rotation(k: int, block: int) -> torch.Tensor:
    """The ``[k, k]`` block-diagonal matrix of orthonormal Hadamard blocks of ``min(block, k)`` channels."""
    b = min(block, k)
    return torch.block_diag(*[hadamard(b)] * (k // b))


def rotated_decompose(block: int):  # noqa: ANN201 - a drop-in for svdquant_numerics.decompose
    """``decompose`` of ``W @ R`` with the second moments of the rotated inputs (unsmoothed only)."""
    real = svdquant_calibration.decompose

    def decompose(weight: torch.Tensor, **kwargs: Any) -> SVDQuantWeight:
        if kwargs.get("act_absmax") is not None:
            raise SystemExit("the rotated experiment takes unsmoothed Linears only (--unsmoothed 'blocks.*')")
        r = rotation(weight.shape[1], block).to(weight.device)
        if kwargs.get("hessian") is not None:
            kwargs["hessian"] = r.t() @ kwargs["hessian"].float() @ r
        return real((weight.float() @ r).to(weight.dtype), **kwargs)

    return decompose


def rotated_linear(block: int):  # noqa: ANN201 - a drop-in for w4a8_linear_reference
    """The W4A8 reference Linear on ``x @ R`` (the weight was decomposed in the rotated basis)."""

    def linear(x: torch.Tensor, weight: SVDQuantWeight, bias: torch.Tensor | None = None,
               **kwargs: Any) -> torch.Tensor:
        r = rotation(weight.in_features, block).to(x.device)
        return w4a8_linear_reference(x.float() @ r, weight, bias, **kwargs).to(x.dtype)

    return linear


def calibrate(out: Path, block: int | None) -> Path:
    """The artifact (calibrated once per basis and kept under ``out``)."""
    path = out / (f"ch-r64-gptq-rot{block}.json" if block else "ch-r64-gptq.json")
    if path.exists():
        return path
    args = ["calibrate", "svdquant", "--recipe", "tiny-wan2.1-trained", "--include", "blocks.*.ffn.0",
            "blocks.*.ffn.2", *CALIBRATE, "--out", str(path)]
    real = svdquant_calibration.decompose
    if block:
        svdquant_calibration.decompose = rotated_decompose(block)
    try:
        if cli_main(args) != 0:
            raise SystemExit(f"calibration failed: worldfoundry {' '.join(args)}")
    finally:
        svdquant_calibration.decompose = real
    return path


def evaluate(name: str, artifact: Path, out: Path) -> dict[str, float]:
    """Worst-seed quality of the artifact with the variant's W4A8 reference Linear."""
    from worldfoundry.bench.harness import BenchConfig, run_bench

    if name.startswith("rotated-"):
        svdquant_dispatch.w4a8_linear_reference = rotated_linear(int(name.split("-")[1]))
    elif name == "group-128":
        svdquant_dispatch.w4a8_linear_reference = functools.partial(w4a8_linear_reference, act_group=128)
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
    parser.add_argument("--out", default="./bench_out/rotation")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name in args.variants:
        block = int(name.split("-")[1]) if name.startswith("rotated-") else None
        rows[name] = evaluate(name, calibrate(out, block), out)
    print(f"{'activations':14s} {'rel L2':>8s} {'PSNR dB':>8s} {'min SSIM':>9s}  within draft budget")
    for name, q in rows.items():
        ok = q["latent_rel_l2"] <= BUDGET["latent_rel_l2"] and q["psnr_db"] >= BUDGET["psnr_db"] and \
            q["min_ssim"] >= BUDGET["min_ssim"]
        print(f"{name:14s} {q['latent_rel_l2']:8.4f} {q['psnr_db']:8.2f} {q['min_ssim']:9.4f}  {ok}")
    (out / "rotation.json").write_text(json.dumps({"calibrate": CALIBRATE, "budget": BUDGET, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
