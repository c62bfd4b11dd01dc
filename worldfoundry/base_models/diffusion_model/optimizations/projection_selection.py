"""Pattern -> Linear selection shared by the plugins that change individual projections (FP8, SVDQuant, ...).

Patterns are matched with :func:`fnmatch.fnmatchcase` against the names ``model.named_modules()`` gives:
``*`` matches any run of characters *including dots*, ``?`` one character, ``[seq]`` one of ``seq``.
Only modules that are exactly :class:`torch.nn.Linear` can be selected; a matched Linear subclass or a Linear
whose ``forward`` was replaced on the instance is refused (the plugin would change code it does not know).

Names per family (``{i}`` is a block index; :func:`linear_name_patterns` lists a model's own names with ``*``
for repeated block indices):

* Wan (``WanTransformer3DModel``): ``blocks.{i}.ffn.net.0.proj`` (FFN up, ``dim -> ffn_dim``),
  ``blocks.{i}.ffn.net.2`` (FFN down), ``blocks.{i}.attn1.to_q|to_k|to_v|to_out.0`` (self-attention),
  ``blocks.{i}.attn2.to_q|to_k|to_v|to_out.0`` (cross-attention; I2V adds ``add_k_proj``/``add_v_proj``).
* SANA-Video (``SanaVideoTransformer3DModel``): no Linear FFN (its FFN is a convolutional GLU,
  ``ff.conv_inverted``/``ff.conv_depth``/``ff.conv_point``); the Linears are
  ``transformer_blocks.{i}.attn1.to_q|to_k|to_v|to_out.0`` (linear self-attention) and
  ``transformer_blocks.{i}.attn2.to_q|to_k|to_v|to_out.0`` (cross-attention).
* MiniMax-H3 (``MiniMaxH3Transformer3DModel``): ``transformer_blocks.{i}.ff.net.0.proj`` / ``ff.net.2``
  (FFN), ``transformer_blocks.{i}.attn.to_q|to_k|to_v|to_out.0``, ``transformer_blocks.{i}.adaln_proj.linear``;
  the token refiner has ``token_refiner.refiner_blocks.{j}.attn.*`` and ``.ff.net.0.proj`` / ``.ff.net.2``.

Example:
    >>> import torch.nn as nn
    >>> model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    >>> [s.path for s in select_linears(model, ["*"], plugin="demo")]
    ['0', '2']
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from worldfoundry.errors import AccelerationRefusedError


@dataclass(frozen=True)
class SelectedLinear:
    """One selected projection: its path in ``model.named_modules()`` and the module."""

    path: str
    module: nn.Linear


def _name_forms(names: Sequence[str]) -> list[str]:
    """Replace a numeric path component by ``*`` where the same name exists with other indices there.

    ``blocks.0.ffn.net.0.proj`` and ``blocks.1.ffn.net.0.proj`` -> ``blocks.*.ffn.net.0.proj`` (``net.0`` stays:
    no other index carries the same suffix). Order of first appearance is kept.
    """
    split = [n.split(".") for n in names]
    variants: dict[tuple[int, tuple[str, ...]], set[str]] = {}
    for parts in split:
        for i, part in enumerate(parts):
            if part.isdigit():
                key = (i, tuple(parts[:i]) + ("*",) + tuple(parts[i + 1:]))
                variants.setdefault(key, set()).add(part)
    forms: dict[str, None] = {}
    for parts in split:
        out = list(parts)
        for i, part in enumerate(parts):
            if part.isdigit():
                key = (i, tuple(parts[:i]) + ("*",) + tuple(parts[i + 1:]))
                if len(variants[key]) > 1:
                    out[i] = "*"
        forms.setdefault(".".join(out), None)
    return list(forms)


def linear_name_patterns(model: nn.Module) -> list[str]:
    """The Linear names of ``model``, with repeated-block indices replaced by ``*`` (model order).

    Args:
        model: any module.

    Returns:
        e.g. ``["blocks.*.attn1.to_q", ..., "blocks.*.ffn.net.0.proj", "blocks.*.ffn.net.2", "proj_out"]``.
    """
    return _name_forms([name for name, module in model.named_modules() if name and isinstance(module, nn.Linear)])


def _near_matches(pattern: str, names: Sequence[str], limit: int = 5) -> list[str]:
    close = difflib.get_close_matches(pattern, _name_forms(names), n=limit, cutoff=0.6)
    if not close:
        close = difflib.get_close_matches(pattern, list(names), n=limit, cutoff=0.5)
    return close


def _describe_miss(model: nn.Module, pattern: str, linear_names: Sequence[str]) -> str:
    others = [
        f"{name} ({type(module).__name__})"
        for name, module in model.named_modules()
        if name and fnmatch.fnmatchcase(name, pattern) and not isinstance(module, nn.Linear)
    ]
    parts = [f"include pattern {pattern!r} matches no nn.Linear"]
    if others:
        parts.append(f"it matches non-Linear modules: {', '.join(others[:4])}{' ...' if len(others) > 4 else ''}")
    near = _near_matches(pattern, linear_names)
    if near:
        parts.append(f"near matches: {', '.join(near)}")
    forms = _name_forms(linear_names)
    if forms:
        shown = ", ".join(forms[:24]) + (" ..." if len(forms) > 24 else "")
        parts.append(f"Linear names in this model look like: {shown}")
    else:
        parts.append("the model has no nn.Linear modules")
    return "; ".join(parts)


def _refuse_unchangeable(model: nn.Module, selected: Sequence[SelectedLinear], *, plugin: str) -> None:
    """Refuse Linear subclasses, Linears with an instance-level ``forward`` and modules reachable under two names.

    Raises:
        AccelerationRefusedError: naming the modules and what to do.
    """
    odd = [f"{s.path} ({type(s.module).__module__}.{type(s.module).__qualname__})"
           for s in selected if type(s.module) is not nn.Linear]
    if odd:
        raise AccelerationRefusedError(
            plugin, f"only plain torch.nn.Linear can be changed; these are Linear subclasses with their own "
            f"behaviour: {', '.join(odd[:6])}{' ...' if len(odd) > 6 else ''}; exclude them"
        )
    custom = [s.path for s in selected if "forward" in s.module.__dict__]
    if custom:
        raise AccelerationRefusedError(
            plugin, f"these Linears have a replaced forward (another patch or wrapper is active): "
            f"{', '.join(custom[:6])}{' ...' if len(custom) > 6 else ''}; remove it or exclude them"
        )
    paths_by_id: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if name:
            paths_by_id.setdefault(id(module), []).append(name)
    shared = [f"{s.path} (also {', '.join(p for p in paths_by_id[id(s.module)] if p != s.path)})"
              for s in selected if len(paths_by_id.get(id(s.module), ())) > 1]
    if shared:
        raise AccelerationRefusedError(
            plugin, f"these Linears are reachable under several names (one module used twice): {', '.join(shared[:4])}"
        )


def select_linears(
    model: nn.Module,
    include: Iterable[str],
    exclude: Iterable[str] = (),
    *,
    plugin: str,
) -> list[SelectedLinear]:
    """Select the plain ``nn.Linear`` modules whose names match ``include`` and no ``exclude`` pattern.

    Args:
        model: the model (read only).
        include: fnmatch patterns; every one must match at least one Linear.
        exclude: fnmatch patterns removed from the selection; every one must match some module name.
        plugin: the plugin name used in errors.

    Returns:
        The selection in ``named_modules()`` order (each module once).

    Raises:
        AccelerationRefusedError: an include pattern matches no Linear (the message lists near matches and the
            model's Linear name forms), an exclude pattern matches nothing, the excludes remove every match,
            a match is a Linear subclass or has an instance-level ``forward``, or one module is reachable
            under two names.
    """
    include = list(include)
    exclude = list(exclude)
    if not include:
        raise AccelerationRefusedError(plugin, "no include patterns given; name the Linear modules to change")
    linears = [(name, m) for name, m in model.named_modules() if name and isinstance(m, nn.Linear)]
    linear_names = [name for name, _ in linears]
    chosen: dict[str, nn.Linear] = {}
    for pattern in include:
        hits = [(n, m) for n, m in linears if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise AccelerationRefusedError(plugin, _describe_miss(model, pattern, linear_names))
        for n, m in hits:
            chosen[n] = m
    all_names = [name for name, _ in model.named_modules() if name]
    for pattern in exclude:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in all_names):
            near = _near_matches(pattern, linear_names)
            hint = f"; near matches: {', '.join(near)}" if near else ""
            raise AccelerationRefusedError(plugin, f"exclude pattern {pattern!r} matches no module{hint}")
    selected = [
        SelectedLinear(n, m) for n, m in linears
        if n in chosen and not any(fnmatch.fnmatchcase(n, p) for p in exclude)
    ]
    if not selected:
        raise AccelerationRefusedError(
            plugin,
            f"the exclude patterns {exclude} remove every Linear matched by {include}; nothing is left to change",
        )
    _refuse_unchangeable(model, selected, plugin=plugin)
    return selected


def refuse_shared_parameters(model: nn.Module, selected: Sequence[SelectedLinear], *, plugin: str) -> None:
    """Refuse when a selected Linear's weight or bias shares storage with any other parameter or buffer.

    Tied or aliased weights would be changed (or guarded) in one place and silently differ in the other.

    Args:
        model: the model (read only).
        selected: the selection.
        plugin: the plugin name used in errors.

    Raises:
        AccelerationRefusedError: naming both tensors of the first shared pair, or a selected weight that
            lives on the ``meta`` device.
    """
    owners: dict[tuple[str, int], list[str]] = {}
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, tensor in tensors:
        if tensor is None or tensor.device.type == "meta":
            continue
        key = (str(tensor.device), tensor.untyped_storage().data_ptr())
        owners.setdefault(key, []).append(name)
    for sel in selected:
        for attr in ("weight", "bias"):
            tensor = getattr(sel.module, attr, None)
            if tensor is None:
                continue
            own = f"{sel.path}.{attr}"
            if tensor.device.type == "meta":
                raise AccelerationRefusedError(plugin, f"{own} is on the meta device; load real weights first")
            key = (str(tensor.device), tensor.untyped_storage().data_ptr())
            others = [n for n in owners.get(key, []) if n != own]
            if others:
                raise AccelerationRefusedError(
                    plugin, f"{own} shares parameter storage with {', '.join(others[:3])} (tied or aliased weights); "
                    "untie them or exclude the module"
                )


def refuse_misaligned(
    selected: Sequence[SelectedLinear], multiple: int, *, plugin: str, why: str = ""
) -> None:
    """Refuse when any selected Linear has ``in_features`` or ``out_features`` not divisible by ``multiple``.

    Args:
        selected: the selection.
        multiple: required divisor (16 for ``torch._scaled_mm``).
        plugin: the plugin name used in errors.
        why: what needs the alignment, appended to the message.

    Raises:
        AccelerationRefusedError: listing every offending module with its dimensions.
    """
    bad = []
    for sel in selected:
        dims = [f"{label}={value}" for label, value in (("in_features", sel.module.in_features),
                                                          ("out_features", sel.module.out_features))
                if value % multiple]
        if dims:
            bad.append(f"{sel.path} ({', '.join(dims)})")
    if bad:
        reason = why or f"dimensions must be multiples of {multiple}"
        raise AccelerationRefusedError(
            plugin, f"{reason}; not divisible by {multiple}: {', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}; "
            "exclude these modules"
        )


__all__ = [
    "SelectedLinear",
    "linear_name_patterns",
    "refuse_misaligned",
    "refuse_shared_parameters",
    "select_linears",
]
