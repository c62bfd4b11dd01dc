"""Runtime options declared by the layers above core: a name, a check and a line of help.

Core validates a :class:`~worldfoundry.core.model_loading.policy.RuntimePolicy`'s options without knowing
what a model layer reads: the layer that consumes an option declares it here with a check (e.g.
:func:`file_path`), and the policy accepts the key and normalises its value through that check.

Example:
    >>> from worldfoundry.core.model_loading.runtime_options import declared_runtime_options, file_path
    >>> file_path("options.example", "a.pt")
    'a.pt'
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from worldfoundry.errors import PolicyError

#: A check takes ``(where, value)`` and returns the normalised value, or raises :class:`PolicyError`.
OptionCheck = Callable[[str, Any], Any]


@dataclass(frozen=True)
class RuntimeOptionDeclaration:
    """One declared runtime option.

    Args:
        name: the option key in ``RuntimePolicy(options={...})``.
        check: ``check(where, value) -> normalised value``; ``None`` values skip it.
        doc: one line saying what reads the option.
    """

    name: str
    check: OptionCheck
    doc: str


_LOCK = threading.Lock()
_DECLARED: dict[str, RuntimeOptionDeclaration] = {}


def declare_runtime_option(name: str, check: OptionCheck, *, doc: str) -> RuntimeOptionDeclaration:
    """Declare a runtime option read outside core; declaring the same option again is a no-op.

    Args:
        name: the option key (a non-empty identifier).
        check: ``check(where, value)`` returning the normalised value or raising :class:`PolicyError`.
        doc: one line saying what reads the option.

    Returns:
        The declaration.

    Raises:
        ValueError: a bad name, or the name already declared with another check.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"runtime option name must be an identifier, got {name!r}")
    declaration = RuntimeOptionDeclaration(name, check, doc)
    with _LOCK:
        existing = _DECLARED.get(name)
        if existing is not None and existing.check is not check:
            raise ValueError(f"runtime option {name!r} is already declared ({existing.doc}); pick another name")
        _DECLARED.setdefault(name, declaration)
        return _DECLARED[name]


def declared_runtime_options() -> Mapping[str, RuntimeOptionDeclaration]:
    """A snapshot ``{name: declaration}`` of the declared runtime options."""
    with _LOCK:
        return dict(_DECLARED)


def check_declared_option(name: str, value: Any) -> Any:
    """Run the declared check of ``name`` on ``value`` (``None`` passes unchanged).

    Raises:
        PolicyError: from the check, naming ``options.<name>``.
        KeyError: ``name`` is not declared.
    """
    declaration = declared_runtime_options()[name]
    return value if value is None else declaration.check(f"options.{name}", value)


def file_path(where: str, value: Any) -> str:
    """Check: a file path (``str`` or ``os.PathLike``), returned as ``str``; the file is not opened.

    Raises:
        PolicyError: the value is no path.
    """
    if not isinstance(value, str | os.PathLike):
        raise PolicyError(f"{where}: expected a file path")
    return os.fspath(value)
