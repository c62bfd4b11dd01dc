"""AccelerationRegistry: code registration, entry-point discovery of real (on-disk) distributions, allowlist."""

from __future__ import annotations

import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from worldfoundry.core.acceleration.registry import (
    PLUGIN_ALLOWLIST_ENV,
    AccelerationRegistry,
    diffusion_acceleration_registry,
    parse_allowlist,
)
from worldfoundry.errors import DuplicateAccelerationError, PluginLoadError, UnknownAccelerationError


def factory(model, options, policy):  # a prepare factory is any callable; these tests never call it
    raise AssertionError("not called")


# ---------------------------------------------------------------------------------------------- code registration


def test_register_get_names_unregister():
    reg = AccelerationRegistry(discover=False)
    reg.register("zeta", factory)
    reg.register("alpha", factory)
    assert reg.names() == ("alpha", "zeta") and "alpha" in reg
    entry = reg.get("alpha")
    assert entry.factory is factory and entry.distribution is None
    reg.unregister("alpha")
    assert reg.names() == ("zeta",)
    with pytest.raises(UnknownAccelerationError, match="known accelerations: zeta"):
        reg.unregister("alpha")


def test_duplicate_names_raise_unless_replace():
    reg = AccelerationRegistry(discover=False)
    reg.register("kernel", factory)

    def other(model, options, policy):
        raise AssertionError("not called")

    with pytest.raises(DuplicateAccelerationError, match="'kernel' is already registered.*replace=True"):
        reg.register("kernel", other)
    assert reg.get("kernel").factory is factory
    reg.register("kernel", other, replace=True)
    assert reg.get("kernel").factory is other


def test_unknown_name_lists_known_ones():
    reg = AccelerationRegistry(discover=False)
    with pytest.raises(UnknownAccelerationError, match=r"\(none registered\)"):
        reg.get("x")
    reg.register("b", factory)
    reg.register("a", factory)
    with pytest.raises(UnknownAccelerationError) as info:
        reg.get("c")
    assert info.value.known == ("a", "b") and "known accelerations: a, b" in str(info.value)
    assert isinstance(info.value, KeyError)


@pytest.mark.parametrize("name", ["", "has space", "dots.not.allowed", 3, None])
def test_invalid_names_are_rejected(name):
    with pytest.raises(TypeError, match="acceleration name"):
        AccelerationRegistry(discover=False).register(name, factory)


def test_factory_must_be_callable():
    with pytest.raises(TypeError, match="must be callable"):
        AccelerationRegistry(discover=False).register("x", object())


def test_registries_are_independent_and_the_default_is_shared():
    a, b = AccelerationRegistry(discover=False), AccelerationRegistry(discover=False)
    a.register("only_in_a", factory)
    assert "only_in_a" not in b
    assert diffusion_acceleration_registry() is diffusion_acceleration_registry()


@pytest.mark.parametrize(("value", "expected"), [
    (None, None), ("", frozenset()), (" , ", frozenset()), ("a", frozenset({"a"})), ("a, b ,", frozenset({"a", "b"})),
])
def test_parse_allowlist(value, expected):
    assert parse_allowlist(value) == expected


# ---------------------------------------------------------------------------------------------- entry points

GOOD_MODULE = """
import worldfoundry

IMPORTED = True

def prepare(model, options, policy):
    raise AssertionError("not called")

@worldfoundry.hookimpl
def register_diffusion_accelerations(register):
    for name in NAMES:
        register(name, prepare)
"""


