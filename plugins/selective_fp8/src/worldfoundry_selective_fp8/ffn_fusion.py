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

from typing import Final

import torch

from worldfoundry.core.acceleration.ffn_structure import FusableFFN, FusedFFNForward, skip_messages, plan_ffn_fusion
from worldfoundry.core.acceleration.kernels.dispatch import (
    gelu_quantize_activations_rowwise_fp8,
)
from worldfoundry.core.acceleration.quantization.fp8_linear import scaled_mm_rowwise

#: ``ledger.executed`` kind of one fused FFN call (recorded on the FFN path).
FUSED_KIND: Final = "fp8_gelu_fused"
#: Counter bumped when the fused producer ran the torch reference (GELU + quantization) instead of the kernel.
GELU_REFERENCE_COUNTER: Final = "gelu_quant_torch_reference"
_MESSAGES: Final = skip_messages("fp8_gelu_fusion")
SKIP_HOOKS: Final = _MESSAGES["hooks"]
SKIP_DROPOUT: Final = _MESSAGES["dropout"]
SKIP_ARGUMENTS: Final = _MESSAGES["arguments"]
SKIP_APPROXIMATE: Final = _MESSAGES["approximate"]


class FusedFFN(FusedFFNForward):
    """The replacement forward of one :class:`FusableFFN`, sharing the plugin's runtime and ledger."""

    PREFIX = "fp8_gelu_fusion"

    def linears_run(self, x: torch.Tensor) -> bool:
        """Both Linears run FP8 for this input (guards verified first)."""
        runtime = self.runtime
        runtime.guard.verify(self.plan.up_path)
        runtime.guard.verify(self.plan.down_path)
        if runtime.fallback_reason(self.up, x) is not None:
            return False
        rows = x.numel() // self.up.in_features
        return runtime.call_reason(self.down, x.device, torch.bfloat16, rows, False) is None

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
