"""Candidate files: the benchmark's input, validated completely before anything is loaded.

Schema (``docs/benchmarks.md`` documents it with an example)::

    {
      "model": "tiny-wan2.1",                      # optional; --model overrides
      "workload": {"prompt": str, "negative_prompt": str, "frames": int, "height": int, "width": int,
                   "steps": int, "guidance": number, "shift": number, "seeds": [int, ...]},
      "quality_budget": {"latent_rel_l2": number, "psnr_db": number, "min_ssim": number},   # optional
      "timing": {"rounds": int, "time_budget_s": number, "width_pool_s": number,          # optional
                 "run_budget_s": number},
      "candidates": [{"name": str, "accelerations": {plugin: {option: value} | true}, "notes": str}, ...]
    }

The whole file is validated before any model is built and before ``--out`` is created: the file must be a
regular UTF-8 file of at most :data:`MAX_CANDIDATE_FILE_BYTES` holding strict JSON (no duplicate keys, no
``NaN``/``Infinity``, nesting at most :data:`MAX_DEPTH` deep, integers within 64 bits); every workload number is
bounded (frames, sizes, steps, finite guidance and shift, non-negative seeds), budgets are finite, candidate
names are non-empty, unique and plain, and every plugin's options are built with its registered options class
(``registry.get(name).options.from_mapping(value, path="candidates[i].accelerations.<name>")``). Checks that
need the model's recipe (frame counts the codec accepts, sizes divisible by patch × codec stride) are in
:mod:`worldfoundry.bench.workload`.

Every error is a :class:`~worldfoundry.errors.CandidateSchemaError` naming the JSON path, e.g.
``candidates[2].accelerations.easycache.threshold: expected number``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from worldfoundry.bench.candidate_options import shown, validate_plugin_options
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.model_loading.input_files import (
    MAX_JSON_FLOAT,
    MAX_JSON_INT,
    parse_json_bytes,
    read_input_bytes,
)
from worldfoundry.errors import CandidateSchemaError, InputFileError, JsonInputError

DEFAULT_BUDGET = {"latent_rel_l2": 0.03, "psnr_db": 33.0, "min_ssim": 0.98}
WORKLOAD_KEYS = {"prompt": str, "negative_prompt": str, "frames": int, "height": int, "width": int, "steps": int,
                 "guidance": float, "shift": float, "seeds": list}
TOP_KEYS = {"model", "description", "workload", "quality_budget", "timing", "candidates"}
#: Largest candidate file accepted, deepest nesting, most candidates and seeds.
MAX_CANDIDATE_FILE_BYTES = 4 << 20
MAX_DEPTH = 32
MAX_CANDIDATES = 256
MAX_SEEDS = 256
MAX_TEXT = 10_000
#: Inclusive bounds of the workload numbers.
WORKLOAD_BOUNDS: dict[str, tuple[float, float]] = {
    "frames": (1, 4096), "height": (1, 16384), "width": (1, 16384), "steps": (1, 10_000),
    "guidance": (-1000.0, 1000.0), "shift": (1e-6, 1000.0),
}
#: Inclusive bounds of the quality budget (each must be finite).
BUDGET_BOUNDS: dict[str, tuple[float, float]] = {"latent_rel_l2": (0.0, 1e6), "psnr_db": (0.0, 1000.0),
                                                 "min_ssim": (-1.0, 1.0)}
#: Candidate names: used in request ids, reports and tables.
CANDIDATE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=@,:\-]{0,127}")


@dataclass(frozen=True)
class Candidate:
    name: str
    accelerations: dict[str, dict[str, Any]]
    notes: str = ""


@dataclass(frozen=True)
class CandidateFile:
    model: str | None
    workload: dict[str, Any]
    budget: dict[str, float]
    rounds: int | None
    candidates: tuple[Candidate, ...]
    description: str = ""
    source: str | None = None
    raw: dict[str, Any] = field(default_factory=dict)
    #: the file's ``timing.time_budget_s`` / ``timing.width_pool_s`` / ``timing.run_budget_s``: what the run uses
    #: where the command line does not say (``--time-budget`` / ``--width-pool`` / ``--run-budget``); ``None``: not set
    time_budget_s: float | None = None
    width_pool_s: float | None = None
    run_budget_s: float | None = None

    @property
    def seeds(self) -> list[int]:
        return list(self.workload.get("seeds", [42, 43]))


def _type_name(expected: Any) -> str:
    return {int: "integer", float: "number", str: "string", bool: "boolean", list: "list", dict: "object"}.get(
        expected, getattr(expected, "__name__", str(expected))
    )


def _check_type(path: str, value: Any, expected: Any) -> None:
    """Type check with booleans refused as numbers."""
    if expected is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif expected is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, expected)
    if not ok:
        raise CandidateSchemaError(path, f"expected {_type_name(expected)}, got {type(value).__name__} ({shown(value)})")



def _check_json_value(path: str, value: Any, depth: int = 0) -> None:
    """Only JSON values, nested at most :data:`MAX_DEPTH` deep, numbers finite and within 64-bit range.

    Applied to decoded dicts too (``parse_candidates`` may be handed Python objects)."""
    if depth > MAX_DEPTH:
        raise CandidateSchemaError(path, f"nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int):
        if abs(value) > MAX_JSON_INT:
            raise CandidateSchemaError(path, "integer out of range (|n| <= 2**63 - 1)")
    elif isinstance(value, float):
        if not abs(value) <= MAX_JSON_FLOAT:
            raise CandidateSchemaError(path, f"number {value!r} is not finite or out of range")
    elif isinstance(value, str):
        if len(value) > MAX_TEXT:
            raise CandidateSchemaError(path, f"string of {len(value)} characters (limit {MAX_TEXT})")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise CandidateSchemaError(path, f"object keys must be strings, got {shown(key)}")
            _check_json_value(f"{path}.{key}" if path != "$" else key, item, depth + 1)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_json_value(f"{path}[{i}]", item, depth + 1)
    else:
        raise CandidateSchemaError(path, f"not a JSON value ({type(value).__name__})")


def _bounded_number(path: str, value: Any, expected: Any, low: float, high: float) -> None:
    _check_type(path, value, expected)
    if not (math.isfinite(value) and low <= value <= high):
        raise CandidateSchemaError(path, f"must be a finite number in [{low:g}, {high:g}], got {shown(value)}")


def _parse_workload(data: Mapping[str, Any]) -> dict[str, Any]:
    workload = data.get("workload", {})
    if not isinstance(workload, Mapping):
        raise CandidateSchemaError("workload", "expected object")
    for key, value in workload.items():
        if key not in WORKLOAD_KEYS:
            raise CandidateSchemaError(f"workload.{key}", f"unknown key; known: {', '.join(sorted(WORKLOAD_KEYS))}")
        _check_type(f"workload.{key}", value, WORKLOAD_KEYS[key])
        if key in ("frames", "height", "width", "steps") and value <= 0:
            raise CandidateSchemaError(f"workload.{key}", f"must be > 0, got {value}")
        if key in WORKLOAD_BOUNDS:
            _bounded_number(f"workload.{key}", value, WORKLOAD_KEYS[key], *WORKLOAD_BOUNDS[key])
        elif isinstance(value, str) and len(value) > MAX_TEXT:
            raise CandidateSchemaError(f"workload.{key}", f"longer than {MAX_TEXT} characters")
    seeds = workload.get("seeds", [42, 43])
    if not seeds:
        raise CandidateSchemaError("workload.seeds", "needs at least one seed")
    if len(seeds) > MAX_SEEDS:
        raise CandidateSchemaError("workload.seeds", f"at most {MAX_SEEDS} seeds, got {len(seeds)}")
    for i, seed in enumerate(seeds):
        check_seed(f"workload.seeds[{i}]", seed)
    return dict(workload)


def check_seed(path: str, seed: Any) -> None:
    """A seed is an integer in ``[0, 2**63 - 1]``.

    Raises:
        CandidateSchemaError: otherwise (``path`` names it).
    """
    _check_type(path, seed, int)
    if not 0 <= seed <= MAX_JSON_INT:
        raise CandidateSchemaError(path, f"seeds must be integers in [0, 2**63 - 1], got {seed}")


def _parse_budget(data: Mapping[str, Any]) -> dict[str, float]:
    budget = dict(DEFAULT_BUDGET)
    raw_budget = data.get("quality_budget", {})
    if not isinstance(raw_budget, Mapping):
        raise CandidateSchemaError("quality_budget", "expected object")
    for key, value in raw_budget.items():
        if key not in DEFAULT_BUDGET:
            raise CandidateSchemaError(f"quality_budget.{key}", f"unknown key; known: {', '.join(DEFAULT_BUDGET)}")
        _bounded_number(f"quality_budget.{key}", value, float, *BUDGET_BOUNDS[key])
        budget[key] = float(value)
    return budget


#: Keys of ``timing`` and the bounds of its seconds (``time_budget_s`` and ``run_budget_s`` must be positive).
TIMING_KEYS: Final = ("rounds", "time_budget_s", "width_pool_s", "run_budget_s")
MAX_TIMING_SECONDS: Final = 86_400.0


def _parse_timing(data: Mapping[str, Any]) -> tuple[int | None, float | None, float | None, float | None]:
    """``(rounds, time_budget_s, width_pool_s, run_budget_s)`` of the file's ``timing`` (``None`` where not set)."""
    timing = data.get("timing", {})
    if not isinstance(timing, Mapping):
        raise CandidateSchemaError("timing", "expected object")
    for key in timing:
        if key not in TIMING_KEYS:
            raise CandidateSchemaError(f"timing.{key}", f"unknown key; known: {', '.join(TIMING_KEYS)}")
    rounds = timing.get("rounds")
    if rounds is not None:
        _check_type("timing.rounds", rounds, int)
        if rounds < 3:
            raise CandidateSchemaError("timing.rounds", f"at least 3 paired rounds are required, got {rounds}")
        if rounds > 10_000:
            raise CandidateSchemaError("timing.rounds", f"at most 10000 rounds, got {rounds}")
    seconds: list[float | None] = []
    for key, low in (("time_budget_s", 0.1), ("width_pool_s", 0.0), ("run_budget_s", 1.0)):
        value = timing.get(key)
        if value is not None:
            _bounded_number(f"timing.{key}", value, float, low, MAX_TIMING_SECONDS)
        seconds.append(None if value is None else float(value))
    return rounds, seconds[0], seconds[1], seconds[2]


