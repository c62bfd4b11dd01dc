"""The Q/K RMSNorm + rotary kernel on CUDA: bitwise eager (``F.rms_norm`` + the processor's rotary, and diffusers'
own ``WanAttnProcessor``) at the Wan W17 and W81 shapes with Wan's float64 frequencies, in both dtypes, with float32
and per-sample frequencies, on forced and real 64-bit indexing. Skipped without CUDA and triton."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worldfoundry.core.fusion import qk_norm_rope
from worldfoundry.core.fusion.qk_norm_rope import reason, reference_rms_norm_rope_qk, rms_norm_rope_qk
from worldfoundry.core.fusion.rope import reference_rope
from worldfoundry.core.fusion.triton_support import TRITON_AVAILABLE, interpreter_enabled

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() and TRITON_AVAILABLE) or interpreter_enabled(),
                                 reason="needs CUDA + triton, without TRITON_INTERPRET")]
BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
#: Wan2.1-T2V-1.3B self-attention: 12 heads of 128; latent frames x height x width of the W17 / W81 workloads
HEADS, HEAD_DIM = 12, 128
LATENTS = {"W17": (5, 40, 72), "W81": (21, 60, 104)}  # 3,600 and 32,760 tokens (patch 1 x 2 x 2)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def _wan_freqs(latent: tuple[int, int, int], d: int = HEAD_DIM) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan's rotary module's (cos, sin), ``[1, S, 1, D]`` float64 (random angles where diffusers is missing)."""
    f, h, w = latent
    try:
        from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed
    except ImportError:
        s = f * (h // 2) * (w // 2)
        angle = torch.rand(1, s, 1, d, dtype=F64, device="cuda") * 1000
        return torch.cos(angle), torch.sin(angle)
    rope = WanRotaryPosEmbed(d, (1, 2, 2), 1024).to("cuda")
    return rope(torch.empty(1, 16, f, h, w, device="cuda"))


def _operands(b: int, s: int, c: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(b, s, c, device="cuda", generator=g) * 3 + 0.25).to(dtype)
    k = (torch.randn(b, s, c, device="cuda", generator=g) * 0.8).to(dtype)
    wq = (torch.randn(c, device="cuda", generator=g) * 0.5 + 1).to(dtype)
    wk = (torch.randn(c, device="cuda", generator=g) * 0.5 + 1).to(dtype)
    return q, k, wq, wk


def _eager(x: torch.Tensor, w: torch.Tensor, eps: float, heads: int, cos: torch.Tensor,
           sin: torch.Tensor) -> torch.Tensor:
    return reference_rope(F.rms_norm(x, (x.shape[-1],), w, eps).unflatten(2, (heads, -1)), cos, sin)


def _check(q, k, wq, wk, eps_q: float, eps_k: float, heads: int, cos, sin, limit: int = 2**31 - 1) -> None:
    assert reason(q, k, wq, wk, cos, sin, heads) is None
    with torch.inference_mode():
        out_q, out_k = rms_norm_rope_qk(q, k, wq, wk, eps_q, eps_k, heads, cos, sin, index_limit=limit)
        eager_q, eager_k = _eager(q, wq, eps_q, heads, cos, sin), _eager(k, wk, eps_k, heads, cos, sin)
    assert out_q.stride() == eager_q.stride() and out_k.stride() == eager_k.stride()
    assert _bits_equal(out_q, eager_q), int((out_q != eager_q).sum())
    assert _bits_equal(out_k, eager_k), int((out_k != eager_k).sum())


@pytest.mark.parametrize("workload", list(LATENTS))
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_wan_shapes_bitwise_to_eager(workload: str, dtype: torch.dtype) -> None:
    cos, sin = _wan_freqs(LATENTS[workload])
    q, k, wq, wk = _operands(1, cos.shape[1], HEADS * HEAD_DIM, dtype, seed=len(workload))
    _check(q, k, wq, wk, 1e-6, 1e-6, HEADS, cos, sin)


def test_w17_through_diffusers_wan_attention_processor(monkeypatch: pytest.MonkeyPatch) -> None:
    """diffusers' own processor (its projections, RMSNorm modules and nested rotary) vs the kernel on the very
    projections it computed."""
    transformer_wan = pytest.importorskip("diffusers.models.transformers.transformer_wan")
    cos, sin = _wan_freqs(LATENTS["W17"])
    c = HEADS * HEAD_DIM
    torch.manual_seed(0)
    attn = transformer_wan.WanAttention(dim=c, heads=HEADS, dim_head=HEAD_DIM, eps=1e-6,
                                        processor=transformer_wan.WanAttnProcessor()).to("cuda", BF16)
    with torch.no_grad():
        attn.norm_q.weight.normal_(1.0, 0.3)
        attn.norm_k.weight.normal_(1.0, 0.3)
    seen: dict[str, torch.Tensor] = {}
    projections = transformer_wan._get_qkv_projections

    def keep_projections(a, hs, ehs):  # noqa: ANN001
        seen["query"], seen["key"], value = projections(a, hs, ehs)
        return seen["query"], seen["key"], value

    def dispatch(q, k, v, **kwargs):  # noqa: ANN001, ANN003
        seen["q"], seen["k"] = q, k
        return q

    monkeypatch.setattr(transformer_wan, "_get_qkv_projections", keep_projections)
    monkeypatch.setattr(transformer_wan, "dispatch_attention_fn", dispatch)
    hidden = torch.randn(1, cos.shape[1], c, device="cuda").to(BF16)
    with torch.inference_mode():
        attn(hidden, rotary_emb=(cos, sin))
        q, k = seen["query"], seen["key"]
        args = (q, k, attn.norm_q.weight, attn.norm_k.weight, cos, sin, HEADS)
        assert reason(*args) is None
        out_q, out_k = rms_norm_rope_qk(q, k, attn.norm_q.weight, attn.norm_k.weight, attn.norm_q.eps,
                                        attn.norm_k.eps, HEADS, cos, sin)
    assert _bits_equal(out_q, seen["q"]) and _bits_equal(out_k, seen["k"])


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_float32_and_per_sample_frequencies_and_two_epsilons(dtype: torch.dtype) -> None:
    """Wan 14B's width (40 heads of 128), a batch of 2 with per-sample float32 frequencies, another head size."""
    g = torch.Generator(device="cuda").manual_seed(3)
    for b, s, heads, d in ((2, 777, 40, 128), (2, 301, 6, 64)):
        angle = torch.rand(b, s, 1, d, dtype=F64, device="cuda", generator=g) * 100
        for freqs in ((torch.cos(angle), torch.sin(angle)), (torch.cos(angle).float(), torch.sin(angle).float()),
                      (torch.cos(angle[:1]), torch.sin(angle[:1]))):
            q, k, wq, wk = _operands(b, s, heads * d, dtype, seed=s)
            _check(q, k, wq, wk, 1e-6, 1e-5, heads, *freqs)


def test_forced_64_bit_indexing_at_w17() -> None:
    cos, sin = _wan_freqs(LATENTS["W17"])
    q, k, wq, wk = _operands(1, cos.shape[1], HEADS * HEAD_DIM, BF16, seed=9)
    qk_norm_rope._PLANS.clear()
    _check(q, k, wq, wk, 1e-6, 1e-6, HEADS, cos, sin, limit=10_000)
    assert next(iter(qk_norm_rope._PLANS.values()))._kwargs["INDEX_64"] is True


def test_reference_with_the_gpus_rsqrt_is_eager_bitwise_at_w17() -> None:
    """The torch reference with ``approx_rsqrt=True`` is eager itself on CUDA (its divisions are by tensors on
    the device: a CUDA tensor divided by a CPU scalar tensor would be multiplied by the inexact reciprocal)."""
    cos, sin = _wan_freqs(LATENTS["W17"])
    q, k, wq, wk = _operands(1, cos.shape[1], HEADS * HEAD_DIM, BF16, seed=5)
    with torch.inference_mode():
        ref_q, ref_k = reference_rms_norm_rope_qk(q, k, wq, wk, 1e-6, 1e-6, HEADS, cos, sin, approx_rsqrt=True)
        for ref, x, w in ((ref_q, q, wq), (ref_k, k, wk)):
            assert _bits_equal(ref, _eager(x, w, 1e-6, HEADS, cos, sin))


@pytest.mark.parametrize("workload", list(LATENTS))
def test_chunks_of_a_fused_qkv_projection_are_read_in_place_bitwise(workload: str) -> None:
    """Q and K as ``optimized_mha`` / diffusers' fused projections hand them over: chunks of one ``[B, S, 3C]``
    output (rows ``3C`` apart); eager's RMSNorm copies them first."""
    cos, sin = _wan_freqs(LATENTS[workload])
    c = HEADS * HEAD_DIM
    packed = (torch.randn(1, cos.shape[1], 3 * c, device="cuda") * 2).to(BF16)
    q, k, _ = packed.chunk(3, dim=-1)
    _, _, wq, wk = _operands(1, 1, c, BF16, seed=9)
    assert not q.is_contiguous() and qk_norm_rope.row_stride(q) == 3 * c
    _check(q, k, wq, wk, 1e-6, 1e-6, HEADS, cos, sin)


def test_past_2_31_elements_takes_the_64_bit_path() -> None:
    s, c = 1_400_000, HEADS * HEAD_DIM  # 2.15e9 elements per tensor: the last rows' offsets exceed int32
    if torch.cuda.get_device_properties(0).total_memory < 60 * 2**30:
        pytest.skip("needs about 40 GB of device memory")
    q = torch.randn(1, s, c, device="cuda", dtype=BF16)
    k = torch.randn(1, s, c, device="cuda", dtype=BF16)
    w = torch.ones(c, device="cuda", dtype=BF16)
    angle = torch.rand(1, s, 1, HEAD_DIM, device="cuda", dtype=F64)
    cos, sin = torch.cos(angle), torch.sin(angle)
    del angle
    qk_norm_rope._PLANS.clear()
    with torch.inference_mode():
        out_q, out_k = rms_norm_rope_qk(q, k, w, w, 1e-6, 1e-6, HEADS, cos, sin)
    assert next(iter(qk_norm_rope._PLANS.values()))._kwargs["INDEX_64"] is True
    tail = slice(s - 4096, s)  # rows are independent: check the far end against eager on those rows
    for x, out in ((q, out_q), (k, out_k)):
        eager = _eager(x[:, tail].contiguous(), w, 1e-6, HEADS, cos[:, tail], sin[:, tail])
        assert _bits_equal(out[:, tail].contiguous(), eager)
    del q, k, out_q, out_k, cos, sin
    torch.cuda.empty_cache()
