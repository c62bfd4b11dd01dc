"""``worldfoundry calibrate``: write calibration artifacts bound to a model's weights.

Subcommands:

* ``svdquant`` — run the calibration requests (own prompts, seeds 11/12) through a recipe's pipeline, record
  the input statistics of the selected Linears and write the ``worldfoundry-svdquant-v1`` artifact
  (``--out NAME.json`` + ``NAME.safetensors``, or ``--out NAME.pt``).

  ``--keep-dense N`` keeps the N units (blocks, or Linears) whose quantization alone changes the calibration
  requests' result most dense (``svdquant_sensitivity``); ``--dense-from ARTIFACT`` leaves out the Linears
  another artifact's selection kept dense; ``--sequential`` observes each block's Linears again with the blocks
  before it quantized (``svdquant_sequential``).

Example::

    worldfoundry calibrate svdquant --recipe tiny-wan2.1-trained --include 'blocks.*.ffn.0' 'blocks.*.ffn.2' \\
        --rank 32 --frames 17 --out svdquant.json --save-references refs/
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from worldfoundry.errors import InvalidRequestError, WorldFoundryError

DEFAULT_RECIPE = "tiny-wan2.1-trained"
DEFAULT_INCLUDE = ("blocks.*.ffn.0", "blocks.*.ffn.2")


def group_size_arg(text: str) -> int:
    """``--group-size`` value: ``64``, ``128``, or ``channel`` / ``0`` (per output channel, stored as 0).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    value = text.strip().lower()
    if value in ("channel", "0"):
        return 0
    if value in ("64", "128"):
        return int(value)
    raise argparse.ArgumentTypeError(f"expected 64, 128 or channel, got {text!r}")


def add_svdquant_arguments(p: argparse.ArgumentParser) -> None:
    """The ``svdquant`` calibration options (shared with ``benchmarks/inference/calibrate_plugins.py``)."""
    p.add_argument("--recipe", "--model", dest="recipe", default=DEFAULT_RECIPE, help="recipe name or YAML path")
    p.add_argument("--assets", "--checkpoint-dir", dest="checkpoint_dir", default=None,
                   help="local diffusers-format checkpoint directory")
    p.add_argument("--random-weights", action="store_true", help="seeded random weights (speed/plumbing only)")
    p.add_argument("--include", nargs="+", default=list(DEFAULT_INCLUDE),
                   help="Linear patterns (original Wan names blocks.*.ffn.0 / ffn.2 accepted)")
    p.add_argument("--method", choices=["svdquant", "rtn"], default="svdquant",
                   help="svdquant (smoothing + low-rank + INT4 residual) or rtn (plain INT4 round to nearest)")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--group-size", type=group_size_arg, default=64, metavar="{64,128,channel}",
                   help="input features per INT4 scale, or 'channel' (0): one scale per output channel for the "
                        "whole K (the fastest W4A8 GEMM; K a multiple of 128)")
    p.add_argument("--alpha", type=float, default=0.5, help="smoothing migration strength in [0, 1]")
    p.add_argument("--unsmoothed", nargs="+", default=[], metavar="PATTERN",
                   help="included Linears decomposed without smoothing (e.g. 'blocks.*.ffn.2': with FP8 "
                        "activations their quantizer then skips the per-channel 1/lambda)")
    p.add_argument("--svd", choices=["full", "randomized"], default="full")
    p.add_argument("--rounding", choices=["nearest", "gptq", "gptq-ordered"], default="nearest",
                   help="INT4 residual rounded to nearest, or with GPTQ's error compensation under the calibration "
                        "inputs' second moments (K^2 floats per Linear collected; same artifact format); "
                        "gptq-ordered: columns in decreasing order of their inputs' mean square, with scales "
                        "searched per group")
    p.add_argument("--lowrank-fit", choices=["svd", "whitened"], default="svd",
                   help="low-rank pair from the SVD of the smoothed weight, or the pair that least changes the "
                        "calibration outputs (whitened by the inputs' second moments)")
    p.add_argument("--refine", type=int, default=0, metavar="N",
                   help="alternate N times between refitting the low-rank pair to what the INT4 codes left and "
                        "requantizing; the decomposition with the least calibration-output error is kept")
    p.add_argument("--keep-dense", type=int, default=0, metavar="N",
                   help="mixed precision from the calibration requests alone: quantize each unit (see "
                        "--sensitivity-unit) alone, rerun the requests, and keep the N units that change the result "
                        "most dense (left out of the artifact); scores recorded under calibration.sensitivity")
    p.add_argument("--sensitivity-unit", choices=["block", "linear"], default="block",
                   help="what --keep-dense ranks and keeps dense: a block's selected Linears together, or each Linear")
    p.add_argument("--sensitivity-metric", choices=["latent_rel_l2", "min_ssim", "psnr_db"], default="latent_rel_l2",
                   help="score --keep-dense ranks units by: the final latent's relative L2 to the dense run, or the "
                        "worst frame's SSIM / the PSNR of the decoded frames (worst over the calibration requests)")
    p.add_argument("--dense-from", default=None, metavar="ARTIFACT",
                   help="leave out the Linears that ARTIFACT's --keep-dense selection kept dense (e.g. an RTN baseline "
                        "on exactly the Linears a sensitivity selection quantized)")
    p.add_argument("--sequential", action="store_true",
                   help="observe each block's Linears again with the blocks before it quantized (one more run of "
                        "the calibration requests per block), so smoothing and rounding fit the inputs they will "
                        "get; after --keep-dense's selection; recorded under calibration.sequential")
    p.add_argument("--prompts", nargs="+", default=None, help="calibration prompts (one per seed, cycled)")
    p.add_argument("--seeds", nargs="+", type=int, default=[11, 12])
    p.add_argument("--frames", type=int, default=17)
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--guidance", type=float, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (recipe/policy default when omitted)")
    p.add_argument("--save-references", default=None, metavar="DIR",
                   help="write calibration_<seed>.pt (latents and frames) per request")
    p.add_argument("--out", required=True, help="artifact path: NAME.json (+ NAME.safetensors) or NAME.pt")


