"""Calibrate plugin artifacts. One subcommand per calibration; each writes an artifact bound to its weights.

Subcommands (``CALIBRATIONS``; add one with :func:`register_calibration`):

* ``lightvae_fp8`` — per-convolution input ``amax`` of the LightVAE student encoder over calibration clips;
  writes the ``worldfoundry-lightvae-fp8-v1`` artifact used by ``load_wan_video_codec(...,
  fp8_calibration=...)`` / the runtime option ``vae_fp8_calibration``.

Calibration uses its own clips (seeds/prompts 11 and 12); evaluations use 42 and 43.

Inputs are data: checkpoints and clips are read with ``torch.load(weights_only=True)`` after a stat check, and a
refused input (corrupt, poisoned with pickled code, NaN weights, a special file) ends the command with one
``error:`` line and exit status 2.

Usage::

    python benchmarks/inference/calibrate_plugins.py lightvae_fp8 --checkpoint lightvaew2_1.pth \
        --reference calibration_11.pt calibration_12.pt --include 'encoder.*' --frames 17 --out lightvae-fp8.pt
    python benchmarks/inference/calibrate_plugins.py lightvae_fp8 --smoke --out /tmp/lightvae-fp8.pt   # CPU
    python benchmarks/inference/calibrate_plugins.py svdquant --include 'blocks.*.ffn.0' 'blocks.*.ffn.2' \
        --rank 32 --frames 17 --out /tmp/calibration-new/svdquant.pt --save-references /tmp/calibration-new/rgb
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightvae_common import default_device, load_or_make_clips, write_json


@dataclass(frozen=True)
class Calibration:
    """One subcommand: ``add_arguments(parser)`` and ``run(args) -> summary dict``."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], dict[str, Any]]


CALIBRATIONS: dict[str, Calibration] = {}


def register_calibration(entry: Calibration) -> None:
    """Add a subcommand (a name may be registered once)."""
    if entry.name in CALIBRATIONS:
        raise ValueError(f"calibration {entry.name!r} is already registered")
    CALIBRATIONS[entry.name] = entry


# --------------------------------------------------------------------------------------------- lightvae_fp8


def _lightvae_fp8_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", help="LightVAE student checkpoint (.pth/.safetensors/diffusers dir)")
    p.add_argument("--reference", nargs="*", help="calibration clips (.pt); synthetic clips of --seeds when omitted")
    p.add_argument("--seeds", nargs="*", type=int, default=[11, 12], help="seeds of synthetic calibration clips")
    p.add_argument("--include", nargs="+", default=["encoder.*"], help="fnmatch patterns over encoder conv paths")
    p.add_argument("--frames", type=int, default=17, help="frames per clip (1 + 4k)")
    p.add_argument("--height", type=int, default=480, help="synthetic clip height")
    p.add_argument("--width", type=int, default=832, help="synthetic clip width")
    p.add_argument("--device", default=default_device())
    p.add_argument("--smoke", action="store_true",
                   help="CPU check: random student weights written to a temporary checkpoint, 5 frames 32x32")
    p.add_argument("--out", required=True, help="artifact path (.pt)")


def _run_lightvae_fp8(args: argparse.Namespace) -> dict[str, Any]:
    from worldfoundry.base_models.diffusion_model.codec import (
        load_wan_video_codec,
        random_wan_video_codec,
    )
    from worldfoundry.base_models.diffusion_model.codec_checkpoints import (
        to_original_state_dict,
    )
    from worldfoundry.base_models.diffusion_model.codec_fp8 import (
        calibrate_encoder_fp8,
        save_artifact,
    )

    checkpoint = args.checkpoint
    scratch = None
    if args.smoke:
        args.frames, args.height, args.width = 5, 32, 32
        if checkpoint is None:
            scratch = tempfile.TemporaryDirectory(prefix="lightvae-smoke-")
            checkpoint = str(Path(scratch.name) / "student-random.pth")
            torch.save(to_original_state_dict(random_wan_video_codec("lightvae-wan21", seed=2).module.state_dict()),
                       checkpoint)
    if checkpoint is None:
        raise SystemExit("lightvae_fp8: --checkpoint is required (or --smoke for a random-weight check)")
    try:
        codec = load_wan_video_codec(checkpoint, "lightvae-wan21", args.device, torch.float32)
        clips = load_or_make_clips(args.reference, args.seeds, args.frames, args.height, args.width)
        device = torch.device(args.device)
        artifact = calibrate_encoder_fp8(codec, [(n, c.to(device)) for n, c in clips], include=args.include,
                                         frames=args.frames)
        out = save_artifact(artifact, args.out)
    finally:
        if scratch is not None:
            scratch.cleanup()
    convs = artifact["convolutions"]
    return {
        "artifact": str(out),
        "checkpoint": artifact["checkpoint"],
        "sources": artifact["calibration"]["sources"],
        "convolutions": {p: {"amax": float(e["amax"]), "calls": e["calls"]} for p, e in convs.items()},
    }


register_calibration(Calibration(
    "lightvae_fp8", "FP8 activation scales of the LightVAE student encoder convolutions",
    _lightvae_fp8_arguments, _run_lightvae_fp8,
))


# --------------------------------------------------------------------------------------------- svdquant


def _svdquant_arguments(p: argparse.ArgumentParser) -> None:
    from worldfoundry.cli.calibrate_cmd import add_svdquant_arguments

    add_svdquant_arguments(p)


def _run_svdquant(args: argparse.Namespace) -> dict[str, Any]:
    from worldfoundry.cli.calibrate_cmd import run_svdquant

    return run_svdquant(args)


register_calibration(Calibration(
    "svdquant", "SVDQuant low-rank + INT4 residual Linears of a recipe's DiT (worldfoundry-svdquant-v1)",
    _svdquant_arguments, _run_svdquant,
))


# --------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Calibrate worldfoundry plugin artifacts")
    sub = parser.add_subparsers(dest="calibration", required=True)
    for cal in CALIBRATIONS.values():
        cal.add_arguments(sub.add_parser(cal.name, help=cal.help, description=cal.help))
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    summary = CALIBRATIONS[args.calibration].run(args)
    artifact = Path(summary["artifact"])
    name = f"{artifact.stem}.summary.json" if artifact.suffix == ".json" else f"{artifact.stem}.json"
    report = write_json(artifact.parent, name, summary)  # never over a .json artifact manifest
    print(f"artifact: {summary['artifact']}  (summary {report})")
    for path, entry in summary.get("convolutions", {}).items():
        print(f"  {path:<40} amax {entry['amax']:.4g}  calls {entry['calls']}")
    return summary


def cli(argv: list[str] | None = None) -> int:
    """:func:`main` as a command: a typed error (bad checkpoint, clip or artifact) is one line, not a traceback.

    Returns:
        0 on success, 2 when an input was refused.
    """
    from worldfoundry.errors import WorldFoundryError

    try:
        return 0 if main(argv) else 1
    except WorldFoundryError as exc:
        logging.getLogger(__name__).debug("calibration failed", exc_info=True)
        print(f"calibrate_plugins.py: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli())
