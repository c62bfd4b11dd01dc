"""The benchmark run: dense pilots, then per candidate install -> pilot -> quality -> execution proof ->
interleaved paired timing -> verdict; finally results.json, report.md and plots."""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Final

import torch
from tqdm.auto import tqdm

from worldfoundry.bench.candidates import Candidate, CandidateFile
from worldfoundry.bench.execution import prove_execution
from worldfoundry.bench.metrics import quality, relative_l2, within_budget
from worldfoundry.bench.preflight import ModelChoice, check_workload, resolve_model
from worldfoundry.bench.provenance import (
    GpuSharingMonitor,
    artifact_paths,
    environment,
    file_stat,
    git_state,
    tree_stats,
)
from worldfoundry.bench.report import write_plots, write_report, write_results
from worldfoundry.bench.floor import MIN_ROUNDS as FLOOR_MIN_ROUNDS
from worldfoundry.bench.floor import DenseFloorReference
from worldfoundry.bench.host_gate import HostGate
from worldfoundry.bench.host_speed import host_speed_summary, run_probes
from worldfoundry.bench.retake import needs_retake, retake_control
from worldfoundry.bench.run_budget import RunBudget, budget_item
from worldfoundry.bench.run_pricing import generation_mark, optional_seconds, plan_items, reprice_rows
from worldfoundry.bench.settle import SPEED_VERDICTS, settle_pass, settle_policy, unsettled, wide, width_policy
from worldfoundry.bench.stats import decide, decision_threshold
from worldfoundry.bench.timing import (
    SWITCH_BLOCK,
    Arm,
    Timed,
    TimingPolicy,
    WidthPool,
    bound_violation,
    model_calls,
    noisy_host,
    run_rounds,
    speed_bound,
    switching_pairs,
    timed_generate,
)
from worldfoundry.bench.unavailable import insert_rows, load_available
from worldfoundry.base_models.diffusion_model.pipeline import DiffusionRequest, NativeDiffusionPipeline, resolve_recipe
from worldfoundry.core.acceleration.registry import AccelerationRegistry, diffusion_acceleration_registry
from worldfoundry.core.fusion.compile_pool import set_default_compile_mode
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.core.model_loading.recipes import project_root, recipe_dirs
from worldfoundry.errors import BenchArgumentError, WorldFoundryError

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "tiny-wan2.1-trained"
TIMING_RTOL = 1e-6
#: Dense-vs-dense control pairs always timed (the noise floor).
CONTROL_MIN_ROUNDS = 6


def default_candidates_path() -> Path:
    for d in recipe_dirs():
        path = d / "candidates" / "default.json"
        if path.is_file():
            return path
    return project_root() / "recipes" / "candidates" / "default.json"


@dataclass
class BenchConfig:
    model: str | None = None
    candidates: str | None = None
    out: str = "bench_out"
    checkpoint_dir: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    rounds: int | None = None
    seeds: list[int] | None = None
    quality_only: bool = False
    random_weights: bool = False
    require_clean: bool = False
    progress: bool = True
    target_halfwidth: float = 0.02
    max_rounds: int | None = None
    #: seconds of timing per candidate; ``None``: the candidate file's ``timing.time_budget_s``, else
    #: :data:`DEFAULT_TIME_BUDGET_S`
    time_budget_s: float | None = None
    #: seconds the whole run may add, past their budgets, to candidates whose verdict is decided but whose CI is
    #: still wider than ``target_halfwidth`` (:class:`~worldfoundry.bench.timing.WidthPool`; 0: none); ``None``:
    #: the candidate file's ``timing.width_pool_s``, else 0
    width_pool_s: float | None = None
    #: seconds a run may spend holding timed generations for a fast host phase (:mod:`~worldfoundry.bench.host_gate`);
    #: ``None``: 60 on a GPU (host phases move a host-bound loop by up to 1.8x), 0 on the CPU (the whole
    #: generation is host time there, and the default run should stay near a minute)
    host_hold_s: float | None = None
    #: the whole run's wall-clock limit (:class:`~worldfoundry.bench.run_budget.RunBudget`): rounds past a candidate's
    #: budget and host waits run only while the rest of the run still fits; ``None``: the candidate file's
    #: ``timing.run_budget_s``, else no limit
    run_budget_s: float | None = None
    max_noise_floor: float = 1.05
    #: the smallest gain a ``recommended`` verdict asserts (its CI lower bound above ``1 + min_gain``); ``None``:
    #: the target half-width (a gain finer than the timing resolves is not called stable)
    min_gain: float | None = None
    #: ``step_floor`` or ``paired_median`` (:func:`~worldfoundry.bench.stats.summarize_speed`).
    estimator: str = "step_floor"
    peers: list[str] | None = None
    #: an explicit recipe file (``--recipe-file``); exclusive with ``model``.
    recipe_file: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class DirtyTreeError(WorldFoundryError, RuntimeError):
    """``--require-clean`` was given and the checkout has uncommitted changes."""


