"""``worldfoundry tune`` on the trained tiny model (CPU, small search): the tuned file re-benches within budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worldfoundry.bench.harness import BenchConfig, run_bench
from worldfoundry.bench.tune import TuneConfig, TuneSpaceError, run_tune, threshold_grid, usable_space
from worldfoundry.cli.main import main
from worldfoundry.core.acceleration.registry import diffusion_acceleration_registry

WORKLOAD = {"prompt": "a red square moving left", "negative_prompt": "", "frames": 5, "height": 32, "width": 32,
            "steps": 6, "guidance": 5.0, "shift": 3.0, "seeds": [42]}
SPACE = {"easycache": {"threshold": [0.05, 0.4], "warmup_steps": [1], "grid": 2},
         "wan_cross_kv_fusion": {"choices": [{"min_tokens": 0}]},
         "not_a_plugin": {"choices": [{}]}}


def test_threshold_grid_and_space_checks() -> None:
    assert threshold_grid(0.02, 0.32, 5) == [0.02, 0.04, 0.08, 0.16, 0.32]
    with pytest.raises(TuneSpaceError, match=r"space.easycache.threshold"):
        run_tune(TuneConfig(space={"easycache": {"threshold": [0.4, 0.1]}}))
    with pytest.raises(TuneSpaceError, match=r"space.x.choices"):
        run_tune(TuneConfig(space={"x": {"choices": []}}))
    usable, left = usable_space({"selective_fp8": {"cuda_only": True, "choices": [{}]}, **SPACE},
                                diffusion_acceleration_registry(), "cpu")
    assert left == {"selective_fp8": "needs CUDA", "not_a_plugin": "not installed"}
    assert set(usable) == {"easycache", "wan_cross_kv_fusion"}


def test_tuned_configuration_rebenches_within_budget(tmp_path: Path) -> None:
    budget = {"latent_rel_l2": 0.2, "psnr_db": 20.0, "min_ssim": 0.5}
    trace = run_tune(TuneConfig(workload=WORKLOAD, budget=budget, space=SPACE, out=str(tmp_path / "t"),
                                refine=1, survivors=2, time_budget_s=2.0, progress=False))
    assert [p["pass"] for p in trace["passes"]][0] == "coarse" and trace["passes"][-1]["timed"] is True
    assert all(not p["timed"] for p in trace["passes"][:-1])  # quality-only passes first, timing last
    chosen = trace["chosen"]
    assert chosen is not None and all(chosen["within_budget"].values())
    tuned = json.loads((tmp_path / "t" / "tuned.json").read_text())
    assert tuned["candidates"][0]["accelerations"] == chosen["accelerations"]
    again = run_bench(BenchConfig(candidates=str(tmp_path / "t" / "tuned.json"), out=str(tmp_path / "re"),
                                  quality_only=True, progress=False))
    record = again["candidates"][0]
    assert record["executed"] and all(record["within_budget"].values())
    assert "not_a_plugin" in (tmp_path / "t" / "tune_report.md").read_text()


def test_cli_reports_a_bad_space(tmp_path: Path, capsys) -> None:
    space = tmp_path / "space.json"
    space.write_text(json.dumps({"easycache": {"threshold": "high"}}))
    assert main(["tune", "--space", str(space), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "space.easycache.threshold" in capsys.readouterr().err


def test_generated_names_are_valid_candidate_names_for_the_default_space() -> None:
    """Nested and list options (optimized_mha, selective_fp8, attention_policy) make valid, distinct names."""
    import itertools

    from worldfoundry.bench.candidates import CANDIDATE_NAME
    from worldfoundry.bench.tune import DEFAULT_SPACE, MAX_NAME, _name

    singles = [{plugin: choice} for plugin, ranges in DEFAULT_SPACE.items() for choice in ranges.get("choices", [])]
    singles.append({"easycache": {"threshold": 0.0625, "warmup_steps": 2, "final_dense_steps": 1}})
    specs = singles + [{**a, **b} for a, b in itertools.combinations(singles, 2) if not set(a) & set(b)]
    names = [_name(spec) for spec in specs]
    for name in names:
        assert CANDIDATE_NAME.fullmatch(name) and len(name) <= MAX_NAME, name
    assert len(set(names)) == len(names)
    assert _name({"optimized_mha": {"self": {"fusion": "qkv"}, "cross": {"fusion": "kv"}}}) == \
        "optimized_mha-self.fusion=qkv-cross.fusion=kv"


@pytest.mark.parametrize("given", [[], ["--estimator", "paired_median"]])
def test_tune_and_bench_pass_the_estimator_on(given) -> None:
    import argparse

    from worldfoundry.cli import bench_cmd, tune_cmd

    p = argparse.ArgumentParser()
    tune_cmd.add_parser(p.add_subparsers(dest="command"))
    config = tune_cmd._config(p.parse_args(["tune", *given]))
    expected = given[1] if given else "step_floor"
    assert config.estimator == expected
    b = argparse.ArgumentParser()
    bench_cmd.add_timing_arguments(b)
    assert b.parse_args(given).estimator == expected
    with pytest.raises(SystemExit):
        b.parse_args(["--estimator", "mean"])


def test_a_routed_recipe_is_tuned_expert_by_expert(tmp_path: Path) -> None:
    from worldfoundry.bench.tune_experts import recipe_experts

    assert recipe_experts("tiny-wan2.2-a14b") == ("high", "low") and recipe_experts("tiny-wan2.1") == ("model",)
    trace = run_tune(TuneConfig(model="tiny-wan2.2-a14b", budget={"latent_rel_l2": 0.15, "psnr_db": 20.0,
                                                                  "min_ssim": 0.5},
                                space={"easycache": {"threshold": [0.05, 0.5], "warmup_steps": [1], "grid": 2}},
                                out=str(tmp_path / "t"), refine=0, survivors=1, time_budget_s=1.0, progress=False))
    passes = {p["pass"]: p for p in trace["passes"]}
    alone = passes["experts"]["rows"]
    # each expert's grid with the other expert at threshold 0
    assert sorted(r["name"] for r in alone) == ["ec0w1@high=0.05", "ec0w1@high=0.5", "ec0w1@low=0.05",
                                                "ec0w1@low=0.5"]
    for row in alone:
        per = row["accelerations"]["easycache"]["per_expert"]
        assert row["accelerations"]["easycache"]["threshold"] == 0.0 and len(per) == 1
    combined = passes.get("experts-combined", {"rows": []})["rows"]
    assert all(set(r["accelerations"]["easycache"]["per_expert"]) == {"high", "low"} for r in combined)
    assert all(r["verdict"] == "quality_only" for r in alone + combined)


class _QualityStub:
    """Stands in for the harness in the stacking logic: a spec passes unless it holds a listed bad pair."""

    def __init__(self, bad_pairs: list[set[str]]) -> None:
        self.bad_pairs = bad_pairs
        self.passes: list[tuple[str, list[dict]]] = []

    def bench(self, name: str, specs: list[dict], *, timed: bool) -> list[dict]:
        assert not timed
        self.passes.append((name, specs))
        return [{"accelerations": s, "executed": True, "within_budget": {"latent_rel_l2": True},
                 "verdict": "rejected_at_install" if any(bad <= set(s) for bad in self.bad_pairs) else "quality_only"}
                for s in specs]


def test_exact_sets_stack_what_passes_together() -> None:
    from worldfoundry.bench.tune import _exact_sets

    singles = [{"a": {}}, {"b": {}}, {"c": {}}, {"d": {"x": 1}}, {"d": {"x": 2}}]
    stub = _QualityStub(bad_pairs=[{"a", "c"}])
    sets = _exact_sets(stub, singles)
    names = [p for p, _ in stub.passes]
    assert names == ["pairs", "sets"]
    pairs = stub.passes[0][1]
    assert len(pairs) == 9 and not any(set(p) == {"d"} for p in pairs)  # one choice per plugin
    # a+c conflicts: every other pair is kept (a sub-stack can be faster than a larger one), and the larger sets
    # are {a, b, d=x} and {b, c, d=x} for each d choice
    larger = sorted(sorted((k, json.dumps(v)) for k, v in s.items()) for s in sets if len(s) > 2)
    assert larger == sorted([
        [("a", "{}"), ("b", "{}"), ("d", '{"x": 1}')], [("a", "{}"), ("b", "{}"), ("d", '{"x": 2}')],
        [("b", "{}"), ("c", "{}"), ("d", '{"x": 1}')], [("b", "{}"), ("c", "{}"), ("d", '{"x": 2}')]])
    assert len([s for s in sets if len(s) == 2]) == 8 and {"a", "c"} not in [set(s) for s in sets]


def test_exact_sets_with_one_plugin_check_nothing() -> None:
    from worldfoundry.bench.tune import _exact_sets

    stub = _QualityStub(bad_pairs=[])
    assert _exact_sets(stub, [{"a": {"x": 1}}, {"a": {"x": 2}}]) == [] and stub.passes == []
