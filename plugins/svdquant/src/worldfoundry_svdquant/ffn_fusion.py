"""Producer fusion of ``svdquant`` (W4F8): the FFN down projection's GELU, smoothing and FP8 quantization in one
kernel.

When both Linears of a diffusers ``FeedForward`` (``net.0.proj`` and ``net.2``, structure checked by
:func:`~worldfoundry.core.acceleration.ffn_structure.plan_ffn_fusion`) run the W4F8 backend, the FFN's forward is
replaced (through the :class:`PatchRecorder`, undone exactly) by:

.. code-block:: text

    h = W4F8 Linear of net.0.proj                                  (bfloat16 out, bias in the GEMM)
    A, s = GELU + (1 / λ) + per-token FP8 of h, then the appended  (one pass over h: no bfloat16 GELU output
           low-rank codes from those codes                          is written, no separate quantizer)
    y = torch._scaled_mm(A, B.T) + bias                            (net.2)

The receipt gets ``w4f8`` for both Linears and ``w4f8_gelu_fused`` for the FFN path. The kernel's GELU is within a
stated bound of the exact formula but not bitwise torch's ``F.gelu`` on CUDA
(:mod:`~worldfoundry.core.acceleration.kernels.fp8_gelu_quant`). A call runs the original ``FeedForward.forward``
instead -- each Linear then takes its own path and records it -- when a Linear would not run W4F8 (its
preparation refused the weight, an input needing gradients or on another device), when extra arguments are
passed, a dropout is active, hooks sit on the inner modules (or global module hooks exist), or the GELU's
``approximate`` was changed to a form the kernel does not compute; the receipt then counts
``skipped["w4f8_gelu_fusion: ..."]`` (not for the per-Linear reasons, which the Linears record).
"""

from __future__ import annotations

from typing import Final

import torch

from worldfoundry.core.acceleration.ffn_structure import FusableFFN, FusedFFNForward, skip_messages
from worldfoundry.core.acceleration.kernels.fp8_gelu_quant import _KERNEL_ARGS
from worldfoundry.core.acceleration.kernels.w4f8_scaled_mm import activation_operand, scaled_mm_w4f8

#: ``ledger.executed`` kind of one fused FFN call (recorded on the FFN path).
FUSED_KIND: Final = "w4f8_gelu_fused"
_MESSAGES: Final = skip_messages("w4f8_gelu_fusion")
SKIP_HOOKS: Final = _MESSAGES["hooks"]
SKIP_DROPOUT: Final = _MESSAGES["dropout"]
SKIP_ARGUMENTS: Final = _MESSAGES["arguments"]
SKIP_APPROXIMATE: Final = _MESSAGES["approximate"]


class FusedW4F8FFN(FusedFFNForward):
    """The replacement forward of one :class:`FusableFFN`, sharing the plugin's runtime and ledger."""

    PREFIX = "w4f8_gelu_fusion"

    def linears_run(self, x: torch.Tensor) -> bool:
        """Both Linears run W4F8 for this input."""
        if self.up.backend != "w4f8" or self.down.backend != "w4f8" or x.device != self.up.weight.device:
            return False
        return self.runtime.dense_reason(self.up, x) is None

    def run(self, x: torch.Tensor) -> torch.Tensor:
        runtime, up, down = self.runtime, self.up, self.down
        if runtime.guard is not None:
            runtime.guard.verify(up.path)
            runtime.guard.verify(down.path)
        fast = runtime.options.fast_accum
        x2d = x.reshape(-1, up.weight.in_features)
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        one = runtime.options.one_launch_operand
        h = scaled_mm_w4f8(x2d, up.weight, up.scaled, up.linear.bias, use_fast_accum=fast, one_launch=one)
        activation, constants = _KERNEL_ARGS[self.plan.activation.approximate]
        pair = activation_operand(h, down.weight, down.scaled, activation=activation, constants=constants,
                                  one_launch=one)
        out = scaled_mm_w4f8(h, down.weight, down.scaled, down.linear.bias, use_fast_accum=fast,
                             activation_operand_pair=pair)
        runtime.ledger.executed(up.path, "w4f8")
        runtime.ledger.executed(down.path, "w4f8")
        runtime.ledger.executed(self.plan.claim, FUSED_KIND)
        return out.to(x.dtype).reshape(*x.shape[:-1], down.weight.out_features)


__all__ = ["FUSED_KIND", "SKIP_APPROXIMATE", "SKIP_ARGUMENTS", "SKIP_DROPOUT", "SKIP_HOOKS", "FusedW4F8FFN"]
