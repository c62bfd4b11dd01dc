"""``worldfoundry estimate-residency`` on the CPU (emulated mode) with the offline tiny recipe."""

from __future__ import annotations

import json
from pathlib import Path

from worldfoundry.cli.main import COMMANDS, main
from worldfoundry_resident_blocks.residency_files import (
    CONFIG_FILENAME,
    REPORT_JSON_FILENAME,
    REPORT_MD_FILENAME,
)


def test_command_is_registered() -> None:
    assert COMMANDS["estimate-residency"] == "worldfoundry.cli.estimate_residency_cmd"


def test_estimate_writes_config_and_report(tmp_path: Path, capsys) -> None:
    out = tmp_path / "save_results"
    rc = main(["estimate-residency", "--recipe", "tiny-wan2.1", "--frames", "5", "--height", "32", "--width", "32",
               "--device", "cpu", "--dtype", "float32", "--contiguous", "--warmup", "1", "--samples", "3",
               "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "emulated" in printed and "r = " in printed
    config = json.loads((out / CONFIG_FILENAME).read_text())
    assert set(config) == {"offload_resident_blocks", "cpu_offload_block_contiguous", "resident_block_indices",
                           "num_blocks", "estimate"}
    assert config["estimate"]["rule"] == "schedule"
    assert config["offload_resident_blocks"] == config["estimate"]["schedule_resident"]
    assert "rules: schedule r = " in printed
    assert config["num_blocks"] == 2 and config["cpu_offload_block_contiguous"] is True
    assert len(config["resident_block_indices"]) == config["offload_resident_blocks"]
    report = json.loads((out / REPORT_JSON_FILENAME).read_text())
    assert report["emulated"] is True and report["device"] == "cpu" and report["dtype"] == "float32"
    assert report["layout"] == "contiguous" and report["copies_per_block"] == 1
    assert report["tokens"] == 2 * 2 * 2 and report["input_shapes"]["encoder_hidden_states"]["shape"][1] == 16
    assert len(report["compute"]["samples_ms"]) == 3 and report["compute_ms"] > 0
    assert report["resident"] == config["offload_resident_blocks"]
    assert "re-estimate" in (out / REPORT_MD_FILENAME).read_text()


def test_estimate_errors_exit_2(tmp_path: Path, capsys) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"_class_name": "WanTransformer3DModel", "num_layers": 1}))
    rc = main(["estimate-residency", "--recipe", str(config), "--random-weights", "--device", "cpu",
               "--out", str(tmp_path / "o")])
    assert rc == 2 and "--frames" in capsys.readouterr().err
    rc = main(["estimate-residency", "--recipe", "no-such-recipe", "--frames", "5", "--height", "32", "--width", "32",
               "--device", "cpu", "--out", str(tmp_path / "o")])
    assert rc == 2 and "no-such-recipe" in capsys.readouterr().err
    rc = main(["estimate-residency", "--recipe", "tiny-wan2.1", "--frames", "5", "--height", "32", "--width", "32",
               "--device", "cpu", "--copy-utilisation", "1.5", "--out", str(tmp_path / "o")])
    assert rc == 2 and "--copy-utilisation" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before measuring or writing anything


def test_estimate_sana_video(tmp_path: Path, capsys) -> None:
    out = tmp_path / "sana"
    rc = main(["estimate-residency", "--recipe", "tiny-sana-video", "--frames", "9", "--height", "64", "--width",
               "64", "--device", "cpu", "--dtype", "float32", "--warmup", "1", "--samples", "2", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((out / REPORT_JSON_FILENAME).read_text())
    assert report["family"] == "sana_video" and report["tokens"] == 3 * 4 * 4
    assert report["input_shapes"]["timestep"]["shape"][1] == 1 and report["compute_ms"] > 0
    config = json.loads((out / CONFIG_FILENAME).read_text())
    assert config["num_blocks"] == report["num_blocks"]


def test_budget_rule_from_the_command_line(tmp_path: Path, capsys) -> None:
    out = tmp_path / "budget"
    rc = main(["estimate-residency", "--recipe", "tiny-wan2.1", "--frames", "5", "--height", "32", "--width", "32",
               "--device", "cpu", "--dtype", "float32", "--rule", "budget", "--warmup", "1", "--samples", "2",
               "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    config = json.loads((out / CONFIG_FILENAME).read_text())
    assert config["estimate"]["rule"] == "budget"
    assert config["offload_resident_blocks"] == config["estimate"]["budget_resident"]
