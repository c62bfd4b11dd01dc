"""Static K/V cache and the fingerprints that decide when cached tensors are stale."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from worldfoundry.core.attention.fingerprints import (
    ContentVersions,
    IdentityRef,
    alignment,
    parameters_state,
    tensor_state,
)
from worldfoundry.core.attention.static_kv_cache import HIT, INVALIDATED, MISS, StaticKVCache


def test_tensor_state_tracks_identity_version_and_layout() -> None:
    t = torch.randn(4, 4)
    key = tensor_state(t)
    assert key == tensor_state(t)
    assert key != tensor_state(t.clone())  # other object, equal values
    t.add_(0)  # in place: version bump
    assert key != tensor_state(t)
    assert tensor_state(None) == ()
    assert IdentityRef(t) == IdentityRef(t) and IdentityRef(t) != IdentityRef(t.clone())


def test_parameters_state_sees_assignment_and_in_place_edits() -> None:
    lin = nn.Linear(4, 4)
    key = parameters_state([lin])
    assert key == parameters_state([lin])
    with torch.no_grad():
        lin.weight.mul_(2)
    key2 = parameters_state([lin])
    assert key2 != key
    lin.bias = nn.Parameter(torch.zeros(4))
    assert parameters_state([lin]) != key2


def test_alignment() -> None:
    assert alignment(torch.empty(0)) == 256
    t = torch.zeros(64)
    assert alignment(t) >= 16
    assert alignment(t[1:]) == 4


def test_content_versions_for_inference_tensors() -> None:
    versions = ContentVersions(max_tracked=2)
    normal = torch.zeros(3)
    assert versions.version(normal) == normal._version
    with torch.inference_mode():
        frozen = torch.zeros(3)
    v1 = versions.version(frozen)
    assert versions.version(frozen) == v1
    with torch.inference_mode():
        frozen.add_(1)
    v2 = versions.version(frozen)
    assert v2 != v1
    assert versions.version(frozen) == v2
    versions.clear()
    assert versions.version(frozen) != v2


def test_cache_hit_miss_and_invalidation() -> None:
    cache = StaticKVCache(max_requests=2)
    k, v = torch.randn(2, 3), torch.randn(2, 3)
    cond = torch.randn(5)
    validity = (tensor_state(cond),)
    assert cache.lookup("r1", "slot", validity) == (None, MISS)
    cache.store("r1", "slot", validity, (k, v))
    tensors, status = cache.lookup("r1", "slot", validity)
    assert status == HIT and tensors[0] is k and tensors[1] is v
    assert cache.lookup("r2", "slot", validity) == (None, MISS)  # requests do not share entries
    cond.mul_(1.0)  # same values, new version: invalidated
    assert cache.lookup("r1", "slot", (tensor_state(cond),)) == (None, INVALIDATED)
    assert cache.lookup("r1", "slot", (tensor_state(cond),)) == (None, MISS)  # dropped


def test_cached_tensors_edited_in_place_are_not_served() -> None:
    cache = StaticKVCache()
    k = torch.randn(2)
    cache.store("r", "s", (), (k,))
    k.add_(1)
    assert cache.lookup("r", "s", ()) == (None, INVALIDATED)


def test_requests_are_dropped_and_bounded() -> None:
    cache = StaticKVCache(max_requests=2)
    for rid in ("a", "b", "c"):
        cache.store(rid, "s", (), (torch.zeros(4),))
    assert cache.evicted_requests == 1 and cache.entries() == 2
    assert cache.lookup("a", "s", ())[1] == MISS
    assert cache.entries("b") == 1 and cache.nbytes() == 2 * 16
    assert cache.drop_request("b") == 1 and cache.drop_request("b") == 0
    cache.clear()
    assert cache.entries() == 0
    with pytest.raises(ValueError):
        StaticKVCache(max_requests=0)
