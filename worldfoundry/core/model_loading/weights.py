"""Building one component's module: random seeded weights, a local diffusers directory, the local Hugging
Face cache (``local_files_only=True``) or a single original-format file (diffusers' ``from_single_file``).

Class references resolve through the allowlist (:mod:`~worldfoundry.core.model_loading.class_allowlist`). Files
of a ``checkpoint_dir`` are checked before any tensor is read (regular files within size bounds, strict JSON
configs and indexes, valid safetensors headers, shard names inside the directory); after loading, missing,
unexpected and mismatched tensors are all reported and NaN/Inf weights are refused."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from worldfoundry.core.model_loading.class_allowlist import resolve_class
from worldfoundry.core.model_loading.dtypes import apply_dtype_policy
from worldfoundry.core.model_loading.input_files import (
    check_finite_tensors,
    check_input_file,
    load_json_file,
)
from worldfoundry.core.model_loading.recipes import ComponentSpec, Recipe
from worldfoundry.errors import CheckpointError, CheckpointKeysError, MissingWeightsError

#: Largest single weight file / JSON file of a checkpoint directory accepted.
MAX_WEIGHT_FILE_BYTES = 1 << 41
MAX_CHECKPOINT_JSON_BYTES = 16 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightSource:
    """Where a component's weights came from (reported wherever results appear)."""

    component: str
    kind: str  # "random" | "diffusers_dir" | "hf_cache" | "single_file" | "local_tokenizer" | "config"
    path: str | None = None
    seed: int | None = None

    @property
    def random(self) -> bool:
        return self.kind == "random"

    def to_json(self) -> dict[str, Any]:
        return {"component": self.component, "kind": self.kind, "path": self.path, "seed": self.seed}


def import_class(path: str | None, *, recipe: str, component: str, field: str = "class") -> type:
    """Resolve a recipe's class reference through the allowlist (nothing else is ever imported).

    Raises:
        RecipeError: not a dotted name. ClassNotAllowedError: not on the allowlist.
    """
    return resolve_class(path, recipe=recipe, component=component, field=field)


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Deterministic initialisation: fork the RNGs, seed them, restore afterwards."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def build_random(spec: ComponentSpec, recipe: Recipe, *, seed: int, device: torch.device,
                 dtype: torch.dtype | None) -> nn.Module:
    """Instantiate a component from its recipe config with seeded random weights on ``device``."""
    cls = import_class(spec.class_path, recipe=recipe.name, component=spec.name)
    init_device = device if device.type == "cuda" else torch.device("cpu")
    with seeded(seed, init_device), torch.device(init_device):
        if spec.config_class:  # transformers: Model(ConfigClass(**config))
            config_cls = import_class(spec.config_class, recipe=recipe.name, component=spec.name, field="config_class")
            module = cls(config_cls(**dict(spec.config)))
        else:  # diffusers: from_config
            module = cls.from_config(dict(spec.config))
    module = module.to(device)
    if dtype is not None:
        apply_dtype_policy(module, dtype)
    return module.eval().requires_grad_(False)


def check_component_dir(where: Path) -> None:
    """Stat and check every file of a diffusers/transformers component directory before anything reads it.

    Every file must be a regular file within :data:`MAX_WEIGHT_FILE_BYTES`, safetensors files with a valid
    header; JSON files (config, shard index) must be strict JSON; an index's shard names must be plain
    file names inside ``where``.

    Raises:
        InputFileError: a special file, a directory where a file belongs, or a file over its bound.
        JsonInputError: a malformed JSON file (names the key).
        CheckpointError: a corrupt safetensors header or a shard outside the directory.
    """
    from worldfoundry.core.model_loading.tensor_store import SafetensorsTensorStore

    for file in sorted(where.iterdir()):
        if file.suffix == ".json":
            data = load_json_file(file, what="checkpoint JSON file", max_bytes=MAX_CHECKPOINT_JSON_BYTES)
            shards = data.get("weight_map", {}) if isinstance(data, dict) and file.name.endswith(".index.json") else {}
            if not isinstance(shards, dict):
                raise CheckpointError(f"{file}: weight_map must be an object of tensor name -> shard file name")
            for key, shard in shards.items():
                if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
                    raise CheckpointError(f"{file}: weight_map[{key!r}] = {shard!r} is not a file name inside {where}")
        elif file.suffix in _WEIGHT_SUFFIXES:
            check_input_file(file, what="weight file", max_bytes=MAX_WEIGHT_FILE_BYTES)
            if file.suffix == ".safetensors":
                SafetensorsTensorStore(file)  # validates the header and the byte layout; reads no tensor
        elif not file.is_dir():  # tokenizer models, vocabularies, ...: regular files within the bound
            check_input_file(file, what="checkpoint file", max_bytes=MAX_WEIGHT_FILE_BYTES)


