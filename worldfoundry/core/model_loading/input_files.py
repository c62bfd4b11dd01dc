"""Checks every file read from outside goes through: stat before reading, bounded reads, strict JSON, finite tensors.

* :func:`check_input_file` stats a path before anything reads it: it must exist, be a regular file (not a
  directory, FIFO, socket or device such as ``/dev/zero``; symlinks are followed) and stay under a size bound.
* :func:`read_input_bytes` reads such a file, never more than the bound.
* :func:`parse_json_bytes` / :func:`load_json_file` decode strict UTF-8 JSON: duplicate keys, nesting deeper than
  :data:`MAX_JSON_DEPTH`, ``NaN``/``Infinity``, integers beyond 64 bits, floats that overflow and overlong strings
  are each a :class:`~worldfoundry.errors.JsonInputError` naming the file and the JSON path of the value.
* :func:`check_finite_tensors` refuses NaN/Inf weights by name.

Example:
    >>> parse_json_bytes(b'{"a": [1, 2.5]}', source="x.json")
    {'a': [1, 2.5]}
    >>> parse_json_bytes(b'{"a": 1, "a": 2}', source="x.json")
    Traceback (most recent call last):
    ...
    worldfoundry.errors.JsonInputError: x.json: $.a: duplicate key 'a' (a JSON object names each key once)
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable, Mapping
from typing import Any, Final

import torch

from worldfoundry.errors import InputFileError, JsonInputError, NonFiniteWeightsError

#: Default bound of a JSON input (candidate files, configs, indexes).
MAX_JSON_BYTES: Final = 16 << 20
#: Deepest nesting of arrays/objects accepted in a JSON input.
MAX_JSON_DEPTH: Final = 64
#: Longest string value or key accepted in a JSON input.
MAX_JSON_STRING: Final = 1 << 20
#: Largest magnitude of a JSON integer (signed 64 bit) and of a JSON float.
MAX_JSON_INT: Final = 2**63 - 1
MAX_JSON_FLOAT: Final = 1e300
_STRING: Final = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET: Final = re.compile(r"[\[\]{}]")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def check_input_file(path: str | os.PathLike[str], *, what: str, max_bytes: int) -> os.stat_result:
    """Stat ``path`` before reading it.

    Args:
        path: the file.
        what: what the file is, for messages (``"candidate file"``).
        max_bytes: the largest size accepted.

    Returns:
        The ``os.stat`` result (symlinks followed).

    Raises:
        InputFileError: missing, not a regular file (directory, device, FIFO, socket) or larger than ``max_bytes``.
    """
    name = os.fspath(path)
    try:
        st = os.stat(name)
    except FileNotFoundError:
        raise InputFileError(name, f"{what} does not exist; check the path") from None
    except OSError as exc:
        raise InputFileError(name, f"cannot stat the {what}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise InputFileError(name, f"the {what} is {_kind(st.st_mode)}, not a regular file; pass the path of a file")
    if st.st_size > max_bytes:
        raise InputFileError(name, f"the {what} is {st.st_size} bytes, more than the {max_bytes}-byte limit for "
                                   f"a {what}; pass the right file")
    return st


def read_input_bytes(path: str | os.PathLike[str], *, what: str, max_bytes: int) -> bytes:
    """:func:`check_input_file`, then read at most ``max_bytes`` (a file that grew meanwhile is refused).

    Raises:
        InputFileError: see :func:`check_input_file`; also when the file cannot be read or grew past the bound.
    """
    name = os.fspath(path)
    check_input_file(name, what=what, max_bytes=max_bytes)
    try:
        with open(name, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise InputFileError(name, f"the {what} was replaced by a special file while opening it")
            data = handle.read(max_bytes + 1)
    except OSError as exc:
        raise InputFileError(name, f"cannot read the {what}: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise InputFileError(name, f"the {what} grew past the {max_bytes}-byte limit while reading it")
    return data


# --------------------------------------------------------------------------------------------- strict JSON


class _Bad:
    """A JSON number or constant that is not accepted; reported with its path after parsing."""

    def __init__(self, text: str, why: str) -> None:
        self.text, self.why = text, why


class _Object(dict):  # type: ignore[type-arg]
    duplicate: str | None = None


def _pairs(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object()
    for key, value in pairs:
        if key in obj and obj.duplicate is None:
            obj.duplicate = key
        obj[key] = value
    return obj


def _parse_int(text: str) -> int | _Bad:
    if len(text.lstrip("-")) > 19 or abs(value := int(text)) > MAX_JSON_INT:
        shown = text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"
        return _Bad(shown, f"integer {shown} is out of range (|n| <= 2**63 - 1)")
    return value


def _parse_float(text: str) -> float | _Bad:
    value = float(text)
    if not abs(value) <= MAX_JSON_FLOAT:
        shown = text if len(text) <= 24 else text[:21] + "..."
        return _Bad(shown, f"number {shown} is out of range (|x| <= {MAX_JSON_FLOAT:g})")
    return value


def _parse_constant(name: str) -> _Bad:
    return _Bad(name, f"{name} is not allowed (JSON numbers must be finite)")


def _depth_path(text: str, limit: int) -> str | None:
    """``None`` when nesting stays within ``limit``, else a rough position of the first too-deep bracket."""
    depth = 0
    for match in _BRACKET.finditer(_STRING.sub('""', text)):
        depth = depth + 1 if match.group() in "[{" else depth - 1
        if depth > limit:
            return f"nesting deeper than {limit} levels"
    return None


def _child(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]*", key) else f"{path}[{json.dumps(key)}]"


def _clean(value: Any, path: str, source: str) -> Any:
    """Turn the parsed tree into plain dicts/lists, refusing duplicates, bad numbers and overlong strings."""
    if isinstance(value, _Bad):
        raise JsonInputError(source, path, value.why)
    if isinstance(value, str):
        if len(value) > MAX_JSON_STRING:
            raise JsonInputError(source, path, f"string of {len(value)} characters (limit {MAX_JSON_STRING})")
        return value
    if isinstance(value, _Object):
        if value.duplicate is not None:
            raise JsonInputError(source, _child(path, value.duplicate),
                                 f"duplicate key {value.duplicate!r} (a JSON object names each key once)")
        out = {}
        for key, item in value.items():
            if len(key) > MAX_JSON_STRING:
                raise JsonInputError(source, path, f"key of {len(key)} characters (limit {MAX_JSON_STRING})")
            out[key] = _clean(item, _child(path, key), source)
        return out
    if isinstance(value, list):
        return [_clean(item, _child(path, i), source) for i, item in enumerate(value)]
    return value


def parse_json_bytes(data: bytes, *, source: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Decode strict UTF-8 JSON (see the module docstring).

    Args:
        data: the raw bytes.
        source: the file name used in messages.
        max_depth: deepest nesting of arrays/objects accepted.

    Returns:
        Plain ``dict``/``list``/``str``/``int``/``float``/``bool``/``None`` values.

    Raises:
        JsonInputError: not UTF-8, invalid JSON, too deep, a duplicate key, a non-finite or out-of-range number,
            an overlong string; ``.path`` is the JSON path (``$`` for the whole document).
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JsonInputError(source, "$", f"not UTF-8 text (invalid byte 0x{data[exc.start]:02x} at offset "
                                          f"{exc.start}); save the file as UTF-8") from None
    text = text.removeprefix("\ufeff")
    too_deep = _depth_path(text, max_depth)
    if too_deep is not None:
        raise JsonInputError(source, "$", f"{too_deep}; flatten the document")
    try:
        tree = json.loads(text, object_pairs_hook=_pairs, parse_int=_parse_int, parse_float=_parse_float,
                          parse_constant=_parse_constant)
    except json.JSONDecodeError as exc:
        raise JsonInputError(source, "$", f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except (RecursionError, ValueError) as exc:
        raise JsonInputError(source, "$", f"cannot parse the JSON: {type(exc).__name__}: {exc}") from None
    return _clean(tree, "$", source)


def load_json_file(path: str | os.PathLike[str], *, what: str, max_bytes: int = MAX_JSON_BYTES,
                   max_depth: int = MAX_JSON_DEPTH) -> Any:
    """:func:`read_input_bytes` + :func:`parse_json_bytes`.

    Raises:
        InputFileError: missing, a directory or special file, too large.
        JsonInputError: malformed content (names the JSON path).
    """
    name = os.fspath(path)
    return parse_json_bytes(read_input_bytes(name, what=what, max_bytes=max_bytes), source=name, max_depth=max_depth)


# --------------------------------------------------------------------------------------------- YAML

_RESOLVER: Final = re.compile(r"\$\{[^}]*:")


class YamlInputError(ValueError):
    """Raised by :func:`load_yaml_file` for malformed content; callers wrap it in their own typed error."""

    def __init__(self, file: str, reason: str) -> None:
        self.file, self.reason = file, reason
        super().__init__(f"{file}: {reason}")


def _refuse_resolvers(value: Any, source: str, where: str = "") -> None:
    """OmegaConf resolvers (``${oc.env:HOME}``) would read the environment or run resolver code: refused."""
    if isinstance(value, str) and _RESOLVER.search(value):
        raise YamlInputError(source, f"{where or 'a value'} uses an OmegaConf resolver ({value[:80]!r}); files are "
                                     "data: write the value itself (plain ${key} references are allowed)")
    if isinstance(value, Mapping):
        for key, item in value.items():
            _refuse_resolvers(key, source, where)
            _refuse_resolvers(item, source, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _refuse_resolvers(item, source, f"{where}[{i}]")


def load_yaml_file(path: str | os.PathLike[str], *, what: str, max_bytes: int) -> Any:
    """Read a UTF-8 YAML (or JSON) file through OmegaConf's safe loader; resolvers are refused.

    Raises:
        InputFileError: missing, a directory or special file, too large.
        YamlInputError: not UTF-8, not YAML, a resolver, or an interpolation that does not resolve.
    """
    from omegaconf import OmegaConf

    name = os.fspath(path)
    raw = read_input_bytes(name, what=what, max_bytes=max_bytes)
    try:
        conf = OmegaConf.create(raw.decode("utf-8"))
        _refuse_resolvers(OmegaConf.to_container(conf, resolve=False), name)
        return OmegaConf.to_container(conf, resolve=True)
    except YamlInputError:
        raise
    except Exception as exc:  # UnicodeDecodeError, YAML and OmegaConf errors of several types
        raise YamlInputError(name, f"{type(exc).__name__}: {str(exc)[:300]}") from None


# --------------------------------------------------------------------------------------------- tensors


def check_finite_tensors(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                         where: str) -> None:
    """Refuse the first floating tensor holding NaN or Inf.

    Args:
        tensors: ``{name: tensor}`` or ``(name, tensor)`` pairs (e.g. ``module.named_parameters()``).
        where: the file or component, for the message.

    Raises:
        NonFiniteWeightsError: names the tensor and how many values are not finite.
    """
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta or not tensor.is_floating_point():
            continue
        if tensor.numel() and not bool(torch.isfinite(tensor).all()):
            count = int((~torch.isfinite(tensor)).sum())
            raise NonFiniteWeightsError(where, name, count)


__all__ = [
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "check_finite_tensors",
    "check_input_file",
    "YamlInputError",
    "load_json_file",
    "load_yaml_file",
    "parse_json_bytes",
    "read_input_bytes",
]
