"""The numerics: the tanh-approximated GELU written out, beside the PyTorch reference it replaces."""

from __future__ import annotations

import math
from typing import Final

import torch
import torch.nn.functional as F

_SQRT_2_OVER_PI: Final = math.sqrt(2.0 / math.pi)
_CUBIC: Final = 0.044715


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))``, evaluated in float32.

    Args:
        x: any floating tensor.

    Returns:
        A tensor of ``x``'s shape and dtype. It agrees with :func:`gelu_tanh_reference` to float32
        rounding (not bitwise: the fused PyTorch kernel orders the operations differently).
    """
    xf = x.float()
    inner = _SQRT_2_OVER_PI * (xf + _CUBIC * xf * xf * xf)
    return (0.5 * xf * (1.0 + torch.tanh(inner))).to(x.dtype)


def gelu_tanh_reference(x: torch.Tensor) -> torch.Tensor:
    """PyTorch's own tanh-approximated GELU (what diffusers' ``GELU(approximate="tanh")`` calls)."""
    return F.gelu(x, approximate="tanh")
