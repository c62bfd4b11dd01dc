"""``worldfoundry generate`` writes an MP4 (or latents) with the tiny recipe offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from worldfoundry.base_models.diffusion_model.video_io import mp4_unavailable_reason, read_mp4
from worldfoundry.cli.main import main


def test_generate_mp4(tmp_path: Path, capsys) -> None:
    if mp4_unavailable_reason() is not None:  # imageio-ffmpeg is a declared dependency
        pytest.skip(f"no MP4 support in this environment: {mp4_unavailable_reason()}")
    out = tmp_path / "x.mp4"
    rc = main(["generate", "--recipe", "tiny-wan2.1", "--prompt", "a red ball", "--frames", "9", "--steps", "2",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["random_weights"] is True
    assert read_mp4(out).shape == (9, 32, 32, 3)


def test_generate_latents_with_accelerations_error(tmp_path: Path, capsys) -> None:
    out = tmp_path / "x.pt"
    assert main(["generate", "--prompt", "x", "--steps", "1", "--out", str(out), "--no-progress"]) == 0
    assert torch.load(out, weights_only=True)["latents"].shape == (1, 48, 9, 8, 8)  # default: tiny-wan2.1-trained
    rc = main(["generate", "--prompt", "x", "--out", str(out), "--accelerations", '{"no_such_plugin": {}}'])
    assert rc == 2
    assert "no_such_plugin" in capsys.readouterr().err
    assert main(["generate", "--out", str(out), "--accelerations", "{bad json"]) == 2
