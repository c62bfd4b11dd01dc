"""Writing decoded frames to MP4 (imageio with the ffmpeg binary of ``imageio-ffmpeg``).

Without ``imageio-ffmpeg`` imageio would hand an ``.mp4`` path to another plugin that cannot write video;
:func:`require_mp4_support` turns that into a :class:`~worldfoundry.errors.MissingDependencyError` before
anything is written (the command line calls it before a generation starts).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from worldfoundry.errors import InvalidRequestError, MissingDependencyError

MP4_PACKAGE = "imageio-ffmpeg"


def mp4_unavailable_reason() -> str | None:
    """``None`` when MP4 files can be written and read here, else why not (one line)."""
    try:
        import imageio_ffmpeg
    except ImportError as exc:
        return f"imageio_ffmpeg is not importable: {exc}"
    try:
        imageio_ffmpeg.get_ffmpeg_exe()
    except (RuntimeError, OSError) as exc:
        return f"no ffmpeg executable: {exc}"
    return None


def require_mp4_support() -> None:
    """Raise unless MP4 files can be written and read here.

    Raises:
        MissingDependencyError: ``imageio-ffmpeg`` (or its ffmpeg binary) is missing.
    """
    reason = mp4_unavailable_reason()
    if reason is not None:
        raise MissingDependencyError("MP4 output", MP4_PACKAGE, reason)


def write_mp4(frames: np.ndarray, path: str | os.PathLike[str], *, fps: int = 16) -> str:
    """Write ``(F, H, W, 3)`` uint8 frames as an H.264 MP4.

    Args:
        frames: ``(F, H, W, 3)`` uint8.
        path: output file; its parent directories are created.
        fps: frames per second.

    Returns:
        The path written.

    Raises:
        InvalidRequestError: frames of the wrong shape or dtype.
        MissingDependencyError: ``imageio-ffmpeg`` is not installed.
    """
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise InvalidRequestError(f"frames: expected (F, H, W, 3) uint8, got {frames.shape} {frames.dtype}")
    require_mp4_support()
    import imageio.v2 as imageio

    out = Path(os.fspath(path))
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = imageio.get_writer(str(out), format="FFMPEG", fps=fps, codec="libx264", macro_block_size=1,
                                quality=8, ffmpeg_log_level="error")
    try:
        for frame in frames:
            writer.append_data(frame)
    finally:
        writer.close()
    return str(out)


def read_mp4(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an MP4 back as ``(F, H, W, 3)`` uint8 frames.

    Raises:
        MissingDependencyError: ``imageio-ffmpeg`` is not installed.
    """
    require_mp4_support()
    import imageio.v2 as imageio

    reader = imageio.get_reader(os.fspath(path), format="FFMPEG")
    try:
        return np.stack([np.asarray(f) for f in reader])
    finally:
        reader.close()
