"""Candidates naming an acceleration that is not installed here become ``rejected_at_install`` rows.

A candidate file written for another machine (or for plugins not installed yet) still runs: every candidate
whose ``accelerations`` names an unknown plugin is taken out before validation and reported as a row saying
which name is missing, whether its entry point failed to load (with the error) and which names are known. The
rest of the file is validated as usual; a file in which no candidate can run is a
:class:`~worldfoundry.errors.CandidateSchemaError`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from worldfoundry.bench.candidates import (
    MAX_CANDIDATE_FILE_BYTES,
    MAX_DEPTH,
    CandidateFile,
    load_candidates,
    parse_candidates,
)
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.model_loading.input_files import parse_json_bytes, read_input_bytes
from worldfoundry.errors import CandidateSchemaError, InputFileError, JsonInputError


def _why(name: str, registry: AccelerationRegistry) -> str:
    for record in registry.load_records():
        if record.status == "failed" and (name in record.names or record.entry_point == name):
            return (f"acceleration {name!r} is installed ({record.distribution}) but failed to load: "
                    f"{record.error}")
    known = ", ".join(registry.names()) or "none"
    return f"unknown acceleration {name!r}: not installed here (known: {known})"


def load_available(path: str | os.PathLike[str], *, registry: AccelerationRegistry
                   ) -> tuple[CandidateFile, list[tuple[int, dict[str, Any]]]]:
    """Load a candidate file, taking out candidates that name unknown accelerations.

    Returns:
        The validated file of the remaining candidates, and ``(index, row)`` for each one taken out.

    Raises:
        CandidateSchemaError: the file is invalid, or no candidate names only known accelerations.
    """
    file = os.fspath(path)
    try:  # the same strict reading as load_candidates
        data = parse_json_bytes(read_input_bytes(file, what="candidate file", max_bytes=MAX_CANDIDATE_FILE_BYTES),
                                source=file, max_depth=MAX_DEPTH)
    except (InputFileError, JsonInputError):
        return load_candidates(path, registry=registry), []  # raises the usual, path-naming error
    cands = data.get("candidates") if isinstance(data, Mapping) else None
    if not isinstance(cands, list):
        return parse_candidates(data, registry=registry, source=file), []
    known = set(registry.names())
    keep, rows = [], []
    for i, cand in enumerate(cands):
        accel = cand.get("accelerations") if isinstance(cand, Mapping) else None
        unknown = sorted(set(accel) - known) if isinstance(accel, Mapping) else []
        if unknown:
            rows.append((i, {"name": str(cand.get("name", f"candidates[{i}]")), "accelerations": dict(accel),
                             "notes": str(cand.get("notes", "")), "verdict": "rejected_at_install",
                             "executed": False, "error": "; ".join(_why(n, registry) for n in unknown)}))
        else:
            keep.append(cand)
    if rows and not keep:
        raise CandidateSchemaError("candidates", "no candidate can run here: " + rows[0][1]["error"])
    cfile = parse_candidates({**data, "candidates": keep}, registry=registry, source=file)
    return dataclasses.replace(cfile, raw=dict(data)), rows


def insert_rows(records: list[dict[str, Any]], rows: list[tuple[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Put the taken-out rows back at their places in the file's order (in place; returns ``records``)."""
    for index, row in sorted(rows, key=lambda item: item[0]):
        records.insert(min(index, len(records)), row)
    return records
