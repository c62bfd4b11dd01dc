"""Parse and validate the header of a safetensors file into an index of :class:`TensorEntry` records.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of UTF-8 JSON
(``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {str: str}}``) and the data section. The
offsets are relative to the data section. :func:`read_safetensors_index` accepts a file only when the
header is well-formed JSON without duplicate names, every dtype is known, every tensor's byte length is
``numel * itemsize``, and the tensors sorted by offset tile the data section exactly (no overlap, no gap,
nothing past the end, nothing after the last tensor). Every error names the file and the offending key.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

import torch

from worldfoundry.errors import CheckpointError

#: safetensors dtype names and the torch dtypes they are read as.
SAFETENSORS_DTYPES: Final[Mapping[str, torch.dtype]] = MappingProxyType(
    {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U64": torch.uint64,
        "U32": torch.uint32,
        "U16": torch.uint16,
        "U8": torch.uint8,
        "BOOL": torch.bool,
    }
)

#: Largest JSON header accepted (the limit the reference safetensors implementation uses).
MAX_HEADER_BYTES: Final[int] = 100_000_000
_METADATA_KEY: Final[str] = "__metadata__"
_ENTRY_FIELDS: Final[frozenset[str]] = frozenset({"dtype", "shape", "data_offsets"})


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the index: name, dtype, shape and absolute byte range ``[begin, end)`` in the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        """Number of bytes the tensor occupies in the file (and in memory)."""
        return self.end - self.begin


def read_safetensors_index(f: io.FileIO, path: str, file_size: int) -> tuple[list[TensorEntry], dict[str, str]]:
    """Read and validate the header of an open safetensors file.

    Args:
        f: the file, opened for reading (its position is changed).
        path: the file's path, used in error messages.
        file_size: the file's size in bytes (from ``os.fstat``).

    Returns:
        ``(entries, metadata)``: the tensors sorted by byte offset (absolute offsets in the file) and the
        header's ``__metadata__`` (empty when absent).

    Raises:
        CheckpointError: the header or the file size is invalid; the message names the file and key.
    """
    header_len, raw = _read_header(f, path, file_size)
    return _parse_header(raw, path, data_start=8 + header_len, file_size=file_size)


def _read_header(f: io.FileIO, path: str, file_size: int) -> tuple[int, bytes]:
    if file_size < 8:
        raise CheckpointError(
            f"{path}: file is {file_size} bytes; a safetensors file starts with an 8-byte header length"
        )
    header_len = int.from_bytes(_read_exact(f, 0, 8, path), "little")
    if header_len == 0 or header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
        raise CheckpointError(
            f"{path}: bad header length {header_len} (file is {file_size} bytes, limit {MAX_HEADER_BYTES}); "
            "the file is truncated or not a safetensors file"
        )
    return header_len, _read_exact(f, 8, header_len, path)


def _read_exact(f: io.FileIO, offset: int, size: int, path: str) -> bytes:
    f.seek(offset)
    chunks = []
    while size:
        chunk = f.read(size)
        if not chunk:
            raise CheckpointError(f"{path}: file ended while reading the header")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _parse_header(
    raw: bytes, path: str, *, data_start: int, file_size: int
) -> tuple[list[TensorEntry], dict[str, str]]:
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicates)
    except _DuplicateKey as exc:
        raise CheckpointError(f"{path}: header names {exc.key!r} twice") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path}: header is not valid UTF-8 JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop(_METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: {_METADATA_KEY!r} must be an object of string values")
    entries = [_parse_entry(name, info, path, data_start) for name, info in header.items()]
    entries.sort(key=lambda e: (e.begin, e.end))
    cursor, previous = data_start, None
    for e in entries:
        if e.end > file_size:
            raise CheckpointError(
                f"{path}: tensor {e.name!r} ends at byte {e.end} but the file has {file_size} bytes "
                "(the file is truncated)"
            )
        if e.begin < cursor:
            raise CheckpointError(f"{path}: tensor {e.name!r} overlaps tensor {previous!r}")
        if e.begin > cursor:
            after = f"after tensor {previous!r}" if previous else "at the start of the data section"
            raise CheckpointError(f"{path}: {e.begin - cursor} unused bytes before tensor {e.name!r} ({after})")
        cursor, previous = e.end, e.name
    if cursor != file_size:
        raise CheckpointError(
            f"{path}: {file_size - cursor} trailing bytes after the last tensor; the file size does not match "
            "the header"
        )
    return entries, dict(metadata)


def _parse_entry(name: str, info: Any, path: str, data_start: int) -> TensorEntry:
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict) or set(info) != _ENTRY_FIELDS:
        got = sorted(info) if isinstance(info, dict) else type(info).__name__
        raise CheckpointError(f"{where}: entry must have exactly {sorted(_ENTRY_FIELDS)}, got {got}")
    dtype_name, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype_name, str) or dtype_name not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"{where}: unsupported dtype {dtype_name!r}; supported: {', '.join(SAFETENSORS_DTYPES)}")
    if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
        raise CheckpointError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise CheckpointError(f"{where}: data_offsets must be [begin, end] non-negative integers, got {offsets!r}")
    begin, end = offsets
    if begin > end:
        raise CheckpointError(f"{where}: data_offsets {offsets} end before they begin")
    dtype = SAFETENSORS_DTYPES[dtype_name]
    numel = 1
    for s in shape:
        numel *= s
    expected = numel * dtype.itemsize
    if expected != end - begin:
        raise CheckpointError(
            f"{where}: shape {tuple(shape)} x {dtype_name} needs {expected} bytes but data_offsets span {end - begin}"
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
