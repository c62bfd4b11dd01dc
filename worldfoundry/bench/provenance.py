"""Provenance of a benchmark run: code revision, environment, resolved config and input files.

Input files are described by size and modification time only: checkpoints are never re-hashed per run.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

MAX_LISTED_FILES = 2000


def git_state(root: Path) -> dict[str, Any]:
    """``{"revision", "dirty", "changed"}`` of the checkout at ``root`` (``revision: None`` outside git)."""
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True,
                             timeout=20).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True,
                                check=True, timeout=20).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return {"revision": None, "dirty": None, "changed": []}
    changed = [line[3:] for line in status if line.strip()]
    return {"revision": rev, "dirty": bool(changed), "changed": changed[:50]}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "diffusers": _version("diffusers"),
        "transformers": _version("transformers"),
        "worldfoundry": _version("worldfoundry"),
        "cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(),
        "device": str(device),
    }
    if device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_capability=f"{props.major}.{props.minor}",
                   gpu_memory_gb=round(props.total_memory / 2**30, 1))
    return env


def file_stat(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(os.fspath(path))
    try:
        st = p.stat()
    except OSError:
        return {"path": str(p), "exists": False}
    return {"path": str(p), "exists": True, "size": st.st_size,
            "mtime": datetime.fromtimestamp(st.st_mtime, timezone.utc).isoformat()}


def tree_stats(root: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Size and mtime of every file below ``root`` (capped), sorted by path."""
    out = []
    for path in sorted(Path(os.fspath(root)).rglob("*")):
        if path.is_file():
            out.append(file_stat(path))
            if len(out) >= MAX_LISTED_FILES:
                break
    return out


def artifact_paths(values: Iterable[Any]) -> list[str]:
    """Strings among option values (recursively) that name existing files."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, Mapping):
            for v in value.values():
                walk(v)
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v)
        elif isinstance(value, str) and len(value) < 4096 and os.path.isfile(value):
            found.append(value)

    for value in values:
        walk(value)
    return sorted(set(found))


class GpuSharingMonitor:
    """Samples NVML for compute processes other than this one on the benchmark GPU (``nvidia-ml-py``)."""

    def __init__(self, device: torch.device) -> None:
        self.available = False
        self.shared = False
        self.samples = 0
        self.others: set[int] = set()
        self.reason = "not a CUDA device"
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible:
                index = int(visible.split(",")[index])
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.available = True
            self.reason = ""
        except Exception as exc:  # NVML missing or not permitted: sharing is unknown, say so
            self.reason = f"NVML unavailable: {type(exc).__name__}: {exc}"

    def sample(self) -> None:
        if not self.available:
            return
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except Exception as exc:
            self.reason = f"NVML query failed: {exc}"
            return
        self.samples += 1
        others = {p.pid for p in procs if p.pid != os.getpid()}
        if others:
            self.shared = True
            self.others |= others

    def to_json(self) -> dict[str, Any]:
        return {"nvml_available": self.available, "shared": self.shared if self.available else None,
                "other_pids": sorted(self.others), "samples": self.samples, "note": self.reason}
