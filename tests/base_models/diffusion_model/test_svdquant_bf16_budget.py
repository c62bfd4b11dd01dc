"""``benchmarks/inference/svdquant_bf16_budget.py``: the budget rule, the per-seed table, and the documented figures
read back from the committed results."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.core.model_loading.recipes import project_root

RAW = project_root() / "benchmarks" / "results" / "cpu-2026-12-03d" / "svdquant-bf16-budget"


def _script():  # noqa: ANN202 - the script as a module
    folder = project_root() / "benchmarks" / "inference"
    spec = importlib.util.spec_from_file_location("svdquant_bf16_budget_test", folder / "svdquant_bf16_budget.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(rel: float, psnr: float, ssim: float) -> dict[str, float]:
    return {"latent_rel_l2": rel, "psnr_db": psnr, "min_ssim": ssim}


_rows = st.dictionaries(st.text("0123456789", min_size=1, max_size=3),
                        st.builds(_row, st.floats(0.0, 1.0), st.floats(5.0, 60.0), st.floats(0.0, 1.0)),
                        min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(_rows)
def test_every_seed_the_budget_is_derived_from_is_within_it(rows) -> None:
    module = _script()
    budget = module.derive_budget(rows)
    assert all(module.within(r, budget) for r in rows.values())
    worst_rel = max(r["latent_rel_l2"] for r in rows.values())
    assert budget["latent_rel_l2"] - worst_rel < 0.01 + 1e-9  # rounded outward by less than one step


def test_the_budget_rounds_each_metric_outward() -> None:
    module = _script()
    rows = {"57": _row(0.0887, 30.17, 0.8372), "58": _row(0.1098, 28.36, 0.8709), "61": _row(0.0952, 29.30, 0.8092)}
    assert module.derive_budget(rows) == {"latent_rel_l2": 0.11, "psnr_db": 28.0, "min_ssim": 0.80}
    assert module.derive_budget({"1": _row(0.12, 27.0, 0.89)}) == {"latent_rel_l2": 0.12, "psnr_db": 27.0,
                                                                   "min_ssim": 0.89}
    with pytest.raises(ValueError, match="no seeds"):
        module.derive_budget({})


def test_the_seed_table_counts_within_worst_and_pairs() -> None:
    module = _script()
    rows = {"a": {"1": _row(0.05, 30.0, 0.90), "2": _row(0.10, 29.0, 0.85)},
            "b": {"1": _row(0.20, 22.0, 0.60), "2": _row(0.09, 29.5, 0.70)}}
    table = module.seed_table(rows, [1, 2], {"latent_rel_l2": 0.11, "psnr_db": 28.0, "min_ssim": 0.80})
    assert table["rows"]["a"] == {"within": 2, "of": 2, "worst": _row(0.10, 29.0, 0.85)}
    assert table["rows"]["b"]["within"] == 0
    # seed 2: b has the lower rel L2 and higher PSNR, a the higher SSIM -> neither is better on every metric
    assert table["better_on_every_metric"] == {"a > b": 1, "b > a": 0}


def test_overlapping_seed_lists_are_refused_before_any_run(monkeypatch) -> None:
    module = _script()
    monkeypatch.setattr(sys, "argv", ["svdquant_bf16_budget.py"])
    with pytest.raises(SystemExit, match="must not repeat a budget seed"):
        module.main(["--budget-seeds", "42", "43", "--heldout-seeds", "43", "71"])


def test_the_documented_figures_come_out_of_the_committed_results() -> None:
    """``docs/svdquant.md``: W4A8 numerics within the bfloat16-anchored budget on 18 of 18 and 16 of 16 held-out
    seeds, better than RTN on every metric on every seed; W4F8 numerics within on 6 of 18 and 11 of 16."""
    module = _script()
    w4a8 = json.loads((RAW / "bf16_budget-w4a8.json").read_text())
    w4f8 = json.loads((RAW / "bf16_budget-w4f8.json").read_text())
    assert w4a8["budget"] == w4f8["budget"] == {"latent_rel_l2": 0.11, "psnr_db": 28.0, "min_ssim": 0.80}
    counts = {(part, name): (r["within"], r["of"]) for part in ("budget_seeds", "heldout_seeds")
              for name, r in w4a8[part]["rows"].items()}
    assert counts[("budget_seeds", "bf16-pipeline")] == (18, 18)
    assert counts[("heldout_seeds", "bf16-pipeline")] == (16, 16)
    assert counts[("budget_seeds", "svdquant-r64-ch-keep2")] == (18, 18)
    assert counts[("heldout_seeds", "svdquant-r64-ch-keep2")] == (16, 16)
    assert w4a8["heldout_seeds"]["better_on_every_metric"]["svdquant-r64-ch-keep2 > int4-rtn-ch-keep2"] == 16
    assert w4a8["budget_seeds"]["better_on_every_metric"]["svdquant-r64-ch-keep2 > int4-rtn-ch-keep2"] == 18
    assert [w4f8[p]["rows"]["svdquant-r64-ch-keep2"]["within"] for p in ("budget_seeds", "heldout_seeds")] == [6, 11]
    # the table is recomputed from the per-seed rows it was written with
    again = module.seed_table(w4a8["per_seed"], w4a8["heldout_seeds"]["seeds"], w4a8["budget"])
    assert again == w4a8["heldout_seeds"]
    bench = json.loads((RAW / "bench-w4a8-results.json").read_text())
    per_seed = {c["name"]: c["quality"]["per_seed"] for c in bench["candidates"]}
    assert per_seed["svdquant-r64-ch-keep2"]["71"]["min_ssim"] == pytest.approx(
        w4a8["per_seed"]["svdquant-r64-ch-keep2"]["71"]["min_ssim"])
