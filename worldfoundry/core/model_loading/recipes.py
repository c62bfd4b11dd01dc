"""Recipes: one YAML file per model (``recipes/<name>.yaml``), read with OmegaConf.

A recipe names the model family, its components (tokenizer, text encoder, optional image encoder,
denoiser with one or two experts, scheduler, codec) with their classes and configs, request defaults and
the accelerations that apply. ``offline: true`` recipes build random seeded weights and a local
tokenizer, so they need no file at all.

A recipe is data. Names are looked up only in ``$WORLDFOUNDRY_RECIPES``, the project's ``recipes/`` and the
recipes a wheel install carries — never in the working directory; a recipe elsewhere is used only when its
path is given explicitly. Class references go through
:func:`~worldfoundry.core.model_loading.class_allowlist.resolve_class`; OmegaConf resolvers (``${oc.env:...}``)
are refused, plain ``${key}`` interpolations are allowed.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from worldfoundry.errors import RecipeError, UnknownRecipeError

RECIPES_ENV: Final = "WORLDFOUNDRY_RECIPES"
FAMILIES: Final = ("wan", "sana_video", "minimax_h3")
MODES: Final = ("t2v", "i2v", "ti2v", "session")
#: Largest recipe file accepted.
MAX_RECIPE_BYTES: Final = 1 << 20
RECIPE_SUFFIXES: Final = (".yaml", ".yml")


def installed_recipe_dirs() -> list[Path]:
    """Where a wheel install puts the built-in recipes: ``<data>/share/worldfoundry/recipes`` of the
    environment's install schemes (the prefix, the user scheme) and next to a ``--target`` directory."""
    dirs: list[Path] = []
    for scheme in (None, f"{os.name}_user"):
        try:
            data = sysconfig.get_path("data", scheme) if scheme else sysconfig.get_path("data")
        except KeyError:
            continue
        if data:
            dirs.append(Path(data) / "share" / "worldfoundry" / "recipes")
    # pip install --target T puts data files under T as well (T holds the package directory)
    dirs.append(Path(__file__).resolve().parents[3] / "share" / "worldfoundry" / "recipes")
    return dirs


def recipe_dirs() -> list[Path]:
    """Where recipes are looked for by name: ``$WORLDFOUNDRY_RECIPES`` (``os.pathsep``-separated), the project's
    ``recipes/`` directory (editable installs) and the recipes a wheel install carries. The working directory is
    never searched: a recipe there is used only through its explicit path."""
    dirs: list[Path] = []
    env = os.environ.get(RECIPES_ENV)
    if env:
        dirs.extend(Path(p) for p in env.split(os.pathsep) if p)
    dirs.append(Path(__file__).resolve().parents[3] / "recipes")
    dirs.extend(installed_recipe_dirs())
    seen: list[Path] = []
    for d in dirs:
        if d.is_dir() and d.resolve() not in [s.resolve() for s in seen]:
            seen.append(d)
    return seen


def project_root() -> Path:
    """The directory holding ``recipes/`` (the project checkout for editable installs)."""
    dirs = recipe_dirs()
    return dirs[0].parent if dirs else Path.cwd()


def available_recipes() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for d in recipe_dirs():
        for path in sorted(d.glob("*.yaml")):
            found.setdefault(path.stem, path)
    return found


@dataclass(frozen=True)
class ComponentSpec:
    """One component: a class path, its config and where its weights live in a diffusers directory."""

    name: str
    class_path: str | None = None
    config_class: str | None = None
    config: Mapping[str, Any] = field(default_factory=dict)
    subfolder: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.extra.get(key, default)


@dataclass(frozen=True)
class Recipe:
    name: str
    family: str
    mode: str
    description: str
    offline: bool
    seed: int
    hf_repo: str | None
    components: Mapping[str, ComponentSpec]
    experts: tuple[str, ...]
    expert_subfolders: tuple[str, ...]
    boundary_ratio: float | None
    defaults: Mapping[str, Any]
    accelerations: tuple[str, ...]
    path: Path | None = None
    raw: Mapping[str, Any] = field(default_factory=dict)
    assets_dir: Path | None = None

    @property
    def denoiser(self) -> ComponentSpec:
        return self.components["denoiser"]

    def component(self, name: str) -> ComponentSpec | None:
        return self.components.get(name)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "path": str(self.path) if self.path else None, **dict(self.raw)}


_TOP_KEYS = {"name", "family", "mode", "description", "offline", "seed", "hf_repo", "components", "defaults",
             "accelerations", "assets"}
_COMPONENT_KEYS = {"class", "config_class", "config", "subfolder"}


def _parse_component(recipe: str, name: str, data: Any) -> ComponentSpec:
    if not isinstance(data, Mapping):
        raise RecipeError(f"recipe {recipe!r}: components.{name} must be a mapping")
    extra = {k: v for k, v in data.items() if k not in _COMPONENT_KEYS}
    config = data.get("config") or {}
    if not isinstance(config, Mapping):
        raise RecipeError(f"recipe {recipe!r}: components.{name}.config must be a mapping")
    return ComponentSpec(name, data.get("class"), data.get("config_class"), dict(config), data.get("subfolder"), extra)


