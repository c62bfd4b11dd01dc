"""Generations of groups of Linears: bumped by replacement, in-place edits, moves and casts; not otherwise."""

from __future__ import annotations

import torch
import torch.nn as nn

from worldfoundry.core.attention.source_watch import LinearSourceWatch, linears_state
from worldfoundry.core.attention.static_kv_cache import CacheEntry, StaticKVCache


def _groups() -> list[list[nn.Linear]]:
    torch.manual_seed(0)
    return [[nn.Linear(4, 4), nn.Linear(4, 4)], [nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)]]


def test_nothing_changed_keeps_every_generation() -> None:
    groups = _groups()
    watch = LinearSourceWatch(groups)
    assert watch.generations() == [0, 0]
    assert watch.generations() == [0, 0]
    assert linears_state(groups[0]) == linears_state(groups[0])


def test_each_kind_of_change_bumps_only_its_group() -> None:
    groups = _groups()
    watch = LinearSourceWatch(groups)
    with torch.no_grad():
        groups[0][1].weight.add_(1.0)  # in place: version counter
    assert watch.generations() == [1, 0]
    groups[1][0].weight = nn.Parameter(groups[1][0].weight.detach().clone())  # replaced
    assert watch.generations() == [1, 1]
    groups[0][0].to(torch.float64)  # cast: new data pointer
    assert watch.generations() == [2, 1]
    groups[1][1].bias = nn.Parameter(torch.zeros(4))  # a bias appears
    assert watch.generations() == [2, 2]
    assert watch.generations() == [2, 2]


def test_inference_tensor_parameters_are_compared_by_full_key() -> None:
    with torch.inference_mode():
        lin = nn.Linear(4, 4)
    watch = LinearSourceWatch([[lin]])
    assert watch.generations() == [0]
    lin.weight = nn.Parameter(torch.zeros(4, 4))
    assert watch.generations() == [1]


def test_request_entries_is_the_live_dict_of_the_request() -> None:
    cache = StaticKVCache(max_requests=2)
    entries = cache.request_entries("a")
    k = torch.zeros(2)
    entries["s"] = CacheEntry.of((1,), (k,))
    assert cache.entries("a") == 1 and cache.lookup("a", "s", (1,))[0][0] is k
    assert entries["s"].untouched()
    k.add_(1)
    assert not entries["s"].untouched()
    cache.request_entries("b")
    cache.request_entries("c")  # evicts "a": its dict is detached
    assert cache.entries("a") == 0 and cache.evicted_requests == 1
    assert cache.drop_request("b") == 0
