"""SVDQuant calibration of a DiT's Linears: activation statistics, decomposition, the bound artifact.

Steps (``worldfoundry calibrate svdquant`` runs all of them):

1. :func:`select_for_calibration` resolves ``include`` patterns (original Wan names such as
   ``blocks.*.ffn.0`` are translated, see ``optimizations/linear_aliases.py``) to plain ``nn.Linear`` modules.
2. :class:`InputAbsmaxObserver` records, per selected Linear, the absmax of every input channel over all
   calls (forward pre-hooks, removed afterwards, also on errors).
3. :func:`calibrate_pipeline` runs the calibration requests (its own prompts and seeds 11/12, never the
   evaluation seeds 42/43) through the native pipeline under the observer, optionally saving each request's
   latents and frames as references.
4. :func:`build_svdquant_artifact` decomposes every Linear (smoothing, SVD, INT4 residual; ``method="rtn"``:
   no smoothing, rank 0) and builds the manifest, with the SHA256 of every source parameter and the
   calibration provenance.
5. With ``keep_dense=N``, :func:`calibrate_pipeline` then quantizes each unit (a block's Linears, or one Linear)
   alone, runs the same calibration requests again and leaves the ``N`` units that move the result most out of
   the artifact (``svdquant_sensitivity``; scores under ``calibration.sensitivity``); ``dense_from`` leaves out
   the Linears another artifact's selection kept dense.
6. With ``sequential=True``, the Linears left quantized are observed again block by block, each block behind the
   quantized blocks before it, and decomposed from those statistics (``svdquant_sequential``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, Final

import torch
from torch import nn

from worldfoundry.base_models.diffusion_model.optimizations.families import family_of
from worldfoundry.base_models.diffusion_model.optimizations.linear_aliases import translate_patterns
from worldfoundry.base_models.diffusion_model.optimizations.projection_selection import (
    SelectedLinear,
    select_linears,
)
from worldfoundry.base_models.diffusion_model.svdquant_sensitivity import (
    RequestOutput,
    check_keep_dense,
    check_metric,
    check_unit,
    drop_linears,
    group_units,
    kept_dense_from_artifact,
    measure_sensitivity,
    sensitivity_record,
    weight_from_tensors,
)
from worldfoundry.core.acceleration.patching import PatchRecorder
from worldfoundry.core.acceleration.quantization.parameter_digest import parameter_digests
from worldfoundry.core.acceleration.quantization.svdquant_artifact import ARTIFACT_FORMAT, METHODS
from worldfoundry.core.acceleration.quantization.svdquant_numerics import (
    ROUNDINGS,
    SVDQuantWeight,
    decompose,
    weight_rel_error,
)
from worldfoundry.errors import AccelerationRefusedError, InvalidRequestError

logger = logging.getLogger(__name__)

CALIBRATION_NAME: Final = "svdquant-calibration"
#: Calibration prompts and seeds (evaluation uses other prompts and seeds 42/43).
CALIBRATION_PROMPTS: Final = ("a blue circle bouncing", "a green bar moving up")
CALIBRATION_SEEDS: Final = (11, 12)
EVALUATION_SEEDS: Final = (42, 43)
#: How the INT4 residual is rounded: to nearest, or with GPTQ's error compensation under the inputs' moments.


def select_for_calibration(model: nn.Module, include: Sequence[str]) -> list[SelectedLinear]:
    """The plain ``nn.Linear`` modules ``include`` selects (original Wan names translated).

    Raises:
        InvalidRequestError: a pattern matches no Linear (the message lists the model's Linear names).
    """
    try:
        family = family_of(model).name
    except AccelerationRefusedError:
        family = None
    patterns = translate_patterns(model, include, family=family)
    try:
        return select_linears(model, patterns, plugin=CALIBRATION_NAME)
    except AccelerationRefusedError as exc:
        raise InvalidRequestError(f"--include: {exc.reason if hasattr(exc, 'reason') else exc}") from exc


class InputAbsmaxObserver:
    """Per-input-channel absmax of the inputs of some Linears, while the ``with`` block runs.

    Attributes:
        absmax: ``{path: float32 [K]}`` on each Linear's device.
        moments: with ``second_moments``, ``{path: float32 [K, K]}``, the inputs' ``X^T X`` summed over rows (for
            error-compensating rounding; ``K^2`` floats per Linear).
        calls / rows: per path, forward calls and input rows seen.
    """

    def __init__(self, selected: Sequence[SelectedLinear], *, second_moments: bool = False) -> None:
        self.selected = list(selected)
        self.second_moments = second_moments
        self.moments: dict[str, torch.Tensor] = {}
        self.absmax: dict[str, torch.Tensor] = {}
        self.calls: dict[str, int] = {s.path: 0 for s in self.selected}
        self.rows: dict[str, int] = {s.path: 0 for s in self.selected}
        self._recorder: PatchRecorder | None = None

    def _hook(self, path: str):  # noqa: ANN202 - a torch forward pre-hook
        def observe(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            x2d = x.reshape(-1, x.shape[-1])
            amax = x2d.abs().amax(dim=0).float()
            with torch.inference_mode(False):
                current = self.absmax.get(path)
                self.absmax[path] = amax.clone() if current is None else torch.maximum(current, amax)
                if self.second_moments:
                    xf = x2d.float()
                    gram = xf.t() @ xf
                    previous = self.moments.get(path)
                    self.moments[path] = gram if previous is None else previous + gram
            self.calls[path] += 1
            self.rows[path] += x.numel() // x.shape[-1]

        return observe

    def __enter__(self) -> InputAbsmaxObserver:
        rec = PatchRecorder(CALIBRATION_NAME)
        for s in self.selected:
            rec.hook(s.module.register_forward_pre_hook(self._hook(s.path)), f"observe {s.path}")
        self._recorder = rec
        return self

    def __exit__(self, *exc: object) -> None:
        if self._recorder is not None:
            self._recorder.undo()
            self._recorder = None


def _digest_record(tensor: torch.Tensor | None, digest: str | None) -> dict[str, Any] | None:
    if tensor is None:
        return None
    return {"sha256": digest, "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}


def build_svdquant_artifact(
    model: nn.Module, selected: Sequence[SelectedLinear], absmax: Mapping[str, torch.Tensor] | None, *,
    method: str = "svdquant", rank: int = 32, group_size: int = 64, alpha: float = 0.5, svd: str = "full",
    include: Sequence[str] = (), calibration: Mapping[str, Any] | None = None,
    observer: InputAbsmaxObserver | None = None, unsmoothed: Sequence[str] = (), rounding: str = "nearest",
    lowrank_fit: str = "svd", refine: int = 0, decomposed: Mapping[str, SVDQuantWeight] | None = None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Decompose every selected Linear and build the manifest and tensors of the artifact.

    Args:
        model: the model the Linears belong to (class recorded).
        selected: the Linears (from :func:`select_for_calibration`).
        absmax: per path input-channel absmax (required for ``method="svdquant"``).
        method: ``"svdquant"`` (smoothing + rank-``r`` + INT4 residual) or ``"rtn"`` (INT4 round to nearest).
        rank, group_size, alpha, svd: decomposition settings (``rtn`` forces rank 0, no smoothing).
        include: the calibration's patterns (recorded).
        calibration: provenance recorded under ``calibration``.
        observer: the observer whose call/row counts are recorded per Linear.
        unsmoothed: patterns (as ``include``) of selected Linears decomposed without smoothing (FP8 activations
            need smoothing less than INT8 ones; at run time their quantizer skips the per-channel ``1/λ``).
        rounding: one of ``ROUNDINGS`` (the GPTQ forms round under the inputs' second moments: the ``observer``
            needs ``second_moments=True``).
        lowrank_fit, refine: low-rank fit and refinement steps (``lowrank_fit`` module; need the moments).
        decomposed: Linears already decomposed with these settings and statistics (a sequential calibration's),
            taken as they are.

    Returns:
        ``(manifest, tensors)`` for :func:`~worldfoundry.core.acceleration.quantization.svdquant_artifact.save_svdquant_artifact`.

    Raises:
        InvalidRequestError: unknown method, missing or non-finite statistics, a Linear that saw no input, or an
            ``unsmoothed`` pattern that selects no Linear of the calibration.
    """
    _check_settings(method, rounding, observer, lowrank_fit, refine)
    if method == "rtn":
        rank, absmax = 0, None
    elif absmax is None:
        raise InvalidRequestError("svdquant calibration needs activation statistics (run the calibration requests)")
    digests = iter(parameter_digests([p for s in selected for p in (s.module.weight, s.module.bias) if p is not None]))
    linears: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    one = linear_decomposer(model, selected, absmax, observer, rank=rank, group_size=group_size, alpha=alpha,
                            svd=svd, unsmoothed=unsmoothed, rounding=rounding, lowrank_fit=lowrank_fit,
                            refine=refine)
    for s in selected:
        w_digest = next(digests)
        b_digest = next(digests) if s.module.bias is not None else None
        q = decomposed[s.path] if decomposed is not None and s.path in decomposed else one(s)
        for name, tensor in q.tensors().items():
            tensors[f"{s.path}.{name}"] = tensor.detach().to("cpu").contiguous()
        linears[s.path] = _linear_record(s, q, w_digest, b_digest, observer)
    manifest = _manifest(model, selected, method=method, rank=rank, group_size=group_size, alpha=alpha, svd=svd,
                         include=include, calibration=calibration, linears=linears)
    if unsmoothed:
        manifest["unsmoothed"] = [str(p) for p in unsmoothed]
    manifest["calibration"]["rounding"] = rounding
    manifest["calibration"]["lowrank_fit"] = lowrank_fit
    manifest["calibration"]["refine"] = int(refine)
    return manifest, tensors