class _Runner:
    def __init__(self, pipe: NativeDiffusionPipeline, workload: dict[str, Any], decode: bool,
                 host_gate: HostGate | None = None) -> None:
        self.pipe = pipe
        self.workload = workload
        self.decode = decode
        self.counter = 0
        self.host_gate = host_gate
        #: seconds for timing budgets: the gate's clock leaves its waits out
        self.clock: Callable[[], float] = host_gate.clock if host_gate is not None else time.perf_counter

    def request(self, seed: int, tag: str, *, decode: bool) -> DiffusionRequest:
        self.counter += 1
        w = self.workload
        return DiffusionRequest(
            prompt=w.get("prompt", "a red square moving left across a blue background"),
            negative_prompt=w.get("negative_prompt"), num_frames=w.get("frames"), height=w.get("height"),
            width=w.get("width"), num_inference_steps=w.get("steps"), guidance_scale=w.get("guidance"),
            flow_shift=w.get("shift"), seed=seed, request_id=f"{tag}-s{seed}-{self.counter}",
            output_type="np" if decode and self.decode else "latent", bundle=w.get("bundle"), progress=False,
        )

    def generate(self, seed: int, tag: str, *, decode: bool = False) -> Any:
        return self.pipe.generate(self.request(seed, tag, decode=decode))


@dataclass(frozen=True)
class BenchPlan:
    """A validated run: the candidate file, the chosen recipe, seeds and rounds. Building it loads nothing."""

    candidates_path: str
    cfile: CandidateFile
    choice: ModelChoice
    seeds: list[int]
    rounds: int
    #: ``(index, row)`` of candidates naming accelerations that are not installed (``rejected_at_install`` rows).
    unavailable: list[tuple[int, dict[str, Any]]] = field(default_factory=list)


#: Seconds of timing per candidate when neither the command line nor the candidate file says.
DEFAULT_TIME_BUDGET_S: Final = 60.0


def with_file_timing(config: BenchConfig, cfile: CandidateFile) -> BenchConfig:
    """``config`` with its unset time budget and width pool taken from the candidate file (else the defaults): a
    value given on the command line wins."""
    budget = config.time_budget_s if config.time_budget_s is not None else cfile.time_budget_s
    pool = config.width_pool_s if config.width_pool_s is not None else cfile.width_pool_s
    run = config.run_budget_s if config.run_budget_s is not None else cfile.run_budget_s
    return replace(config, time_budget_s=DEFAULT_TIME_BUDGET_S if budget is None else budget,
                   width_pool_s=0.0 if pool is None else pool, run_budget_s=run)


def plan_bench(config: BenchConfig, *, registry: AccelerationRegistry | None = None,
               announce: Callable[[str], None] | None = None) -> BenchPlan:
    """Validate everything a run needs — candidate file, recipe, workload against the recipe, CLI values — without
    building a model or creating ``config.out``.

    Raises:
        CandidateSchemaError: the candidate file or the workload is invalid (with its JSON path).
        BenchArgumentError: contradictory or out-of-range arguments.
        UnknownRecipeError / RecipeError / InputFileError: the recipe cannot be used.
    """
    registry = registry if registry is not None else diffusion_acceleration_registry()
    candidates_path = config.candidates or str(default_candidates_path())
    cfile, unavailable = load_available(candidates_path, registry=registry)
    choice = resolve_model(config.model, config.recipe_file, cfile, DEFAULT_MODEL, announce)
    check_workload(cfile.workload, resolve_recipe(choice.model)[0], cli_seeds=config.seeds)
    rounds = int(config.rounds or cfile.rounds or 3)
    if not config.quality_only and not 3 <= rounds <= 10_000:
        raise BenchArgumentError(f"rounds: between 3 and 10000 interleaved paired rounds are required, got {rounds}")
    if config.min_gain is not None and not 0.0 <= config.min_gain < 1.0:
        raise BenchArgumentError(f"--min-gain: expected a fraction in [0, 1) (0.02 = 2 %), got {config.min_gain}")
    if config.host_hold_s is not None and not 0.0 <= config.host_hold_s <= 3600.0:
        raise BenchArgumentError(f"--host-hold: expected 0 to 3600 seconds of waiting for a fast host phase "
                                 f"(0 turns it off), got {config.host_hold_s}")
    if config.run_budget_s is not None and not 0.0 < config.run_budget_s <= 86_400.0:
        raise BenchArgumentError(f"--run-budget: expected 0 < seconds <= 86400 for the whole run, got "
                                 f"{config.run_budget_s}")
    return BenchPlan(candidates_path, cfile, choice, list(config.seeds or cfile.seeds), rounds, unavailable)


