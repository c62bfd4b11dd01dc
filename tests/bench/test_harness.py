"""The benchmark harness: verdict paths with small test-only plugins, schema errors, provenance, metrics."""

from __future__ import annotations

import gc
import json
import math
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from worldfoundry.bench import harness
from worldfoundry.bench.candidates import parse_candidates
from worldfoundry.bench.harness import CONTROL_MIN_ROUNDS, BenchConfig, DirtyTreeError, run_bench
from worldfoundry.bench.metrics import frame_ssim, psnr, relative_l2
from worldfoundry.bench.provenance import git_state
from worldfoundry.bench.report import write_report
from worldfoundry.bench.stats import bootstrap_ci, decide
from worldfoundry.core.acceleration.handle import RecordedHandle
from worldfoundry.core.acceleration.patching import PatchRecorder
from worldfoundry.core.acceleration.prepared import PreparedAcceleration
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.errors import AccelerationOptionsError, CandidateSchemaError

TARGET = "blocks.0.ffn"


@dataclass(frozen=True)
class ScaleOptions:
    factor: float = 1.0
    record: bool = True

    @classmethod
    def from_mapping(cls, options: Any) -> ScaleOptions:
        unknown = set(options) - {"factor", "record"}
        if unknown:
            raise AccelerationOptionsError("scale", f"unknown option(s) {sorted(unknown)}")
        opts = cls(**options)
        if opts.factor < 0:
            raise AccelerationOptionsError("scale", f"factor: must be >= 0, got {opts.factor}")
        return opts


def _scale_factory(name: str, *, exact: bool, nan: bool = False, fail: bool = False):
    def prepare(model, options, policy):
        opts = ScaleOptions.from_mapping(options)

        def activate():
            if fail:
                raise RuntimeError("activation refused by the test plugin")
            with PatchRecorder() as rec:
                handle = RecordedHandle(name, PatchRecorder())
                module = model.get_submodule(TARGET)

                def make(orig):
                    def forward(hidden_states, *args, **kwargs):
                        out = orig(hidden_states, *args, **kwargs)
                        if opts.record:
                            handle.ledger.executed(TARGET, "kernel")
                        if nan:
                            return out * float("nan")
                        return out if opts.factor == 1.0 else out * opts.factor
                    return forward

                rec.wrap_forward(module, make, name=name)
                handle.patches = rec.pop_all()
            return handle

        return PreparedAcceleration(name=name, claims={TARGET}, activate=activate, options=dict(options), exact=exact)

    prepare.options_class = ScaleOptions
    return prepare


@pytest.fixture
def registry() -> AccelerationRegistry:
    reg = AccelerationRegistry(discover=False)
    reg.register("exact_test", _scale_factory("exact_test", exact=True))
    reg.register("approx_test", _scale_factory("approx_test", exact=False))
    reg.register("nan_test", _scale_factory("nan_test", exact=False, nan=True))
    reg.register("fail_test", _scale_factory("fail_test", exact=False, fail=True))
    reg.register("liar_test", _scale_factory("liar_test", exact=True))
    return reg


def _write(tmp_path: Path, candidates: list[dict], **extra: Any) -> Path:
    data = {"workload": {"prompt": "a red square", "frames": 5, "height": 32, "width": 32, "steps": 2,
                         "guidance": 5.0, "seeds": [1]}, "candidates": candidates, **extra}
    path = tmp_path / "candidates.json"
    path.write_text(json.dumps(data))
    return path