def linear_decomposer(model: nn.Module, selected: Sequence[SelectedLinear],
                      absmax: Mapping[str, torch.Tensor] | None, observer: InputAbsmaxObserver | None, *,
                      rank: int, group_size: int, alpha: float = 0.5, svd: str = "full",
                      unsmoothed: Sequence[str] = (), rounding: str = "nearest", lowrank_fit: str = "svd",
                      refine: int = 0) -> Callable[[SelectedLinear], SVDQuantWeight]:
    """``one(s)``: the decomposition of one selected Linear with these settings, reading ``absmax`` and the
    ``observer``'s moments when it is called (a sequential calibration fills them unit by unit)."""
    plain = _unsmoothed_paths(model, selected, unsmoothed)

    def one(s: SelectedLinear) -> SVDQuantWeight:
        stats = None if s.path in plain else _finite_stats(absmax, s.path)
        moments = observer.moments[s.path] if needs_moments(rounding, lowrank_fit, refine) else None
        with torch.no_grad():
            return decompose(s.module.weight, rank=min(rank, *s.module.weight.shape), group_size=group_size,
                             act_absmax=stats, alpha=alpha, svd=svd, rounding=rounding, hessian=moments,
                             lowrank_fit=lowrank_fit if rank else "svd", refine=refine if rank else 0)

    return one


