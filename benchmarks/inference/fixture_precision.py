"""How far plain bfloat16 inference moves the shipped trained tiny model from its float32 output.

The quality budget of the bench (latent rel L2 <= 0.03, PSNR >= 33 dB, min SSIM >= 0.98 against the dense model in
the run's own dtype) is a budget for near-lossless accelerations. This script measures the error of the most common
precision change of all, float32 -> bfloat16 for the whole pipeline, on the default workload of
``recipes/candidates/default.json`` (9 frames 32x32, 8 steps, CFG 5, seeds 42/43), with the bench's own metrics:
the scale against which the 4-bit numbers of ``svdquant`` on this fixture are read (``docs/performance.md``).

    python benchmarks/inference/fixture_precision.py [--out bench_out/fixture_precision.json]
    python benchmarks/inference/fixture_precision.py --seeds 51 52 53 54 55 56 57 58 61 62 63 64 65 66 67 68
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from worldfoundry.base_models.diffusion_model.pipeline import DiffusionRequest, NativeDiffusionPipeline
from worldfoundry.bench.metrics import quality
from worldfoundry.core.model_loading.policy import RuntimePolicy

RECIPE = "tiny-wan2.1-trained"
SEEDS = (42, 43)


def generate(dtype: torch.dtype, seeds: tuple[int, ...] = SEEDS) -> dict[int, object]:
    pipe = NativeDiffusionPipeline.from_pretrained(RECIPE, policy=RuntimePolicy(device="cpu", dtype=dtype))
    with pipe:
        return {seed: pipe.generate(DiffusionRequest(
            prompt="a red square moving left", negative_prompt="", num_frames=9, height=32, width=32,
            num_inference_steps=8, guidance_scale=5.0, flow_shift=3.0, seed=seed, request_id=f"{dtype}-{seed}",
            output_type="np", progress=False)) for seed in seeds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench_out/fixture_precision.json"))
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS),
                   help="evaluation seeds (default: the bench's 42 43)")
    args = p.parse_args(argv)
    seeds = tuple(args.seeds)
    ref, low = generate(torch.float32, seeds), generate(torch.bfloat16, seeds)
    rows = {}
    for seed in seeds:
        q = quality(low[seed].latents.float(), ref[seed].latents.float(), low[seed].frames, ref[seed].frames)
        rows[str(seed)] = {k: q[k] for k in ("latent_rel_l2", "psnr_db", "min_ssim", "mean_ssim")}
        print(f"seed {seed}: bf16 vs fp32 latent rel L2 {q['latent_rel_l2']:.4f}, PSNR {q['psnr_db']:.2f} dB, "
              f"min SSIM {q['min_ssim']:.4f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"recipe": RECIPE, "workload": "default.json", "seeds": list(seeds),
                                    "per_seed": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
