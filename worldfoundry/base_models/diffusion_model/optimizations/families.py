"""Model-family knowledge: where the blocks, attention modules, projections and FFNs are.

Plugins ask this module what to touch instead of hard-coding diffusers module names. Supported families:

* ``wan`` — :class:`diffusers.WanTransformer3DModel` (Wan 2.1 / 2.2): ``blocks.{i}.attn1`` (self),
  ``blocks.{i}.attn2`` (cross, optional image K/V ``add_k_proj``/``add_v_proj``), ``blocks.{i}.ffn.net.0.proj``
  and ``blocks.{i}.ffn.net.2``.
* ``sana_video`` — :class:`diffusers.SanaVideoTransformer3DModel`: ``transformer_blocks.{i}.attn1`` (linear
  self-attention), ``transformer_blocks.{i}.attn2`` (softmax cross-attention), FFN is a conv GLU
  (``ff.conv_inverted`` / ``ff.conv_depth`` / ``ff.conv_point``), no Linear FFN.
* ``minimax_h3`` — :class:`diffusers.MiniMaxH3Transformer3DModel`: ``transformer_blocks.{i}.attn`` (self only),
  ``transformer_blocks.{i}.ff.net.0.proj`` / ``ff.net.2`` (SwiGLU); token refiner blocks under
  ``token_refiner.refiner_blocks.{j}``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import torch.nn as nn

from worldfoundry.errors import AccelerationRefusedError


@dataclass(frozen=True)
class AttentionSite:
    """One attention module inside a block.

    Attributes:
        path: module path relative to the model (``"blocks.3.attn2"``).
        kind: ``"self"`` or ``"cross"``.
        softmax: ``False`` for linear attention (SANA-Video self-attention).
        image_kv: the cross-attention has separate image K/V projections (Wan I2V).
    """

    path: str
    module: nn.Module
    kind: str
    softmax: bool = True
    image_kv: bool = False

    def projection(self, name: str) -> nn.Module | None:
        if name == "to_out":
            out = getattr(self.module, "to_out", None)
            return out[0] if out is not None else None
        return getattr(self.module, name, None)

    def projection_path(self, name: str) -> str:
        return f"{self.path}.to_out.0" if name == "to_out" else f"{self.path}.{name}"


@dataclass(frozen=True)
class ModelFamily:
    name: str
    blocks_attribute: str
    attention_names: tuple[tuple[str, str], ...]  # (attribute in block, kind)
    ffn_linear_names: tuple[str, ...]  # Linear paths inside a block
    linear_self_attention: bool = False
    refiner_blocks_attribute: str | None = None

    def blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        container = getattr(model, self.blocks_attribute)
        return [(f"{self.blocks_attribute}.{i}", block) for i, block in enumerate(container)]

    def attention_sites(self, model: nn.Module, kinds: tuple[str, ...] = ("self", "cross")) -> list[AttentionSite]:
        sites = []
        for block_path, block in self.blocks(model):
            for attr, kind in self.attention_names:
                if kind not in kinds:
                    continue
                module = getattr(block, attr, None)
                if module is None:
                    continue
                softmax = not (kind == "self" and self.linear_self_attention)
                image_kv = kind == "cross" and getattr(module, "add_k_proj", None) is not None
                sites.append(AttentionSite(f"{block_path}.{attr}", module, kind, softmax, image_kv))
        return sites

    def ffn_linears(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        out = []
        for block_path, block in self.blocks(model):
            for rel in self.ffn_linear_names:
                module = block.get_submodule(rel)
                out.append((f"{block_path}.{rel}", module))
        return out


WAN: Final = ModelFamily(
    name="wan",
    blocks_attribute="blocks",
    attention_names=(("attn1", "self"), ("attn2", "cross")),
    ffn_linear_names=("ffn.net.0.proj", "ffn.net.2"),
)
SANA_VIDEO: Final = ModelFamily(
    name="sana_video",
    blocks_attribute="transformer_blocks",
    attention_names=(("attn1", "self"), ("attn2", "cross")),
    ffn_linear_names=(),
    linear_self_attention=True,
)
MINIMAX_H3: Final = ModelFamily(
    name="minimax_h3",
    blocks_attribute="transformer_blocks",
    attention_names=(("attn", "self"),),
    ffn_linear_names=("ff.net.0.proj", "ff.net.2"),
    refiner_blocks_attribute="token_refiner.refiner_blocks",
)

_BY_CLASS: Final[dict[str, ModelFamily]] = {
    "WanTransformer3DModel": WAN,
    "SanaVideoTransformer3DModel": SANA_VIDEO,
    "MiniMaxH3Transformer3DModel": MINIMAX_H3,
}
FAMILIES: Final[dict[str, ModelFamily]] = {f.name: f for f in (WAN, SANA_VIDEO, MINIMAX_H3)}


def family_of(model: nn.Module, *, plugin: str = "worldfoundry") -> ModelFamily:
    """The family of a diffusers DiT (by class, subclasses included).

    Raises:
        AccelerationRefusedError: the model is not a supported DiT.
    """
    for cls in type(model).__mro__:
        family = _BY_CLASS.get(cls.__name__)
        if family is not None:
            return family
    raise AccelerationRefusedError(
        plugin,
        f"model class {type(model).__name__} is not a supported DiT (supported: {', '.join(sorted(_BY_CLASS))})",
    )


def module_path(model: nn.Module) -> Callable[[nn.Module], str]:
    """A lookup ``module -> its dotted path in model`` (``"<root>"`` for the model)."""
    paths = {id(m): (n or "<root>") for n, m in model.named_modules(remove_duplicate=False)}
    return lambda module: paths[id(module)]
