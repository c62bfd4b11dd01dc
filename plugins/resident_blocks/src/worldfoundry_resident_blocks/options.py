"""resident_blocks options: a frozen, validated dataclass built from the spec mapping or an estimator config."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Final

from worldfoundry.core.offload.estimator import uniform_resident_indices
from worldfoundry_resident_blocks.residency_config import read_residency_config
from worldfoundry.plugin import (
    AccelerationOptionsError,
    OptionValueError,
    PluginOptions,
    boolean,
    file_path,
    integer,
    join_path,
    option,
    optional,
    sequence_of,
)

NAME: Final = "resident_blocks"
#: Keys of the spec mapping.
SPEC_KEYS: Final = ("offload_resident_blocks", "cpu_offload_block_contiguous", "resident_block_indices", "config")
#: Keys an estimator config file may hold (``worldfoundry estimate-residency`` writes all five; ``estimate`` is the
#: record of how r was chosen — both rules' r, their predicted waits, c, d, N — and is not an option).
CONFIG_KEYS: Final = ("offload_resident_blocks", "cpu_offload_block_contiguous", "resident_block_indices",
                      "num_blocks", "estimate")
#: Config keys that are a record, not options.
RECORD_KEYS: Final = ("estimate",)
#: Most blocks a model may have (far above any DiT; bounds every count and index).
MAX_BLOCKS: Final = 100_000


def _error(message: str) -> AccelerationOptionsError:
    return AccelerationOptionsError(NAME, message)


def _read_config(path_value: Any, where: str) -> dict[str, Any]:
    try:
        path = Path(file_path(expected="a path to an estimator config JSON")(path_value, where))
    except OptionValueError as exc:
        raise _error(str(exc)) from None
    data = read_residency_config(path, plugin=NAME, where=where)  # stat-checked, strict JSON, typed fields
    return {k: v for k, v in data.items() if k not in RECORD_KEYS}


@dataclass(frozen=True)
class Options(PluginOptions):
    """resident_blocks options.

    Args:
        offload_resident_blocks: r, blocks kept on the device for a whole request (0 = none; every block
            streams through the two slots).
        cpu_offload_block_contiguous: ``True``: one pinned slab and one copy per block; ``False``: one pinned
            host tensor and one copy per weight. Booleans only.
        resident_block_indices: which blocks are resident (length r, distinct); default evenly spread
            (``uniform_resident_indices(N, r)``).
        num_blocks: N the indices were estimated for (from an estimator config); checked against the model.
        config: the estimator config file these values were read from (for the receipt).

    Raises:
        AccelerationOptionsError: a value has the wrong type or is out of range.

    Example:
        >>> Options.from_mapping({"offload_resident_blocks": 3}).resolve_indices(30)
        (0, 10, 20)
    """

    plugin_name: ClassVar[str] = NAME

    offload_resident_blocks: int = option(0, integer(min=0, max=MAX_BLOCKS))
    cpu_offload_block_contiguous: bool = option(False, boolean())
    resident_block_indices: tuple[int, ...] | None = option(None, optional(sequence_of(
        integer(min=0, max=MAX_BLOCKS - 1, expected="integers >= 0"), unique=True, expected="a list of integers")))
    num_blocks: int | None = option(None, optional(integer(min=1, max=MAX_BLOCKS)))
    config: str | None = option(None, optional(file_path()))

    def validate(self) -> None:
        indices, r = self.resident_block_indices, self.offload_resident_blocks
        if indices is not None:
            if len(indices) != r:
                raise OptionValueError(
                    "", f"resident_block_indices lists {len(indices)} block(s) but offload_resident_blocks is {r}")
            object.__setattr__(self, "resident_block_indices", tuple(sorted(indices)))

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None, *, path: str = "") -> Options:
        """Build from the spec mapping; unknown keys are rejected by name.

        ``{"config": "save_results/resident_blocks_config.json"}`` reads the estimator's config; keys given
        next to it override the file (a different ``offload_resident_blocks`` drops the file's indices, so
        the new r is spread evenly again).

        Raises:
            AccelerationOptionsError: unknown key, wrong type, out-of-range value, unreadable config.
        """
        if options is None:
            return cls()
        mapping = cls.check_mapping(options, path=path, known=SPEC_KEYS)
        values: dict[str, Any] = {}
        config_path = None
        if "config" in mapping:
            values = _read_config(mapping["config"], join_path(path, "config"))
            config_path = os.fspath(mapping["config"])
        explicit = {k: v for k, v in mapping.items() if k != "config"}
        if ("offload_resident_blocks" in explicit and "resident_block_indices" not in explicit
                and explicit["offload_resident_blocks"] != values.get("offload_resident_blocks")):
            values.pop("resident_block_indices", None)
        values.update(explicit)
        if "resident_block_indices" in values and "offload_resident_blocks" not in values:
            indices = values["resident_block_indices"]
            if isinstance(indices, list | tuple):
                values["offload_resident_blocks"] = len(indices)
        return cls.build({**values, "config": config_path}, path=path)

    def resolve_indices(self, num_blocks: int) -> tuple[int, ...]:
        """The resident block indices for a model with ``num_blocks`` blocks.

        Raises:
            AccelerationOptionsError: r > N, an index ≥ N, or a config estimated for another N.
        """
        if self.num_blocks is not None and self.num_blocks != num_blocks:
            where = f" ({self.config})" if self.config else ""
            raise _error(
                f"the residency config{where} was estimated for {self.num_blocks} blocks but the model has "
                f"{num_blocks}; run estimate-residency for this model"
            )
        r = self.offload_resident_blocks
        if r > num_blocks:
            raise _error(f"offload_resident_blocks is {r} but the model has only {num_blocks} blocks")
        if self.resident_block_indices is None:
            return tuple(uniform_resident_indices(num_blocks, r))
        bad = [i for i in self.resident_block_indices if i >= num_blocks]
        if bad:
            raise _error(f"resident_block_indices {bad} are outside 0..{num_blocks - 1}")
        return self.resident_block_indices

    def to_json(self) -> dict[str, Any]:
        return {
            "offload_resident_blocks": self.offload_resident_blocks,
            "cpu_offload_block_contiguous": self.cpu_offload_block_contiguous,
            "resident_block_indices": list(self.resident_block_indices) if self.resident_block_indices else None,
            "num_blocks": self.num_blocks,
            "config": self.config,
        }
