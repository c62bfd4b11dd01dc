"""Candidate files are validated completely — before any model is built and before ``--out`` exists.

Every case below once crashed with a traceback, was silently accepted, or failed only after the model had loaded
(leaving an empty ``--out``). Each now is a :class:`CandidateSchemaError` naming the JSON path, through the CLI
without a traceback.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from worldfoundry.bench import harness
from worldfoundry.bench.candidates import load_candidates, parse_candidates
from worldfoundry.bench.harness import BenchConfig, plan_bench
from worldfoundry.cli.main import main
from worldfoundry.core.acceleration.registry import diffusion_acceleration_registry
from worldfoundry.errors import CandidateSchemaError

BIG = "1" + "0" * 400  # the integer 10**400 written out (400 digits)


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if a model is built: every case here must be refused before loading."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was built for an invalid candidate file")

    monkeypatch.setattr(harness.NativeDiffusionPipeline, "from_pretrained", refuse)


def _cli(tmp_path: Path, path: Path, capsys, *extra: str) -> tuple[int, str]:
    out = tmp_path / "out"
    rc = main(["bench", "--candidates", str(path), "--out", str(out), "--no-progress", *extra])
    err = capsys.readouterr().err
    assert not out.exists(), "--out was created for an invalid run"
    assert "Traceback" not in err
    return rc, err


def _doc_with(candidate_document, section: str, **values):
    doc = candidate_document()
    doc[section] = {**doc[section], **values}
    return doc


# the files that used to pass the schema and fail only after the model loaded (tiny-wan2.1: temporal stride 4,
# sizes divisible by 16)
AFTER_LOAD = [
    ({"frames": 6}, "workload.frames", "4·k + 1"),
    ({"frames": 8}, "workload.frames", "e.g. 5 or 9"),
    ({"height": 33}, "workload.height", "not divisible by 16"),
    ({"width": 40}, "workload.width", "not divisible by 16"),
    ({"seeds": [-1]}, "workload.seeds[0]", "[0, 2**63 - 1]"),
    ({"seeds": [1, 2**64]}, "workload.seeds[1]", "out of range"),
    ({"steps": 10**7}, "workload.steps", "[1, 10000]"),
    ({"frames": 40_001}, "workload.frames", "[1, 4096]"),
    ({"shift": 0}, "workload.shift", "finite number"),
    ({"guidance": 1e6}, "workload.guidance", "[-1000, 1000]"),
]


@pytest.mark.parametrize(("change", "path", "text"), AFTER_LOAD)
def test_workload_the_model_cannot_run_fails_before_loading(tmp_path, capsys, no_model, candidate_document,
                                                            write_json, change, path, text) -> None:
    cands = write_json(tmp_path / "c.json", _doc_with(candidate_document, "workload", **change))
    rc, err = _cli(tmp_path, cands, capsys)
    assert rc == 2 and f"{path}: " in err and text in err, err


@pytest.mark.parametrize(("raw", "path", "text"), [
    ('"guidance": Infinity', "workload.guidance", "Infinity is not allowed"),
    ('"guidance": NaN', "workload.guidance", "NaN is not allowed"),
    ('"guidance": -Infinity', "workload.guidance", "Infinity is not allowed"),
    ('"frames": 4000000000000000000000000000000', "workload.frames", "out of range"),
    ('"frames": 4e30', "workload.frames", "expected integer"),
    ('"guidance": 1e400', "workload.guidance", "out of range"),
])
def test_non_finite_and_huge_numbers_are_refused(tmp_path, capsys, no_model, candidate_document, raw, path,
                                                 text) -> None:
    doc = candidate_document()
    body = json.dumps(doc).replace('"guidance": 5.0', raw) if "guidance" in raw else \
        json.dumps(doc).replace('"frames": 5', raw)
    (tmp_path / "c.json").write_text(body)
    rc, err = _cli(tmp_path, tmp_path / "c.json", capsys)
    assert rc == 2 and f"{path}: " in err and text in err, err


@pytest.mark.parametrize("plugin,key", [("easycache", "threshold"), ("attention_lora", "scale")])
def test_400_digit_integer_option_is_a_typed_error(tmp_path, capsys, no_model, candidate_document, plugin,
                                                   key) -> None:
    options = {"threshold": 0.0} if plugin == "easycache" else {"path": "a.safetensors", "rank": 4, "scale": 1.0}
    doc = candidate_document(candidates=[{"name": "x", "accelerations": {plugin: options}}])
    text = json.dumps(doc).replace(f'"{key}": {options[key]}', f'"{key}": {BIG}')
    assert BIG in text
    (tmp_path / "c.json").write_text(text)
    rc, err = _cli(tmp_path, tmp_path / "c.json", capsys)
    assert rc == 2 and f"candidates[0].accelerations.{plugin}.{key}: " in err and "out of range" in err, err
    # handed over as a Python int (no JSON parser in between): still typed, never an OverflowError
    doc["candidates"][0]["accelerations"][plugin][key] = 10**400
    with pytest.raises(CandidateSchemaError) as info:
        parse_candidates(doc, registry=diffusion_acceleration_registry())
    assert info.value.path == f"candidates[0].accelerations.{plugin}.{key}"


def test_deep_nesting_is_refused_without_recursion(tmp_path, capsys, no_model) -> None:
    (tmp_path / "c.json").write_text("[" * 100_000 + "]" * 100_000)
    rc, err = _cli(tmp_path, tmp_path / "c.json", capsys)
    assert rc == 2 and "$: " in err and "nesting deeper than" in err
    deep: list = []
    for _ in range(1000):
        deep = [deep]
    with pytest.raises(CandidateSchemaError, match="nested deeper"):
        parse_candidates({"description": "x", "candidates": deep}, registry=diffusion_acceleration_registry())


def test_candidate_path_that_is_a_directory_or_special_file(tmp_path, capsys, no_model) -> None:
    rc, err = _cli(tmp_path, tmp_path, capsys)
    assert rc == 2 and "is a directory" in err and err.count("\n") == 1  # one line, from the first check that sees it
    if Path("/dev/zero").exists():
        rc, err = _cli(tmp_path, Path("/dev/zero"), capsys)
        assert rc == 2 and "character device" in err
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # opening it for reading would block forever: it is refused from its stat
    with pytest.raises(CandidateSchemaError, match="FIFO"):
        load_candidates(fifo, registry=diffusion_acceleration_registry())
    rc, err = _cli(tmp_path, tmp_path / "absent.json", capsys)  # the CLI's argument check or the reader
    assert rc == 2 and ("does not exist" in err or "missing" in err)


def test_duplicate_keys_are_refused_with_their_path(tmp_path, capsys, no_model, candidate_document) -> None:
    text = json.dumps(candidate_document()).replace('"steps": 2', '"steps": 2, "steps": 50')
    (tmp_path / "c.json").write_text(text)
    rc, err = _cli(tmp_path, tmp_path / "c.json", capsys)
    assert rc == 2 and "workload.steps: " in err and "duplicate key 'steps'" in err


def test_non_utf8_file_names_the_offset(tmp_path, capsys, no_model, candidate_document) -> None:
    text = json.dumps(candidate_document()).replace("a red ball", "caf\u00e9")
    (tmp_path / "c.json").write_bytes(text.encode("latin-1"))
    rc, err = _cli(tmp_path, tmp_path / "c.json", capsys)
    assert rc == 2 and "$: " in err and "not UTF-8" in err and "offset" in err


@pytest.mark.parametrize(("budget", "text"), [
    ({"latent_rel_l2": -0.1}, "quality_budget.latent_rel_l2: must be a finite number"),
    ({"psnr_db": -1}, "quality_budget.psnr_db: must be a finite number"),
    ({"min_ssim": 2.0}, "quality_budget.min_ssim: must be a finite number"),
])
def test_negative_or_out_of_range_budgets(tmp_path, capsys, no_model, candidate_document, write_json, budget,
                                          text) -> None:
    cands = write_json(tmp_path / "c.json", _doc_with(candidate_document, "quality_budget", **budget))
    rc, err = _cli(tmp_path, cands, capsys)
    assert rc == 2 and text in err


def test_nan_budget_is_refused(tmp_path, capsys, no_model, candidate_document) -> None:
    text = json.dumps(candidate_document()).replace('"psnr_db": 33.0', '"psnr_db": NaN')
    (tmp_path / "c.json").write_text(text)
    rc, err = _cli(tmp_path, tmp_path / "c.json", capsys)
    assert rc == 2 and "quality_budget.psnr_db: " in err and "NaN" in err
    with pytest.raises(CandidateSchemaError, match="quality_budget.psnr_db"):
        parse_candidates(candidate_document(quality_budget={"psnr_db": float("nan")}),
                         registry=diffusion_acceleration_registry())


@pytest.mark.parametrize(("name", "text"), [
    ("", "is not a candidate name"), ("   ", "is not a candidate name"), ("a|b", "is not a candidate name"),
    ("x" * 129, "is not a candidate name"), ("dense", "reserved"), ("a\nb", "is not a candidate name"),
])
def test_candidate_names_are_plain_unique_and_non_empty(candidate_document, name, text) -> None:
    doc = candidate_document(candidates=[{"name": name, "accelerations": {"easycache": {}}}])
    with pytest.raises(CandidateSchemaError, match=text) as info:
        parse_candidates(doc, registry=diffusion_acceleration_registry())
    assert info.value.path == "candidates[0].name"


def test_plugin_options_are_checked_by_their_options_class(tmp_path, capsys, no_model, candidate_document,
                                                           write_json) -> None:
    doc = candidate_document(candidates=[{"name": "r", "accelerations": {"resident_blocks": {"offload_resident_blocks": -2}}}])
    rc, err = _cli(tmp_path, write_json(tmp_path / "c.json", doc), capsys)
    assert rc == 2 and "candidates[0].accelerations.resident_blocks" in err
    doc = candidate_document(candidates=[{"name": "r", "accelerations": {"resident_blocks": {"config": "/dev/zero"}}}])
    rc, err = _cli(tmp_path, write_json(tmp_path / "c.json", doc), capsys)
    assert rc == 2 and "candidates[0].accelerations.resident_blocks" in err


def test_cli_seeds_and_rounds_are_checked_before_loading(tmp_path, capsys, no_model, candidate_document,
                                                         write_json) -> None:
    cands = write_json(tmp_path / "c.json", candidate_document())
    rc, err = _cli(tmp_path, cands, capsys, "--seeds", "-5")
    assert rc == 2 and "--seeds[0]: " in err
    rc, err = _cli(tmp_path, cands, capsys, "--rounds", "2")
    assert rc == 2 and "rounds" in err
    rc, err = _cli(tmp_path, cands, capsys, "--model", "tiny-wan2.1", "--recipe-file", "x.yaml")
    assert rc == 2 and "either --model or --recipe-file" in err


def test_a_valid_file_plans_without_loading_or_creating_anything(tmp_path, no_model, candidate_document,
                                                                 write_json) -> None:
    cands = write_json(tmp_path / "c.json", candidate_document())
    plan = plan_bench(BenchConfig(candidates=str(cands), out=str(tmp_path / "out"), progress=False))
    assert plan.choice.model == "tiny-wan2.1" and plan.seeds == [1] and plan.rounds == 3
    assert not (tmp_path / "out").exists()
