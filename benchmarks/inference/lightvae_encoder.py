"""LightVAE student vs Wan2.1 teacher encoder on the same video; both latents decoded by the teacher decoder.

Candidates (interleaved rounds, medians, warm-up excluded; both through ``load_wan_video_codec``, float32):
``teacher_encoder`` and ``student_encoder``. Reported per candidate: encode time, extra peak memory, and the
quality of ``teacher.decode(latents)`` against the input video (PSNR over the clip, SSIM per frame), plus
the relative L2 distance of the student's normalized latents to the teacher's.

Inputs: ``--reference`` clip files (``.pt`` BCTHW/CTHW in [-1, 1], THWC uint8, or ``{"video": ...}``), or
seeded synthetic clips (``--seeds``, default 42 43, the evaluation seeds). With random weights (no
checkpoint files) the quality numbers are meaningless; only time and memory count.

Usage::

    python benchmarks/inference/lightvae_encoder.py --out /tmp/lightvae-enc             # H200: 81x480x832
    python benchmarks/inference/lightvae_encoder.py --teacher Wan2.1_VAE.pth --student lightvaew2_1.pth \
        --reference reference_42.pt reference_43.pt --out DIR
    python benchmarks/inference/lightvae_encoder.py --smoke --out /tmp/lightvae-enc-smoke  # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--teacher", help="Wan2.1 VAE checkpoint (random weights when omitted)")
    p.add_argument("--student", help="LightVAE student checkpoint (random weights when omitted)")
    p.add_argument("--reference", nargs="*", help="evaluation clips (.pt); synthetic clips when omitted")
    p.add_argument("--seeds", nargs="*", type=int, default=[42, 43], help="seeds of the synthetic clips")
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default=default_device())
    p.add_argument("--quality-frames", type=int, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shapes for CPU (5 frames, 32x32, one clip)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.smoke:
        args.frames, args.height, args.width, args.seeds = 5, 32, 32, args.seeds[:1]
    if args.rounds < 3:
        p.error("--rounds must be at least 3")
    return args


def _run_clip(name: str, clip: torch.Tensor, teacher: Any, student: Any, device: torch.device,
              args: argparse.Namespace) -> dict[str, Any]:
    video = clip.to(device)
    kept: dict[str, torch.Tensor] = {}
    timing = interleaved_rounds(
        {"teacher_encoder": lambda: teacher.encode(video), "student_encoder": lambda: student.encode(video)},
        device, rounds=args.rounds, warmup=args.warmup, keep=kept.__setitem__,
    )
    quality = {}
    for cand, latents in kept.items():
        decoded = teacher.decode(latents).float().cpu()
        quality[cand] = video_quality(decoded, clip, max_frames=args.quality_frames)
    quality["student_encoder"]["latent_rel_l2_vs_teacher"] = relative_l2(kept["student_encoder"], kept["teacher_encoder"])
    for cand in timing:
        timing[cand]["quality_teacher_decoded_vs_input"] = quality[cand]
    return {"clip": name, "shape": list(clip.shape), "results": timing}


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    teacher = load_codec(args.teacher, "wan2.1", args.device, seed=1)
    student = load_codec(args.student, "lightvae-wan21", args.device, seed=2)
    clips = load_or_make_clips(args.reference, args.seeds, args.frames, args.height, args.width)
    per_clip = [_run_clip(name, clip, teacher, student, device, args) for name, clip in clips]
    random_weights = not (args.teacher and args.student)
    summary = {}
    for cand in ("teacher_encoder", "student_encoder"):
        ms = sorted(c["results"][cand]["median_ms"] for c in per_clip)
        summary[cand] = {"median_ms_over_clips": ms[len(ms) // 2]}
    summary["speedup_student_vs_teacher"] = (
        summary["teacher_encoder"]["median_ms_over_clips"] / summary["student_encoder"]["median_ms_over_clips"]
    )
    return {
        "benchmark": "lightvae_encoder",
        "clips": per_clip,
        "summary": summary,
        "random_weights": random_weights,
        "notes": [RANDOM_WEIGHTS_NOTE] if random_weights else [],
        "algorithmically_approximate": {"student_encoder": True, "teacher_encoder": False},
        "student_report": student.execution_report(),
        "teacher_report": teacher.execution_report(),
        "provenance": provenance(args, [args.teacher, args.student, *(args.reference or [])]),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    report = run(args)
    path = write_json(args.out, "lightvae_encoder.json", report)
    rows = []
    for clip in report["clips"]:
        base = clip["results"]["teacher_encoder"]["median_ms"]
        for cand, r in clip["results"].items():
            q = r["quality_teacher_decoded_vs_input"]
            rows.append([clip["clip"], cand, r["median_ms"], base / r["median_ms"], r["peak_extra_gb"],
                         q["psnr_db"], q["ssim_min"], q.get("latent_rel_l2_vs_teacher"), r["finite"]])
    print(f"results: {path}")
    if report["random_weights"]:
        print(f"note: {RANDOM_WEIGHTS_NOTE}")
    print_table("LightVAE encoder (latents decoded by the teacher decoder)",
                ["clip", "encoder", "median ms", "x vs teacher", "peak extra GB", "PSNR dB", "SSIM min",
                 "latent rel L2", "finite"], rows)
    return report


if __name__ == "__main__":
    main()
