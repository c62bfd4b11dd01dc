"""``worldfoundry tune`` on a routed recipe (Wan2.2 A14B): the cache threshold searched for each expert on its own.

Routed experts see different noise levels, so one threshold for both is rarely right for either. After the
shared-threshold passes, for each warm-up setting:

1. ``experts``: per expert, the threshold grid with that expert's EasyCache active and the other's at threshold 0
   (every step computed, the dense output unchanged) -- one quality pass for all experts;
2. ``experts-combined``: each expert's largest passing threshold together, and the same with one expert backed
   off to its next passing threshold (quality budgets do not add: two errors that fit alone may not fit
   together).

The records join the shared-threshold ones; the survivors are chosen from all of them by skipped model calls.
Candidates carry the per-expert thresholds as ``per_expert`` options (``docs/plugins.md``).
"""

from __future__ import annotations

from typing import Any

from worldfoundry.core.model_loading.recipes import load_recipe
from worldfoundry.errors import WorldFoundryError


def recipe_experts(model: str) -> tuple[str, ...]:
    """The expert labels of ``model``'s recipe (one label, or none found, means not routed)."""
    try:
        return tuple(load_recipe(model).experts)
    except (WorldFoundryError, OSError):
        return ()


def _spec(cache: dict[str, Any], warmup: int, thresholds: dict[str, float]) -> dict[str, dict[str, Any]]:
    from worldfoundry.bench.tune import CACHE_PLUGIN, _cache_opts

    opts = _cache_opts(cache, 0.0, warmup)
    opts["per_expert"] = {label: {"threshold": float(t)} for label, t in thresholds.items()}
    return {CACHE_PLUGIN: opts}


def _passing(records: list[dict[str, Any]], label: str, warmup: int) -> list[float]:
    """Thresholds of ``label`` that passed alone (the other experts at 0), largest first."""
    from worldfoundry.bench.tune import CACHE_PLUGIN, _ok

    out = []
    for r in records:
        opts = r["accelerations"][CACHE_PLUGIN]
        per = opts.get("per_expert") or {}
        if opts["warmup_steps"] == warmup and list(per) == [label] and _ok(r):
            out.append(float(per[label]["threshold"]))
    return sorted(set(out), reverse=True)


def per_expert_pass(search: Any, cache: dict[str, Any], labels: tuple[str, ...]) -> list[dict[str, Any]]:
    """The two passes above; returns their records (empty for a single expert)."""
    from worldfoundry.bench.tune import threshold_grid

    if len(labels) < 2:
        return []
    warmups = [int(w) for w in cache.get("warmup_steps", [2])]
    grid = threshold_grid(*cache["threshold"], int(cache.get("grid", 4)))
    alone = search.bench("experts", [_spec(cache, w, {label: t}) for w in warmups for label in labels
                                     for t in grid], timed=False)
    combined = []
    for w in warmups:
        best = {label: _passing(alone, label, w) for label in labels}
        if not all(best.values()):
            continue
        top = {label: ts[0] for label, ts in best.items()}
        combined.append(_spec(cache, w, top))
        for label, ts in best.items():
            if len(ts) > 1:
                combined.append(_spec(cache, w, {**top, label: ts[1]}))
    return alone + (search.bench("experts-combined", combined, timed=False) if combined else [])
