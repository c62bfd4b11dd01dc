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
import os
from contextvars import ContextVar
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, ClassVar, Final, Self

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
    """Raised by a check; the options base turns it into :class:`AccelerationOptionsError` with the path.

    Args:
        path: the JSON path of the bad value, relative to where the check runs (``threshold``, ``self.fusion``).
        message: what is wrong, in words (used as ``"{path}: {message}"``); or
        expected: what was expected (``"an integer >= 0"``) and ``value`` the bad value: the options class
            renders these with its :attr:`PluginOptions.error_format`.
    """

    def __init__(self, path: str, message: str | None = None, *, expected: str | None = None,
                 value: Any = None) -> None:
        self.path = path
        self.expected = expected
        self.shown = shown_value(value)
        self.message = message if message is not None else f"expected {expected}, got {self.shown}"
        super().__init__(f"{path}: {self.message}")

    def render(self, error_format: str, path: str) -> str:
        """The message at ``path`` in the wording ``error_format`` (``expected`` form) or ``"path: message"``."""
        if self.expected is None:
            return f"{path}: {self.message}" if path else self.message
        return error_format.format(path=path, expected=self.expected, value=self.shown)


def shown_value(value: Any) -> str:
    """A short ``repr`` of a bad value (huge integers by size, long reprs cut), safe for any input."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        return f"an integer of {value.bit_length()} bits"
    try:
        shown = repr(value)
    except Exception:  # a hostile __repr__ must not hide the real error
        shown = f"<{type(value).__name__}>"
    return shown if len(shown) <= 80 else shown[:77] + "..."


def join_path(base: str, name: str) -> str:
    """``base.name``, or whichever of the two is not empty."""
    return f"{base}.{name}" if base and name else base or name


def _fail(path: str, expected: str, value: Any) -> OptionValueError:
    return OptionValueError(path, expected=expected, value=value)


def _bounds(lo: float | None, hi: float | None, fmt: Callable[[Any], str] = str) -> str:
    if lo is not None and hi is not None:
        return f" in [{fmt(lo)}, {fmt(hi)}]"
    if lo is not None:
        return f" >= {fmt(lo)}"
    return f" <= {fmt(hi)}" if hi is not None else ""


# ---------------------------------------------------------------------------------------- checks
def integer(*, min: int | None = None, max: int | None = None, expected: str | None = None) -> Check:  # noqa: A002
    """An ``int`` (not ``bool``) in ``[min, max]``; always within ±(2⁶³ − 1).

    Args:
        min, max: inclusive bounds (``None``: the signed 64-bit limit).
        expected: the words of the error instead of ``"an integer >= 0"``.
    """
    lo = -INT_LIMIT if min is None else min
    hi = INT_LIMIT if max is None else max
    expected = expected or "an integer" + _bounds(min, max)

    def check(value: Any, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise _fail(path, expected, value)
        return int(value)

    return check


def number(*, min: float | None = None, max: float | None = None, min_exclusive: bool = False,  # noqa: A002
           expected: str | None = None, type_expected: str | None = None) -> Check:
    """A finite real number (``int`` or ``float``, not ``bool``) in the bounds, returned as ``float``.

    Args:
        min, max: bounds (``min`` exclusive when ``min_exclusive``); magnitudes above 1e300 are always refused.
        expected: the words of the error for a value out of range.
        type_expected: the words for a value that is not a number at all (default: ``expected``).
    """
    lo = -FLOAT_LIMIT if min is None else float(min)
    hi = FLOAT_LIMIT if max is None else float(max)
    op = ">" if min_exclusive else ">="
    parts = [f"{op} {min:g}" if min is not None else "", f"<= {max:g}" if max is not None else ""]
    expected = expected or "a finite number" + ("" if not any(parts) else " " + " and ".join(p for p in parts if p))
    type_expected = type_expected or expected

    def check(value: Any, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _fail(path, type_expected, value)
        if isinstance(value, int) and abs(value) > INT_LIMIT:
            raise _fail(path, expected, value)
        result = float(value)
        if not math.isfinite(result) or result > hi or result < lo or (min_exclusive and result == lo):
            raise _fail(path, expected, value)
        return result

    return check


def boolean(*, expected: str = "true or false") -> Check:
    """``True`` or ``False`` (not ``0``/``1``)."""

    def check(value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            raise _fail(path, expected, value)
        return value

    return check


def choice(*values: Any, expected: str | None = None) -> Check:
    """One of ``values`` (compared with ``==`` and the same type).

    A value of none of the allowed types (a number where every choice is a string) is named by type:
    ``"expected a string"``.
    """
    allowed = tuple(values)
    listed = expected or f"one of {list(allowed)}"
    all_strings = bool(allowed) and all(isinstance(v, str) for v in allowed)

    def check(value: Any, path: str) -> Any:
        for candidate in allowed:
            if type(value) is type(candidate) and value == candidate:
                return value
        if all_strings and not isinstance(value, str):
            raise _fail(path, f"a string, {listed}", value)
        raise _fail(path, listed, value)

    return check


def string(*, nonempty: bool = True, min_length: int = 0, max_length: int = MAX_STRING,
           expected: str | None = None) -> Check:
    """A ``str`` of ``min_length`` to ``max_length`` characters (non-empty unless told), without NUL."""
    low = max(min_length, 1 if nonempty else 0)
    expected = expected or ("a non-empty string" if nonempty else "a string")

    def check(value: Any, path: str) -> str:
        if not isinstance(value, str) or not low <= len(value) <= max_length or "\x00" in value:
            raise _fail(path, expected, value)
        return value

    return check


def file_path(*, expected: str = "a non-empty file path") -> Check:
    """A file path: a non-empty ``str`` or :class:`os.PathLike` (returned as ``str``), at most 4096 characters.

    The path is data: nothing is opened here.
    """
    inner = string(expected=expected)

    def check(value: Any, path: str) -> str:
        if isinstance(value, os.PathLike):
            try:
                value = os.fspath(value)
            except TypeError:
                raise _fail(path, expected, value) from None
        return inner(value, path)

    return check


def optional(inner: Check) -> Check:
    """``None`` or what ``inner`` accepts."""

    def check(value: Any, path: str) -> Any:
        return None if value is None else inner(value, path)

    return check


def sequence_of(inner: Check, *, min_items: int = 0, max_items: int = MAX_ITEMS, unique: bool = False,
                expected: str = "a list") -> Check:
    """A list or tuple (not a string) of items ``inner`` accepts, returned as a tuple."""

    def check(value: Any, path: str) -> tuple[Any, ...]:
        if not isinstance(value, list | tuple):
            raise _fail(path, expected, value)
        if not min_items <= len(value) <= max_items:
            raise _fail(path, f"{expected} of {min_items} to {max_items} items", value)
        items = tuple(inner(item, f"{path}[{i}]") for i, item in enumerate(value))
        if unique:
            try:
                repeated = len(set(items)) != len(items)
            except TypeError:
                repeated = any(a == b for i, a in enumerate(items) for b in items[i + 1:])
            if repeated:
                raise OptionValueError(path, f"{shown_value(value)} lists an item twice; items must not repeat")
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
    #: How a check's ``expected`` error reads; ``"{path} must be {expected}, got {value}"`` is the other wording.
    error_format: ClassVar[str] = "{path}: expected {expected}, got {value}"

    def __post_init__(self) -> None:
        base = _BUILD_PATH.get()
        token = _BUILD_PATH.set("")  # options built by a check (nested) set their own path
        try:
            for f in fields(self):
                check = f.metadata.get(CHECK_KEY)
                if check is not None:
                    object.__setattr__(self, f.name, check(getattr(self, f.name), join_path(base, f.name)))
        except OptionValueError as exc:  # field checks name the full path
            raise self._error(exc, exc.path) from None
        finally:
            _BUILD_PATH.reset(token)
        try:
            self.validate()
        except OptionValueError as exc:  # validate() names paths relative to these options
            raise self._error(exc, join_path(base, exc.path)) from None

    def _error(self, exc: OptionValueError, path: str) -> AccelerationOptionsError:
        return AccelerationOptionsError(self.plugin_name, exc.render(self.error_format, path), path=path or None)

    def validate(self) -> None:
        """Checks across fields; override and raise :class:`OptionValueError` (path relative to the options)."""

    @classmethod
    def known_options(cls) -> tuple[str, ...]:
        """The option names a spec mapping may hold, sorted."""
        return tuple(sorted(f.name for f in fields(cls) if f.init))

    @classmethod
    def required_options(cls) -> tuple[str, ...]:
        """The options without a default, in declaration order."""
        return tuple(f.name for f in fields(cls)
                     if f.init and f.default is MISSING and f.default_factory is MISSING)

    @classmethod
    def check_mapping(cls, options: Any, *, path: str = "", known: Sequence[str] | None = None) -> Mapping[str, Any]:
        """``options`` as a mapping with only ``known`` keys (default :meth:`known_options`).

        Raises:
            AccelerationOptionsError: not a mapping or an unknown key (both named, with the known ones).
        """
        if not isinstance(options, Mapping):
            where = repr(path) if path else "options"
            raise AccelerationOptionsError(
                cls.plugin_name, f"{where} must be a mapping; expected a mapping of option names to values, "
                f"got {type(options).__name__}", path=path or None)
        allowed = cls.known_options() if known is None else tuple(known)
        unknown = sorted(repr(k) if not isinstance(k, str) else k for k in options if k not in allowed)
        if unknown:
            where = f" in {path!r}" if path else ""
            raise AccelerationOptionsError(
                cls.plugin_name, f"unknown option(s) {unknown}{where}; known options: {sorted(allowed)}",
                path=path or None)
        return options

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None, *, path: str = "") -> Self:
        """Build from a spec mapping (``None`` = defaults); unknown keys are rejected by name.

        Args:
            options: the plugin's spec value.
            path: the JSON path of ``options`` for error messages (e.g. ``candidates[2].accelerations.my_kernel``).

        Returns:
            The validated, frozen options.

        Raises:
            AccelerationOptionsError: not a mapping, an unknown or missing key, or a bad value; ``.path`` names it.
        """
        mapping = cls.check_mapping({} if options is None else options, path=path)
        missing = [name for name in cls.required_options() if name not in mapping]
        if missing:
            where = f" in {path!r}" if path else ""
            raise AccelerationOptionsError(cls.plugin_name, f"missing required option(s) {missing}{where}",
                                           path=path or None)
        return cls.build(dict(mapping), path=path)

    @classmethod
    def build(cls, values: Mapping[str, Any], *, path: str = "") -> Self:
        """``cls(**values)`` with errors naming ``path`` (for ``from_mapping`` overrides that rename keys)."""
        token = _BUILD_PATH.set(path)
        try:
            return cls(**values)
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
    "file_path",
    "join_path",
    "shown_value",
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
