"""Entry-point discovery shared by the registries: the allowlist, load records and broken-distribution isolation.

A registry names its entry-point group and hook; :func:`load_entry_points` loads each entry point of the group
that the allowlist (``WORLDFOUNDRY_PLUGINS``: unset = all, empty = none, otherwise entry-point or distribution
names) lets through, calls the module's hook implementations with a ``register`` callable the registry makes,
and records what happened. A distribution that fails to import or register is recorded with its cause, its
staged registrations are dropped, and the others still load.

Example:
    >>> parse_allowlist("a, b,")
    frozenset({'a', 'b'})
"""

from __future__ import annotations

import abc

import dataclasses
import importlib.metadata as importlib_metadata
import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import pluggy

from worldfoundry.core.acceleration import hookspecs
from worldfoundry.errors import PluginLoadError

logger = logging.getLogger(__name__)

PLUGIN_ALLOWLIST_ENV = "WORLDFOUNDRY_PLUGINS"

#: ``make_register(entry_point, distribution, version) -> (register, commit)``: ``register`` is handed to the hook
#: implementations and stages registrations; ``commit()`` applies them and returns the registered names.
RegisterFactory = Callable[[Any, str, str], tuple[Callable[..., None], Callable[[], tuple[str, ...]]]]


@dataclass(frozen=True)
class PluginLoadRecord:
    """What happened to one entry point during discovery."""

    entry_point: str
    value: str
    distribution: str
    version: str
    status: str  # "loaded" | "failed" | "skipped (not in WORLDFOUNDRY_PLUGINS)"
    names: tuple[str, ...] = ()
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "names": list(self.names)}


def parse_allowlist(value: str | None) -> frozenset[str] | None:
    """``None`` (unset) allows everything; ``""`` allows nothing; otherwise comma-separated names."""
    if value is None:
        return None
    return frozenset(part.strip() for part in value.split(",") if part.strip())


def resolve_allowlist(explicit: frozenset[str] | None) -> frozenset[str] | None:
    """``explicit`` when given, else the allowlist ``WORLDFOUNDRY_PLUGINS`` sets (see :func:`parse_allowlist`)."""
    return explicit if explicit is not None else parse_allowlist(os.environ.get(PLUGIN_ALLOWLIST_ENV))


def load_entry_points(
    group: str,
    hook_name: str,
    plugin_manager: pluggy.PluginManager,
    allow: frozenset[str] | None,
    make_register: RegisterFactory,
) -> tuple[list[PluginLoadRecord], list[PluginLoadError]]:
    """Load every entry point of ``group`` (sorted by name) and call its ``hook_name`` implementations.

    Args:
        group: the entry-point group.
        hook_name: the hook each entry point's module implements (``register_diffusion_accelerations``, ...).
        plugin_manager: the registry's pluggy manager (with the project's hookspecs added).
        allow: entry-point or distribution names to load; ``None`` loads all (see :func:`resolve_allowlist`).
        make_register: see :data:`RegisterFactory`.

    Returns:
        ``(records, errors)``: one record per entry point, one :class:`PluginLoadError` per failed one.
    """
    records: list[PluginLoadRecord] = []
    errors: list[PluginLoadError] = []
    for ep in sorted(importlib_metadata.entry_points(group=group), key=lambda e: e.name):
        dist = ep.dist.name if ep.dist is not None else "<unknown>"
        version = ep.dist.version if ep.dist is not None else "<unknown>"
        if allow is not None and ep.name not in allow and dist not in allow:
            records.append(PluginLoadRecord(ep.name, ep.value, dist, version, f"skipped (not in {PLUGIN_ALLOWLIST_ENV})"))
            continue
        register, commit = make_register(ep, dist, version)
        try:
            _call_hook(ep, dist, hook_name, plugin_manager, register)
            names = commit()
        except Exception as exc:  # a broken distribution must not break the others
            error = PluginLoadError(dist, ep.name, exc)
            logger.warning("%s", error)
            errors.append(error)
            records.append(
                PluginLoadRecord(ep.name, ep.value, dist, version, "failed", (), f"{type(exc).__name__}: {exc}"))
            continue
        records.append(PluginLoadRecord(ep.name, ep.value, dist, version, "loaded", names))
    return records, errors


def _call_hook(ep: Any, dist: str, hook_name: str, plugin_manager: pluggy.PluginManager,
               register: Callable[..., None]) -> None:
    """Load ``ep``'s module, register it with pluggy once, and call its ``hook_name`` implementations.

    Raises:
        LookupError: the module implements no ``hook_name``; anything the import or the hook raises.
    """
    module = ep.load()
    plugin_name = plugin_manager.get_name(module)  # two entry points may name one module
    if plugin_name is None:
        plugin_name = f"{dist}:{ep.name}"
        plugin_manager.register(module, name=plugin_name)
    impls = [impl for impl in getattr(plugin_manager.hook, hook_name).get_hookimpls()
             if impl.plugin_name == plugin_name]
    if not impls:
        raise LookupError(f"entry point {ep.value!r} defines no @worldfoundry.hookimpl {hook_name}")
    for impl in impls:
        impl.function(register=register)


class EntryPointDiscovered(abc.ABC):
    """Base of a registry filled lazily from one entry-point group: the lock, the records and the errors.

    A subclass sets :attr:`hook_name`, calls :meth:`_init_discovery` in ``__init__`` and implements
    ``_entry_point_register`` (a :data:`RegisterFactory`); every lookup calls :meth:`_ensure_discovered` first.
    """

    #: the hook the group's modules implement.
    hook_name: ClassVar[str]

    def _init_discovery(self, *, discover: bool, entry_point_group: str, allowlist: Iterable[str] | None) -> None:
        """Set up discovery state (nothing is loaded yet).

        Args:
            discover: load the group's entry points on first lookup (``False``: never).
            entry_point_group: the entry-point group.
            allowlist: entry point or distribution names to load; ``None`` reads ``WORLDFOUNDRY_PLUGINS``.
        """
        self._lock = threading.RLock()
        self._discovered = not discover
        self._group = entry_point_group
        self._allowlist = frozenset(allowlist) if allowlist is not None else None
        self._load_records: list[PluginLoadRecord] = []
        self._load_errors: list[PluginLoadError] = []
        self._plugin_manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._plugin_manager.add_hookspecs(hookspecs)

    @abc.abstractmethod
    def _entry_point_register(self, ep: Any, dist: str, version: str) -> tuple[Callable[..., None],
                                                                               Callable[[], tuple[str, ...]]]:
        """The ``register`` callback handed to one entry point's hook, and a function naming what it staged."""

    def _ensure_discovered(self) -> None:
        if self._discovered:
            return
        with self._lock:
            if self._discovered:
                return
            self._discovered = True
            records, errors = load_entry_points(self._group, self.hook_name, self._plugin_manager,
                                                resolve_allowlist(self._allowlist), self._entry_point_register)
            self._load_records.extend(records)
            self._load_errors.extend(errors)

    def load_records(self) -> tuple[PluginLoadRecord, ...]:
        """What discovery did for each entry point (loaded / failed / skipped)."""
        self._ensure_discovered()
        return tuple(self._load_records)

    def load_errors(self) -> tuple[PluginLoadError, ...]:
        """One :class:`PluginLoadError` per entry point that failed to load (its ``cause`` is the original error)."""
        self._ensure_discovered()
        with self._lock:
            return tuple(self._load_errors)


__all__ = ["PLUGIN_ALLOWLIST_ENV", "EntryPointDiscovered", "PluginLoadRecord", "RegisterFactory", "load_entry_points", "parse_allowlist",
           "resolve_allowlist"]
