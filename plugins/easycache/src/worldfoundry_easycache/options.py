"""EasyCache options: a frozen, validated dataclass built from the spec mapping."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Final

from worldfoundry.errors import AccelerationOptionsError

PLUGIN_NAME: Final = "easycache"
BRANCH_DECISIONS: Final = ("cond", "separate")


@dataclass(frozen=True)
class Options:
    """EasyCache options.

    Args:
        threshold: skip while the accumulated predicted output change stays below this value. ``0.0``
            computes every step and returns the dense output unchanged.
        warmup_steps: the first steps of each phase (the request, or one expert's phase) are always computed.
        final_dense_steps: the last steps of each phase are always computed.
        branch_decision: ``"cond"``: the conditional CFG branch decides for the pair (the unconditional branch
            of the same step follows; the runner calls ``cond`` first); ``"separate"``: each branch decides.

    Raises:
        AccelerationOptionsError: a value has the wrong type or is out of range.

    Example:
        >>> Options.from_mapping({"threshold": 0.1, "warmup_steps": 4})
        Options(threshold=0.1, warmup_steps=4, final_dense_steps=1, branch_decision='cond')
    """

    threshold: float = 0.05
    warmup_steps: int = 10
    final_dense_steps: int = 1
    branch_decision: str = "cond"

    def __post_init__(self) -> None:
        threshold = self.threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int | float):
            raise AccelerationOptionsError(PLUGIN_NAME, f"threshold: expected a number, got {threshold!r}")
        if not math.isfinite(threshold) or threshold < 0:
            raise AccelerationOptionsError(PLUGIN_NAME, f"threshold: expected a finite number >= 0, got {threshold!r}")
        object.__setattr__(self, "threshold", float(threshold))
        for name in ("warmup_steps", "final_dense_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise AccelerationOptionsError(PLUGIN_NAME, f"{name}: expected an integer >= 0, got {value!r}")
        if self.branch_decision not in BRANCH_DECISIONS:
            raise AccelerationOptionsError(
                PLUGIN_NAME, f"branch_decision: expected one of {list(BRANCH_DECISIONS)}, got {self.branch_decision!r}"
            )

    @property
    def dense(self) -> bool:
        """``threshold == 0``: every step is computed and the model output is returned unchanged."""
        return self.threshold == 0.0

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None) -> Options:
        """Build from the spec mapping; unknown keys are rejected by name.

        Raises:
            AccelerationOptionsError: unknown key, wrong type or out-of-range value.
        """
        if options is None:
            return cls()
        if not isinstance(options, Mapping):
            raise AccelerationOptionsError(PLUGIN_NAME, f"options: expected a mapping, got {type(options).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in options if k not in known)
        if unknown:
            raise AccelerationOptionsError(
                PLUGIN_NAME, f"unknown option(s) {unknown}; known options: {sorted(known)}"
            )
        return cls(**{str(k): v for k, v in options.items()})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
