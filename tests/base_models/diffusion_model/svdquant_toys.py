"""Toy models of the SVDQuant calibration tests: residual blocks, each with one ``ffn`` Linear."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

WIDTH = 128


class ResidualBlock(nn.Module):
    """``x + act(W x + b)`` (``act`` the identity when ``None``)."""

    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.ffn = nn.Linear(WIDTH, WIDTH)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ffn(x)
        return x + (y if self.act is None else self.act(y))


def residual_blocks(n: int, std: float, act: Callable[[torch.Tensor], torch.Tensor] | None = None) -> nn.Module:
    """``n`` seeded blocks (weights ``N(0, std)``) in ``model.blocks``, in eval mode; calling the model runs them
    in order."""
    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.ModuleList([ResidualBlock(act) for _ in range(n)])
    with torch.no_grad():
        for block in model.blocks:
            block.ffn.weight.normal_(0.0, std)
    model.eval()

    def forward(x: torch.Tensor) -> torch.Tensor:
        for block in model.blocks:
            x = block(x)
        return x

    model.forward = forward
    return model
