"""Index an immutable safetensors file once and read groups of tensors straight into owned CPU tensors.

:class:`SafetensorsTensorStore` parses and validates the safetensors header itself, remembers the file's
identity (size, modification time, inode, device) and closes the file again. Each :meth:`read` opens the
file once, checks that it is still the file that was indexed, allocates every requested tensor with
``torch.empty`` and fills its storage directly from the file: byte-adjacent tensors are coalesced into
chunks filled by one ``os.preadv`` scatter read each, several chunks in parallel threads (``readinto`` on
the calling thread where ``preadv`` does not exist). There is no intermediate ``bytes`` object and no
clone, and the returned tensors own their memory: they stay valid after the file is closed, replaced or
deleted.

Example:
    >>> import torch, tempfile, os
    >>> from safetensors.torch import save_file
    >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
    >>> save_file({"blocks.0.weight": torch.ones(2, 3), "blocks.0.bias": torch.zeros(2)}, path)
    >>> store = SafetensorsTensorStore(path)
    >>> store.shape("blocks.0.weight")
    (2, 3)
    >>> tensors = store.read(["blocks.0.weight"], expected_shapes={"blocks.0.weight": (2, 3)})
    >>> float(tensors["blocks.0.weight"].sum())
    6.0
"""

from __future__ import annotations

import difflib
import io
import logging
import os
import stat
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

import torch

from worldfoundry.core.model_loading.policy import parse_dtype
from worldfoundry.core.model_loading.safetensors_header import (
    SAFETENSORS_DTYPES,
    TensorEntry,
    read_safetensors_index,
)
from worldfoundry.errors import CheckpointError, PolicyError

__all__ = ["SAFETENSORS_DTYPES", "FileIdentity", "SafetensorsTensorStore", "TensorEntry"]

logger = logging.getLogger(__name__)

#: Bytes one scatter read (one ``os.preadv`` call sequence on one thread) fills at most.
CHUNK_BYTES: Final[int] = 32 << 20
#: Tensors are allocated, filled and (optionally) cast in batches of about this many bytes, so a dtype
#: cast never holds more than one batch in the file's dtype next to the cast results.
BATCH_BYTES: Final[int] = 256 << 20
#: Default number of threads filling chunks in parallel (``pread`` releases the GIL). At least 4 so that a
#: read from disk keeps several requests in flight; up to 8 on hosts with more cores, where copying from
#: the page cache and faulting in fresh destination pages also scale with threads.
DEFAULT_READ_WORKERS: Final[int] = min(8, max(4, os.cpu_count() or 1))
_IOV_MAX: Final[int] = 1024
_HAS_PREADV: Final[bool] = hasattr(os, "preadv")
_ADVISE: bool = hasattr(os, "posix_fadvise")

_Chunk = tuple[int, list[memoryview]]


@dataclass(frozen=True)
class FileIdentity:
    """What identifies one version of a file: size, modification time (ns), inode and device."""

    size: int
    mtime_ns: int
    inode: int
    device: int

    @classmethod
    def from_stat(cls, st: os.stat_result) -> FileIdentity:
        """Build the identity from an ``os.stat``/``os.fstat`` result."""
        return cls(size=st.st_size, mtime_ns=st.st_mtime_ns, inode=st.st_ino, device=st.st_dev)


