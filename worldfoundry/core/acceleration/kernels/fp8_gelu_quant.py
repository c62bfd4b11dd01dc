"""Fused FP8 producer for a Linear fed by a GELU: GELU -> bfloat16 -> row amax -> scale -> FP8, one pass.

In a diffusers ``FeedForward`` (Wan: ``GELU(approximate="tanh")`` with ``.proj``, ``Dropout``, ``Linear``) the
down projection's input is the GELU of the up projection's bfloat16 output ``h``. Run densely, that costs a
GELU kernel (read ``h``, write ``g``) and then the activation quantization (read ``g`` again, write FP8). The
fused kernel reads ``h`` once and writes only the FP8 rows and their scales:

.. code-block:: text

    g[r, k]  = bf16(gelu_f32(h[r, k]))      (GELU in float32 math, rounded to bfloat16, computed once)
    (q, scale) = quantize_rowwise_fp8(g)     (the rowwise FP8 definition, bitwise)

:func:`reference_gelu_quantize_rowwise_fp8` is the torch reference of the same function:
``quantize_rowwise_fp8(F.gelu(h, approximate=...))`` -- the activation the dense model produces, quantized.

**The activation is not bitwise torch's GELU.** The kernel's GELU is within ``2**-8 * |gelu(x)| + 2**-20 * |x|``
of the float64 formula (:func:`gelu_float64`) for every normal bfloat16 input -- the bound torch's own bfloat16
GELU meets -- and equals torch's GELU for most, not all, elements (the differences sit where ``1 + tanh``
cancels, for negative inputs; the measured fractions are in ``docs/performance.md``). So the fused
path rounds slightly differently from the per-Linear path
(``F.gelu`` then the quantizer); both are FP8 approximations of the dense model. The quantization step itself is
bitwise: the kernel's FP8 bytes and scales always equal ``quantize_rowwise_fp8`` of the kernel's own activation
(checked on the CPU and on CUDA). The GPU tests and the benchmark record the fraction of bitwise-equal
activations and the largest distance in bfloat16 ulps.

GELU in the kernel, float32:

* ``approximate="tanh"``: ``0.5 * x * (1 + tanh(u))`` with ``u = kBeta * (x + kKappa * x**3)`` equals
  ``x / (1 + exp(-2u))``; the kernel computes ``x / (1 + 2**z)`` with ``z = x * (A + B * x * x)``
  (:data:`GELU_TANH_EXP2_A`, :data:`GELU_TANH_EXP2_B`): one ``ex2``, one approximate reciprocal, a few FMAs --
  about 11 instructions instead of libdevice ``tanhf``'s ~20 plus the formula's. Where torch's float32
  ``tanh(u)`` rounds to -1 (``u <= -9.0109``, i.e. ``z >= 26``) the result is ``-0.0`` as torch's. Inputs below
  ``2**-126`` in magnitude (bfloat16 subnormals) give zero on CUDA (the reciprocal flushes them);
* ``approximate="none"``: ``(x * 0.5) * (1 + erff(x * M_SQRT1_2))`` with libdevice's ``__nv_erff``;

then rounds to bfloat16 to nearest even.

Under the Triton interpreter (CPU tests) there is no libdevice: the tanh form uses the interpreter's ``exp2``
and an IEEE division, ``erf`` the interpreter's, and bfloat16/e4m3 rounding runs in bit arithmetic. Those
activations are within the same bound and equal torch's CPU GELU for most values (the differences again where
``1 + tanh`` cancels in torch; fractions in ``docs/performance.md``).

Example (CPU, with ``TRITON_INTERPRET=1`` set before triton is imported)::

    q, scale = triton_gelu_quantize_rowwise_fp8(torch.randn(4, 64).to(torch.bfloat16), "tanh")
"""

from __future__ import annotations

import struct
from typing import Any, Final

import torch
import torch.nn.functional as F

from worldfoundry.core.acceleration.kernels.fp8_rowwise_quant import (
    ACTIVATION_GELU_ERF,
    ACTIVATION_GELU_TANH,
    TRITON_AVAILABLE,
    check_clip_counter,
    interpreter_enabled,
    launch_rowwise_fp8,
)
from worldfoundry.core.acceleration.quantization.fp8 import quantize_rowwise_fp8
from worldfoundry.errors import QuantizationInputError


