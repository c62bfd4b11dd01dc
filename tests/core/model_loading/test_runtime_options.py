"""Runtime options declared from above core: accepted, checked and normalised by ``RuntimePolicy``."""

from __future__ import annotations

from pathlib import Path

import pytest

from worldfoundry.core.model_loading import runtime_options
from worldfoundry.core.model_loading.policy import KNOWN_OPTION_KEYS, RuntimePolicy, known_option_keys
from worldfoundry.core.model_loading.runtime_options import (
    check_declared_option,
    declare_runtime_option,
    declared_runtime_options,
    file_path,
)
from worldfoundry.errors import PolicyError


@pytest.fixture(autouse=True)
def _isolated_declarations(monkeypatch):
    """Declarations made by a test vanish after it."""
    monkeypatch.setattr(runtime_options, "_DECLARED", dict(runtime_options._DECLARED))


def _positive(where, value):
    if not isinstance(value, int) or value <= 0:
        raise PolicyError(f"{where}: expected a positive integer")
    return value


def test_declared_option_is_known_checked_and_normalised(tmp_path: Path) -> None:
    declare_runtime_option("test_declared_count", _positive, doc="a count read by a test layer")
    assert "test_declared_count" in known_option_keys() and "test_declared_count" not in KNOWN_OPTION_KEYS
    assert RuntimePolicy(options={"test_declared_count": 3}).option("test_declared_count") == 3
    with pytest.raises(PolicyError, match="options.test_declared_count: expected a positive integer"):
        RuntimePolicy(options={"test_declared_count": 0})
    assert RuntimePolicy(options={"test_declared_count": None}).option("test_declared_count") is None


def test_model_layer_calibration_path_is_normalised(tmp_path: Path) -> None:
    policy = RuntimePolicy(options={"vae_fp8_calibration": tmp_path / "a.pt"})
    assert policy.option("vae_fp8_calibration") == str(tmp_path / "a.pt")
    assert "vae_fp8_calibration" in declared_runtime_options()


def test_redeclaring_with_another_check_is_refused() -> None:
    declare_runtime_option("test_declared_path", file_path, doc="a path read by a test layer")
    declare_runtime_option("test_declared_path", file_path, doc="same check: a no-op")
    with pytest.raises(ValueError, match="already declared"):
        declare_runtime_option("test_declared_path", _positive, doc="another check")
    with pytest.raises(ValueError, match="identifier"):
        declare_runtime_option("not a name", file_path, doc="bad")


def test_file_path_check() -> None:
    assert file_path("options.x", Path("a") / "b.pt") == str(Path("a") / "b.pt")
    with pytest.raises(PolicyError, match="options.x: expected a file path"):
        file_path("options.x", 5)
    assert check_declared_option("vae_fp8_calibration", None) is None