def _parse_candidate(i: int, cand: Any, names: set[str], registry: AccelerationRegistry) -> Candidate:
    path = f"candidates[{i}]"
    if not isinstance(cand, Mapping):
        raise CandidateSchemaError(path, "expected object")
    extra = sorted(set(cand) - {"name", "accelerations", "notes"})
    if extra:
        raise CandidateSchemaError(f"{path}.{extra[0]}", "unknown key; known: name, accelerations, notes")
    name = cand.get("name")
    _check_type(f"{path}.name", name, str)
    if not CANDIDATE_NAME.fullmatch(name):
        raise CandidateSchemaError(
            f"{path}.name", f"{shown(name)} is not a candidate name: 1-128 characters, letters, digits and ._+=@,:- "
            "starting with a letter or digit")
    if name in names or name == "dense":
        raise CandidateSchemaError(f"{path}.name", f"duplicate or reserved name {name!r}")
    names.add(name)
    accel = cand.get("accelerations")
    if not isinstance(accel, Mapping) or not accel:
        raise CandidateSchemaError(f"{path}.accelerations", "expected a non-empty object name -> options")
    spec: dict[str, dict[str, Any]] = {}
    for plugin, options in accel.items():
        ppath = f"{path}.accelerations.{plugin}"
        if options is True:
            options = {}
        if not isinstance(options, Mapping):
            raise CandidateSchemaError(ppath, f"expected an options object or true, got {type(options).__name__}")
        validate_plugin_options(ppath, plugin, options, registry)
        spec[plugin] = dict(options)
    notes = cand.get("notes", "")
    _check_type(f"{path}.notes", notes, str)
    return Candidate(name, spec, notes)