def _float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (as a C ``double -> float`` conversion)."""
    return struct.unpack("f", struct.pack("f", value))[0]


#: ``approximate`` values of ``torch.nn.functional.gelu`` that the kernel computes.
GELU_APPROXIMATIONS: Final = ("tanh", "none")
# The C math constants (<cmath>), as double literals.
_M_SQRT2: Final = 1.41421356237309504880
_M_2_SQRTPI: Final = 1.12837916709551257390
_M_SQRT1_2: Final = 0.70710678118654752440
#: ``kBeta = M_SQRT2 * M_2_SQRTPI * 0.5`` (computed in double, then rounded to float32, as the C++ constexpr).
GELU_TANH_BETA: Final = _float32(_M_SQRT2 * _M_2_SQRTPI * 0.5)
#: ``kKappa = 0.044715`` rounded to float32.
GELU_TANH_KAPPA: Final = _float32(0.044715)
#: ``kAlpha = M_SQRT1_2`` rounded to float32 (exact GELU).
GELU_ERF_ALPHA: Final = _float32(_M_SQRT1_2)
_LOG2_E: Final = 1.44269504088896340736
#: The kernel's tanh GELU is ``x / (1 + 2**z)`` with ``z = x * (A + B * x * x) = -2 * log2(e) * u`` and
#: ``u = kBeta * (x + kKappa * x**3)``: ``A = -2 log2(e) kBeta``, ``B = A * kKappa`` (float64, then float32).
GELU_TANH_EXP2_A: Final = _float32(-2.0 * _LOG2_E * _M_SQRT2 * _M_2_SQRTPI * 0.5)
GELU_TANH_EXP2_B: Final = _float32(-2.0 * _LOG2_E * _M_SQRT2 * _M_2_SQRTPI * 0.5 * 0.044715)

_KERNEL_ARGS: Final = {
    "tanh": (ACTIVATION_GELU_TANH, (GELU_TANH_EXP2_A, GELU_TANH_EXP2_B)),
    "none": (ACTIVATION_GELU_ERF, (GELU_ERF_ALPHA, 0.0)),
}


def check_approximate(approximate: Any) -> str:
    """Return ``approximate`` if the kernel supports it.

    Raises:
        QuantizationInputError: not ``"tanh"`` or ``"none"``.
    """
    if approximate not in GELU_APPROXIMATIONS:
        raise QuantizationInputError(
            f"GELU approximate={approximate!r} is not supported; use one of {', '.join(map(repr, GELU_APPROXIMATIONS))}"
        )
    return approximate


def _check_input(h: Any, what: str) -> None:
    if not isinstance(h, torch.Tensor) or h.dtype != torch.bfloat16:
        raise QuantizationInputError(
            f"{what}: expected a bfloat16 tensor (the producer Linear's output), got {getattr(h, 'dtype', type(h))!r}"
        )
    if h.dim() < 1 or h.shape[-1] == 0:
        raise QuantizationInputError(f"{what}: empty last dimension in shape {tuple(h.shape)}")


def reference_gelu_quantize_rowwise_fp8(
    h: torch.Tensor, approximate: str = "tanh", *, return_activation: bool = False
) -> tuple[torch.Tensor, ...]:
    """Torch reference of the fused producer: ``quantize_rowwise_fp8(F.gelu(h, approximate=approximate))``.

    Args:
        h: bfloat16 tensor ``[..., K]`` (the up projection's output), any device.
        approximate: ``"tanh"`` or ``"none"``.
        return_activation: also return the bfloat16 GELU output.

    Returns:
        ``(q, scale)`` as :func:`~worldfoundry.core.acceleration.quantization.fp8.quantize_rowwise_fp8`, plus
        the activation when ``return_activation``.

    Raises:
        QuantizationInputError: not bfloat16, empty last dimension or unsupported ``approximate``.
    """
    _check_input(h, "reference_gelu_quantize_rowwise_fp8")
    check_approximate(approximate)
    g = F.gelu(h, approximate=approximate)
    q, scale = quantize_rowwise_fp8(g)
    return (q, scale, g) if return_activation else (q, scale)


def gelu_float64(h: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GELU of ``h`` in float64 math (the exact function the bfloat16 activation approximates).

    Args:
        h: float tensor.
        approximate: ``"tanh"`` (the tanh formula, exactly) or ``"none"`` (``x * Phi(x)``).

    Returns:
        float64 tensor.
    """
    check_approximate(approximate)
    x = h.to(torch.float64)
    if approximate == "tanh":
        return 0.5 * x * (1.0 + torch.tanh(_M_SQRT2 * _M_2_SQRTPI * 0.5 * (x + 0.044715 * x * x * x)))
    return 0.5 * x * (1.0 + torch.erf(x * _M_SQRT1_2))


def bfloat16_ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance between two bfloat16 tensors in units in the last place (0 = bitwise equal).

    The bit patterns are mapped onto an ordered integer line (``-0.0`` and ``+0.0`` both map to 0), so the
    distance counts the representable bfloat16 values between ``a`` and ``b``. NaNs are not special-cased.

    Returns:
        int32 tensor of the broadcast shape.
    """
    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.to(torch.bfloat16).contiguous().view(torch.int16).to(torch.int32)
        magnitude = bits & 0x7FFF
        return torch.where(bits < 0, -magnitude, magnitude)

    return (ordered(a) - ordered(b)).abs()


def triton_gelu_quantize_rowwise_fp8(
    h: torch.Tensor,
    approximate: str = "tanh",
    *,
    clip_counter: torch.Tensor | None = None,
    software_rounding: bool | None = None,
    portable_math: bool | None = None,
    return_activation: bool = False,
    config: dict[str, Any] | None = None,
    inv_smooth: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """GELU + rowwise FP8 quantization of ``h`` in one Triton kernel (one read of ``h``).

    Args:
        h: bfloat16 tensor ``[..., K]`` on a CUDA device (or on the CPU with ``TRITON_INTERPRET=1``); rows may
            be strided.
        approximate: ``"tanh"`` or ``"none"``, as ``torch.nn.functional.gelu``.
        clip_counter: optional one-element int32 tensor on ``h``'s device; clipped elements are added.
        software_rounding: bfloat16/e4m3 rounding in bit arithmetic (default: only under the interpreter).
        portable_math: tanh/erf without libdevice (default: only under the interpreter).
        return_activation: also write and return the bfloat16 GELU output (tests and benchmarks; costs the
            write the fusion saves).
        config: optional ``{"BLOCK_M", "num_warps"}`` override (benchmark sweeps; same bytes for any value).
        inv_smooth: optional float32 ``[K]`` multiplied into the GELU output before quantization (SVDQuant's
            ``1 / λ`` of the next Linear).

    Returns:
        ``(q, scale)``: float8_e4m3fn of ``h``'s shape and float32 scales ``[..., 1]``; plus the activation when
        ``return_activation``.

    Raises:
        QuantizationInputError: triton missing, CPU tensor without the interpreter, not bfloat16, empty rows,
            unsupported ``approximate`` or a bad ``clip_counter``.
    """
    if not TRITON_AVAILABLE:
        raise QuantizationInputError("triton is not installed; install the 'triton' extra or use the torch reference")
    _check_input(h, "triton_gelu_quantize_rowwise_fp8")
    activation, constants = _KERNEL_ARGS[check_approximate(approximate)]
    if h.device.type != "cuda" and not interpreter_enabled():
        raise QuantizationInputError(
            f"triton_gelu_quantize_rowwise_fp8: tensor on {h.device}; the kernel needs a CUDA device "
            "(or TRITON_INTERPRET=1 for CPU tests)"
        )
    check_clip_counter(clip_counter, h)
    q, scale, g = launch_rowwise_fp8(
        h, activation=activation, constants=constants, clip_counter=clip_counter,
        software_rounding=software_rounding, portable_math=portable_math, store_activation=return_activation,
        config=config, inv_smooth=inv_smooth,
    )
    return (q, scale, g) if return_activation else (q, scale)


__all__ = [
    "GELU_APPROXIMATIONS",
    "GELU_ERF_ALPHA",
    "GELU_TANH_BETA",
    "GELU_TANH_EXP2_A",
    "GELU_TANH_EXP2_B",
    "GELU_TANH_KAPPA",
    "bfloat16_ulp_distance",
    "check_approximate",
    "gelu_float64",
    "reference_gelu_quantize_rowwise_fp8",
    "triton_gelu_quantize_rowwise_fp8",
]
