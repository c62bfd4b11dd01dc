"""Shared pieces of the LightVAE benchmarks: codec loading, synthetic clips, timing, memory, quality, provenance.

Not a benchmark itself; imported by ``lightvae.py``, ``lightvae_encoder.py``, ``lightvae_fp8.py`` and
``calibrate_plugins.py`` in this directory.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from worldfoundry.base_models.diffusion_model.codec import (
    WanVideoCodec,
    load_wan_video_codec,
    random_wan_video_codec,
)

RANDOM_WEIGHTS_NOTE = (
    "random weights: decoded-RGB quality numbers say nothing about the real codecs; only time and memory "
    "are meaningful"
)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_codec(path: str | None, variant: str, device: str, seed: int, **kwargs: Any) -> WanVideoCodec:
    """The codec from ``path`` through worldfoundry's loader, or seeded random weights when ``path`` is None."""
    if path:
        return load_wan_video_codec(path, variant, device, torch.float32, **kwargs)
    if kwargs.get("fp8_calibration") is not None:
        return load_wan_video_codec(None, variant, device, torch.float32, seed=seed, **kwargs)
    return random_wan_video_codec(variant, device=device, seed=seed)


def synthetic_clip(seed: int, frames: int, height: int, width: int) -> torch.Tensor:
    """A smooth, moving, seeded test video ``(1, 3, frames, H, W)`` in [-1, 1] (sums of drifting sinusoids)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(frames, dtype=torch.float32).view(frames, 1, 1)
    y = torch.linspace(0, 1, height).view(1, height, 1)
    x = torch.linspace(0, 1, width).view(1, 1, width)
    channels = []
    for _ in range(3):
        acc = torch.zeros(frames, height, width)
        for _ in range(4):
            fy, fx = (torch.rand(2, generator=g) * 6 + 1).tolist()
            vy, vx, phase = (torch.rand(3, generator=g) * 0.2).tolist()
            acc += torch.sin(2 * math.pi * (fy * (y + vy * t) + fx * (x + vx * t)) + phase * 10)
        channels.append(acc / 4)
    return torch.stack(channels).unsqueeze(0).clamp(-1, 1).contiguous()


def load_or_make_clips(paths: Sequence[str] | None, seeds: Sequence[int], frames: int, height: int,
                       width: int) -> list[tuple[str, torch.Tensor]]:
    """Clips from ``.pt`` files, or synthetic clips named ``synthetic:<seed>`` when no file is given."""
    from worldfoundry.base_models.diffusion_model.codec_fp8 import load_clip

    if paths:
        return [(p, load_clip(p, frames)) for p in paths]
    return [(f"synthetic:{s}", synthetic_clip(s, frames, height, width)) for s in seeds]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[torch.Tensor, float, float | None]:
    """Run ``fn`` once: ``(output, milliseconds, extra peak GB over what was allocated before)``."""
    sync(device)
    base = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    ms = (time.perf_counter() - start) * 1e3
    peak = (torch.cuda.max_memory_allocated(device) - base) / 1e9 if base is not None else None
    return out, ms, peak


def interleaved_rounds(candidates: dict[str, Callable[[], torch.Tensor]], device: torch.device, *, rounds: int,
                       warmup: int = 1, keep: Callable[[str, torch.Tensor], None] | None = None) -> dict[str, dict[str, Any]]:
    """Warm up each candidate, then ``rounds`` interleaved rounds (a, b, c, a, b, c, ...); medians reported.

    ``keep(name, output)`` sees the output of each candidate's first timed round (for quality checks); all
    outputs are checked finite.
    """
    for _ in range(warmup):
        for fn in candidates.values():
            out, _, _ = measure(fn, device)
            del out
    samples: dict[str, dict[str, list[float]]] = {n: {"ms": [], "peak_gb": []} for n in candidates}
    finite = dict.fromkeys(candidates, True)
    for r in range(rounds):
        for name, fn in candidates.items():
            out, ms, peak = measure(fn, device)
            finite[name] = finite[name] and bool(torch.isfinite(out).all())
            samples[name]["ms"].append(ms)
            if peak is not None:
                samples[name]["peak_gb"].append(peak)
            if r == 0 and keep is not None:
                keep(name, out)
            del out
    results = {}
    for name, s in samples.items():
        results[name] = {
            "median_ms": statistics.median(s["ms"]),
            "min_ms": min(s["ms"]),
            "max_ms": max(s["ms"]),
            "rounds_ms": s["ms"],
            "peak_extra_gb": max(s["peak_gb"]) if s["peak_gb"] else None,
            "finite": finite[name],
        }
    return results


def to_uint8_frames(video: torch.Tensor) -> np.ndarray:
    """BCTHW in [-1, 1] -> ``(T, H, W, 3)`` uint8 of the first batch item."""
    frames = ((video[0].detach().float().clamp(-1, 1).permute(1, 2, 3, 0) + 1.0) * 127.5).round()
    return frames.to(torch.uint8).cpu().numpy()


def video_quality(test: torch.Tensor, reference: torch.Tensor, *, max_frames: int | None = None) -> dict[str, Any]:
    """PSNR (dB, whole clip) and SSIM (mean and minimum per frame) of uint8 frames, with scikit-image."""
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    a, b = to_uint8_frames(test), to_uint8_frames(reference)
    if max_frames is not None and a.shape[0] > max_frames:
        idx = np.linspace(0, a.shape[0] - 1, max_frames).round().astype(int)
        a, b = a[idx], b[idx]
    psnr = float(peak_signal_noise_ratio(b, a, data_range=255)) if not np.array_equal(a, b) else float("inf")
    ssim = [float(structural_similarity(b[i], a[i], channel_axis=-1, data_range=255)) for i in range(a.shape[0])]
    return {"psnr_db": psnr, "ssim_mean": float(np.mean(ssim)), "ssim_min": float(np.min(ssim)),
            "frames_compared": int(a.shape[0])}


def relative_l2(test: torch.Tensor, reference: torch.Tensor) -> float:
    ref = reference.double()
    return float((test.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def provenance(args: Any, inputs: Sequence[str | None] = ()) -> dict[str, Any]:
    """Git revision and dirty flag, versions, device, configuration and input file sizes/mtimes."""
    import diffusers

    def git(*cmd: str) -> str | None:
        try:
            return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    files = {}
    for p in inputs:
        if p and Path(p).is_file():
            st = Path(p).stat()
            files[p] = {"size_bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    info: dict[str, Any] = {
        "git_revision": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain")) if git("rev-parse", "HEAD") else None,
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "diffusers": str(diffusers.__version__),
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "allow_tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "config": {k: v for k, v in vars(args).items()},
        "inputs": files,
    }
    return info


def write_json(out_dir: str | os.PathLike[str], name: str, data: dict[str, Any]) -> Path:
    path = Path(os.fspath(out_dir))
    path.mkdir(parents=True, exist_ok=True)
    target = path / name
    target.write_text(json.dumps(data, indent=2, default=str))
    return target


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A small fixed-width table (printed last by each benchmark)."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(str(h).ljust(w) for h, w in zip(header, widths, strict=True)))
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def parse_shape(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.replace("x", ",").split(",") if v)
