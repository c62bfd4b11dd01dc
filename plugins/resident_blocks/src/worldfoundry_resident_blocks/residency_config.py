"""Reading a ``resident_blocks`` residency config file (what ``worldfoundry estimate-residency`` writes) as
untrusted data.

The file is stat-checked (a regular file of at most :data:`MAX_RESIDENCY_CONFIG_BYTES`; directories, FIFOs and
devices such as ``/dev/zero`` are refused before reading), decoded as strict UTF-8 JSON (duplicate keys, ``NaN``,
out-of-range numbers and deep nesting refused) and its fields are type-checked. Every error is an
:class:`~worldfoundry.errors.AccelerationOptionsError` of ``resident_blocks`` whose message names the file and the
key.

Example:
    >>> import json, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "r.json")
    >>> _ = open(path, "w").write(json.dumps({"offload_resident_blocks": 2, "num_blocks": 30}))
    >>> read_residency_config(path)["offload_resident_blocks"]
    2
"""

from __future__ import annotations

import os
from typing import Any, Final

from worldfoundry.core.model_loading.input_files import load_json_file
from worldfoundry.errors import AccelerationOptionsError, InputFileError, JsonInputError

#: The plugin these configs belong to (named in errors).
PLUGIN: Final = "resident_blocks"
#: Keys a residency config may hold (``estimate-residency`` writes all five; ``estimate`` is its record of how r was
#: chosen — both rules' r, their predicted waits, c, d, N — and is not an option).
RESIDENCY_CONFIG_KEYS: Final = ("offload_resident_blocks", "cpu_offload_block_contiguous", "resident_block_indices",
                                "num_blocks", "estimate")
MAX_RESIDENCY_CONFIG_BYTES: Final = 1 << 20
#: Most blocks a config may name (no DiT has more than a few hundred).
MAX_BLOCKS: Final = 100_000


def _is_count(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= MAX_BLOCKS


def read_residency_config(path: str | os.PathLike[str], *, plugin: str = PLUGIN, where: str = "config") -> dict[str, Any]:
    """Read and check a residency config.

    Args:
        path: the JSON file.
        plugin: the plugin name used in errors.
        where: the JSON path of the option naming the file (``candidates[0].accelerations.resident_blocks.config``).

    Returns:
        The config's fields (``resident_block_indices`` as a list).

    Raises:
        AccelerationOptionsError: the file is missing, not a regular file, too large, malformed JSON, has an
            unknown key or a value of the wrong type or range; ``.path`` is ``where`` or ``<where>.<key>``.
    """
    name = os.fspath(path)
    try:
        data = load_json_file(name, what="residency config", max_bytes=MAX_RESIDENCY_CONFIG_BYTES, max_depth=4)
    except InputFileError as exc:
        raise AccelerationOptionsError(plugin, f"{where}: {exc}; run `worldfoundry estimate-residency ...` to write "
                                               "one", path=where) from exc
    except JsonInputError as exc:
        raise AccelerationOptionsError(plugin, f"{where}: {exc}", path=where) from exc
    if not isinstance(data, dict):
        raise AccelerationOptionsError(plugin, f"{where}: {name} must hold a JSON object", path=where)
    unknown = sorted(k for k in data if k not in RESIDENCY_CONFIG_KEYS)
    if unknown:
        raise AccelerationOptionsError(
            plugin, f"{where}: {name} has unknown key(s) {unknown}; known keys: {list(RESIDENCY_CONFIG_KEYS)}",
            path=where)
    checks = {
        "offload_resident_blocks": (lambda v: _is_count(v), "an integer in [0, 100000]"),
        "cpu_offload_block_contiguous": (lambda v: isinstance(v, bool), "true or false"),
        "num_blocks": (lambda v: v is None or _is_count(v, 1), "an integer in [1, 100000]"),
        "estimate": (lambda v: v is None or isinstance(v, dict), "a JSON object (the estimator's record)"),
        "resident_block_indices": (
            lambda v: v is None or (isinstance(v, list) and len(v) <= MAX_BLOCKS and all(_is_count(i) for i in v)),
            "a list of block indices (integers >= 0)"),
    }
    if "offload_resident_blocks" not in data:
        raise AccelerationOptionsError(plugin, f"{where}: {name} has no offload_resident_blocks", path=where)
    for key, (ok, expected) in checks.items():
        if key in data and not ok(data[key]):
            shown = repr(data[key])
            raise AccelerationOptionsError(
                plugin, f"{where}.{key}: {name}: expected {expected}, got {shown[:60]}", path=f"{where}.{key}")
    return data


__all__ = ["MAX_RESIDENCY_CONFIG_BYTES", "RESIDENCY_CONFIG_KEYS", "read_residency_config"]
