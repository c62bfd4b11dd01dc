"""Residency estimator maths: how many blocks to keep resident (r) and which ones.

Model: a forward runs N blocks, each computing for ``c`` ms; a streamed block needs a host-to-device copy
of ``d`` ms on a separate copy stream. Copies of the N − r streamed blocks can hide behind the compute of
the whole forward when the budget

    (N − r) · d ≤ N · c

holds; r is the smallest integer that satisfies it (0 when d ≤ c). The budget is a total: with only two
slots a single copy can still make the compute wait, so r is an estimate, not a guarantee, and it does not
account for free device memory (slots, non-block weights and activations also live there).

``copy_utilisation`` u (default 1, the rule above) scales the budget to ``(N − r) · d ≤ u · N · c``. At u = 1 the
copy stream is busy almost the whole forward; a two-slot pipeline cannot keep it that busy without the compute
waiting now and then, and host-to-device DMA running next to the compute slows some kernels. What each u gave
on real hardware is recorded in ``docs/performance.md``, not here.

The r resident blocks are spread evenly (:func:`uniform_resident_indices`) so the copy stream gets regular
windows in which a resident block computes without needing a copy.

The budget ignores *when* a copy may run. With two slots, the copy of the j-th streamed block can start only
after the (j − 2)-th has computed, so inside a run of three or more streamed blocks each copy has one block's
compute to hide behind: when d > c the compute waits, however large the total budget.
:func:`two_slot_copy_wait_ms` plays that schedule for given c, d and indices, and
:func:`resident_without_waits` finds the smallest r for which it predicts no wait (for c < d ≤ 2c that is about
N / 3: no run of three streamed blocks).

Two rules choose r (``rule``):

* ``"schedule"`` (the default): the smallest r for which the two-slot schedule predicts no copy wait, with the
  compute share scaled by the copy utilisation u (:func:`resident_without_waits` on ``u · c`` and ``d``);
* ``"budget"``: the budget rule ``(N − r) · d ≤ u · N · c`` (:func:`resident_count`).

The config and the report record both r values, their predicted waits, c, d, N and the rule used.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

#: The rules that choose r; :data:`DEFAULT_RULE` is the two-slot schedule model.
RULES: Final = ("schedule", "budget")
DEFAULT_RULE: Final = "schedule"

RE_ESTIMATE_NOTE: Final = (
    "re-estimate when the device, the weights, the input shape (frames/height/width), the dtype, the layout "
    "or the kernels change; r is computed for these measurements only"
)


def uniform_resident_indices(num_blocks: int, resident: int) -> list[int]:
    """``resident`` block indices spread evenly over ``num_blocks``, starting at block 0.

    Index ``i`` is ``floor(i * N / r)``: the gaps between consecutive indices (and the wrap-around gap back
    to block 0 of the next forward) differ by at most one block, so every run of streamed blocks between
    two resident ones has the same length ±1. Block 0 is resident whenever r > 0, which hides the first
    copy of a forward behind a resident block's compute.

    Args:
        num_blocks: N ≥ 0.
        resident: r with 0 ≤ r ≤ N.

    Returns:
        Sorted, distinct indices (``[]`` for r = 0, ``range(N)`` for r = N).

    Raises:
        ValueError: r or N out of range.

    Example:
        >>> uniform_resident_indices(30, 9)
        [0, 3, 6, 10, 13, 16, 20, 23, 26]
    """
    if isinstance(num_blocks, bool) or isinstance(resident, bool):
        raise ValueError("num_blocks and resident must be integers, not booleans")
    if not isinstance(num_blocks, int) or num_blocks < 0:
        raise ValueError(f"num_blocks must be an integer >= 0, got {num_blocks!r}")
    if not isinstance(resident, int) or not 0 <= resident <= num_blocks:
        raise ValueError(f"resident must be an integer in 0..{num_blocks}, got {resident!r}")
    return [(i * num_blocks) // resident for i in range(resident)]


def resident_count(num_blocks: int, compute_ms: float, transfer_ms: float, *,
                   copy_utilisation: float = 1.0) -> int:
    """The smallest r in 0..N with (N − r) · d ≤ u · N · c.

    Args:
        num_blocks: N ≥ 1.
        compute_ms: c, compute time of one block (≥ 0, finite).
        transfer_ms: d, host-to-device time of one block (≥ 0, finite).
        copy_utilisation: u in (0, 1], the share of the compute time the copies may fill (1: the plain rule).

    Returns:
        r (0 when d ≤ c, N when c = 0 and d > 0).

    Raises:
        ValueError: N < 1, a time that is negative or not finite, or u outside (0, 1].

    Example:
        >>> resident_count(30, compute_ms=1.27, transfer_ms=1.8)
        9
    """
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
    for label, value in (("compute_ms", compute_ms), ("transfer_ms", transfer_ms)):
        if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{label} must be a finite number >= 0, got {value!r}")
    u = copy_utilisation
    if isinstance(u, bool) or not isinstance(u, int | float) or not 0.0 < u <= 1.0:
        raise ValueError(f"copy_utilisation must be a number in (0, 1], got {u!r}")
    n, c, d = num_blocks, float(compute_ms) * float(u), float(transfer_ms)
    if d <= c:
        return 0
    # Start from the closed form and correct for floating-point rounding at the boundary.
    r = min(n, max(0, math.ceil(n - n * c / d)))
    while r > 0 and (n - (r - 1)) * d <= n * c:
        r -= 1
    while r < n and (n - r) * d > n * c:
        r += 1
    return r


def two_slot_copy_wait_ms(num_blocks: int, compute_ms: float, transfer_ms: float, resident_indices: Sequence[int],
                          *, slots: int = 2) -> float:
    """Compute-stream wait per forward that the slot schedule predicts (ms).

    Model: blocks run in index order, ``c`` each; streamed blocks are copied in that order on one copy stream, ``d``
    each; a copy starts when the copy stream is free and its slot is free (the block ``slots`` streamed blocks
    earlier has computed); a streamed block starts when the previous block has finished and its copy is done. The
    first ``slots`` copies are taken as done when block 0 starts (they are issued when the forward begins, while the
    model computes its embeddings). Host time, kernels slowed by the DMA and the model's non-block work are not
    modelled.

    Returns:
        The forward's predicted length minus ``N · c`` (0 when ``d ≤ c`` or every block is resident).
    """
    resident = set(resident_indices)
    streamed = [i for i in range(num_blocks) if i not in resident]
    position = {block: j for j, block in enumerate(streamed)}
    copy_done = [0.0] * len(streamed)
    compute_end: dict[int, float] = {}
    issued = min(slots, len(streamed))
    copy_free = 0.0
    t = 0.0
    for block in range(num_blocks):
        start = t
        j = position.get(block)
        if j is not None:
            while issued <= j:
                begin = max(copy_free, compute_end[streamed[issued - slots]])
                copy_free = copy_done[issued] = begin + transfer_ms
                issued += 1
            start = max(t, copy_done[j])
        t = compute_end[block] = start + compute_ms
    wait = t - num_blocks * compute_ms
    return wait if wait > 1e-9 * max(1.0, num_blocks * compute_ms) else 0.0  # below that: summation rounding


def resident_without_waits(num_blocks: int, compute_ms: float, transfer_ms: float, *, slots: int = 2) -> int:
    """The smallest r whose evenly spread resident blocks (:func:`uniform_resident_indices`) leave no predicted wait
    (:func:`two_slot_copy_wait_ms`); 0 when ``d ≤ c``."""
    resident_count(num_blocks, compute_ms, transfer_ms)  # validates the arguments
    for r in range(num_blocks + 1):
        if two_slot_copy_wait_ms(num_blocks, compute_ms, transfer_ms, uniform_resident_indices(num_blocks, r),
                                 slots=slots) == 0.0:
            return r
    return num_blocks


def resident_for_rule(num_blocks: int, compute_ms: float, transfer_ms: float, *, rule: str = DEFAULT_RULE,
                      copy_utilisation: float = 1.0) -> int:
    """r under ``rule`` (``"schedule"``: no predicted two-slot wait with ``u · c``; ``"budget"``: ``(N − r)·d ≤ u·N·c``).

    Returns:
        r in ``0..N`` (0 whenever ``d ≤ u · c``).

    Raises:
        ValueError: an unknown rule or an argument :func:`resident_count` rejects.

    Example:
        >>> resident_for_rule(30, 1.27, 1.8, rule="budget"), resident_for_rule(30, 1.27, 1.8)
        (9, 10)
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {list(RULES)}, got {rule!r}")
    budget_r = resident_count(num_blocks, compute_ms, transfer_ms, copy_utilisation=copy_utilisation)
    if rule == "budget":
        return budget_r
    return resident_without_waits(num_blocks, float(compute_ms) * float(copy_utilisation), transfer_ms)