def _from_pretrained(cls: type, location: str, subfolder: str | None, dtype: torch.dtype | None) -> nn.Module:
    kwargs: dict[str, Any] = {"local_files_only": True, "output_loading_info": True}
    if subfolder:
        kwargs["subfolder"] = subfolder
    if dtype is not None:
        kwargs["torch_dtype"] = dtype
    module, info = cls.from_pretrained(location, **kwargs)
    missing = sorted(info.get("missing_keys") or ())
    unexpected = sorted(info.get("unexpected_keys") or ())
    mismatched = [f"{m[0]} {tuple(m[1])} != {tuple(m[2])}" if isinstance(m, tuple | list) and len(m) == 3 else str(m)
                  for m in (info.get("mismatched_keys") or ())]
    where = f"{location}/{subfolder or '.'}"
    if missing or unexpected:
        raise CheckpointKeysError(where, missing, unexpected,
                                  f"Use the {cls.__name__} checkpoint written for this configuration (config.json).")
    if mismatched:
        raise CheckpointError(f"{where}: {len(mismatched)} tensor(s) with the wrong shape: {', '.join(mismatched[:4])}")
    return module


def hf_cache_dir(repo: str) -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / ("models--" + repo.replace("/", "--"))


def load_pretrained(spec: ComponentSpec, recipe: Recipe, *, subfolder: str | None, checkpoint_dir: str | None,
                    device: torch.device, dtype: torch.dtype | None) -> tuple[nn.Module, WeightSource]:
    """Load from ``checkpoint_dir/<subfolder>`` or the local HF cache of ``recipe.hf_repo``.

    Raises:
        MissingWeightsError: neither place has the component (names the paths looked at).
        CheckpointError: the files exist but cannot be read (corrupt, wrong keys).
    """
    cls = import_class(spec.class_path, recipe=recipe.name, component=spec.name)
    looked_at: list[str] = []
    candidates: list[tuple[str, str]] = []
    if checkpoint_dir is not None:
        where = Path(checkpoint_dir) / (subfolder or "")
        looked_at.append(str(where))
        if (where / "config.json").is_file():
            try:
                check_component_dir(where)
            except CheckpointError as exc:
                raise CheckpointError(f"recipe {recipe.name!r}: component {spec.name!r}: {exc}") from exc
            candidates.append(("diffusers_dir", str(checkpoint_dir)))
    if recipe.hf_repo:
        cache = hf_cache_dir(recipe.hf_repo)
        looked_at.append(f"{cache} (Hugging Face cache, subfolder {subfolder or '.'}, local_files_only)")
        if cache.is_dir():
            candidates.append(("hf_cache", recipe.hf_repo))
    for kind, location in candidates:
        try:
            module = _from_pretrained(cls, location, subfolder, dtype)
        except CheckpointError:
            raise
        except OSError as exc:
            text = str(exc)
            if kind == "hf_cache" or "no file named" in text.lower() or "does not appear to have" in text:
                looked_at.append(f"{location}: {text.splitlines()[0][:200]}")
                continue  # absent files: reported together below as missing weights
            raise CheckpointError(
                f"recipe {recipe.name!r}: cannot read component {spec.name!r} from {location} "
                f"(subfolder {subfolder}): {exc}"
            ) from exc
        except Exception as exc:  # safetensors / torch raise various types on corrupt files
            raise CheckpointError(
                f"recipe {recipe.name!r}: cannot read component {spec.name!r} from {location} "
                f"(subfolder {subfolder}): {type(exc).__name__}: {exc}"
            ) from exc
        module = module.to(device).eval().requires_grad_(False)
        check_finite_tensors(module.state_dict(), where=f"{location} ({spec.name}, subfolder {subfolder or '.'})")
        return module, WeightSource(spec.name, kind, location)
    raise MissingWeightsError(recipe.name, spec.name, looked_at)


