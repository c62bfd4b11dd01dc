"""The attention provider registry: names -> :class:`AttentionProvider`, discovered lazily from entry points.

Distributions declare an entry point in the group ``worldfoundry.attention_providers`` naming a module with::

    @worldfoundry.hookimpl
    def register_attention_providers(register):
        register(AttentionProvider(name="my_kernel", ...))

``WORLDFOUNDRY_PLUGINS`` limits which entry points load, exactly as for acceleration plugins (unset = all,
empty = none, otherwise entry-point or distribution names). A distribution that fails to import or register is
recorded with its cause and the others still load. The built-in PyTorch SDPA providers are always present.

Example:
    >>> reg = AttentionProviderRegistry(discover=False)
    >>> reg.names()
    ('sdpa', 'sdpa_cudnn', 'sdpa_efficient', 'sdpa_flash', 'sdpa_math')
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as importlib_metadata
import logging
import os
import threading
from collections.abc import Iterable
from typing import Any

import pluggy

from worldfoundry.core.acceleration import hookspecs
from worldfoundry.core.acceleration.registry import PLUGIN_ALLOWLIST_ENV, PluginLoadRecord, parse_allowlist
from worldfoundry.core.attention.builtin_providers import builtin_providers
from worldfoundry.core.attention.providers import AttentionProvider
from worldfoundry.errors import DuplicateAttentionProviderError, PluginLoadError, UnknownAttentionProviderError

logger = logging.getLogger(__name__)


class AttentionProviderRegistry:
    """Maps attention provider names to providers.

    Build fresh ones in tests; :func:`attention_provider_registry` returns the process default.

    Args:
        discover: load entry points of ``entry_point_group`` lazily on first lookup.
        allowlist: entry point or distribution names to load; ``None`` reads ``WORLDFOUNDRY_PLUGINS``.
        builtins: register the PyTorch SDPA providers (``sdpa``, ``sdpa_flash``, ...).
    """

    def __init__(self, *, discover: bool = True,
                 entry_point_group: str = hookspecs.ATTENTION_PROVIDER_ENTRY_POINT_GROUP,
                 allowlist: Iterable[str] | None = None, builtins: bool = True) -> None:
        self._providers: dict[str, AttentionProvider] = {}
        self._lock = threading.RLock()
        self._discovered = not discover
        self._group = entry_point_group
        self._allowlist = frozenset(allowlist) if allowlist is not None else None
        self._load_records: list[PluginLoadRecord] = []
        self._load_errors: list[PluginLoadError] = []
        self._plugin_manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._plugin_manager.add_hookspecs(hookspecs)
        if builtins:
            for provider in builtin_providers():
                self._providers[provider.name] = provider

    @property
    def entry_point_group(self) -> str:
        return self._group

    # ------------------------------------------------------------------ registration
    def register(self, provider: AttentionProvider, *, replace: bool = False) -> None:
        """Register ``provider`` under its name.

        Raises:
            TypeError: ``provider`` is not an :class:`AttentionProvider`.
            DuplicateAttentionProviderError: the name is taken and ``replace`` is false.
        """
        _validate(provider)
        with self._lock:
            self._add(provider, replace=replace)

    def _add(self, provider: AttentionProvider, *, replace: bool,
             staged: dict[str, AttentionProvider] | None = None) -> None:
        """Add to ``staged`` (one entry point's providers, committed together) or directly."""
        name = provider.name
        existing = self._providers.get(name) or (staged or {}).get(name)
        if existing is not None and not replace:
            origin = existing.distribution or "code"
            raise DuplicateAttentionProviderError(
                f"attention provider {name!r} is already registered (by {origin}); pass replace=True to override")
        (staged if staged is not None else self._providers)[name] = provider

    def unregister(self, name: str) -> None:
        self._ensure_discovered()
        with self._lock:
            if name not in self._providers:
                raise UnknownAttentionProviderError(name, self._providers)
            del self._providers[name]

    def names(self) -> tuple[str, ...]:
        self._ensure_discovered()
        with self._lock:
            return tuple(sorted(self._providers))

    def providers(self) -> tuple[AttentionProvider, ...]:
        self._ensure_discovered()
        with self._lock:
            return tuple(self._providers[n] for n in sorted(self._providers))

    def get(self, name: str) -> AttentionProvider:
        """The provider called ``name``.

        Raises:
            UnknownAttentionProviderError: not registered (lists the known names); when an entry point of that
                name failed to load, its :class:`PluginLoadError` is chained as ``__cause__``.
        """
        self._ensure_discovered()
        with self._lock:
            try:
                return self._providers[name]
            except KeyError:
                cause = next((e for e in self._load_errors if e.entry_point == name), None)
                raise UnknownAttentionProviderError(name, self._providers) from cause

    def __contains__(self, name: object) -> bool:
        self._ensure_discovered()
        with self._lock:
            return name in self._providers

    def load_records(self) -> tuple[PluginLoadRecord, ...]:
        self._ensure_discovered()
        return tuple(self._load_records)

    def load_errors(self) -> tuple[PluginLoadError, ...]:
        self._ensure_discovered()
        with self._lock:
            return tuple(self._load_errors)

    # ------------------------------------------------------------------ discovery
    def _ensure_discovered(self) -> None:
        if self._discovered:
            return
        with self._lock:
            if self._discovered:
                return
            self._discovered = True
            allow = self._allowlist if self._allowlist is not None else parse_allowlist(
                os.environ.get(PLUGIN_ALLOWLIST_ENV))
            for ep in sorted(importlib_metadata.entry_points(group=self._group), key=lambda e: e.name):
                self._load_entry_point(ep, allow)

    def _load_entry_point(self, ep: Any, allow: frozenset[str] | None) -> None:
        dist = ep.dist.name if ep.dist is not None else "<unknown>"
        version = ep.dist.version if ep.dist is not None else "<unknown>"
        if allow is not None and ep.name not in allow and dist not in allow:
            self._load_records.append(
                PluginLoadRecord(ep.name, ep.value, dist, version, f"skipped (not in {PLUGIN_ALLOWLIST_ENV})"))
            return
        staged: dict[str, AttentionProvider] = {}

        def register(provider: AttentionProvider, *, replace: bool = False) -> None:
            _validate(provider)
            provider = dataclasses.replace(provider, distribution=provider.distribution or dist)
            self._add(provider, replace=replace, staged=staged)

        try:
            module = ep.load()
            plugin_name = self._plugin_manager.get_name(module)
            if plugin_name is None:
                plugin_name = f"{dist}:{ep.name}"
                self._plugin_manager.register(module, name=plugin_name)
            impls = [impl for impl in self._plugin_manager.hook.register_attention_providers.get_hookimpls()
                     if impl.plugin_name == plugin_name]
            if not impls:
                raise LookupError(f"entry point {ep.value!r} defines no @worldfoundry.hookimpl "
                                  "register_attention_providers")
            for impl in impls:
                impl.function(register=register)
        except Exception as exc:  # a broken distribution must not break the others
            error = PluginLoadError(dist, ep.name, exc)
            logger.warning("%s", error)
            self._load_errors.append(error)
            self._load_records.append(
                PluginLoadRecord(ep.name, ep.value, dist, version, "failed", (), f"{type(exc).__name__}: {exc}"))
            return
        self._providers.update(staged)
        self._load_records.append(PluginLoadRecord(ep.name, ep.value, dist, version, "loaded", tuple(staged)))


def _validate(provider: Any) -> None:
    if not isinstance(provider, AttentionProvider):
        raise TypeError(f"register an AttentionProvider, got {type(provider).__name__}")


_DEFAULT: AttentionProviderRegistry | None = None
_DEFAULT_LOCK = threading.Lock()


def attention_provider_registry() -> AttentionProviderRegistry:
    """The process-wide default registry (entry points discovered lazily on first lookup)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = AttentionProviderRegistry(discover=True)
        return _DEFAULT


def register_attention_provider(provider: AttentionProvider, *, replace: bool = False,
                                registry: AttentionProviderRegistry | None = None) -> None:
    """Register ``provider`` in ``registry`` (default: the process-wide one).

    Raises:
        DuplicateAttentionProviderError: the name is taken and ``replace`` is false.
    """
    (registry if registry is not None else attention_provider_registry()).register(provider, replace=replace)


__all__ = [
    "AttentionProviderRegistry",
    "attention_provider_registry",
    "register_attention_provider",
]
