"""CPU: calibration variants of ``svdquant`` on the shipped trained tiny model, judged on quality only.

Each variant calibrates an artifact for ``blocks.*.ffn.0`` / ``blocks.*.ffn.2`` (seeds 11/12, the recipe's own
prompts) with ``worldfoundry calibrate svdquant`` and its flags, then ``worldfoundry bench --quality-only`` runs
all of them on the evaluation seeds 42/43 with INT8 activations (``backend: reference``, the torch reference of
the W4A8 numerics; ``--backends w4f8`` adds the FP8-activation numerics, ``--backends w4a16`` the
bfloat16-activation numerics of the W4A16 kernel, ``--activation-groups 128`` INT8 scales per token and group of
128), against the draft budget (latent rel L2 <= 0.12, PSNR >= 27 dB, min SSIM
>= 0.89). Prints one row per variant and writes the bench's ``results.json`` / ``report.md`` under ``--out``.

    python benchmarks/inference/svdquant_fixture_variants.py --out /tmp/svdquant-variants      # ~1 min per variant
    python benchmarks/inference/svdquant_fixture_variants.py --only ch-r64-gptq g64-r64-gptq
    python benchmarks/inference/svdquant_fixture_variants.py --only ch-r64-gptq ch-r64-gptq-c1314 \
        --activation-groups token 128 --seeds 21 22 23 24     # the same artifacts judged on other seeds
    python benchmarks/inference/svdquant_fixture_variants.py --only ch-r64-gptq-pool10      # 10 calibration requests
    python benchmarks/inference/svdquant_fixture_variants.py --only ch-r64-gptq-only0 ch-r64-gptq-skip03 \
        ch-rtn-skip03                    # one block's FFNs alone; every block but 0 and 3, SVDQuant and RTN
    python benchmarks/inference/svdquant_fixture_variants.py --only ch-r64-gptq-keep2 ch-rtn-keep2 \
        --out /tmp/keep2                 # the 2 most sensitive blocks (on calibration data) dense; RTN on the rest
    python benchmarks/inference/svdquant_fixture_variants.py --only ch-r64-gptq-keep2 ch-rtn-keep2 \
        --out /tmp/keep2 --reuse-artifacts --seeds 21 22 23 24 --bench-dir bench-21-24   # same artifacts, held out

A variant's flags may name ``{out}`` (the ``--out`` folder): ``--dense-from {out}/OTHER.json`` reads another
variant's artifact, so such variants are calibrated after the others.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

_CH = ["--group-size", "channel", "--unsmoothed", "blocks.*", "--rounding", "gptq"]
_POOL10 = ["--seeds", *[str(s) for s in range(11, 21)]]
#: name -> ``worldfoundry calibrate svdquant`` flags (beyond recipe, include and output).
VARIANTS: dict[str, list[str]] = {
    "ch-r64-gptq": ["--rank", "64", "--group-size", "channel", "--unsmoothed", "blocks.*", "--rounding", "gptq"],
    "ch-r64-gptq-a50": ["--rank", "64", "--group-size", "channel", "--alpha", "0.5", "--rounding", "gptq"],
    "ch-r64-gptq-a25": ["--rank", "64", "--group-size", "channel", "--alpha", "0.25", "--rounding", "gptq"],
    "ch-r64-gptq-ffn2-plain": ["--rank", "64", "--group-size", "channel", "--alpha", "0.25", "--unsmoothed",
                               "blocks.*.ffn.2", "--rounding", "gptq"],
    "ch-r128-gptq": ["--rank", "128", "--group-size", "channel", "--unsmoothed", "blocks.*", "--rounding", "gptq"],
    "g64-r64-gptq": ["--rank", "64", "--group-size", "64", "--unsmoothed", "blocks.*", "--rounding", "gptq"],
    "ch-rtn": ["--method", "rtn", "--group-size", "channel"],
    # eight calibration seeds (11-18, never the evaluation seeds 42/43) instead of two: more calibration tokens
    "ch-r64-gptq-s8": ["--rank", "64", "--group-size", "channel", "--unsmoothed", "blocks.*", "--rounding", "gptq",
                       "--seeds", *[str(s) for s in range(11, 19)]],
    "g64-r64-gptq-s8": ["--rank", "64", "--group-size", "64", "--unsmoothed", "blocks.*", "--rounding", "gptq",
                        "--seeds", *[str(s) for s in range(11, 19)]],
    "ch-r32-gptq-s8": ["--rank", "32", "--group-size", "channel", "--unsmoothed", "blocks.*", "--rounding", "gptq",
                       "--seeds", *[str(s) for s in range(11, 19)]],
    # the low-rank pair fitted to the calibration outputs, and refined against what the INT4 codes left
    "ch-r64-gptq-whitened": ["--rank", "64", "--group-size", "channel", "--unsmoothed", "blocks.*", "--rounding",
                             "gptq", "--lowrank-fit", "whitened"],
    "ch-r64-gptq-refine4": ["--rank", "64", "--group-size", "channel", "--unsmoothed", "blocks.*", "--rounding",
                            "gptq", "--refine", "4"],
    "ch-r64-gptq-whitened-refine4": ["--rank", "64", "--group-size", "channel", "--unsmoothed", "blocks.*",
                                     "--rounding", "gptq", "--lowrank-fit", "whitened", "--refine", "4"],
    "ch-r32-gptq-whitened-refine4": ["--rank", "32", "--group-size", "channel", "--unsmoothed", "blocks.*",
                                     "--rounding", "gptq", "--lowrank-fit", "whitened", "--refine", "4"],
    # GPTQ in act order (columns by decreasing input mean square) with scales searched per group
    "ch-r64-gptqo": ["--rank", "64", "--group-size", "channel", "--unsmoothed", "blocks.*", "--rounding",
                     "gptq-ordered"],
    "ch-r32-gptqo": ["--rank", "32", "--group-size", "channel", "--unsmoothed", "blocks.*", "--rounding",
                     "gptq-ordered"],
    "ch-r32-gptqo-a50": ["--rank", "32", "--group-size", "channel", "--alpha", "0.5", "--rounding", "gptq-ordered"],
    "g64-r32-gptqo": ["--rank", "32", "--group-size", "64", "--unsmoothed", "blocks.*", "--rounding",
                      "gptq-ordered"],
    "ch-gptqo-rtn": ["--method", "rtn", "--group-size", "channel", "--rounding", "gptq-ordered"],
    # the same method (rank 64, per channel, GPTQ) calibrated on other seed pairs (never 42/43): how far the
    # evaluation's metrics move with the calibration data alone
    **{f"ch-r64-gptq-c{a}{a + 1}": ["--rank", "64", "--group-size", "channel", "--unsmoothed", "blocks.*",
                                     "--rounding", "gptq", "--seeds", str(a), str(a + 1)] for a in (13, 15, 17, 19)},
    # the same method calibrated on pooled requests (the contract's seeds 11/12 first, then more; never 42/43 or
    # 21-24): does more calibration data remove the spread between seed pairs?
    **{f"ch-r64-gptq-pool{n}": ["--rank", "64", "--group-size", "channel", "--unsmoothed", "blocks.*",
                                "--rounding", "gptq", "--seeds", *[str(s) for s in range(11, 11 + n)]]
       for n in (6, 10)},
    # the same method on one block's FFN at a time (``--include`` given again replaces the default set), and on
    # every block but one: which blocks carry the 4-bit error
    **{f"ch-r64-gptq-only{b}": ["--rank", "64", "--group-size", "channel", "--unsmoothed", "blocks.*",
                                "--rounding", "gptq", "--include", f"blocks.{b}.ffn.0", f"blocks.{b}.ffn.2"]
       for b in range(6)},
    **{f"ch-r64-gptq-skip{b}": ["--rank", "64", "--group-size", "channel", "--unsmoothed", "blocks.*",
                                "--rounding", "gptq", "--include",
                                *[f"blocks.{k}.ffn.{j}" for k in range(6) if k != b for j in (0, 2)]]
       for b in range(6)},
    "ch-r64-gptq-skip03": ["--rank", "64", "--group-size", "channel", "--unsmoothed", "blocks.*", "--rounding", "gptq",
                           "--include", *[f"blocks.{k}.ffn.{j}" for k in (1, 2, 4, 5) for j in (0, 2)]],
    **{f"ch-r64-gptq-skip03-c{a}{a + 1}": ["--rank", "64", "--group-size", "channel", "--unsmoothed", "blocks.*",
                                           "--rounding", "gptq", "--seeds", str(a), str(a + 1), "--include",
                                           *[f"blocks.{k}.ffn.{j}" for k in (1, 2, 4, 5) for j in (0, 2)]]
       for a in (13, 15, 17, 19)},
    "ch-rtn-skip03": ["--method", "rtn", "--group-size", "channel",
                      "--include", *[f"blocks.{k}.ffn.{j}" for k in (1, 2, 4, 5) for j in (0, 2)]],
    # mixed precision chosen on the calibration requests alone: each block's FFN pair quantized alone, the two whose
    # final calibration latents move most stay dense (``--keep-dense``); the RTN baseline quantizes exactly the
    # Linears that selection kept quantized (``--dense-from`` the SVDQuant artifact: calibrate that one first)
    **{f"ch-r64-gptq{pool}-keep{n}": ["--rank", "64", "--group-size", "channel", "--unsmoothed", "blocks.*",
                                      "--rounding", "gptq", "--keep-dense", str(n), *seeds]
       for n in (1, 2) for pool, seeds in (("", []), ("-pool10", ["--seeds", *[str(s) for s in range(11, 21)]]))},
    **{f"ch-rtn{pool}-keep{n}": ["--method", "rtn", "--group-size", "channel", "--dense-from",
                                 f"{{out}}/ch-r64-gptq{pool}-keep{n}.json"]
       for n in (1, 2) for pool in ("", "-pool10")},
    # the same per Linear: the four Linears whose quantization alone moves the calibration latents most stay dense
    "ch-r64-gptq-lin-keep4": ["--rank", "64", "--group-size", "channel", "--unsmoothed", "blocks.*", "--rounding",
                              "gptq", "--keep-dense", "4", "--sensitivity-unit", "linear"],
    "ch-rtn-lin-keep4": ["--method", "rtn", "--group-size", "channel", "--dense-from",
                         "{out}/ch-r64-gptq-lin-keep4.json"],
    # two blocks dense, chosen on calibration seeds 11-20, with the other levers: rank 96/128, group-wise weights,
    # three blocks, ranking by worst-frame SSIM, calibration seeds 1-20, four Linears; each ``rtn-of-X`` quantizes
    # exactly the Linears X kept quantized (``docs/performance.md``, eighteenth lease)
    **(_KEEP := {
        **{f"ch-r{r}-gptq-pool10-keep2": ["--rank", str(r), *_CH, "--keep-dense", "2", *_POOL10] for r in (96, 128)},
        "g64-r64-gptq-pool10-keep2": ["--rank", "64", "--group-size", "64", "--unsmoothed", "blocks.*", "--rounding",
                                      "gptq", "--keep-dense", "2", *_POOL10],
        "ch-r64-gptq-pool10-lin-keep4": ["--rank", "64", *_CH, "--keep-dense", "4", "--sensitivity-unit", "linear",
                                         *_POOL10],
        "ch-r64-gptq-pool10-keep3": ["--rank", "64", *_CH, "--keep-dense", "3", *_POOL10],
        "ch-r64-gptq-pool10-keep2-ssim": ["--rank", "64", *_CH, "--keep-dense", "2", "--sensitivity-metric",
                                          "min_ssim", *_POOL10],
        "ch-r64-gptq-pool1_20-keep2": ["--rank", "64", *_CH, "--keep-dense", "2", "--seeds",
                                       *[str(s) for s in range(1, 21)]],
    }),
    **{f"rtn-of-{name}": ["--method", "rtn", "--group-size", "64" if name.startswith("g64") else "channel",
                          "--dense-from", f"{{out}}/{name}.json"] for name in _KEEP},
    # sequential statistics: each block observed with the blocks before it quantized (nineteenth lease)
    "ch-r64-gptq-pool10-seq": ["--rank", "64", *_CH, *_POOL10, "--sequential"],
    "ch-r64-gptq-pool10-keep2-seq": ["--rank", "64", *_CH, "--keep-dense", "2", *_POOL10, "--sequential"],
    "rtn-of-ch-r64-gptq-pool10-keep2-seq": ["--method", "rtn", "--group-size", "channel", "--dense-from",
                                            "{out}/ch-r64-gptq-pool10-keep2-seq.json"],
}
WORKLOAD = {"prompt": "a red square moving left", "negative_prompt": "", "frames": 9, "height": 32, "width": 32,
            "steps": 8, "guidance": 5.0, "shift": 3.0, "seeds": [42, 43]}
BUDGET = {"latent_rel_l2": 0.12, "psnr_db": 27.0, "min_ssim": 0.89}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="./bench_out/svdquant-variants")
    parser.add_argument("--only", nargs="+", choices=sorted(VARIANTS), default=sorted(VARIANTS))
    parser.add_argument("--backends", nargs="+", choices=["reference", "w4f8", "w4a16"],
                        default=["reference"], help="numerics each artifact is benched with: W4A8 (INT8 activations), "
                                                    "W4F8 (FP8), W4A16 (bfloat16 activations)")
    parser.add_argument("--activation-groups", nargs="+", choices=["token", "64", "128"], default=["token"],
                        help="INT8 activation scales per token, or per token and group of 64 / 128 (W4A8 only)")
    parser.add_argument("--seeds", nargs="+", type=int, default=WORKLOAD["seeds"],
                        help="seeds the bench judges quality on (default the evaluation seeds 42 43; others, e.g. "
                             "21-24, validate without touching them)")
    parser.add_argument("--reuse-artifacts", action="store_true",
                        help="bench a variant's artifact already under --out instead of calibrating it again")
    parser.add_argument("--bench-dir", default="bench", help="folder under --out receiving the bench's results")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    candidates = []
    # variants reading another variant's artifact (``{out}``) are calibrated after the others
    for name in sorted(args.only, key=lambda n: any("{out}" in f for f in VARIANTS[n])):
        artifact = out / f"{name}.json"
        flags = [f.replace("{out}", str(out)) for f in VARIANTS[name]]
        if not (args.reuse_artifacts and artifact.is_file()):
            cmd = ["worldfoundry", "calibrate", "svdquant", "--recipe", "tiny-wan2.1-trained", "--include",
                   "blocks.*.ffn.0", "blocks.*.ffn.2", *flags, "--out", str(artifact)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"{name}: calibration failed: {done.stderr.strip()[-400:]}", file=sys.stderr)
                continue
        for backend in args.backends:
            for group in args.activation_groups if backend == "reference" else ["token"]:
                options = {"artifact": str(artifact), "backend": backend}
                if group != "token":
                    options["activation_group"] = int(group)
                suffix = ("" if backend == "reference" else f"@{backend}") + \
                    ("" if group == "token" else f"@act{group}")
                candidates.append({"name": name + suffix, "accelerations": {"svdquant": options},
                                   "notes": "calibrate flags: " + " ".join(flags)})
    spec = {"model": "tiny-wan2.1-trained", "workload": {**WORKLOAD, "seeds": list(args.seeds)},
            "quality_budget": BUDGET,
            "timing": {"rounds": 3}, "candidates": candidates}
    bench_dir = out / args.bench_dir
    spec_file = out / ("candidates.json" if args.bench_dir == "bench" else f"candidates-{args.bench_dir}.json")
    spec_file.write_text(json.dumps(spec, indent=1))
    bench = subprocess.run(["worldfoundry", "bench", "--candidates", str(spec_file), "--quality-only",
                            "--out", str(bench_dir)], capture_output=True, text=True)
    if bench.returncode != 0:
        print(bench.stderr.strip()[-800:], file=sys.stderr)
        return bench.returncode
    results = json.loads((bench_dir / "results.json").read_text())
    print(f"{'variant':<24} {'rel L2':>8} {'PSNR dB':>8} {'min SSIM':>9}  within draft budget  "
          f"seeds within  median rel L2 / min SSIM")
    for c in results["candidates"]:
        worst = c["quality"]["worst"]
        within, seeds, medians = seed_counts(c["quality"]["per_seed"])
        print(f"{c['name']:<24} {worst['latent_rel_l2']:8.4f} {float(worst['psnr_db']):8.2f} "
              f"{worst['min_ssim']:9.4f}  {str(all(c['within_budget'].values())):<19}  {within:>2} of {seeds:<6}  "
              f"{medians[0]:.4f} / {medians[1]:.4f}")
    return 0


def seed_counts(per_seed: dict[str, dict[str, float]]) -> tuple[int, int, tuple[float, float]]:
    """How many seeds are within :data:`BUDGET` on every metric, of how many, and the medians over the seeds of the
    latent rel L2 and the worst frame's SSIM."""
    rows = list(per_seed.values())
    within = sum(r["latent_rel_l2"] <= BUDGET["latent_rel_l2"] and float(r["psnr_db"]) >= BUDGET["psnr_db"]
                 and r["min_ssim"] >= BUDGET["min_ssim"] for r in rows)
    return within, len(rows), (statistics.median(r["latent_rel_l2"] for r in rows),
                               statistics.median(r["min_ssim"] for r in rows))


if __name__ == "__main__":
    sys.exit(main())
