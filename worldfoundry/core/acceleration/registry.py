"""The acceleration registry: names -> prepare factories, discovered lazily from entry points through pluggy."""

from __future__ import annotations

import importlib.metadata as importlib_metadata
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from worldfoundry.core.acceleration import hookspecs
from worldfoundry.core.acceleration.discovery import (  # re-exported: the registry's public names
    PLUGIN_ALLOWLIST_ENV,
    EntryPointDiscovered,
    PluginLoadRecord,
    parse_allowlist,
)
from worldfoundry.errors import DuplicateAccelerationError, UnknownAccelerationError


#: Built-in acceleration name -> the distribution (under ``plugins/``) that registers it; the ``all`` extra of
#: the core distribution lists the same distributions.
def bundled_distribution(name: str) -> str | None:
    """The distribution of the ``worldfoundry[all]`` extra that provides ``name``, if it is one of them.

    Built-in plugins follow one naming rule (``my_kernel`` → ``worldfoundry-my-kernel``); the extra's list in the
    installed core's metadata says which exist, so core holds no plugin names.
    """
    candidate = "worldfoundry-" + name.replace("_", "-")
    try:
        requirements = importlib_metadata.requires("worldfoundry") or []
    except importlib_metadata.PackageNotFoundError:
        return None
    for requirement in requirements:
        head, _, marker = requirement.partition(";")
        base = head.strip().split("==")[0].split(">=")[0].split("[")[0].strip().lower()
        if base == candidate and "all" in marker:
            return candidate
    return None


@dataclass(frozen=True)
class RegisteredAcceleration:
    """One registered name."""

    name: str
    factory: Callable[..., Any]
    distribution: str | None = None
    version: str | None = None
    entry_point: str | None = None
    #: the plugin's options class (a :class:`~worldfoundry.core.acceleration.options.PluginOptions` subclass or
    #: any class with ``from_mapping``), so tools validate options without a model.
    options: type | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "entry_point": self.entry_point,
        }


