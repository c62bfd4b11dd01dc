"""``worldfoundry generate``: one request through the native pipeline, written as MP4 (or latents)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DEFAULT_RECIPE = "tiny-wan2.1-trained"


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("generate", help="generate a video with a recipe (tiny recipes run offline on CPU)")
    p.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"recipe name or YAML path (default {DEFAULT_RECIPE})")
    p.add_argument("--prompt", default="", help="text prompt")
    p.add_argument("--negative-prompt", default=None)
    p.add_argument("--frames", type=int, default=None, help="number of frames (4k+1 for Wan VAEs)")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="denoising steps")
    p.add_argument("--guidance", type=float, default=None, help="CFG scale")
    p.add_argument("--shift", type=float, default=None, help="flow shift")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--fps", type=int, default=16)
    p.add_argument("--out", required=True, help="output .mp4 (or .pt for latents)")
    p.add_argument("--accelerations", default=None, help='JSON mapping, e.g. \'{"easycache": {"threshold": 0.05}}\'')
    p.add_argument("--checkpoint-dir", default=None, help="local diffusers-format directory")
    p.add_argument("--random-weights", action="store_true", help="real recipe with seeded random weights")
    p.add_argument("--image", default=None, help="first frame for image-to-video recipes (PNG/JPEG)")
    p.add_argument("--bundle", default=None, help="MiniMax-H3 conditioning bundle directory")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from worldfoundry.base_models.diffusion_model.pipeline import DiffusionRequest, NativeDiffusionPipeline
    from worldfoundry.core.model_loading.policy import RuntimePolicy
    from worldfoundry.errors import WorldFoundryError

    try:
        accelerations = json.loads(args.accelerations) if args.accelerations else None
    except json.JSONDecodeError as exc:
        print(f"--accelerations: not valid JSON: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    latent_only = out.suffix == ".pt"
    image = None
    if args.image:
        import imageio.v3 as iio

        image = iio.imread(args.image)[..., :3]
    try:
        policy = RuntimePolicy(device=args.device, dtype=args.dtype, options={"progress": not args.no_progress})
        with NativeDiffusionPipeline.from_pretrained(args.recipe, policy=policy, accelerations=accelerations,
                                                     checkpoint_dir=args.checkpoint_dir,
                                                     random_weights=args.random_weights) as pipe:
            request = DiffusionRequest(
                prompt=args.prompt, negative_prompt=args.negative_prompt, num_frames=args.frames,
                height=args.height, width=args.width, num_inference_steps=args.steps, guidance_scale=args.guidance,
                flow_shift=args.shift, seed=args.seed, output_type="latent" if latent_only else "mp4",
                output_path=None if latent_only else str(out), fps=args.fps, image=image, bundle=args.bundle,
            )
            result = pipe.generate(request)
    except WorldFoundryError as exc:
        print(f"worldfoundry generate: {exc}", file=sys.stderr)
        return 2
    if latent_only:
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"latents": result.latents.cpu(), "receipts": result.receipts}, out)
    summary = {"request_id": result.request_id, "out": str(out), "latents_shape": list(result.latents.shape),
               "timings": {k: v for k, v in result.timings.items() if k != "steps_s"},
               "random_weights": result.provenance.get("random_weights"),
               "accelerations": (result.receipts.get("installed") or {}).get("names", [])}
    print(json.dumps(summary, indent=2))
    return 0
