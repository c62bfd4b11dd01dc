"""The PNG plots of a benchmark run, drawn for a person to read.

* ``speedup.png``: one bar per candidate and peer, coloured by verdict (legend), the 95% CI as error bars, the
  dense-vs-dense noise floor as a grey band, the receipts bound as a tick; candidates without a speed (invalid,
  rejected, quality only) appear as hatched placeholders with their verdict written on them.
* ``quality_vs_speed.png``: one panel per quality budget (rel L2, PSNR, min SSIM) with the budget line drawn and
  each candidate marked pass (filled) or fail (cross); speed on the y axis, or the candidate index under
  ``--quality-only``.
* ``steps.png``: per step, dense vs candidate time of cache candidates (which steps ran: short bars are reused).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

PSNR_PLOT_CAP = 80.0
VERDICT_COLOURS = {
    "recommended": "#2ca02c",
    "measured_quality_tradeoff": "#ff7f0e",
    "no_stable_gain": "#7f7f7f",
    "noisy_host": "#bcbd22",
    "quality_only": "#1f77b4",
    "peer_reference": "#9467bd",
    "refused_shared_gpu": "#8c564b",
}
INVALID_COLOUR = "#d62728"


def _colour(verdict: str) -> str:
    return VERDICT_COLOURS.get(verdict, INVALID_COLOUR)


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = list(results.get("candidates", []))
    rows += [p for p in results.get("peers", []) or [] if p.get("verdict") in ("peer_reference", "peer_failed")]
    return rows


def speedup_plot(results: dict[str, Any], path: Path) -> Path:
    """Bars of the speedup estimate with CIs, the noise band and verdict colours. Returns ``path``."""
    plt = _plt()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = _rows(results)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.75 * len(rows) + 3), 4.6))
    floor = float(results.get("noise_floor") or 1.0)
    if results.get("quality_only"):
        ax.text(0.5, 0.5, "quality only: nothing was timed\n(see quality_vs_speed.png)", ha="center", va="center",
                transform=ax.transAxes)
        rows = []
    ax.axhspan(1.0 / floor, floor, color="0.85", zorder=0)
    ax.axhline(1.0, color="black", linewidth=0.8)
    valid = [r for r in rows if r.get("speed") and _colour(r["verdict"]) != INVALID_COLOUR]
    top = max([floor] + [r["speed"]["ci95"][1] for r in valid] + [r.get("speed_bound") or 0 for r in valid
                                                                   if math.isfinite(r.get("speed_bound") or 0)])
    for i, r in enumerate(rows):
        sp = r.get("speed")
        if sp and _colour(r["verdict"]) == INVALID_COLOUR:  # measured but invalid: hatched, clipped, value written
            med = sp["speedup"]
            ax.bar(i, min(med, top * 1.05), color="white", edgecolor=INVALID_COLOUR, hatch="xx", zorder=2)
            ax.text(i, min(med, top * 1.05), f"{med:.3g}× ({r['verdict'].replace('_', ' ')})", ha="center",
                    va="bottom", fontsize=7, color=INVALID_COLOUR)
            if r.get("speed_bound") and math.isfinite(r["speed_bound"]):
                ax.plot([i - 0.4, i + 0.4], [r["speed_bound"]] * 2, color="black", linestyle=":", zorder=3)
        elif sp:
            med, (lo, hi) = sp["speedup"], sp["ci95"]
            ax.bar(i, med, color=_colour(r["verdict"]), yerr=[[med - lo], [hi - med]], capsize=3, zorder=2)
            if r.get("speed_bound") and math.isfinite(r["speed_bound"]):
                ax.plot([i - 0.4, i + 0.4], [r["speed_bound"]] * 2, color="black", linestyle=":", zorder=3)
        else:
            ax.bar(i, 1.0, color="white", edgecolor=_colour(r["verdict"]), hatch="//", zorder=2)
            ax.text(i, 0.55, r["verdict"].replace("_", "\n"), ha="center", va="center", fontsize=6)
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows], rotation=35, ha="right", fontsize=8)
    ax.set_ylim(0, max(1.2, top * 1.25))
    ax.set_ylabel("speedup vs dense (estimate, 95% CI)")
    estimator = (results.get("timing_policy") or {}).get("estimator", "step_floor").replace("_", " ")
    title = f"{results['model']}: speedup of the denoise loop ({estimator})"
    if results.get("noisy_host"):
        title += "\nNOISY HOST: no speed verdicts"
    ax.set_title(title, fontsize=10)
    seen = sorted({r["verdict"] for r in rows if _colour(r["verdict"]) != INVALID_COLOUR})
    handles = [Patch(color=_colour(v), label=v) for v in seen]
    if any(_colour(r["verdict"]) == INVALID_COLOUR for r in rows):
        handles.append(Patch(facecolor="white", edgecolor=INVALID_COLOUR, hatch="xx",
                             label="invalid / rejected (hatched)"))
    handles.append(Patch(color="0.85", label=f"noise floor [{1 / floor:.3f}, {floor:.3f}]"))
    handles.append(Line2D([], [], color="black", linestyle=":", label="receipts bound n/k"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


BUDGET_AXES = (("latent_rel_l2", "latent rel L2 (≤ budget)", True), ("psnr_db", "PSNR dB (≥ budget)", False),
               ("min_ssim", "min SSIM (≥ budget)", False))


def quality_plot(results: dict[str, Any], path: Path) -> Path:
    """One panel per budget: every candidate's worst-seed value, pass/fail marked, the budget line drawn."""
    plt = _plt()
    budget = results["budget"]
    cands = [c for c in results.get("candidates", []) if c.get("quality")]
    speed = any(c.get("speed") for c in cands)
    fig, axes = plt.subplots(1, 3, figsize=(13, max(3.5, 0.35 * len(cands) + 1.5)), sharey=True)
    for ax, (key, label, _upper) in zip(axes, BUDGET_AXES):
        for i, c in enumerate(cands):
            value = c["quality"]["worst"].get(key)
            if value is None:
                continue
            value = float(value)
            if key == "psnr_db":
                value = min(value, PSNR_PLOT_CAP)
            y = c["speed"]["speedup"] if c.get("speed") else i
            ok = c.get("within_budget", {}).get(key, True)
            ax.scatter([value], [y], color=_colour(c["verdict"]), marker="o" if ok else "X", s=50 if ok else 70,
                       zorder=3)
            if speed:  # without speed the y axis names the candidates; with it, staggered labels
                ax.annotate(c["name"], (value, y), fontsize=7, xytext=(4, 4 + 9 * (i % 3)),
                            textcoords="offset points")
        ax.axvline(budget[key], color="tab:blue", linestyle="--", label=f"budget {budget[key]}")
        ax.set_xlabel(label + (f" (identical at {PSNR_PLOT_CAP:.0f})" if key == "psnr_db" else ""), fontsize=8)
        ax.legend(fontsize=7, title="● pass · ✖ fail", title_fontsize=7, loc="best")
    axes[0].set_ylabel("speedup" if speed else "candidate")
    if not speed:
        axes[0].set_yticks(range(len(cands)), [c["name"] for c in cands], fontsize=7)
    fig.suptitle(f"{results['model']}: quality against each budget" + ("" if speed else " (quality only)"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def steps_plot(results: dict[str, Any], path: Path) -> Path | None:
    """Per-step median time, dense vs each cache candidate (one panel each); ``None`` when there is none."""
    cands = [c for c in results.get("candidates", []) if c.get("skipped") and (c.get("speed") or {}).get("steps_s")]
    if not cands:
        return None
    import numpy as np

    plt = _plt()
    fig, axes = plt.subplots(len(cands), 1, figsize=(7, 2.4 * len(cands)), squeeze=False)
    for ax, c in zip(axes[:, 0], cands):
        steps = c["speed"]["steps_s"]
        dense = np.median(np.asarray(steps["dense"], dtype=float), axis=0)
        cand = np.median(np.asarray(steps["candidate"], dtype=float), axis=0)
        x = np.arange(len(dense))
        ax.bar(x - 0.2, dense * 1e3, width=0.4, color="0.6", label="dense")
        ax.bar(x + 0.2, cand * 1e3, width=0.4, color=_colour(c["verdict"]), label=c["name"])
        ax.set_ylabel("ms / step", fontsize=8)
        skipped = ", ".join(f"{k} skipped {v.get('steps', 0)} calls" for k, v in c["skipped"].items())
        ax.set_title(f"{c['name']} ({c['verdict']}): {skipped}", fontsize=8)
        ax.set_xticks(x)
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("denoising step (short bars: the cache reused the step)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write every plot that has data; returns their paths."""
    paths = [speedup_plot(results, out_dir / "speedup.png"), quality_plot(results, out_dir / "quality_vs_speed.png")]
    steps = steps_plot(results, out_dir / "steps.png")
    return paths + ([steps] if steps else [])