class FakeDistributions:
    """Writes real ``*.dist-info`` distributions into a directory on ``sys.path`` (found by importlib.metadata)."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.tag = uuid.uuid4().hex[:8]
        self.modules: list[str] = []
        monkeypatch.syspath_prepend(str(root))

    def module(self, stem: str, source: str) -> str:
        name = f"wf_fake_{stem}_{self.tag}"
        (self.root / f"{name}.py").write_text(textwrap.dedent(source))
        self.modules.append(name)
        return name

    def distribution(self, name: str, version: str, entry_points: dict[str, str]) -> str:
        dist = f"{name}-{self.tag}"
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = "".join(f"{ep} = {value}\n" for ep, value in entry_points.items())
        (info / "entry_points.txt").write_text(f"[worldfoundry.accelerations]\n{lines}")
        return dist

    def cleanup(self) -> None:
        for name in self.modules:
            sys.modules.pop(name, None)


@pytest.fixture
def fake_dists(tmp_path, monkeypatch):
    monkeypatch.delenv(PLUGIN_ALLOWLIST_ENV, raising=False)
    dists = FakeDistributions(tmp_path, monkeypatch)
    yield dists
    dists.cleanup()


def _good(dists: FakeDistributions, stem: str, names: list[str]) -> str:
    return dists.module(stem, GOOD_MODULE.replace("NAMES", repr(names)))


def test_discovery_reports_broken_plugins_and_loads_the_others(fake_dists):
    t = fake_dists.tag
    good = _good(fake_dists, "good", [f"good_a_{t}", f"good_b_{t}"])
    broken = fake_dists.module("broken", "import a_module_that_does_not_exist_anywhere\n")
    nohook = fake_dists.module("nohook", "def register_diffusion_accelerations(register):\n    pass\n")
    badsig = fake_dists.module("badsig", """
        import worldfoundry
        @worldfoundry.hookimpl
        def register_diffusion_accelerations(register, unexpected):
            pass
    """)
    raising = fake_dists.module("raising", f"""
        import worldfoundry
        @worldfoundry.hookimpl
        def register_diffusion_accelerations(register):
            register("half_registered_{t}", lambda m, o, p: None)
            raise RuntimeError("plugin exploded while registering")
    """)
    good_dist = fake_dists.distribution("wf-good", "1.2.3", {f"good_{t}": good})
    bad_dist = fake_dists.distribution("wf-bad", "0.0.1", {
        f"broken_{t}": broken, f"nohook_{t}": nohook, f"badsig_{t}": badsig, f"raising_{t}": raising,
        f"missing_attr_{t}": f"{good}:does_not_exist",
    })
    reg = AccelerationRegistry()
    assert f"good_a_{t}" in reg.names() and f"good_b_{t}" in reg.names()
    entry = reg.get(f"good_a_{t}")
    assert (entry.distribution, entry.version) == (good_dist, "1.2.3")
    assert entry.entry_point == f"good_{t} = {good}"
    assert f"half_registered_{t}" not in reg  # a plugin that fails registers nothing

    records = {r.entry_point: r for r in reg.load_records() if r.distribution in (good_dist, bad_dist)}
    assert records[f"good_{t}"].status == "loaded"
    assert records[f"good_{t}"].names == (f"good_a_{t}", f"good_b_{t}")
    failed = {ep for ep, r in records.items() if r.status == "failed"}
    assert failed == {f"broken_{t}", f"nohook_{t}", f"badsig_{t}", f"raising_{t}", f"missing_attr_{t}"}
    assert "ModuleNotFoundError" in records[f"broken_{t}"].error
    assert "no @worldfoundry.hookimpl" in records[f"nohook_{t}"].error
    assert "unexpected" in records[f"badsig_{t}"].error
    assert "plugin exploded" in records[f"raising_{t}"].error
    errors = {e.entry_point: e for e in reg.load_errors() if e.distribution == bad_dist}
    assert set(errors) == failed
    err = errors[f"broken_{t}"]
    assert isinstance(err, PluginLoadError) and isinstance(err.cause, ModuleNotFoundError)
    assert bad_dist in str(err) and f"broken_{t}" in str(err)
    assert all(r.to_json()["distribution"] for r in records.values())
    with pytest.raises(UnknownAccelerationError) as info:  # asking for the broken one says why it is missing
        reg.get(f"broken_{t}")
    assert info.value.__cause__ is err


def test_discovery_is_lazy(fake_dists):
    t = fake_dists.tag
    module = _good(fake_dists, "lazy", [f"lazy_{t}"])
    fake_dists.distribution("wf-lazy", "1.0", {f"lazy_{t}": module})
    reg = AccelerationRegistry()
    assert module not in sys.modules
    assert f"lazy_{t}" in reg
    assert module in sys.modules
    assert AccelerationRegistry(discover=False).names() == ()


def test_two_plugins_registering_one_name(fake_dists):
    t = fake_dists.tag
    first = _good(fake_dists, "first", [f"shared_{t}"])
    second = _good(fake_dists, "second", [f"shared_{t}"])
    fake_dists.distribution("wf-dup", "1.0", {f"a_first_{t}": first, f"b_second_{t}": second})
    reg = AccelerationRegistry()
    assert reg.get(f"shared_{t}").entry_point == f"a_first_{t} = {first}"
    record = next(r for r in reg.load_records() if r.entry_point == f"b_second_{t}")
    assert record.status == "failed" and "registered twice" in record.error


def test_two_entry_points_naming_one_module(fake_dists):
    t = fake_dists.tag
    module = _good(fake_dists, "twice", [f"twice_{t}"])
    fake_dists.distribution("wf-twice", "1.0", {f"one_{t}": module})
    fake_dists.distribution("wf-twice-again", "1.0", {f"two_{t}": module})
    reg = AccelerationRegistry()
    statuses = {r.entry_point: r.status for r in reg.load_records() if r.entry_point in (f"one_{t}", f"two_{t}")}
    assert statuses[f"one_{t}"] == "loaded"
    assert statuses[f"two_{t}"] == "failed"  # same hook called again: the name is taken
    assert f"twice_{t}" in reg


@pytest.mark.parametrize("allow", ["unset", "empty", "entry_point", "distribution", "code_allowlist"])
def test_allowlist(fake_dists, monkeypatch, allow):
    t = fake_dists.tag
    one = _good(fake_dists, "one", [f"one_{t}"])
    two = _good(fake_dists, "two", [f"two_{t}"])
    three = _good(fake_dists, "three", [f"three_{t}"])
    dist_a = fake_dists.distribution("wf-allow-a", "1.0", {f"ep_one_{t}": one, f"ep_two_{t}": two})
    fake_dists.distribution("wf-allow-b", "1.0", {f"ep_three_{t}": three})
    kwargs = {}
    if allow == "empty":
        monkeypatch.setenv(PLUGIN_ALLOWLIST_ENV, "")
    elif allow == "entry_point":
        monkeypatch.setenv(PLUGIN_ALLOWLIST_ENV, f"ep_two_{t}, ep_three_{t}")
    elif allow == "distribution":
        monkeypatch.setenv(PLUGIN_ALLOWLIST_ENV, dist_a)
    elif allow == "code_allowlist":
        monkeypatch.setenv(PLUGIN_ALLOWLIST_ENV, "")  # an explicit argument wins over the environment
        kwargs["allowlist"] = [f"ep_one_{t}"]
    reg = AccelerationRegistry(**kwargs)
    loaded = {n for n in (f"one_{t}", f"two_{t}", f"three_{t}") if n in reg}
    expected = {
        "unset": {f"one_{t}", f"two_{t}", f"three_{t}"},
        "empty": set(),
        "entry_point": {f"two_{t}", f"three_{t}"},
        "distribution": {f"one_{t}", f"two_{t}"},
        "code_allowlist": {f"one_{t}"},
    }[allow]
    assert loaded == expected
    ours = [r for r in reg.load_records() if r.entry_point.endswith(t)]
    assert len(ours) == 3
    for record in ours:
        if record.status.startswith("skipped"):
            assert PLUGIN_ALLOWLIST_ENV in record.status and not record.names
            assert record.value.split(":")[0] not in sys.modules  # skipped plugins are never imported
    if allow == "empty":
        assert all(r.status.startswith("skipped") for r in reg.load_records())
