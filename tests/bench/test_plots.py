"""Plots and report from a synthetic results mapping: every verdict kind, peers, per-step times."""

from __future__ import annotations

from pathlib import Path

from worldfoundry.bench.plots import write_all
from worldfoundry.bench.report import render_table, write_report


def _speed(med: float, lo: float, hi: float) -> dict:
    return {"speedup": med, "ci95": [lo, hi], "rounds": 5, "steps_s": {
        "dense": [[0.1, 0.1, 0.1, 0.1]] * 3, "candidate": [[0.1, 0.01, 0.01, 0.1]] * 3}}


def _quality(rel: float, psnr: float, ssim: float, ok: bool) -> dict:
    return {"quality": {"worst": {"latent_rel_l2": rel, "psnr_db": psnr, "min_ssim": ssim, "bitwise_equal": False}},
            "within_budget": {"latent_rel_l2": ok, "psnr_db": ok, "min_ssim": ok}, "executed": True}


def results(quality_only: bool = False) -> dict:
    cands = [
        {"name": "fast", "verdict": "recommended", "accelerations": {"a": {}}, **_quality(0.01, 40, 0.99, True),
         "speed": _speed(1.5, 1.4, 1.6), "skipped": {"easycache": {"steps": 2}}, "speed_bound": 2.0},
        {"name": "too-fast", "verdict": "invalid_timing", "accelerations": {"b": {}}, **_quality(0.01, 40, 0.99, True),
         "speed": _speed(21.1, 4.5, 26.1), "skipped": {"easycache": {"steps": 6}}, "speed_bound": 1.6,
         "timing_invalid": "median speedup 21.1x exceeds the receipts bound 1.6x"},
        {"name": "lossy", "verdict": "measured_quality_tradeoff", "accelerations": {"c": {}},
         **_quality(0.2, 25, 0.7, False), "speed": _speed(1.2, 1.1, 1.3)},
        {"name": "missing", "verdict": "rejected_at_install", "accelerations": {"nope": {}},
         "error": "UnknownAccelerationError: nope", "executed": False,
         "missing": [f"m{i}" for i in range(13)]},
    ]
    if quality_only:
        for c in cands:
            c.pop("speed", None)
            c["verdict"] = "quality_only" if "quality" in c else c["verdict"]
    return {"model": "m", "budget": {"latent_rel_l2": 0.03, "psnr_db": 33.0, "min_ssim": 0.98},
            "noise_floor": 1.03, "quality_only": quality_only, "candidates": cands, "workload": {}, "seeds": [1],
            "rounds": 3, "dense": {}, "environment": {"device": "cpu"}, "git": {"revision": "x"},
            "timing_policy": {"min_rounds": 3, "max_rounds": 12, "target_halfwidth": 0.02, "budget_s": 60,
                              "max_noise_floor": 1.05},
            "noisy_host": None,
            "peers": [{"name": "peer:eager", "verdict": "peer_reference", "speed": _speed(1.0, 0.98, 1.02),
                       "latent_rel_l2": 0.0, "warmup_s": 0.2},
                      {"name": "peer:compile", "verdict": "peer_skipped", "reason": "torch.compile is skipped"}]}


def test_plots_written_for_every_kind(tmp_path: Path) -> None:
    paths = write_all(results(), tmp_path)
    assert [p.name for p in paths] == ["speedup.png", "quality_vs_speed.png", "steps.png"]
    assert all(p.stat().st_size > 5000 for p in paths)


def test_quality_only_still_plots_quality(tmp_path: Path) -> None:
    paths = write_all(results(quality_only=True), tmp_path)
    assert [p.name for p in paths] == ["speedup.png", "quality_vs_speed.png"]
    assert paths[1].stat().st_size > 5000


def test_report_cpu_sharing_truncation_and_peers(tmp_path: Path) -> None:
    text = write_report(results(), tmp_path).read_text()
    assert "GPU sharing during timing: not applicable (CPU run)" in text
    assert "… and 3 more not executed" in text
    assert "invalid timing: median speedup 21.1x" in text
    assert "| peer:eager | peer_reference |" in text and "torch.compile is skipped" in text
    assert "**invalid_timing**" in render_table(results())
    noisy = results()
    noisy["noisy_host"] = "NOISY HOST: dense-vs-dense noise floor 1.900 > 1.050"
    assert "> **NOISY HOST" in write_report(noisy, tmp_path).read_text()