def run_svdquant(args: argparse.Namespace) -> dict[str, Any]:
    """Calibrate and write the artifact; returns a JSON summary.

    Raises:
        WorldFoundryError: bad recipe, include, seeds or decomposition settings.
    """
    from worldfoundry.base_models.diffusion_model.pipeline import NativeDiffusionPipeline
    from worldfoundry.base_models.diffusion_model.svdquant_calibration import (
        CALIBRATION_PROMPTS,
        calibrate_pipeline,
    )
    from worldfoundry.core.acceleration.quantization.svdquant_artifact import save_svdquant_artifact
    from worldfoundry.core.model_loading.policy import RuntimePolicy

    from worldfoundry.base_models.diffusion_model.svdquant_sensitivity import check_keep_dense
    from worldfoundry.core.acceleration.quantization.lowrank_fit import MAX_REFINE

    if not 0 <= args.refine <= MAX_REFINE:  # refused before the calibration requests run
        raise InvalidRequestError(f"--refine must be an integer in [0, {MAX_REFINE}], got {args.refine}")
    check_keep_dense(args.keep_dense)
    if args.keep_dense and args.dense_from is not None:
        raise InvalidRequestError("give --keep-dense N or --dense-from ARTIFACT, not both")
    policy_kwargs: dict[str, Any] = {"device": args.device}
    if args.dtype is not None:
        policy_kwargs["dtype"] = args.dtype
    policy = RuntimePolicy(**policy_kwargs)
    with NativeDiffusionPipeline.from_pretrained(args.recipe, policy=policy, checkpoint_dir=args.checkpoint_dir,
                                                 random_weights=args.random_weights) as pipe:
        manifest, tensors = calibrate_pipeline(
            pipe, include=args.include, prompts=args.prompts or CALIBRATION_PROMPTS, seeds=args.seeds,
            frames=args.frames, height=args.height, width=args.width, steps=args.steps, guidance=args.guidance,
            references=args.save_references, method=args.method, rank=args.rank, group_size=args.group_size,
            alpha=args.alpha, svd=args.svd, unsmoothed=args.unsmoothed, rounding=args.rounding,
            lowrank_fit=args.lowrank_fit, refine=args.refine, keep_dense=args.keep_dense,
            sensitivity_unit=args.sensitivity_unit, sensitivity_metric=args.sensitivity_metric,
            dense_from=args.dense_from, sequential=args.sequential)
    manifest["calibration"]["recipe"] = manifest["calibration"].get("recipe") or str(args.recipe)
    manifest["calibration"]["random_weights"] = bool(args.random_weights)
    out = save_svdquant_artifact(manifest, tensors, args.out)
    errors = {p: e["diagnostics"]["weight_rel_l2"] for p, e in manifest["linears"].items()}
    sensitivity = manifest["calibration"].get("sensitivity") or {}
    return {"artifact": str(out), "method": manifest["method"], "rounding": args.rounding,
            "lowrank_fit": args.lowrank_fit, "refine": args.refine, "sequential": bool(args.sequential),
            "rank": manifest["rank"],
            "group_size": manifest["group_size"], "linears": len(errors),
            "weight_rel_l2_max": max(errors.values()), "weight_rel_l2": errors,
            "references": args.save_references, "kept_dense": sensitivity.get("kept_dense_linears", []),
            "sensitivity": {u: s.get(sensitivity.get("metric")) for u, s in (sensitivity.get("scores") or {}).items()}}


def _run(args: argparse.Namespace) -> int:
    if args.calibration is None:
        print("worldfoundry calibrate: name a calibration (svdquant)", file=sys.stderr)
        return 2
    try:
        summary = run_svdquant(args)
    except WorldFoundryError as exc:
        print(f"worldfoundry calibrate {args.calibration}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        grouping = "per channel" if summary["group_size"] == 0 else f"group {summary['group_size']}"
        print(f"artifact: {summary['artifact']}  ({summary['method']}, rank {summary['rank']}, {grouping}, "
              f"{summary['linears']} Linears, max weight rel L2 "
              f"{summary['weight_rel_l2_max']:.4f})")
        if summary["kept_dense"]:
            print(f"kept dense: {' '.join(summary['kept_dense'])}")
    return 0


def add_parser(subparsers: Any) -> None:
    """Add ``calibrate`` with its ``svdquant`` subcommand."""
    parser = subparsers.add_parser("calibrate", help="write calibration artifacts (svdquant)",
                                   description="Write calibration artifacts bound to a model's weights.")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    sub = parser.add_subparsers(dest="calibration", metavar="CALIBRATION")
    svd = sub.add_parser("svdquant", help="SVDQuant low-rank + INT4 residual artifact",
                         description="Calibrate SVDQuant Linears of a recipe (seeds 11/12; evaluation uses 42/43).")
    add_svdquant_arguments(svd)
    parser.set_defaults(func=_run, calibration=None)


__all__ = ["DEFAULT_INCLUDE", "DEFAULT_RECIPE", "add_parser", "add_svdquant_arguments", "run_svdquant"]
