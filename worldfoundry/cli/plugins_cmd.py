"""``worldfoundry plugins``: what entry-point discovery found, and whether each plugin loaded — acceleration
plugins (``worldfoundry.accelerations``) and attention providers (``worldfoundry.attention_providers``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from worldfoundry.core.acceleration.hookspecs import (
    ACCELERATION_ENTRY_POINT_GROUP,
    ATTENTION_PROVIDER_ENTRY_POINT_GROUP,
)
from worldfoundry.core.acceleration.registry import PLUGIN_ALLOWLIST_ENV, AccelerationRegistry
from worldfoundry.core.attention.provider_registry import AttentionProviderRegistry

_COLUMNS = ("name", "distribution", "version", "entry_point", "status")
_PROVIDER_COLUMNS = ("name", "numerics", "version", "distribution", "entry_point", "status")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``plugins`` sub-parser (sets ``func=run``)."""
    parser = subparsers.add_parser(
        "plugins",
        help="list acceleration plugins found through entry points",
        description=(
            f"List every entry point of the group {ACCELERATION_ENTRY_POINT_GROUP!r} with the acceleration names "
            f"it registers and whether it loaded, then the attention providers of the group "
            f"{ATTENTION_PROVIDER_ENTRY_POINT_GROUP!r} (and the built-in PyTorch SDPA ones). {PLUGIN_ALLOWLIST_ENV} "
            "(comma separated; empty = none) limits which entry points are loaded."
        ),
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    parser.add_argument("--strict", action="store_true", help="exit with status 1 when any plugin failed to load")
    parser.set_defaults(func=run)
    return parser


def plugin_rows(registry: AccelerationRegistry) -> list[dict[str, Any]]:
    """One row per registered acceleration name, plus one per entry point that failed or was skipped.

    Returns:
        Dicts with ``name``, ``distribution``, ``version``, ``entry_point``, ``status`` and ``error``.
    """
    rows: list[dict[str, Any]] = []
    listed: set[str] = set()
    for record in registry.load_records():
        entry_point = f"{record.entry_point} = {record.value}"
        if record.status == "loaded":
            for name in record.names:
                listed.add(name)
                rows.append(_row(name, record.distribution, record.version, entry_point, "loaded", None))
            if not record.names:
                rows.append(_row("-", record.distribution, record.version, entry_point, "loaded (no names)", None))
        else:
            rows.append(_row("-", record.distribution, record.version, entry_point, record.status, record.error))
    for name in registry.names():
        if name not in listed:
            entry = registry.get(name)
            rows.append(_row(name, entry.distribution or "-", entry.version or "-", entry.entry_point or "(code)",
                             "loaded", None))
    return rows


def _row(name: str, distribution: str, version: str, entry_point: str, status: str,
         error: str | None) -> dict[str, Any]:
    return {"name": name, "distribution": distribution, "version": version, "entry_point": entry_point,
            "status": status, "error": error}


def provider_rows(registry: AttentionProviderRegistry) -> list[dict[str, Any]]:
    """One row per registered attention provider, plus one per entry point that failed or was skipped.

    Returns:
        Dicts with ``name``, ``numerics``, ``version``, ``distribution``, ``entry_point``, ``status``, ``error``.
    """
    rows: list[dict[str, Any]] = []
    entry_points: dict[str, str] = {}
    for record in registry.load_records():
        entry_point = f"{record.entry_point} = {record.value}"
        if record.status == "loaded":
            entry_points.update({name: entry_point for name in record.names})
        else:
            rows.append({"name": "-", "numerics": "-", "version": record.version,
                         "distribution": record.distribution, "entry_point": entry_point, "status": record.status,
                         "error": record.error})
    for provider in registry.providers():
        entry_point = entry_points.get(provider.name, "(built-in)" if provider.distribution == "torch" else "(code)")
        rows.append({"name": provider.name, "numerics": provider.numerics, "version": provider.version,
                     "distribution": provider.distribution or "-", "entry_point": entry_point, "status": "loaded",
                     "error": None})
    return sorted(rows, key=lambda r: (r["name"] == "-", r["name"]))


def format_table(rows: list[dict[str, Any]], columns: tuple[str, ...] = _COLUMNS) -> str:
    """A plain-text table of ``rows`` with the errors of failed plugins listed below it."""
    if not rows:
        return f"no acceleration plugins found (entry-point group {ACCELERATION_ENTRY_POINT_GROUP!r})"
    header = {c: c.replace("_", " ") for c in columns}
    widths = {c: max(len(header[c]), *(len(str(r[c])) for r in rows)) for c in columns}
    lines = ["  ".join(header[c].ljust(widths[c]) for c in columns).rstrip()]
    lines.append("  ".join("-" * widths[c] for c in columns))
    lines.extend("  ".join(str(r[c]).ljust(widths[c]) for c in columns).rstrip() for r in rows)
    errors = [r for r in rows if r["error"]]
    if errors:
        lines.append("")
        lines.append("errors:")
        lines.extend(f"  {r['distribution']} ({r['entry_point']}): {r['error']}" for r in errors)
    return "\n".join(lines)


def run(args: argparse.Namespace, *, registry: AccelerationRegistry | None = None, out: TextIO | None = None,
        providers: AttentionProviderRegistry | None = None) -> int:
    """Discover plugins and attention providers (fresh registries, so the listing reflects what is installed
    now) and print them.

    Returns:
        0, or 1 with ``--strict`` when a plugin or provider distribution failed to load.
    """
    out = out if out is not None else sys.stdout
    registry = registry if registry is not None else AccelerationRegistry(discover=True)
    providers = providers if providers is not None else AttentionProviderRegistry(discover=True)
    rows = plugin_rows(registry)
    attention_rows = provider_rows(providers)
    failed = [r for r in (*rows, *attention_rows) if r["status"] == "failed"]
    if args.json:
        json.dump({"group": ACCELERATION_ENTRY_POINT_GROUP, "plugins": rows,
                   "attention_providers": {"group": providers.entry_point_group, "providers": attention_rows}},
                  out, indent=2)
        out.write("\n")
    else:
        out.write(format_table(rows) + "\n")
        out.write(f"\nattention providers (entry-point group {providers.entry_point_group!r}):\n")
        out.write(format_table(attention_rows, _PROVIDER_COLUMNS) + "\n")
    return 1 if (args.strict and failed) else 0
