"""Options validation, including the estimator-config form."""

from __future__ import annotations

import json

import pytest
from worldfoundry_resident_blocks.options import Options

from worldfoundry.errors import AccelerationOptionsError


def test_defaults_are_r_zero_per_tensor() -> None:
    opts = Options.from_mapping({})
    assert opts.offload_resident_blocks == 0
    assert opts.cpu_offload_block_contiguous is False
    assert opts.resolve_indices(5) == ()
    assert Options.from_mapping(None) == opts


def test_spec_form_spreads_indices_evenly() -> None:
    opts = Options.from_mapping({"offload_resident_blocks": 3, "cpu_offload_block_contiguous": True})
    assert opts.cpu_offload_block_contiguous is True
    assert opts.resolve_indices(30) == (0, 10, 20)
    assert opts.resolve_indices(3) == (0, 1, 2)


@pytest.mark.parametrize(
    "options, fragment",
    [
        ({"resident_blocks": 3}, "unknown option(s) ['resident_blocks']"),
        ({"offload_resident_blocks": -1}, "offload_resident_blocks"),
        ({"offload_resident_blocks": 1.5}, "offload_resident_blocks"),
        ({"offload_resident_blocks": True}, "offload_resident_blocks"),
        ({"offload_resident_blocks": "2"}, "offload_resident_blocks"),
        ({"cpu_offload_block_contiguous": 1}, "cpu_offload_block_contiguous"),
        ({"cpu_offload_block_contiguous": "true"}, "cpu_offload_block_contiguous"),
        ({"offload_resident_blocks": 2, "resident_block_indices": [0, 0]}, "repeat"),
        ({"offload_resident_blocks": 2, "resident_block_indices": [0]}, "lists 1 block(s)"),
        ({"offload_resident_blocks": 1, "resident_block_indices": [-1]}, "integers >= 0"),
        ({"offload_resident_blocks": 1, "resident_block_indices": "0"}, "list of integers"),
        ({"config": 3}, "config"),
        ({"config": "/nonexistent/resident_blocks_config.json"}, "estimate-residency"),
    ],
)
def test_bad_options_are_rejected_by_name(options: dict, fragment: str) -> None:
    with pytest.raises(AccelerationOptionsError) as info:
        Options.from_mapping(options)
    assert info.value.plugin == "resident_blocks"
    assert fragment in str(info.value)


def test_r_larger_than_the_model_is_rejected() -> None:
    opts = Options.from_mapping({"offload_resident_blocks": 5})
    with pytest.raises(AccelerationOptionsError, match="only 4 blocks"):
        opts.resolve_indices(4)
    opts = Options.from_mapping({"offload_resident_blocks": 1, "resident_block_indices": [7]})
    with pytest.raises(AccelerationOptionsError, match=r"\[7\] are outside"):
        opts.resolve_indices(4)


def test_explicit_indices_set_r_and_are_sorted() -> None:
    opts = Options.from_mapping({"resident_block_indices": [3, 1]})
    assert opts.offload_resident_blocks == 2
    assert opts.resolve_indices(4) == (1, 3)


def _write(tmp_path, data) -> str:
    path = tmp_path / "resident_blocks_config.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_config_file_form(tmp_path) -> None:
    path = _write(tmp_path, {"offload_resident_blocks": 2, "cpu_offload_block_contiguous": True,
                             "resident_block_indices": [0, 2], "num_blocks": 4})
    opts = Options.from_mapping({"config": path})
    assert opts.offload_resident_blocks == 2 and opts.cpu_offload_block_contiguous is True
    assert opts.resolve_indices(4) == (0, 2)
    assert opts.config == path
    with pytest.raises(AccelerationOptionsError, match="estimated for 4 blocks but the model has 6"):
        opts.resolve_indices(6)


def test_the_runner_reads_either_rules_config(tmp_path) -> None:
    from worldfoundry_resident_blocks.residency_files import write_estimate

    from worldfoundry.core.offload.estimator import estimate_residency

    for rule, r in (("schedule", 10), ("budget", 9)):
        path = write_estimate(estimate_residency(30, 1.27, 1.8, contiguous=True, rule=rule), tmp_path / rule)["config"]
        opts = Options.from_mapping({"config": str(path)})
        assert opts.offload_resident_blocks == r and opts.resolve_indices(30) == tuple(json.loads(
            path.read_text())["resident_block_indices"])
    with pytest.raises(AccelerationOptionsError, match="estimate: .*expected a JSON object"):
        Options.from_mapping({"config": _write(tmp_path, {"offload_resident_blocks": 1, "estimate": [1]})})


def test_explicit_keys_override_the_config_file(tmp_path) -> None:
    path = _write(tmp_path, {"offload_resident_blocks": 2, "cpu_offload_block_contiguous": True,
                             "resident_block_indices": [1, 3], "num_blocks": 4})
    lowered = Options.from_mapping({"config": path, "offload_resident_blocks": 1})
    assert lowered.resolve_indices(4) == (0,)  # the file's indices belong to r = 2; r = 1 is spread again
    same = Options.from_mapping({"config": path, "offload_resident_blocks": 2})
    assert same.resolve_indices(4) == (1, 3)
    layout = Options.from_mapping({"config": path, "cpu_offload_block_contiguous": False})
    assert layout.cpu_offload_block_contiguous is False and layout.resolve_indices(4) == (1, 3)


@pytest.mark.parametrize(
    "data, fragment",
    [
        ({"offload_resident_blocks": 1, "extra": 1}, "unknown key(s) ['extra']"),
        ({"cpu_offload_block_contiguous": False}, "no offload_resident_blocks"),
        ([1, 2], "JSON object"),
        ({"offload_resident_blocks": 1, "num_blocks": 0}, "num_blocks"),
    ],
)
def test_bad_config_files_are_rejected(tmp_path, data, fragment: str) -> None:
    with pytest.raises(AccelerationOptionsError, match=None) as info:
        Options.from_mapping({"config": _write(tmp_path, data)})
    assert fragment in str(info.value)


def test_unreadable_config_file(tmp_path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(AccelerationOptionsError, match="invalid JSON"):
        Options.from_mapping({"config": str(path)})


def test_options_class_is_published_for_model_free_validation() -> None:
    from worldfoundry.core.acceleration.registry import AccelerationRegistry

    entry = AccelerationRegistry(discover=True, allowlist=["resident_blocks"]).get("resident_blocks")
    assert entry.options is Options
    assert entry.options.from_mapping({"offload_resident_blocks": 2}).offload_resident_blocks == 2
