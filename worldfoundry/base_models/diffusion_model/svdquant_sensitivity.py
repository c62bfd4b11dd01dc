"""Mixed precision chosen from calibration data: each unit's sensitivity to 4 bits, and the units kept dense.

``worldfoundry calibrate svdquant --keep-dense N`` decomposes every selected Linear as usual, then measures, on
the calibration requests only (their prompts and seeds; never the evaluation seeds), how much quantizing each
*unit* alone changes the result:

1. the dense outputs (final latents and frames) of the calibration requests are those of the statistics run
   (the observer's hooks change nothing);
2. for each unit -- a block's selected Linears (``unit="block"``: the path up to its first integer component,
   ``blocks.3.ffn.net.2`` -> ``blocks.3``) or one Linear (``unit="linear"``) -- its Linears run the quantized
   numerics the plugin runs on that device (``svdquant_dispatch.svdquant_linear``, ``backend="auto"``, from the
   very tensors written to the artifact) while every other Linear stays dense, and the requests run again;
3. each unit's score is the worst over the requests of the bench's quality metrics against the dense outputs
   (``latent_rel_l2``, and with frames ``psnr_db`` and ``min_ssim``, :func:`worldfoundry.bench.metrics.quality`);
4. the ``N`` units that score worst on ``metric`` are kept dense: their Linears leave the artifact, so the
   plugin quantizes only the others. Scores, ranking and the kept-dense units and Linears are recorded under the
   manifest's ``calibration.sensitivity``.

It costs one run of the calibration requests per unit (a unit quantized alone; its interactions with the
others are not measured). :func:`kept_dense_from_artifact` reads another artifact's kept-dense Linears, so a
baseline (``--method rtn``) can quantize exactly the Linears a sensitivity selection kept quantized.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch
from torch import nn

from worldfoundry.core.acceleration.patching import PatchRecorder
from worldfoundry.core.acceleration.quantization.svdquant_numerics import SVDQuantWeight
from worldfoundry.errors import InvalidRequestError

#: How Linears are grouped into units: per block (its selected Linears together) or one Linear each.
SENSITIVITY_UNITS: Final = ("block", "linear")
#: Scores a unit is ranked by; ``True``: larger is worse.
SENSITIVITY_METRICS: Final = {"latent_rel_l2": True, "min_ssim": False, "psnr_db": False}
PATCH_NAME: Final = "svdquant-sensitivity"
_INTEGER: Final = re.compile(r"^\d+$")


@dataclass(frozen=True)
class RequestOutput:
    """One calibration request's result: final latents and, when decoded, ``(F, H, W, 3)`` uint8 frames."""

    seed: int
    latents: torch.Tensor
    frames: np.ndarray | None = None


