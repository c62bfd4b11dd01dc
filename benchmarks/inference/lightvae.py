"""LightVAE student vs Wan2.1 teacher decoder on the same latents: time, peak memory, decoded-RGB PSNR/SSIM.

Candidates (one run, interleaved rounds, medians; warm-up excluded):

* ``teacher_fp32``  — the teacher loaded through ``load_wan_video_codec`` (float32), ``codec.decode``;
* ``teacher_bf16``  — anchor: the same diffusers ``AutoencoderKLWan`` cast to bfloat16, decoded directly
  (worldfoundry refuses low precision; this row is diffusers alone);
* ``student_fp32``  — the LightVAE student through ``load_wan_video_codec``, ``codec.decode``;
* ``student_fp32_diffusers`` — control: the student's diffusers module decoded directly (shows that the
  loader and wrapper add nothing).

Peak memory is ``torch.cuda.max_memory_allocated`` minus what was allocated before the call (extra peak).
Quality is decoded RGB of each candidate against ``teacher_fp32`` (PSNR over the clip, SSIM per frame).
Without checkpoint files both codecs have seeded random weights: then the quality numbers are meaningless
and only time and memory count.

Usage::

    python benchmarks/inference/lightvae.py --out /tmp/lightvae                       # H200: 1x16x21x60x104
    python benchmarks/inference/lightvae.py --teacher Wan2.1_VAE.pth --student lightvaew2_1.pth --out DIR
    python benchmarks/inference/lightvae.py --smoke --out /tmp/lightvae-smoke          # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import copy
import gc
from typing import Any

import torch
from lightvae_common import (
    RANDOM_WEIGHTS_NOTE,
    default_device,
    interleaved_rounds,
    load_codec,
    parse_shape,
    print_table,
    provenance,
    video_quality,
    write_json,
)

#: Anchors measured with diffusers AutoencoderKLWan on the lent H200 (random weights, latent 1x16x21x60x104).
ANCHORS = {"teacher_fp32": (2787.0, 8.76), "teacher_bf16": (1828.0, 4.38), "student_fp32": (609.0, 2.47)}
GOALS = {"speedup_vs_teacher_fp32": 4.5, "speedup_vs_teacher_bf16": 3.0, "peak_fraction_of_teacher_fp32": 0.30}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--teacher", help="Wan2.1 VAE checkpoint (random weights when omitted)")
    p.add_argument("--student", help="LightVAE student checkpoint (random weights when omitted)")
    p.add_argument("--latent-shape", default="1,16,21,60,104", help="normalized latent BCTHW (default W81)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default=default_device())
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--no-bf16-anchor", action="store_true", help="skip the diffusers bf16 teacher row")
    p.add_argument("--quality-frames", type=int, default=None, help="compare at most this many frames (all)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes for CPU (latent 1x16x2x4x4)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.smoke:
        args.latent_shape = "1,16,2,4,4"
    if args.rounds < 3:
        p.error("--rounds must be at least 3")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    teacher = load_codec(args.teacher, "wan2.1", args.device, seed=1)
    student = load_codec(args.student, "lightvae-wan21", args.device, seed=2)
    shape = parse_shape(args.latent_shape)
    g = torch.Generator().manual_seed(args.seed)
    latents = torch.randn(*shape, generator=g).to(device)
    raw_student = student.denormalize(latents)

    candidates = {"teacher_fp32": lambda: teacher.decode(latents)}
    teacher_bf16 = None
    if not args.no_bf16_anchor:
        teacher_bf16 = copy.deepcopy(teacher.module).to(torch.bfloat16)
        raw_bf16 = teacher.denormalize(latents).to(torch.bfloat16)

        def bf16_decode() -> torch.Tensor:
            with torch.no_grad():
                return teacher_bf16.decode(raw_bf16, return_dict=False)[0]

        candidates["teacher_bf16"] = bf16_decode
    candidates["student_fp32"] = lambda: student.decode(latents)

    def student_direct() -> torch.Tensor:
        with torch.no_grad():
            return student.module.decode(raw_student, return_dict=False)[0]

    candidates["student_fp32_diffusers"] = student_direct

    kept: dict[str, torch.Tensor] = {}
    results = interleaved_rounds(candidates, device, rounds=args.rounds, warmup=args.warmup,
                                 keep=lambda n, o: kept.__setitem__(n, o.float().cpu()))
    for name, out in kept.items():
        if name != "teacher_fp32":
            results[name]["quality_vs_teacher_fp32"] = video_quality(out, kept["teacher_fp32"],
                                                                     max_frames=args.quality_frames)
    results["student_fp32_diffusers"]["bitwise_equal_to_student_fp32"] = bool(
        torch.equal(kept["student_fp32"], kept["student_fp32_diffusers"])
    )
    base = results["teacher_fp32"]
    stu = results["student_fp32"]
    summary: dict[str, Any] = {
        "speedup_vs_teacher_fp32": base["median_ms"] / stu["median_ms"],
        "speedup_vs_teacher_bf16": (results["teacher_bf16"]["median_ms"] / stu["median_ms"]) if teacher_bf16 is not None else None,
        "peak_fraction_of_teacher_fp32": (stu["peak_extra_gb"] / base["peak_extra_gb"])
        if stu["peak_extra_gb"] and base["peak_extra_gb"] else None,
        "wrapper_overhead_ratio": stu["median_ms"] / results["student_fp32_diffusers"]["median_ms"],
    }
    summary["goals"] = {k: (summary[k] is not None and (summary[k] <= v if k.startswith("peak") else summary[k] >= v))
                        for k, v in GOALS.items()}
    random_weights = not (args.teacher and args.student)
    report = {
        "benchmark": "lightvae_decode",
        "latent_shape": list(shape),
        "video_shape": [shape[0], 3, 1 + 4 * (shape[2] - 1), shape[3] * 8, shape[4] * 8],
        "results": results,
        "summary": summary,
        "anchors_h200": {k: {"ms": v[0], "peak_extra_gb": v[1]} for k, v in ANCHORS.items()},
        "random_weights": random_weights,
        "notes": [RANDOM_WEIGHTS_NOTE] if random_weights else [],
        "student_report": student.execution_report(),
        "teacher_report": teacher.execution_report(),
        "algorithmically_approximate": {"student_fp32": True, "student_fp32_diffusers": True, "teacher_bf16": True,
                                        "teacher_fp32": False},
        "provenance": provenance(args, [args.teacher, args.student]),
    }
    candidates.clear()
    gc.collect()
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    report = run(args)
    path = write_json(args.out, "lightvae_decode.json", report)
    rows = []
    base = report["results"]["teacher_fp32"]["median_ms"]
    for name, r in report["results"].items():
        q = r.get("quality_vs_teacher_fp32") or {}
        rows.append([name, r["median_ms"], base / r["median_ms"], r["peak_extra_gb"], q.get("psnr_db"),
                     q.get("ssim_min"), r["finite"]])
    s = report["summary"]
    print(f"results: {path}")
    if report["random_weights"]:
        print(f"note: {RANDOM_WEIGHTS_NOTE}")
    print(f"student speedup vs teacher fp32 {s['speedup_vs_teacher_fp32']:.2f}x (goal >= 4.5), vs teacher bf16 "
          f"{s['speedup_vs_teacher_bf16'] or float('nan'):.2f}x (goal >= 3), peak fraction "
          f"{s['peak_fraction_of_teacher_fp32'] or float('nan'):.3f} (goal <= 0.30), goals {s['goals']}")
    print_table(f"LightVAE decode, latent {report['latent_shape']} on {report['provenance']['gpu'] or 'cpu'}",
                ["candidate", "median ms", "x vs teacher fp32", "peak extra GB", "PSNR dB", "SSIM min", "finite"], rows)
    return report


if __name__ == "__main__":
    main()
