"""Frozen, validated options of ``wan_block_fusion`` and ``sana_block_fusion``.

Spec::

    {"wan_block_fusion": {"chains": ["modulate", "gated_residual", "cross_residual", "rope", "qk_norm", "layer_norm"],
                          "min_tokens": 0, "blocks": null}}
    {"wan_block_fusion": {"chains": ["modulate", "gated_residual", "cross_residual", "rope", "float_carry"]}}
    {"sana_block_fusion": {"chains": ["modulate", "gated_residual", "cross_residual", "linear_attention", "glu"]}}
    {"wan_block_fusion": {"kernel_compile": "blocking"}}

Example:
    >>> WanOptions.from_mapping({"chains": ["rope"]}).chains
    ('rope',)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Final

from worldfoundry.plugin import OptionValueError, PluginOptions, choice, integer, option, optional, sequence_of

WAN_NAME: Final = "wan_block_fusion"
SANA_NAME: Final = "sana_block_fusion"

#: Wan chains: ``modulate`` (norm1/norm3 output x (1 + scale) + shift and the cast, the modulation-table add and
#: split folded in), ``gated_residual`` (``(x.float() + y * gate).type_as(x)`` after self-attention and FFN),
#: ``cross_residual`` (``x + cross_attention(x)``), ``rope`` (Q/K rotary after the across-heads RMSNorm, one launch
#: for both), ``float_carry`` (the residual kernels also write the float32 stream the next LayerNorm reads, so the
#: eager ``hidden_states.float()`` casts do not run), ``layer_norm`` (``norm1``/``norm3`` and their
#: modulation as one kernel, ``norm2`` and its cast as one kernel, reproducing PyTorch's CUDA LayerNorm bitwise --
#: :mod:`worldfoundry.core.fusion.layer_norm`; it reads the stream itself, so ``float_carry`` has nothing to do
#: beside it and is not used), ``qk_norm`` (``norm_q``/``norm_k``, the across-heads RMSNorms of self-attention, inside
#: the rotary launch, reproducing PyTorch's CUDA RMSNorm bitwise -- :mod:`worldfoundry.core.fusion.qk_norm_rope`;
#: needs ``rope``; on the CPU, whose RMSNorm is another algorithm, it falls back visibly).
WAN_CHAINS: Final = ("modulate", "gated_residual", "cross_residual", "rope", "float_carry", "layer_norm", "qk_norm")
#: The chains a spec without ``chains`` fuses: all but ``float_carry``, which has nothing to do beside ``layer_norm``
#: (it is the float32 stream's fallback for a spec without ``layer_norm``; see ``docs/block_fusion.md``).
WAN_DEFAULT_CHAINS: Final = ("modulate", "gated_residual", "cross_residual", "rope", "qk_norm", "layer_norm")
#: SANA-Video chains: ``modulate``, ``gated_residual``, ``cross_residual`` as for Wan (rounded per operation, as
#: eager's bfloat16 arithmetic), ``linear_attention`` (ReLU + rotary + float casts of Q/K/V, and the final
#: ``hidden * (1 / (t + 1e-15))`` with the cast, of the linear self-attention processor), ``glu`` (the
#: feed-forward's gated SiLU ``h * silu(gate)`` over the two halves of the depthwise convolution's output).
SANA_CHAINS: Final = ("modulate", "gated_residual", "cross_residual", "linear_attention", "glu")
#: ``kernel_compile``: when the kernels compile -- ``blocking`` (the first fused call waits), ``background`` (the
#: original forward runs until they are ready, counted as fallbacks), ``auto`` (the process default,
#: ``background`` unless :func:`worldfoundry.core.fusion.compile_pool.set_default_compile_mode` changed it).
KERNEL_COMPILE_MODES: Final = ("auto", "background", "blocking")


@dataclass(frozen=True)
class WanOptions(PluginOptions):
    """Options of ``wan_block_fusion``.

    Attributes:
        chains: which chains run fused (default: all but ``float_carry``, see :data:`WAN_DEFAULT_CHAINS`); the others
            run as eager's torch operations.
        min_tokens: blocks called with fewer tokens per sample run the original forward (counted as fallbacks).
        blocks: indices of the blocks to fuse (default: every block).
        kernel_compile: ``auto``, ``background`` or ``blocking`` (see :data:`KERNEL_COMPILE_MODES`).
    """

    plugin_name: ClassVar[str] = WAN_NAME
    known_chains: ClassVar[tuple[str, ...]] = WAN_CHAINS

    chains: tuple[str, ...] = option(WAN_DEFAULT_CHAINS, sequence_of(choice(*WAN_CHAINS), min_items=1, unique=True))
    min_tokens: int = option(0, integer(min=0, max=2**40))
    blocks: tuple[int, ...] | None = option(None, optional(sequence_of(integer(min=0, max=100_000), min_items=1,
                                                                       unique=True)))
    kernel_compile: str = option("auto", choice(*KERNEL_COMPILE_MODES))

    def validate(self) -> None:
        if "qk_norm" in self.chains and "rope" not in self.chains:
            raise OptionValueError("chains", "qk_norm needs rope (the norms run inside the rotary launch)")
        if "float_carry" in self.chains and not {"gated_residual", "cross_residual"} & set(self.chains):
            raise OptionValueError("chains", "float_carry needs gated_residual or cross_residual (the kernels that "
                                             "write the float32 stream)")


@dataclass(frozen=True)
class SanaOptions(PluginOptions):
    """Options of ``sana_block_fusion`` (fields as :class:`WanOptions`)."""

    plugin_name: ClassVar[str] = SANA_NAME
    known_chains: ClassVar[tuple[str, ...]] = SANA_CHAINS

    chains: tuple[str, ...] = option(SANA_CHAINS, sequence_of(choice(*SANA_CHAINS), min_items=1, unique=True))
    min_tokens: int = option(0, integer(min=0, max=2**40))
    blocks: tuple[int, ...] | None = option(None, optional(sequence_of(integer(min=0, max=100_000), min_items=1,
                                                                       unique=True)))
    kernel_compile: str = option("auto", choice(*KERNEL_COMPILE_MODES))


__all__ = ["KERNEL_COMPILE_MODES", "SANA_CHAINS", "SANA_NAME", "WAN_CHAINS", "WAN_DEFAULT_CHAINS", "WAN_NAME",
           "SanaOptions", "WanOptions"]
