"""Original-checkpoint Linear names accepted in ``include`` patterns, translated to diffusers module names.

Wan's original checkpoints (and the tools around them) call the FFN Linears ``blocks.{i}.ffn.0`` and
``blocks.{i}.ffn.2``; diffusers' ``WanTransformer3DModel`` names them ``blocks.{i}.ffn.net.0.proj`` and
``blocks.{i}.ffn.net.2``. A pattern that matches no module of the model as written and ends in one of the
original suffixes is translated (``blocks.*.ffn.0`` -> ``blocks.*.ffn.net.0.proj``); patterns that match
something are kept as they are.

Example:
    >>> import torch.nn as nn
    >>> translate_patterns(nn.Linear(2, 2), ["blocks.*.ffn.0"], family="wan")
    ('blocks.*.ffn.net.0.proj',)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Final

from torch import nn

#: family -> ((original suffix, diffusers suffix), ...)
ALIASES: Final[dict[str, tuple[tuple[str, str], ...]]] = {
    "wan": ((".ffn.0", ".ffn.net.0.proj"), (".ffn.2", ".ffn.net.2")),
}


def translate_patterns(model: nn.Module, patterns: Iterable[str], *, family: str | None) -> tuple[str, ...]:
    """Translate original-checkpoint suffixes of ``patterns`` that match no module of ``model``.

    Args:
        model: the model (read only).
        patterns: fnmatch patterns over ``model.named_modules()`` names.
        family: the model family name (``"wan"``), or ``None`` (no translation).

    Returns:
        The patterns, translated where needed, in order.
    """
    names = [n for n, _ in model.named_modules() if n]
    out = []
    for pattern in patterns:
        if any(fnmatch.fnmatchcase(n, pattern) for n in names):
            out.append(pattern)
            continue
        for original, diffusers_name in ALIASES.get(family or "", ()):
            if pattern.endswith(original):
                pattern = pattern[: -len(original)] + diffusers_name
                break
        out.append(pattern)
    return tuple(out)


__all__ = ["ALIASES", "translate_patterns"]