class SafetensorsTensorStore:
    """Validated index of one immutable safetensors file; reads groups of tensors into owned CPU tensors.

    The file is opened only inside the constructor and inside each read; no descriptor is kept between
    calls. The file must not change after indexing: every read compares the open file with the recorded
    :class:`FileIdentity` and refuses if it differs.

    Args:
        path: the ``.safetensors`` file.
        read_workers: threads that fill destination tensors in parallel during a read (1 = the calling
            thread only). Platforms without ``os.preadv`` always read on the calling thread.

    Raises:
        PolicyError: ``read_workers`` is not a positive integer.
        CheckpointError: the file is missing, corrupt (bad header length, malformed JSON, unknown dtype,
            shape/byte-length mismatch, overlapping, gapped or out-of-bounds ranges, trailing bytes), or
            the host is big-endian. The message names the file and, where there is one, the bad key.
    """

    def __init__(self, path: str | os.PathLike[str], *, read_workers: int = DEFAULT_READ_WORKERS) -> None:
        self._path = os.path.abspath(os.fspath(path))
        if isinstance(read_workers, bool) or not isinstance(read_workers, int) or read_workers < 1:
            raise PolicyError(f"read_workers must be a positive integer, got {read_workers!r}")
        self._workers = read_workers if _HAS_PREADV else 1
        if sys.byteorder != "little":
            raise CheckpointError(
                f"{self._path}: safetensors data is little-endian and this host is {sys.byteorder}-endian; "
                "read the file on a little-endian machine"
            )
        try:  # stat before opening: opening a FIFO would block, a device has no end
            if not stat.S_ISREG(os.stat(self._path).st_mode):
                raise CheckpointError(f"{self._path}: not a regular file (a directory, FIFO, socket or device); "
                                      "pass the path of a .safetensors file")
            with io.FileIO(self._path, "r") as f:
                st = os.fstat(f.fileno())
                self._identity = FileIdentity.from_stat(st)
                entries, metadata = read_safetensors_index(f, self._path, st.st_size)
        except OSError as exc:
            raise CheckpointError(f"{self._path}: cannot read safetensors file: {exc}") from exc
        self._entries: dict[str, TensorEntry] = {e.name: e for e in entries}
        self._metadata: Mapping[str, str] = MappingProxyType(metadata)
        logger.debug("indexed %s: %d tensors, %d bytes", self._path, len(entries), st.st_size)

    # --- index ---------------------------------------------------------------------------------------

    @property
    def path(self) -> str:
        """Absolute path of the indexed file."""
        return self._path

    @property
    def identity(self) -> FileIdentity:
        """Identity of the file recorded at index time."""
        return self._identity

    @property
    def metadata(self) -> Mapping[str, str]:
        """The header's ``__metadata__`` (read-only; empty when the file has none)."""
        return self._metadata

    def keys(self) -> list[str]:
        """Tensor names in file order (by byte offset)."""
        return list(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __repr__(self) -> str:
        return f"SafetensorsTensorStore({self._path!r}, tensors={len(self._entries)})"

    def entry(self, key: str) -> TensorEntry:
        """Index entry of ``key``.

        Raises:
            CheckpointError: ``key`` is not in the file (the message lists close matches).
        """
        found = self._entries.get(key)
        if found is None:
            raise self._unknown([key])
        return found

    def shape(self, key: str) -> tuple[int, ...]:
        """Shape of ``key`` as stored. Raises :class:`CheckpointError` for an unknown key."""
        return self.entry(key).shape

    def dtype(self, key: str) -> torch.dtype:
        """torch dtype of ``key`` as stored. Raises :class:`CheckpointError` for an unknown key."""
        return self.entry(key).dtype

    def nbytes(self, key: str) -> int:
        """Stored size of ``key`` in bytes. Raises :class:`CheckpointError` for an unknown key."""
        return self.entry(key).nbytes

    # --- reading -------------------------------------------------------------------------------------

    def read(
        self,
        keys: Iterable[str] | str,
        *,
        expected_shapes: Mapping[str, Sequence[int]] | None = None,
        dtype: torch.dtype | str | None = None,
    ) -> dict[str, torch.Tensor]:
        """Read a group of tensors with one open of the file.

        Args:
            keys: tensor names (a single string reads one tensor); duplicates are read once.
            expected_shapes: optional ``{name: shape}`` checked for the whole group before any byte is
                read; every mismatch is reported at once.
            dtype: optional dtype (``torch.bfloat16`` or ``"bf16"``...) that floating-point tensors are
                cast to after reading; integer and bool tensors keep their stored dtype.

        Returns:
            ``{name: tensor}`` in the order the names were given; contiguous CPU tensors owning their memory.

        Raises:
            CheckpointError: unknown key (close matches listed), shape mismatch, expected shape for a key
                that is not read, the file changed since indexing, or the file ended early.
            PolicyError: ``dtype`` names no floating dtype.
        """
        names = list(dict.fromkeys([keys] if isinstance(keys, str) else keys))
        unknown = [n for n in names if n not in self._entries]
        if unknown:
            raise self._unknown(unknown)
        if expected_shapes:
            self._check_shapes(names, expected_shapes)
        cast = None if dtype is None else parse_dtype(dtype, field_name="dtype")
        loaded: dict[str, torch.Tensor] = {}
        ordered = sorted((self._entries[n] for n in names), key=lambda e: (e.begin, e.end))
        total = sum(e.nbytes for e in ordered)
        workers = min(self._workers, max(1, -(-total // CHUNK_BYTES)))
        try:
            with io.FileIO(self._path, "r") as f, ThreadPoolExecutor(workers) as pool:
                self._check_identity(os.fstat(f.fileno()))
                batches = list(_batches(ordered))
                _advise_willneed(f.fileno(), batches[:1])
                for index, batch in enumerate(batches):
                    _advise_willneed(f.fileno(), batches[index + 1 : index + 2])
                    tensors = [torch.empty(e.shape, dtype=e.dtype) for e in batch]
                    chunks = _chunks(batch, tensors)
                    if workers > 1 and len(chunks) > 1:
                        complete = all(pool.map(lambda c: _fill_preadv(f.fileno(), c), chunks))
                    else:
                        complete = all(_fill(f, c) for c in chunks)
                    if not complete:
                        shown = ", ".join(repr(e.name) for e in batch[:3])
                        raise CheckpointError(f"{self._path}: the file ended early while reading {shown}")
                    for e, t in zip(batch, tensors):
                        loaded[e.name] = t.to(cast) if cast is not None and t.is_floating_point() else t
                self._check_identity(os.fstat(f.fileno()))
        except OSError as exc:
            raise CheckpointError(f"{self._path}: cannot read the indexed file: {exc}") from exc
        return {n: loaded[n] for n in names}

    def read_all(self, *, dtype: torch.dtype | str | None = None) -> dict[str, torch.Tensor]:
        """Read every tensor of the file (see :meth:`read`)."""
        return self.read(self._entries, dtype=dtype)

    def read_prefix(self, prefix: str, *, dtype: torch.dtype | str | None = None) -> dict[str, torch.Tensor]:
        """Read every tensor whose name starts with ``prefix`` (see :meth:`read`).

        Raises:
            CheckpointError: no tensor name starts with ``prefix``.
        """
        names = [n for n in self._entries if n.startswith(prefix)]
        if not names:
            roots = sorted({n.split(".", 1)[0] for n in self._entries})[:10]
            raise CheckpointError(
                f"{self._path}: no tensor name starts with {prefix!r}; top-level names: {', '.join(roots)}"
            )
        return self.read(names, dtype=dtype)

    # --- checks --------------------------------------------------------------------------------------

    def _unknown(self, names: Sequence[str]) -> CheckpointError:
        known = list(self._entries)
        parts = []
        for name in names[:5]:
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
            hint = f"close matches: {', '.join(repr(c) for c in close)}" if close else "no close match"
            parts.append(f"{name!r} ({hint})")
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        return CheckpointError(
            f"{self._path}: no tensor named {'; '.join(parts)}{more}; the file holds {len(known)} tensors"
        )

    def _check_shapes(self, names: Sequence[str], expected: Mapping[str, Sequence[int]]) -> None:
        wanted = set(names)
        extra = [k for k in expected if k not in wanted]
        if extra:
            raise CheckpointError(
                f"{self._path}: expected_shapes names tensors that are not being read: "
                f"{', '.join(repr(k) for k in extra[:10])}"
            )
        bad = []
        for key, shape in expected.items():
            want = tuple(int(s) for s in shape)
            if self._entries[key].shape != want:
                bad.append(f"{key!r} has shape {self._entries[key].shape}, expected {want}")
        if bad:
            raise CheckpointError(f"{self._path}: shape mismatch: " + "; ".join(bad))

    def _check_identity(self, st: os.stat_result) -> None:
        now = FileIdentity.from_stat(st)
        if now != self._identity:
            raise CheckpointError(
                f"{self._path}: the file changed since it was indexed ({self._identity} -> {now}); "
                "safetensors files are treated as immutable, build a new SafetensorsTensorStore"
            )


# --- reading -----------------------------------------------------------------------------------------


def _batches(entries: Sequence[TensorEntry]) -> Iterator[list[TensorEntry]]:
    """Group entries (sorted by offset) into batches of about :data:`BATCH_BYTES`."""
    batch: list[TensorEntry] = []
    size = 0
    for e in entries:
        if batch and size + e.nbytes > BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(e)
        size += e.nbytes
    if batch:
        yield batch


def _advise_willneed(fd: int, batches: Sequence[Sequence[TensorEntry]]) -> None:
    """Ask the kernel to start reading a batch's byte span ahead (a no-op for pages already cached)."""
    if not _ADVISE or not batches or not batches[0]:
        return
    begin, end = batches[0][0].begin, max(e.end for e in batches[0])
    if end > begin:
        os.posix_fadvise(fd, begin, end - begin, os.POSIX_FADV_WILLNEED)


def _chunks(entries: Sequence[TensorEntry], tensors: Sequence[torch.Tensor]) -> list[_Chunk]:
    """Cut the destination bytes into chunks ``(file_offset, views)`` of byte-adjacent ranges.

    Adjacent tensors share a chunk (one scatter read), a tensor larger than :data:`CHUNK_BYTES` is split
    over several chunks so that threads can fill it in parallel.
    """
    chunks: list[_Chunk] = []
    start = end = 0
    views: list[memoryview] = []
    for e, tensor in zip(entries, tensors):
        if not e.nbytes:
            continue
        view, pos = _byte_view(tensor), e.begin
        while len(view):
            if views and (pos != end or end - start >= CHUNK_BYTES):
                chunks.append((start, views))
                views = []
            if not views:
                start = end = pos
            take = min(len(view), CHUNK_BYTES - (end - start))
            views.append(view[:take])
            view, pos, end = view[take:], pos + take, end + take
    if views:
        chunks.append((start, views))
    return chunks


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """Writable byte view of a freshly allocated contiguous CPU tensor's storage."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _fill(f: io.FileIO, chunk: _Chunk) -> bool:
    """Fill one chunk on the calling thread; ``False`` when the file ended first."""
    return _fill_preadv(f.fileno(), chunk) if _HAS_PREADV else _fill_readinto(f, chunk)


def _fill_preadv(fd: int, chunk: _Chunk) -> bool:
    """Scatter-read a chunk's byte-adjacent views with ``os.preadv``, resuming after partial reads."""
    offset, views = chunk[0], list(chunk[1])
    index = 0
    while index < len(views):
        got = os.preadv(fd, views[index : index + _IOV_MAX], offset)
        if got == 0:
            return False
        offset += got
        while got and index < len(views):
            if got >= len(views[index]):
                got -= len(views[index])
                index += 1
            else:
                views[index] = views[index][got:]
                got = 0
    return True


def _fill_readinto(f: io.FileIO, chunk: _Chunk) -> bool:
    """Sequential ``seek`` + ``readinto`` for platforms without ``os.preadv``."""
    f.seek(chunk[0])
    for view in chunk[1]:
        while len(view):
            got = f.readinto(view)
            if not got:
                return False
            view = view[got:]
    return True