def run_bench(config: BenchConfig, *, registry: AccelerationRegistry | None = None,
              announce: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run a benchmark and write its outputs to ``config.out``. Returns the results mapping.

    Everything is validated by :func:`plan_bench` before any model is built and before ``config.out`` is created.

    Args:
        announce: called with a one-line message before a recipe file named by a path is read (the CLI prints it).

    Raises:
        CandidateSchemaError: the candidate file or the workload is invalid (nothing was loaded or created).
        BenchArgumentError: contradictory or out-of-range arguments.
        DirtyTreeError: ``require_clean`` and the checkout is dirty.
    """
    entered = time.perf_counter()  # the run budget counts from here: planning is part of the run a user waits for
    registry = registry if registry is not None else diffusion_acceleration_registry()
    plan = plan_bench(config, registry=registry, announce=announce)
    config = with_file_timing(config, plan.cfile)
    candidates_path, cfile, model, seeds, rounds = (plan.candidates_path, plan.cfile, plan.choice.model, plan.seeds,
                                                    plan.rounds)
    _timing_policy(config, rounds)  # bad timing options fail here, before a model is built
    git = git_state(project_root())
    if git.get("dirty") and config.require_clean:
        raise DirtyTreeError(f"the checkout has uncommitted changes ({git['changed'][:5]}); commit them or drop "
                             "--require-clean")
    policy = RuntimePolicy(device=config.device, dtype=config.dtype)
    out_dir = Path(config.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    budget = None if config.quality_only or not config.run_budget_s else RunBudget(config.run_budget_s,
                                                                                    started=entered)
    pipe = NativeDiffusionPipeline.from_pretrained(model, policy=policy, checkpoint_dir=config.checkpoint_dir,
                                                   random_weights=config.random_weights, registry=registry)
    gc.collect()
    gc.freeze()  # the loaded model and libraries: later collections skip them
    # pilots prove execution and rounds time the steady state: fusion kernels compile before a first fused call
    # (``kernel_compile: auto`` -> blocking), never beside timed or proved calls
    compile_mode = set_default_compile_mode("blocking")
    try:
        loaded = time.perf_counter()
        results = _run(pipe, cfile, config, model, seeds, rounds, policy, registry, budget)
        results["wall_s"] = {"plan": started - entered, "load": loaded - started, **results["wall_s"],
                             "total": time.perf_counter() - entered}
        insert_rows(results["candidates"], plan.unavailable)
    finally:
        set_default_compile_mode(compile_mode)
        gc.unfreeze()
        pipe.close()
        config.extra.pop("_timing_policy", None)
        config.extra.pop("_noisy", None)
    results["git"] = git
    results["environment"] = environment(policy.device)
    results["inputs"] = _inputs(candidates_path, config, cfile)
    results["config"] = {"cli": asdict(config), "candidates_file": cfile.raw, "policy": policy.to_json()}
    write_results(results, out_dir)
    write_report(results, out_dir)
    write_plots(results, out_dir)
    return results


def _inputs(candidates_path: str, config: BenchConfig, cfile: CandidateFile) -> list[dict[str, Any]]:
    inputs = [file_stat(candidates_path)]
    if config.checkpoint_dir:
        inputs += tree_stats(config.checkpoint_dir)
    inputs += [file_stat(p) for p in artifact_paths([c.accelerations for c in cfile.candidates])]
    return inputs


def _run(pipe: NativeDiffusionPipeline, cfile: CandidateFile, config: BenchConfig, model: str, seeds: list[int],
         rounds: int, policy: RuntimePolicy, registry: AccelerationRegistry,
         budget: RunBudget | None = None) -> dict[str, Any]:
    gate = None if config.quality_only else HostGate(budget_s=host_hold_s(config))
    began = time.perf_counter()
    runner = _Runner(pipe, cfile.workload, decode=pipe.components.codec is not None, host_gate=gate)
    monitor = GpuSharingMonitor(policy.device)
    dense = {seed: runner.generate(seed, "dense-pilot", decode=True) for seed in seeds}
    results = _results_header(pipe, cfile, model, seeds, 0 if config.quality_only else rounds, config.quality_only,
                              dense)
    steps_per_candidate = 1 + (0 if config.quality_only else rounds)
    bar = tqdm(total=len(cfile.candidates) * steps_per_candidate, disable=not config.progress, desc="bench")
    noise_floor = 1.0
    tpolicy = _timing_policy(config, rounds, len(seeds))
    if budget is not None:
        tpolicy = replace(tpolicy, run_budget=budget)
        plan_items(budget, candidates=len(cfile.candidates), peers=config.peers, device=torch.device(policy.device),
                   tpolicy=tpolicy, gate=gate)
    results["timing_policy"] = {**asdict(replace(tpolicy, width_pool=None, run_budget=None)),
                                "gc": "frozen after loading; paused inside timed requests"}
    if not config.quality_only:
        mark = generation_mark(runner)
        tpolicy, noise_floor = _noise_floor(results, runner, dense, seeds, tpolicy)
        reprice_rows(budget, runner, mark, tpolicy, len(seeds))
    results["noise_floor"] = noise_floor
    tpolicy = _decision_policy(results, config, tpolicy, noise_floor)
    config.extra["_timing_policy"] = tpolicy
    config.extra["_noisy"] = bool(results.get("noisy_host"))
    walls = results["wall_s"] = {"dense_and_control": time.perf_counter() - began, "candidates": 0.0}
    pilots: dict[str, dict[int, Any]] = {}  # of the candidates whose verdict was not settled
    for cand in cfile.candidates:
        t0 = time.perf_counter()
        with budget_item(budget, lambda: optional_seconds(gate, tpolicy)):
            results["candidates"].append(_evaluate(cand, runner, dense, cfile, config, seeds, rounds, policy,
                                                   registry, monitor, bar, noise_floor, keep=pilots))
        results["candidates"][-1]["wall_s"] = time.perf_counter() - t0
        walls["candidates"] += results["candidates"][-1]["wall_s"]
    retake = budget is not None and not config.quality_only and needs_retake(noise_floor, _min_gain(config))
    if budget is not None and not retake and not _pending(results, config):
        budget.release_settle()  # nothing to settle: the price kept for the pass is the peers' slack
    bar.close()
    # the candidates' verdicts and widths before the peers' optional rounds: the peers' mandatory part stays in the
    # run budget's reserve, their rounds past it take what the pass leaves (at W17 on an H200 the peers spent 71 s,
    # 37 s of it optional, and the pass then had no room for two rows still wider than the target)
    _retake_and_settle(results, cfile, pilots, runner, dense, config, seeds, policy, registry, monitor,
                       noise_floor, retake)
    if config.peers and not config.quality_only:
        _time_peers(results, config.peers, runner, dense, seeds, tpolicy)
    after = runner.generate(seeds[0], "dense-after")
    results["dense"]["stable_after_candidates"] = bool(torch.equal(after.latents, dense[seeds[0]].latents))
    results["gpu_sharing"] = monitor.to_json()
    results["host_speed"] = host_speed_summary(run_probes(results))
    results["host_gate"] = gate.to_json() if gate is not None else None
    results["run_budget"] = budget.to_json() if budget is not None else None
    _record_policy_state(results, tpolicy)
    if not results["dense"]["stable_after_candidates"]:
        logger.error("the dense output changed after the candidates ran: the harness or a plugin did not restore")
    return results


def _retake_and_settle(results: dict[str, Any], cfile: CandidateFile, pilots: dict[str, dict[int, Any]],
                       runner: _Runner, dense: dict[int, Any], config: BenchConfig, seeds: list[int],
                       policy: RuntimePolicy, registry: AccelerationRegistry, monitor: GpuSharingMonitor,
                       noise_floor: float, retake: bool) -> None:
    """After every row, before the peers: the noise floor's retake when it was planned, then the settling pass over
    the verdicts still unsettled and the rows still wider than the target (none on a noisy host), each with its wall
    time."""
    walls = results["wall_s"]
    if retake:
        t0 = time.perf_counter()
        noise_floor = _retake_noise_floor(results, cfile, pilots, runner, dense, config, seeds, monitor)
        walls["retake"] = time.perf_counter() - t0
    if pilots and _pending(results, config):
        t0 = time.perf_counter()
        results["settle"] = _settle(results, cfile, pilots, runner, dense, config, seeds, policy, registry, monitor,
                                    noise_floor)
        walls["settle"] = time.perf_counter() - t0


def _results_header(pipe: NativeDiffusionPipeline, cfile: CandidateFile, model: str, seeds: list[int], rounds: int,
                    quality_only: bool, dense: dict[int, Any]) -> dict[str, Any]:
    """``results.json``'s fields known once the dense pilots have run."""
    return {
        "schema": "worldfoundry-bench-results-v1",
        "created": datetime.now(timezone.utc).isoformat(),
        "model": model,
        "random_weights": pipe.components.random_weights,
        "weights": pipe.components.weight_report(),
        "workload": cfile.workload,
        "budget": cfile.budget,
        "seeds": seeds,
        "rounds": rounds,
        "quality_only": quality_only,
        "dense": {"pilot_timings": {str(s): dense[s].timings for s in seeds}},
        "candidates": [],
    }


def _noise_floor(results: dict[str, Any], runner: _Runner, dense: dict[int, Any], seeds: list[int],
                 tpolicy: TimingPolicy) -> tuple[TimingPolicy, float]:
    """Time the control pairs and record the noise floor; on a noisy host the candidates get only their minimum
    rounds (no speed verdict will be given: more rounds would only cost time)."""
    control = _control_pairs(runner, dense, seeds, tpolicy)
    results["dense"]["control"] = control
    noise_floor = max(1.0, control["ci95"][1])
    results["noisy_host"] = noisy_host(noise_floor, tpolicy)
    if results["noisy_host"]:
        logger.warning("%s", results["noisy_host"])
        tpolicy = replace(tpolicy, max_rounds=tpolicy.min_rounds)
        results["timing_policy"]["max_rounds"] = tpolicy.max_rounds
    return tpolicy, noise_floor


def _time_peers(results: dict[str, Any], peers: list[str], runner: _Runner, dense: dict[int, Any], seeds: list[int],
                tpolicy: TimingPolicy) -> None:
    """The peer reference rows (``results["peers"]``) and their wall time."""
    from worldfoundry.bench.peers import run_peers

    t0 = time.perf_counter()
    gate = runner.host_gate

    def item(name: str) -> contextlib.AbstractContextManager[None]:  # each peer is an item of the run budget
        return budget_item(tpolicy.run_budget, lambda: optional_seconds(gate, tpolicy), kind="peer")

    # reference rows get no verdict, so no extension of undecided rounds either; a CI wider than the target may
    # still be narrowed by the width pool, within the peer's fair share of the run budget's slack
    results["peers"] = run_peers(peers, runner, dense, seeds, replace(tpolicy, threshold=None), item=item)
    results["wall_s"]["peers"] = time.perf_counter() - t0


def _record_policy_state(results: dict[str, Any], tpolicy: TimingPolicy) -> None:
    """What the run's shared timing state ended as: the dense floor reference and the width pool's use."""
    if tpolicy.dense_reference is not None:
        results["dense"]["floor_reference_s"] = tpolicy.dense_reference.to_json()
    if tpolicy.width_pool is not None:
        results["timing_policy"]["width_pool"] = tpolicy.width_pool.to_json()


#: The default ``host_hold_s`` on a GPU.
GPU_HOST_HOLD_S = 60.0


def host_hold_s(config: BenchConfig) -> float:
    """The run's total budget for holding timed generations (see :attr:`BenchConfig.host_hold_s`)."""
    if config.host_hold_s is not None:
        return config.host_hold_s
    return GPU_HOST_HOLD_S if str(config.device).startswith("cuda") else 0.0


def _min_gain(config: BenchConfig) -> float:
    return config.target_halfwidth if config.min_gain is None else config.min_gain


def _decision_policy(results: dict[str, Any], config: BenchConfig, tpolicy: TimingPolicy,
                     noise_floor: float) -> TimingPolicy:
    """Record the run's decision threshold and return the candidates' policy with it and the run's dense-floor
    reference (seeded with both arms of the control pairs: each is dense)."""
    results["min_gain"] = _min_gain(config)
    results["decision_threshold"] = decision_threshold(noise_floor, results["min_gain"])
    if config.quality_only:
        return tpolicy
    reference = DenseFloorReference()
    control = results["dense"]["control"]
    for arm in ("dense", "candidate"):
        reference.update((control.get("steps_s") or {}).get(arm) or [], control.get("groups") or [])
    results["timing_policy"]["threshold"] = results["decision_threshold"]
    return replace(tpolicy, threshold=results["decision_threshold"], dense_reference=reference)


def _timing_policy(config: BenchConfig, rounds: int, n_seeds: int = 1) -> TimingPolicy:
    """The candidates' policy; with the step floor every seed is timed at least twice (its CI needs two rounds) and
    every candidate at least :data:`~worldfoundry.bench.floor.MIN_ROUNDS` times."""
    least = max(3, rounds, max(2 * n_seeds, FLOOR_MIN_ROUNDS) if config.estimator == "step_floor" else 0)
    budget = DEFAULT_TIME_BUDGET_S if config.time_budget_s is None else config.time_budget_s
    pool = config.width_pool_s or 0.0
    return TimingPolicy(min_rounds=least, max_rounds=max(least, config.max_rounds or 4 * rounds),
                        target_halfwidth=config.target_halfwidth, budget_s=budget,
                        estimator=config.estimator, max_noise_floor=config.max_noise_floor,
                        width_pool=WidthPool(pool) if pool > 0 else None)


def _control_pair(runner: _Runner, seeds: list[int]) -> Callable[[int], tuple[Timed, Timed]]:
    """Round ``r`` of the dense-vs-dense control pair: two dense generations of the round's seed, timed."""

    def timed(arm: str, seed: int) -> Timed:
        _, seconds, phases = timed_generate(runner, seed, f"control-{arm}")
        return Timed.of(seconds, phases, seed)

    def pair(r: int) -> tuple[Timed, Timed]:
        seed = seeds[r % len(seeds)]
        return timed("a", seed), timed("b", seed)

    return pair


def _control_pairs(runner: _Runner, dense: dict[int, Any], seeds: list[int], policy: TimingPolicy) -> dict[str, Any]:
    """Dense-vs-dense pairs timed like candidate pairs: their speedup CI is the run's noise floor."""
    # one untimed generation through the timed path first: the pilots ran another output path, and the first
    # timed call pays one-off costs (event timers, allocator growth) that would widen the noise floor
    timed_generate(runner, seeds[0], "control-warmup")
    return run_rounds(_control_pair(runner, seeds), control_policy(policy), clock=runner.clock)


def _retake_noise_floor(results: dict[str, Any], cfile: CandidateFile, pilots: dict[str, dict[int, Any]],
                        runner: _Runner, dense: dict[int, Any], config: BenchConfig, seeds: list[int],
                        monitor: GpuSharingMonitor) -> float:
    """Retake the noise floor (:mod:`worldfoundry.bench.retake`): continue the control pair with the run budget's
    slack, then decide the floor, the noisy-host banner, the threshold and every speed verdict again; keep the
    pilots of the verdicts left unsettled. Returns the new noise floor."""
    tpolicy = config.extra["_timing_policy"]
    tpolicy.run_budget.release_settle()  # the retake decides every verdict: it goes before the settling pass
    control, record = retake_control(results["dense"]["control"], _control_pair(runner, seeds),
                                     control_policy(tpolicy), tpolicy.run_budget,
                                     warm=lambda: timed_generate(runner, seeds[0], "control-warmup"),
                                     clock=runner.clock)
    results["dense"]["control"], results["retake"] = control, record
    noise_floor = record["after"]["noise_floor"]
    results["noise_floor"] = noise_floor
    results["noisy_host"] = noisy_host(noise_floor, tpolicy)
    results["decision_threshold"] = decision_threshold(noise_floor, results["min_gain"])
    results["timing_policy"]["threshold"] = results["decision_threshold"]
    tpolicy = config.extra["_timing_policy"] = replace(tpolicy, threshold=results["decision_threshold"])
    config.extra["_noisy"] = bool(results["noisy_host"])
    by_name = {c.name: c for c in cfile.candidates}
    for rec in results["candidates"]:
        if rec.get("speed") and rec.get("verdict") in (*SPEED_VERDICTS, "noisy_host"):
            _decide_record(rec, by_name[rec["name"]], cfile, config, len(seeds), monitor, noise_floor)
    return noise_floor


def _pending(results: dict[str, Any], config: BenchConfig) -> bool:
    """Whether the settling pass has a row to take up: an unsettled verdict or a CI wider than the target (none
    on a noisy host)."""
    tpolicy = config.extra["_timing_policy"]
    return not config.extra.get("_noisy", False) and any(
        unsettled(r, tpolicy) or wide(r, tpolicy) for r in results["candidates"])


def control_policy(policy: TimingPolicy) -> TimingPolicy:
    """The control pairs' policy: at least :data:`CONTROL_MIN_ROUNDS` rounds, up to twice the candidates' rounds,
    twice the time budget and half the target half-width. The noise floor is the upper bound of a bootstrap CI of
    the median, which with 3 rounds is simply the largest ratio (one pair straddling a change of the host's speed
    would declare the whole run noisy), and with the candidates' target half-width it would sit about that far
    above 1."""
    rounds = max(policy.min_rounds, CONTROL_MIN_ROUNDS)
    return replace(policy, min_rounds=rounds, max_rounds=max(2 * policy.max_rounds, rounds),
                   budget_s=2 * policy.budget_s, target_halfwidth=policy.target_halfwidth / 2, width_pool=None,
                   run_budget=None)


def _evaluate(cand: Candidate, runner: _Runner, dense: dict[int, Any], cfile: CandidateFile, config: BenchConfig,
              seeds: list[int], rounds: int, policy: RuntimePolicy, registry: AccelerationRegistry,
              monitor: GpuSharingMonitor, bar: Any, noise_floor: float = 1.0,
              keep: dict[str, dict[int, Any]] | None = None) -> dict[str, Any]:
    """One candidate's record: installation, quality against dense, execution proof, timing and verdict. When its
    speed verdict is not settled (:func:`~worldfoundry.bench.settle.unsettled`) and the run has a run budget, its
    pilots go into ``keep`` for the settling pass."""
    den = runner.pipe.components.denoiser
    record: dict[str, Any] = {"name": cand.name, "accelerations": cand.accelerations, "notes": cand.notes}
    try:
        session = den.install(cand.accelerations, policy, registry=registry)
    except Exception as exc:  # any install failure is a verdict, not a crash
        record.update(verdict="rejected_at_install", error=f"{type(exc).__name__}: {exc}", executed=False)
        bar.update(1 + (0 if config.quality_only else rounds))
        return record
    record["install"] = session.receipt.to_json()
    record["exact_claimed"] = session.receipt.exact
    try:
        pilots, per_seed, proofs = {}, {}, {}
        for seed in seeds:
            res = runner.generate(seed, f"{cand.name}-pilot", decode=True)
            pilots[seed] = res
            per_seed[str(seed)] = quality(res.latents, dense[seed].latents, res.frames, dense[seed].frames)
            proofs[str(seed)] = prove_execution(res.receipts.get("installed"), res.receipts.get("plugins", {}))
        bar.update(1)
        worst = _worst(per_seed)
        checks = within_budget(worst, cfile.budget)
        executed = all(p["executed"] for p in proofs.values())
        record.update(
            quality={"per_seed": per_seed, "worst": worst}, within_budget=checks, executed=executed,
            execution={"per_seed": proofs}, missing=sorted({m for p in proofs.values() for m in p["missing"]}),
            fallbacks=_merge([p["fallbacks"] for p in proofs.values()]),
            skipped=_merge([p["skipped"] for p in proofs.values()]),
        )
        speed, mismatches = None, []
        if not config.quality_only and worst["finite"] and executed:
            tpolicy = config.extra["_timing_policy"]
            speed, mismatches, session = _time_pairs(cand, runner, dense, pilots, seeds, tpolicy, policy, registry,
                                                     monitor, bar, session)
            if tpolicy.dense_reference is not None:  # this pair's dense arm joins the run's reference
                tpolicy.dense_reference.update(speed["steps_s"]["dense"], speed["groups"])
        else:
            bar.update(0 if config.quality_only else rounds)
        record["speed"] = speed
        record["timing_mismatch"] = mismatches
        _decide_record(record, cand, cfile, config, len(seeds), monitor, noise_floor)
        tpolicy = config.extra["_timing_policy"]
        if keep is not None and tpolicy.run_budget is not None and speed is not None:
            # the settling pass may take up any timed row (a retake may unsettle any verdict, the width part takes
            # wide ones); it checks outputs against the latents only
            keep[cand.name] = {seed: SimpleNamespace(latents=res.latents) for seed, res in pilots.items()}
    except Exception as exc:
        logger.exception("candidate %s failed while running", cand.name)
        record.update(verdict="invalid_not_executed", executed=False, error=f"{type(exc).__name__}: {exc}",
                      missing=[f"a request raised {type(exc).__name__}: {exc}"])
    finally:
        if den.session is not None:
            den.session.uninstall()
    return record


def _decide_record(record: dict[str, Any], cand: Candidate, cfile: CandidateFile, config: BenchConfig, n_seeds: int,
                   monitor: GpuSharingMonitor, noise_floor: float) -> None:
    """The receipts bound, its violation and the verdict of a record whose quality, execution and speed are in."""
    worst, speed = record["quality"]["worst"], record["speed"]
    bound = speed_bound(record["skipped"], model_calls(cfile.workload) * n_seeds, plugins=cand.accelerations)
    record["speed_bound"] = bound
    violation = bound_violation(speed, bound, config.extra["_timing_policy"].bound_tolerance)
    record.pop("timing_invalid", None)
    if violation:
        record["timing_invalid"] = violation
    exact_ok = not record["exact_claimed"] or worst["bitwise_equal"]
    record["verdict"] = decide(installed=True, finite=worst["finite"], executed=record["executed"], exact_ok=exact_ok,
                               timing_ok=not record["timing_mismatch"], quality_ok=all(record["within_budget"].values()),
                               speed=speed, gpu_shared=monitor.shared, noise_floor=noise_floor,
                               bound_ok=violation is None, noisy=config.extra.get("_noisy", False),
                               min_gain=_min_gain(config))


def _settle(results: dict[str, Any], cfile: CandidateFile, pilots: dict[str, dict[int, Any]], runner: _Runner,
            dense: dict[int, Any], config: BenchConfig, seeds: list[int], policy: RuntimePolicy,
            registry: AccelerationRegistry, monitor: GpuSharingMonitor, noise_floor: float) -> dict[str, Any]:
    """The settling pass (:mod:`worldfoundry.bench.settle`) over the candidates whose pilots were kept."""
    tpolicy = config.extra["_timing_policy"]
    by_name = {c.name: c for c in cfile.candidates}
    den = runner.pipe.components.denoiser

    def retime(record: dict[str, Any], rules: Callable[[TimingPolicy, dict[str, Any]], TimingPolicy]) -> None:
        cand, kept = by_name[record["name"]], pilots[record["name"]]
        session = den.install(cand.accelerations, policy, registry=registry)
        try:
            mismatches = []
            warm = runner.generate(seeds[0], f"{cand.name}-settle-warm")  # an install's one-off costs, untimed
            if not torch.equal(warm.latents, kept[seeds[0]].latents):
                err = relative_l2(warm.latents, kept[seeds[0]].latents)
                if not err <= TIMING_RTOL:
                    mismatches.append(f"settling pass: candidate output differs from its pilot (rel L2 {err:.3g})")
            prior = record["speed"]
            first = "candidate" if (prior["rounds"] // SWITCH_BLOCK) % 2 == 0 else "dense"  # the candidate's half
            speed, more, _ = _time_pairs(cand, runner, dense, kept, seeds, rules(tpolicy, prior), policy,
                                         registry, monitor, None, session, prior=prior, first=first)
        finally:
            if den.session is not None:
                den.session.uninstall()
        if tpolicy.dense_reference is not None:
            tpolicy.dense_reference.update(speed["steps_s"]["dense"], speed["groups"])
        record["speed"] = speed
        record["timing_mismatch"] = list(record.get("timing_mismatch") or []) + mismatches + more
        _decide_record(record, cand, cfile, config, len(seeds), monitor, noise_floor)

    return settle_pass([r for r in results["candidates"] if r["name"] in pilots], tpolicy,
                       lambda r: retime(r, settle_policy),
                       widen=lambda r, seconds: retime(r, partial(width_policy, budget_s=seconds)))


def _time_pairs(cand: Candidate, runner: _Runner, dense: dict[int, Any], pilots: dict[int, Any], seeds: list[int],
                tpolicy: TimingPolicy, policy: RuntimePolicy, registry: AccelerationRegistry,
                monitor: GpuSharingMonitor, bar: Any, session: Any, *, prior: dict[str, Any] | None = None,
                first: str = "candidate") -> tuple[dict[str, Any], list[str], Any]:
    """Interleaved paired rounds of the denoising loop (:func:`~worldfoundry.bench.timing.switching_pairs`: blocks
    of two rounds, one untimed generation after every install or uninstall, the installed candidate first: its
    pilots were its warm-up); outputs checked against the pilots. ``prior``/``first``: a settling pass continues
    an earlier summary, the side ``first`` names going first (``bar``: ``None`` for no progress)."""
    den = runner.pipe.components.denoiser
    mismatches: list[str] = []
    state = {"session": session}

    def installed() -> bool:
        return state["session"] is not None and state["session"].installed

    def to_dense() -> bool:
        if not installed():
            return False
        state["session"].uninstall()
        return True

    def to_candidate() -> bool:
        if installed():
            return False
        state["session"] = den.install(cand.accelerations, policy, registry=registry)
        return True

    def timed(arm: str, r: int, seed: int) -> Timed:
        monitor.sample()
        out, seconds, phases = timed_generate(runner, seed, f"{cand.name}-timed" if arm == "candidate" else
                                              "dense-timed")
        monitor.sample()
        reference = (pilots if arm == "candidate" else dense)[seed].latents
        if not torch.equal(out.latents, reference):
            err = relative_l2(out.latents, reference)
            if arm == "dense" or not err <= TIMING_RTOL:
                mismatches.append(f"round {r}: {arm} output differs from its pilot (rel L2 {err:.3g})")
        return Timed.of(seconds, phases, seed)

    speed = switching_pairs(
        Arm(to_dense, lambda r, seed: timed("dense", r, seed), lambda seed: runner.generate(seed, "dense-warm")),
        Arm(to_candidate, lambda r, seed: timed("candidate", r, seed),
            lambda seed: runner.generate(seed, f"{cand.name}-warm")),
        seeds, tpolicy, on_round=None if bar is None else lambda: bar.update(1), clock=runner.clock, first=first,
        prior=prior)
    return speed, mismatches, state["session"]


def _worst(per_seed: dict[str, dict[str, Any]]) -> dict[str, Any]:
    values = list(per_seed.values())
    worst: dict[str, Any] = {
        "latent_rel_l2": max(v["latent_rel_l2"] for v in values),
        "bitwise_equal": all(v["bitwise_equal"] for v in values),
        "finite": all(v["finite"] for v in values),
    }
    if all("psnr_db" in v for v in values):
        worst["psnr_db"] = min(v["psnr_db"] for v in values)
        worst["min_ssim"] = min(v["min_ssim"] for v in values)
    return worst


def _merge(items: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for item in items:
        for plugin, counts in item.items():
            target = out.setdefault(plugin, {})
            for key, n in counts.items():
                target[key] = target.get(key, 0) + n
    return out

