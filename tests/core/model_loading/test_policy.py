"""RuntimePolicy: frozen, validated, read from YAML/JSON through OmegaConf."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from worldfoundry.core.model_loading.policy import KNOWN_OPTION_KEYS, RuntimePolicy, parse_dtype
from worldfoundry.errors import PolicyError


def test_defaults_and_parsing():
    policy = RuntimePolicy(device="cpu", dtype="bf16",
                           options={"accelerations": {"a": True, "b": {"x": [1, 2]}, "c": False},
                                    "dit_weight_dtype": "torch.float16"})
    assert policy.device == torch.device("cpu") and policy.dtype is torch.bfloat16
    assert policy.accelerations == {"a": {}, "b": {"x": [1, 2]}}
    assert policy.option("dit_weight_dtype") is torch.float16
    assert policy.to_json() == {"device": "cpu", "dtype": "bfloat16",
                                "options": {"accelerations": {"a": {}, "b": {"x": [1, 2]}},
                                            "dit_weight_dtype": "float16"}}
    assert RuntimePolicy().dtype is torch.float32


def test_policy_is_frozen_and_options_read_only():
    policy = RuntimePolicy(options={"accelerations": {"a": {"k": 1}}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.dtype = torch.float16
    with pytest.raises(TypeError):
        policy.options["progress"] = True
    with pytest.raises(TypeError):
        policy.options["accelerations"]["a"]["k"] = 2
    copy = policy.accelerations
    copy["a"]["k"] = 99
    assert policy.accelerations == {"a": {"k": 1}}


def test_caller_mapping_is_not_shared():
    options = {"accelerations": {"a": {"k": 1}}}
    policy = RuntimePolicy(options=options)
    options["accelerations"]["a"]["k"] = 2
    assert policy.accelerations == {"a": {"k": 1}}


@pytest.mark.parametrize("dtype", ["int8", "float33", torch.int64, 3, None])
def test_bad_dtype(dtype):
    with pytest.raises(PolicyError, match="dtype"):
        RuntimePolicy(dtype=dtype)


@pytest.mark.parametrize("device", ["gpu", "cuda:x", 3.5, None])
def test_bad_device(device):
    with pytest.raises(PolicyError, match="device"):
        RuntimePolicy(device=device)


def test_unknown_option_keys_list_the_known_ones():
    with pytest.raises(PolicyError) as info:
        RuntimePolicy(options={"acceleration": {}})
    message = str(info.value)
    assert "'acceleration'" in message and all(k in message for k in KNOWN_OPTION_KEYS)
    with pytest.raises(PolicyError, match="unknown option 'nope'"):
        RuntimePolicy().option("nope")


@pytest.mark.parametrize(("options", "message"), [
    ("not a mapping", "options: expected a mapping"),
    ({"accelerations": ["easycache"]}, "options.accelerations: expected a mapping"),
    ({"accelerations": {"easycache": 0.1}}, r"options.accelerations.easycache: expected an options mapping"),
    ({"accelerations": {"": {}}}, "non-empty strings"),
    ({"dit_weight_dtype": "int4"}, "options.dit_weight_dtype"),
    ({"progress": "yes"}, "options.progress"),
    ({"vae_fp8_calibration": 5}, "file path"),
])
def test_bad_option_values(options, message):
    with pytest.raises(PolicyError, match=message):
        RuntimePolicy(options=options)


def test_replace_merges_options():
    policy = RuntimePolicy(options={"progress": True})
    changed = policy.replace(dtype="fp16", options={"accelerations": {"a": True}})
    assert changed.dtype is torch.float16 and changed.option("progress") is True
    assert changed.accelerations == {"a": {}} and policy.accelerations == {}
    with pytest.raises(PolicyError, match=r"unknown field\(s\) \['devce'\]"):
        policy.replace(devce="cuda")


def test_from_config_yaml_json_and_mapping(tmp_path):
    yaml_file = tmp_path / "policy.yaml"
    yaml_file.write_text(
        "device: cpu\n"
        "dtype: bf16\n"
        "options:\n"
        "  accelerations:\n"
        "    easycache: {threshold: 0.05}\n"
        "    example_gelu_tanh: true\n"
    )
    from_yaml = RuntimePolicy.from_config(yaml_file)
    assert from_yaml.dtype is torch.bfloat16
    assert from_yaml.accelerations == {"easycache": {"threshold": 0.05}, "example_gelu_tanh": {}}

    json_file = tmp_path / "policy.json"
    json_file.write_text(json.dumps({"dtype": "float32", "options": {"accelerations": {"easycache": True}}}))
    from_json = RuntimePolicy.from_config(str(json_file))
    assert from_json.dtype is torch.float32 and from_json.accelerations == {"easycache": {}}

    assert RuntimePolicy.from_config({"dtype": "fp16"}).dtype is torch.float16
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    assert RuntimePolicy.from_config(empty) == RuntimePolicy()


@pytest.mark.parametrize(("content", "message"), [
    ("device: cpu\nfoo: 1\n", r"unknown top-level key\(s\) \['foo'\]"),
    ("- a\n- b\n", "top level must be a mapping"),
    ("dtype: int8\n", "dtype"),
    ("options:\n  turbo: true\n", r"unknown key\(s\) \['turbo'\]"),
    ("options: {accelerations: {a: 3}}\n", "expected an options mapping"),
    ("device: [unclosed\n", "cannot read policy config"),
])
def test_from_config_errors(tmp_path, content, message):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(PolicyError, match=message):
        RuntimePolicy.from_config(path)


def test_from_config_missing_file(tmp_path):
    with pytest.raises(PolicyError, match="cannot read policy config"):
        RuntimePolicy.from_config(tmp_path / "missing.yaml")


def test_parse_dtype_accepts_dtypes_and_aliases():
    assert parse_dtype(torch.float64) is torch.float64
    assert parse_dtype(" Half ") is torch.float16
