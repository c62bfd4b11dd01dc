"""dtype policy: cast a module to a compute dtype while keeping diffusers' fp32 modules in fp32."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn


def keep_in_fp32_names(model: nn.Module) -> tuple[str, ...]:
    return tuple(getattr(model, "_keep_in_fp32_modules", None) or ())


def apply_dtype_policy(model: nn.Module, dtype: torch.dtype, keep_fp32: Iterable[str] | None = None) -> nn.Module:
    """Cast floating parameters and buffers to ``dtype`` except those whose dotted name contains one of
    ``keep_fp32`` as a component (the rule diffusers' ``from_pretrained`` applies to
    ``_keep_in_fp32_modules``), which become float32. Returns ``model``."""
    keep = tuple(keep_fp32) if keep_fp32 is not None else keep_in_fp32_names(model)
    with torch.no_grad():
        for module_name, module in model.named_modules():
            for kind in ("_parameters", "_buffers"):
                for name, tensor in list(getattr(module, kind).items()):
                    if tensor is None or not tensor.is_floating_point():
                        continue
                    full = f"{module_name}.{name}" if module_name else name
                    target = torch.float32 if any(k in full.split(".") for k in keep) else dtype
                    if tensor.dtype != target:
                        new = tensor.to(target)
                        if kind == "_parameters":
                            module._parameters[name] = nn.Parameter(new, requires_grad=tensor.requires_grad)
                        else:
                            module._buffers[name] = new
    return model


def module_dtype_summary(model: nn.Module) -> dict[str, int]:
    """Parameter count per dtype name (for reports)."""
    out: dict[str, int] = {}
    for p in model.parameters():
        key = str(p.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + p.numel()
    return out
