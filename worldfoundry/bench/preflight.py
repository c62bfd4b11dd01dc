"""Everything the benchmark checks before a model is built or ``--out`` is created.

* :func:`resolve_model` decides which recipe the run uses: ``--recipe-file PATH``, ``--model`` (a recipe name,
  an explicit recipe path or a diffusers directory), the candidate file's ``model`` (a name is looked up only
  among the installed recipes; a path is resolved against the candidate file's directory and announced before
  it is read), else the default tiny model.
* :func:`check_workload` checks the workload against that recipe: frame counts the codec accepts
  (``1 + k·temporal_stride``), heights and widths divisible by codec stride × patch size, and CLI seeds.

Reading a recipe parses data only; class references in it resolve through the allowlist, so a hostile recipe is a
typed error here, before any model exists.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worldfoundry.bench.candidates import CandidateFile, check_seed
from worldfoundry.core.model_loading.class_allowlist import resolve_class
from worldfoundry.core.model_loading.input_files import check_input_file
from worldfoundry.core.model_loading.recipes import MAX_RECIPE_BYTES, Recipe, is_recipe_path
from worldfoundry.errors import BenchArgumentError, CandidateSchemaError, InputFileError

#: Strides the drivers assume when a recipe has no codec.
DEFAULT_STRIDES = (4, 8)


@dataclass(frozen=True)
class ModelChoice:
    """The model argument for ``NativeDiffusionPipeline.from_pretrained`` and where it came from."""

    model: str
    origin: str  # "--recipe-file" | "--model" | "candidates" | "default"
    recipe_file: str | None = None


def _recipe_file(path: Path, origin: str) -> ModelChoice:
    check_input_file(path, what="recipe file", max_bytes=MAX_RECIPE_BYTES)
    return ModelChoice(str(path.resolve()), origin, str(path.resolve()))


def resolve_model(model: str | None, recipe_file: str | None, cfile: CandidateFile, default: str,
                  announce: Callable[[str], None] | None = None) -> ModelChoice:
    """Choose the recipe of a run; announce any recipe file before it is read.

    Args:
        model: ``--model`` (name, explicit recipe path or diffusers directory), or ``None``.
        recipe_file: ``--recipe-file``, or ``None``.
        cfile: the validated candidate file.
        default: the model used when nothing names one.
        announce: called with a one-line message before a recipe file is used (the CLI prints it).

    Returns:
        The :class:`ModelChoice`.

    Raises:
        BenchArgumentError: ``--model`` and ``--recipe-file`` together.
        InputFileError: a recipe file that is missing, a directory or special file, or too large.
        CandidateSchemaError: the candidate file's ``model`` names a path that is not a recipe file.
    """
    if recipe_file is not None and model is not None:
        raise BenchArgumentError("give either --model or --recipe-file, not both")
    choice: ModelChoice
    if recipe_file is not None:
        choice = _recipe_file(Path(recipe_file), "--recipe-file")
    elif model is not None:
        choice = _recipe_file(Path(model), "--model") if is_recipe_path(model) and not Path(model).is_dir() else \
            ModelChoice(model, "--model")
    elif cfile.model is not None and is_recipe_path(cfile.model):
        base = Path(cfile.source).parent if cfile.source else Path.cwd()
        path = Path(cfile.model) if Path(cfile.model).is_absolute() else base / cfile.model
        if path.is_dir():
            choice = ModelChoice(str(path.resolve()), "candidates")
        else:
            try:
                choice = _recipe_file(path, "candidates")
            except InputFileError as exc:
                raise CandidateSchemaError("model", str(exc)) from exc
    elif cfile.model is not None:
        choice = ModelChoice(cfile.model, "candidates")
    else:
        choice = ModelChoice(default, "default")
    if announce is not None and (choice.recipe_file is not None or Path(choice.model).is_dir()):
        named_by = f"named by {cfile.source}" if choice.origin == "candidates" else f"from {choice.origin}"
        what = "recipe file" if choice.recipe_file is not None else "model directory"
        announce(f"loading {what} {choice.model} ({named_by})")
    return choice


# --------------------------------------------------------------------------------------------- geometry


@dataclass(frozen=True)
class VideoGeometry:
    """What a request's size must respect: the codec's strides and the denoiser's patch size."""

    temporal_stride: int
    spatial_stride: int
    patch: tuple[int, int, int]


