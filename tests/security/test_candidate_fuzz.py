"""Property: whatever a candidate file holds, validating it never raises anything but a typed WorldFoundryError,
never builds a model and never creates ``--out``.

Documents start from a valid file and are mutated at every schema location (top level, workload, budget,
timing, candidate fields and each registered plugin's own option names) with arbitrary JSON values, including
NaN/Infinity tokens, 70-bit integers, deep nesting and duplicate keys; some are raw bytes.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worldfoundry.bench import harness
from worldfoundry.bench.harness import BenchConfig, BenchPlan, plan_bench
from worldfoundry.core.acceleration.registry import diffusion_acceleration_registry
from worldfoundry.errors import CandidateSchemaError, WorldFoundryError

REGISTRY = diffusion_acceleration_registry()


def _option_names(name: str) -> list[str]:
    entry = REGISTRY.get(name)
    options = getattr(entry, "options", None) or getattr(entry.factory, "options_class", None)
    known = getattr(options, "known_options", None)
    if callable(known):
        return list(known())
    fields = getattr(options, "__dataclass_fields__", {})
    return list(fields) or ["x"]


PLUGINS = list(REGISTRY.names())
SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def _base() -> dict[str, Any]:
    return {"model": "tiny-wan2.1",
            "workload": {"prompt": "p", "frames": 5, "height": 32, "width": 32, "steps": 2, "guidance": 5.0,
                         "shift": 3.0, "seeds": [1]},
            "quality_budget": {"latent_rel_l2": 0.03, "psnr_db": 33.0, "min_ssim": 0.98},
            "timing": {"rounds": 3},
            "candidates": [{"name": "c0", "accelerations": {"easycache": {"threshold": 0.0}}}]}


@st.composite
def mutated(draw) -> str:
    doc = _base()
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.sampled_from(["top", "workload", "quality_budget", "timing", "candidate", "plugin", "drop"]))
        value = draw(VALUES)
        if where == "top":
            doc[draw(st.sampled_from(["model", "description", "workload", "candidates", "extra"]))] = value
        elif where in ("workload", "quality_budget", "timing") and isinstance(doc.get(where), dict):
            keys = list(_base()[where]) + ["unknown"]
            doc[where][draw(st.sampled_from(keys))] = value
        elif where == "candidate" and isinstance(doc.get("candidates"), list) and doc["candidates"]:
            cand = doc["candidates"][0]
            if isinstance(cand, dict):
                cand[draw(st.sampled_from(["name", "accelerations", "notes", "unknown"]))] = value
        elif where == "plugin" and PLUGINS:
            plugin = draw(st.sampled_from(PLUGINS))
            key = draw(st.sampled_from(_option_names(plugin)))
            doc["candidates"] = [{"name": "p", "accelerations": {plugin: {key: value}}}]
        elif where == "drop":
            doc.pop(draw(st.sampled_from(sorted(doc))), None)
    text = json.dumps(doc, allow_nan=True)
    style = draw(st.sampled_from(["plain", "duplicate", "deep", "truncated"]))
    if style == "duplicate":
        text = text.replace('"workload": {', '"workload": {"steps": 1, ', 1)
    elif style == "deep":
        depth = draw(st.integers(10, 5000))
        text = text[:-1] + ', "description": ' + "[" * depth + "]" * depth + "}"
    elif style == "truncated":
        text = text[: draw(st.integers(0, max(0, len(text) - 1)))]
    return text


@pytest.fixture(autouse=True)
def _no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("validation built a model")

    monkeypatch.setattr(harness.NativeDiffusionPipeline, "from_pretrained", refuse)


def _check(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.json"
        path.write_bytes(data)
        out = Path(tmp) / "out"
        try:
            plan = plan_bench(BenchConfig(candidates=str(path), out=str(out), progress=False), registry=REGISTRY)
        except CandidateSchemaError as exc:
            assert exc.path and str(exc).startswith(exc.path)
        except WorldFoundryError:
            pass
        else:
            assert isinstance(plan, BenchPlan)
        assert not out.exists()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutated_candidate_files_fail_typed_or_plan(text: str) -> None:
    _check(text.encode("utf-8"))


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_fail_typed(data: bytes) -> None:
    _check(data)
