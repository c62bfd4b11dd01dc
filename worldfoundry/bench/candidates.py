"""Candidate files: the benchmark's input, validated completely before anything is loaded.

Schema (``docs/benchmarks.md`` documents it with an example)::

    {
      "model": "tiny-wan2.1",                      # optional; --model overrides
      "workload": {"prompt": str, "negative_prompt": str, "frames": int, "height": int, "width": int,
                   "steps": int, "guidance": number, "shift": number, "seeds": [int, ...]},
      "quality_budget": {"latent_rel_l2": number, "psnr_db": number, "min_ssim": number},   # optional
      "timing": {"rounds": int},                                                          # optional
      "candidates": [{"name": str, "accelerations": {plugin: {option: value} | true}, "notes": str}, ...]
    }

Every error is a :class:`~worldfoundry.errors.CandidateSchemaError` naming the JSON path, e.g.
``candidates[2].accelerations.easycache.threshold: expected number``.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import json
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.errors import AccelerationOptionsError, CandidateSchemaError, UnknownAccelerationError

DEFAULT_BUDGET = {"latent_rel_l2": 0.03, "psnr_db": 33.0, "min_ssim": 0.98}
WORKLOAD_KEYS = {"prompt": str, "negative_prompt": str, "frames": int, "height": int, "width": int, "steps": int,
                 "guidance": float, "shift": float, "seeds": list}
TOP_KEYS = {"model", "description", "workload", "quality_budget", "timing", "candidates"}


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

    @property
    def seeds(self) -> list[int]:
        return list(self.workload.get("seeds", [42, 43]))


def _type_name(expected: Any) -> str:
    return {int: "integer", float: "number", str: "string", bool: "boolean", list: "list", dict: "object"}.get(
        expected, getattr(expected, "__name__", str(expected))
    )


def _check_type(path: str, value: Any, expected: Any) -> None:
    if expected is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif expected is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, expected)
    if not ok:
        raise CandidateSchemaError(path, f"expected {_type_name(expected)}, got {type(value).__name__} ({value!r})")


def _annotation_check(path: str, value: Any, annotation: Any) -> None:
    """Check a JSON value against a dataclass field annotation (numbers, strings, bools, sequences, mappings)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                _annotation_check(path, value, option)
                return
            except CandidateSchemaError:
                continue
        expected = " or ".join(_describe(a) for a in args)
        raise CandidateSchemaError(path, f"expected {expected}, got {type(value).__name__} ({value!r})")
    if annotation is type(None):
        if value is not None:
            raise CandidateSchemaError(path, f"expected null, got {value!r}")
        return
    if annotation is typing.Any or annotation is object:
        return
    if annotation in (int, float, str, bool):
        _check_type(path, value, annotation)
        return
    if origin in (tuple, list, collections.abc.Sequence) or annotation in (tuple, list):
        if not isinstance(value, list | tuple):
            raise CandidateSchemaError(path, f"expected list, got {type(value).__name__} ({value!r})")
        inner = args[0] if args else typing.Any
        for i, item in enumerate(value):
            _annotation_check(f"{path}[{i}]", item, inner if inner is not Ellipsis else typing.Any)
        return
    if origin in (dict, collections.abc.Mapping) or annotation is dict:
        if not isinstance(value, Mapping):
            raise CandidateSchemaError(path, f"expected object, got {type(value).__name__}")
        return
    if typing.get_origin(annotation) is typing.Literal:
        if value not in args:
            raise CandidateSchemaError(path, f"expected one of {list(args)}, got {value!r}")


def _describe(annotation: Any) -> str:
    if annotation in (int, float, str, bool):
        return _type_name(annotation)
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def validate_plugin_options(path: str, name: str, options: Mapping[str, Any], registry: AccelerationRegistry) -> None:
    """Validate one plugin's options without a model, using its registered options class when it has one.

    Plugins publish it with ``register(name, prepare, options=Options)`` (``RegisteredAcceleration.options``)."""
    try:
        entry = registry.get(name)
    except UnknownAccelerationError as exc:
        raise CandidateSchemaError(path, f"unknown acceleration {name!r}; known: {', '.join(exc.known) or 'none'}") from exc
    options_class = entry.options
    if options_class is None:
        return
    from_mapping = getattr(options_class, "from_mapping", None)
    fields: dict[str, Any] = {}
    if dataclasses.is_dataclass(options_class):
        hints = typing.get_type_hints(options_class)
        fields = {f.name: hints.get(f.name, typing.Any) for f in dataclasses.fields(options_class) if f.init}
    # spec keys that are not field names (nested or renamed options): the plugin's from_mapping judges them
    if fields and (from_mapping is None or set(options) <= set(fields)):
        for key, value in options.items():
            if key not in fields:
                raise CandidateSchemaError(f"{path}.{key}", f"unknown option; known: {', '.join(sorted(fields))}")
            _annotation_check(f"{path}.{key}", value, fields[key])
    if from_mapping is not None:
        try:
            from_mapping(options)
        except (AccelerationOptionsError, TypeError, ValueError) as exc:
            message = str(exc).removeprefix(f"{getattr(exc, 'plugin', name)}: ")
            key, sep, rest = message.partition(": ")
            if sep and key in options:  # "threshold: must be >= 0" -> path.threshold: must be >= 0
                raise CandidateSchemaError(f"{path}.{key}", rest) from exc
            raise CandidateSchemaError(path, message) from exc


