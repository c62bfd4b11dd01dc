"""Fused forward of diffusers 0.42's ``GLUMBTempConv`` (the SANA-Video feed-forward): the ``glu`` chain.

Eager::

    x = conv_inverted(x.view(B * F, H, W, C).permute(0, 3, 1, 2)); x = silu(x); x = conv_depth(x)
    x, gate = torch.chunk(x, 2, dim=1)
    x = x * silu(gate)                     # two strided kernels, three passes over the halves
    x = conv_point(x); ... temporal conv, permutes, optional RMSNorm, residual

The fused forward runs the same module calls in the same order and replaces only ``x * silu(gate)`` by one kernel
(:func:`~worldfoundry.core.fusion.glu.silu_gate`: bitwise eager's on CUDA, output strides as eager's). It replaces
the feed-forward's ``forward`` (recorded, undone on uninstall); a call that does not fit (grad mode, another
device, a dtype other than bfloat16/float16/float32, fewer tokens than ``min_tokens``, a nonlinearity that is not
``nn.SiLU`` or has hooks) runs the original forward and is counted as a ``glu`` fallback with its reason.

On the CPU the chain falls back even under Triton's interpreter: the interpreted kernel's ``exp`` is numpy's,
which differs in the last bit from torch's CPU ``exp`` -- the kernel's exactness is CUDA's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import torch
import torch.nn as nn

from worldfoundry.core.acceleration.context import current_request_id
from worldfoundry.core.fusion.glu import GLU_DTYPES, silu_gate, silu_gate_reason
from worldfoundry.core.fusion.triton_support import unavailable_reason
from worldfoundry_block_fusion.eligibility import REASON_GRAD, REASON_TOKENS, no_global_hooks
from worldfoundry_block_fusion.handle import GLU

if TYPE_CHECKING:
    from worldfoundry_block_fusion.sana_block import SanaBlockRuntime

#: Device types the ``glu`` kernel runs on (tests add ``"cpu"`` to exercise the fused path in the interpreter).
KERNEL_DEVICES: list[str] = ["cuda"]
REASON_CPU: Final = ("cpu tensor (the kernel reproduces CUDA's expf; the interpreter's numpy exp differs from "
                     "torch's CPU exp)")
REASON_SHAPE: Final = "hidden_states is not [B, F, H, W, C]"
REASON_SILU: Final = "nonlinearity is not nn.SiLU"
REASON_HOOKS: Final = "forward hooks on the nonlinearity (the fused gate would skip their second call)"


def glu_reason(x: torch.Tensor, ff: nn.Module, min_tokens: int) -> str | None:
    """Why the feed-forward ``ff`` cannot take the fused path on ``x`` (``None`` when it can).

    Args:
        x: the feed-forward's input, ``[B, F, H, W, C]``.
        ff: the ``GLUMBTempConv``.
        min_tokens: the option of that name (tokens per sample: ``F * H * W``).
    """
    if torch.is_grad_enabled():
        return REASON_GRAD
    device = unavailable_reason(x)
    if device is not None:
        return device
    if x.device.type not in KERNEL_DEVICES:
        return REASON_CPU if x.device.type == "cpu" else f"{x.device.type} tensor"
    if x.dtype not in GLU_DTYPES:
        return f"hidden_states dtype {x.dtype} is not bfloat16/float16/float32"
    if x.dim() != 5:
        return REASON_SHAPE
    if x.shape[1] * x.shape[2] * x.shape[3] < min_tokens:
        return REASON_TOKENS
    nl = ff.nonlinearity
    if type(nl) is not nn.SiLU:
        return REASON_SILU
    if nl._forward_hooks or nl._forward_pre_hooks or not no_global_hooks():
        return REASON_HOOKS
    return None


def make_ff_forward(runtime: SanaBlockRuntime, ff: nn.Module, path: str
                    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The wrapper factory of ``ff.forward`` for :meth:`PatchRecorder.wrap_forward` (counts go to ``path``)."""
    counts = runtime.block_counts(path)

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(hidden_states: torch.Tensor) -> torch.Tensor:
            if runtime.kernels.pending():  # the block's fallback counted it
                return original(hidden_states)
            reason = glu_reason(hidden_states, ff, runtime.min_tokens)
            if reason is not None:
                runtime.counters.fallback(path, "glu: " + reason)
                return original(hidden_states)
            rid = current_request_id()
            if rid != counts.rid:
                runtime.counters.switch(counts, rid)
            return ff_forward(ff, hidden_states, lambda: runtime.glu_fused(counts.counts),
                              lambda why: runtime.counters.fallback(path, "glu: " + why))

        return forward

    return make


