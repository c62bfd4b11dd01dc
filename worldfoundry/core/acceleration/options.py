"""The options base every plugin builds on: a frozen dataclass whose fields carry typed, bounded checks.

A plugin declares its options once::

    @dataclass(frozen=True)
    class Options(PluginOptions):
        plugin_name: ClassVar[str] = "my_kernel"
        threshold: float = option(0.05, number(min=0.0))
        warmup_steps: int = option(2, integer(min=0, max=10_000))
        mode: str = option("fast", choice("fast", "exact"))

``Options.from_mapping(spec, path="accelerations.my_kernel")`` rejects unknown keys by name, runs every
field's check and raises :class:`~worldfoundry.errors.AccelerationOptionsError` whose message and ``.path``
name the JSON path of the bad value (``accelerations.my_kernel.threshold: expected a finite number >= 0, got
-1``). Checks bound every number, so a 400-digit integer or ``1e400`` is a typed error, never an
``OverflowError``; strings and lists are bounded in length too.
"""

from __future__ import annotations

import math
from contextvars import ContextVar
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, ClassVar, Final

from worldfoundry.errors import AccelerationOptionsError

#: The key under which a field's check lives in ``dataclasses.field(metadata=...)``.
CHECK_KEY: Final = "worldfoundry_check"
#: Largest magnitude an integer option may have (fits a signed 64-bit integer).
INT_LIMIT: Final = 2**63 - 1
#: Largest finite magnitude of a number option.
FLOAT_LIMIT: Final = 1e300
#: Longest string option, and the most items in a list option.
MAX_STRING: Final = 4096
MAX_ITEMS: Final = 4096

Check = Callable[[Any, str], Any]
#: The JSON path of the mapping being built (set by ``from_mapping`` for the duration of one construction).
_BUILD_PATH: ContextVar[str] = ContextVar("worldfoundry_options_path", default="")


