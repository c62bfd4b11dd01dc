"""The files ``worldfoundry estimate-residency`` writes for ``resident_blocks``: its config and report.

The estimator's maths (:mod:`worldfoundry.core.offload.estimator`) is plugin-neutral; this module turns an
estimate into this plugin's options (``{"resident_blocks": {"config": <path>}}`` reads the config file back).

Example:
    >>> from worldfoundry.core.offload.estimator import estimate_residency
    >>> config_of(estimate_residency(30, 1.27, 1.8, contiguous=True))["offload_resident_blocks"]
    10
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from worldfoundry.core.offload.estimator import RULES, ResidencyEstimate

#: File names written into the output directory.
CONFIG_FILENAME: Final = "resident_blocks_config.json"
REPORT_JSON_FILENAME: Final = "resident_blocks_report.json"
REPORT_MD_FILENAME: Final = "resident_blocks_report.md"
#: Report keys shown in the Markdown table, in order (those present).
_MARKDOWN_KEYS: Final = (
    "recipe", "device", "device_name", "dtype", "layout", "weights", "block_path", "block_bytes", "tokens",
    "input_shapes", "compute_ms", "transfer_ms", "transfer_gb_per_s", "warmup", "samples", "copy_utilisation",
    "copy_need_ms_per_forward", "copy_budget_ms_per_forward", "two_slot_predicted_copy_wait_ms_per_forward",
    "two_slot_resident_without_waits", "emulated", "torch", "diffusers",
)


def config_of(estimate: ResidencyEstimate) -> dict[str, Any]:
    """The ``resident_blocks`` options an estimate stands for (the config file's content).

    Args:
        estimate: from :func:`~worldfoundry.core.offload.estimator.estimate_residency`.

    Returns:
        ``offload_resident_blocks``, ``cpu_offload_block_contiguous``, ``resident_block_indices``, ``num_blocks``,
        and ``estimate``: the rule used, both rules' r and their predicted copy waits, c, d, N and u (a record the
        plugin does not read as options).
    """
    return {
        "offload_resident_blocks": estimate.resident,
        "cpu_offload_block_contiguous": estimate.contiguous,
        "resident_block_indices": list(estimate.indices),
        "num_blocks": estimate.num_blocks,
        "estimate": estimate.rule_comparison(),
    }


def markdown_report(report: Mapping[str, Any]) -> str:
    """The human-readable report of :meth:`ResidencyEstimate.to_report`."""
    lines = [
        "# resident_blocks residency estimate",
        "",
        f"r = **{report['resident']}** of N = {report['num_blocks']} blocks resident "
        f"(indices {report['resident_block_indices']}); {report['streamed']} streamed through two slots.",
        "",
        "| quantity | value |",
        "|---|---|",
    ]
    lines += [f"| {key} | {report[key]} |" for key in _MARKDOWN_KEYS if key in report]
    rules = report["rules"]
    lines += ["", f"Rule: {report['rule']} ({report['rule_text']}).", "",
              "| rule | r | predicted copy wait (ms per forward) |", "|---|---|---|"]
    lines += [f"| {name}{' (used)' if name == report['rule'] else ''} | {rules[f'{name}_resident']} | "
              f"{rules[f'{name}_predicted_copy_wait_ms']} |" for name in RULES]
    lines += ["", f"Note: {report['note']}.", ""]
    return "\n".join(lines)


def write_estimate(estimate: ResidencyEstimate, out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Write the config JSON and the report (JSON and Markdown) into ``out_dir`` (created if needed).

    Returns:
        ``{"config": path, "report_json": path, "report_md": path}``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "config": out / CONFIG_FILENAME,
        "report_json": out / REPORT_JSON_FILENAME,
        "report_md": out / REPORT_MD_FILENAME,
    }
    report = estimate.to_report()
    paths["config"].write_text(json.dumps(config_of(estimate), indent=2) + "\n")
    paths["report_json"].write_text(json.dumps(report, indent=2) + "\n")
    paths["report_md"].write_text(markdown_report(report))
    return paths
