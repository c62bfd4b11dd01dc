"""FP32 vs FP8 LightVAE student encoder (same checkpoint), both latents decoded by the common FP32 student decoder.

This isolates the FP8 quantization error of the encoder; it does not replace the student-vs-teacher
comparison (``lightvae.py``, ``lightvae_encoder.py``). Per evaluation clip: interleaved timing rounds of
``fp32_encoder``, ``fp8_encoder`` and ``fp8_encoder_no_clip_count`` (the same FP8 path without the clipping
diagnostic; medians, warm-up excluded, outputs checked finite), the execution proof
(every selected convolution executed in FP8 in every timed request, no dense fallback), input clipping
counts (a diagnostic, not a failure), and quality separately: latent relative L2 and decoded-RGB PSNR /
minimum-frame SSIM of the FP8 path against the FP32 path (budget: rel L2 <= 0.03, PSNR >= 33 dB,
SSIM >= 0.98).

Without ``--artifact`` the script calibrates first (``encoder.*``, calibration clips with seeds 11 and 12,
or ``--calibration-reference`` files) and writes the artifact next to the results; evaluation uses seeds
42 and 43 (or ``--reference`` files). Without ``--checkpoint`` the student has seeded random weights and the
quality numbers only describe those weights.

Usage::

    python benchmarks/inference/lightvae_fp8.py --frames 17 --out /tmp/lightvae-fp8        # H200
    python benchmarks/inference/lightvae_fp8.py --checkpoint lightvaew2_1.pth --artifact lightvae-fp8.pt \
        --reference reference_42.pt reference_43.pt --rounds 3 --out DIR
    python benchmarks/inference/lightvae_fp8.py --smoke --fp8-backend reference --out /tmp/fp8-smoke  # CPU
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from lightvae_common import (
    RANDOM_WEIGHTS_NOTE,
    default_device,
    interleaved_rounds,
    load_codec,
    load_or_make_clips,
    print_table,
    provenance,
    relative_l2,
    video_quality,
    write_json,
)

from worldfoundry.base_models.diffusion_model.codec import install_fp8_encoder
from worldfoundry.base_models.diffusion_model.codec_fp8 import (
    calibrate_encoder_fp8,
    save_artifact,
)
from worldfoundry.core.acceleration.context import RequestContext, request_scope

BUDGET = {"latent_rel_l2_max": 0.03, "psnr_db_min": 33.0, "ssim_min": 0.98}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", help="LightVAE student checkpoint (random weights when omitted)")
    p.add_argument("--artifact", help="FP8 calibration artifact (calibrated here when omitted)")
    p.add_argument("--calibration-reference", nargs="*", help="calibration clips when calibrating here")
    p.add_argument("--calibration-seeds", nargs="*", type=int, default=[11, 12])
    p.add_argument("--include", nargs="*", default=["encoder.*"])
    p.add_argument("--reference", nargs="*", help="evaluation clips (.pt); synthetic clips when omitted")
    p.add_argument("--seeds", nargs="*", type=int, default=[42, 43], help="seeds of the synthetic evaluation clips")
    p.add_argument("--frames", type=int, default=17)
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--fp8-backend", default="auto", choices=["auto", "scaled_mm", "reference"])
    p.add_argument("--device", default=default_device())
    p.add_argument("--quality-frames", type=int, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shapes for CPU (5 frames, 32x32, one clip)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.smoke:
        args.frames, args.height, args.width = 5, 32, 32
        args.seeds, args.calibration_seeds = args.seeds[:1], args.calibration_seeds[:1]
    if args.rounds < 3:
        p.error("--rounds must be at least 3")
    return args


def execution_proof(report: dict[str, Any], request_ids: list[str]) -> dict[str, Any]:
    """Every selected convolution executed in every timed FP8 request, with no dense fallback."""
    plugin = report["plugins"]["lightvae"]["model"]
    convs = plugin["convolutions"]
    missing, fallbacks, clipped = {}, {}, 0
    for rid in request_ids:
        rec = plugin["requests"].get(rid)
        if rec is None:
            missing[rid] = ["<request not recorded>"]
            continue
        absent = [c for c in convs if not rec["modules"].get(c)]
        if absent:
            missing[rid] = absent
        if rec["counters"].get("dense_fallback"):
            fallbacks[rid] = rec["fallbacks"]
        clipped += int(rec["counters"].get("clipped_inputs", 0))
    return {
        "backend": plugin["backend"],
        "fallback_reason": plugin["fallback_reason"],
        "convolutions": len(convs),
        "requests_checked": len(request_ids),
        "not_executed": missing,
        "fallbacks": fallbacks,
        "executed_all": not missing and not fallbacks,
        "clipped_inputs": clipped,
    }


def _run_clip(name: str, clip: torch.Tensor, fp32: Any, fp8: Any, fp8_nocount: Any, counter: Any,
              device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    video = clip.to(device)
    timed_ids: dict[str, list[str]] = {"fp8_encoder": [], "fp8_encoder_no_clip_count": []}

    def in_request(codec: Any, label: str) -> Any:
        def call() -> torch.Tensor:
            rid = f"{name}#{label}#{next(counter)}"
            timed_ids[label].append(rid)
            with request_scope(RequestContext(rid)):
                return codec.encode(video)

        return call

    kept: dict[str, torch.Tensor] = {}
    timing = interleaved_rounds(
        {"fp32_encoder": lambda: fp32.encode(video),
         "fp8_encoder": in_request(fp8, "fp8_encoder"),
         "fp8_encoder_no_clip_count": in_request(fp8_nocount, "fp8_encoder_no_clip_count")},
        device, rounds=args.rounds, warmup=args.warmup, keep=kept.__setitem__)
    ref_video = fp32.decode(kept["fp32_encoder"]).float().cpu()
    fp8_video = fp32.decode(kept["fp8_encoder"]).float().cpu()
    quality = video_quality(fp8_video, ref_video, max_frames=args.quality_frames)
    quality["latent_rel_l2"] = relative_l2(kept["fp8_encoder"], kept["fp32_encoder"])
    quality["within_budget"] = (quality["latent_rel_l2"] <= BUDGET["latent_rel_l2_max"]
                                and quality["psnr_db"] >= BUDGET["psnr_db_min"]
                                and quality["ssim_min"] >= BUDGET["ssim_min"])
    quality["no_clip_count_bitwise_equal"] = bool(torch.equal(kept["fp8_encoder"], kept["fp8_encoder_no_clip_count"]))
    return {
        "clip": name,
        "shape": list(clip.shape),
        "results": timing,
        "quality_fp8_vs_fp32": quality,
        "execution": execution_proof(fp8.fp8_session.execution_report(), timed_ids["fp8_encoder"][args.warmup:]),
        "execution_no_clip_count": execution_proof(fp8_nocount.fp8_session.execution_report(),
                                                   timed_ids["fp8_encoder_no_clip_count"][args.warmup:]),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    fp32 = load_codec(args.checkpoint, "lightvae-wan21", args.device, seed=2)
    artifact_path = args.artifact
    calibration = None
    if artifact_path is None:
        clips = load_or_make_clips(args.calibration_reference, args.calibration_seeds, args.frames, args.height,
                                   args.width)
        artifact = calibrate_encoder_fp8(fp32, [(n, c.to(device)) for n, c in clips], include=args.include,
                                         frames=args.frames)
        artifact_path = str(save_artifact(artifact, Path(args.out) / "lightvae-fp8.pt"))
        calibration = {"artifact": artifact_path, "sources": [n for n, _ in clips]}
    fp8 = load_codec(args.checkpoint, "lightvae-wan21", args.device, seed=2, fp8_calibration=artifact_path,
                     fp8_backend=args.fp8_backend)
    fp8_nocount = load_codec(args.checkpoint, "lightvae-wan21", args.device, seed=2)
    fp8_nocount.fp8_session = install_fp8_encoder(fp8_nocount, artifact_path, backend=args.fp8_backend,
                                                  count_clipping=False)
    counter = iter(range(1 << 30))
    per_clip = [_run_clip(name, clip, fp32, fp8, fp8_nocount, counter, device, args)
                for name, clip in load_or_make_clips(args.reference, args.seeds, args.frames, args.height, args.width)]
    random_weights = not args.checkpoint
    report = {
        "benchmark": "lightvae_fp8_encoder",
        "artifact": artifact_path,
        "calibrated_here": calibration,
        "clips": per_clip,
        "budget": BUDGET,
        "random_weights": random_weights,
        "notes": ([RANDOM_WEIGHTS_NOTE] if random_weights else [])
        + ["quality isolates the FP8 encoder error: both latents are decoded by the same FP32 student decoder"],
        "algorithmically_approximate": True,
        "fp8_codec_report": fp8.execution_report(),
        "provenance": provenance(args, [args.checkpoint, artifact_path, *(args.reference or [])]),
    }
    fp8.close()
    fp8_nocount.close()
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    report = run(args)
    path = write_json(args.out, "lightvae_fp8.json", report)
    rows = []
    for clip in report["clips"]:
        r32, r8, r8n = (clip["results"][k] for k in ("fp32_encoder", "fp8_encoder", "fp8_encoder_no_clip_count"))
        q, e = clip["quality_fp8_vs_fp32"], clip["execution"]
        rows.append([clip["clip"], r32["median_ms"], r8["median_ms"], r8n["median_ms"], r32["median_ms"] / r8n["median_ms"],
                     r32["peak_extra_gb"], r8n["peak_extra_gb"], q["latent_rel_l2"], q["psnr_db"], q["ssim_min"],
                     q["within_budget"], e["backend"], e["executed_all"] and clip["execution_no_clip_count"]["executed_all"],
                     e["clipped_inputs"]])
    print(f"results: {path}")
    for note in report["notes"]:
        print(f"note: {note}")
    print_table("LightVAE student encoder FP32 vs FP8 (decoded by the FP32 student decoder)",
                ["clip", "fp32 ms", "fp8 ms", "fp8 ms (no clip count)", "speedup (no count)", "fp32 GB", "fp8 GB",
                 "latent rel L2", "PSNR dB", "SSIM min", "in budget", "backend", "all executed", "clipped"], rows)
    return report


if __name__ == "__main__":
    main()
