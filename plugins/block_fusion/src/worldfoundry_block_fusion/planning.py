"""Prepare-time selection and checks shared by ``wan_block_fusion`` and ``sana_block_fusion`` (read-only), and the
recorded activation (block forwards wrapped, self-attention processors replaced)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from worldfoundry.core.acceleration.patching import patch_names
from worldfoundry.core.fusion.launch import warm_compiler
from worldfoundry.core.fusion.triton_support import TRITON_AVAILABLE, interpreter_enabled
from worldfoundry.errors import AccelerationOptionsError, AccelerationRefusedError
from worldfoundry.plugin import (
    ExecutionLedger,
    PatchRecorder,
    PluginOptions,
    family_of,
    refuse_common,
    refuse_module_hooks,
)
from worldfoundry_block_fusion.handle import BlockFusionHandle, FusionCounters
from worldfoundry_block_fusion.kernel_warmup import KernelWarmup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockPlan:
    """What one plugin instance will change: the blocks and (when a processor chain is on) their ``attn1``."""

    name: str
    family: str
    blocks: tuple[tuple[str, nn.Module], ...]
    replace_processor: bool
    #: the blocks' feed-forward forwards are replaced too (SANA-Video's ``glu`` chain)
    replace_ff: bool = False

    def claims(self) -> frozenset[str]:
        return frozenset(path for path, _ in self.blocks)


def plan_blocks(model: nn.Module, opts: PluginOptions, *, name: str, family: str, block_class: type,
                processor_class: type, replace_processor: bool, ff_class: type | None = None) -> BlockPlan:
    """Select and check the blocks ``opts`` asks for; change nothing.

    Args:
        ff_class: when given, every block's ``ff`` must be exactly this class (its forward is replaced).

    Raises:
        AccelerationRefusedError: another model family; compiled / CUDA-graph / sequence-parallel / hooked /
            training model; a block of another class, with a replaced forward or forward hooks; a self-attention
            processor that is not diffusers' stock one (when the processor is replaced); a feed-forward of
            another class, with a replaced forward, hooks or a nonlinearity that is not ``nn.SiLU`` (when
            ``ff_class`` is given).
        AccelerationOptionsError: a block index the model does not have.
    """
    fam = family_of(model, plugin=name)
    if fam.name != family:
        raise AccelerationRefusedError(name, f"{name} fuses {family} blocks; this model is {fam.name}"
                                             f"{' (use wan_block_fusion)' if fam.name == 'wan' else ''}"
                                             f"{' (use sana_block_fusion)' if fam.name == 'sana_video' else ''}")
    refuse_common(model, name)
    blocks = fam.blocks(model)
    indices = opts.blocks if opts.blocks is not None else tuple(range(len(blocks)))
    missing = [i for i in indices if i >= len(blocks)]
    if missing:
        raise AccelerationOptionsError(name, f"blocks: the model has {len(blocks)} blocks, no index {missing}",
                                       path="blocks")
    chosen = tuple(blocks[i] for i in sorted(indices))
    for path, block in chosen:
        if type(block) is not block_class:
            raise AccelerationRefusedError(name, f"{path} is a {type(block).__name__}, not diffusers' "
                                                 f"{block_class.__name__} whose forward {name} reproduces")
        if "forward" in vars(block):
            owners = patch_names(vars(block)["forward"]) or ["an unknown wrapper"]
            raise AccelerationRefusedError(name, f"{path}.forward is already replaced (by {', '.join(owners)}); "
                                                 "remove that first")
        named = [(path, block)]
        if replace_processor:
            attn = block.attn1
            if type(attn.processor) is not processor_class:
                raise AccelerationRefusedError(
                    name, f"{path}.attn1 uses the custom attention processor {type(attn.processor).__name__}; "
                          f"{name} replaces only {processor_class.__name__} (restore it, or drop the processor chain)")
            named.append((f"{path}.attn1", attn))
        if ff_class is not None:
            named.extend(_check_ff(block, path, ff_class, name))
        refuse_module_hooks(named, name)
    return BlockPlan(name, family, chosen, replace_processor, replace_ff=ff_class is not None)


def _check_ff(block: nn.Module, path: str, ff_class: type, name: str) -> list[tuple[str, nn.Module]]:
    """Refuse a feed-forward whose forward cannot be replaced; returns it and its nonlinearity (hooks checked)."""
    ff = getattr(block, "ff", None)
    if type(ff) is not ff_class:
        raise AccelerationRefusedError(name, f"{path}.ff is a {type(ff).__name__}, not diffusers' "
                                             f"{ff_class.__name__} whose forward the glu chain reproduces "
                                             "(drop the glu chain)")
    if "forward" in vars(ff):
        owners = patch_names(vars(ff)["forward"]) or ["an unknown wrapper"]
        raise AccelerationRefusedError(name, f"{path}.ff.forward is already replaced (by {', '.join(owners)}); "
                                             "remove that first, or drop the glu chain")
    if type(ff.nonlinearity) is not nn.SiLU:
        raise AccelerationRefusedError(name, f"{path}.ff.nonlinearity is a {type(ff.nonlinearity).__name__}, not "
                                             "nn.SiLU (drop the glu chain)")
    return [(f"{path}.ff", ff), (f"{path}.ff.nonlinearity", ff.nonlinearity)]


def kernel_note() -> str:
    """Where the kernels will run, for the install receipt."""
    if not TRITON_AVAILABLE:
        return "triton is not importable: every call falls back to the eager operations (counted with the reason)"
    if interpreter_enabled():
        return "TRITON_INTERPRET=1: CPU tensors run the kernels in Triton's interpreter (slow; for tests)"
    return "kernels run on CUDA tensors; CPU calls fall back to the eager operations (counted with the reason)"


def activate_plan(plan: BlockPlan, opts: PluginOptions, runtime_factory: Callable[[FusionCounters], Any]
                  ) -> BlockFusionHandle:
    """Wrap every planned block's forward (and replace its ``attn1`` processor, wrap its ``ff`` forward);
    undone on failure part-way."""
    counters = FusionCounters(ExecutionLedger(plan.name))
    runtime = runtime_factory(counters)
    runtime.kernels = KernelWarmup(getattr(opts, "kernel_compile", "auto"))
    if torch.cuda.is_available():  # the kernels will compile: prepare Triton's compiler in the background
        warm_compiler()
    handle = BlockFusionHandle(plan.name, counters, chains=tuple(opts.chains), blocks=[p for p, _ in plan.blocks],
                               notes={"min_tokens": opts.min_tokens, "kernels": kernel_note()},
                               kernels=runtime.kernels)
    with PatchRecorder(plan.name) as recorder:
        for path, block in plan.blocks:
            recorder.wrap_forward(block, runtime.make_block_forward(block, path), name=plan.name)
            if plan.replace_processor:
                attn = block.attn1
                recorder.setattr(attn, "processor", runtime.make_processor(attn.processor, path))
            if plan.replace_ff:
                recorder.wrap_forward(block.ff, runtime.make_ff_forward(block.ff, path), name=plan.name)
        handle.patches = recorder.pop_all()
    logger.debug("%s active on %d block(s)", plan.name, len(plan.blocks))
    return handle


__all__ = ["BlockPlan", "activate_plan", "kernel_note", "plan_blocks"]