def needs_moments(rounding: str, lowrank_fit: str = "svd", refine: int = 0) -> bool:
    """Whether the decomposition needs the inputs' second moments ``X^T X`` (``K^2`` floats per Linear)."""
    return rounding != "nearest" or lowrank_fit != "svd" or bool(refine)


def _check_settings(method: str, rounding: str, observer: InputAbsmaxObserver | None, lowrank_fit: str,
                    refine: int) -> None:
    from worldfoundry.core.acceleration.quantization.lowrank_fit import LOWRANK_FITS, MAX_REFINE

    if method not in METHODS:
        raise InvalidRequestError(f"--method must be one of {list(METHODS)}, got {method!r}")
    if rounding not in ROUNDINGS:
        raise InvalidRequestError(f"--rounding must be one of {list(ROUNDINGS)}, got {rounding!r}")
    if lowrank_fit not in LOWRANK_FITS:
        raise InvalidRequestError(f"--lowrank-fit must be one of {list(LOWRANK_FITS)}, got {lowrank_fit!r}")
    if isinstance(refine, bool) or not isinstance(refine, int) or not 0 <= refine <= MAX_REFINE:
        raise InvalidRequestError(f"--refine must be an integer in [0, {MAX_REFINE}], got {refine!r}")
    if needs_moments(rounding, lowrank_fit, refine) and (observer is None or not observer.second_moments):
        raise InvalidRequestError(f"--rounding {rounding} --lowrank-fit {lowrank_fit} --refine {refine} needs the "
                                  "inputs' second moments (calibrate with them collected)")