def parse_candidates(data: Any, *, registry: AccelerationRegistry, source: str | None = None) -> CandidateFile:
    """Validate a decoded candidate file (a mapping) completely; nothing is loaded or created.

    Raises:
        CandidateSchemaError: the first invalid value, with its JSON path.
    """
    if not isinstance(data, Mapping):
        raise CandidateSchemaError("$", "the top level must be an object")
    _check_json_value("$", data)
    unknown = sorted(set(data) - TOP_KEYS)
    if unknown:
        raise CandidateSchemaError(f"$.{unknown[0]}", f"unknown key; known: {', '.join(sorted(TOP_KEYS))}")
    model = data.get("model")
    if model is not None:
        _check_type("model", model, str)
        if not model.strip():
            raise CandidateSchemaError("model", "expected a recipe name or a recipe file path, got an empty string")
    description = data.get("description", "")
    _check_type("description", description, str)
    workload = _parse_workload(data)
    budget = _parse_budget(data)
    rounds, time_budget_s, width_pool_s, run_budget_s = _parse_timing(data)
    raw_candidates = data.get("candidates")
    if not isinstance(raw_candidates, list) or not raw_candidates:
        raise CandidateSchemaError("candidates", "expected a non-empty list")
    if len(raw_candidates) > MAX_CANDIDATES:
        raise CandidateSchemaError("candidates", f"at most {MAX_CANDIDATES} candidates, got {len(raw_candidates)}")
    names: set[str] = set()
    candidates = [_parse_candidate(i, cand, names, registry) for i, cand in enumerate(raw_candidates)]
    return CandidateFile(model, workload, budget, rounds, tuple(candidates), description, source, dict(data),
                         time_budget_s, width_pool_s, run_budget_s)


def _schema_path(path: str) -> str:
    """``$.workload.frames`` (a JSON reader's path) -> ``workload.frames`` (the schema's spelling)."""
    return path if path == "$" else path.removeprefix("$.").removeprefix("$")


def load_candidates(path: str | os.PathLike[str], *, registry: AccelerationRegistry) -> CandidateFile:
    """Read and validate a candidate file; nothing else is read, loaded or created.

    Raises:
        CandidateSchemaError: the file is missing, a directory or special file, too large, not UTF-8, not strict
            JSON, or any value is invalid; the message names the JSON path (``$`` for the whole file).
    """
    file = os.fspath(path)
    try:
        data = read_input_bytes(file, what="candidate file", max_bytes=MAX_CANDIDATE_FILE_BYTES)
        tree = parse_json_bytes(data, source=file, max_depth=MAX_DEPTH)
    except InputFileError as exc:
        raise CandidateSchemaError("$", str(exc)) from exc
    except JsonInputError as exc:
        raise CandidateSchemaError(_schema_path(exc.path), f"{exc.file}: {str(exc).split(': ', 2)[-1]}") from exc
    return parse_candidates(tree, registry=registry, source=file)
