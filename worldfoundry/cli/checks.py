"""Argument checks shared by the commands: each raises :class:`~worldfoundry.errors.CommandLineError` naming
the flag and what to pass, before any work starts (nothing is loaded, created or written).

Example:
    >>> check_output_dir("bench_out")          # missing is fine: it is created later
    >>> check_device("cpu")
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path

from worldfoundry.errors import CommandLineError, WorldFoundryError


def _first_existing_ancestor(path: Path) -> Path | None:
    for parent in path.absolute().parents:
        if parent.exists():
            return parent
    return None


def _check_parent(path: Path, flag: str) -> None:
    ancestor = _first_existing_ancestor(path)
    if ancestor is not None and not ancestor.is_dir():
        raise CommandLineError(flag, f"{path}: {ancestor} is a file, not a directory; choose another path")
    if ancestor is not None and not os.access(ancestor, os.W_OK):
        raise CommandLineError(flag, f"{path}: {ancestor} is not writable; choose another path")


def check_device(value: str | None, flag: str = "--device") -> None:
    """A device the installed torch can use (``cpu``, ``cuda``, ``cuda:1``); ``None`` is left to the command.

    Raises:
        CommandLineError: not a device name, CUDA unavailable (a CPU build, or no GPU visible), or a CUDA
            index beyond the visible devices.
    """
    if value is None:
        return
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, ValueError, TypeError):
        raise CommandLineError(flag, f"{value!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = (f"this torch ({torch.__version__}) is a CPU build" if torch.version.cuda is None
               else f"this torch ({torch.__version__}) sees no CUDA device")
        raise CommandLineError(flag, f"{value}: CUDA is not available, {why}; use --device cpu or install a "
                                     "CUDA build of torch")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise CommandLineError(flag, f"{value}: only {count} CUDA device(s) visible (cuda:0 .. cuda:{count - 1})")


def check_output_dir(path: str | os.PathLike[str], flag: str = "--out") -> None:
    """An output directory: missing (it is created later) or an existing directory, never a file.

    Raises:
        CommandLineError: ``path`` or a parent is a file, or the nearest existing parent is not writable.
    """
    out = Path(os.fspath(path))
    if out.exists() and not out.is_dir():
        raise CommandLineError(flag, f"{out} is a file; pass a directory (it is created when missing)")
    _check_parent(out, flag)


def check_output_file(path: str | os.PathLike[str], flag: str = "--out", *,
                      suffixes: Iterable[str] | None = None) -> None:
    """An output file: not a directory, its parents creatable, and one of ``suffixes`` when given.

    Raises:
        CommandLineError: ``path`` is a directory, a parent is a file, or the suffix is not accepted.
    """
    out = Path(os.fspath(path))
    if out.is_dir():
        raise CommandLineError(flag, f"{out} is a directory; pass a file name (for example {out / 'clip.mp4'})")
    allowed = tuple(suffixes or ())
    if allowed and out.suffix.lower() not in allowed:
        raise CommandLineError(flag, f"{out}: the file name must end in {' or '.join(allowed)}")
    _check_parent(out, flag)


def check_input_file(path: str | os.PathLike[str] | None, flag: str) -> None:
    """An existing, readable file (``None``: not given, nothing to check).

    Raises:
        CommandLineError: missing, a directory, or unreadable.
    """
    if path is None:
        return
    p = Path(os.fspath(path))
    if not p.exists():
        raise CommandLineError(flag, f"{p}: missing (no such file)")
    if p.is_dir():
        raise CommandLineError(flag, f"{p} is a directory; pass a file")
    if not os.access(p, os.R_OK):
        raise CommandLineError(flag, f"{p}: not readable")


def check_input_dir(path: str | os.PathLike[str] | None, flag: str, what: str = "directory") -> None:
    """An existing directory (``None``: not given).

    Raises:
        CommandLineError: missing or a file.
    """
    if path is None:
        return
    p = Path(os.fspath(path))
    if not p.exists():
        raise CommandLineError(flag, f"{p}: missing (no such directory); pass an existing {what}")
    if not p.is_dir():
        raise CommandLineError(flag, f"{p} is a file; pass a {what}")


def usage_error(command: str, exc: WorldFoundryError | ValueError | OSError) -> int:
    """Print ``worldfoundry <command>: <message>`` (one line) to stderr; returns the exit status 2."""
    message = " ".join(str(exc).split())
    print(f"worldfoundry {command}: {message}", file=sys.stderr)
    return 2


def remove_if_created_and_empty(path: Path, existed_before: bool) -> None:
    """Remove an output directory this run created when the run failed before writing anything into it."""
    if existed_before or not path.is_dir():
        return
    try:
        if not any(path.iterdir()):
            path.rmdir()
    except OSError:  # not empty after all, or not ours to remove: leave it
        pass
