"""Triton kernels, each with a torch reference of the same function beside it.

* :mod:`~worldfoundry.core.acceleration.kernels.fp8_rowwise_quant` — fused rowwise FP8 activation
  quantization (row amax -> scale -> cast in one pass).
* :mod:`~worldfoundry.core.acceleration.kernels.fp8_gelu_quant` — fused GELU producer: GELU -> bfloat16 ->
  rowwise FP8 in one pass (the down projection input of a GELU feed-forward), reference: torch's GELU.
* :mod:`~worldfoundry.core.acceleration.kernels.dispatch` — picks the kernel on CUDA and the torch reference
  elsewhere, reporting why.

Import the submodules directly; this package imports nothing so that it never cycles with
:mod:`worldfoundry.core.acceleration.quantization`.
"""