def test_verdict_for_each_path(tmp_path: Path, registry: AccelerationRegistry) -> None:
    path = _write(tmp_path, [
        {"name": "exact", "accelerations": {"exact_test": {}}},
        {"name": "never", "accelerations": {"exact_test": {"record": False}}},
        {"name": "nan", "accelerations": {"nan_test": {}}},
        {"name": "fails", "accelerations": {"fail_test": {}}},
        {"name": "tradeoff", "accelerations": {"approx_test": {"factor": 3.0}}},
        {"name": "liar", "accelerations": {"liar_test": {"factor": 1.01}}},
    ])
    out = tmp_path / "out"
    results = run_bench(BenchConfig(model="tiny-wan2.1", candidates=str(path), out=str(out), rounds=3,
                                    progress=False), registry=registry)
    verdicts = {c["name"]: c["verdict"] for c in results["candidates"]}
    assert verdicts["exact"] in ("recommended", "no_stable_gain", "noisy_host")
    assert verdicts["never"] == "invalid_not_executed"
    assert verdicts["nan"] == "invalid_nonfinite"
    assert verdicts["fails"] == "rejected_at_install"
    assert verdicts["tradeoff"] == "measured_quality_tradeoff"
    assert verdicts["liar"] == "invalid_exactness_claim"
    by = {c["name"]: c for c in results["candidates"]}
    assert by["exact"]["quality"]["worst"]["bitwise_equal"] is True
    assert len(by["exact"]["speed"]["speedups"]) >= 3 and by["tradeoff"]["speed"] is not None
    assert "never executed" in " ".join(by["never"]["missing"])
    assert "activation refused" in by["fails"]["error"]
    # the harness itself must not change the model
    assert results["dense"]["stable_after_candidates"] is True
    assert results["noise_floor"] >= 1.0 and len(results["dense"]["control"]["speedups"]) >= CONTROL_MIN_ROUNDS
    assert results["timing_policy"]["gc"] and gc.isenabled()
    saved = json.loads((out / "results.json").read_text())
    assert saved["candidates"][0]["quality"]["worst"]["psnr_db"] == "inf"
    for key in ("revision", "dirty"):
        assert key in saved["git"]
    for key in ("python", "torch", "diffusers", "device"):
        assert key in saved["environment"]
    assert saved["inputs"][0]["path"] == str(path) and "size" in saved["inputs"][0] and "mtime" in saved["inputs"][0]
    assert saved["random_weights"] is True
    report = (out / "report.md").read_text()
    assert "| exact |" in report and "rejected_at_install" in report and "Random weights" in report
    # where the wall time went: the phases add up to no more than the whole, each candidate has its own
    walls = saved["wall_s"]
    assert set(walls) == {"plan", "load", "dense_and_control", "candidates", "total"}
    assert all(v >= 0 for v in walls.values())
    assert walls["plan"] + walls["load"] + walls["dense_and_control"] + walls["candidates"] <= walls["total"]
    assert abs(sum(c["wall_s"] for c in saved["candidates"]) - walls["candidates"]) < 1e-6
    assert f"- wall: {walls['total']:.0f} s (planning {walls['plan']:.0f} s, model load" in report
    assert "6 candidates" in report
    assert (out / "speedup.png").stat().st_size > 1000 and (out / "quality_vs_speed.png").stat().st_size > 1000


def test_quality_only_skips_timing(tmp_path: Path, registry: AccelerationRegistry) -> None:
    path = _write(tmp_path, [{"name": "exact", "accelerations": {"exact_test": True}}])
    results = run_bench(BenchConfig(candidates=str(path), out=str(tmp_path / "o"), quality_only=True,
                                    progress=False), registry=registry)
    assert results["candidates"][0]["verdict"] == "quality_only"
    assert results["candidates"][0]["speed"] is None


def test_the_bench_compiles_fusion_kernels_before_first_fused_calls_and_restores_the_default(
        tmp_path: Path, registry: AccelerationRegistry, monkeypatch) -> None:
    from worldfoundry.core.fusion.compile_pool import default_compile_mode, set_default_compile_mode

    seen: list[str] = []

    def record(*args: Any, **kwargs: Any) -> None:
        seen.append(default_compile_mode())
        raise RuntimeError("stop here")

    monkeypatch.setattr(harness, "_run", record)
    path = _write(tmp_path, [{"name": "exact", "accelerations": {"exact_test": True}}])
    previous = set_default_compile_mode("background")
    try:
        with pytest.raises(RuntimeError, match="stop here"):
            run_bench(BenchConfig(candidates=str(path), out=str(tmp_path / "o"), quality_only=True,
                                  progress=False), registry=registry)
        # pilots prove execution and rounds time the steady state: kernel_compile auto -> blocking while it runs
        assert seen == ["blocking"] and default_compile_mode() == "background"
    finally:
        set_default_compile_mode(previous)