@contextlib.contextmanager
def _config_dir(spec: ComponentSpec, cls: type) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="worldfoundry-config-") as tmp:
        config = {"_class_name": cls.__name__, **dict(spec.config)}
        Path(tmp, "config.json").write_text(json.dumps(config))
        yield tmp


def load_single_file(spec: ComponentSpec, recipe: Recipe, path: str | os.PathLike[str], *, device: torch.device,
                     dtype: torch.dtype | None) -> tuple[nn.Module, WeightSource]:
    """Load an original-format (or diffusers-format) single file for a diffusers component, converting keys
    with diffusers' own ``from_single_file`` conversion; the config comes from the recipe (no download).

    Raises:
        MissingWeightsError: the file does not exist.
        CheckpointError: the file is corrupt or its keys do not match the model.
    """
    file = Path(os.fspath(path))
    if not file.is_file():
        raise MissingWeightsError(recipe.name, spec.name, [str(file)], "Check the checkpoint_overrides path.")
    if file.suffix not in (".safetensors", ".pth", ".pt", ".ckpt", ".bin"):
        raise CheckpointError(f"{file}: unsupported checkpoint suffix {file.suffix!r} (use .safetensors or .pth)")
    check_input_file(file, what="checkpoint file", max_bytes=MAX_WEIGHT_FILE_BYTES)
    cls = import_class(spec.class_path, recipe=recipe.name, component=spec.name)
    if not hasattr(cls, "from_single_file"):
        raise CheckpointError(f"recipe {recipe.name!r}: {cls.__name__} has no single-file loader in diffusers")
    try:
        with _config_dir(spec, cls) as config_dir:
            kwargs: dict[str, Any] = {"config": config_dir, "local_files_only": True}
            if dtype is not None:
                kwargs["torch_dtype"] = dtype
            module = cls.from_single_file(str(file), **kwargs)
    except Exception as exc:
        raise CheckpointError(f"recipe {recipe.name!r}: cannot load {spec.name!r} from single file {file}: "
                              f"{type(exc).__name__}: {exc}") from exc
    module = module.to(device).eval().requires_grad_(False)
    check_finite_tensors(module.state_dict(), where=f"{file} ({spec.name})")
    return module, WeightSource(spec.name, "single_file", str(file))


def check_config_matches(module: nn.Module, spec: ComponentSpec, recipe: Recipe) -> None:
    """Refuse a loaded component whose config contradicts the recipe on the keys the recipe states."""
    config = getattr(module, "config", None)
    if config is None or not spec.config:
        return
    getter = config.get if isinstance(config, Mapping) else (lambda k, d=None: getattr(config, k, d))
    mismatched = []
    for key, expected in spec.config.items():
        actual = getter(key, None)
        if actual is None:
            continue
        if isinstance(actual, tuple | list) and isinstance(expected, tuple | list):
            same = list(actual) == list(expected)
        else:
            same = actual == expected
        if not same:
            mismatched.append(f"{key}: recipe {expected!r}, checkpoint {actual!r}")
    if mismatched:
        raise CheckpointError(
            f"recipe {recipe.name!r}: component {spec.name!r} does not match the recipe: " + "; ".join(mismatched[:6])
        )
