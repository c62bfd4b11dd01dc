"""Frozen, validated options of ``cuda_graph``.

Spec::

    {"cuda_graph": {"max_signatures": 4, "output": "copy", "warmup_calls": 0, "compose_with": []}}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Final

from worldfoundry.plugin import PluginOptions, choice, integer, option, sequence_of, string

PLUGIN_NAME: Final = "cuda_graph"


@dataclass(frozen=True)
class Options(PluginOptions):
    """Options of ``cuda_graph``.

    Attributes:
        max_signatures: captured call signatures kept per model; the least recently used one is evicted (its graph
            and memory pool freed) when a new one is captured beyond this.
        output: ``"copy"`` — every replay returns fresh tensors the caller owns; ``"static"`` — the graph's own
            output buffers, overwritten by the next call of the same signature (saves one copy per call; not
            allowed beside a plugin that keeps outputs, such as ``easycache``).
        warmup_calls: eager calls of a new signature before it is captured (0: the first call captures).
        compose_with: names of further co-installed plugins whose forward has no per-call Python state beyond
            ledger calls (so that freezing it in a graph is exact); unknown plugins otherwise make calls eager.
    """

    plugin_name: ClassVar[str] = PLUGIN_NAME

    max_signatures: int = option(4, integer(min=1, max=64))
    output: str = option("copy", choice("copy", "static"))
    warmup_calls: int = option(0, integer(min=0, max=1000))
    compose_with: tuple[str, ...] = option((), sequence_of(string(max_length=200), max_items=64, unique=True))


__all__ = ["PLUGIN_NAME", "Options"]