@pytest.mark.parametrize(
    ("mutate", "path"),
    [
        (lambda d: d["candidates"][0]["accelerations"]["exact_test"].update(factor="big"),
         "candidates[0].accelerations.exact_test.factor: expected number"),
        (lambda d: d["candidates"][0]["accelerations"]["exact_test"].update(colour=1),
         "candidates[0].accelerations.exact_test: unknown option(s) ['colour']"),
        (lambda d: d["candidates"][0]["accelerations"]["exact_test"].update(factor=-1.0),
         "candidates[0].accelerations.exact_test.factor: must be >= 0"),
        (lambda d: d["candidates"].append({"name": "x", "accelerations": {"nope": {}}}),
         "candidates[1].accelerations.nope: unknown acceleration"),
        (lambda d: d["workload"].update(steps="four"), "workload.steps: expected integer"),
        (lambda d: d["workload"].update(seeds=[1, "2"]), "workload.seeds[1]: expected integer"),
        (lambda d: d.update(quality_budget={"psnr_db": "high"}), "quality_budget.psnr_db: expected number"),
        (lambda d: d.update(timing={"rounds": 2}), "timing.rounds: at least 3"),
        (lambda d: d.update(timing={"time_budget_s": 0}), "timing.time_budget_s: must be a finite number in [0.1,"),
        (lambda d: d.update(timing={"width_pool_s": -1.0}), "timing.width_pool_s: must be a finite number in [0,"),
        (lambda d: d.update(timing={"width_pool_s": "lots"}), "timing.width_pool_s: expected number"),
        (lambda d: d.update(timing={"budget": 6}), "timing.budget: unknown key; known: rounds, time_budget_s"),
        (lambda d: d["candidates"].append({"name": "b", "accelerations": {"exact_test": 3}}),
         "candidates[1].accelerations.exact_test: expected an options object"),
        (lambda d: d["candidates"].append(dict(d["candidates"][0])), "candidates[1].name: duplicate"),
        (lambda d: d.update(extra=1), "$.extra: unknown key"),
    ],
)
def test_schema_errors_name_the_json_path(registry: AccelerationRegistry, mutate, path: str) -> None:
    data = {"workload": {"steps": 2, "seeds": [1]}, "candidates": [{"name": "a", "accelerations": {"exact_test": {}}}]}
    mutate(data)
    with pytest.raises(CandidateSchemaError) as info:
        parse_candidates(data, registry=registry)
    assert str(info.value).startswith(path), str(info.value)


def test_the_file_s_time_budget_and_width_pool_apply_unless_the_command_line_sets_them(
        registry: AccelerationRegistry) -> None:
    data = {"workload": {"steps": 2, "seeds": [1]}, "timing": {"time_budget_s": 6, "width_pool_s": 40.5},
            "candidates": [{"name": "a", "accelerations": {"exact_test": {}}}]}
    cfile = parse_candidates(data, registry=registry)
    assert (cfile.time_budget_s, cfile.width_pool_s) == (6.0, 40.5)
    resolved = harness.with_file_timing(BenchConfig(), cfile)
    assert (resolved.time_budget_s, resolved.width_pool_s) == (6.0, 40.5)
    given = harness.with_file_timing(BenchConfig(time_budget_s=2.0, width_pool_s=0.0), cfile)
    assert (given.time_budget_s, given.width_pool_s) == (2.0, 0.0)  # an explicit 0 turns the pool off
    plain = harness.with_file_timing(BenchConfig(), parse_candidates(
        {k: v for k, v in data.items() if k != "timing"}, registry=registry))
    assert (plain.time_budget_s, plain.width_pool_s) == (harness.DEFAULT_TIME_BUDGET_S, 0.0)


def test_schema_error_before_loading_anything(tmp_path: Path, registry: AccelerationRegistry, monkeypatch) -> None:
    path = _write(tmp_path, [{"name": "a", "accelerations": {"exact_test": {"factor": "x"}}}])

    def no_load(*args, **kwargs):
        raise AssertionError("the model must not be loaded for an invalid candidate file")

    monkeypatch.setattr(harness.NativeDiffusionPipeline, "from_pretrained", no_load)
    with pytest.raises(CandidateSchemaError):
        run_bench(BenchConfig(candidates=str(path), out=str(tmp_path / "o"), progress=False), registry=registry)