def _unsmoothed_paths(model: nn.Module, selected: Sequence[SelectedLinear], patterns: Sequence[str]) -> set[str]:
    """The selected paths ``patterns`` name (each pattern must name at least one of them)."""
    chosen = {s.path for s in selected}
    paths: set[str] = set()
    for pattern in patterns:
        try:
            hits = {s.path for s in select_for_calibration(model, [pattern])} & chosen
        except InvalidRequestError:
            hits = set()
        if not hits:
            raise InvalidRequestError(f"--unsmoothed {pattern!r} selects none of the calibrated Linears "
                                      f"(--include {' '.join(sorted(chosen))[:200]}); name one of them")
        paths |= hits
    return paths


def _finite_stats(absmax: Mapping[str, torch.Tensor] | None, path: str) -> torch.Tensor | None:
    """``path``'s input absmax (``None`` without statistics); refused when it is missing or not finite."""
    if absmax is None:
        return None
    stats = absmax.get(path)
    if stats is None or not bool(torch.isfinite(stats).all()):
        raise InvalidRequestError(f"{path}: calibration saw no finite input; check the requests/include")
    return stats


def _linear_record(s: SelectedLinear, q: SVDQuantWeight, w_digest: str, b_digest: str | None,
                   observer: InputAbsmaxObserver | None) -> dict[str, Any]:
    """The manifest entry of one decomposed Linear: shape, rank, source digests, calibration counts, error."""
    return {
        "in_features": s.module.in_features, "out_features": s.module.out_features, "rank": q.rank,
        "smoothed": q.inv_smooth is not None,
        "source": {"weight": _digest_record(s.module.weight, w_digest), "bias": _digest_record(s.module.bias, b_digest)},
        "calibration": {"calls": observer.calls.get(s.path, 0) if observer else 0,
                        "rows": observer.rows.get(s.path, 0) if observer else 0},
        "diagnostics": {"weight_rel_l2": weight_rel_error(s.module.weight, q)},
    }


def _manifest(model: nn.Module, selected: Sequence[SelectedLinear], *, method: str, rank: int, group_size: int,
              alpha: float, svd: str, include: Sequence[str], calibration: Mapping[str, Any] | None,
              linears: dict[str, Any]) -> dict[str, Any]:
    """The artifact's manifest: format, settings, model, provenance (versions, time) and the Linears."""
    import diffusers

    return {
        "format": ARTIFACT_FORMAT, "method": method, "rank": int(rank), "group_size": int(group_size),
        "alpha": float(alpha) if method == "svdquant" else None, "svd": svd if rank else None,
        "weight_bits": 4, "activation_bits": 8, "lowrank_dtype": "bfloat16", "scale_dtype": "bfloat16",
        "include": [str(p) for p in include] or [s.path for s in selected],
        "model": {"class": type(model).__name__, "family": _family_name(model)},
        "calibration": {**dict(calibration or {}), "created_at": datetime.now(timezone.utc).isoformat(),
                        "torch": str(torch.__version__), "diffusers": str(diffusers.__version__)},
        "linears": linears,
    }


def _family_name(model: nn.Module) -> str | None:
    try:
        return family_of(model).name
    except AccelerationRefusedError:
        return None


