"""Which classes a recipe may name, and how a class reference in a file becomes a class.

A recipe is data: its ``class`` / ``config_class`` strings are never imported as arbitrary modules. A
reference resolves only to

* a public class exported at the top level of ``diffusers`` (``diffusers.WanTransformer3DModel``) that is a
  model (``ModelMixin``) or a scheduler (``SchedulerMixin``);
* a public class exported at the top level of ``transformers`` (``transformers.UMT5EncoderModel``) that is a
  model, a model config, a tokenizer or an image processor;
* one of this project's own component classes, registered by the layer that defines it through
  :func:`register_project_class` (core names none of them; the model layer registers its codec class when
  the ``worldfoundry`` package is imported);
* a class that an installed distribution registers under the entry-point group ``worldfoundry.classes``
  (entry point name = the reference as written in recipes, value = ``"package.module:Class"``), filtered by
  ``WORLDFOUNDRY_PLUGINS`` like acceleration plugins.

Anything else (``builtins.exec``, ``os.system``, ``diffusers.utils.something``, a function, a module attribute
that is not a class of the allowed kinds) raises :class:`~worldfoundry.errors.ClassNotAllowedError` before
anything is imported or called.

Example:
    >>> resolve_class("diffusers.FlowMatchEulerDiscreteScheduler", recipe="r", component="scheduler").__name__
    'FlowMatchEulerDiscreteScheduler'
    >>> resolve_class("builtins.exec", recipe="r", component="denoiser")
    Traceback (most recent call last):
    ...
    worldfoundry.errors.ClassNotAllowedError: recipe 'r': components.denoiser.class 'builtins.exec' is not an allowed class ...
"""

from __future__ import annotations

import importlib
import importlib.metadata as importlib_metadata
import os
import re
from typing import Final

from worldfoundry.errors import ClassNotAllowedError, RecipeError

#: Entry-point group through which installed distributions add classes recipes may name.
CLASS_ENTRY_POINT_GROUP: Final = "worldfoundry.classes"
#: This project's own component classes: reference -> (module, attribute), filled by
#: :func:`register_project_class` from code (never from a file).
PROJECT_CLASSES: Final[dict[str, tuple[str, str]]] = {}
_PUBLIC_CLASS_NAME: Final = re.compile(r"[A-Z][A-Za-z0-9]*")
_LIBRARIES: Final = ("diffusers", "transformers")


def register_project_class(reference: str, module: str, attribute: str) -> None:
    """Let recipes name one of this project's classes as ``reference``; it is imported only when a recipe uses it.

    Args:
        reference: the name recipes write (``"worldfoundry.<module path>.<Class>"``).
        module: the module that defines it (imported lazily, at resolution).
        attribute: the class's name in that module.

    Raises:
        ValueError: ``reference`` or ``module`` outside the ``worldfoundry`` package, or ``reference`` already
            registered for another class.
    """
    if not (reference.startswith("worldfoundry.") and module.startswith("worldfoundry.")):
        raise ValueError(f"project classes live in the worldfoundry package: got {reference!r} from {module!r}")
    previous = PROJECT_CLASSES.get(reference)
    if previous is not None and previous != (module, attribute):
        raise ValueError(f"project class {reference!r} is already registered as {previous[0]}.{previous[1]}")
    PROJECT_CLASSES[reference] = (module, attribute)


def _library_bases(library: str) -> tuple[type, ...]:
    """The base classes a class exported by ``library`` must derive from."""
    module = importlib.import_module(library)
    if library == "diffusers":
        names = ("ModelMixin", "SchedulerMixin")
    else:
        names = ("PreTrainedModel", "PreTrainedConfig", "PretrainedConfig", "PreTrainedTokenizerBase",
                 "ImageProcessingMixin")
    return tuple(b for b in (getattr(module, n, None) for n in names) if isinstance(b, type))


def _allowed_names(library: str) -> str:
    return ("diffusers models and schedulers" if library == "diffusers"
            else "transformers models, configs, tokenizers and image processors")


def _refuse(reference: object, *, recipe: str, component: str, field: str, why: str) -> ClassNotAllowedError:
    return ClassNotAllowedError(
        f"recipe {recipe!r}: components.{component}.{field} {reference!r} is not an allowed class ({why}). Recipes may "
        "name top-level diffusers models/schedulers, transformers models/configs/tokenizers/image processors or "
        "worldfoundry classes; register any other class through the 'worldfoundry.classes' entry point group "
        "of an installed distribution"
    )


def _entry_point_class(reference: str) -> type | None:
    """The class an installed ``worldfoundry.classes`` entry point named ``reference`` provides, if any."""
    from worldfoundry.core.acceleration.registry import PLUGIN_ALLOWLIST_ENV, parse_allowlist

    allow = parse_allowlist(os.environ.get(PLUGIN_ALLOWLIST_ENV))
    for ep in importlib_metadata.entry_points(group=CLASS_ENTRY_POINT_GROUP):
        if ep.name != reference:
            continue
        dist = ep.dist.name if ep.dist is not None else None
        if allow is not None and ep.name not in allow and dist not in allow:
            continue
        loaded = ep.load()  # installed code, chosen by the user's environment, never by a file
        return loaded if isinstance(loaded, type) else None
    return None


def resolve_class(reference: object, *, recipe: str, component: str, field: str = "class") -> type:
    """Resolve a class reference from a recipe through the allowlist.

    Args:
        reference: the string written in the recipe (``"diffusers.WanTransformer3DModel"``).
        recipe: recipe name (for messages).
        component: component name (for messages).
        field: ``"class"`` or ``"config_class"`` (for messages).

    Returns:
        The class.

    Raises:
        RecipeError: the reference is missing or not a dotted name.
        ClassNotAllowedError: the reference is not on the allowlist (nothing was imported or called).
    """
    if not isinstance(reference, str) or "." not in reference:
        raise RecipeError(
            f"recipe {recipe!r}: components.{component}.{field} must be a dotted class name, got {reference!r}")
    if reference in PROJECT_CLASSES:
        module, attr = PROJECT_CLASSES[reference]
        return getattr(importlib.import_module(module), attr)
    library, _, name = reference.partition(".")
    if library in _LIBRARIES and _PUBLIC_CLASS_NAME.fullmatch(name):
        try:
            candidate = getattr(importlib.import_module(library), name)
        except (ImportError, AttributeError) as exc:
            raise ClassNotAllowedError(
                f"recipe {recipe!r}: components.{component}.{field} {reference!r}: {library} has no class {name!r} "
                f"({type(exc).__name__}: {exc}); check the name and the installed {library} version"
            ) from None
        if isinstance(candidate, type) and issubclass(candidate, _library_bases(library)):
            return candidate
        raise _refuse(reference, recipe=recipe, component=component, field=field,
                      why=f"only {_allowed_names(library)} are allowed from {library}")
    registered = _entry_point_class(reference)
    if registered is not None:
        return registered
    raise _refuse(reference, recipe=recipe, component=component, field=field,
                  why="not a top-level diffusers/transformers class, a worldfoundry class or a registered class")


__all__ = ["CLASS_ENTRY_POINT_GROUP", "PROJECT_CLASSES", "register_project_class", "resolve_class"]