def test_dirty_tree_is_marked_and_can_be_refused(tmp_path: Path, registry: AccelerationRegistry, monkeypatch) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    (repo / "a.txt").write_text("1")
    subprocess.run(["git", "add", "a.txt"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-qm", "x"], cwd=repo, check=True)
    assert git_state(repo)["dirty"] is False
    (repo / "a.txt").write_text("2")
    state = git_state(repo)
    assert state["dirty"] is True and state["changed"] == ["a.txt"] and len(state["revision"]) == 40
    monkeypatch.setattr(harness, "git_state", lambda root: state)
    path = _write(tmp_path, [{"name": "a", "accelerations": {"exact_test": {}}}])
    with pytest.raises(DirtyTreeError):
        run_bench(BenchConfig(candidates=str(path), out=str(tmp_path / "o"), require_clean=True, progress=False),
                  registry=registry)
    results = run_bench(BenchConfig(candidates=str(path), out=str(tmp_path / "o"), quality_only=True,
                                    progress=False), registry=registry)
    assert results["git"]["dirty"] is True
    assert "DIRTY TREE" in (tmp_path / "o" / "report.md").read_text()


def test_metrics_against_hand_computed_values() -> None:
    ref = torch.tensor([3.0, 4.0])
    assert relative_l2(torch.tensor([3.0, 4.0]), ref) == 0.0
    assert math.isclose(relative_l2(torch.tensor([3.0, 5.0]), ref), 1.0 / 5.0)
    a = np.zeros((1, 8, 8, 3), dtype=np.uint8)
    b = a.copy()
    assert psnr(a, b) == math.inf
    b[...] = 10  # MSE = 100 -> PSNR = 10 log10(255^2 / 100)
    assert math.isclose(psnr(b, a), 10 * math.log10(255.0**2 / 100.0))
    rng = np.random.RandomState(0)
    frames = rng.randint(0, 256, size=(3, 16, 16, 3)).astype(np.uint8)
    assert frame_ssim(frames, frames) == [1.0, 1.0, 1.0]
    noisy = np.clip(frames.astype(int) + rng.randint(-40, 40, frames.shape), 0, 255).astype(np.uint8)
    assert all(0.0 < s < 1.0 for s in frame_ssim(noisy, frames))


def test_bootstrap_ci_shape_and_decisions() -> None:
    ratios = [1.10, 1.12, 1.08, 1.11, 1.09]
    low, high = bootstrap_ci(ratios)
    assert low <= float(np.median(ratios)) <= high and low > 1.0
    assert bootstrap_ci([1.0, 1.0, 1.0]) == (1.0, 1.0)
    speed = {"ci95": [1.02, 1.2]}
    kw = dict(installed=True, finite=True, executed=True, exact_ok=True, timing_ok=True, quality_ok=True,
              speed=speed, gpu_shared=False)
    assert decide(**kw) == "recommended"
    assert decide(**{**kw, "speed": {"ci95": [0.97, 1.1]}}) == "no_stable_gain"
    assert decide(**{**kw, "quality_ok": False}) == "measured_quality_tradeoff"
    assert decide(**{**kw, "gpu_shared": True}) == "refused_shared_gpu"
    assert decide(**{**kw, "timing_ok": False}) == "invalid_timing_mismatch"
    # a CI lower bound above 1 but inside the dense-vs-dense noise floor is not a stable gain
    assert decide(**{**kw, "noise_floor": 1.05}) == "no_stable_gain"
    assert decide(**{**kw, "noise_floor": 1.01}) == "recommended"


def test_report_renders_without_timing(tmp_path: Path) -> None:
    results = {"model": "m", "git": {"revision": "abc", "dirty": False}, "environment": {"device": "cpu"},
               "budget": {"latent_rel_l2": 0.03, "psnr_db": 33.0, "min_ssim": 0.98}, "workload": {},
               "seeds": [1], "rounds": 0, "dense": {}, "candidates": [
                   {"name": "x", "verdict": "rejected_at_install", "accelerations": {"a": {}}, "error": "boom"}]}
    text = write_report(results, tmp_path).read_text()
    assert "rejected_at_install" in text and "boom" in text


def test_report_names_a_speedup_taken_against_the_run_dense_floor(tmp_path: Path) -> None:
    speed = {"speedup": 1.51, "ci95": [1.50, 1.52], "halfwidth": 0.007, "rounds": 5, "dense_excess": 0.417,
             "dense_floor_source": "run_reference", "pair_estimate": {"speedup": 2.097, "ci95": [2.070, 2.107]},
             "candidate_host_share": 0.04}
    host_bound = {**speed, "dense_floor_source": "pair", "candidate_host_share": 0.97, "speedup": 1.32}
    results = {"model": "m", "git": {"revision": "abc", "dirty": False}, "environment": {"device": "cpu"},
               "budget": {"latent_rel_l2": 0.03, "psnr_db": 33.0, "min_ssim": 0.98}, "workload": {},
               "seeds": [1], "rounds": 5, "dense": {}, "candidates": [
                   {"name": "stack", "verdict": "recommended", "accelerations": {"a": {}}, "speed": speed},
                   {"name": "eager", "verdict": "recommended", "accelerations": {"b": {}}, "speed": host_bound}]}
    text = write_report(results, tmp_path).read_text()
    assert ("speedup against the run's dense floor: this pair's dense arm stayed 42% above the run's dense floor "
            "(host slow phase), and the candidate was device-bound (host busy 4% of its steps); against its own "
            "dense arm 2.097× [2.070, 2.107]") in text
    assert "the candidate was host-bound too (host busy 97% of its steps), so its own pair's estimate stands" in text
    assert "lower bound divided by 1 + that excess (1.059) clears the threshold" in text  # 1.50 / 1.417


def test_report_marks_a_verdict_that_had_not_settled_when_its_rounds_ended(tmp_path: Path) -> None:
    def row(name: str, verdict: str, ci: list[float]) -> dict:
        speed = {"speedup": sum(ci) / 2, "ci95": ci, "halfwidth": 0.01, "rounds": 5, "stopped": "run_budget"}
        return {"name": name, "verdict": verdict, "accelerations": {name: {}}, "speed": speed}

    results = {"model": "m", "git": {"revision": "abc", "dirty": False}, "environment": {"device": "cpu"},
               "budget": {"latent_rel_l2": 0.03, "psnr_db": 33.0, "min_ssim": 0.98}, "workload": {},
               "seeds": [1], "rounds": 5, "dense": {},
               "timing_policy": {"min_rounds": 4, "max_rounds": 20, "target_halfwidth": 0.02, "budget_s": 6.0,
                                 "max_noise_floor": 1.05, "threshold": 1.02, "verdict_margin": 0.01,
                                 "extend_factor": 2.0},
               "candidates": [row("close", "recommended", [1.025, 1.06]), row("straddles", "no_stable_gain",
                                                                            [0.99, 1.04]),
                              row("clear", "recommended", [1.2, 1.3]), row("slower", "no_stable_gain", [0.8, 0.9])]}
    text = write_report(results, tmp_path).read_text()
    assert ("verdict not settled: CI [1.025, 1.060] against the threshold 1.020 (margin 1.0%) when its rounds ended "
            "(run_budget, 5 rounds); a repeat run may give the other verdict") in text
    assert "CI [0.990, 1.040] against the threshold" in text
    assert text.count("verdict not settled") == 2


def test_report_names_a_gain_that_only_the_noise_floor_held_back(tmp_path: Path) -> None:
    """Run Y of the twentieth H200 lease: `cuda-graph` at 1.041× [1.038, 1.041] under a noise floor of 1.049."""
    def row(name: str, verdict: str, ci: list[float]) -> dict:
        speed = {"speedup": ci[1], "ci95": ci, "halfwidth": 0.002, "rounds": 4, "stopped": "target"}
        return {"name": name, "verdict": verdict, "accelerations": {name: {}}, "speed": speed}

    results = {"model": "m", "git": {"revision": "abc", "dirty": False}, "environment": {"device": "cpu"},
               "budget": {"latent_rel_l2": 0.03, "psnr_db": 33.0, "min_ssim": 0.98}, "workload": {},
               "seeds": [1], "rounds": 4, "dense": {}, "noise_floor": 1.049, "min_gain": 0.02,
               "decision_threshold": 1.049,
               "candidates": [row("held", "no_stable_gain", [1.038, 1.041]),
                              row("under-gain", "no_stable_gain", [1.01, 1.04]),
                              row("clear", "recommended", [1.45, 1.47])]}
    text = write_report(results, tmp_path).read_text()
    assert ("held back by this run's noise floor: CI [1.038, 1.041] clears 1 + the minimum gain (1.020) but not the "
            "noise floor (1.049)") in text
    assert text.count("held back by this run's noise floor") == 1
    results["noise_floor"] = 1.003  # a quiet host: the floor withholds nothing
    assert "held back" not in write_report(results, tmp_path).read_text()