def _choice(flag: str, value: str, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``, else a one-line error naming ``flag``."""
    if value not in choices:
        raise InvalidRequestError(f"{flag} must be one of {list(choices)}, got {value!r}")
    return value


def check_unit(unit: str) -> str:
    """``unit`` if it is one of :data:`SENSITIVITY_UNITS`.

    Raises:
        InvalidRequestError: otherwise.
    """
    return _choice("--sensitivity-unit", unit, SENSITIVITY_UNITS)


def unit_of(path: str, unit: str = "block") -> str:
    """The unit a Linear belongs to: ``block``: the path up to its first integer component (the Linear itself
    when there is none); ``linear``: the path.

    Raises:
        InvalidRequestError: an unknown unit.
    """
    if check_unit(unit) == "linear":
        return path
    parts = path.split(".")
    for i, part in enumerate(parts):
        if _INTEGER.match(part):
            return ".".join(parts[: i + 1])
    return path


def group_units(paths: Sequence[str], unit: str = "block") -> dict[str, list[str]]:
    """``{unit: [Linear paths]}`` in the order of ``paths``."""
    units: dict[str, list[str]] = {}
    for path in paths:
        units.setdefault(unit_of(path, unit), []).append(path)
    return units


def check_keep_dense(keep_dense: Any, units: int | None = None) -> int:
    """``keep_dense`` as an int in ``[0, units - 1]`` (at least one unit stays quantized).

    Raises:
        InvalidRequestError: not an integer, negative, or not below the number of units.
    """
    if isinstance(keep_dense, bool) or not isinstance(keep_dense, int) or keep_dense < 0:
        raise InvalidRequestError(f"--keep-dense must be a non-negative integer, got {keep_dense!r}")
    if units is not None and keep_dense >= units:
        raise InvalidRequestError(f"--keep-dense {keep_dense} would keep every unit dense: the selection has "
                                  f"{units} unit(s); give at most {units - 1}")
    return keep_dense


def check_metric(metric: str) -> str:
    """``metric`` if it is one of :data:`SENSITIVITY_METRICS`.

    Raises:
        InvalidRequestError: otherwise.
    """
    return _choice("--sensitivity-metric", metric, SENSITIVITY_METRICS)


def weight_from_tensors(tensors: Mapping[str, torch.Tensor], path: str, group_size: int,
                        device: torch.device | str) -> SVDQuantWeight:
    """The :class:`SVDQuantWeight` of ``path`` from an artifact's tensors (``P.qweight``, ``P.scales``, ...)."""
    pick = {n: tensors.get(f"{path}.{n}") for n in ("qweight", "scales", "inv_smooth", "lora_down", "lora_up")}
    return SVDQuantWeight(pick["qweight"], pick["scales"], group_size, pick["inv_smooth"], pick["lora_down"],
                          pick["lora_up"]).to(device)


@contextmanager
def quantized_linears(modules: Mapping[str, nn.Linear], weights: Mapping[str, SVDQuantWeight],
                      backend: str = "auto") -> Iterator[None]:
    """While the block runs, each Linear of ``modules`` computes its quantized weight's output (the plugin's
    numerics on that device); the original forwards are back afterwards, also on errors."""
    from worldfoundry.core.acceleration.kernels.svdquant_dispatch import pad_rank, svdquant_linear

    with PatchRecorder(PATCH_NAME) as rec:
        for path, module in modules.items():
            weight, bias = pad_rank(weights[path]), module.bias

            def make(original: Callable[..., Any], weight: SVDQuantWeight = weight,
                     bias: torch.Tensor | None = bias) -> Callable[..., Any]:
                def forward(input: torch.Tensor) -> torch.Tensor:
                    return svdquant_linear(input, weight, bias, backend=backend)[0]

                return forward

            rec.wrap_forward(module, make, name=PATCH_NAME)
        yield


def worst_quality(outputs: Sequence[RequestOutput], dense: Sequence[RequestOutput]) -> dict[str, Any]:
    """The worst over the requests of the bench's quality metrics of ``outputs`` against ``dense``."""
    from worldfoundry.bench.metrics import quality

    per_request = [quality(o.latents, d.latents, o.frames, d.frames) for o, d in zip(outputs, dense, strict=True)]
    worst: dict[str, Any] = {"latent_rel_l2": max(float(q["latent_rel_l2"]) for q in per_request)}
    if all("psnr_db" in q for q in per_request):
        worst["psnr_db"] = min(float(q["psnr_db"]) for q in per_request)
        worst["min_ssim"] = min(float(q["min_ssim"]) for q in per_request)
    worst["per_request"] = {str(o.seed): {k: float(q[k]) for k in SENSITIVITY_METRICS if k in q}
                            for o, q in zip(outputs, per_request)}
    return worst


def measure_sensitivity(run: Callable[[], Sequence[RequestOutput]], dense: Sequence[RequestOutput],
                        units: Mapping[str, Sequence[str]], modules: Mapping[str, nn.Linear],
                        weights: Mapping[str, SVDQuantWeight], backend: str = "auto") -> dict[str, dict[str, Any]]:
    """Each unit's :func:`worst_quality` with its Linears alone quantized (``run`` reruns the requests).

    Returns:
        ``{unit: {"linears": [...], "latent_rel_l2": ..., "psnr_db": ..., "min_ssim": ..., "per_request": ...}}``.
    """
    scores: dict[str, dict[str, Any]] = {}
    for name, paths in units.items():
        with quantized_linears({p: modules[p] for p in paths}, weights, backend), torch.no_grad():
            outputs = run()
        scores[name] = {"linears": list(paths), **worst_quality(outputs, dense)}
    return scores


def rank_units(scores: Mapping[str, Mapping[str, Any]], metric: str = "latent_rel_l2") -> list[str]:
    """Units from the most sensitive to the least on ``metric`` (ties by name).

    Raises:
        InvalidRequestError: unknown metric, or a unit without that score (frames were not decoded).
    """
    check_metric(metric)
    missing = [u for u, s in scores.items() if metric not in s]
    if missing:
        raise InvalidRequestError(f"--sensitivity-metric {metric}: no such score for {missing[0]} (the requests "
                                  "returned no frames); use latent_rel_l2")
    sign = 1.0 if SENSITIVITY_METRICS[metric] else -1.0
    return sorted(scores, key=lambda u: (-sign * float(scores[u][metric]), u))


def sensitivity_record(scores: Mapping[str, Mapping[str, Any]], *, keep_dense: int, unit: str, metric: str,
                       backend: str, seeds: Sequence[int]) -> dict[str, Any]:
    """The manifest's ``calibration.sensitivity``: settings, per-unit scores, ranking and what stays dense."""
    ranking = rank_units(scores, metric)
    kept = ranking[:keep_dense]
    return {"unit": unit, "metric": metric, "keep_dense": keep_dense, "backend": backend,
            "seeds": [int(s) for s in seeds], "scores": {u: dict(s) for u, s in scores.items()},
            "ranking": ranking, "kept_dense": kept,
            "kept_dense_linears": [p for u in kept for p in scores[u]["linears"]]}


def drop_linears(manifest: dict[str, Any], tensors: dict[str, torch.Tensor], paths: Sequence[str]) -> None:
    """Remove ``paths``' entries and tensors from an artifact being built (in place)."""
    for path in paths:
        manifest["linears"].pop(path, None)
        for name in [n for n in tensors if n.startswith(f"{path}.")]:
            del tensors[name]


def kept_dense_from_artifact(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``calibration.sensitivity`` of an artifact written with ``--keep-dense`` (read and checked), with
    ``from_artifact`` added.

    Raises:
        ArtifactFormatError: the artifact cannot be read.
        InvalidRequestError: it records no kept-dense selection.
    """
    from worldfoundry.core.acceleration.quantization.svdquant_artifact import load_svdquant_artifact

    artifact = load_svdquant_artifact(path)
    record = (artifact.manifest.get("calibration") or {}).get("sensitivity")
    linears = record.get("kept_dense_linears") if isinstance(record, Mapping) else None
    if not isinstance(linears, list) or not all(isinstance(p, str) for p in linears):
        raise InvalidRequestError(f"--dense-from {os.fspath(path)}: the artifact records no kept-dense selection "
                                  "(calibration.sensitivity.kept_dense_linears); calibrate it with --keep-dense N")
    return {**{k: v for k, v in record.items() if k != "from_artifact"}, "from_artifact": str(artifact.file)}


__all__ = [
    "SENSITIVITY_METRICS",
    "SENSITIVITY_UNITS",
    "RequestOutput",
    "check_keep_dense",
    "check_metric",
    "check_unit",
    "drop_linears",
    "group_units",
    "kept_dense_from_artifact",
    "measure_sensitivity",
    "quantized_linears",
    "rank_units",
    "sensitivity_record",
    "unit_of",
    "weight_from_tensors",
]