def parse_recipe(data: Mapping[str, Any], *, path: Path | None = None) -> Recipe:
    """Validate a recipe mapping. Raises :class:`RecipeError` naming the recipe and the bad field."""
    name = str(data.get("name") or (path.stem if path else "<inline>"))
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise RecipeError(f"recipe {name!r}: unknown top-level key(s) {unknown}; known: {sorted(_TOP_KEYS)}")
    family = data.get("family")
    if family not in FAMILIES:
        raise RecipeError(f"recipe {name!r}: family must be one of {FAMILIES}, got {family!r}")
    mode = data.get("mode", "t2v")
    if mode not in MODES:
        raise RecipeError(f"recipe {name!r}: mode must be one of {MODES}, got {mode!r}")
    comps_raw = data.get("components")
    if not isinstance(comps_raw, Mapping) or "denoiser" not in comps_raw:
        raise RecipeError(f"recipe {name!r}: components must be a mapping with at least a denoiser")
    components = {k: _parse_component(name, k, v) for k, v in comps_raw.items()}
    den = components["denoiser"]
    experts_raw = den.get("experts") or [{"name": "model", "subfolder": den.subfolder or "transformer"}]
    if not isinstance(experts_raw, list) or not 1 <= len(experts_raw) <= 2:
        raise RecipeError(f"recipe {name!r}: components.denoiser.experts must list one or two experts")
    experts = tuple(str(e["name"]) for e in experts_raw)
    subfolders = tuple(str(e.get("subfolder") or "transformer") for e in experts_raw)
    boundary = den.get("boundary_ratio")
    if len(experts) == 2 and boundary is None:
        raise RecipeError(f"recipe {name!r}: two experts need components.denoiser.boundary_ratio")
    if boundary is not None and not 0.0 < float(boundary) < 1.0:
        raise RecipeError(f"recipe {name!r}: boundary_ratio must be in (0, 1), got {boundary}")
    defaults = dict(data.get("defaults") or {})
    for key in ("num_frames", "height", "width", "num_inference_steps"):
        if key in defaults and (not isinstance(defaults[key], int) or defaults[key] <= 0):
            raise RecipeError(f"recipe {name!r}: defaults.{key} must be a positive integer")
    accelerations = data.get("accelerations") or []
    assets = data.get("assets")
    assets_dir = None
    if assets is not None:
        assets_dir = Path(str(assets))
        if not assets_dir.is_absolute():
            assets_dir = (path.parent if path else Path.cwd()) / assets_dir
    return Recipe(
        name=name,
        family=family,
        mode=mode,
        description=str(data.get("description", "")),
        offline=bool(data.get("offline", False)),
        seed=int(data.get("seed", 0)),
        hf_repo=data.get("hf_repo"),
        components=components,
        experts=experts,
        expert_subfolders=subfolders,
        boundary_ratio=float(boundary) if boundary is not None else None,
        defaults=defaults,
        accelerations=tuple(str(a) for a in accelerations),
        path=path,
        raw=dict(data),
        assets_dir=assets_dir,
    )


def is_recipe_path(name_or_path: str | os.PathLike[str]) -> bool:
    """``True`` when the argument names a recipe file (a ``.yaml``/``.yml`` suffix or a directory part)."""
    text = os.fspath(name_or_path)
    return Path(text).suffix in RECIPE_SUFFIXES or os.sep in text or (os.altsep is not None and os.altsep in text)


def read_recipe_file(path: Path) -> Recipe:
    """Read and validate one recipe file (stat first: a regular file of at most :data:`MAX_RECIPE_BYTES`).

    Raises:
        InputFileError: missing, a directory or special file, too large.
        RecipeError: not UTF-8 YAML, uses resolvers, or a malformed recipe.
    """
    from worldfoundry.core.model_loading.input_files import YamlInputError, load_yaml_file

    try:
        data = load_yaml_file(path, what="recipe file", max_bytes=MAX_RECIPE_BYTES)
    except YamlInputError as exc:
        raise RecipeError(f"cannot read recipe file {path}: {exc.reason}") from exc
    if not isinstance(data, dict):
        raise RecipeError(f"recipe file {path}: the top level must be a mapping")
    return parse_recipe(data, path=path)


def load_recipe(name_or_path: str | os.PathLike[str]) -> Recipe:
    """Load a recipe by name (``"tiny-wan2.1"``) or by the explicit path of a YAML file.

    A name is looked up in :func:`recipe_dirs` only (never in the working directory).

    Raises:
        UnknownRecipeError: no recipe of that name (the message lists the known ones).
        InputFileError: the path is not a regular recipe file.
        RecipeError: the file is malformed.
    """
    if is_recipe_path(name_or_path):
        return read_recipe_file(Path(os.fspath(name_or_path)))
    known = available_recipes()
    key = str(name_or_path)
    if key not in known:
        local = [p for p in (Path("recipes") / f"{key}{s}" for s in RECIPE_SUFFIXES) if p.is_file()]
        hint = (f"{local[0]} in the working directory is not used by name; pass its path explicitly "
                f"(e.g. --recipe-file {local[0]}) if you trust it" if local else "")
        raise UnknownRecipeError(key, known, hint)
    return read_recipe_file(known[key])
