"""SHA256 of files, computed once per (path, size, mtime) in this process (artifacts bind to weights by digest)."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading

logger = logging.getLogger(__name__)

_HASH_CACHE: dict[tuple[str, int, int], str] = {}
_HASH_LOCK = threading.Lock()


def file_sha256(path: str | os.PathLike[str]) -> str:
    """SHA256 of a file, computed once per (path, size, mtime) in this process."""
    real = os.path.realpath(os.fspath(path))
    stat = os.stat(real)
    key = (real, stat.st_size, stat.st_mtime_ns)
    with _HASH_LOCK:
        cached = _HASH_CACHE.get(key)
    if cached is not None:
        return cached
    digest = hashlib.sha256()
    with open(real, "rb") as handle:
        for block in iter(functools.partial(handle.read, 1 << 22), b""):
            digest.update(block)
    value = digest.hexdigest()
    with _HASH_LOCK:
        _HASH_CACHE[key] = value
    logger.info("sha256 %s = %s", real, value)
    return value

__all__ = ["file_sha256"]
