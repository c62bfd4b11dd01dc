"""Producer fusion of ``svdquant`` (W4A8): the FFN down projection's GELU, smoothing, INT8 quantization and
low-rank down projection in one kernel.

When both Linears of a diffusers ``FeedForward`` (``net.0.proj`` and ``net.2``, structure checked by
:func:`~worldfoundry.core.acceleration.ffn_structure.plan_ffn_fusion`) run the W4A8 backend on a bfloat16 model,
the FFN's forward is replaced (through the :class:`PatchRecorder`, undone exactly) by:

.. code-block:: text

    h = W4A8 Linear of net.0.proj                          (bfloat16 out, low-rank term and bias in the GEMM)
    q, s, t = GELU + (1 / λ) + per-token INT8 of h,        (one kernel: no bfloat16 GELU output is written,
              and t = GELU(h) @ D.T                         no separate quantizer or low-rank GEMM)
    y = W4A8 GEMM of (q, s, t) with net.2's weight + bias  (Gluon on Hopper for per-channel weights, else Triton)

When ``net.2`` was calibrated without smoothing (``--unsmoothed``), the up projection's GEMM also writes each
row's largest output (its epilogue, an atomic maximum; a reduction after the Triton GEMM), and the producer reads
``h`` **once** with the row scales known in advance (``max(GELU(hmax), 0.171875) / 127``:
:mod:`~worldfoundry.core.acceleration.kernels.int8_gelu_quant`): the receipt then also counts
``w4a8_gelu_single_pass`` on the FFN. A smoothed ``net.2`` takes the two-pass producer.

The receipt gets each Linear's backend (``w4a8`` or ``w4a8_gluon``) and ``w4a8_gelu_fused`` for the FFN path.
The kernel's GELU (:mod:`~worldfoundry.core.acceleration.kernels.int8_gelu_quant`) is within a stated bound of
the exact formula, not bitwise torch's ``F.gelu``. A call runs the original ``FeedForward.forward`` instead --
each Linear then takes its own path and records it -- when a Linear would not run W4A8 for this input (needs
gradients, another device), the input is not bfloat16 (the kernel's GELU rounds to bfloat16 as a bfloat16
model's does), the down projection has no low-rank branch, when extra arguments are passed, a dropout is active,
hooks sit on the inner modules (or global module hooks exist), or the GELU's ``approximate`` was changed to a
form the kernel does not compute; the receipt then counts ``skipped["w4a8_gelu_fusion: ..."]`` (not for the
per-Linear reasons, which the Linears record).
"""

from __future__ import annotations

from typing import Final

import torch

from worldfoundry.core.acceleration.ffn_structure import FusedFFNForward, skip_messages
from worldfoundry.core.acceleration.kernels.int8_gelu_quant import triton_gelu_quantize_rows_int8_lowrank
from worldfoundry.core.acceleration.kernels.svdquant_dispatch import (
    BackendChoice,
    choose_backend,
    svdquant_linear,
    w4a8_gemm_from_codes,
)

#: ``ledger.executed`` kind of one fused FFN call (recorded on the FFN path).
FUSED_KIND_W4A8: Final = "w4a8_gelu_fused"
#: ``ledger.executed`` kind of a fused FFN call whose producer read ``h`` once (row maxima from the up GEMM).
SINGLE_PASS_KIND: Final = "w4a8_gelu_single_pass"
PREFIX: Final = "w4a8_gelu_fusion"
_MESSAGES: Final = skip_messages(PREFIX)
SKIP_NOT_BF16: Final = f"{PREFIX}: input not bfloat16"


class FusedW4A8FFN(FusedFFNForward):
    """The replacement forward of one :class:`~worldfoundry.core.acceleration.ffn_structure.FusableFFN` whose
    Linears run W4A8, sharing the plugin's runtime and ledger."""

    PREFIX = PREFIX

    def __init__(self, runtime, plan) -> None:  # noqa: ANN001 - the base class's arguments
        super().__init__(runtime, plan)
        self.w4a8 = all(choose_backend(t.weight.device, t.backend, t.weight.group_size).backend == "w4a8"
                        for t in (self.up, self.down))

    def linears_run(self, x: torch.Tensor) -> bool:
        """Both Linears run W4A8 for this input (the down projection has a low-rank branch)."""
        if not self.w4a8 or x.device != self.up.weight.device or self.down.weight.lora_down is None:
            return False
        return self.runtime.dense_reason(self.up, x) is None

    def skip_reason(self, x: torch.Tensor, args: tuple, kwargs: dict) -> str | None:
        reason = super().skip_reason(x, args, kwargs)
        if reason is None and x.dtype != torch.bfloat16:
            return SKIP_NOT_BF16
        return reason

    def run(self, x: torch.Tensor) -> torch.Tensor:
        runtime, up, down = self.runtime, self.up, self.down
        if runtime.guard is not None:
            runtime.guard.verify(up.path)
            runtime.guard.verify(down.path)
        single = down.weight.inv_smooth is None
        rows = x.numel() // up.weight.in_features
        row_max = torch.zeros(rows, dtype=torch.float32, device=x.device) if single else None
        h, up_ran = svdquant_linear(x, up.weight, up.linear.bias, backend="w4a8", row_max=row_max)
        h2d = h.reshape(-1, up.weight.out_features)
        q, scale, t = triton_gelu_quantize_rows_int8_lowrank(h2d, self.plan.activation.approximate,
                                                             down.weight.inv_smooth, down.weight.lora_down,
                                                             row_max=row_max)
        out, down_ran = w4a8_gemm_from_codes(q, scale, down.weight, t, down.linear.bias, x.dtype,
                                             BackendChoice("w4a8"))
        runtime.ledger.executed(up.path, up_ran.backend)
        runtime.ledger.executed(down.path, down_ran.backend)
        runtime.ledger.executed(self.plan.claim, FUSED_KIND_W4A8)
        if single:
            runtime.ledger.executed(self.plan.claim, SINGLE_PASS_KIND)
        for ran in (up_ran, down_ran):
            if ran.reason:
                runtime.ledger.count("backend_reason: " + ran.reason)
        return out.reshape(*x.shape[:-1], down.weight.out_features)


__all__ = ["FUSED_KIND_W4A8", "SINGLE_PASS_KIND", "SKIP_NOT_BF16", "FusedW4A8FFN"]
