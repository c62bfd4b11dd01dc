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
import threading
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from worldfoundry.core.acceleration import hookspecs
from worldfoundry.core.acceleration.discovery import EntryPointDiscovered
from worldfoundry.core.attention.builtin_providers import builtin_providers
from worldfoundry.core.attention.providers import AttentionProvider
from worldfoundry.errors import DuplicateAttentionProviderError, UnknownAttentionProviderError


class AttentionProviderRegistry(EntryPointDiscovered):
    """Maps attention provider names to providers.

    Build fresh ones in tests; :func:`attention_provider_registry` returns the process default.

    Args:
        discover: load entry points of ``entry_point_group`` lazily on first lookup.
        allowlist: entry point or distribution names to load; ``None`` reads ``WORLDFOUNDRY_PLUGINS``.
        builtins: register the PyTorch SDPA providers (``sdpa``, ``sdpa_flash``, ...).
    """

    hook_name: ClassVar[str] = "register_attention_providers"

    def __init__(self, *, discover: bool = True,
                 entry_point_group: str = hookspecs.ATTENTION_PROVIDER_ENTRY_POINT_GROUP,
                 allowlist: Iterable[str] | None = None, builtins: bool = True) -> None:
        self._providers: dict[str, AttentionProvider] = {}
        self._init_discovery(discover=discover, entry_point_group=entry_point_group, allowlist=allowlist)
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

    # ------------------------------------------------------------------ discovery
    def _entry_point_register(self, ep: Any, dist: str, version: str) -> tuple[Callable[..., None],
                                                                               Callable[[], tuple[str, ...]]]:
        """The ``register`` handed to one entry point's hooks (staging), and the ``commit`` that applies it."""
        staged: dict[str, AttentionProvider] = {}

        def register(provider: AttentionProvider, *, replace: bool = False) -> None:
            _validate(provider)
            provider = dataclasses.replace(provider, distribution=provider.distribution or dist)
            self._add(provider, replace=replace, staged=staged)

        def commit() -> tuple[str, ...]:
            self._providers.update(staged)
            return tuple(staged)

        return register, commit


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
