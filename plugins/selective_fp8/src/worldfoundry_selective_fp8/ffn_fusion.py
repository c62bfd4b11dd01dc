"""Producer fusion of ``selective_fp8``: the FFN down projection's GELU and activation quantization in one kernel.

A diffusers ``FeedForward`` is ``net = [GELU(.proj Linear), Dropout, Linear(, Dropout)]``. When both of its
Linears are selected, the FFN's ``forward`` is replaced (through the :class:`PatchRecorder`, undone exactly) by:

.. code-block:: text

    h = FP8 linear of net.0.proj               (activation quant + torch._scaled_mm, bfloat16 out)
    q, scale = fused GELU + rowwise FP8 of h   (one Triton pass over h: no bfloat16 GELU output is written)
    y = torch._scaled_mm(q, W2_fp8) + bias     (net.2)

which removes the dense GELU kernel's write and the quantization kernel's re-read of ``h``. The receipt gets
``fp8_gemm`` for both Linears and ``fp8_gelu_fused`` for the FFN path. The kernel's GELU is within a stated
bound of the exact formula but not bitwise torch's ``F.gelu`` on CUDA, so the fused path rounds slightly
differently from the per-Linear path (see :mod:`~worldfoundry.core.acceleration.kernels.fp8_gelu_quant`); the
install notes say so.

The original ``FeedForward.forward`` runs instead -- each Linear then takes its own per-Linear path and records
its own FP8 call or dense fallback with the reason -- when the call would not run FP8 (CPU, no FP8 tensor
cores, fewer than ``min_tokens`` rows, not bfloat16, autograd), when extra arguments are passed, when a
dropout is active, or when forward hooks sit on the FFN's inner modules (``net.0``, ``net.1``, the Linears, or
global module hooks): the fused forward would bypass them, so that call runs unfused and the receipt counts
``skipped["fp8_gelu_fusion: ..."]`` (likewise when the GELU's ``approximate`` was changed to a form the kernel
does not compute). FFNs whose structure differs (another activation such as SwiGLU, a
replaced forward, hooks on ``net.0``/``net.1`` at install time) are not fused at all; the install receipt's
notes and the execution report say why. Hooks on the FFN itself or its parents keep running either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

import torch
import torch.nn as nn
import torch.nn.modules.module as module_globals

from worldfoundry.core.acceleration.kernels.dispatch import (
    gelu_quantize_activations_rowwise_fp8,
)
from worldfoundry.core.acceleration.kernels.fp8_gelu_quant import GELU_APPROXIMATIONS
from worldfoundry.core.acceleration.quantization.fp8_linear import scaled_mm_rowwise
from worldfoundry.plugin import ROOT_MODULE

#: ``ledger.executed`` kind of one fused FFN call (recorded on the FFN path).
FUSED_KIND: Final = "fp8_gelu_fused"
#: Counter bumped when the fused producer ran the torch reference (GELU + quantization) instead of the kernel.
GELU_REFERENCE_COUNTER: Final = "gelu_quant_torch_reference"
SKIP_HOOKS: Final = "fp8_gelu_fusion: forward hooks on inner modules"
SKIP_DROPOUT: Final = "fp8_gelu_fusion: dropout active"
SKIP_ARGUMENTS: Final = "fp8_gelu_fusion: extra forward arguments"
SKIP_APPROXIMATE: Final = "fp8_gelu_fusion: unsupported GELU approximate"
_UP_SUFFIX: Final = "net.0.proj"
_DOWN_SUFFIX: Final = "net.2"
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


def _has_hooks(module: nn.Module) -> bool:
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
        if _has_hooks(inner):
            return f"{where}.net.{index} has forward hooks that the fused forward would bypass"
    return activation, dropouts, approximate


def plan_ffn_fusion(model: nn.Module, selected_paths: Iterable[str], *, enabled: bool = True
                    ) -> tuple[list[FusableFFN], dict[str, str]]:
    """The FFNs whose up (``net.0.proj``) and down (``net.2``) Linears are both selected.

    Args:
        model: the model (read only).
        selected_paths: the selected Linear paths.
        enabled: ``False`` (option ``fuse_gelu: false``) fuses nothing.

    Returns:
        ``(fusable, not_fused)``: the FFNs to fuse, and for the other candidate FFNs the reason
        (``{ffn path: reason}``). FFNs with only one selected Linear are not candidates.
    """
    selected = set(selected_paths)
    candidates = []
    for path in selected:
        if path == _UP_SUFFIX:
            ffn_path = ""
        elif path.endswith("." + _UP_SUFFIX):
            ffn_path = path[: -len(_UP_SUFFIX) - 1]
        else:
            continue
        if _join(ffn_path, _DOWN_SUFFIX) in selected:
            candidates.append(ffn_path)
    fusable: list[FusableFFN] = []
    not_fused: dict[str, str] = {}
    classes = _diffusers_classes() if enabled and candidates else None
    for ffn_path in sorted(candidates):
        if not enabled:
            not_fused[ffn_path or ROOT_MODULE] = "fuse_gelu is false"
            continue
        ffn = model.get_submodule(ffn_path)
        found = _structure_problem(ffn_path, ffn, classes)
        if isinstance(found, str):
            not_fused[ffn_path or ROOT_MODULE] = found
            continue
        activation, dropouts, approximate = found
        fusable.append(FusableFFN(ffn_path, ffn, activation, dropouts, _join(ffn_path, _UP_SUFFIX),
                                  _join(ffn_path, _DOWN_SUFFIX), approximate))
    return fusable, not_fused


def _global_hooks() -> bool:
    return any(getattr(module_globals, name, None) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_forward_hooks_always_called"))


class FusedFFN:
    """The replacement forward of one :class:`FusableFFN`, sharing the plugin's runtime and ledger."""

    def __init__(self, runtime: Any, plan: FusableFFN) -> None:
        self.runtime = runtime
        self.plan = plan
        self.up = runtime.targets[plan.up_path]
        self.down = runtime.targets[plan.down_path]
        self._inner = (plan.activation, *plan.dropouts, self.up.linear, self.down.linear)

    def make_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """The ``make_wrapper`` handed to :meth:`PatchRecorder.wrap_forward` for the FFN."""

        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            skip = self.skip_reason(hidden_states, args, kwargs)
            if skip is None:
                return self.run(hidden_states)
            if skip:
                self.runtime.ledger.skipped(skip)
            return original(hidden_states, *args, **kwargs)

        return forward

    def skip_reason(self, x: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """``None``: run fused. ``""``: a Linear would not run FP8 (the per-Linear path records why). Else the
        reason this call runs unfused although FP8 could run."""
        runtime = self.runtime
        runtime.guard.verify(self.plan.up_path)
        runtime.guard.verify(self.plan.down_path)
        if runtime.fallback_reason(self.up, x) is not None:
            return ""
        rows = x.numel() // self.up.in_features
        if runtime.call_reason(self.down, x.device, torch.bfloat16, rows, False) is not None:
            return ""
        if args or kwargs:
            return SKIP_ARGUMENTS
        if any(_has_hooks(m) for m in self._inner) or _global_hooks():
            return SKIP_HOOKS
        if any(d.training and getattr(d, "p", 0.0) > 0 for d in self.plan.dropouts):
            return SKIP_DROPOUT
        if getattr(self.plan.activation, "approximate", None) not in GELU_APPROXIMATIONS:
            return SKIP_APPROXIMATE
        return None

    def run(self, x: torch.Tensor) -> torch.Tensor:
        runtime, down = self.runtime, self.down
        lead = x.shape[:-1]
        h = runtime.fp8_matmul(self.up, x.reshape(-1, self.up.in_features))
        rows = gelu_quantize_activations_rowwise_fp8(  # the module's current GELU form (checked in skip_reason)
            h, self.plan.activation.approximate, clip_counter=runtime.clip_counter(down.path, x.device))
        if rows.fallback_reason is not None:
            runtime.ledger.count(GELU_REFERENCE_COUNTER)
        out = scaled_mm_rowwise(rows.q, rows.scale, down.weight, down.linear.bias,
                                out_dtype=torch.bfloat16, use_fast_accum=runtime.options.use_fast_accum)
        runtime.ledger.executed(down.path, runtime.executed_kind)
        runtime.ledger.executed(self.plan.claim, FUSED_KIND)
        return out.reshape(*lead, down.out_features)


__all__ = [
    "FUSED_KIND",
    "GELU_REFERENCE_COUNTER",
    "SKIP_APPROXIMATE",
    "SKIP_ARGUMENTS",
    "SKIP_DROPOUT",
    "SKIP_HOOKS",
    "FusableFFN",
    "FusedFFN",
    "plan_ffn_fusion",
]
