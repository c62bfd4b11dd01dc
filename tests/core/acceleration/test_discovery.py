"""The shared entry-point discovery: allowlist resolution and a group with nothing to load."""

from __future__ import annotations

import pluggy

from worldfoundry.core.acceleration import hookspecs
from worldfoundry.core.acceleration.discovery import (
    PLUGIN_ALLOWLIST_ENV,
    load_entry_points,
    parse_allowlist,
    resolve_allowlist,
)


def test_resolve_allowlist_prefers_the_explicit_one(monkeypatch) -> None:
    monkeypatch.setenv(PLUGIN_ALLOWLIST_ENV, "a, b")
    assert resolve_allowlist(None) == frozenset({"a", "b"})
    assert resolve_allowlist(frozenset({"c"})) == frozenset({"c"})
    monkeypatch.delenv(PLUGIN_ALLOWLIST_ENV)
    assert resolve_allowlist(None) is None
    assert parse_allowlist("") == frozenset()


def test_an_empty_group_loads_nothing_and_never_asks_for_a_register() -> None:
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)

    def make_register(ep, dist, version):
        raise AssertionError("no entry point, no register")

    records, errors = load_entry_points("worldfoundry.no_such_group", "register_diffusion_accelerations", manager,
                                        None, make_register)
    assert records == [] and errors == []
