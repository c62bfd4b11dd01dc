"""Entry point of ``resident_blocks``: validate (prepare) and activate.

Spec: ``{"resident_blocks": {"offload_resident_blocks": 3, "cpu_offload_block_contiguous": false}}`` or
``{"resident_blocks": {"config": "save_results/resident_blocks_config.json"}}`` (the estimator's output).

Scope: one device (CUDA, or the CPU in emulated mode), eager (no torch.compile, CUDA graph or sequence
parallelism), inference mode, no diffusers hooks, no feature cache (``role:feature_cache``). Claims
``role:offload`` and every block path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

import worldfoundry
from worldfoundry.base_models.diffusion_model.optimizations.refusals import refuse_accelerate_hooks
from worldfoundry.plugin import (
    ROLE_FEATURE_CACHE,
    ROLE_OFFLOAD,
    AccelerationRefusedError,
    PreparedAcceleration,
    RuntimePolicy,
    family_of,
    refuse_common,
)
from worldfoundry_resident_blocks.handle import (
    ResidentBlocksHandle,
    activate_resident_blocks,
)
from worldfoundry_resident_blocks.options import NAME, Options


def model_device(model: nn.Module) -> torch.device:
    """The one device holding every parameter and buffer of ``model``.

    Raises:
        AccelerationRefusedError: several devices, no tensors, or a device other than cpu/cuda.
    """
    devices = {t.device for t in model.parameters()} | {t.device for t in model.buffers()}
    if not devices:
        raise AccelerationRefusedError(NAME, "the model has no parameters")
    if len(devices) > 1:
        raise AccelerationRefusedError(
            NAME, f"the model spans several devices ({', '.join(sorted(map(str, devices)))}); "
                  "resident_blocks runs on a single device"
        )
    device = next(iter(devices))
    if device.type not in ("cuda", "cpu"):
        raise AccelerationRefusedError(NAME, f"device {device} is not supported (cuda, or cpu in emulated mode)")
    return device


def check_blocks(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> None:
    """Refuse blocks whose weights cannot be swapped exactly.

    Raises:
        AccelerationRefusedError: forward hooks on a block, a block without parameters, a parameter shared
            with another block or with the rest of the model, or a non-contiguous parameter.
    """
    block_ids: dict[int, str] = {}
    for path, block in blocks:
        if block._forward_hooks or block._forward_pre_hooks:
            raise AccelerationRefusedError(
                NAME, f"{path} has forward hooks; they would run while the block's weights are on the host"
            )
        params = list(block.named_parameters(remove_duplicate=False))
        if not params:
            raise AccelerationRefusedError(NAME, f"{path} has no parameters to offload")
        for name, p in params:
            other = block_ids.get(id(p))
            if other is not None and other != path:
                raise AccelerationRefusedError(NAME, f"{path}.{name} is shared with {other} (tied weights)")
            block_ids[id(p)] = path
            if not p.is_contiguous():
                raise AccelerationRefusedError(NAME, f"{path}.{name} is not contiguous")
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = block_ids.get(id(p))
        if owner is not None and not (name == owner or name.startswith(owner + ".")):
            raise AccelerationRefusedError(NAME, f"{name} shares its tensor with {owner} (tied weights)")


def prepare(model: nn.Module, options: Mapping[str, Any], policy: RuntimePolicy) -> PreparedAcceleration:
    """Validate options and the model; mutates nothing.

    Raises:
        AccelerationOptionsError: bad options (also an r larger than the number of blocks).
        AccelerationRefusedError: the model is out of scope (named reason).
    """
    opts = Options.from_mapping(options)
    refuse_common(model, NAME)
    refuse_accelerate_hooks(model, NAME)
    family = family_of(model, plugin=NAME)
    blocks = family.blocks(model)
    if not blocks:
        raise AccelerationRefusedError(NAME, "the model has no transformer blocks")
    indices = opts.resolve_indices(len(blocks))
    device = model_device(model)
    check_blocks(model, blocks)
    emulated = device.type == "cpu"

    def activate() -> ResidentBlocksHandle:
        return activate_resident_blocks(model, blocks, indices, contiguous=opts.cpu_offload_block_contiguous,
                                        device=device)

    resolved = opts.to_json()
    resolved["resident_block_indices"] = list(indices)
    resolved["num_blocks"] = len(blocks)
    notes = [
        f"{len(indices)} of {len(blocks)} blocks resident per request {list(indices)}; "
        f"{len(blocks) - len(indices)} streamed through two slots",
        f"layout {'contiguous slab' if opts.cpu_offload_block_contiguous else 'per tensor'}",
    ]
    if emulated:
        notes.append("emulated mode: cpu is host and device, events emulated")
    return PreparedAcceleration(
        name=NAME,
        claims=frozenset({ROLE_OFFLOAD} | {path for path, _ in blocks}),
        activate=activate,
        incompatible_with=frozenset({ROLE_FEATURE_CACHE}),
        options=resolved,
        exact=True,
        notes=tuple(notes),
    )


@worldfoundry.hookimpl
def register_diffusion_accelerations(register: Any) -> None:
    """Register ``resident_blocks``."""
    register(NAME, prepare, options=Options)
