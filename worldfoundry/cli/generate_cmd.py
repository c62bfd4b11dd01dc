"""``worldfoundry generate``: one request through the native pipeline, written as MP4 (or latents)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from worldfoundry.cli.checks import (
    check_device,
    check_input_dir,
    check_input_file,
    check_output_file,
    usage_error,
)
from worldfoundry.errors import CommandLineError, WorldFoundryError

DEFAULT_RECIPE = "tiny-wan2.1-trained"
#: Output suffixes: an MP4 video, or the final latents and receipts (``torch.save``).
OUTPUT_SUFFIXES = (".mp4", ".pt")


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


def check_arguments(args: argparse.Namespace) -> tuple[dict[str, Any] | None, Any]:
    """Every argument mistake, found before the model is loaded. Returns ``(accelerations, image)``.

    Raises:
        CommandLineError: bad ``--accelerations`` JSON, unusable ``--device``, ``--out`` that is a directory or
            has another suffix than .mp4/.pt, MP4 output without imageio-ffmpeg, a missing ``--image``,
            ``--bundle`` or ``--checkpoint-dir``, or an image-to-video / bundle recipe without its input.
        UnknownRecipeError / RecipeError: the recipe cannot be read.
    """
    try:
        accelerations = json.loads(args.accelerations) if args.accelerations else None
    except json.JSONDecodeError as exc:
        raise CommandLineError("--accelerations", f"not valid JSON: {exc}") from None
    if accelerations is not None and not isinstance(accelerations, dict):
        raise CommandLineError("--accelerations", "must be a JSON object, e.g. '{\"easycache\": {}}'")
    check_device(args.device)
    check_output_file(args.out, suffixes=OUTPUT_SUFFIXES)
    if Path(args.out).suffix.lower() == ".mp4":
        from worldfoundry.base_models.diffusion_model.video_io import MP4_PACKAGE, mp4_unavailable_reason

        reason = mp4_unavailable_reason()
        if reason is not None:
            raise CommandLineError("--out", f"MP4 output needs {MP4_PACKAGE} ({reason}): pip install {MP4_PACKAGE}, "
                                            "or write latents with --out NAME.pt")
    check_input_file(args.image, "--image")
    check_input_dir(args.bundle, "--bundle", "MiniMax-H3 conditioning bundle directory")
    check_input_dir(args.checkpoint_dir, "--checkpoint-dir", "diffusers-format directory")
    from worldfoundry.core.model_loading.recipes import load_recipe

    recipe = load_recipe(args.recipe)
    if recipe.mode == "i2v" and args.image is None:
        raise CommandLineError("--image", f"recipe {recipe.name!r} is image-to-video; pass --image FIRST_FRAME.png")
    if recipe.mode == "session" and args.bundle is None:
        raise CommandLineError("--bundle", f"recipe {recipe.name!r} runs from a conditioning bundle; pass --bundle DIR")
    return accelerations, _read_image(args.image)


def _read_image(path: str | None) -> Any:
    if path is None:
        return None
    import imageio.v3 as iio

    try:
        image = iio.imread(path)
    except Exception as exc:  # any decoder failure: the file is not an image we can read
        raise CommandLineError("--image", f"{path}: cannot be read as an image ({type(exc).__name__}: {exc})") from None
    if image.ndim != 3 or image.shape[-1] not in (3, 4):
        raise CommandLineError("--image", f"{path}: expected an RGB or RGBA image, got shape {tuple(image.shape)}")
    return image[..., :3]


def run(args: argparse.Namespace) -> int:
    try:
        accelerations, image = check_arguments(args)
    except (WorldFoundryError, ValueError) as exc:
        return usage_error("generate", exc)
    import torch

    from worldfoundry.base_models.diffusion_model.pipeline import DiffusionRequest, NativeDiffusionPipeline
    from worldfoundry.core.model_loading.policy import RuntimePolicy

    out = Path(args.out)
    latent_only = out.suffix.lower() == ".pt"
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
        return usage_error("generate", exc)
    if latent_only:
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"latents": result.latents.cpu(), "receipts": result.receipts}, out)
    summary = {"request_id": result.request_id, "out": str(out), "latents_shape": list(result.latents.shape),
               "timings": {k: v for k, v in result.timings.items() if k not in ("steps_s", "host_steps_s")},
               "random_weights": result.provenance.get("random_weights"),
               "accelerations": (result.receipts.get("installed") or {}).get("names", [])}
    print(json.dumps(summary, indent=2))
    return 0
