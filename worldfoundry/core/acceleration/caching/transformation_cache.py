"""EasyCache numerics: the cached input -> output transformation of one model branch and its error estimate.

Notation (latent space, one model call per step and branch): ``x_t`` is the raw model input, ``v_t`` the
model output, ``p`` the last *computed* step.

* A computed step stores the transformation ``Δ = v_t − x_t`` and, when an earlier computed step exists,
  the transformation rate ``k = mean|v_t − v_p| / mean|x_t − x_p|``.
* A later step predicts the relative output change ``ε_t = k · mean|x_t − x_{t−1}| / mean|v_p|`` where
  ``x_{t−1}`` is the input of the previous step (computed or skipped). A controller accumulates ``ε_t`` and
  reuses the transformation while the sum stays below its threshold.
* A reused (skipped) step returns ``x_t + Δ``; the model is not called.

Statistics are float32 means over every element (batch included). They stay on the device as 0-d tensors;
the controller reads them with one host transfer per decision. ``Δ`` is kept in float32.

Example:
    >>> import torch
    >>> cache = TransformationCache(track_rate=True)
    >>> cache.record_computed(torch.zeros(2, 3), torch.ones(2, 3))
    >>> cache.record_computed(torch.full((2, 3), 0.5), torch.full((2, 3), 1.25))
    >>> float(cache.rate)
    0.5
    >>> cache.estimate(torch.full((2, 3), 1.0), torch.float32)[0, 0].item()
    1.75
"""

from __future__ import annotations

from typing import Final

import torch

#: Gate names returned by :func:`dense_gate`.
WARMUP: Final = "warmup"
FINAL: Final = "final"
DenseGate = str


def mean_abs(t: torch.Tensor) -> torch.Tensor:
    """``mean|t|`` in float32 as a 0-d tensor on ``t``'s device."""
    return t.detach().float().abs().mean()


def mean_abs_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``mean|a − b|`` in float32 as a 0-d tensor on ``a``'s device."""
    return (a.detach().float() - b.detach().float()).abs().mean()


def dense_gate(local_index: int, phase_length: int, warmup_steps: int, final_dense_steps: int) -> DenseGate | None:
    """Whether a step must be computed regardless of the accumulated error.

    Args:
        local_index: zero-based step index within the phase (the whole request, or one expert's phase).
        phase_length: number of steps in the phase.
        warmup_steps: the first ``warmup_steps`` steps of the phase are computed.
        final_dense_steps: the last ``final_dense_steps`` steps of the phase are computed.

    Returns:
        ``"warmup"``, ``"final"`` or ``None`` (the controller decides).

    Raises:
        ValueError: ``local_index`` is outside ``0 .. phase_length - 1``.
    """
    if not 0 <= local_index < phase_length:
        raise ValueError(f"local step {local_index} outside 0..{phase_length - 1}")
    if local_index < warmup_steps:
        return WARMUP
    if local_index >= phase_length - final_dense_steps:
        return FINAL
    return None


class TransformationCache:
    """The cached transformation of one (request, expert, CFG branch).

    Args:
        track_rate: keep what the error estimate needs (last computed input/output, previous input, rate).
            A branch that only follows another branch's decision needs ``Δ`` alone.
    """

    __slots__ = ("delta", "last_input", "last_output", "previous_input", "rate", "track_rate")

    def __init__(self, *, track_rate: bool) -> None:
        self.track_rate = track_rate
        self.delta: torch.Tensor | None = None
        self.last_input: torch.Tensor | None = None
        self.last_output: torch.Tensor | None = None
        self.previous_input: torch.Tensor | None = None
        self.rate: torch.Tensor | None = None

    # ------------------------------------------------------------------ state
    def can_reuse(self, x: torch.Tensor) -> bool:
        """``Δ`` exists and has ``x``'s shape."""
        return self.delta is not None and self.delta.shape == x.shape

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held (for diagnostics and release checks)."""
        held = [self.delta, self.last_input, self.last_output, self.previous_input, self.rate]
        unique: dict[int, torch.Tensor] = {id(t): t for t in held if t is not None}
        return list(unique.values())

    def clear(self) -> None:
        """Drop every tensor; the next step starts like the first one."""
        self.delta = self.last_input = self.last_output = self.previous_input = self.rate = None

    # ------------------------------------------------------------------ updates
    def record_computed(self, x: torch.Tensor, v: torch.Tensor) -> None:
        """Store the transformation of a computed step (and its rate against the previous computed step).

        Args:
            x: the latent model input of the step (``x`` may be changed by the caller afterwards; it is copied).
            v: the model output, same shape as ``x``.

        Raises:
            ValueError: ``x`` and ``v`` differ in shape.
        """
        if x.shape != v.shape:
            raise ValueError(
                f"transformation needs input and output of one shape, got {tuple(x.shape)} and {tuple(v.shape)}"
            )
        x = x.detach()
        v = v.detach()
        if self.track_rate:
            rate = None
            if self.last_input is not None and self.last_output is not None and self.last_input.shape == x.shape:
                rate = mean_abs_diff(v, self.last_output) / mean_abs_diff(x, self.last_input)
            self.rate = rate
            self.last_input = x.clone()
            self.last_output = v.clone()
            self.previous_input = self.last_input
        self.delta = v.float() - x.float()

    def observe_input(self, x: torch.Tensor) -> None:
        """Remember the input of a step whose transformation was reused (the next error estimate needs it)."""
        if self.track_rate:
            self.previous_input = x.detach().clone()

    # ------------------------------------------------------------------ estimates
    def error_increment(self, x: torch.Tensor) -> torch.Tensor | None:
        """``ε_t = k · mean|x_t − x_{t−1}| / mean|v_p|`` as a 0-d float32 tensor, or ``None`` when unknown.

        It is unknown until two computed steps gave a rate, or when ``x`` no longer fits the cached shapes.
        Non-finite values (a zero denominator) are returned as they are; a controller comparing them with a
        threshold computes the step.
        """
        if self.rate is None or self.previous_input is None or self.last_output is None:
            return None
        if self.previous_input.shape != x.shape:
            return None
        return self.rate * mean_abs_diff(x, self.previous_input) / mean_abs(self.last_output)

    def estimate(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x + Δ`` in ``dtype`` (the reused step's output).

        Raises:
            ValueError: no transformation is cached or it does not fit ``x``.
        """
        if not self.can_reuse(x):
            raise ValueError("no cached transformation fits this input")
        return (x.detach().float() + self.delta).to(dtype)  # type: ignore[operator]


__all__ = [
    "FINAL",
    "WARMUP",
    "DenseGate",
    "TransformationCache",
    "dense_gate",
    "mean_abs",
    "mean_abs_diff",
]
