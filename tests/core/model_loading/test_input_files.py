"""The strict readers every untrusted file goes through: stat first, bounded reads, strict JSON, finite tensors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.core.model_loading.input_files import (
    MAX_JSON_DEPTH,
    YamlInputError,
    check_input_file,
    load_json_file,
    load_yaml_file,
    parse_json_bytes,
    read_input_bytes,
)
from worldfoundry.errors import InputFileError, JsonInputError

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63) + 1, 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False, min_value=-1e300, max_value=1e300) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=150, deadline=None)
@given(JSON)
def test_valid_json_round_trips_like_the_standard_decoder(value) -> None:
    data = json.dumps(value).encode()
    assert parse_json_bytes(data, source="x.json") == json.loads(data)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_give_json_or_a_typed_error(data: bytes) -> None:
    try:
        parse_json_bytes(data, source="x.json")
    except JsonInputError as exc:
        assert exc.file == "x.json" and exc.path.startswith("$")


@pytest.mark.parametrize(("raw", "path", "text"), [
    (b'{"a": {"b": 1, "b": 2}}', "$.a.b", "duplicate key 'b'"),
    (b'{"a": [0, NaN]}', "$.a[1]", "NaN is not allowed"),
    (b'{"a": -Infinity}', "$.a", "Infinity is not allowed"),
    (b'{"a": 1e309}', "$.a", "out of range"),
    (b'{"a": 9223372036854775808}', "$.a", "out of range"),
    (b'{"odd key": {"x": 1, "x": 1}}', '$["odd key"].x', "duplicate key"),
    (b'{"a": 1,}', "$", "invalid JSON at line 1"),
    (b"\xef\xbb\xbf\xff", "$", "not UTF-8"),
])
def test_refusals_name_the_json_path(raw: bytes, path: str, text: str) -> None:
    with pytest.raises(JsonInputError) as info:
        parse_json_bytes(raw, source="x.json")
    assert info.value.path == path and text in str(info.value), str(info.value)


def test_depth_limit_and_strings_with_brackets() -> None:
    ok = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert parse_json_bytes(ok.encode(), source="x") is not None
    with pytest.raises(JsonInputError, match="nesting deeper"):
        parse_json_bytes(("[" + ok + "]").encode(), source="x")
    brackets = json.dumps({"s": "[" * 1000 + '\\"{'})  # brackets inside strings do not count as nesting
    assert parse_json_bytes(brackets.encode(), source="x")["s"].startswith("[[[")
    assert math.isclose(parse_json_bytes(b"\xef\xbb\xbf1.5", source="x"), 1.5)  # a UTF-8 BOM is accepted


def test_files_are_stat_checked_before_reading(tmp_path: Path) -> None:
    with pytest.raises(InputFileError, match="does not exist"):
        check_input_file(tmp_path / "none", what="config", max_bytes=10)
    with pytest.raises(InputFileError, match="is a directory"):
        read_input_bytes(tmp_path, what="config", max_bytes=10)
    (tmp_path / "big.json").write_text("[" + "1," * 20 + "1]")
    with pytest.raises(InputFileError, match="more than the 10-byte limit"):
        load_json_file(tmp_path / "big.json", what="config", max_bytes=10)
    assert load_json_file(tmp_path / "big.json", what="config")[0] == 1


def test_yaml_resolvers_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("x: 1\ny: ${x}\n")
    assert load_yaml_file(tmp_path / "a.yaml", what="config", max_bytes=1000) == {"x": 1, "y": 1}
    (tmp_path / "b.yaml").write_text("home: ${oc.env:HOME}\n")
    with pytest.raises(YamlInputError, match="home uses an OmegaConf resolver"):
        load_yaml_file(tmp_path / "b.yaml", what="config", max_bytes=1000)
