"""Checks each operand of the cuBLAS W4F8 path on the GPU against the torch reference (one Linear per W81 FFN
shape): expansion, activation codes, appended low-rank codes, and ``torch._scaled_mm`` against an FP32 product of
the same operands; prints the range of the low-rank scaling.

Usage::

    python benchmarks/kernels/w4f8_debug.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worldfoundry.core.acceleration.kernels import w4f8_scaled_mm as S
from worldfoundry.core.acceleration.kernels.svdquant_dispatch import lowrank_down, pad_rank
from worldfoundry.core.acceleration.quantization.fp8 import quantize_rowwise_fp8
from worldfoundry.core.acceleration.quantization.int4_packing import unpack_int4
from worldfoundry.core.acceleration.quantization.int8_activation import smoothed_rows
from worldfoundry.core.acceleration.quantization.svdquant_numerics import decompose, w4f8_linear_reference


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main() -> None:
    dev = torch.device("cuda")
    for m, k, n in ((4096, 1536, 8960), (4096, 8960, 1536)):
        g = torch.Generator(device=dev).manual_seed(k + n)
        w = (torch.randn(n, k, generator=g, device=dev) * 0.02).to(torch.bfloat16)
        x = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
        x[:, :: max(1, k // 16)] *= 8.0
        sq = pad_rank(decompose(w, rank=32, group_size=0, act_absmax=x.float().abs().amax(0), svd="randomized"))
        try:
            prep = S.prepare_scaled_mm(sq)
        except Exception as exc:
            print(k, n, "prepare:", exc)
            continue
        print(k, n, "alpha", prep.alpha[:4].tolist(), "scale_b", prep.scale_b.flatten()[:4].tolist())
        a, s = S.activation_operand(x, sq, prep)
        bw = S.weight_operand(sq, prep)
        codes = unpack_int4(sq.qweight, 0)
        step = torch.exp2(prep.exponents.float())[:, None]
        print("  expand equal:", bool(torch.equal(bw[:, :k].float() * step, codes.float())),
              "max diff", float((bw[:, :k].float() * step - codes.float()).abs().max()))
        qr, sr = quantize_rowwise_fp8(smoothed_rows(x, sq.inv_smooth))
        print("  act codes equal:", bool(torch.equal(a[:, :k].view(torch.uint8), qr.view(torch.uint8))),
              "scales equal:", bool(torch.equal(s, sr)))
        t = lowrank_down(x, sq).float()
        av = (a[:, :k].float() @ prep.down_hat.float().t()) / prep.alpha[None, :]
        head = av.clamp(-448, 448).to(torch.float8_e4m3fn)
        r = prep.rank
        tail = ((av.clamp(-448, 448) - head.float()) * 16).to(torch.float8_e4m3fn)
        print("  appended a tail equal:", bool(torch.equal(a[:, k + r:k + 2 * r].view(torch.uint8),
                                                            tail.view(torch.uint8))))
        print("  appended a head equal:", bool(torch.equal(a[:, k:k + r].view(torch.uint8), head.view(torch.uint8))),
              "rel", rel(a[:, k:k + r].float(), av), " third block equal head:",
              bool(torch.equal(a[:, k + 2 * r:].view(torch.uint8), head.view(torch.uint8))))
        print("  appended u equal:", bool(torch.equal(bw[:, k:].view(torch.uint8), prep.up_codes.view(torch.uint8))),
              "exponents", None if getattr(prep, "exponents", None) is None else prep.exponents.unique().tolist())
        lr_exact = t @ sq.lora_up.float().t()
        lr_codes = (a[:, k:].float() @ bw[:, k:].float().t()) * s * prep.scale_b
        print("  low-rank from appended codes rel:", rel(lr_codes, lr_exact))
        emu = (a.float() @ bw.float().t()) * s * prep.scale_b
        for fast in (False, True):
            y = torch._scaled_mm(a, bw.t(), scale_a=s, scale_b=prep.scale_b, out_dtype=torch.bfloat16,
                                 use_fast_accum=fast)
            print("  _scaled_mm fast=%s vs fp32 emulation rel:" % fast, rel(y, emu))
        ref = w4f8_linear_reference(x, sq, None, lowrank_from_codes=True).float()
        print("  emulation vs reference rel:", rel(emu, ref), " reference vs bf16:", rel(ref, F.linear(x, w)))


if __name__ == "__main__":
    main()
