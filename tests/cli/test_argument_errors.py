"""Every argument mistake is one typed line on stderr, exit status 2, naming the flag and what to do, found
before any work starts; a failed bench leaves no empty output directory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from worldfoundry.base_models.diffusion_model.pipeline import NativeDiffusionPipeline
from worldfoundry.cli.main import build_parser, main

# the flags a CPU build and a CUDA machine both refuse: no CUDA at all, or an index beyond the visible GPUs
UNUSABLE_CUDA = "cuda:99" if torch.cuda.is_available() else "cuda"


def one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"worldfoundry {command}: "), err
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail the test if a command gets as far as loading a model (arguments must be checked first)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(NativeDiffusionPipeline, "from_pretrained", refuse)


@pytest.mark.parametrize("command", ["bench", "generate"])
def test_unusable_cuda_device(tmp_path, capsys, no_model_loading, command):
    extra = ["--out", str(tmp_path / ("out" if command == "bench" else "x.pt"))]
    assert main([command, "--device", UNUSABLE_CUDA, *extra]) == 2
    err = one_line_error(capsys, command)
    assert f"--device: {UNUSABLE_CUDA}" in err
    assert ("use --device cpu" in err) if UNUSABLE_CUDA == "cuda" else ("CUDA device(s) visible" in err)
    assert not (tmp_path / "out").exists() and not (tmp_path / "x.pt").exists()


def test_not_a_device_name(tmp_path, capsys, no_model_loading):
    assert main(["generate", "--device", "gpu0", "--out", str(tmp_path / "x.pt")]) == 2
    assert "not a device; use cpu, cuda or cuda:N" in one_line_error(capsys, "generate")


def test_bench_out_that_is_a_file(tmp_path, capsys, no_model_loading):
    target = tmp_path / "results.json"
    target.write_text("{}")
    assert main(["bench", "--out", str(target)]) == 2
    assert "--out: " in (err := one_line_error(capsys, "bench")) and "is a file; pass a directory" in err
    assert target.read_text() == "{}"


@pytest.mark.parametrize("case", ["directory", "under_a_file", "suffix"])
def test_generate_out_is_checked_before_generating(tmp_path, capsys, no_model_loading, case):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = {"directory": tmp_path, "under_a_file": blocker / "clip.mp4", "suffix": tmp_path / "clip.gif"}[case]
    assert main(["generate", "--prompt", "x", "--out", str(out)]) == 2
    err = one_line_error(capsys, "generate")
    expected = {"directory": "is a directory; pass a file name", "under_a_file": "is a file, not a directory",
                "suffix": "must end in .mp4 or .pt"}[case]
    assert "--out: " in err and expected in err


def test_generate_mp4_without_imageio_ffmpeg_is_refused_before_generating(tmp_path, capsys, monkeypatch,
                                                                          no_model_loading):
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)
    assert main(["generate", "--prompt", "x", "--out", str(tmp_path / "clip.mp4")]) == 2
    err = one_line_error(capsys, "generate")
    assert "pip install imageio-ffmpeg" in err and "--out NAME.pt" in err


def test_generate_image_that_is_missing_or_not_an_image(tmp_path, capsys, no_model_loading):
    out = str(tmp_path / "x.pt")
    assert main(["generate", "--recipe", "tiny-wan2.1-i2v", "--image", str(tmp_path / "nope.png"), "--out", out]) == 2
    assert "--image: " in (err := one_line_error(capsys, "generate")) and "nope.png: missing (no such file)" in err
    fake = tmp_path / "fake.png"
    fake.write_text("not an image")
    assert main(["generate", "--recipe", "tiny-wan2.1-i2v", "--image", str(fake), "--out", out]) == 2
    assert "cannot be read as an image" in one_line_error(capsys, "generate")


def test_image_to_video_without_image_names_the_flag(tmp_path, capsys, no_model_loading):
    assert main(["generate", "--recipe", "tiny-wan2.1-i2v", "--prompt", "x", "--out", str(tmp_path / "x.pt")]) == 2
    err = one_line_error(capsys, "generate")
    assert "--image: " in err and "image-to-video" in err and "DiffusionRequest" not in err


def test_generate_unknown_recipe(tmp_path, capsys, no_model_loading):
    assert main(["generate", "--recipe", "tiny-wan9", "--out", str(tmp_path / "x.pt")]) == 2
    assert "unknown recipe 'tiny-wan9'" in one_line_error(capsys, "generate")


def test_estimate_residency_unknown_recipe_says_so(tmp_path, capsys):
    assert main(["estimate-residency", "--recipe", "no-such-recipe", "--device", "cpu",
                 "--out", str(tmp_path / "o")]) == 2
    err = one_line_error(capsys, "estimate-residency")
    assert "unknown recipe 'no-such-recipe'" in err and "--frames" not in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["bench", "generate", "estimate-residency"])
def test_missing_checkpoint_dir_is_called_missing(tmp_path, capsys, no_model_loading, command):
    missing = tmp_path / "Wan2.1-T2V-1.3B-Diffusers"
    args = {"bench": ["bench", "--out", str(tmp_path / "o")],
            "generate": ["generate", "--out", str(tmp_path / "x.pt")],
            "estimate-residency": ["estimate-residency", "--recipe", "tiny-wan2.1", "--device", "cpu",
                                   "--out", str(tmp_path / "o")]}[command]
    assert main([*args, "--checkpoint-dir", str(missing)]) == 2
    err = one_line_error(capsys, command)
    assert f"--checkpoint-dir: {missing}: missing (no such directory)" in err
    assert not (tmp_path / "o").exists()


def test_bench_help_names_the_real_default_model(monkeypatch):
    from worldfoundry.bench.harness import DEFAULT_MODEL

    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps help at hyphens otherwise
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    assert f"else {DEFAULT_MODEL})" in " ".join(bench.format_help().split())


def test_a_failed_bench_leaves_no_empty_output_directory(tmp_path, capsys):
    out = tmp_path / "bench_out"
    assert main(["bench", "--model", "tiny-wan9", "--quality-only", "--out", str(out), "--no-progress"]) == 2
    assert "unknown recipe 'tiny-wan9'" in one_line_error(capsys, "bench")
    assert not out.exists()
    out.mkdir()  # a directory that was there before is the user's: it stays
    assert main(["bench", "--model", "tiny-wan9", "--quality-only", "--out", str(out), "--no-progress"]) == 2
    assert out.is_dir()


def test_estimate_residency_device_and_out_are_checked_first(tmp_path, capsys):
    target = tmp_path / "config.json"
    target.write_text("{}")
    assert main(["estimate-residency", "--recipe", "tiny-wan2.1", "--device", "cpu", "--out", str(target)]) == 2
    assert "--out: " in (err := one_line_error(capsys, "estimate-residency")) and "is a file" in err
    assert main(["estimate-residency", "--recipe", "tiny-wan2.1", "--device", UNUSABLE_CUDA,
                 "--out", str(tmp_path / "o")]) == 2
    assert f"--device: {UNUSABLE_CUDA}" in one_line_error(capsys, "estimate-residency")
    assert not (tmp_path / "o").exists()


def test_bench_unknown_peer_is_refused_before_any_work(tmp_path, capsys, no_model_loading):
    assert main(["bench", "--out", str(tmp_path / "out"), "--peers", "eager,cachedit"]) == 2
    err = one_line_error(capsys, "bench")
    assert "--peers: unknown peer(s) cachedit; known: eager, compile, fbcache, dbcache, float8" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("given", "names"), [(["eager,compile"], ["eager", "compile"]),
                                              (["eager", "fbcache"], ["eager", "fbcache"]), ([], ["all"])])
def test_bench_peers_separated_by_commas_or_spaces(given, names):
    from worldfoundry.cli.bench_cmd import peer_names

    assert peer_names(given) == names
    assert peer_names(None) is None