def calibrate_pipeline(pipe: Any, *, include: Sequence[str], prompts: Sequence[str] = CALIBRATION_PROMPTS,
                       seeds: Sequence[int] = CALIBRATION_SEEDS, frames: int | None = None,
                       height: int | None = None, width: int | None = None, steps: int | None = None,
                       guidance: float | None = None, references: str | Path | None = None,
                       keep_dense: int = 0, sensitivity_unit: str = "block",
                       sensitivity_metric: str = "latent_rel_l2", dense_from: str | Path | None = None,
                       sequential: bool = False,
                       **decomposition: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Run the calibration requests through ``pipe`` (a ``NativeDiffusionPipeline`` without accelerations)
    under an :class:`InputAbsmaxObserver` and build the artifact.

    Args:
        pipe: the pipeline; its denoiser model must have no acceleration session.
        include: Linear patterns.
        prompts: one prompt per seed (cycled).
        seeds: calibration seeds (11, 12 by default).
        frames, height, width, steps, guidance: request size (recipe defaults when ``None``).
        references: directory receiving ``calibration_<seed>.pt`` (``{"latents", "video"}``) per request.
        keep_dense, sensitivity_unit, sensitivity_metric: keep the ``keep_dense`` units (``"block"`` or
            ``"linear"``) most sensitive on ``sensitivity_metric`` dense, each unit quantized alone on the same
            requests (``svdquant_sensitivity``); 0 measures nothing.
        dense_from: an artifact written with ``keep_dense``: its kept-dense Linears are left out of this one.
        sequential: observe each block's Linears again with the blocks before it quantized
            (``svdquant_sequential``; after ``keep_dense``'s selection; ``method="svdquant"`` only).
        **decomposition: ``method``, ``rank``, ``group_size``, ``alpha``, ``svd``, ``unsmoothed``, ``rounding``,
            ``lowrank_fit``, ``refine`` for :func:`build_svdquant_artifact`.

    Returns:
        ``(manifest, tensors)``.

    Raises:
        InvalidRequestError: evaluation seeds used for calibration, no seeds, an accelerated model, bad include,
            a ``keep_dense`` not below the number of units, or ``keep_dense`` with ``dense_from``.
    """
    seeds = [int(s) for s in seeds]  # the requests and the mixed-precision settings are checked before any runs
    _check_requests(seeds, prompts, keep_dense, dense_from, sensitivity_unit, sensitivity_metric)
    if sequential and decomposition.get("method", "svdquant") != "svdquant":
        raise InvalidRequestError("--sequential refits statistics for --method svdquant; RTN uses none")
    model = pipe.components.denoiser.model
    selected, inherited = _selection(model, include, dense_from)
    units = group_units([s.path for s in selected], sensitivity_unit)
    check_keep_dense(keep_dense, len(units) if keep_dense else None)
    out_dir = Path(references) if references is not None else None
    size = {"frames": frames, "height": height, "width": width, "steps": steps, "guidance": guidance}
    moments = needs_moments(decomposition.get("rounding", "nearest"), decomposition.get("lowrank_fit", "svd"),
                            decomposition.get("refine", 0))
    with InputAbsmaxObserver(selected, second_moments=moments) as observer:
        dense = [_calibration_request(pipe, prompts[i % len(prompts)], seed, out_dir, **size)
                 for i, seed in enumerate(seeds)]
    provenance = _provenance(pipe, model, [entry for entry, _ in dense], seeds, size)
    rerun = partial(_rerun, pipe, prompts, seeds, size)
    mixed = {"keep_dense": keep_dense, "unit": sensitivity_unit, "metric": sensitivity_metric, "units": units,
             "dense": [out for _, out in dense], "inherited": inherited}
    return _artifact(model, selected, observer, rerun, include, provenance, mixed, sequential, decomposition)


def _artifact(model: nn.Module, selected: Sequence[SelectedLinear], observer: InputAbsmaxObserver, rerun: Any,
              include: Sequence[str], provenance: Mapping[str, Any], mixed: Mapping[str, Any], sequential: bool,
              decomposition: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The artifact from the dense statistics, less the kept-dense units (``mixed``: the ``keep_dense``
    selection's settings, or the ``inherited`` record of ``dense_from``), rebuilt from sequential statistics when
    asked."""
    manifest: dict[str, Any] = {"linears": {s.path: None for s in selected}, "calibration": {}}
    tensors: dict[str, torch.Tensor] = {}
    keep_dense = mixed["keep_dense"]
    if keep_dense or not sequential:
        manifest, tensors = build_svdquant_artifact(model, selected, observer.absmax, include=include,
                                                    calibration=provenance, observer=observer, **decomposition)
    if keep_dense:
        _keep_sensitive_dense(selected, mixed["units"], manifest, tensors, rerun, mixed["dense"],
                              keep_dense=keep_dense, unit=mixed["unit"], metric=mixed["metric"])
    sensitivity = manifest["calibration"].get("sensitivity") or mixed["inherited"]
    if sequential:
        manifest, tensors = _sequential_artifact(model, [s for s in selected if s.path in manifest["linears"]],
                                                 observer, rerun, include, provenance, decomposition)
    if sensitivity is not None:
        manifest["calibration"]["sensitivity"] = sensitivity
    return manifest, tensors


def _provenance(pipe: Any, model: nn.Module, requests: list[Any], seeds: list[int],
                size: Mapping[str, Any]) -> dict[str, Any]:
    """The artifact's ``calibration`` record: recipe, requests, seeds, size, device and dtype."""
    recipe = getattr(getattr(pipe, "recipe", None), "name", None)
    return {"recipe": recipe, "requests": requests, "seeds": seeds, **size,
            "device": str(next(model.parameters()).device),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}


def _sequential_artifact(model: nn.Module, selected: Sequence[SelectedLinear], dense: InputAbsmaxObserver,
                         rerun: Any, include: Sequence[str], provenance: Mapping[str, Any],
                         decomposition: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The artifact of ``selected`` from sequential statistics (``svdquant_sequential``), recorded under
    ``calibration.sequential``."""
    from worldfoundry.base_models.diffusion_model.svdquant_sequential import sequential_statistics

    settings = {k: v for k, v in decomposition.items() if k not in ("method", "include", "calibration")}
    settings.setdefault("rank", 32)
    settings.setdefault("group_size", 64)
    observer, decomposed, units = sequential_statistics(
        selected, dense, rerun, InputAbsmaxObserver,
        lambda obs: linear_decomposer(model, selected, obs.absmax, obs, **settings))
    manifest, tensors = build_svdquant_artifact(model, selected, observer.absmax, include=include,
                                                calibration=provenance, observer=observer, decomposed=decomposed,
                                                **decomposition)
    manifest["calibration"]["sequential"] = {"unit": "block", "units": units, "reruns": max(0, len(units) - 1)}
    return manifest, tensors


def _rerun(pipe: Any, prompts: Sequence[str], seeds: Sequence[int], size: Mapping[str, Any]) -> list[RequestOutput]:
    """The calibration requests again (nothing recorded): their outputs."""
    return [_calibration_request(pipe, prompts[i % len(prompts)], seed, None, **size)[1]
            for i, seed in enumerate(seeds)]


def _check_requests(seeds: Sequence[int], prompts: Sequence[str], keep_dense: int,
                    dense_from: str | Path | None, unit: str, metric: str) -> None:
    """Refuse bad calibration requests or mixed-precision settings before anything runs."""
    if not seeds or not prompts:
        raise InvalidRequestError("give at least one calibration seed and prompt")
    overlap = sorted(set(seeds) & set(EVALUATION_SEEDS))
    if overlap:
        raise InvalidRequestError(f"seeds {overlap} are evaluation seeds; calibrate on other seeds (default 11 12)")
    check_keep_dense(keep_dense)
    check_unit(unit)
    check_metric(metric)
    if keep_dense and dense_from is not None:
        raise InvalidRequestError("give --keep-dense N or --dense-from ARTIFACT, not both")


def _selection(model: nn.Module, include: Sequence[str],
               dense_from: str | Path | None) -> tuple[list[SelectedLinear], dict[str, Any] | None]:
    """The Linears to calibrate: ``include``'s, less the kept-dense Linears of ``dense_from`` (with its record).

    Raises:
        InvalidRequestError: an accelerated model; ``dense_from`` keeps dense a Linear ``include`` does not
            select, or every one.
    """
    from worldfoundry.core.acceleration.session import get_session

    if get_session(model) is not None:
        raise InvalidRequestError("calibrate the dense model: uninstall its accelerations first")
    selected = select_for_calibration(model, include)
    if dense_from is None:
        return selected, None
    inherited = kept_dense_from_artifact(dense_from)
    dense = set(inherited["kept_dense_linears"])
    unknown = sorted(dense - {s.path for s in selected})
    if unknown:
        raise InvalidRequestError(f"--dense-from {dense_from}: keeps dense {unknown[0]}, which --include does not "
                                  "select; calibrate with the same --include")
    kept = [s for s in selected if s.path not in dense]
    if not kept:
        raise InvalidRequestError(f"--dense-from {dense_from}: keeps every selected Linear dense")
    return kept, inherited


def _keep_sensitive_dense(selected: Sequence[SelectedLinear], units: Mapping[str, Sequence[str]],
                          manifest: dict[str, Any], tensors: dict[str, torch.Tensor], rerun: Any,
                          dense: Sequence[RequestOutput], *, keep_dense: int, unit: str, metric: str) -> None:
    """Measure each unit's sensitivity with the artifact's own tensors, drop the ``keep_dense`` most sensitive
    units' Linears from the artifact and record it all under ``calibration.sensitivity`` (in place)."""
    from worldfoundry.core.acceleration.kernels.svdquant_dispatch import choose_backend

    modules = {s.path: s.module for s in selected}
    group = int(manifest["group_size"])
    weights = {p: weight_from_tensors(tensors, p, group, m.weight.device) for p, m in modules.items()}
    device = next(iter(modules.values())).weight.device
    backend = choose_backend(device, "auto", group).backend
    scores = measure_sensitivity(rerun, dense, units, modules, weights)
    record = sensitivity_record(scores, keep_dense=keep_dense, unit=unit, metric=metric, backend=backend,
                                seeds=[o.seed for o in dense])
    logger.info("svdquant sensitivity (%s, %s): %s; kept dense: %s", unit, metric,
                ", ".join(f"{u} {scores[u][metric]:.4g}" for u in record["ranking"]), record["kept_dense"])
    drop_linears(manifest, tensors, record["kept_dense_linears"])
    manifest["calibration"]["sensitivity"] = record


def _calibration_request(pipe: Any, prompt: str, seed: int, out_dir: Path | None,
                         **size: Any) -> tuple[dict[str, Any], RequestOutput]:
    """Generate one calibration request; its provenance entry (and ``calibration_<seed>.pt`` under ``out_dir``)
    and its output."""
    from worldfoundry.base_models.diffusion_model.request import DiffusionRequest

    request = DiffusionRequest(prompt=prompt, seed=seed, num_frames=size["frames"], height=size["height"],
                               width=size["width"], num_inference_steps=size["steps"],
                               guidance_scale=size["guidance"], request_id=f"calibration-{seed}", output_type="np")
    result = pipe.generate(request)
    entry: dict[str, Any] = {"prompt": prompt, "seed": seed, "latent_shape": list(result.latents.shape)}
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        ref = out_dir / f"calibration_{seed}.pt"
        video = torch.from_numpy(result.frames.copy()) if result.frames is not None else None
        torch.save({"latents": result.latents.detach().cpu(), "video": video, "prompt": prompt, "seed": seed}, ref)
        entry["reference"] = str(ref)
    return entry, RequestOutput(seed, result.latents.detach(), result.frames)


__all__ = [
    "CALIBRATION_PROMPTS",
    "CALIBRATION_SEEDS",
    "EVALUATION_SEEDS",
    "InputAbsmaxObserver",
    "build_svdquant_artifact",
    "calibrate_pipeline",
    "select_for_calibration",
]