class AccelerationRegistry(EntryPointDiscovered):
    """Maps acceleration names to prepare factories.

    Build fresh ones in tests; :func:`diffusion_acceleration_registry` returns the process default.

    Args:
        discover: load entry points of ``entry_point_group`` lazily on first lookup.
        allowlist: entry point or distribution names to load; ``None`` reads ``WORLDFOUNDRY_PLUGINS``
            (unset = all, empty = none).

    Example:
        >>> reg = AccelerationRegistry(discover=False)
        >>> reg.register("noop", lambda model, options, policy: ...)
        >>> reg.names()
        ('noop',)
    """

    hook_name: ClassVar[str] = "register_diffusion_accelerations"

    def __init__(
        self,
        *,
        discover: bool = True,
        entry_point_group: str = hookspecs.ACCELERATION_ENTRY_POINT_GROUP,
        allowlist: Iterable[str] | None = None,
    ) -> None:
        self._entries: dict[str, RegisteredAcceleration] = {}
        self._discover = discover
        self._init_discovery(discover=discover, entry_point_group=entry_point_group, allowlist=allowlist)

    # ------------------------------------------------------------------ registration
    def register(
        self,
        name: str,
        prepare_factory: Callable[..., Any],
        *,
        options: type | None = None,
        replace: bool = False,
        distribution: str | None = None,
        version: str | None = None,
        entry_point: str | None = None,
    ) -> None:
        """Register ``prepare_factory(model, options, policy) -> PreparedAcceleration`` under ``name``.

        Args:
            options: the plugin's options class (``from_mapping(mapping, path=...)``); tools such as the bench
                validate a spec with it before any model exists.

        Raises:
            DuplicateAccelerationError: ``name`` is taken and ``replace`` is false.
            TypeError: the factory is not callable or the name is not a non-empty string.
        """
        _validate_registration(name, prepare_factory, options)
        with self._lock:
            existing = self._entries.get(name)
            if existing is not None and not replace:
                origin = existing.distribution or "code"
                raise DuplicateAccelerationError(
                    f"acceleration {name!r} is already registered (by {origin}); pass replace=True to override"
                )
            self._entries[name] = RegisteredAcceleration(
                name, prepare_factory, distribution, version, entry_point, _options_of(prepare_factory, options))

    def unregister(self, name: str) -> None:
        self._ensure_discovered()
        with self._lock:
            if name not in self._entries:
                raise self._unknown(name)
            del self._entries[name]

    def names(self) -> tuple[str, ...]:
        self._ensure_discovered()
        with self._lock:
            return tuple(sorted(self._entries))

    def get(self, name: str) -> RegisteredAcceleration:
        """The registration of ``name``.

        Raises:
            UnknownAccelerationError: ``name`` is not registered (lists the known names). When an entry point of
                that name failed to load, its :class:`PluginLoadError` is chained as ``__cause__``.
        """
        self._ensure_discovered()
        with self._lock:
            try:
                return self._entries[name]
            except KeyError:
                cause = next((e for e in self._load_errors if e.entry_point == name), None)
                raise self._unknown(name) from cause

    def _unknown(self, name: str) -> UnknownAccelerationError:
        """The error for ``name`` with what helps: the built-in distribution, or the allowlist that skipped it."""
        skipped = any(r.entry_point == name and r.status.startswith("skipped") for r in self._load_records)
        return UnknownAccelerationError(name, self._entries, distribution=bundled_distribution(name),
                                        skipped_by_allowlist=skipped)

    def __contains__(self, name: object) -> bool:
        self._ensure_discovered()
        with self._lock:
            return name in self._entries

    # ------------------------------------------------------------------ discovery
    def _entry_point_register(self, ep: Any, dist: str, version: str) -> tuple[Callable[..., None],
                                                                               Callable[[], tuple[str, ...]]]:
        """The ``register`` handed to one entry point's hooks (staging), and the ``commit`` that applies it."""
        registered: list[str] = []
        staged: dict[str, RegisteredAcceleration] = {}

        def register(name: str, prepare_factory: Callable[..., Any], *, options: type | None = None,
                     replace: bool = False) -> None:
            _validate_registration(name, prepare_factory, options)
            if not replace and (name in self._entries or name in staged):
                raise DuplicateAccelerationError(
                    f"acceleration {name!r} registered twice (second time by {dist}); pass replace=True"
                )
            staged[name] = RegisteredAcceleration(
                name, prepare_factory, dist, version, f"{ep.name} = {ep.value}", _options_of(prepare_factory, options))
            registered.append(name)

        def commit() -> tuple[str, ...]:
            self._entries.update(staged)
            return tuple(registered)

        return register, commit


def _validate_registration(name: Any, prepare_factory: Any, options: Any = None) -> None:
    if not isinstance(name, str) or not name or not name.replace("_", "").replace("-", "").isalnum():
        raise TypeError(f"acceleration name must be a non-empty identifier-like string, got {name!r}")
    if not callable(prepare_factory):
        raise TypeError(f"prepare_factory for {name!r} must be callable")
    if options is not None and not (isinstance(options, type) and callable(getattr(options, "from_mapping", None))):
        raise TypeError(f"options for {name!r} must be a class with from_mapping (a worldfoundry.plugin.PluginOptions)")


def _options_of(prepare_factory: Any, options: type | None) -> type | None:
    """The explicit options class, else the legacy ``prepare.options_class`` attribute."""
    if options is not None:
        return options
    legacy = getattr(prepare_factory, "options_class", None)
    return legacy if isinstance(legacy, type) else None


_DEFAULT_REGISTRY: AccelerationRegistry | None = None
_DEFAULT_LOCK = threading.Lock()


def diffusion_acceleration_registry() -> AccelerationRegistry:
    """The process-wide default registry (entry points discovered lazily on first lookup)."""
    global _DEFAULT_REGISTRY
    with _DEFAULT_LOCK:
        if _DEFAULT_REGISTRY is None:
            _DEFAULT_REGISTRY = AccelerationRegistry(discover=True)
        return _DEFAULT_REGISTRY


__all__ = [
    "PLUGIN_ALLOWLIST_ENV",
    "AccelerationRegistry",
    "PluginLoadRecord",
    "RegisteredAcceleration",
    "bundled_distribution",
    "diffusion_acceleration_registry",
    "parse_allowlist",
]