@dataclass(frozen=True)
class ResidencyEstimate:
    """The estimator's answer and the measurements behind it.

    Attributes:
        num_blocks / compute_ms / transfer_ms: N, c and d.
        resident: r.
        indices: :func:`uniform_resident_indices` (N, r).
        contiguous: the layout d was measured in (``cpu_offload_block_contiguous``).
        copy_utilisation: u (scales the compute share both rules may fill with copies).
        rule: ``"schedule"`` or ``"budget"`` (see the module docstring).
        context: what was measured (device, shapes, dtype, recipe, samples, ...), JSON-serialisable.
    """

    num_blocks: int
    compute_ms: float
    transfer_ms: float
    resident: int
    indices: tuple[int, ...]
    contiguous: bool
    context: Mapping[str, Any] = field(default_factory=dict)
    copy_utilisation: float = 1.0
    rule: str = DEFAULT_RULE

    @property
    def streamed(self) -> int:
        return self.num_blocks - self.resident

    @property
    def copy_budget_ms(self) -> float:
        """u · N · c: compute time per forward the copies may hide behind."""
        return self.copy_utilisation * self.num_blocks * self.compute_ms

    @property
    def copy_need_ms(self) -> float:
        """(N − r) · d: copy time per forward."""
        return self.streamed * self.transfer_ms

    def rule_comparison(self) -> dict[str, Any]:
        """Both rules' r for these measurements, with the two-slot wait each predicts (ms per forward)."""
        n, c, d, u = self.num_blocks, self.compute_ms, self.transfer_ms, self.copy_utilisation
        out: dict[str, Any] = {"rule": self.rule, "num_blocks": n, "compute_ms": round(c, 4),
                               "transfer_ms": round(d, 4), "copy_utilisation": u}
        for name in RULES:
            r = resident_for_rule(n, c, d, rule=name, copy_utilisation=u)
            out[f"{name}_resident"] = r
            out[f"{name}_predicted_copy_wait_ms"] = round(
                two_slot_copy_wait_ms(n, c, d, uniform_resident_indices(n, r)), 4)
        return out

    def to_report(self) -> dict[str, Any]:
        n, c, d = self.num_blocks, self.compute_ms, self.transfer_ms
        return {
            **dict(self.context),
            "layout": "contiguous" if self.contiguous else "per_tensor",
            "num_blocks": self.num_blocks,
            "compute_ms": round(self.compute_ms, 4),
            "transfer_ms": round(self.transfer_ms, 4),
            "resident": self.resident,
            "streamed": self.streamed,
            "resident_block_indices": list(self.indices),
            "rule": self.rule,
            "rule_text": _rule_text(self.rule, self.copy_utilisation),
            "rules": self.rule_comparison(),
            "copy_utilisation": self.copy_utilisation,
            "copy_need_ms_per_forward": round(self.copy_need_ms, 4),
            "copy_budget_ms_per_forward": round(self.copy_budget_ms, 4),
            "two_slot_predicted_copy_wait_ms_per_forward": round(two_slot_copy_wait_ms(n, c, d, self.indices), 4),
            "two_slot_resident_without_waits": resident_without_waits(n, c, d),
            "note": RE_ESTIMATE_NOTE,
        }


def _rule_text(rule: str, u: float) -> str:
    share = "c" if u == 1.0 else f"{u:g} * c"
    if rule == "budget":
        return f"smallest r with (N - r) * d <= N * {share}"
    return f"smallest r for which the two-slot schedule (compute {share} per block) predicts no copy wait"


def estimate_residency(num_blocks: int, compute_ms: float, transfer_ms: float, *, contiguous: bool,
                       context: Mapping[str, Any] | None = None,
                       copy_utilisation: float = 1.0, rule: str = DEFAULT_RULE) -> ResidencyEstimate:
    """Compute r and its indices from measured c and d under ``rule`` (see :func:`resident_for_rule`)."""
    r = resident_for_rule(num_blocks, compute_ms, transfer_ms, rule=rule, copy_utilisation=copy_utilisation)
    return ResidencyEstimate(
        num_blocks=num_blocks,
        compute_ms=float(compute_ms),
        transfer_ms=float(transfer_ms),
        resident=r,
        indices=tuple(uniform_resident_indices(num_blocks, r)),
        contiguous=bool(contiguous),
        context=dict(context or {}),
        copy_utilisation=float(copy_utilisation),
        rule=rule,
    )
