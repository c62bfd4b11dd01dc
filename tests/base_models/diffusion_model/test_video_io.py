"""MP4 writing needs imageio-ffmpeg; without it the error is typed, names the package and nothing is written."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from worldfoundry.base_models.diffusion_model.video_io import (
    mp4_unavailable_reason,
    read_mp4,
    require_mp4_support,
    write_mp4,
)
from worldfoundry.errors import InvalidRequestError, MissingDependencyError

FRAMES = np.zeros((5, 16, 16, 3), dtype=np.uint8)


def test_without_imageio_ffmpeg_the_error_names_the_package(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # import imageio_ffmpeg now raises ImportError
    assert mp4_unavailable_reason().startswith("imageio_ffmpeg is not importable")
    out = tmp_path / "sub" / "v.mp4"
    with pytest.raises(MissingDependencyError, match="pip install imageio-ffmpeg") as info:
        write_mp4(FRAMES, out)
    assert info.value.package == "imageio-ffmpeg" and "\n" not in str(info.value)
    assert not out.exists() and not out.parent.exists()
    with pytest.raises(MissingDependencyError):
        read_mp4(out)


def test_bad_frames_are_refused_before_the_dependency_check(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)
    with pytest.raises(InvalidRequestError, match="uint8"):
        write_mp4(FRAMES.astype(np.float32), tmp_path / "v.mp4")


@pytest.mark.skipif(mp4_unavailable_reason() is not None, reason=f"no MP4 support here: {mp4_unavailable_reason()}")
def test_round_trip_where_ffmpeg_is_installed(tmp_path) -> None:
    require_mp4_support()
    frames = np.full((5, 16, 16, 3), 128, dtype=np.uint8)
    path = write_mp4(frames, tmp_path / "v.mp4", fps=8)
    back = read_mp4(path)
    assert back.shape == frames.shape
    assert np.abs(back.astype(np.int16) - 128).mean() < 8  # lossy codec
