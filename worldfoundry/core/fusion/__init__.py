"""Pointwise fusion of DiT block chains: Triton kernels, each with the torch reference it reproduces bitwise.

* :mod:`~worldfoundry.core.fusion.indexing` — 32- or 64-bit offsets, chosen from shapes *and* strides.
* :mod:`~worldfoundry.core.fusion.triton_support` — Triton availability, interpreter mode, launch options.
* :mod:`~worldfoundry.core.fusion.launch` — launch plans that call the compiled kernel's launcher directly once
  Triton compiled it (host cost per launch), and concurrent precompilation of a block's kernel variants.
* :mod:`~worldfoundry.core.fusion.adaln` — AdaLN chains over a ``[B, S, C]`` residual stream: modulation
  (``norm * (1 + scale) + shift`` with the modulation-table add folded in), gated residual and plain residual.
* :mod:`~worldfoundry.core.fusion.rope` — Wan rotary embedding of Q and K in one launch, and SANA-Video's
  ReLU + rotary + float32 casts of the linear self-attention.
* :mod:`~worldfoundry.core.fusion.glu` — SANA-Video's GLU gated SiLU ``h * silu(g)`` over two strided halves.
* :mod:`~worldfoundry.core.fusion.layout` — the output strides eager elementwise ops choose (TensorIterator's rule).

Every kernel performs the operations eager diffusers performs, in the same precision and the same order, with
floating-point contraction disabled (``enable_fp_fusion=False``), so its output is bitwise the eager output.
Reductions (LayerNorm, RMSNorm) are not reproduced: they stay torch calls.
"""
