"""Sequential SVDQuant calibration: each block's Linears observed with the blocks before it quantized.

The default calibration observes every selected Linear once, in the dense model. At run time a Linear's inputs
come from blocks whose Linears are quantized, so its input statistics -- the smoothing's absmax, GPTQ's second
moments -- differ from the dense ones by the error of everything upstream. With ``sequential`` the calibration
takes the units (a block's selected Linears) in model order: the first keeps the dense statistics; each later
one is observed again on the calibration requests while every earlier unit's Linears run their quantized
numerics (the ones the plugin runs on that device, as the sensitivity measurement does:
:func:`~worldfoundry.base_models.diffusion_model.svdquant_sensitivity.quantized_linears`), and is then
decomposed from what it saw, so its smoothing and rounding are fitted to the inputs it will get. Linears kept
dense (``keep_dense``, ``dense_from``) are not selected here and stay dense during those runs. It costs one more
run of the calibration requests per unit after the first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from worldfoundry.base_models.diffusion_model.optimizations.projection_selection import SelectedLinear
from worldfoundry.base_models.diffusion_model.svdquant_sensitivity import group_units, quantized_linears
from worldfoundry.core.acceleration.quantization.svdquant_numerics import SVDQuantWeight


def sequential_statistics(selected: Sequence[SelectedLinear], dense: Any, rerun: Callable[[], Any],
                          observer_cls: Any,
                          decomposer: Callable[[Any], Callable[[SelectedLinear], SVDQuantWeight]],
                          ) -> tuple[Any, dict[str, SVDQuantWeight], list[str]]:
    """Statistics and decompositions of ``selected``, unit by unit in order.

    Args:
        selected: the Linears to quantize, in model order.
        dense: the observer of the dense calibration run (its statistics serve the first unit).
        rerun: runs the calibration requests again.
        observer_cls: :class:`~worldfoundry.base_models.diffusion_model.svdquant_calibration.InputAbsmaxObserver`.
        decomposer: ``decomposer(observer)`` gives ``one(s)``, the decomposition of one Linear reading that
            observer's statistics (:func:`~worldfoundry.base_models.diffusion_model.svdquant_calibration.linear_decomposer`).

    Returns:
        ``(observer, decomposed, units)``: an observer holding every Linear's statistics as it was decomposed
        (its counts those of the run that observed it), ``{path: SVDQuantWeight}``, and the units in order.
    """
    units = group_units([s.path for s in selected], "block")
    by_path = {s.path: s for s in selected}
    out = observer_cls(selected, second_moments=dense.second_moments)
    one = decomposer(out)
    decomposed: dict[str, SVDQuantWeight] = {}
    for i, paths in enumerate(units.values()):
        members = [by_path[p] for p in paths]
        if i == 0:
            source = dense
        else:
            with quantized_linears({p: by_path[p].module for p in decomposed}, decomposed), \
                    observer_cls(members, second_moments=dense.second_moments) as source:
                rerun()
        for path in paths:
            _copy(source, out, path)
        for s in members:
            decomposed[s.path] = one(s)
    return out, decomposed, list(units)


def _copy(source: Any, target: Any, path: str) -> None:
    """``path``'s statistics and counts from one observer to another."""
    if path in source.absmax:
        target.absmax[path] = source.absmax[path]
    if path in source.moments:
        target.moments[path] = source.moments[path]
    target.calls[path] = source.calls.get(path, 0)
    target.rows[path] = source.rows.get(path, 0)


__all__ = ["sequential_statistics"]
