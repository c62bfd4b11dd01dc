"""Writing ``results.json``, ``report.md`` and the PNG plots of a benchmark run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from worldfoundry.bench.metrics import json_number

PSNR_PLOT_CAP = 80.0


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "–"
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        if math.isinf(value):
            return "∞ (identical)" if value > 0 else "-∞"
        return f"{value:.{digits}g}"
    return str(value)


def _jsonify(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonify(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonify(v) for v in value]
    if isinstance(value, float):
        return json_number(value)
    return value


def write_results(results: dict[str, Any], out_dir: Path) -> Path:
    path = out_dir / "results.json"
    path.write_text(json.dumps(_jsonify(results), indent=2, allow_nan=False))
    return path


def render_table(results: dict[str, Any]) -> str:
    """The Markdown table a person reads (one row per candidate)."""
    lines = [
        "| candidate | verdict | exact (claimed / bitwise) | latent rel L2 | PSNR dB | min SSIM | median speedup | 95% CI | executed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in results["candidates"]:
        worst = c.get("quality", {}).get("worst", {})
        speed = c.get("speed") or {}
        ci = speed.get("ci95")
        exact = f"{_fmt(c.get('exact_claimed'))} / {_fmt(worst.get('bitwise_equal'))}"
        executed = "yes" if c.get("executed") else ("–" if c["verdict"] == "rejected_at_install" else "**no**")
        lines.append(
            f"| {c['name']} | **{c['verdict']}** | {exact} | {_fmt(worst.get('latent_rel_l2'))} | "
            f"{_fmt(worst.get('psnr_db'))} | {_fmt(worst.get('min_ssim'))} | "
            f"{_fmt(speed.get('median_speedup'), 4)}{'×' if speed else ''} | "
            f"{'[' + _fmt(ci[0], 4) + ', ' + _fmt(ci[1], 4) + ']' if ci else '–'} | {executed} |"
        )
    return "\n".join(lines)


def write_report(results: dict[str, Any], out_dir: Path) -> Path:
    env = results["environment"]
    git = results["git"]
    lines = [f"# Benchmark: {results['model']}", ""]
    if git.get("dirty"):
        lines += [f"> **DIRTY TREE** — uncommitted changes at revision {git.get('revision')}: "
                  f"{', '.join(git.get('changed', [])[:8])}. Results may not be reproducible.", ""]
    if results.get("random_weights"):
        lines += ["> **Random weights**: speed and bitwise exactness are meaningful; quality numbers of approximate "
                  "candidates are not (a random model has no denoising trajectory to preserve).", ""]
    budget = results["budget"]
    lines += [
        f"- device: {env.get('device')} {env.get('gpu', '')} · torch {env.get('torch')} · triton {env.get('triton')} · "
        f"diffusers {env.get('diffusers')}",
        f"- revision: {git.get('revision')}{' (dirty)' if git.get('dirty') else ''}",
        f"- workload: {json.dumps(results['workload'])}",
        f"- seeds: {results['seeds']} · paired rounds: {results['rounds']} · quality budget: rel L2 ≤ "
        f"{budget['latent_rel_l2']}, PSNR ≥ {budget['psnr_db']} dB, min SSIM ≥ {budget['min_ssim']}",
        f"- GPU sharing during timing: {results.get('gpu_sharing', {}).get('shared')}",
        f"- dense output unchanged after all candidates: {results['dense'].get('stable_after_candidates')}",
        "",
        render_table(results),
        "",
        "Speedup = dense time / candidate time of the denoising loop, per interleaved pair; median and 95% "
        "bootstrap CI over pairs. `recommended` needs quality within budget and a CI lower bound above the noise "
        f"floor ({_fmt(results.get('noise_floor'), 4)}: the upper CI bound of dense-vs-dense control pairs "
        "timed the same way, at least 1).",
        "",
    ]
    for c in results["candidates"]:
        details = []
        if c.get("error"):
            details.append(f"  - error: {c['error']}")
        for item in c.get("missing", [])[:10]:
            details.append(f"  - not executed: {item}")
        if c.get("fallbacks"):
            details.append(f"  - dense fallbacks: {json.dumps(c['fallbacks'])}")
        if c.get("skipped"):
            details.append(f"  - skipped work: {json.dumps(c['skipped'])}")
        if c.get("timing_mismatch"):
            details.append(f"  - timing mismatches: {c['timing_mismatch'][:3]}")
        if c.get("notes"):
            details.append(f"  - notes: {c['notes']}")
        if details:
            lines += [f"- **{c['name']}** ({json.dumps(c['accelerations'])})", *details]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def write_plots(results: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [c for c in results["candidates"] if c.get("speed")]
    paths = []
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(timed) + 2), 3.5))
    if timed:
        names = [c["name"] for c in timed]
        med = [c["speed"]["median_speedup"] for c in timed]
        lo = [m - c["speed"]["ci95"][0] for m, c in zip(med, timed)]
        hi = [c["speed"]["ci95"][1] - m for m, c in zip(med, timed)]
        colors = ["tab:green" if c["verdict"] == "recommended" else "tab:gray" for c in timed]
        ax.bar(names, med, yerr=[lo, hi], color=colors, capsize=4)
        ax.tick_params(axis="x", labelrotation=30)
    else:
        ax.text(0.5, 0.5, "no timed candidates", ha="center", va="center", transform=ax.transAxes)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("speedup vs dense (median, 95% CI)")
    ax.set_title(f"{results['model']}: paired speedup")
    fig.tight_layout()
    paths.append(out_dir / "speedup.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 4.0))
    budget = results["budget"]
    for c in timed:
        psnr = c.get("quality", {}).get("worst", {}).get("psnr_db")
        if psnr is None:
            continue
        x = min(float(psnr), PSNR_PLOT_CAP)
        ax.scatter([x], [c["speed"]["median_speedup"]], color="tab:green" if c["verdict"] == "recommended" else "tab:red")
        ax.annotate(c["name"], (x, c["speed"]["median_speedup"]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    ax.axvline(budget["psnr_db"], color="tab:blue", linestyle="--", label=f"budget PSNR ≥ {budget['psnr_db']} dB")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel(f"decoded-RGB PSNR vs dense, dB (identical plotted at {PSNR_PLOT_CAP:.0f})")
    ax.set_ylabel("median speedup")
    ax.legend(fontsize=8)
    ax.set_title("quality vs speed")
    fig.tight_layout()
    paths.append(out_dir / "quality_vs_speed.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
