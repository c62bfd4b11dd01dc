"""Which groups of Linears had a weight change since the last look, checked once per model forward.

A derived tensor (a packed weight copy, cached keys/values) is stale when any Parameter it was computed from was
replaced, edited in place (version counter), moved or cast (data pointer). :func:`linears_state` is that key for a
group of Linears. :class:`LinearSourceWatch` keeps one *generation* number per group and bumps it when the group's
key changes. Its :meth:`~LinearSourceWatch.generations` is meant to run once per model forward: the usual case
(nothing changed) is three C-level loops over flat lists — identities, version counters and data pointers of every
weight and bias — with no per-group Python work, so a model with dozens of groups pays a few microseconds.

Writes through ``param.data`` keep the pointer and bypass the version counter; like every fingerprint here they
are not seen (reinstall after such edits).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch.nn as nn

from worldfoundry.core.attention.fingerprints import tensor_state

_PARAM_NAMES = ("weight", "bias")
_version = operator.attrgetter("_version")
_data_ptr = operator.methodcaller("data_ptr")


def linears_state(modules: Sequence[nn.Module]) -> tuple[Any, ...]:
    """Identity/version/pointer/dtype/device/shape key of the weight and bias of every module, in order."""
    return tuple((tensor_state(m._parameters.get("weight")), tensor_state(m._parameters.get("bias")))
                 for m in modules)


class LinearSourceWatch:
    """Generation numbers of groups of Linears; a group's number grows whenever :func:`linears_state` changes.

    Args:
        groups: each group's modules (e.g. ``(to_k, to_v)`` of every cross-attention).
    """

    def __init__(self, groups: Sequence[Sequence[nn.Module]]) -> None:
        self._groups = [tuple(g) for g in groups]
        self._dicts = [m._parameters for g in self._groups for m in g for _ in _PARAM_NAMES]
        self._names = [n for g in self._groups for _m in g for n in _PARAM_NAMES]
        self._states = [linears_state(g) for g in self._groups]
        self.gens = [0] * len(self._groups)
        self._remember()

    def _remember(self) -> None:
        self._params = list(map(dict.get, self._dicts, self._names))
        self._tensors = [p for p in self._params if p is not None]
        self._versions = self._read_versions()
        self._ptrs = list(map(_data_ptr, self._tensors))

    def _read_versions(self) -> list[int] | None:
        try:
            return list(map(_version, self._tensors))
        except RuntimeError:  # inference tensors have no version counter: compare the full keys every time
            return None

    def generations(self) -> list[int]:
        """The current generation of every group (the list is updated in place and returned)."""
        current = list(map(dict.get, self._dicts, self._names))
        if (self._versions is not None and all(map(operator.is_, current, self._params))
                and self._read_versions() == self._versions
                and list(map(_data_ptr, self._tensors)) == self._ptrs):
            return self.gens
        for i, group in enumerate(self._groups):
            state = linears_state(group)
            if state != self._states[i]:
                self._states[i] = state
                self.gens[i] += 1
        self._remember()
        return self.gens


__all__ = ["LinearSourceWatch", "linears_state"]
