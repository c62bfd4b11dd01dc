"""EasyCache options: a frozen, validated dataclass built from the spec mapping."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Final

from worldfoundry.plugin import PluginOptions, choice, integer, number, option

PLUGIN_NAME: Final = "easycache"
BRANCH_DECISIONS: Final = ("cond", "separate")
#: Upper bound of the step counts (far above any schedule; keeps the counters in 64 bits).
MAX_STEPS: Final = 1_000_000


@dataclass(frozen=True)
class Options(PluginOptions):
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

    plugin_name: ClassVar[str] = PLUGIN_NAME

    threshold: float = option(0.05, number(min=0.0))
    warmup_steps: int = option(10, integer(min=0, max=MAX_STEPS))
    final_dense_steps: int = option(1, integer(min=0, max=MAX_STEPS))
    branch_decision: str = option("cond", choice(*BRANCH_DECISIONS))

    @property
    def dense(self) -> bool:
        """``threshold == 0``: every step is computed and the model output is returned unchanged."""
        return self.threshold == 0.0
