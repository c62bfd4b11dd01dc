"""Which diffusers ``FeedForward`` modules a producer fusion may replace: the structure checks shared by the
plugins that fuse an FFN's GELU into the down projection's activation quantization.

A diffusers ``FeedForward`` is ``net = [GELU(.proj Linear), Dropout, Linear(, Dropout)]``. :func:`plan_ffn_fusion`
lists the FFNs whose up (``net.0.proj``) and down (``net.2``) Linears are both selected and whose structure the
fused forward reproduces (diffusers' ``GELU`` with a supported ``approximate``, plain dropouts, no replaced
forwards, no hooks on the inner modules), and says for every other candidate why not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

import torch
import torch.nn as nn
import torch.nn.modules.module as module_globals

from worldfoundry.core.acceleration.kernels.fp8_gelu_quant import GELU_APPROXIMATIONS
from worldfoundry.core.acceleration.prepared import ROOT_MODULE

UP_SUFFIX: Final = "net.0.proj"
DOWN_SUFFIX: Final = "net.2"
_DROPOUT_TYPES: Final = (nn.Dropout, nn.Identity)


@dataclass(frozen=True)
class FusableFFN:
    """One diffusers ``FeedForward`` whose GELU and down-projection quantization run fused."""

    path: str  # "" for a FeedForward at the root
    ffn: nn.Module
    activation: nn.Module
    dropouts: tuple[nn.Module, ...]
    up_path: str
    down_path: str
    approximate: str

    @property
    def claim(self) -> str:
        """The claim / receipt name of the FFN (``"<root>"`` for the root module)."""
        return self.path or ROOT_MODULE


def _diffusers_classes() -> tuple[type, type] | None:
    try:
        from diffusers.models.activations import GELU
        from diffusers.models.attention import FeedForward
    except ImportError:  # diffusers missing or reorganised: nothing is fused
        return None
    return FeedForward, GELU


def has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _join(prefix: str, suffix: str) -> str:
    return f"{prefix}.{suffix}" if prefix else suffix


def _structure_problem(ffn_path: str, ffn: nn.Module, classes: tuple[type, type] | None) -> str | tuple[Any, ...]:
    """Why ``ffn`` cannot be fused (a string), or ``(activation, dropouts, approximate)``."""
    if classes is None:
        return "diffusers' FeedForward/GELU are not importable"
    feed_forward, gelu = classes
    where = ffn_path or ROOT_MODULE
    if type(ffn) is not feed_forward:
        return f"{where} is a {type(ffn).__name__}, not diffusers' FeedForward"
    if "forward" in ffn.__dict__:
        return f"{where} has a replaced forward"
    net = ffn._modules.get("net")
    if type(net) is not nn.ModuleList or len(net) not in (3, 4):
        return f"{where}.net is not the ModuleList [activation, dropout, linear(, dropout)]"
    activation = net[0]
    if type(activation) is not gelu:
        return f"{where}.net.0 is {type(activation).__name__}; only diffusers' GELU is fused"
    approximate = getattr(activation, "approximate", None)
    if approximate not in GELU_APPROXIMATIONS:
        return f"{where}.net.0 has GELU approximate={approximate!r}; fused: {list(GELU_APPROXIMATIONS)}"
    if "forward" in activation.__dict__ or "gelu" in activation.__dict__:
        return f"{where}.net.0 has a replaced forward/gelu"
    dropouts = tuple(net[i] for i in range(1, len(net)) if i != 2)
    for index, dropout in zip((1, 3), dropouts, strict=False):
        if type(dropout) not in _DROPOUT_TYPES or "forward" in dropout.__dict__:
            return f"{where}.net.{index} is {type(dropout).__name__}; expected a plain Dropout or Identity"
    for index, inner in ((0, activation), *zip((1, 3), dropouts, strict=False)):
        if has_hooks(inner):
            return f"{where}.net.{index} has forward hooks that the fused forward would bypass"
    return activation, dropouts, approximate


def plan_ffn_fusion(model: nn.Module, selected_paths: Iterable[str], *, enabled: bool = True,
                    disabled_reason: str = "fuse_gelu is false") -> tuple[list[FusableFFN], dict[str, str]]:
    """The FFNs whose up (``net.0.proj``) and down (``net.2``) Linears are both selected.

    Args:
        model: the model (read only).
        selected_paths: the selected Linear paths.
        enabled: ``False`` (option ``fuse_gelu: false``) fuses nothing; ``disabled_reason`` is then every
            candidate's reason.

    Returns:
        ``(fusable, not_fused)``: the FFNs to fuse, and for the other candidate FFNs the reason
        (``{ffn path: reason}``). FFNs with only one selected Linear are not candidates.
    """
    selected = set(selected_paths)
    candidates = []
    for path in selected:
        if path == UP_SUFFIX:
            ffn_path = ""
        elif path.endswith("." + UP_SUFFIX):
            ffn_path = path[: -len(UP_SUFFIX) - 1]
        else:
            continue
        if _join(ffn_path, DOWN_SUFFIX) in selected:
            candidates.append(ffn_path)
    fusable: list[FusableFFN] = []
    not_fused: dict[str, str] = {}
    classes = _diffusers_classes() if enabled and candidates else None
    for ffn_path in sorted(candidates):
        if not enabled:
            not_fused[ffn_path or ROOT_MODULE] = disabled_reason
            continue
        ffn = model.get_submodule(ffn_path)
        found = _structure_problem(ffn_path, ffn, classes)
        if isinstance(found, str):
            not_fused[ffn_path or ROOT_MODULE] = found
            continue
        activation, dropouts, approximate = found
        fusable.append(FusableFFN(ffn_path, ffn, activation, dropouts, _join(ffn_path, UP_SUFFIX),
                                  _join(ffn_path, DOWN_SUFFIX), approximate))
    return fusable, not_fused


def global_hooks() -> bool:
    return any(getattr(module_globals, name, None) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_forward_hooks_always_called"))


def skip_messages(prefix: str) -> dict[str, str]:
    """The receipt ``skipped`` keys of a fused FFN call that ran unfused, by cause."""
    return {"arguments": f"{prefix}: extra forward arguments", "hooks": f"{prefix}: forward hooks on inner modules",
            "dropout": f"{prefix}: dropout active", "approximate": f"{prefix}: unsupported GELU approximate"}


class FusedFFNForward:
    """Base of a producer-fused FFN forward: the wrapper and the call-time checks the fusions share.

    A subclass sets ``PREFIX`` (the receipt ``skipped`` keys are :func:`skip_messages` of it) and implements
    :meth:`linears_run` (``False`` when a Linear would not take the plugin's path, which then records why itself)
    and :meth:`run`.
    """

    PREFIX: str = "ffn_fusion"

    def __init__(self, runtime: Any, plan: FusableFFN) -> None:
        self.runtime = runtime
        self.plan = plan
        self.up = runtime.targets[plan.up_path]
        self.down = runtime.targets[plan.down_path]
        self._inner = (plan.activation, *plan.dropouts, self.up.linear, self.down.linear)

    def make_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """The ``make_wrapper`` handed to ``PatchRecorder.wrap_forward`` for the FFN."""

        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            skip = self.skip_reason(hidden_states, args, kwargs)
            if skip is None:
                return self.run(hidden_states)
            if skip:
                self.runtime.ledger.skipped(skip)
            return original(hidden_states, *args, **kwargs)

        return forward

    def skip_reason(self, x: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """``None``: run fused. ``""``: a Linear would not take the plugin's path. Else why this call runs
        unfused although it could."""
        if not self.linears_run(x):
            return ""
        messages = skip_messages(self.PREFIX)
        if args or kwargs:
            return messages["arguments"]
        if any(has_hooks(m) for m in self._inner) or global_hooks():
            return messages["hooks"]
        if any(d.training and getattr(d, "p", 0.0) > 0 for d in self.plan.dropouts):
            return messages["dropout"]
        if getattr(self.plan.activation, "approximate", None) not in GELU_APPROXIMATIONS:
            return messages["approximate"]
        return None

    def linears_run(self, x: torch.Tensor) -> bool:  # pragma: no cover - every subclass overrides it
        raise NotImplementedError

    def run(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - every subclass overrides it
        raise NotImplementedError


def fusion_note(fused: list[FusableFFN] | tuple[FusableFFN, ...], not_fused: dict[str, str], kind: str) -> str:
    """One sentence about the fused GELU producers (receipt ``kind``) and the candidate FFNs left unfused."""
    if not fused and not not_fused:
        return "no FFN has both Linears selected: every selected Linear runs its own activation quantization"
    text = (f"{len(fused)} FFN(s) run GELU + the down projection's activation quantization as one kernel "
            f"(receipt kind '{kind}'); this avoids writing the bfloat16 GELU output (M x inner x 2 bytes "
            "per call) and reading it back; the kernel's GELU is within 2**-8*|gelu| + 2**-20*|x| of the exact "
            "formula but not bitwise torch's (most bf16 values equal), so fusing changes rounding slightly "
            "versus the per-Linear path")
    if not_fused:
        shown = "; ".join(f"{path}: {why}" for path, why in list(not_fused.items())[:4])
        text += f". Not fused ({len(not_fused)}; per-Linear path): {shown}"
    return text


__all__ = ["DOWN_SUFFIX", "UP_SUFFIX", "FusableFFN", "FusedFFNForward", "fusion_note", "skip_messages", "global_hooks", "has_hooks", "plan_ffn_fusion"]
