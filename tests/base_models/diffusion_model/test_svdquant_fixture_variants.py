"""``benchmarks/inference/svdquant_fixture_variants.py``'s seed counts, read back from committed bench results."""

from __future__ import annotations

import importlib.util
import json

import pytest

from worldfoundry.core.model_loading.recipes import project_root


def _script():  # noqa: ANN202 - the script as a module
    path = project_root() / "benchmarks" / "inference" / "svdquant_fixture_variants.py"
    spec = importlib.util.spec_from_file_location("svdquant_fixture_variants_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_seed_counts_read_the_documented_fresh_seed_figures() -> None:
    """The counts ``docs/svdquant.md`` states for sixteen fresh seeds come out of the committed results."""
    raw = project_root() / "benchmarks" / "results" / "cpu-2026-12-03c" / "svdquant-sequential"
    counts = {}
    for name in ("bench-fresh-results.json", "bench-fresh-keep2-results.json"):
        for c in json.loads((raw / name).read_text())["candidates"]:
            counts[c["name"]] = _script().seed_counts(c["quality"]["per_seed"])
    assert counts["ch-r64-gptq-pool10-keep2"][:2] == (12, 16)
    assert counts["ch-r64-gptq-pool10-keep2-seq"][:2] == (10, 16)
    assert counts["rtn-of-ch-r64-gptq-pool10-keep2-seq"][:2] == (0, 16)
    assert counts["ch-r64-gptq-pool10-keep2"][2][1] == pytest.approx(0.903, abs=5e-4)


def test_a_seed_is_within_only_when_every_metric_is() -> None:
    module = _script()
    per_seed = {"1": {"latent_rel_l2": 0.05, "psnr_db": 30.0, "min_ssim": 0.95},
                "2": {"latent_rel_l2": 0.05, "psnr_db": 30.0, "min_ssim": 0.85},   # SSIM outside
                "3": {"latent_rel_l2": 0.13, "psnr_db": 30.0, "min_ssim": 0.95},   # rel L2 outside
                "4": {"latent_rel_l2": 0.12, "psnr_db": 27.0, "min_ssim": 0.89}}   # on every edge: within
    within, seeds, (rel, ssim) = module.seed_counts(per_seed)
    assert (within, seeds) == (2, 4) and rel == pytest.approx(0.085) and ssim == pytest.approx(0.92)
