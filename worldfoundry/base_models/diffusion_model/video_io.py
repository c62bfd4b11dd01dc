"""Writing decoded frames to MP4 (imageio with its bundled ffmpeg)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from worldfoundry.errors import InvalidRequestError


def write_mp4(frames: np.ndarray, path: str | os.PathLike[str], *, fps: int = 16) -> str:
    """Write ``(F, H, W, 3)`` uint8 frames as an H.264 MP4. Returns the path written."""
    import imageio.v2 as imageio

    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise InvalidRequestError(f"frames: expected (F, H, W, 3) uint8, got {frames.shape} {frames.dtype}")
    out = Path(os.fspath(path))
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = imageio.get_writer(str(out), fps=fps, codec="libx264", macro_block_size=1, quality=8,
                                ffmpeg_log_level="error")
    try:
        for frame in frames:
            writer.append_data(frame)
    finally:
        writer.close()
    return str(out)


def read_mp4(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an MP4 back as ``(F, H, W, 3)`` uint8 frames."""
    import imageio.v2 as imageio

    reader = imageio.get_reader(os.fspath(path))
    try:
        return np.stack([np.asarray(f) for f in reader])
    finally:
        reader.close()
