"""The attention provider registry: built-ins, code registration, entry-point discovery of the test
distribution, the WORLDFOUNDRY_PLUGINS allowlist, broken distributions, and the ``worldfoundry plugins`` listing."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import uuid

import pytest
import torch

from worldfoundry.cli import plugins_cmd
from worldfoundry.core.acceleration.registry import PLUGIN_ALLOWLIST_ENV, AccelerationRegistry
from worldfoundry.core.attention.provider_registry import AttentionProviderRegistry, register_attention_provider
from worldfoundry.errors import DuplicateAttentionProviderError, PluginLoadError, UnknownAttentionProviderError

TEST_PROVIDER = "chunked_softmax"
TEST_DIST = "worldfoundry-test-attention-provider"
BUILTINS = ("sdpa", "sdpa_cudnn", "sdpa_efficient", "sdpa_flash", "sdpa_math")


@pytest.fixture(autouse=True)
def _all_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PLUGIN_ALLOWLIST_ENV, raising=False)


@pytest.fixture
def test_distribution() -> None:
    """Skip where the test-only provider distribution is not installed (it is in requirements-dev.txt)."""
    import importlib.metadata

    try:
        importlib.metadata.version(TEST_DIST)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{TEST_DIST} is not installed: pip install -e tests/fixtures/attention_provider_dist")


def test_builtins_and_code_registration() -> None:
    registry = AttentionProviderRegistry(discover=False)
    assert registry.names() == BUILTINS
    assert AttentionProviderRegistry(discover=False, builtins=False).names() == ()
    sdpa = registry.get("sdpa")
    mine = dataclasses.replace(sdpa, name="mine", distribution=None)
    register_attention_provider(mine, registry=registry)
    assert registry.get("mine") is mine and "mine" in registry
    with pytest.raises(DuplicateAttentionProviderError, match="'mine' is already registered \\(by code\\)"):
        registry.register(mine)
    registry.register(dataclasses.replace(mine, version="2"), replace=True)
    assert registry.get("mine").version == "2"
    registry.unregister("mine")
    with pytest.raises(UnknownAttentionProviderError) as info:
        registry.get("mine")
    assert "unknown attention provider 'mine'; registered providers: ['sdpa'" in str(info.value)
    with pytest.raises(TypeError, match="register an AttentionProvider, got function"):
        registry.register(lambda q, k, v: q)


def test_the_test_distribution_is_discovered_through_its_entry_point(test_distribution) -> None:
    registry = AttentionProviderRegistry()
    provider = registry.get(TEST_PROVIDER)
    assert provider.distribution == TEST_DIST and provider.numerics == "exact_equivalent"
    record = next(r for r in registry.load_records() if r.entry_point == TEST_PROVIDER)
    assert record.status == "loaded" and record.names == (TEST_PROVIDER,) and record.distribution == TEST_DIST
    q = torch.randn(1, 2, 40, 16)
    torch.testing.assert_close(provider.attention(q, q, q), torch.nn.functional.scaled_dot_product_attention(q, q, q))


def test_allowlist_by_entry_point_distribution_or_empty(monkeypatch: pytest.MonkeyPatch, test_distribution) -> None:
    assert TEST_PROVIDER in AttentionProviderRegistry(allowlist=[TEST_DIST]).names()
    monkeypatch.setenv(PLUGIN_ALLOWLIST_ENV, TEST_PROVIDER)
    registry = AttentionProviderRegistry()
    assert set(registry.names()) - set(BUILTINS) == {TEST_PROVIDER}
    monkeypatch.setenv(PLUGIN_ALLOWLIST_ENV, "")
    registry = AttentionProviderRegistry()
    assert registry.names() == BUILTINS
    assert registry.load_records() and all(
        r.status == f"skipped (not in {PLUGIN_ALLOWLIST_ENV})" for r in registry.load_records())


def _broken_distribution(tmp_path, monkeypatch, body: str) -> tuple[str, str]:  # noqa: ANN001
    tag = uuid.uuid4().hex[:8]
    module = f"wf_broken_provider_{tag}"
    (tmp_path / f"{module}.py").write_text(body)
    info = tmp_path / f"wf_broken_provider_{tag}-2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: wf-broken-provider-{tag}\nVersion: 2.0\n")
    (info / "entry_points.txt").write_text(f"[worldfoundry.attention_providers]\nbroken_{tag} = {module}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tag, module


def test_a_broken_distribution_is_reported_and_the_others_load(tmp_path, monkeypatch, test_distribution) -> None:
    tag, module = _broken_distribution(tmp_path, monkeypatch, "raise ImportError('kernel extension missing')\n")
    registry = AttentionProviderRegistry()
    assert TEST_PROVIDER in registry.names()
    (error,) = [e for e in registry.load_errors() if e.entry_point == f"broken_{tag}"]
    assert isinstance(error, PluginLoadError) and "kernel extension missing" in str(error)
    with pytest.raises(UnknownAttentionProviderError) as info:
        registry.get(f"broken_{tag}")
    assert info.value.__cause__ is error
    rows = plugins_cmd.provider_rows(registry)
    failed = [r for r in rows if r["status"] == "failed"]
    assert failed and failed[0]["distribution"] == f"wf-broken-provider-{tag}"
    out = io.StringIO()
    assert plugins_cmd.run(argparse.Namespace(json=False, strict=True), registry=AccelerationRegistry(discover=False),
                           out=out, providers=registry) == 1
    assert f"wf-broken-provider-{tag} (broken_{tag} = {module}): ImportError: kernel extension missing" in out.getvalue()


def test_a_module_without_the_hook_fails_to_load(tmp_path, monkeypatch) -> None:
    tag, _ = _broken_distribution(tmp_path, monkeypatch, "X = 1\n")
    registry = AttentionProviderRegistry()
    (error,) = [e for e in registry.load_errors() if e.entry_point == f"broken_{tag}"]
    assert "defines no @worldfoundry.hookimpl register_attention_providers" in str(error)


def test_worldfoundry_plugins_lists_the_providers(test_distribution) -> None:
    out = io.StringIO()
    assert plugins_cmd.run(argparse.Namespace(json=True, strict=False), registry=AccelerationRegistry(discover=False),
                           out=out, providers=AttentionProviderRegistry(allowlist=[TEST_PROVIDER])) == 0
    data = json.loads(out.getvalue())["attention_providers"]
    assert data["group"] == "worldfoundry.attention_providers"
    rows = {r["name"]: r for r in data["providers"]}
    assert rows[TEST_PROVIDER] == {"name": TEST_PROVIDER, "numerics": "exact_equivalent", "version": "0.1.0",
                                   "distribution": TEST_DIST, "status": "loaded", "error": None,
                                   "entry_point": f"{TEST_PROVIDER} = worldfoundry_test_attention_provider.provider"}
    assert rows["sdpa"]["entry_point"] == "(built-in)"
    text = io.StringIO()
    plugins_cmd.run(argparse.Namespace(json=False, strict=False), registry=AccelerationRegistry(discover=False),
                    out=text, providers=AttentionProviderRegistry(allowlist=[TEST_PROVIDER]))
    assert "attention providers (entry-point group 'worldfoundry.attention_providers'):" in text.getvalue()