def fused_gate(h: torch.Tensor, gate: torch.Tensor, nonlinearity: nn.Module, fused: Callable[[], None],
               fallback: Callable[[str], None]) -> torch.Tensor:
    """``h * nonlinearity(gate)``: the kernel when the halves fit, else eager's expression (with ``fallback``)."""
    reason = silu_gate_reason(h, gate)
    if reason is None:
        try:
            out = silu_gate(h, gate)
        except ValueError as exc:  # a layout the kernel does not index (more than three row dimensions)
            reason = str(exc)
        else:
            fused()
            return out
    fallback(reason)
    return h * nonlinearity(gate)


def ff_forward(ff: nn.Module, hidden_states: torch.Tensor, fused: Callable[[], None],
               fallback: Callable[[str], None]) -> torch.Tensor:
    """``GLUMBTempConv.forward`` of diffusers 0.42, operation for operation, with the gated SiLU fused."""
    if ff.residual_connection:
        residual = hidden_states
    batch_size, num_frames, height, width, num_channels = hidden_states.shape
    hidden_states = hidden_states.view(batch_size * num_frames, height, width, num_channels).permute(0, 3, 1, 2)

    hidden_states = ff.conv_inverted(hidden_states)
    hidden_states = ff.nonlinearity(hidden_states)

    hidden_states = ff.conv_depth(hidden_states)
    hidden_states, gate = torch.chunk(hidden_states, 2, dim=1)
    hidden_states = fused_gate(hidden_states, gate, ff.nonlinearity, fused, fallback)

    hidden_states = ff.conv_point(hidden_states)

    hidden_states_temporal = hidden_states.view(batch_size, num_frames, num_channels, height * width).permute(
        0, 2, 1, 3)
    hidden_states = hidden_states_temporal + ff.conv_temp(hidden_states_temporal)
    hidden_states = hidden_states.permute(0, 2, 3, 1).view(batch_size, num_frames, height, width, num_channels)

    if ff.norm_type == "rms_norm":
        hidden_states = ff.norm(hidden_states.movedim(1, -1)).movedim(-1, 1)

    if ff.residual_connection:
        hidden_states = hidden_states + residual

    return hidden_states


def precompile_glu(ff: nn.Module, x: torch.Tensor, frames: int | None, height: int | None, width: int | None,
                   min_tokens: int) -> None:
    """Issue the ``glu`` launch the block's first feed-forward will make (inside a ``precompile()`` block).

    The halves are built as eager's ``conv_depth`` output on a channels-last input gives them (channels-last);
    nothing is issued when the feed-forward would fall back.
    """
    bsz, s, c = x.shape
    if not (frames and height and width) or frames * height * width != s:
        return
    like = torch.empty((bsz, frames, height, width, c), dtype=x.dtype, device=x.device)
    conv = getattr(ff, "conv_depth", None)
    if glu_reason(like, ff, min_tokens) is not None or not isinstance(conv, nn.Conv2d):
        return
    full = torch.empty((bsz * frames, conv.out_channels, height, width), dtype=x.dtype, device=x.device,
                       memory_format=torch.channels_last)
    silu_gate(*torch.chunk(full, 2, dim=1))


__all__ = ["KERNEL_DEVICES", "ff_forward", "fused_gate", "glu_reason", "make_ff_forward", "precompile_glu"]