class OptionValueError(ValueError):
    """Raised by a check; the options base turns it into :class:`AccelerationOptionsError` with the path."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        super().__init__(f"{path}: {message}")


def _fail(path: str, expected: str, value: Any) -> OptionValueError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return OptionValueError(path, f"expected {expected}, got {shown}")


# ---------------------------------------------------------------------------------------- checks
def integer(*, min: int | None = None, max: int | None = None) -> Check:  # noqa: A002 - bounds read naturally
    """An ``int`` (not ``bool``) in ``[min, max]``; always within ±(2⁶³ − 1)."""
    lo = -INT_LIMIT if min is None else min
    hi = INT_LIMIT if max is None else max
    expected = f"an integer in [{lo}, {hi}]" if (min is not None and max is not None) else (
        f"an integer >= {lo}" if min is not None else (f"an integer <= {hi}" if max is not None else "an integer"))

    def check(value: Any, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise _fail(path, expected, value)
        return int(value)

    return check


def number(*, min: float | None = None, max: float | None = None, min_exclusive: bool = False) -> Check:  # noqa: A002
    """A finite real number (``int`` or ``float``, not ``bool``) in the bounds, returned as ``float``."""
    lo = -FLOAT_LIMIT if min is None else float(min)
    hi = FLOAT_LIMIT if max is None else float(max)
    op = ">" if min_exclusive else ">="
    parts = [f"{op} {min:g}" if min is not None else "", f"<= {max:g}" if max is not None else ""]
    expected = "a finite number" + ("" if not any(parts) else " " + " and ".join(p for p in parts if p))

    def check(value: Any, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _fail(path, expected, value)
        if isinstance(value, int) and abs(value) > INT_LIMIT:
            raise _fail(path, expected, value)
        result = float(value)
        if not math.isfinite(result) or result > hi or result < lo or (min_exclusive and result == lo):
            raise _fail(path, expected, value)
        return result

    return check


def boolean() -> Check:
    """``True`` or ``False`` (not ``0``/``1``)."""

    def check(value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            raise _fail(path, "true or false", value)
        return value

    return check


def choice(*values: Any) -> Check:
    """One of ``values`` (compared with ``==`` and the same type)."""
    allowed = tuple(values)

    def check(value: Any, path: str) -> Any:
        for candidate in allowed:
            if type(value) is type(candidate) and value == candidate:
                return value
        raise _fail(path, f"one of {list(allowed)}", value)

    return check


def string(*, nonempty: bool = True, max_length: int = MAX_STRING) -> Check:
    """A ``str`` of at most ``max_length`` characters (non-empty unless told)."""

    def check(value: Any, path: str) -> str:
        if not isinstance(value, str) or len(value) > max_length or (nonempty and not value):
            raise _fail(path, "a non-empty string" if nonempty else "a string", value)
        if "\x00" in value:
            raise _fail(path, "a string without NUL characters", value)
        return value

    return check


def optional(inner: Check) -> Check:
    """``None`` or what ``inner`` accepts."""

    def check(value: Any, path: str) -> Any:
        return None if value is None else inner(value, path)

    return check


def sequence_of(inner: Check, *, min_items: int = 0, max_items: int = MAX_ITEMS, unique: bool = False) -> Check:
    """A list or tuple (not a string) of items ``inner`` accepts, returned as a tuple."""

    def check(value: Any, path: str) -> tuple[Any, ...]:
        if isinstance(value, str | bytes) or not isinstance(value, Sequence):
            raise _fail(path, "a list", value)
        if not min_items <= len(value) <= max_items:
            raise _fail(path, f"a list of {min_items} to {max_items} items", value)
        items = tuple(inner(item, f"{path}[{i}]") for i, item in enumerate(value))
        if unique and len(set(items)) != len(items):
            raise _fail(path, "a list without repeated items", value)
        return items

    return check


def nested(options_class: type[PluginOptions]) -> Check:
    """A mapping validated by another options class (its errors carry the full path)."""

    def check(value: Any, path: str) -> PluginOptions:
        if isinstance(value, options_class):
            return value
        return options_class.from_mapping(value, path=path)

    return check


def any_of(*checks: Check, expected: str) -> Check:
    """The first of ``checks`` that accepts the value; otherwise ``expected`` is named."""

    def check(value: Any, path: str) -> Any:
        for inner in checks:
            try:
                return inner(value, path)
            except (OptionValueError, AccelerationOptionsError):
                continue
        raise _fail(path, expected, value)

    return check


def option(default: Any = MISSING, check: Check | None = None, *, default_factory: Any = MISSING) -> Any:
    """A dataclass field whose value ``check`` validates (and may normalise) at construction."""
    metadata = {CHECK_KEY: check} if check is not None else {}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


# ---------------------------------------------------------------------------------------- the base
@dataclass(frozen=True)
class PluginOptions:
    """Base of every plugin's ``Options``: frozen, validated at construction, built from a spec mapping.

    Subclasses set ``plugin_name`` and declare fields with :func:`option`. ``validate()`` may be overridden for
    checks that span fields (raise :class:`OptionValueError` with the field's path).

    Example:
        >>> from dataclasses import dataclass
        >>> from typing import ClassVar
        >>> @dataclass(frozen=True)
        ... class Options(PluginOptions):
        ...     plugin_name: ClassVar[str] = "demo"
        ...     scale: float = option(1.0, number(min=0.0))
        >>> Options.from_mapping({"scale": 2}).scale
        2.0
        >>> Options.from_mapping({"scale": -1}, path="accelerations.demo")
        Traceback (most recent call last):
        ...
        worldfoundry.errors.AccelerationOptionsError: demo: accelerations.demo.scale: expected a finite number >= 0, got -1
    """

    plugin_name: ClassVar[str] = "plugin"

    def __post_init__(self) -> None:
        base = _BUILD_PATH.get()
        _BUILD_PATH.set("")  # nested options built by a check set their own path
        for f in fields(self):
            check = f.metadata.get(CHECK_KEY)
            if check is None:
                continue
            path = f"{base}.{f.name}" if base else f.name
            try:
                object.__setattr__(self, f.name, check(getattr(self, f.name), path))
            except OptionValueError as exc:
                raise AccelerationOptionsError(self.plugin_name, str(exc), path=exc.path) from None
        _BUILD_PATH.set(base)
        try:
            self.validate()
        except OptionValueError as exc:
            path = f"{base}.{exc.path}" if base else exc.path
            raise AccelerationOptionsError(self.plugin_name, f"{path}: {str(exc).split(': ', 1)[-1]}", path=path) from None

    def validate(self) -> None:
        """Checks across fields; override and raise :class:`OptionValueError` (path relative to the options)."""

    @classmethod
    def known_options(cls) -> tuple[str, ...]:
        return tuple(sorted(f.name for f in fields(cls) if f.init))

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None, *, path: str = "") -> PluginOptions:
        """Build from a spec mapping (``None`` = defaults); unknown keys are rejected by name.

        Args:
            options: the plugin's spec value.
            path: the JSON path of ``options`` for error messages (e.g. ``candidates[2].accelerations.easycache``).

        Raises:
            AccelerationOptionsError: not a mapping, an unknown key, or a bad value; ``.path`` names it.
        """
        if options is None:
            options = {}
        where = path or "options"
        if not isinstance(options, Mapping):
            raise AccelerationOptionsError(
                cls.plugin_name, f"{where}: expected a mapping of options, got {type(options).__name__}", path=where)
        known = cls.known_options()
        unknown = sorted(repr(k) if not isinstance(k, str) else k for k in options if k not in known)
        if unknown:
            raise AccelerationOptionsError(
                cls.plugin_name, f"{where}: unknown option(s) {unknown}; known options: {list(known)}", path=where)
        return cls._build({str(k): v for k, v in options.items()}, path)

    @classmethod
    def _build(cls, values: dict[str, Any], path: str) -> PluginOptions:
        token = _BUILD_PATH.set(path)
        try:
            return cls(**values)
        except TypeError as exc:  # a required field is missing
            raise AccelerationOptionsError(cls.plugin_name, f"{path or 'options'}: {exc}", path=path) from None
        finally:
            _BUILD_PATH.reset(token)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict of the options (nested options included)."""
        return _jsonable(asdict(self))


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | frozenset | set):
        return [_jsonable(v) for v in value]
    return value


def options_class_of(options: Any) -> type[PluginOptions] | None:
    """``options`` when it is a :class:`PluginOptions` subclass, else ``None``."""
    return options if isinstance(options, type) and issubclass(options, PluginOptions) else None


__all__ = [
    "CHECK_KEY",
    "OptionValueError",
    "PluginOptions",
    "any_of",
    "boolean",
    "choice",
    "integer",
    "nested",
    "number",
    "option",
    "optional",
    "sequence_of",
    "string",
]
