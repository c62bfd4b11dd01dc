"""Model-free validation of one candidate's plugin options through the plugin's registered options class.

The options class is ``registry.get(name).options`` (``register(name, prepare, options=Options)``; the registry
falls back to the legacy ``prepare.options_class`` attribute). A :class:`~worldfoundry.plugin.PluginOptions`
subclass is built with ``from_mapping(value, path="candidates[i].accelerations.<name>")`` so its errors carry the
JSON path; a legacy dataclass is first checked field by field against its annotations. Whatever the class
raises becomes a :class:`~worldfoundry.errors.CandidateSchemaError` naming the path: no plugin's mistake
reaches the user as a traceback.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import types
import typing
from collections.abc import Mapping
from typing import Any

from worldfoundry.core.acceleration.options import options_class_of
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.acceleration.spec import PER_EXPERT, expert_options
from worldfoundry.errors import AccelerationOptionsError, CandidateSchemaError, UnknownAccelerationError


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (a hostile file must not flood the terminal)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _name_of(expected: Any) -> str:
    return {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}.get(
        expected, getattr(expected, "__name__", str(expected)))


def _scalar_ok(value: Any, annotation: type) -> bool:
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


def annotation_check(path: str, value: Any, annotation: Any) -> None:
    """Check a JSON value against a dataclass field annotation (numbers, strings, bools, sequences, mappings).

    Raises:
        CandidateSchemaError: the value does not fit the annotation.
    """
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                annotation_check(path, value, option)
                return
            except CandidateSchemaError:
                continue
        expected = " or ".join(_name_of(a) for a in args)
        raise CandidateSchemaError(path, f"expected {expected}, got {type(value).__name__} ({shown(value)})")
    if annotation is typing.Any or annotation is object:
        return
    if annotation in (int, float, str, bool, type(None)):
        if not _scalar_ok(value, annotation):
            raise CandidateSchemaError(
                path, f"expected {_name_of(annotation)}, got {type(value).__name__} ({shown(value)})")
        return
    if origin in (tuple, list, collections.abc.Sequence) or annotation in (tuple, list):
        if not isinstance(value, list | tuple):
            raise CandidateSchemaError(path, f"expected list, got {type(value).__name__} ({shown(value)})")
        inner = args[0] if args else typing.Any
        for i, item in enumerate(value):
            annotation_check(f"{path}[{i}]", item, inner if inner is not Ellipsis else typing.Any)
        return
    if origin in (dict, collections.abc.Mapping) or annotation is dict:
        if not isinstance(value, Mapping):
            raise CandidateSchemaError(path, f"expected object, got {type(value).__name__}")
        return
    if origin is typing.Literal and value not in args:
        raise CandidateSchemaError(path, f"expected one of {list(args)}, got {shown(value)}")


def _accepts_path(from_mapping: Any) -> bool:
    try:
        params = inspect.signature(from_mapping).parameters
    except (TypeError, ValueError):
        return False
    return "path" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _legacy_field_checks(path: str, options: Mapping[str, Any], options_class: type, has_from_mapping: bool) -> None:
    """Field-by-field annotation checks for a plain (legacy) options dataclass."""
    if not dataclasses.is_dataclass(options_class):
        return
    try:
        hints = typing.get_type_hints(options_class)
    except Exception:  # an unresolvable annotation: the class's own from_mapping judges the values
        return
    fields = {f.name: hints.get(f.name, typing.Any) for f in dataclasses.fields(options_class) if f.init}
    # spec keys that are not field names (nested or renamed options): the plugin's from_mapping judges them
    if not fields or (has_from_mapping and not set(options) <= set(fields)):
        return
    for key, value in options.items():
        if key not in fields:
            raise CandidateSchemaError(f"{path}.{key}", f"unknown option; known: {', '.join(sorted(fields))}")
        annotation_check(f"{path}.{key}", value, fields[key])


def _from_options_error(path: str, name: str, options: Mapping[str, Any], exc: AccelerationOptionsError) -> None:
    message = str(exc).removeprefix(f"{exc.plugin}: ")
    if exc.path:
        raise CandidateSchemaError(exc.path, message.removeprefix(f"{exc.path}: ")) from exc
    key, sep, rest = message.partition(": ")
    if sep and key in options:  # "threshold: must be >= 0" -> path.threshold: must be >= 0
        raise CandidateSchemaError(f"{path}.{key}", rest) from exc
    raise CandidateSchemaError(path, message) from exc


def validate_plugin_options(path: str, name: str, options: Mapping[str, Any], registry: AccelerationRegistry) -> None:
    """Validate one plugin's options without a model.

    Args:
        path: JSON path of the options (``candidates[0].accelerations.easycache``).
        name: the acceleration name.
        options: its options mapping.
        registry: where ``name`` is registered.

    Raises:
        CandidateSchemaError: unknown acceleration, or options the plugin's options class refuses (any exception
            it raises is reported with the path, never as a traceback); with ``per_expert`` overrides, the options
            of each named expert are checked too.
    """
    try:
        entry = registry.get(name)
    except UnknownAccelerationError as exc:
        raise CandidateSchemaError(path, str(exc)) from exc  # names the known ones and what to install
    if PER_EXPERT in options:  # each expert's merged options are checked (the expert names at install)
        overrides = options[PER_EXPERT]
        where = f"{path}.{PER_EXPERT}"
        if not isinstance(overrides, Mapping) or not overrides or not all(
                isinstance(k, str) and isinstance(v, Mapping) and PER_EXPERT not in v for k, v in overrides.items()):
            raise CandidateSchemaError(where, "expected a non-empty object expert name -> options object")
        for label in overrides:
            _validate_one(f"{where}.{label}", name, expert_options(options, label), entry)
        options = expert_options(options, "")
    _validate_one(path, name, options, entry)


def _validate_one(path: str, name: str, options: Mapping[str, Any], entry: Any) -> None:
    options_class = getattr(entry, "options", None) or getattr(entry.factory, "options_class", None)
    if options_class is None:
        return
    from_mapping = getattr(options_class, "from_mapping", None)
    if options_class_of(options_class) is None:  # PluginOptions check their own fields, with paths
        _legacy_field_checks(path, options, options_class, from_mapping is not None)
    if from_mapping is None:
        return
    try:
        if _accepts_path(from_mapping):
            from_mapping(options, path=path)
        else:
            from_mapping(options)
    except AccelerationOptionsError as exc:
        _from_options_error(path, name, options, exc)
    except CandidateSchemaError:
        raise
    except Exception as exc:  # a plugin's options class must not turn a bad value into a traceback
        raise CandidateSchemaError(path, f"{name} refused these options ({type(exc).__name__}: {shown(str(exc), 200)})") from exc


__all__ = ["annotation_check", "shown", "validate_plugin_options"]