def _signature_default(cls: type, name: str) -> Any:
    try:
        param = inspect.signature(cls.__init__).parameters.get(name)
    except (TypeError, ValueError):
        return None
    return None if param is None or param.default is inspect.Parameter.empty else param.default


def _int_tuple(value: Any, length: int) -> tuple[int, ...] | None:
    if isinstance(value, Sequence) and not isinstance(value, str) and len(value) == length and all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        return tuple(value)
    return None


def recipe_geometry(recipe: Recipe) -> VideoGeometry | None:
    """The geometry a recipe's requests must respect, read from the recipe alone (no model is built).

    Returns:
        ``None`` for families driven by conditioning bundles (MiniMax-H3), whose sizes the bundle fixes.

    Raises:
        RecipeError / ClassNotAllowedError: a class reference in the recipe is not allowed.
    """
    if recipe.family == "minimax_h3":
        return None
    den = recipe.denoiser
    den_cls = resolve_class(den.class_path, recipe=recipe.name, component="denoiser")
    patch = _int_tuple(den.config.get("patch_size", _signature_default(den_cls, "patch_size")), 3) or (1, 2, 2)
    codec = recipe.component("codec")
    temporal, spatial = DEFAULT_STRIDES
    if codec is not None:
        codec_cls = resolve_class(codec.class_path, recipe=recipe.name, component="codec")
        config: Mapping[str, Any] = codec.config
        strides_for = getattr(codec_cls, "strides_for", None)
        if callable(strides_for):
            temporal, spatial = strides_for(dict(config))
        else:
            t = config.get("scale_factor_temporal", _signature_default(codec_cls, "scale_factor_temporal"))
            s = config.get("scale_factor_spatial", _signature_default(codec_cls, "scale_factor_spatial"))
            temporal = t if isinstance(t, int) and t > 0 else DEFAULT_STRIDES[0]
            spatial = s if isinstance(s, int) and s > 0 else DEFAULT_STRIDES[1]
    return VideoGeometry(int(temporal), int(spatial), patch)  # type: ignore[arg-type]


def check_workload(workload: Mapping[str, Any], recipe: Recipe, *, cli_seeds: Sequence[Any] | None = None) -> None:
    """Check the workload's sizes against ``recipe`` (recipe defaults fill absent fields) and any CLI seeds.

    Raises:
        CandidateSchemaError: ``workload.frames`` / ``.height`` / ``.width`` the model cannot run (the message
            suggests valid values), or ``--seeds`` values out of range.
    """
    for i, seed in enumerate(cli_seeds or ()):
        check_seed(f"--seeds[{i}]", seed)
    geometry = recipe_geometry(recipe)
    if geometry is None:
        return
    defaults = recipe.defaults
    frames = workload.get("frames", defaults.get("num_frames"))
    t = geometry.temporal_stride
    if isinstance(frames, int) and (frames - 1) % t:
        low = (frames - 1) // t * t + 1
        raise CandidateSchemaError(
            "workload.frames", f"{frames} frames: the codec of {recipe.name!r} has temporal stride {t}, so frames must "
            f"be {t}·k + 1 (e.g. {low} or {low + t})")
    for key, axis in (("height", 1), ("width", 2)):
        value = workload.get(key, defaults.get(key))
        step = geometry.spatial_stride * geometry.patch[axis]
        if isinstance(value, int) and value % step:
            raise CandidateSchemaError(
                f"workload.{key}", f"{value} is not divisible by {step} (codec stride {geometry.spatial_stride} × patch "
                f"{geometry.patch[axis]} of {recipe.name!r}); try {max(step, value // step * step)}")


__all__ = ["ModelChoice", "VideoGeometry", "check_workload", "recipe_geometry", "resolve_model"]