def parse_candidates(data: Any, *, registry: AccelerationRegistry, source: str | None = None) -> CandidateFile:
    """Validate a decoded candidate file (a mapping). Raises :class:`CandidateSchemaError`."""
    if not isinstance(data, Mapping):
        raise CandidateSchemaError("$", "the top level must be an object")
    unknown = sorted(set(data) - TOP_KEYS)
    if unknown:
        raise CandidateSchemaError(f"$.{unknown[0]}", f"unknown key; known: {', '.join(sorted(TOP_KEYS))}")
    model = data.get("model")
    if model is not None:
        _check_type("model", model, str)
    workload = data.get("workload", {})
    if not isinstance(workload, Mapping):
        raise CandidateSchemaError("workload", "expected object")
    for key, value in workload.items():
        if key not in WORKLOAD_KEYS:
            raise CandidateSchemaError(f"workload.{key}", f"unknown key; known: {', '.join(sorted(WORKLOAD_KEYS))}")
        _check_type(f"workload.{key}", value, WORKLOAD_KEYS[key])
        if key in ("frames", "height", "width", "steps") and value <= 0:
            raise CandidateSchemaError(f"workload.{key}", f"must be > 0, got {value}")
    seeds = workload.get("seeds", [42, 43])
    if not seeds:
        raise CandidateSchemaError("workload.seeds", "needs at least one seed")
    for i, seed in enumerate(seeds):
        _check_type(f"workload.seeds[{i}]", seed, int)
    budget = dict(DEFAULT_BUDGET)
    raw_budget = data.get("quality_budget", {})
    if not isinstance(raw_budget, Mapping):
        raise CandidateSchemaError("quality_budget", "expected object")
    for key, value in raw_budget.items():
        if key not in DEFAULT_BUDGET:
            raise CandidateSchemaError(f"quality_budget.{key}", f"unknown key; known: {', '.join(DEFAULT_BUDGET)}")
        _check_type(f"quality_budget.{key}", value, float)
        budget[key] = float(value)
    timing = data.get("timing", {})
    if not isinstance(timing, Mapping):
        raise CandidateSchemaError("timing", "expected object")
    rounds = timing.get("rounds")
    if rounds is not None:
        _check_type("timing.rounds", rounds, int)
        if rounds < 3:
            raise CandidateSchemaError("timing.rounds", f"at least 3 paired rounds are required, got {rounds}")
    for key in timing:
        if key != "rounds":
            raise CandidateSchemaError(f"timing.{key}", "unknown key; known: rounds")
    raw_candidates = data.get("candidates")
    if not isinstance(raw_candidates, list) or not raw_candidates:
        raise CandidateSchemaError("candidates", "expected a non-empty list")
    names: set[str] = set()
    candidates = []
    for i, cand in enumerate(raw_candidates):
        path = f"candidates[{i}]"
        if not isinstance(cand, Mapping):
            raise CandidateSchemaError(path, "expected object")
        extra = sorted(set(cand) - {"name", "accelerations", "notes"})
        if extra:
            raise CandidateSchemaError(f"{path}.{extra[0]}", "unknown key; known: name, accelerations, notes")
        name = cand.get("name")
        _check_type(f"{path}.name", name, str)
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
        candidates.append(Candidate(name, spec, notes))
    return CandidateFile(model, dict(workload), budget, rounds, tuple(candidates), str(data.get("description", "")),
                         source, dict(data))


def load_candidates(path: str | os.PathLike[str], *, registry: AccelerationRegistry) -> CandidateFile:
    file = Path(os.fspath(path))
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError as exc:
        raise CandidateSchemaError("$", f"candidate file {file} does not exist") from exc
    except json.JSONDecodeError as exc:
        raise CandidateSchemaError("$", f"{file} is not valid JSON: {exc}") from exc
    return parse_candidates(data, registry=registry, source=str(file))
